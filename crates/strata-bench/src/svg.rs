//! Line charts as standalone SVG (no scripts, no external resources): inlined in the HTML
//! report and written as files for the docs.
use std::fmt::Write;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 380.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
pub const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub color: &'static str,
    pub dashed: bool,
}

pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub series: Vec<Series>,
    /// Fixed y range (for shares and ratios); None fits the data from 0.
    pub y_max: Option<f64>,
}

pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// About five round tick values from 0 to at least `max`.
pub fn ticks(max: f64) -> Vec<f64> {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| s * 5.0 >= max)
        .unwrap_or(10.0 * mag);
    let n = (max / step).ceil() as usize;
    (0..=n).map(|i| i as f64 * step).collect()
}

fn label(v: f64) -> String {
    if v >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if v >= 1e4 {
        format!("{}k", trim(v / 1e3))
    } else {
        trim(v)
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

impl Chart<'_> {
    pub fn render(&self) -> String {
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (x_max, y_data) = pts.fold((0f64, 0f64), |(x, y), p| (x.max(p.0), y.max(p.1)));
        let x_ticks = ticks(x_max);
        let y_ticks = ticks(self.y_max.unwrap_or(y_data));
        let (xm, ym) = (
            *x_ticks.last().unwrap_or(&1.0),
            *y_ticks.last().unwrap_or(&1.0),
        );
        let (pw, ph) = (WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM);
        let sx = |x: f64| LEFT + x / xm * pw;
        let sy = |y: f64| TOP + ph - (y / ym).min(1.05) * ph;
        let mut o = String::new();
        let _ = write!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = write!(
            o,
            r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="20" font-size="14" font-weight="bold">{}</text>"#,
            LEFT,
            escape(self.title)
        );
        for t in &x_ticks {
            let x = sx(*t);
            let _ = write!(
                o,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + ph,
                TOP + ph + 16.0,
                label(*t)
            );
        }
        for t in &y_ticks {
            let y = sy(*t);
            let _ = write!(
                o,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
                label(*t)
            );
        }
        let _ = write!(
            o,
            r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
        );
        let _ = write!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            HEIGHT - 10.0,
            escape(self.x_label)
        );
        let _ = write!(
            o,
            r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + ph / 2.0,
            escape(self.y_label)
        );
        for (i, s) in self.series.iter().enumerate() {
            let path: Vec<String> = s
                .points
                .iter()
                .map(|p| format!("{:.1},{:.1}", sx(p.0), sy(p.1)))
                .collect();
            let dash = if s.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            };
            let _ = write!(
                o,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
                path.join(" "),
                s.color
            );
            for p in &s.points {
                let _ = write!(
                    o,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{}"/>"#,
                    sx(p.0),
                    sy(p.1),
                    s.color
                );
            }
            let ly = TOP + 14.0 + 16.0 * i as f64;
            let lx = LEFT + pw - 230.0;
            let _ = write!(
                o,
                r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="2"{dash}/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
                ly - 4.0,
                lx + 20.0,
                ly - 4.0,
                s.color,
                lx + 26.0,
                escape(&s.name)
            );
        }
        o.push_str("</svg>");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(9.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(100.0), vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(*ticks(12_345.0).last().unwrap(), 12_500.0);
        assert_eq!(ticks(0.0).len(), 6);
    }

    #[test]
    fn a_chart_is_one_svg_with_every_series() {
        let chart = Chart {
            title: "a <b>",
            x_label: "IOPS",
            y_label: "ms",
            series: vec![
                Series {
                    name: "p99".into(),
                    points: vec![(1.0, 2.0), (2.0, 3.0)],
                    color: COLORS[0],
                    dashed: false,
                },
                Series {
                    name: "mean".into(),
                    points: vec![(1.0, 1.0)],
                    color: COLORS[1],
                    dashed: true,
                },
            ],
            y_max: None,
        };
        let svg = chart.render();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a &lt;b&gt;"));
        assert!(!svg.contains("<script"));
    }
}

//! A writer for the Prometheus text exposition format (version 0.0.4): families with HELP and
//! TYPE, labelled samples, histograms with cumulative `le` buckets. Small on purpose: the
//! daemon renders a fresh snapshot per scrape, so no registry of live metric objects is needed.
use std::fmt::Write;

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Type {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Default)]
pub struct Exposition {
    out: String,
}

pub type Labels<'a> = &'a [(&'a str, &'a str)];

impl Exposition {
    /// Starts a family; the samples that follow until the next family belong to it.
    pub fn family(&mut self, name: &str, kind: Type, help: &str) -> &mut Self {
        let kind = match kind {
            Type::Counter => "counter",
            Type::Gauge => "gauge",
            Type::Histogram => "histogram",
        };
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        self
    }

    pub fn sample(&mut self, name: &str, labels: Labels, value: f64) -> &mut Self {
        self.out.push_str(name);
        write_labels(&mut self.out, labels, None);
        let _ = writeln!(self.out, " {}", number(value));
        self
    }

    /// One family with a single unlabelled sample.
    pub fn single(&mut self, name: &str, kind: Type, help: &str, value: f64) -> &mut Self {
        self.family(name, kind, help).sample(name, &[], value)
    }

    /// The series of one histogram: `bounds` in the metric's unit, `cumulative` with one more
    /// entry than `bounds` (the `+Inf` bucket, equal to the count).
    pub fn histogram(
        &mut self,
        name: &str,
        labels: Labels,
        bounds: &[f64],
        cumulative: &[u64],
        sum: f64,
    ) -> &mut Self {
        debug_assert_eq!(cumulative.len(), bounds.len() + 1);
        let bucket = format!("{name}_bucket");
        for (i, &c) in cumulative.iter().enumerate() {
            let le = bounds.get(i).map_or("+Inf".to_string(), |&b| number(b));
            self.out.push_str(&bucket);
            write_labels(&mut self.out, labels, Some(&le));
            let _ = writeln!(self.out, " {c}");
        }
        let count = cumulative.last().copied().unwrap_or(0);
        self.sample(&format!("{name}_sum"), labels, sum);
        self.sample(&format!("{name}_count"), labels, count as f64)
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn write_labels(out: &mut String, labels: Labels, le: Option<&str>) {
    if labels.is_empty() && le.is_none() {
        return;
    }
    out.push('{');
    let mut first = true;
    let all = labels.iter().copied().chain(le.map(|v| ("le", v)));
    for (k, v) in all {
        if !first {
            out.push(',');
        }
        first = false;
        let v = v
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        let _ = write!(out, "{k}=\"{v}\"");
    }
    out.push('}');
}

/// Integers without a fraction, others in Rust's shortest round-trip form; NaN and infinities
/// as Prometheus spells them.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_samples_and_escaping() {
        let mut e = Exposition::default();
        e.family("strata_x_total", Type::Counter, "X done.\nTwice")
            .sample("strata_x_total", &[("volume", "a\"b\\c")], 3.0)
            .single("strata_fill_ratio", Type::Gauge, "Fill.", 0.25);
        let text = e.finish();
        assert_eq!(
            text,
            "# HELP strata_x_total X done.\\nTwice\n# TYPE strata_x_total counter\n\
             strata_x_total{volume=\"a\\\"b\\\\c\"} 3\n\
             # HELP strata_fill_ratio Fill.\n# TYPE strata_fill_ratio gauge\nstrata_fill_ratio 0.25\n"
        );
    }

    #[test]
    fn histograms_have_cumulative_buckets_sum_and_count() {
        let mut e = Exposition::default();
        e.family("lat_seconds", Type::Histogram, "Latency.");
        e.histogram("lat_seconds", &[("op", "read")], &[0.001, 0.01], &[2, 5, 6], 0.5);
        let text = e.finish();
        assert!(text.contains("lat_seconds_bucket{op=\"read\",le=\"0.001\"} 2\n"), "{text}");
        assert!(text.contains("lat_seconds_bucket{op=\"read\",le=\"0.01\"} 5\n"));
        assert!(text.contains("lat_seconds_bucket{op=\"read\",le=\"+Inf\"} 6\n"));
        assert!(text.contains("lat_seconds_sum{op=\"read\"} 0.5\n"));
        assert!(text.contains("lat_seconds_count{op=\"read\"} 6\n"));
    }

    #[test]
    fn numbers_are_spelled_as_prometheus_reads_them() {
        assert_eq!(number(3.0), "3");
        assert_eq!(number(0.125), "0.125");
        assert_eq!(number(f64::NAN), "NaN");
        assert_eq!(number(f64::INFINITY), "+Inf");
        assert_eq!(number(1e20), "100000000000000000000");
    }
}

//! Device emulation specs: the text of `strata serve --fast-emulate SPEC` and
//! `--capacity-emulate SPEC`, turned into a [`ThrottleConfig`] and a label that names the device
//! as emulated everywhere its name appears (logs, API, dashboard, benchmark reports).
//!
//! A spec is an optional preset followed by `key=value` items, comma-separated:
//! `nand-a,scale=0.02`, `bw=40MB,iops=2000,latency_us=200`. Rates use decimal units, as drive
//! data sheets do: `40MB` and `40M` are 40,000,000 bytes per second. Keys:
//!
//! | key | meaning |
//! | --- | --- |
//! | `bw` | one-way bandwidth (reads or writes alone), bytes/s |
//! | `mixed_bw` | total bandwidth at a 50/50 read/write mix, bytes/s (the NAND penalty) |
//! | `iops` | operations per second |
//! | `latency_us` | latency added to every operation |
//! | `mix_window_ms` | time constant of the read/write mix average |
//! | `scale` | multiplies `bw`, `mixed_bw` and `iops` (applied last, keeps ratios) |
//!
//! Presets carry the full-scale figures of the two cache devices in CONTEXT.md §2; the source
//! gives only their 50/50 totals, so both presets share one one-way bandwidth (the larger 50/50
//! figure) and differ only in the mixed-load penalty, the property the comparison is about.
use crate::throttle::ThrottleConfig;

/// Cache device A of CONTEXT.md §2 (800 GB SAS NAND): 772 MB/s at a 50/50 mix.
pub const PRESET_NAND_A: (&str, u64, u64) = ("nand-a", 1_984_000_000, 772_000_000);
/// Cache device B of CONTEXT.md §2 (Optane P5800X): 1,984 MB/s at a 50/50 mix, no penalty.
pub const PRESET_OPTANE_B: (&str, u64, u64) = ("optane-b", 1_984_000_000, 1_984_000_000);
/// Bounds a spec cannot exceed, so a typo cannot ask for nonsense.
const MAX_SCALE: f64 = 1000.0;
const MAX_LATENCY_US: u64 = 10_000_000;
const MAX_SPEC_LEN: usize = 256;
/// The least bandwidth a spec may set: one 4 KiB block a second. Below it a device does not
/// even get through opening (`bw=40`, a unit left out, never let the daemon start).
const MIN_BANDWIDTH_BYTES_PER_S: u64 = 4096;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid emulation spec {spec:?}: {reason}")]
pub struct EmulationError {
    pub spec: String,
    pub reason: String,
}

/// A parsed spec: the limits, and the label the emulated device carries in its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmulationSpec {
    pub config: ThrottleConfig,
    pub label: String,
}

/// Parses a spec (see the module documentation).
pub fn parse_emulation(spec: &str) -> Result<EmulationSpec, EmulationError> {
    let fail = |reason: String| EmulationError {
        spec: spec.chars().take(MAX_SPEC_LEN).collect(),
        reason,
    };
    if spec.len() > MAX_SPEC_LEN {
        return Err(fail(format!("longer than {MAX_SPEC_LEN} characters")));
    }
    let mut config = ThrottleConfig::default();
    let mut preset = None;
    let mut scale = 1.0f64;
    for (i, item) in spec.split(',').map(str::trim).enumerate() {
        if item.is_empty() {
            return Err(fail("empty item".into()));
        }
        let Some((key, value)) = item.split_once('=') else {
            if i > 0 {
                return Err(fail(format!("{item:?} is not key=value")));
            }
            let (name, bw, mixed) = [PRESET_NAND_A, PRESET_OPTANE_B]
                .into_iter()
                .find(|p| p.0 == item)
                .ok_or_else(|| fail(format!("unknown preset {item:?} (use nand-a or optane-b)")))?;
            config.bandwidth_bytes_per_s = bw;
            config.mixed_bandwidth_bytes_per_s = mixed;
            preset = Some(name);
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        match key {
            "bw" => config.bandwidth_bytes_per_s = parse_rate(value).map_err(fail)?,
            "mixed_bw" => config.mixed_bandwidth_bytes_per_s = parse_rate(value).map_err(fail)?,
            "iops" => config.iops = parse_rate(value).map_err(fail)?,
            "latency_us" => config.latency_us = parse_int(value, MAX_LATENCY_US).map_err(fail)?,
            "mix_window_ms" => config.mix_window_ms = parse_int(value, 60_000).map_err(fail)?,
            "scale" => scale = parse_scale(value).map_err(fail)?,
            _ => return Err(fail(format!(
                "unknown key {key:?} (use bw, mixed_bw, iops, latency_us, mix_window_ms, scale)"
            ))),
        }
    }
    config.bandwidth_bytes_per_s = scaled(config.bandwidth_bytes_per_s, scale);
    config.mixed_bandwidth_bytes_per_s = scaled(config.mixed_bandwidth_bytes_per_s, scale);
    config.iops = scaled(config.iops, scale);
    validate(&config).map_err(fail)?;
    Ok(EmulationSpec {
        label: label(&config, preset, scale),
        config,
    })
}

fn validate(c: &ThrottleConfig) -> Result<(), String> {
    for (key, bw) in [
        ("bw", c.bandwidth_bytes_per_s),
        ("mixed_bw", c.mixed_bandwidth_bytes_per_s),
    ] {
        if bw > 0 && bw < MIN_BANDWIDTH_BYTES_PER_S {
            return Err(format!(
                "{key} of {bw} bytes/s is below {MIN_BANDWIDTH_BYTES_PER_S} (one 4 KiB block a \
                 second); is a unit missing? (40MB is 40,000,000)"
            ));
        }
    }
    if c.mixed_bandwidth_bytes_per_s > 0 {
        if c.bandwidth_bytes_per_s == 0 {
            return Err("mixed_bw needs bw".into());
        }
        if c.mixed_bandwidth_bytes_per_s > c.bandwidth_bytes_per_s {
            return Err("mixed_bw must not exceed bw".into());
        }
    }
    if c.is_unlimited() {
        return Err("it sets no limit (give bw, iops or latency_us, or a preset)".into());
    }
    Ok(())
}

fn scaled(value: u64, scale: f64) -> u64 {
    if value == 0 {
        return 0;
    }
    ((value as f64 * scale).round() as u64).max(1)
}

/// "emulated nand-a x0.02: bw 39.7 MB/s, 50/50 15.4 MB/s".
fn label(c: &ThrottleConfig, preset: Option<&str>, scale: f64) -> String {
    let mut text = String::from("emulated");
    if let Some(p) = preset {
        text.push_str(&format!(" {p}"));
        if scale != 1.0 {
            text.push_str(&format!(" x{scale}"));
        }
    }
    let mut parts = Vec::new();
    if c.bandwidth_bytes_per_s > 0 {
        parts.push(format!(
            "bw {:.1} MB/s",
            c.bandwidth_bytes_per_s as f64 / 1e6
        ));
    }
    if c.mixed_bandwidth_bytes_per_s > 0 && c.mixed_bandwidth_bytes_per_s < c.bandwidth_bytes_per_s
    {
        parts.push(format!(
            "50/50 {:.1} MB/s",
            c.mixed_bandwidth_bytes_per_s as f64 / 1e6
        ));
    }
    if c.iops > 0 {
        parts.push(format!("{} IOPS", c.iops));
    }
    if c.latency_us > 0 {
        parts.push(format!("+{} us", c.latency_us));
    }
    format!("{text}: {}", parts.join(", "))
}

/// "40MB", "40M", "1.5G", "2500", "2.5k" (decimal units).
fn parse_rate(text: &str) -> Result<u64, String> {
    let lower = text.to_ascii_lowercase();
    let trimmed = lower.trim_end_matches("/s").trim_end_matches('b');
    let (number, multiplier) = match trimmed.chars().last() {
        Some('k') => (&trimmed[..trimmed.len() - 1], 1e3),
        Some('m') => (&trimmed[..trimmed.len() - 1], 1e6),
        Some('g') => (&trimmed[..trimmed.len() - 1], 1e9),
        _ => (trimmed, 1.0),
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a rate such as 40MB, 2.5k or 1000"))?;
    let value = value * multiplier;
    if !value.is_finite() || !(0.0..=1e13).contains(&value) {
        return Err(format!("rate {text:?} is out of range"));
    }
    // 0 means no limit: a small rate must not become one by rounding.
    if value > 0.0 && value.round() == 0.0 {
        return Err(format!("rate {text:?} rounds to 0, which means no limit"));
    }
    Ok(value.round() as u64)
}

fn parse_int(text: &str, max: u64) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(v) if v <= max => Ok(v),
        _ => Err(format!("{text:?} is not a whole number up to {max}")),
    }
}

fn parse_scale(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= MAX_SCALE => Ok(v),
        _ => Err(format!(
            "scale {text:?} must be a number above 0 and at most {MAX_SCALE}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_scale_and_keep_their_ratio() {
        let a = parse_emulation("nand-a,scale=0.02").unwrap();
        assert_eq!(a.config.bandwidth_bytes_per_s, 39_680_000);
        assert_eq!(a.config.mixed_bandwidth_bytes_per_s, 15_440_000);
        assert!(a.label.starts_with("emulated nand-a x0.02"), "{}", a.label);
        let b = parse_emulation("optane-b, scale=0.02").unwrap();
        assert_eq!(b.config.mixed_bandwidth_bytes_per_s, 39_680_000);
        let ratio = b.config.mixed_bandwidth_bytes_per_s as f64
            / a.config.mixed_bandwidth_bytes_per_s as f64;
        assert!((ratio - 1984.0 / 772.0).abs() < 1e-3);
        assert!(!b.label.contains("50/50"), "no penalty: {}", b.label);
    }

    #[test]
    fn keys_parse_with_units() {
        let s = parse_emulation("bw=40MB,iops=2.5k,latency_us=200,mixed_bw=10M/s").unwrap();
        assert_eq!(s.config.bandwidth_bytes_per_s, 40_000_000);
        assert_eq!(s.config.iops, 2500);
        assert_eq!(s.config.latency_us, 200);
        assert_eq!(s.config.mixed_bandwidth_bytes_per_s, 10_000_000);
        assert_eq!(
            s.label,
            "emulated: bw 40.0 MB/s, 50/50 10.0 MB/s, 2500 IOPS, +200 us"
        );
    }

    #[test]
    fn bad_specs_are_one_line_errors() {
        for (spec, needle) in [
            ("", "empty item"),
            ("hdd", "unknown preset"),
            ("bw=40MB,nand-a", "not key=value"),
            ("bw=fast", "not a rate"),
            ("bw=-5", "out of range"),
            ("color=red", "unknown key"),
            ("nand-a,scale=0", "scale"),
            ("mixed_bw=10M", "mixed_bw needs bw"),
            ("bw=10M,mixed_bw=20M", "must not exceed"),
            ("mix_window_ms=50", "sets no limit"),
            ("latency_us=99999999999", "whole number"),
            ("bw=40", "is a unit missing"),
            ("bw=10M,mixed_bw=400", "mixed_bw of 400 bytes/s"),
            ("bw=4096,scale=0.5", "below 4096"),
            ("iops=0.4", "rounds to 0"),
            ("bw=0.4,iops=100", "rounds to 0"),
        ] {
            let e = parse_emulation(spec).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec:?}: {e}");
            assert!(!e.contains('\n'));
        }
    }
}

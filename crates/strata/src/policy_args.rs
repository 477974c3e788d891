//! The tiering-policy options of `strata volume create` and `strata volume set-policy`, and
//! their parsers: durations with a unit (`10s`, `30m`, `1h`, `7d`, or `0`), sizes (`64M`),
//! counts; 0 means "no limit" for the I/O limits. Options not given stay out of the request,
//! so the daemon fills them (defaults on create, current values on set-policy).
use clap::{Args, ValueEnum};
use strata_engine::Mode;

use crate::api_policy::PolicyPatch;
use crate::config::parse_size_arg;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// The fast tier is a write buffer, destaged by fill level.
    Cache,
    /// Data stays on the fast tier until it is cold (age and heat), or room is needed.
    Tier,
}

#[derive(Debug, Clone, Default, Args)]
pub struct PolicyArgs {
    /// Tiering mode [default on create: cache].
    #[arg(long, value_enum, value_name = "MODE")]
    pub policy: Option<ModeArg>,
    /// Tier mode: data younger than this stays on the fast tier (e.g. 30m, 1h) [default on create: 1h].
    #[arg(long, value_name = "DURATION", value_parser = parse_seconds)]
    pub tier_min_age: Option<u64>,
    /// Tier mode: data hotter than this (rewrites and reads since it last moved) stays [default on create: 0].
    #[arg(long, value_name = "N")]
    pub tier_max_cold_heat: Option<u8>,
    /// Reads of a 64 KiB region within the window that promote it to the fast tier; 0: never [default on create: 2].
    #[arg(long, value_name = "N")]
    pub promote_after_reads: Option<u32>,
    /// Window in which those reads must fall (e.g. 5m) [default on create: 5m].
    #[arg(long, value_name = "DURATION", value_parser = parse_seconds)]
    pub promote_window: Option<u64>,
    /// Reads continuing a sequential stream longer than this never promote (e.g. 4M) [default on create: 4M].
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    pub promote_sequential_cutoff: Option<u64>,
    /// Requests per second allowed; 0: no limit [default on create: 0].
    #[arg(long, value_name = "N")]
    pub iops_limit: Option<u64>,
    /// Bytes per second allowed (e.g. 64M); 0: no limit [default on create: 0].
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    pub bandwidth_limit: Option<u64>,
    /// Cache mode: writes of 128 KiB or more continuing a sequential stream longer than this go
    /// straight to the capacity tier (e.g. 8M); 0: never [default on create: 0].
    #[arg(long, value_name = "SIZE", value_parser = parse_size_arg)]
    pub sequential_write_cutoff: Option<u64>,
}

impl PolicyArgs {
    /// The options given, as the API's partial policy.
    pub fn patch(&self) -> PolicyPatch {
        PolicyPatch {
            mode: self.policy.map(|m| match m {
                ModeArg::Cache => Mode::Cache,
                ModeArg::Tier => Mode::Tier,
            }),
            tier_min_age_s: self.tier_min_age,
            tier_max_cold_heat: self.tier_max_cold_heat,
            promote_after_reads: self.promote_after_reads,
            promote_window_s: self.promote_window,
            promote_sequential_cutoff_bytes: self.promote_sequential_cutoff,
            iops_limit: self.iops_limit,
            bandwidth_limit_bytes_per_s: self.bandwidth_limit,
            sequential_write_cutoff_bytes: self.sequential_write_cutoff,
        }
    }
}

/// Parses a duration into whole seconds: `0`, or a number with a unit s, m, h or d.
pub fn parse_seconds(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let bad = || format!("invalid duration {text:?}: use a number with a unit, like 10s, 30m, 1h or 7d (or 0)");
    if t == "0" {
        return Ok(0);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let scale: u64 = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("invalid duration {text:?}: too long"))
}

/// "1h", "30m", "90s", "0s": the largest whole unit.
pub fn format_seconds(secs: u64) -> String {
    for (unit, scale) in [("d", 86_400), ("h", 3600), ("m", 60)] {
        if secs > 0 && secs.is_multiple_of(scale) {
            return format!("{}{unit}", secs / scale);
        }
    }
    format!("{secs}s")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_need_a_unit() {
        assert_eq!(parse_seconds("10s"), Ok(10));
        assert_eq!(parse_seconds("30m"), Ok(1800));
        assert_eq!(parse_seconds("1h"), Ok(3600));
        assert_eq!(parse_seconds("2d"), Ok(172_800));
        assert_eq!(parse_seconds("0"), Ok(0));
        for bad in ["", "10", "1x", "h", "-5s", "1.5h", "99999999999999999999d"] {
            assert!(parse_seconds(bad).is_err(), "{bad:?}");
        }
        assert_eq!(format_seconds(3600), "1h");
        assert_eq!(format_seconds(90), "90s");
        assert_eq!(format_seconds(300), "5m");
        assert_eq!(format_seconds(0), "0s");
    }

    #[test]
    fn only_given_options_reach_the_patch() {
        let args = PolicyArgs {
            policy: Some(ModeArg::Tier),
            iops_limit: Some(0),
            ..PolicyArgs::default()
        };
        let p = args.patch();
        assert_eq!(p.mode, Some(Mode::Tier));
        assert_eq!(p.iops_limit, Some(0));
        assert_eq!(p.tier_min_age_s, None);
        assert!(PolicyArgs::default().patch().is_empty());
    }
}

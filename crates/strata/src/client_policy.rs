//! How the CLI shows tiering policies and their figures: the compact policy of `volume list`,
//! the policy and figures lines of `volume info`, and `strata volume set-policy`.
use anyhow::{bail, Result};
use strata_engine::{Mode, Policy};

use crate::api::VolumeJson;
use crate::api_policy::FiguresJson;
use crate::config::format_size;
use crate::policy_args::{format_seconds, PolicyArgs};

impl super::Client {
    /// `strata volume set-policy NAME [options]`: options not given keep their values.
    pub fn set_policy(&self, name: &str, args: &PolicyArgs) -> Result<()> {
        let patch = args.patch();
        if patch.is_empty() {
            // parse_cli refuses this as a usage error; kept for callers that skip it.
            bail!("nothing to change: give at least one policy option (see strata volume set-policy --help)");
        }
        let path = format!(
            "/api/v1/volumes/{}/policy",
            super::path_segment("volume", name)?
        );
        let v = self.call("PUT", &path, Some(serde_json::to_value(&patch)?))?;
        self.print(&v, |v| {
            let v: VolumeJson = serde_json::from_value(v.clone())?;
            let no_cache = self.node_without_read_cache();
            print!("{}", set_policy_text(&v.name, &v.policy, no_cache));
            Ok(())
        })
    }

    /// Whether the daemon's node has no read cache (`--read-cache 0`, or `auto` deciding 0):
    /// then no read is ever promoted, whatever a volume's policy says. False when the node
    /// cannot be asked: only a note of the promote line depends on it.
    pub fn node_without_read_cache(&self) -> bool {
        let node = self.call("GET", "/api/v1/node", None).ok();
        node.and_then(|n| n["read_cache"]["ratio"].as_f64()) == Some(0.0)
    }
}

/// What `set-policy` prints: the policy in one line, then every setting as `volume info`
/// shows it, so whatever option was changed is echoed with its new value.
pub fn set_policy_text(name: &str, p: &Policy, node_without_read_cache: bool) -> String {
    format!(
        "volume {name:?} policy: {}\n{}",
        policy_summary(p),
        policy_lines(p, node_without_read_cache)
    )
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Cache => "cache",
        Mode::Tier => "tier",
    }
}

/// "cache", "tier", with the limits when set: "tier, 500 IOPS, 64 MiB/s".
pub fn policy_summary(p: &Policy) -> String {
    let mut parts = vec![mode_name(p.mode).to_string()];
    if p.iops_limit > 0 {
        parts.push(format!("{} IOPS", p.iops_limit));
    }
    if p.bandwidth_limit_bytes_per_s > 0 {
        parts.push(format!("{}/s", format_size(p.bandwidth_limit_bytes_per_s)));
    }
    parts.join(", ")
}

/// "500 IOPS", or "IOPS unlimited" for 0 (not "none IOPS").
fn limit(value: u64, what: &str, text: impl Fn(u64) -> String) -> String {
    if value == 0 {
        format!("{what} unlimited")
    } else {
        text(value)
    }
}

/// The policy lines of `volume info`; `node_without_read_cache`: the node has no read cache
/// to promote into, which the promote line then says.
pub fn policy_lines(p: &Policy, node_without_read_cache: bool) -> String {
    // A promote cutoff of 0 means none: reads of any stream count.
    let streams = if p.promote_sequential_cutoff_bytes == 0 {
        "sequential streams too".to_string()
    } else {
        format!(
            "not past {} sequential",
            format_size(p.promote_sequential_cutoff_bytes)
        )
    };
    let window = format_seconds(p.promote_window_s);
    let promote = if p.promote_after_reads == 0 {
        format!("never (0 reads; window {window}, {streams} when on)")
    } else {
        // The policy stands, to apply on a node with a read cache; on this one nothing is
        // promoted, which the setting alone would not tell.
        let none_here = match node_without_read_cache {
            true => " (none: the node has no read cache)",
            false => "",
        };
        format!(
            "after {} read(s) within {window}, {streams}{none_here}",
            p.promote_after_reads
        )
    };
    let bypass = match (p.sequential_write_cutoff_bytes, p.mode) {
        (0, _) => "never".to_string(),
        (cutoff, Mode::Cache) => format!("writes of 128K+ past {} sequential", format_size(cutoff)),
        (cutoff, Mode::Tier) => format!(
            "never in tier mode (in cache mode: writes of 128K+ past {} sequential)",
            format_size(cutoff)
        ),
    };
    format!(
        "policy:      {}\ntier when:   older than {} and heat <= {}\npromote:     {}\nbypass log:  {}\nlimits:      {}, {}\n",
        mode_name(p.mode),
        format_seconds(p.tier_min_age_s),
        p.tier_max_cold_heat,
        promote,
        bypass,
        limit(p.iops_limit, "IOPS", |n| format!("{n} IOPS")),
        limit(p.bandwidth_limit_bytes_per_s, "bandwidth", |n| {
            format!("{}/s bandwidth", format_size(n))
        }),
    )
}

/// The figures lines of `volume info`.
pub fn figures_lines(f: &FiguresJson) -> String {
    let hit = f
        .fast_read_hit_ratio
        .map_or_else(|| "- (no reads of stored data yet)".into(), |r| format!("{:.1}%", r * 100.0));
    format!(
        "hit ratio:   {hit} ({} log, {} cached, {} capacity)\npromoted:    {}, kept at destage {}, evicted {}\nbypassed:    {}\nlimited:     {} ms waited\nresidency:   {}\n",
        format_size(f.read_fast_bytes),
        format_size(f.read_cached_bytes),
        format_size(f.read_capacity_bytes),
        format_size(f.promoted_bytes),
        format_size(f.kept_bytes),
        format_size(f.evicted_bytes),
        format_size(f.bypassed_bytes),
        f.limited_wait_ms,
        residency(&f.residency_seconds_log2),
    )
}

/// The non-empty residency buckets as "<2s 12, <64s 300, longer 5" (4 KiB blocks).
pub fn residency(buckets: &[u64]) -> String {
    let last = buckets.len().saturating_sub(1);
    let parts: Vec<String> = buckets
        .iter()
        .enumerate()
        .filter(|(_, &n)| n > 0)
        .map(|(i, n)| {
            if i == last {
                format!("longer {n}")
            } else {
                format!("<{} {n}", format_seconds(1u64 << i))
            }
        })
        .collect();
    if parts.is_empty() {
        return "nothing moved to the capacity tier yet".into();
    }
    format!("{} (blocks moved after)", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_name_mode_and_limits() {
        let p = Policy {
            mode: Mode::Tier,
            iops_limit: 500,
            bandwidth_limit_bytes_per_s: 64 << 20,
            ..Policy::default()
        };
        assert_eq!(policy_summary(&p), "tier, 500 IOPS, 64 MiB/s");
        assert_eq!(policy_summary(&Policy::default()), "cache");
        let lines = policy_lines(&p, false);
        assert!(lines.contains("policy:      tier\n"), "{lines}");
        assert!(lines.contains("older than 1h"), "{lines}");
        assert!(lines.contains("after 2 read(s) within 5m, not past 4 MiB"), "{lines}");
        assert!(lines.contains("500 IOPS, 64 MiB/s bandwidth"), "{lines}");
        let unlimited = policy_lines(&Policy::default(), false);
        assert!(
            unlimited.contains("limits:      IOPS unlimited, bandwidth unlimited\n"),
            "{unlimited}"
        );
    }

    /// On a node without a read cache (`--read-cache 0`) nothing is promoted: the promote
    /// line says so, instead of "after 2 read(s)" alone.
    #[test]
    fn the_promote_line_says_when_the_node_has_no_read_cache() {
        let p = Policy::default();
        let with_cache = policy_lines(&p, false);
        let want = "promote:     after 2 read(s) within 5m, not past 4 MiB sequential\n";
        assert!(with_cache.contains(want), "{with_cache}");
        let without = policy_lines(&p, true);
        let want = "promote:     after 2 read(s) within 5m, not past 4 MiB sequential \
                    (none: the node has no read cache)\n";
        assert!(without.contains(want), "{without}");
        let text = set_policy_text("db", &p, true);
        assert!(
            text.contains("(none: the node has no read cache)"),
            "{text}"
        );
        // Promotion off says never already.
        let off = Policy {
            promote_after_reads: 0,
            ..p
        };
        let never = policy_lines(&off, true);
        assert!(!never.contains("no read cache"), "{never}");
    }

    /// `set-policy` echoes every setting, so whichever option was given shows its new value.
    #[test]
    fn set_policy_echoes_every_option() {
        let p = Policy {
            mode: Mode::Cache,
            tier_min_age_s: 7 * 86_400,
            tier_max_cold_heat: 9,
            promote_after_reads: 7,
            promote_window_s: 13 * 60,
            promote_sequential_cutoff_bytes: 3 << 20,
            iops_limit: 123,
            bandwidth_limit_bytes_per_s: 5 << 20,
            sequential_write_cutoff_bytes: 6 << 20,
        };
        let text = set_policy_text("db", &p, false);
        for (option, shown) in [
            ("--policy", "policy:      cache\n"),
            ("--tier-min-age", "older than 7d"),
            ("--tier-max-cold-heat", "heat <= 9"),
            ("--promote-after-reads", "after 7 read(s)"),
            ("--promote-window", "within 13m"),
            ("--promote-sequential-cutoff", "not past 3 MiB sequential"),
            ("--iops-limit", "123 IOPS"),
            ("--bandwidth-limit", "5 MiB/s bandwidth"),
            ("--sequential-write-cutoff", "past 6 MiB sequential"),
        ] {
            assert!(text.contains(shown), "{option}: {shown:?} not in\n{text}");
        }
        assert!(
            text.starts_with("volume \"db\" policy: cache, 123 IOPS, 5 MiB/s\n"),
            "{text}"
        );
        // Settings that do not apply now are still shown, and said not to apply.
        let off = Policy {
            mode: Mode::Tier,
            promote_after_reads: 0,
            promote_sequential_cutoff_bytes: 0,
            ..p
        };
        let text = set_policy_text("db", &off, false);
        assert!(
            text.contains("never (0 reads; window 13m, sequential streams too when on)"),
            "{text}"
        );
        assert!(
            text.contains("never in tier mode (in cache mode: writes of 128K+ past 6 MiB"),
            "{text}"
        );
    }

    #[test]
    fn residency_shows_only_filled_buckets() {
        let mut b = vec![0; 24];
        b[1] = 12;
        b[6] = 300;
        b[23] = 5;
        assert_eq!(residency(&b), "<2s 12, <64s 300, longer 5 (blocks moved after)");
        assert_eq!(residency(&[0; 24]), "nothing moved to the capacity tier yet");
        let f = FiguresJson {
            fast_read_hit_ratio: Some(0.5),
            read_cached_bytes: 4096,
            ..FiguresJson::default()
        };
        assert!(figures_lines(&f).contains("hit ratio:   50.0% (0 B log, 4 KiB cached"), "{}", figures_lines(&f));
    }
}

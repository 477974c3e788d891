//! What one run asks of the targets: the I/O mix (profiles), the topology (VMs, connections,
//! queue depth), the timing and the targets themselves, checked once before anything connects.
use std::time::Duration;

use serde::Serialize;

use crate::BenchError;

/// Bounds that keep a typo from asking for absurd resources.
pub const MAX_VMS: u32 = 1024;
pub const MAX_CONNECTIONS_TOTAL: u32 = 4096;
pub const MAX_QUEUE_DEPTH: u32 = 1024;
/// The largest NBD request Strata (and most servers) accept.
pub const MAX_BLOCK_SIZE_BYTES: u32 = 32 << 20;
pub const MIN_BLOCK_SIZE_BYTES: u32 = 512;

/// The I/O mix of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Workload {
    pub block_size_bytes: u32,
    /// Share of operations that are reads, percent.
    pub read_pct: u8,
    /// Share of operations at a random offset (the rest continue sequentially), percent.
    pub random_pct: u8,
    /// Share of each VM's region the offsets fall in, percent.
    pub working_set_pct: u8,
}

/// A named profile: the workloads CONTEXT.md §5 names. `prep` writes every volume once.
#[derive(Debug, Clone, Copy)]
pub struct Profile {
    pub name: &'static str,
    pub what: &'static str,
    pub workload: Workload,
}

const fn wl(block_kib: u32, read_pct: u8, random_pct: u8) -> Workload {
    Workload {
        block_size_bytes: block_kib << 10,
        read_pct,
        random_pct,
        working_set_pct: 100,
    }
}

pub const PROFILES: [Profile; 7] = [
    Profile {
        name: "70r-32k",
        what: "70% read, 32 KiB, random",
        workload: wl(32, 70, 100),
    },
    Profile {
        name: "70r-4k",
        what: "70% read, 4 KiB, random",
        workload: wl(4, 70, 100),
    },
    Profile {
        name: "rr-4k",
        what: "random read, 4 KiB",
        workload: wl(4, 100, 100),
    },
    Profile {
        name: "rw-4k",
        what: "random write, 4 KiB",
        workload: wl(4, 0, 100),
    },
    Profile {
        name: "50r-8k",
        what: "50% read, 8 KiB, random",
        workload: wl(8, 50, 100),
    },
    Profile {
        name: "sw-256k",
        what: "sequential write, 256 KiB",
        workload: wl(256, 0, 0),
    },
    Profile {
        name: "prep",
        what: "write every volume end to end once, 256 KiB, timed",
        workload: wl(256, 0, 0),
    },
];

pub fn profile(name: &str) -> Result<Profile, BenchError> {
    PROFILES
        .iter()
        .copied()
        .find(|p| p.name == name)
        .ok_or_else(|| {
            let names: Vec<&str> = PROFILES.iter().map(|p| p.name).collect();
            BenchError::Invalid(format!(
                "unknown profile {name:?} (use one of {})",
                names.join(", ")
            ))
        })
}

/// How the load is offered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Uncontrolled: every connection keeps its queue full.
    Max,
    /// Find the maximum, then 10%, 20%, ... 100% of it with Poisson arrivals.
    Curve,
    /// One worker at queue depth 1 per VM, doubling the VMs: 1, 2, 4, ... N.
    Scale,
    /// Write every VM's region end to end once, timed.
    Prep,
}

/// An NBD export: `nbd://HOST:PORT/EXPORT` (port 10809 when left out).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TargetUri {
    pub uri: String,
    pub host: String,
    pub port: u16,
    pub export: String,
}

pub fn parse_uri(text: &str) -> Result<TargetUri, BenchError> {
    let bad = |why: &str| BenchError::Invalid(format!("invalid NBD URI {text:?}: {why}"));
    let rest = text
        .strip_prefix("nbd://")
        .ok_or_else(|| bad("expected nbd://HOST[:PORT]/EXPORT"))?;
    let (authority, export) = rest.split_once('/').unwrap_or((rest, ""));
    let (host, port_text) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or_else(|| bad("unclosed ["))?;
        (h, after.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port_text {
        Some(p) => p
            .parse::<u16>()
            .map_err(|_| bad("the port is not a number"))?,
        None => 10809,
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    if export.len() > 4096 {
        return Err(bad("export name longer than 4096 bytes"));
    }
    Ok(TargetUri {
        uri: text.to_string(),
        host: host.to_string(),
        port,
        export: export.to_string(),
    })
}

/// How many VMs, connections and requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Topology {
    pub vms: u32,
    pub connections_per_vm: u32,
    pub queue_depth: u32,
}

impl Topology {
    /// In u64: 1024 VMs x 2^22 connections would wrap a u32 to 0 and pass the bound.
    pub fn connections(&self) -> u64 {
        u64::from(self.vms) * u64::from(self.connections_per_vm)
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |s: String| Err(BenchError::Invalid(s));
        if self.vms == 0 || self.vms > MAX_VMS {
            return bad(format!("--vms must be between 1 and {MAX_VMS}"));
        }
        if self.connections_per_vm == 0 || self.connections() > u64::from(MAX_CONNECTIONS_TOTAL) {
            return bad(format!(
                "--conns must be at least 1 and VMs x connections at most {MAX_CONNECTIONS_TOTAL}"
            ));
        }
        if self.queue_depth == 0 || self.queue_depth > MAX_QUEUE_DEPTH {
            return bad(format!("--qd must be between 1 and {MAX_QUEUE_DEPTH}"));
        }
        Ok(())
    }
}

impl Workload {
    pub fn validate(&self) -> Result<(), BenchError> {
        let bs = self.block_size_bytes;
        if !(MIN_BLOCK_SIZE_BYTES..=MAX_BLOCK_SIZE_BYTES).contains(&bs) || !bs.is_multiple_of(512) {
            return Err(BenchError::Invalid(format!(
                "--block-size must be a multiple of 512 between 512 and 32 MiB, not {bs}"
            )));
        }
        for (name, v) in [
            ("--read-pct", self.read_pct),
            ("--random-pct", self.random_pct),
        ] {
            if v > 100 {
                return Err(BenchError::Invalid(format!(
                    "{name} must be 0..100, not {v}"
                )));
            }
        }
        if self.working_set_pct == 0 || self.working_set_pct > 100 {
            return Err(BenchError::Invalid(
                "--working-set-pct must be 1..100".into(),
            ));
        }
        Ok(())
    }
}

/// Durations such as "30s", "500ms", "2m", "10" (seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let (number, scale_s) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("invalid duration {text:?}: expected e.g. 30s, 500ms, 2m"))?;
    let secs = value * scale_s;
    if !secs.is_finite() || !(0.0..=7.0 * 86_400.0).contains(&secs) {
        return Err(format!("duration {text:?} is out of range (0 to 7 days)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Sizes such as "4k", "32K", "256KiB", "1M", "4096" (binary units, the grammar every Strata
/// command takes), exact, up to 4 GiB - 1.
pub fn parse_size(text: &str) -> Result<u32, String> {
    let bytes = strata_units::parse_size(text).map_err(|e| e.to_string())?;
    u32::try_from(bytes).map_err(|_| format!("size {text:?} is too large"))
}

/// A share in percent: a whole number from 0 to 100 ("70" or "70%").
pub fn parse_pct(text: &str) -> Result<u8, String> {
    let t = text.trim();
    match t.strip_suffix('%').unwrap_or(t).parse::<u8>() {
        Ok(p) if p <= 100 => Ok(p),
        _ => Err(format!(
            "invalid percentage {text:?}: a whole number from 0 to 100"
        )),
    }
}

/// Curve steps such as "10,20,50,100" (percent of the maximum, rising, 1..100).
pub fn parse_steps(text: &str) -> Result<Vec<u8>, String> {
    let steps: Vec<u8> = text
        .split(',')
        .map(|s| s.trim().trim_end_matches('%').parse::<u8>())
        .collect::<Result<_, _>>()
        .map_err(|_| format!("invalid curve steps {text:?}: expected e.g. 10,20,50,100"))?;
    let rising = steps.windows(2).all(|w| w[0] < w[1]);
    if steps.is_empty()
        || steps.len() > 100
        || !rising
        || steps[0] == 0
        || steps[steps.len() - 1] > 100
    {
        return Err(format!(
            "curve steps {text:?} must rise strictly and lie in 1..100"
        ));
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentages_are_whole_numbers_from_0_to_100() {
        assert_eq!(parse_pct("0"), Ok(0));
        assert_eq!(parse_pct("70%"), Ok(70));
        assert_eq!(parse_pct(" 100 "), Ok(100));
        for bad in ["-1", "101", "255", "256", "7.5", "", "%", "x"] {
            let e = parse_pct(bad).unwrap_err();
            assert!(e.contains("from 0 to 100"), "{bad}: {e}");
        }
    }

    #[test]
    fn profiles_match_the_issue() {
        assert_eq!(profile("70r-32k").unwrap().workload, wl(32, 70, 100));
        assert_eq!(profile("sw-256k").unwrap().workload.random_pct, 0);
        assert_eq!(profile("rr-4k").unwrap().workload.read_pct, 100);
        assert_eq!(profile("rw-4k").unwrap().workload.read_pct, 0);
        assert!(profile("70r-64k").unwrap_err().to_string().contains("prep"));
    }

    #[test]
    fn uris_parse() {
        let t = parse_uri("nbd://127.0.0.1:10900/vol0").unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.export.as_str()),
            ("127.0.0.1", 10900, "vol0")
        );
        let t = parse_uri("nbd://localhost").unwrap();
        assert_eq!((t.port, t.export.as_str()), (10809, ""));
        let t = parse_uri("nbd://[::1]:99/x").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 99));
        assert!(parse_uri("http://x/y").is_err());
        assert!(parse_uri("nbd://:1/x").is_err());
        assert!(parse_uri("nbd://h:port/x").is_err());
    }

    #[test]
    fn durations_sizes_and_steps_parse() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1.5").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("soon").is_err());
        assert_eq!(parse_size("32K").unwrap(), 32768);
        assert_eq!(parse_size("256KiB").unwrap(), 262144);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("8G").unwrap_err().contains("too large"));
        assert_eq!(parse_size("1.5K").unwrap(), 1536);
        assert_eq!(parse_size("4 K").unwrap(), 4096);
        assert!(parse_size("1.1K")
            .unwrap_err()
            .contains("whole number of bytes"));
        assert!(parse_size("4kibb").unwrap_err().contains("unknown unit"));
        assert!(parse_size("4ib").unwrap_err().contains("unknown unit"));
        assert_eq!(parse_steps("10,20,50%,100").unwrap(), vec![10, 20, 50, 100]);
        assert!(parse_steps("20,10").is_err());
        assert!(parse_steps("0,50").is_err());
        assert!(parse_steps("50,150").is_err());
    }

    #[test]
    fn bad_workloads_and_topologies_are_refused() {
        let mut w = wl(4, 70, 100);
        w.block_size_bytes = 1000;
        assert!(w.validate().is_err());
        w = wl(4, 101, 100);
        assert!(w.validate().is_err());
        let t = Topology {
            vms: 2,
            connections_per_vm: 4,
            queue_depth: 0,
        };
        assert!(t.validate().is_err());
        let t = Topology {
            vms: 2,
            connections_per_vm: 4096,
            queue_depth: 1,
        };
        assert!(t.validate().is_err());
    }

    /// 1024 VMs x 2^22 connections is 2^32: the product must not wrap to 0 and pass the bound.
    #[test]
    fn a_connection_count_past_u32_is_refused() {
        let t = Topology {
            vms: 1024,
            connections_per_vm: 1 << 22,
            queue_depth: 1,
        };
        assert!(t.validate().is_err());
    }
}

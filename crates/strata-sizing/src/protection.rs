//! Protection policies and what they cost: write amplification and the smallest cluster.
use serde::Serialize;

/// A cluster starts at three hosts (CONTEXT.md section 1), whatever the policy.
pub const MIN_CLUSTER_HOSTS: u32 = 3;
const MAX_FTT: u32 = 8;
const MAX_EC_DATA: u32 = 32;
const MAX_EC_PARITY: u32 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Protection {
    /// RAID-1: `ftt + 1` full copies on as many hosts.
    Mirror { ftt: u32 },
    /// Erasure coding: `data` data fragments and `parity` parity fragments on distinct hosts.
    Erasure { data: u32, parity: u32 },
}

impl Protection {
    /// `raid1` (FTT=1), `ftt=N` (N+1 copies), `ec=K+M`.
    pub fn parse(text: &str) -> Result<Protection, String> {
        let t = text.trim().to_ascii_lowercase();
        let bad = || {
            format!("invalid protection {text:?}: use raid1, ftt=N (N+1 copies, N <= {MAX_FTT}) or ec=K+M (e.g. ec=4+2)")
        };
        if t == "raid1" || t == "raid-1" {
            return Ok(Protection::Mirror { ftt: 1 });
        }
        if let Some(n) = t.strip_prefix("ftt=") {
            let ftt: u32 = n.parse().map_err(|_| bad())?;
            return (ftt <= MAX_FTT)
                .then_some(Protection::Mirror { ftt })
                .ok_or_else(bad);
        }
        let spec = t.strip_prefix("ec=").ok_or_else(bad)?;
        let (k, m) = spec.split_once('+').ok_or_else(bad)?;
        let data: u32 = k.trim().parse().map_err(|_| bad())?;
        let parity: u32 = m.trim().parse().map_err(|_| bad())?;
        if !(1..=MAX_EC_DATA).contains(&data) || !(1..=MAX_EC_PARITY).contains(&parity) {
            return Err(format!(
                "invalid protection {text:?}: erasure coding needs 1..={MAX_EC_DATA} data and 1..={MAX_EC_PARITY} parity fragments"
            ));
        }
        Ok(Protection::Erasure { data, parity })
    }

    /// Bytes written to devices per byte the VMs write.
    pub fn write_amplification(&self) -> f64 {
        match *self {
            Protection::Mirror { ftt } => f64::from(ftt + 1),
            Protection::Erasure { data, parity } => f64::from(data + parity) / f64::from(data),
        }
    }

    /// Hosts the policy needs: one per copy or fragment, and never fewer than a cluster's three.
    pub fn min_hosts(&self) -> u32 {
        let spread = match *self {
            Protection::Mirror { ftt } => ftt + 1,
            Protection::Erasure { data, parity } => data + parity,
        };
        spread.max(MIN_CLUSTER_HOSTS)
    }

    pub fn label(&self) -> String {
        match *self {
            // FTT=0 keeps one copy: nothing is mirrored, so it is not RAID-1.
            Protection::Mirror { ftt: 0 } => "no redundancy, FTT=0 (1 copy)".to_string(),
            Protection::Mirror { ftt } => format!("RAID-1, FTT={ftt} ({} copies)", ftt + 1),
            Protection::Erasure { data, parity } => format!("erasure coding {data}+{parity}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_policies() {
        assert_eq!(
            Protection::parse("raid1"),
            Ok(Protection::Mirror { ftt: 1 })
        );
        assert_eq!(
            Protection::parse("RAID-1"),
            Ok(Protection::Mirror { ftt: 1 })
        );
        assert_eq!(
            Protection::parse("ftt=2"),
            Ok(Protection::Mirror { ftt: 2 })
        );
        assert_eq!(
            Protection::parse("ftt=0"),
            Ok(Protection::Mirror { ftt: 0 })
        );
        assert_eq!(
            Protection::parse("ec=4+2"),
            Ok(Protection::Erasure { data: 4, parity: 2 })
        );
        for bad in [
            "raid5", "ftt=", "ftt=-1", "ftt=9", "ec=4", "ec=0+1", "ec=4+0", "ec=a+b", "",
        ] {
            assert!(Protection::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn amplification_and_minimum_hosts() {
        let raid1 = Protection::Mirror { ftt: 1 };
        assert_eq!(raid1.write_amplification(), 2.0);
        assert_eq!(raid1.min_hosts(), 3);
        let ftt3 = Protection::Mirror { ftt: 3 };
        assert_eq!(ftt3.write_amplification(), 4.0);
        assert_eq!(ftt3.min_hosts(), 4);
        let ec = Protection::Erasure { data: 4, parity: 2 };
        assert_eq!(ec.write_amplification(), 1.5);
        assert_eq!(ec.min_hosts(), 6);
        let ec21 = Protection::Erasure { data: 2, parity: 1 };
        assert!((ec21.write_amplification() - 1.5).abs() < 1e-12);
        assert_eq!(ec21.min_hosts(), 3);
        assert_eq!(ec.label(), "erasure coding 4+2");
        assert_eq!(raid1.label(), "RAID-1, FTT=1 (2 copies)");
        assert_eq!(
            Protection::Mirror { ftt: 0 }.label(),
            "no redundancy, FTT=0 (1 copy)"
        );
    }
}

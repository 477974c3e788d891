//! Per-volume tiering policy: how the fast tier serves a volume (write buffer or tier), when
//! data read from the capacity tier is promoted, and the volume's I/O limits. Stored in the
//! volume's record (a small versioned binary encoding), changeable at any time.

use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::format::{Reader, Writer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The fast tier is a write buffer: the fill-level destager decides when data moves.
    Cache,
    /// Data stays on the fast tier until it is cold (old enough and not rewritten or read
    /// lately), or until the fast tier needs the room.
    Tier,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub mode: Mode,
    /// Tier mode: data younger than this stays on the fast tier (unless room is needed).
    pub tier_min_age_s: u64,
    /// Tier mode: data whose heat (rewrites and reads since it last moved) exceeds this stays.
    pub tier_max_cold_heat: u8,
    /// Reads of a region within the window that promote it to the fast tier; 0: never.
    pub promote_after_reads: u32,
    pub promote_window_s: u64,
    /// Reads continuing a sequential stream longer than this neither count nor promote.
    pub promote_sequential_cutoff_bytes: u64,
    /// I/O operations per second allowed (0: no limit); requests over it wait.
    pub iops_limit: u64,
    /// Bytes per second allowed (0: no limit); requests over it wait.
    /// 0, or at least [`MIN_BANDWIDTH_LIMIT`].
    pub bandwidth_limit_bytes_per_s: u64,
    /// Cache mode: writes of at least `BYPASS_MIN_BYTES` that continue a sequential stream
    /// already this long go straight to the capacity tier (0: never; see `bypass.rs`).
    #[serde(default)]
    pub sequential_write_cutoff_bytes: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            mode: Mode::Cache,
            tier_min_age_s: 3600,
            tier_max_cold_heat: 0,
            promote_after_reads: 2,
            promote_window_s: 300,
            promote_sequential_cutoff_bytes: 4 << 20,
            iops_limit: 0,
            bandwidth_limit_bytes_per_s: 0,
            sequential_write_cutoff_bytes: 0,
        }
    }
}

/// The least bandwidth limit (bytes per second) taken: one below it would hold a client's
/// every request for seconds (a limit of 100 given for 100 MB/s: 40 s per 4 KiB read).
pub const MIN_BANDWIDTH_LIMIT: u64 = 64 << 10;
/// Region whose reads are counted together for promotion (64 KiB).
pub const PROMOTE_REGION_BLOCKS: u64 = 16;
/// Version 2 added `sequential_write_cutoff_bytes` at the end; version 1 is still read.
const ENCODING_VERSION: u8 = 2;

impl Policy {
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |what: &str| Err(EngineError::InvalidArgument(format!("policy: {what}")));
        if self.promote_after_reads > 1000 {
            return bad("promote_after_reads is at most 1000");
        }
        if self.promote_after_reads > 0 && self.promote_window_s == 0 {
            return bad("promote_window_s must be at least 1 when promotion is on");
        }
        if self.tier_min_age_s > 10 * 365 * 86400 || self.promote_window_s > 30 * 86400 {
            return bad("tier_min_age_s is at most ten years and promote_window_s at most 30 days");
        }
        let bw = self.bandwidth_limit_bytes_per_s;
        if bw > 0 && bw < MIN_BANDWIDTH_LIMIT {
            return bad(&format!(
                "a bandwidth limit of {bw} bytes/s would hold each request of a client for \
                 seconds or hours: 0 for no limit, or at least {MIN_BANDWIDTH_LIMIT} \
                 (64 KiB/s; sizes take units, as 100M)"
            ));
        }
        Ok(())
    }

    /// The stored form (empty for the defaults, so volumes without a policy stay small).
    pub fn encode(&self) -> Vec<u8> {
        if *self == Policy::default() {
            return Vec::new();
        }
        let mut w = Writer::default();
        w.u8(ENCODING_VERSION).u8(match self.mode {
            Mode::Cache => 0,
            Mode::Tier => 1,
        });
        w.u64(self.tier_min_age_s)
            .u8(self.tier_max_cold_heat)
            .u32(self.promote_after_reads);
        w.u64(self.promote_window_s)
            .u64(self.promote_sequential_cutoff_bytes);
        w.u64(self.iops_limit).u64(self.bandwidth_limit_bytes_per_s);
        w.u64(self.sequential_write_cutoff_bytes);
        w.buf
    }

    pub fn decode(b: &[u8]) -> Result<Policy, EngineError> {
        if b.is_empty() {
            return Ok(Policy::default());
        }
        let mut r = Reader::new(b);
        let version = r.u8()?;
        if version != 1 && version != ENCODING_VERSION {
            return Err(EngineError::Format(format!(
                "volume policy encoding {version} is not known to this build"
            )));
        }
        let mode = match r.u8()? {
            0 => Mode::Cache,
            1 => Mode::Tier,
            x => {
                return Err(EngineError::Format(format!(
                    "unknown volume policy mode {x}"
                )))
            }
        };
        Ok(Policy {
            mode,
            tier_min_age_s: r.u64()?,
            tier_max_cold_heat: r.u8()?,
            promote_after_reads: r.u32()?,
            promote_window_s: r.u64()?,
            promote_sequential_cutoff_bytes: r.u64()?,
            iops_limit: r.u64()?,
            bandwidth_limit_bytes_per_s: r.u64()?,
            sequential_write_cutoff_bytes: if version >= 2 { r.u64()? } else { 0 },
        })
    }
}

/// Time as the engine's policies see it: milliseconds since an arbitrary start. Tests inject
/// a manual clock to make ages, windows and rate limits deterministic.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> u64;

    /// Wall-clock seconds since the Unix epoch, which log batch headers carry so that the age
    /// of data in the log survives a restart (0: not known).
    fn unix_s(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    }
}

/// Where `SystemClock` starts counting: data replayed from the log after a restart is given
/// the age its batch's time stamp says, up to this much (longer than the longest minimum age
/// a policy may set, ten years).
pub const AGE_HORIZON_MS: u64 = 11 * 365 * 86_400 * 1000;

/// The monotonic clock, from `AGE_HORIZON_MS` at its creation: wall-clock steps do not move
/// it, and the time before the start can be told.
#[derive(Debug)]
pub struct SystemClock(std::time::Instant);

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock(std::time::Instant::now())
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        AGE_HORIZON_MS + self.0.elapsed().as_millis() as u64
    }
}

/// The wall clock a `ManualClock` reports at its start (2023-11-14).
pub const MANUAL_UNIX_START_S: u64 = 1_700_000_000;

/// A clock that moves only when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock(std::sync::atomic::AtomicU64);

impl ManualClock {
    pub fn advance_ms(&self, ms: u64) {
        self.0.fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Moves with the manual time, from `MANUAL_UNIX_START_S`.
    fn unix_s(&self) -> u64 {
        MANUAL_UNIX_START_S + self.now_ms() / 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_round_trip_and_defaults_take_no_room() {
        assert!(Policy::default().encode().is_empty());
        assert_eq!(Policy::decode(&[]).unwrap(), Policy::default());
        let p = Policy {
            mode: Mode::Tier,
            tier_min_age_s: 60,
            iops_limit: 500,
            promote_after_reads: 3,
            sequential_write_cutoff_bytes: 8 << 20,
            ..Policy::default()
        };
        let b = p.encode();
        assert!(b.len() <= crate::format::MAX_POLICY_BYTES);
        assert_eq!(Policy::decode(&b).unwrap(), p);
        // Version 1 (before the write cutoff) still reads, with the cutoff off.
        let mut v1 = b[..b.len() - 8].to_vec();
        v1[0] = 1;
        let old = Policy::decode(&v1).unwrap();
        assert_eq!(old.sequential_write_cutoff_bytes, 0);
        assert_eq!(old.iops_limit, 500);
        assert!(Policy::decode(&[9]).is_err());
        let bad = Policy {
            promote_after_reads: 2,
            promote_window_s: 0,
            ..Policy::default()
        };
        assert!(bad.validate().is_err());
        let bad = Policy {
            tier_min_age_s: u64::MAX,
            ..Policy::default()
        };
        assert!(bad.validate().is_err());
        // `--bandwidth-limit 100` meant as 100 MB/s: a 4 KiB request would wait 40 s.
        for (bw, ok) in [(0, true), (100, false), (MIN_BANDWIDTH_LIMIT - 1, false)] {
            let p = Policy {
                bandwidth_limit_bytes_per_s: bw,
                ..Policy::default()
            };
            assert_eq!(p.validate().is_ok(), ok, "{bw}: {:?}", p.validate());
        }
        let p = Policy {
            bandwidth_limit_bytes_per_s: MIN_BANDWIDTH_LIMIT,
            ..Policy::default()
        };
        assert!(p.validate().is_ok());
    }
}

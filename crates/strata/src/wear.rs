//! Device wear as the daemon reports it: lifetime bytes written (persisted by the engine),
//! average and recent write rates, drive writes per day and, when the device names a catalog
//! entry, the share of its rated endurance used and when it would wear out.
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::config::format_size;
use crate::history::History;

/// Window of the "recent" write rate.
pub const RECENT_WINDOW: Duration = Duration::from_secs(300);
const SECONDS_PER_DAY: f64 = 86_400.0;
/// History a device needs by default before its wear-out is projected (and warned about) from
/// its average write rate: an initial load, or a group's first seconds, say nothing of the long
/// run (`--wear-projection-after`; `off` projects nothing).
pub const PROJECTION_AFTER: Duration = Duration::from_secs(86_400);
const SECONDS_PER_YEAR: f64 = 365.0 * SECONDS_PER_DAY;

/// A device of the disk group as configured: which tier, which file, which catalog entry.
#[derive(Debug, Clone)]
pub struct DeviceIdentity {
    pub name: String,
    pub tier: &'static str,
    pub model: Option<String>,
    pub rating: Option<Rating>,
    /// History needed before a wear-out date is projected (`PROJECTION_AFTER` by default);
    /// None: never (`--wear-projection-after off`).
    pub projection_after_s: Option<u64>,
}

/// Rated endurance from the device catalog.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rating {
    pub endurance_bytes: f64,
    pub warranty_years: f64,
    /// The model's capacity: its endurance is for a drive of this size.
    pub capacity_bytes: u64,
}

/// The device catalog the daemon rates its devices with: the built-in one plus `catalog_files`.
pub fn load_catalog(catalog_files: &[PathBuf]) -> anyhow::Result<strata_sizing::Catalog> {
    Ok(strata_sizing::Catalog::load(catalog_files)?)
}

/// The rating of a catalog entry; None without a model, or for a device the catalog lists
/// without a write-endurance rating (a hard disk). An unknown model is an error.
///
/// Strata writes its capacity devices in large sequential segments, so a capacity device with a
/// separate sequential rating (QLC drives have one) is held to that rating.
pub fn rating_for(
    catalog: &strata_sizing::Catalog,
    model: Option<&str>,
    tier: &str,
) -> anyhow::Result<Option<Rating>> {
    let Some(model) = model else { return Ok(None) };
    // A model the catalog lacks is a bad flag or config value (exit 2); a catalog file that
    // cannot be read or is bad failed earlier, in `load_catalog` (exit 1).
    let device = catalog
        .get(model)
        .map_err(|e| crate::UsageError(format!("{tier} device model: {e}")))?;
    Ok(device.endurance.map(|e| Rating {
        endurance_bytes: e.budget_bytes(tier == "capacity"),
        warranty_years: e.warranty_years,
        capacity_bytes: device.capacity_bytes,
    }))
}

/// What is wrong when a device is far from the size of the model it is rated as (under half
/// of it, or a quarter more): the model's endurance is a whole drive's, so on a partition, a
/// file, or a drive of another size, the endurance used and the wear-out date are off by the
/// ratio of the sizes. None when the sizes agree, or for an unrated device.
pub fn model_size_mismatch(id: &DeviceIdentity, size_bytes: u64) -> Option<String> {
    let rating = id.rating?;
    let model = id.model.as_deref()?;
    let rated = rating.capacity_bytes;
    if rated == 0 || (size_bytes >= rated / 2 && size_bytes <= rated + rated / 4) {
        return None;
    }
    Some(format!(
        "{} device {} is {}, but its model {model} is a {} drive: the endurance used and the \
         wear-out date, figured against that drive's rating, are off by the ratio of the sizes \
         (name the model of the drive this is, or add a catalog entry for it)",
        id.tier,
        id.name,
        format_size(size_bytes),
        format_size(rated)
    ))
}

/// How often the daemon looks at its devices' wear.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// A device that keeps wearing too fast is logged again at most this often.
pub const WARNING_INTERVAL: Duration = Duration::from_secs(3600);

/// Rate limit of the wear warnings in the log: the first time a device is found wearing out
/// before its warranty, then at most once per [`WARNING_INTERVAL`] while it still is.
#[derive(Debug, Default)]
pub struct WarningLimiter {
    last_warned: HashMap<String, Instant>,
}

impl WarningLimiter {
    /// Whether to log a warning for `device` now; a device found healthy is forgotten, so it
    /// is reported at once if it starts wearing too fast again.
    pub fn should_warn(&mut self, device: &str, wears_out_early: bool, now: Instant) -> bool {
        if !wears_out_early {
            self.last_warned.remove(device);
            return false;
        }
        match self.last_warned.get(device) {
            Some(at) if now.saturating_duration_since(*at) < WARNING_INTERVAL => false,
            _ => {
                self.last_warned.insert(device.to_string(), now);
                true
            }
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WearJson {
    /// The size drive writes per day are a share of: the part of the device its disk group
    /// was formatted on, which is all the group writes to. Smaller than the device's
    /// `size_bytes` on a device grown since (the rest stays unused).
    pub formatted_size_bytes: u64,
    pub bytes_written_total: u64,
    pub first_use_unix_s: u64,
    pub write_bytes_per_s_avg: f64,
    pub write_bytes_per_s_recent: Option<f64>,
    pub drive_writes_per_day: f64,
    pub model: Option<String>,
    pub rated_endurance_bytes: Option<f64>,
    pub endurance_used_ratio: Option<f64>,
    pub warranty_end_unix_s: Option<u64>,
    /// When the rated endurance runs out at the average write rate; None until the device
    /// has enough history (`DeviceIdentity::projection_after_s`, a day by default), and
    /// always with the projection off.
    pub projected_wear_out_unix_s: Option<u64>,
    /// The average rate would use up the rated endurance before the warranty ends.
    pub wears_out_before_warranty: bool,
    /// The history a device needs before its wear-out is projected; None when projection is
    /// off: no wear-out date, no warning, whatever the device's history.
    pub projection_after_s: Option<u64>,
}

/// The wear of one device at `now_unix_s`; `size_bytes` is the part of the device the group
/// writes to (`WearJson::formatted_size_bytes`).
pub fn wear(
    id: &DeviceIdentity,
    size_bytes: u64,
    w: strata_engine::DeviceWear,
    now_unix_s: u64,
    history: &History,
) -> WearJson {
    let recent = history.recent_device_write_bytes_per_s(&id.name, RECENT_WINDOW);
    // With the clock behind the device's first use (stepped back, or wrong when the group was
    // made), the device's age is unknown: an age of a second would make the average a
    // device's lifetime writes per second. The recent rate stands in, and nothing is projected.
    let age_s = now_unix_s.checked_sub(w.first_use_unix_s);
    let avg = match age_s {
        Some(age_s) => w.bytes_written_total as f64 / age_s.max(1) as f64,
        None => recent.unwrap_or(0.0),
    };
    let drive_writes_per_day = if size_bytes == 0 {
        0.0
    } else {
        avg * SECONDS_PER_DAY / size_bytes as f64
    };
    let mut out = WearJson {
        formatted_size_bytes: size_bytes,
        bytes_written_total: w.bytes_written_total,
        first_use_unix_s: w.first_use_unix_s,
        write_bytes_per_s_avg: avg,
        write_bytes_per_s_recent: recent,
        drive_writes_per_day,
        model: id.model.clone(),
        rated_endurance_bytes: None,
        endurance_used_ratio: None,
        warranty_end_unix_s: None,
        projected_wear_out_unix_s: None,
        wears_out_before_warranty: false,
        projection_after_s: id.projection_after_s,
    };
    if let Some(r) = id.rating.filter(|r| r.endurance_bytes > 0.0) {
        let warranty_end = w.first_use_unix_s as f64 + r.warranty_years * SECONDS_PER_YEAR;
        out.rated_endurance_bytes = Some(r.endurance_bytes);
        out.endurance_used_ratio = Some(w.bytes_written_total as f64 / r.endurance_bytes);
        out.warranty_end_unix_s = Some(warranty_end as u64);
        let old_enough = match (age_s, id.projection_after_s) {
            (Some(age_s), Some(after_s)) => age_s >= after_s,
            // The clock is behind the first use, or projection is off.
            _ => false,
        };
        if avg > 0.0 && old_enough {
            let left = (r.endurance_bytes - w.bytes_written_total as f64).max(0.0);
            let wear_out = now_unix_s as f64 + left / avg;
            out.projected_wear_out_unix_s = Some(wear_out.min(u64::MAX as f64) as u64);
            out.wears_out_before_warranty = wear_out < warranty_end;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(rating: Option<Rating>) -> DeviceIdentity {
        DeviceIdentity {
            name: "fast".into(),
            tier: "fast",
            model: rating.map(|_| "test-800g".into()),
            rating,
            projection_after_s: Some(PROJECTION_AFTER.as_secs()),
        }
    }

    const GB: f64 = 1e9;
    const DAY: u64 = 86_400;

    #[test]
    fn drive_writes_per_day_from_the_average_rate() {
        let h = History::new();
        let size = 800_000_000_000u64;
        // Ten days, 3 full drive writes per day.
        let w = strata_engine::DeviceWear {
            bytes_written_total: 30 * size,
            first_use_unix_s: 1_000,
        };
        let j = wear(&id(None), size, w, 1_000 + 10 * DAY, &h);
        assert!((j.drive_writes_per_day - 3.0).abs() < 1e-9, "{j:?}");
        assert_eq!(j.endurance_used_ratio, None);
        assert!(!j.wears_out_before_warranty);
    }

    /// An 800 GB device rated 3 drive writes per day for 5 years.
    fn rated_800gb_3_dwpd() -> Rating {
        Rating {
            endurance_bytes: 3.0 * 800.0 * GB * 365.0 * 5.0,
            warranty_years: 5.0,
            capacity_bytes: 800_000_000_000,
        }
    }

    #[test]
    fn a_device_written_at_twice_its_rating_is_flagged() {
        let h = History::new();
        let size = 800_000_000_000u64;
        // 3 DWPD for 5 years.
        let rating = rated_800gb_3_dwpd();
        let at_rating = strata_engine::DeviceWear {
            bytes_written_total: 3 * size * 100,
            first_use_unix_s: 0,
        };
        let j = wear(&id(Some(rating)), size, at_rating, 100 * DAY, &h);
        assert!(!j.wears_out_before_warranty, "{j:?}");
        let wear_out = j.projected_wear_out_unix_s.unwrap() as f64;
        let warranty = j.warranty_end_unix_s.unwrap() as f64;
        assert!((wear_out - warranty).abs() < 2.0 * DAY as f64, "{wear_out} vs {warranty}");
        let twice = strata_engine::DeviceWear {
            bytes_written_total: 6 * size * 100,
            first_use_unix_s: 0,
        };
        let j = wear(&id(Some(rating)), size, twice, 100 * DAY, &h);
        assert!(j.wears_out_before_warranty);
        let used = j.endurance_used_ratio.unwrap();
        assert!((used - 600.0 / (3.0 * 365.0 * 5.0)).abs() < 1e-9);
        let half_life = j.projected_wear_out_unix_s.unwrap() as f64 / SECONDS_PER_YEAR;
        assert!((half_life - 2.5).abs() < 0.01, "{half_life}");
    }

    #[test]
    fn no_wear_out_is_projected_from_less_than_a_day() {
        let h = History::new();
        let size = 800_000_000_000u64;
        let rating = rated_800gb_3_dwpd();
        // A bulk load: 100 GB in the first hour, far above the rated 3 DWPD if it went on.
        let load = strata_engine::DeviceWear {
            bytes_written_total: 100_000_000_000,
            first_use_unix_s: 0,
        };
        let j = wear(&id(Some(rating)), size, load, 3600, &h);
        assert_eq!(j.projected_wear_out_unix_s, None, "{j:?}");
        assert!(!j.wears_out_before_warranty, "{j:?}");
        assert!(j.endurance_used_ratio.is_some());
        // A day on, the average says what it says.
        let j = wear(&id(Some(rating)), size, load, DAY, &h);
        assert!(j.projected_wear_out_unix_s.is_some(), "{j:?}");
    }

    /// `--wear-projection-after off`: never a date nor a warning, however long and however
    /// fast the device was written; `0`: projected from the first second.
    #[test]
    fn a_projection_off_projects_nothing_and_zero_projects_at_once() {
        let h = History::new();
        let size = 800_000_000_000u64;
        let rating = rated_800gb_3_dwpd();
        // Ten times the rated 3 DWPD, for a year.
        let fast = strata_engine::DeviceWear {
            bytes_written_total: 30 * size * 365,
            first_use_unix_s: 0,
        };
        let off = DeviceIdentity {
            projection_after_s: None,
            ..id(Some(rating))
        };
        let j = wear(&off, size, fast, 365 * DAY, &h);
        assert_eq!(j.projected_wear_out_unix_s, None, "{j:?}");
        assert!(!j.wears_out_before_warranty, "{j:?}");
        assert_eq!(j.projection_after_s, None, "{j:?}");
        assert!(j.endurance_used_ratio.is_some(), "{j:?}");
        let at_once = DeviceIdentity {
            projection_after_s: Some(0),
            ..id(Some(rating))
        };
        let j = wear(&at_once, size, fast, 1, &h);
        assert!(j.wears_out_before_warranty, "{j:?}");
        assert_eq!(j.projection_after_s, Some(0), "{j:?}");
    }

    #[test]
    fn a_clock_behind_the_first_use_gives_no_lifetime_average() {
        let h = History::new();
        let size = 800_000_000_000u64;
        let rating = rated_800gb_3_dwpd();
        // Made a year ahead of the clock that now reads: a day's writes at 3 DWPD.
        let w = strata_engine::DeviceWear {
            bytes_written_total: 3 * size,
            first_use_unix_s: 400 * DAY,
        };
        let j = wear(&id(Some(rating)), size, w, 35 * DAY, &h);
        assert_eq!(j.write_bytes_per_s_avg, 0.0, "{j:?}");
        assert_eq!(j.drive_writes_per_day, 0.0, "{j:?}");
        assert_eq!(j.projected_wear_out_unix_s, None, "{j:?}");
        assert!(!j.wears_out_before_warranty, "{j:?}");
        // The lifetime count is still what the device received.
        let used = j.endurance_used_ratio.unwrap();
        assert!((used - 1.0 / (365.0 * 5.0)).abs() < 1e-12, "{used}");
    }

    #[test]
    fn ratings_come_from_the_catalog() {
        let catalog = strata_sizing::Catalog::builtin();
        assert_eq!(rating_for(&catalog, None, "fast").unwrap(), None);
        let r = rating_for(&catalog, Some("optane-p5800x-400g"), "fast").unwrap().unwrap();
        // 100 DWPD x 400 GB x 365 x 5 years.
        assert!((r.endurance_bytes - 100.0 * 400.0 * GB * 365.0 * 5.0).abs() < 1.0);
        assert_eq!(r.warranty_years, 5.0);
        // A QLC capacity device is held to its sequential rating, as a fast device to the other.
        let seq = rating_for(&catalog, Some("d5-p4320-7.68t"), "capacity").unwrap().unwrap();
        let random = rating_for(&catalog, Some("d5-p4320-7.68t"), "fast").unwrap().unwrap();
        assert!((seq.endurance_bytes / random.endurance_bytes - 4.5).abs() < 1e-9);
        // A disk has no write-endurance rating.
        assert_eq!(rating_for(&catalog, Some("hdd-1.2t-10k-sas"), "capacity").unwrap(), None);
        let e = rating_for(&catalog, Some("optane-p5800x"), "fast").unwrap_err();
        assert!(
            e.is::<crate::UsageError>(),
            "an unknown model is a usage error: {e}"
        );
        let e = e.to_string();
        assert!(e.contains("fast device model") && e.contains("optane-p5800x-400g"), "{e}");
    }

    #[test]
    fn warnings_once_then_at_most_hourly() {
        let mut limiter = WarningLimiter::default();
        let t0 = Instant::now();
        assert!(limiter.should_warn("fast", true, t0));
        assert!(!limiter.should_warn("fast", true, t0 + Duration::from_secs(5)));
        // Another device has its own clock.
        assert!(limiter.should_warn("cap", true, t0 + Duration::from_secs(5)));
        assert!(!limiter.should_warn("fast", true, t0 + WARNING_INTERVAL - Duration::from_secs(1)));
        assert!(limiter.should_warn("fast", true, t0 + WARNING_INTERVAL));
        // Healthy again, then too fast again: reported at once.
        let t1 = t0 + WARNING_INTERVAL + Duration::from_secs(10);
        assert!(!limiter.should_warn("fast", false, t1));
        assert!(limiter.should_warn("fast", true, t1 + Duration::from_secs(5)));
    }

    /// A device far from its model's size is named with both sizes; one about its size (a
    /// TB drive seen in TiB, a few percent off) is not, and neither is an unrated one.
    #[test]
    fn a_device_far_from_its_models_size_is_named() {
        let rated = Some(Rating {
            endurance_bytes: 14.6e15,
            warranty_years: 5.0,
            capacity_bytes: 800_000_000_000,
        });
        let small = model_size_mismatch(&id(rated), 2 << 30).expect("2 GiB against 800 GB");
        assert!(
            small.starts_with(
                "fast device fast is 2 GiB, but its model test-800g is a 745.1 GiB drive"
            ),
            "{small}"
        );
        assert!(model_size_mismatch(&id(rated), 2_000_000_000_000).is_some());
        assert_eq!(model_size_mismatch(&id(rated), 745 << 30), None);
        assert_eq!(model_size_mismatch(&id(rated), 400_000_000_000), None);
        assert_eq!(model_size_mismatch(&id(None), 2 << 30), None);
    }
}

//! The device catalog: the built-in entries (`catalog.toml`, compiled in) plus user files that
//! add entries or replace built-in ones by id. Entries are in the makers' units; a [`Device`]
//! holds them converted to bytes.
use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::formulas::{self, BYTES_PER_GB, BYTES_PER_MB, BYTES_PER_TB};
use crate::SizingError;

const BUILTIN_TOML: &str = include_str!("../catalog.toml");
/// A user catalog larger than this is refused rather than read.
const MAX_CATALOG_FILE_BYTES: u64 = 1 << 20;
/// At most this many close matches are suggested for an unknown id.
const MAX_SUGGESTIONS: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MediaKind {
    /// Storage-class memory (3D XPoint / Optane).
    Scm,
    Slc,
    Mlc,
    Tlc,
    Qlc,
    Hdd,
}

impl MediaKind {
    pub fn label(self) -> &'static str {
        match self {
            MediaKind::Scm => "SCM",
            MediaKind::Slc => "SLC",
            MediaKind::Mlc => "MLC",
            MediaKind::Tlc => "TLC",
            MediaKind::Qlc => "QLC",
            MediaKind::Hdd => "HDD",
        }
    }
}

/// One `[[device]]` table as written in a catalog file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    id: String,
    name: String,
    media: MediaKind,
    capacity_gb: f64,
    dwpd: Option<f64>,
    dwpd_sequential: Option<f64>,
    tbw: Option<f64>,
    warranty_years: Option<f64>,
    seq_read_mb_per_s: f64,
    seq_write_mb_per_s: f64,
    random_read_iops: f64,
    random_write_iops: f64,
    read_latency_us: Option<f64>,
    write_latency_us: Option<f64>,
    preferred_write_bytes: u64,
    source: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    #[serde(default)]
    device: Vec<Entry>,
}

/// Rated write endurance over the warranty.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Endurance {
    /// Bytes the device may receive before the warranty's write budget is spent.
    pub endurance_bytes: f64,
    /// The same budget for large sequential writes, when the maker rates them separately.
    pub sequential_endurance_bytes: Option<f64>,
    pub warranty_years: f64,
}

impl Endurance {
    /// The budget for a device written in large sequential units (Strata's capacity tier) when
    /// `sequential`, else the general (random-write) rating.
    pub fn budget_bytes(&self, sequential: bool) -> f64 {
        match self.sequential_endurance_bytes {
            Some(b) if sequential => b,
            _ => self.endurance_bytes,
        }
    }
}

/// A catalog device in bytes and operations.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Device {
    pub id: String,
    pub name: String,
    pub media: MediaKind,
    pub capacity_bytes: u64,
    pub endurance: Option<Endurance>,
    pub seq_read_bytes_per_s: f64,
    pub seq_write_bytes_per_s: f64,
    pub random_read_iops: f64,
    pub random_write_iops: f64,
    pub read_latency_us: Option<f64>,
    pub write_latency_us: Option<f64>,
    pub preferred_write_bytes: u64,
    pub source: Option<String>,
    /// "built-in" or the user catalog file the entry came from.
    pub origin: String,
}

impl Device {
    /// The rated endurance as drive writes per day, for display.
    pub fn rated_dwpd(&self, sequential: bool) -> Option<f64> {
        let e = self.endurance?;
        let per_s =
            formulas::sustained_write_bytes_per_s(e.budget_bytes(sequential), e.warranty_years);
        Some(formulas::drive_writes_per_day(per_s, self.capacity_bytes))
    }
}

/// The ranges of a catalog's figures: far wider than any device's, yet narrow enough that
/// every figure derived from them (endurance, rates, loads, drive writes per day) is a finite
/// number above zero. `tbw = 1e300` made the endurance infinite, which JSON prints as null,
/// the value that means "no rating".
const CAPACITY_GB_RANGE: RangeInclusive<f64> = 0.0..=1e6;
const DWPD_RANGE: RangeInclusive<f64> = 1e-3..=1e3;
/// Decimal TB.
const TBW_RANGE: RangeInclusive<f64> = 1e-3..=1e8;
const WARRANTY_YEARS_RANGE: RangeInclusive<f64> = 0.1..=100.0;
const MB_PER_S_RANGE: RangeInclusive<f64> = 1e-3..=1e7;
const IOPS_RANGE: RangeInclusive<f64> = 1e-3..=1e9;
const LATENCY_US_RANGE: RangeInclusive<f64> = 1e-3..=1e9;

/// `v` if it lies in `range` (NaN and infinities never do).
fn within(what: &str, v: f64, range: RangeInclusive<f64>) -> Result<f64, String> {
    if range.contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{what} must be from {} to {}, got {v}",
            range.start(),
            range.end()
        ))
    }
}

fn endurance_of(e: &Entry, capacity_bytes: u64) -> Result<Option<Endurance>, String> {
    let years = e
        .warranty_years
        .map(|y| within("warranty_years", y, WARRANTY_YEARS_RANGE))
        .transpose()?;
    let endurance_bytes = match (e.dwpd, e.tbw, years) {
        (None, None, _) => {
            if e.dwpd_sequential.is_some() {
                return Err("dwpd_sequential needs dwpd as well".into());
            }
            return Ok(None);
        }
        (Some(_), Some(_), _) => return Err("give dwpd or tbw, not both".into()),
        (_, _, None) => return Err("an endurance rating needs warranty_years".into()),
        (Some(dwpd), None, Some(y)) => {
            let dwpd = within("dwpd", dwpd, DWPD_RANGE)?;
            formulas::endurance_bytes_from_dwpd(capacity_bytes, dwpd, y)
        }
        (None, Some(tbw), Some(_)) => within("tbw", tbw, TBW_RANGE)? * BYTES_PER_TB,
    };
    let sequential_endurance_bytes = match (e.dwpd_sequential, years) {
        (None, _) => None,
        (Some(_), _) if e.dwpd.is_none() => return Err("dwpd_sequential needs dwpd as well".into()),
        (Some(d), Some(y)) => Some(formulas::endurance_bytes_from_dwpd(
            capacity_bytes,
            within("dwpd_sequential", d, DWPD_RANGE)?,
            y,
        )),
        (Some(_), None) => return Err("an endurance rating needs warranty_years".into()),
    };
    Ok(Some(Endurance {
        endurance_bytes,
        sequential_endurance_bytes,
        warranty_years: years.unwrap_or(0.0),
    }))
}

fn device_of(e: Entry, origin: &str) -> Result<Device, String> {
    let id = e.id.trim().to_ascii_lowercase();
    if id.is_empty()
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(format!(
            "id {:?} must be letters, digits, '-', '_' or '.'",
            e.id
        ));
    }
    let at = |r: Result<f64, String>| r.map_err(|m| format!("device {id}: {m}"));
    let capacity_gb = at(within("capacity_gb", e.capacity_gb, CAPACITY_GB_RANGE))?;
    let capacity_bytes = (capacity_gb * BYTES_PER_GB) as u64;
    if capacity_bytes < 1 << 20 {
        return Err(format!(
            "device {id}: capacity_gb {} is less than 1 MiB",
            e.capacity_gb
        ));
    }
    if e.preferred_write_bytes == 0 || !e.preferred_write_bytes.is_multiple_of(512) {
        return Err(format!(
            "device {id}: preferred_write_bytes must be a positive multiple of 512, got {}",
            e.preferred_write_bytes
        ));
    }
    let endurance = endurance_of(&e, capacity_bytes).map_err(|m| format!("device {id}: {m}"))?;
    let latency =
        |what: &str, v: Option<f64>| v.map(|v| at(within(what, v, LATENCY_US_RANGE))).transpose();
    let rate = |what: &str, v: f64| at(within(what, v, MB_PER_S_RANGE)).map(|v| v * BYTES_PER_MB);
    let iops = |what: &str, v: f64| at(within(what, v, IOPS_RANGE));
    Ok(Device {
        name: e.name,
        media: e.media,
        capacity_bytes,
        endurance,
        seq_read_bytes_per_s: rate("seq_read_mb_per_s", e.seq_read_mb_per_s)?,
        seq_write_bytes_per_s: rate("seq_write_mb_per_s", e.seq_write_mb_per_s)?,
        random_read_iops: iops("random_read_iops", e.random_read_iops)?,
        random_write_iops: iops("random_write_iops", e.random_write_iops)?,
        read_latency_us: latency("read_latency_us", e.read_latency_us)?,
        write_latency_us: latency("write_latency_us", e.write_latency_us)?,
        preferred_write_bytes: e.preferred_write_bytes,
        source: e.source,
        origin: origin.to_string(),
        id,
    })
}

/// Parses one catalog text; `origin` names it in errors.
fn parse(text: &str, origin: &str) -> Result<Vec<Device>, String> {
    let file: CatalogFile = toml::from_str(text).map_err(|e| crate::one_line(&e.to_string()))?;
    let mut seen = BTreeMap::new();
    let mut out = Vec::with_capacity(file.device.len());
    for entry in file.device {
        let device = device_of(entry, origin)?;
        if seen.insert(device.id.clone(), ()).is_some() {
            return Err(format!("device {} is listed twice", device.id));
        }
        out.push(device);
    }
    Ok(out)
}

/// The built-in entries, then each user file in order; a later entry replaces an earlier one
/// with the same id.
#[derive(Debug, Clone)]
pub struct Catalog {
    devices: BTreeMap<String, Device>,
}

impl Catalog {
    pub fn builtin() -> Catalog {
        // The built-in file is checked by a unit test; a broken one is a build defect.
        let devices =
            parse(BUILTIN_TOML, "built-in").unwrap_or_else(|e| panic!("built-in catalog: {e}"));
        Catalog {
            devices: devices.into_iter().map(|d| (d.id.clone(), d)).collect(),
        }
    }

    /// The built-in catalog extended and overridden by `files`.
    pub fn load(files: &[PathBuf]) -> Result<Catalog, SizingError> {
        let mut catalog = Catalog::builtin();
        for path in files {
            catalog.add_file(path)?;
        }
        Ok(catalog)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), SizingError> {
        let err = |reason: String| SizingError::Catalog {
            path: path.display().to_string(),
            reason,
        };
        let len = std::fs::metadata(path)
            .map_err(|e| err(crate::io_reason(&e)))?
            .len();
        if len > MAX_CATALOG_FILE_BYTES {
            return Err(err(format!("larger than {MAX_CATALOG_FILE_BYTES} bytes")));
        }
        let text = std::fs::read_to_string(path).map_err(|e| err(crate::io_reason(&e)))?;
        for device in parse(&text, &path.display().to_string()).map_err(err)? {
            self.devices.insert(device.id.clone(), device);
        }
        Ok(())
    }

    pub fn devices(&self) -> impl Iterator<Item = &Device> {
        self.devices.values()
    }

    /// The entry with this id (case-insensitive); an unknown id lists close matches.
    pub fn get(&self, id: &str) -> Result<&Device, SizingError> {
        let key = id.trim().to_ascii_lowercase();
        self.devices
            .get(&key)
            .ok_or_else(|| SizingError::UnknownDevice {
                id: id.to_string(),
                hint: self.suggestions(&key),
            })
    }

    fn suggestions(&self, key: &str) -> String {
        let mut scored: Vec<(usize, &str)> = self
            .devices
            .keys()
            .map(|id| (closeness(key, id), id.as_str()))
            .filter(|(d, id)| *d <= 3 + id.len() / 4)
            .collect();
        scored.sort();
        let close: Vec<&str> = scored
            .iter()
            .take(MAX_SUGGESTIONS)
            .map(|(_, id)| *id)
            .collect();
        if close.is_empty() {
            " (see `strata size --list-devices`)".to_string()
        } else {
            format!(
                " (did you mean {}? see `strata size --list-devices`)",
                close.join(", ")
            )
        }
    }
}

/// Edit distance, with a substring counting as close.
fn closeness(a: &str, b: &str) -> usize {
    if a.len() >= 3 && (b.contains(a) || a.contains(b)) {
        return 1;
    }
    levenshtein(a, b)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitute = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = substitute.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
#[path = "catalog_tests.rs"]
mod tests;

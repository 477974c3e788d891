//! `--read-cache RATIO|auto`: how much of the write log's area the read cache may hold. `auto`
//! gives hybrid nodes (every capacity device rotational) 0.7 and all-flash nodes none. A device
//! is rotational when the kernel says so in `/sys/dev/block/MAJOR:MINOR/queue/rotational`: for
//! a block device its own number, for a regular file the device holding its filesystem, a
//! partition answered by its disk. Anything unknown counts as not rotational.
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The ratio `auto` picks on a hybrid node.
pub const HYBRID_READ_CACHE_RATIO: f64 = 0.7;
/// Largest ratio the engine accepts: the write buffer always keeps a tenth of the log.
pub const MAX_READ_CACHE_RATIO: f64 = 0.9;

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ReadCacheSetting {
    #[default]
    Auto,
    Ratio(f64),
}

/// `read_cache` in the config file: `"auto"`, `0.5`, `0` or `"50%"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ReadCacheValue {
    Int(i64),
    Float(f64),
    Text(String),
}

impl ReadCacheValue {
    pub fn resolve(&self) -> Result<ReadCacheSetting, String> {
        match self {
            ReadCacheValue::Int(n) => check(*n as f64, &n.to_string()),
            ReadCacheValue::Float(x) => check(*x, &x.to_string()),
            ReadCacheValue::Text(s) => parse_setting(s),
        }
    }
}

/// Parses `auto`, a ratio (`0.5`) or a percentage (`50%`), at most 0.9.
pub fn parse_setting(text: &str) -> Result<ReadCacheSetting, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("auto") {
        return Ok(ReadCacheSetting::Auto);
    }
    let (number, scale) = match t.strip_suffix('%') {
        Some(p) => (p.trim(), 100.0),
        None => (t, 1.0),
    };
    let value: f64 = number.parse().map_err(|_| {
        format!("invalid read cache {text:?}: use auto, a ratio like 0.7 or a percentage like 70%")
    })?;
    check(value / scale, text)
}

fn check(value: f64, text: &str) -> Result<ReadCacheSetting, String> {
    if !(0.0..=MAX_READ_CACHE_RATIO).contains(&value) {
        return Err(format!(
            "read cache {text} is out of range: use 0 to {MAX_READ_CACHE_RATIO} (the write buffer keeps the rest of the log), or auto"
        ));
    }
    Ok(ReadCacheSetting::Ratio(value))
}

/// What the daemon chose, and why (shown in the log, /api/v1/status and `strata status`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReadCacheDecision {
    /// Share of the write log's area the read cache may hold.
    pub ratio: f64,
    /// `auto` or `configured`.
    pub setting: String,
    pub reason: String,
}

/// Resolves the setting against the capacity devices.
pub fn decide(setting: ReadCacheSetting, capacity_devices: &[PathBuf]) -> ReadCacheDecision {
    decide_with(setting, capacity_devices, |p| rotational(Path::new("/sys"), p))
}

pub fn decide_with(
    setting: ReadCacheSetting,
    capacity_devices: &[PathBuf],
    probe: impl Fn(&Path) -> Result<bool, String>,
) -> ReadCacheDecision {
    if let ReadCacheSetting::Ratio(ratio) = setting {
        return ReadCacheDecision {
            ratio,
            setting: "configured".into(),
            reason: "set by --read-cache or read_cache in the config file".into(),
        };
    }
    let mut not_rotational = Vec::new();
    for path in capacity_devices {
        match probe(path) {
            Ok(true) => {}
            Ok(false) => not_rotational.push(format!("{} is not rotational", path.display())),
            Err(why) => not_rotational.push(format!(
                "{}: rotation unknown ({why}), counted as not rotational",
                path.display()
            )),
        }
    }
    let (ratio, reason) = if not_rotational.is_empty() && !capacity_devices.is_empty() {
        (
            HYBRID_READ_CACHE_RATIO,
            "every capacity device is rotational (hybrid node)".to_string(),
        )
    } else {
        (0.0, format!("all-flash or unknown: {}", not_rotational.join("; ")))
    };
    ReadCacheDecision {
        ratio,
        setting: "auto".into(),
        reason,
    }
}

/// Whether the device behind `path` is rotational, looked up under `sys_root` (normally /sys).
pub fn rotational(sys_root: &Path, path: &Path) -> Result<bool, String> {
    let meta = std::fs::metadata(path).map_err(|e| crate::io_reason(&e))?;
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    let (major, minor) = split_dev(dev);
    let link = sys_root.join(format!("dev/block/{major}:{minor}"));
    let mut dir = std::fs::canonicalize(&link)
        .map_err(|_| format!("no block device {major}:{minor} in sysfs"))?;
    if dir.join("partition").exists() {
        dir = dir
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| "a partition without a disk".to_string())?;
    }
    let flag = std::fs::read_to_string(dir.join("queue/rotational"))
        .map_err(|_| format!("block device {major}:{minor} does not say"))?;
    match flag.trim() {
        "1" => Ok(true),
        "0" => Ok(false),
        other => Err(format!("unexpected queue/rotational {other:?}")),
    }
}

/// Major and minor numbers of a Linux `dev_t` (glibc's encoding).
pub fn split_dev(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_with_bounds() {
        assert_eq!(parse_setting("auto"), Ok(ReadCacheSetting::Auto));
        assert_eq!(parse_setting("0.5"), Ok(ReadCacheSetting::Ratio(0.5)));
        assert_eq!(parse_setting("70%"), Ok(ReadCacheSetting::Ratio(0.7)));
        assert_eq!(parse_setting("0"), Ok(ReadCacheSetting::Ratio(0.0)));
        assert!(parse_setting("0.95").unwrap_err().contains("out of range"));
        assert!(parse_setting("lots").unwrap_err().contains("invalid read cache"));
        assert!(parse_setting("-0.1").is_err());
        assert_eq!(ReadCacheValue::Int(0).resolve(), Ok(ReadCacheSetting::Ratio(0.0)));
        assert!(ReadCacheValue::Int(1).resolve().is_err());
    }

    #[test]
    fn the_flag_wins_over_the_file_and_auto_is_the_default() {
        let resolve = |flag: Option<&str>, file: &str| {
            let args = crate::ServeArgs {
                read_cache: flag.map(str::to_string),
                ..Default::default()
            };
            let file = crate::config::parse_file(file).map_err(|e| e.to_string())?;
            crate::config::merge(&args, file).map(|c| c.read_cache).map_err(|e| e.to_string())
        };
        assert_eq!(resolve(None, ""), Ok(ReadCacheSetting::Auto));
        assert_eq!(resolve(None, "read_cache = 0.5"), Ok(ReadCacheSetting::Ratio(0.5)));
        assert_eq!(resolve(None, "read_cache = \"30%\""), Ok(ReadCacheSetting::Ratio(0.3)));
        assert_eq!(resolve(Some("auto"), "read_cache = 0.5"), Ok(ReadCacheSetting::Auto));
        assert!(resolve(None, "read_cache = 2").unwrap_err().contains("read_cache in the config file"));
        assert!(resolve(Some("1.5"), "").unwrap_err().contains("out of range"));
    }

    #[test]
    fn auto_needs_every_capacity_device_rotational() {
        let paths = [PathBuf::from("/a"), PathBuf::from("/b")];
        let all = decide_with(ReadCacheSetting::Auto, &paths, |_| Ok(true));
        assert_eq!(all.ratio, HYBRID_READ_CACHE_RATIO);
        let one_ssd = decide_with(ReadCacheSetting::Auto, &paths, |p| Ok(p == Path::new("/a")));
        assert_eq!(one_ssd.ratio, 0.0);
        assert!(one_ssd.reason.contains("/b is not rotational"), "{}", one_ssd.reason);
        let unknown = decide_with(ReadCacheSetting::Auto, &paths, |_| Err("x".into()));
        assert_eq!(unknown.ratio, 0.0);
        assert!(unknown.reason.contains("counted as not rotational"));
        let set = decide_with(ReadCacheSetting::Ratio(0.5), &paths, |_| Ok(true));
        assert_eq!((set.ratio, set.setting.as_str()), (0.5, "configured"));
    }

    #[test]
    fn device_numbers_split_like_glibc() {
        assert_eq!(split_dev(0x0801), (8, 1));
        assert_eq!(split_dev((259 << 8) | 3), (259, 3));
        // A large minor: bits above the low byte live at 20..
        assert_eq!(split_dev((0x12345 >> 8 << 20) | (8 << 8) | 0x45), (8, 0x12345));
    }

    /// A fake sysfs: a regular file whose filesystem lives on a partition of a rotational disk.
    #[test]
    fn partitions_answer_through_their_disk() {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("capacity.img");
        std::fs::write(&file, b"x").unwrap();
        let (major, minor) = split_dev(std::fs::metadata(&file).unwrap().dev());
        let disk = root.path().join("devices/sda");
        let part = disk.join("sda1");
        std::fs::create_dir_all(disk.join("queue")).unwrap();
        std::fs::create_dir_all(&part).unwrap();
        std::fs::write(part.join("partition"), "1\n").unwrap();
        std::fs::write(disk.join("queue/rotational"), "1\n").unwrap();
        std::fs::create_dir_all(root.path().join("dev/block")).unwrap();
        let link = root.path().join(format!("dev/block/{major}:{minor}"));
        std::os::unix::fs::symlink(&part, &link).unwrap();
        assert_eq!(rotational(root.path(), &file), Ok(true));
        std::fs::write(disk.join("queue/rotational"), "0\n").unwrap();
        assert_eq!(rotational(root.path(), &file), Ok(false));
        std::fs::remove_file(&link).unwrap();
        assert!(rotational(root.path(), &file).unwrap_err().contains("no block device"));
    }
}

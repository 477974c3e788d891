//! `--read-cache RATIO|auto`: how much of the write log's area the read cache may hold. `auto`
//! gives hybrid nodes 0.7 and all-flash nodes none. A node is hybrid when every capacity device
//! is rotational and none shares a disk with the fast device (a copy on the disk it came from
//! saves no seek; a single virtual disk, which often reports itself rotational, is the common
//! case). A device is rotational when the kernel says so in
//! `/sys/dev/block/MAJOR:MINOR/queue/rotational`: for a block device its own number, for a
//! regular file the device holding its filesystem, a partition answered by its disk, a loop
//! device by the disk holding its backing file. Anything unknown counts as not rotational. A
//! capacity device slowed down by `--capacity-emulate` counts as a device of its own.
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
#[serde(
    untagged,
    expecting = "\"auto\", a ratio from 0 to 1 (0.5) or a percentage (\"50%\")"
)]
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

/// What sysfs says about the disk behind a path.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    /// The whole disk's sysfs directory, when found (two paths on one disk share it).
    pub disk: Option<PathBuf>,
    pub rotational: Result<bool, String>,
}

/// The devices a decision looks at.
pub struct Devices<'a> {
    pub fast: &'a Path,
    pub capacity: &'a [PathBuf],
    /// The capacity devices are slowed down by a device model (`--capacity-emulate`).
    pub capacity_emulated: bool,
}

/// Resolves the setting against the devices.
pub fn decide(setting: ReadCacheSetting, devices: &Devices) -> ReadCacheDecision {
    decide_with(setting, devices, |p| probe(Path::new("/sys"), p))
}

pub fn decide_with(
    setting: ReadCacheSetting,
    devices: &Devices,
    probe: impl Fn(&Path) -> Probe,
) -> ReadCacheDecision {
    if let ReadCacheSetting::Ratio(ratio) = setting {
        return ReadCacheDecision {
            ratio,
            setting: "configured".into(),
            reason: "set by --read-cache or read_cache in the config file".into(),
        };
    }
    let fast_disk = probe(devices.fast).disk;
    let mut not_hybrid = Vec::new();
    for path in devices.capacity {
        let found = probe(path);
        let shared = !devices.capacity_emulated && found.disk.is_some() && found.disk == fast_disk;
        match found.rotational {
            _ if shared => {
                not_hybrid.push(format!("{} is on the fast device's disk", path.display()))
            }
            Ok(true) => {}
            Ok(false) => not_hybrid.push(format!("{} is not rotational", path.display())),
            Err(why) => not_hybrid.push(format!(
                "{}: rotation unknown ({why}), counted as not rotational",
                path.display()
            )),
        }
    }
    let (ratio, reason) = if not_hybrid.is_empty() && !devices.capacity.is_empty() {
        (
            HYBRID_READ_CACHE_RATIO,
            "every capacity device is rotational, on a disk of its own (hybrid node)".to_string(),
        )
    } else {
        (0.0, format!("not a hybrid node: {}", not_hybrid.join("; ")))
    };
    ReadCacheDecision {
        ratio,
        setting: "auto".into(),
        reason,
    }
}

/// Looks up the disk behind `path` under `sys_root` (normally /sys).
pub fn probe(sys_root: &Path, path: &Path) -> Probe {
    match disk_of(sys_root, path) {
        Ok(disk) => Probe {
            rotational: rotational_of(&disk),
            disk: Some(disk),
        },
        Err(why) => Probe {
            disk: None,
            rotational: Err(why),
        },
    }
}

/// Loop devices followed to their backing files' disks, at most this many deep.
const MAX_LOOP_DEPTH: usize = 8;

/// The sysfs directory of the whole disk holding `path` (a block device, or a file's filesystem).
fn disk_of(sys_root: &Path, path: &Path) -> Result<PathBuf, String> {
    disk_of_dev(sys_root, device_number(path)?, MAX_LOOP_DEPTH)
}

/// The device a path is (a block device) or lives on (a file).
fn device_number(path: &Path) -> Result<u64, String> {
    let meta = std::fs::metadata(path).map_err(|e| crate::io_reason(&e))?;
    Ok(if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    })
}

/// The whole disk of device `dev`: a partition answers through its disk, and a loop device
/// through the disk holding its backing file, so two loop devices backed by files on one disk
/// (or one beside the other tier's file) share it, as the files would.
fn disk_of_dev(sys_root: &Path, dev: u64, loops_left: usize) -> Result<PathBuf, String> {
    let (major, minor) = split_dev(dev);
    let link = sys_root.join(format!("dev/block/{major}:{minor}"));
    let dir = std::fs::canonicalize(&link)
        .map_err(|_| format!("no block device {major}:{minor} in sysfs"))?;
    if let Ok(backing) = std::fs::read_to_string(dir.join("loop/backing_file")) {
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        if loops_left == 0 {
            return Err(format!("{name}: loop devices nested too deep"));
        }
        let backing = Path::new(backing.trim_end_matches('\n'));
        let dev = device_number(backing)
            .map_err(|why| format!("{name}: backing file {}: {why}", backing.display()))?;
        return disk_of_dev(sys_root, dev, loops_left - 1);
    }
    if dir.join("partition").exists() {
        return dir
            .parent()
            .map(Path::to_path_buf)
            .ok_or_else(|| "a partition without a disk".to_string());
    }
    Ok(dir)
}

fn rotational_of(disk: &Path) -> Result<bool, String> {
    let flag = std::fs::read_to_string(disk.join("queue/rotational"))
        .map_err(|_| format!("{} does not say whether it is rotational", disk.display()))?;
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
        assert!(parse_setting("lots")
            .unwrap_err()
            .contains("invalid read cache"));
        assert!(parse_setting("-0.1").is_err());
        assert_eq!(
            ReadCacheValue::Int(0).resolve(),
            Ok(ReadCacheSetting::Ratio(0.0))
        );
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
            crate::config::merge(&args, file)
                .map(|c| c.read_cache)
                .map_err(|e| e.to_string())
        };
        assert_eq!(resolve(None, ""), Ok(ReadCacheSetting::Auto));
        assert_eq!(
            resolve(None, "read_cache = 0.5"),
            Ok(ReadCacheSetting::Ratio(0.5))
        );
        assert_eq!(
            resolve(None, "read_cache = \"30%\""),
            Ok(ReadCacheSetting::Ratio(0.3))
        );
        assert_eq!(
            resolve(Some("auto"), "read_cache = 0.5"),
            Ok(ReadCacheSetting::Auto)
        );
        assert!(resolve(None, "read_cache = 2")
            .unwrap_err()
            .contains("read_cache in the config file"));
        assert!(resolve(Some("1.5"), "")
            .unwrap_err()
            .contains("out of range"));
    }

    #[test]
    fn auto_needs_every_capacity_device_rotational_on_a_disk_of_its_own() {
        let paths = [PathBuf::from("/a"), PathBuf::from("/b")];
        let devices = |capacity_emulated| Devices {
            fast: Path::new("/fast"),
            capacity: &paths,
            capacity_emulated,
        };
        // Each path its own disk, named after it; the fast device's disk is not rotational.
        let on = |rotational: fn(&Path) -> bool| {
            move |p: &Path| Probe {
                disk: Some(p.to_path_buf()),
                rotational: Ok(p != Path::new("/fast") && rotational(p)),
            }
        };
        let all = decide_with(ReadCacheSetting::Auto, &devices(false), on(|_| true));
        assert_eq!(all.ratio, HYBRID_READ_CACHE_RATIO, "{}", all.reason);
        let one_ssd = decide_with(
            ReadCacheSetting::Auto,
            &devices(false),
            on(|p| p == Path::new("/a")),
        );
        assert_eq!(one_ssd.ratio, 0.0);
        assert!(
            one_ssd.reason.contains("/b is not rotational"),
            "{}",
            one_ssd.reason
        );
        let unknown = |p: &Path| Probe {
            disk: Some(p.to_path_buf()),
            rotational: Err("x".into()),
        };
        let unknown = decide_with(ReadCacheSetting::Auto, &devices(false), unknown);
        assert_eq!(unknown.ratio, 0.0);
        assert!(unknown.reason.contains("counted as not rotational"));
        // Everything on one rotational disk (a virtual machine's single disk): no read cache,
        // unless the capacity device is emulated as a device of its own.
        let one_disk = |_: &Path| Probe {
            disk: Some(PathBuf::from("/sys/devices/vda")),
            rotational: Ok(true),
        };
        let shared = decide_with(ReadCacheSetting::Auto, &devices(false), one_disk);
        assert_eq!(shared.ratio, 0.0);
        assert!(
            shared.reason.contains("/a is on the fast device's disk"),
            "{}",
            shared.reason
        );
        let emulated = decide_with(ReadCacheSetting::Auto, &devices(true), one_disk);
        assert_eq!(
            emulated.ratio, HYBRID_READ_CACHE_RATIO,
            "{}",
            emulated.reason
        );
        let set = decide_with(ReadCacheSetting::Ratio(0.5), &devices(false), one_disk);
        assert_eq!((set.ratio, set.setting.as_str()), (0.5, "configured"));
    }

    #[test]
    fn device_numbers_split_like_glibc() {
        assert_eq!(split_dev(0x0801), (8, 1));
        assert_eq!(split_dev((259 << 8) | 3), (259, 3));
        // A large minor: bits above the low byte live at 20..
        assert_eq!(
            split_dev((0x12345 >> 8 << 20) | (8 << 8) | 0x45),
            (8, 0x12345)
        );
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
        let found = probe(root.path(), &file);
        assert_eq!(found.rotational, Ok(true));
        assert_eq!(found.disk, Some(std::fs::canonicalize(&disk).unwrap()));
        // A second file on the same filesystem is on the same disk.
        let other = root.path().join("fast.img");
        std::fs::write(&other, b"y").unwrap();
        assert_eq!(probe(root.path(), &other).disk, found.disk);
        std::fs::write(disk.join("queue/rotational"), "0\n").unwrap();
        assert_eq!(probe(root.path(), &file).rotational, Ok(false));
        std::fs::remove_file(&link).unwrap();
        let gone = probe(root.path(), &file);
        assert!(gone.rotational.unwrap_err().contains("no block device"));
        assert_eq!(gone.disk, None);
    }

    /// A fake sysfs: a loop device whose backing file lives on a partition of a disk answers
    /// through that disk, the one a file beside the backing file answers through: the tiers
    /// share it. It was taken for a disk of its own (a hybrid node: 70% of the log for a read
    /// cache that only copies data within one disk).
    #[test]
    fn loop_devices_answer_through_their_backing_files_disk() {
        let root = tempfile::tempdir().unwrap();
        let backing = root.path().join("cap0.raw");
        let fast = root.path().join("fast.img");
        std::fs::write(&backing, b"x").unwrap();
        std::fs::write(&fast, b"y").unwrap();
        let (major, minor) = split_dev(std::fs::metadata(&backing).unwrap().dev());
        let disk = root.path().join("devices/vda");
        std::fs::create_dir_all(disk.join("queue")).unwrap();
        std::fs::write(disk.join("queue/rotational"), "1\n").unwrap();
        let loop_dir = root.path().join("devices/virtual/block/loop1");
        std::fs::create_dir_all(loop_dir.join("loop")).unwrap();
        std::fs::create_dir_all(loop_dir.join("queue")).unwrap();
        std::fs::write(loop_dir.join("queue/rotational"), "1\n").unwrap();
        let backing_line = format!("{}\n", backing.display());
        std::fs::write(loop_dir.join("loop/backing_file"), backing_line).unwrap();
        let links = root.path().join("dev/block");
        std::fs::create_dir_all(&links).unwrap();
        std::os::unix::fs::symlink(&disk, links.join(format!("{major}:{minor}"))).unwrap();
        let loop_minor = 987_654;
        std::os::unix::fs::symlink(&loop_dir, links.join(format!("7:{loop_minor}"))).unwrap();
        let loop_dev = libc::makedev(7, loop_minor);

        let found = disk_of_dev(root.path(), loop_dev, MAX_LOOP_DEPTH).unwrap();
        assert_eq!(found, std::fs::canonicalize(&disk).unwrap());
        assert_eq!(Some(found), probe(root.path(), &fast).disk);
        // A backing file gone since (the kernel keeps it open): unknown, not the loop itself.
        std::fs::remove_file(&backing).unwrap();
        let deleted = format!("{} (deleted)\n", backing.display());
        std::fs::write(loop_dir.join("loop/backing_file"), deleted).unwrap();
        let gone = disk_of_dev(root.path(), loop_dev, MAX_LOOP_DEPTH).unwrap_err();
        assert!(gone.contains("loop1: backing file"), "{gone}");
        assert!(disk_of_dev(root.path(), loop_dev, 0)
            .unwrap_err()
            .contains("nested too deep"));
    }
}

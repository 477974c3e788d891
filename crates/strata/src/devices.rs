//! Opening the devices of a disk group: files are created on first start (the fast tier
//! allocated and written with zeros, the capacity tier sparse), block devices are used as
//! they are. An existing fast-tier file is allocated only once it is known to be one the
//! engine will take (blank, or a Strata fast device). With `--fast-emulate` /
//! `--capacity-emulate` (benchmarking aids) a device is wrapped in the device layer's
//! `Throttled` model and its name says "emulated", so every report built from device names
//! (API, dashboard, `strata bench`) states it.
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use strata_device::{
    Device, DeviceError, DurableWrite, EmulationSpec, IoBackend, OpenOptions, Throttled,
};
use strata_engine::format::{Role, Superblock, SuperblockRead};

use crate::config::{format_size, IoBackendChoice, ServeConfig};

pub struct OpenedDevices {
    pub fast: Arc<dyn Device>,
    pub capacity: Vec<Arc<dyn Device>>,
    /// "io_uring" or "threads", as the device layer reports it.
    pub io_backend: String,
    /// What this start created, for [`Created::remove`] if the start fails later.
    pub created: Created,
}

/// Device files and directories a start created. A start that fails removes them again, so
/// it leaves nothing behind: a size refused by the engine can be corrected on the next try
/// (an existing file is never resized).
#[derive(Debug, Default)]
pub struct Created {
    dirs: Vec<PathBuf>,
    files: Vec<PathBuf>,
}

impl Created {
    /// Removes the files, then the directories if they are empty, newest first. Call it only
    /// once the devices are closed.
    pub fn remove(&self) {
        for file in self.files.iter().rev() {
            match std::fs::remove_file(file) {
                Ok(()) => {
                    tracing::info!(path = %file.display(), "removed the device file this failed start created")
                }
                Err(e) => {
                    tracing::warn!(path = %file.display(), error = %e, "cannot remove a device file this failed start created")
                }
            }
        }
        for dir in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Opens (and creates) the devices `cfg` names. Setting `abandon` stops the creation of a
/// fast-tier file: the open then fails with an error [`is_abandoned`] recognises, after
/// removing whatever it created.
pub fn open_devices(cfg: &ServeConfig, abandon: &Arc<AtomicBool>) -> Result<OpenedDevices> {
    let mut created = Created::default();
    let opened = open_all(cfg, &mut created, abandon);
    // On an error the devices opened so far are closed by now.
    opened
        .map(|(fast, capacity, io_backend)| OpenedDevices {
            fast,
            capacity,
            io_backend,
            created: std::mem::take(&mut created),
        })
        .inspect_err(|_| created.remove())
}

type Opened = (Arc<dyn Device>, Vec<Arc<dyn Device>>, String);

/// Whether `e` is the failure of an open whose creation of a device file was abandoned.
pub fn is_abandoned(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref(), Some(DeviceError::Abandoned(_)))
}

fn open_all(cfg: &ServeConfig, created: &mut Created, abandon: &Arc<AtomicBool>) -> Result<Opened> {
    let size = cfg.fast_size_bytes;
    let refuse = || missing_fast_device(cfg);
    let fast = open_one(&cfg.fast_device, size, true, cfg, created, abandon, &refuse)?;
    if let Some(note) = copy_on_write_fast_file(&cfg.fast_device) {
        tracing::warn!(path = %cfg.fast_device.display(), "{note}");
    }
    warn_unused_size(&fast, cfg.fast_size_bytes, cfg.fast_size_given, "fast-size");
    warn_grown(fast.as_ref());
    // Before any capacity file is made: one the group does not have would be made for nothing.
    check_capacity_count(fast.as_ref(), cfg.capacity_devices.len())?;
    let group = strata_engine::read_superblock(fast.as_ref()).ok().flatten();
    let group = group.filter(|sb| sb.role == Role::Fast);
    let io_backend = fast.io_backend_name().to_string();
    let fast = emulate(fast, cfg.emulation.fast.as_ref());
    let capacity = cfg
        .capacity_devices
        .iter()
        .enumerate()
        .map(|(index, path)| {
            let size = cfg.capacity_size_bytes;
            let refuse = || missing_capacity_device(cfg, index, group.as_ref());
            let device = open_one(path, size, false, cfg, created, abandon, &refuse)?;
            warn_unused_size(&device, size, cfg.capacity_size_given, "capacity-size");
            warn_grown(device.as_ref());
            if let Some(note) = unbacked_capacity_file(path, device.size_bytes()) {
                tracing::warn!(path = %path.display(), "{note}");
            }
            Ok(emulate(device, cfg.emulation.capacity.as_ref()))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((fast, capacity, io_backend))
}

/// Refuses to create a missing fast device file when a capacity device belongs to a disk group:
/// the group has a fast device elsewhere (a wrong path, or a file system not mounted), and a
/// new blank one in its place would only be refused by the engine.
fn missing_fast_device(cfg: &ServeConfig) -> Result<()> {
    let Some((capacity, sb)) = cfg
        .capacity_devices
        .iter()
        .find_map(|path| Some((path, superblock_at(path)?)))
    else {
        return Ok(());
    };
    Err(anyhow!(
        "fast device {} does not exist, and capacity device {} belongs to disk group {}, which \
         cannot be opened without its fast device: {} was not created. Check first that the \
         path is right ({}), and that the file system that holds it is mounted",
        cfg.fast_device.display(),
        capacity.display(),
        strata_engine::format::uuid_hex(&sb.group),
        cfg.fast_device.display(),
        named_by(
            cfg,
            &cfg.fast_device,
            "--fast-device, or fast_device in the config file"
        )
    ))
}

/// Refuses to create missing capacity device file `index` of a disk group (`group`: the fast
/// device's superblock): the group's device is elsewhere, and a new blank one would only be
/// refused by the engine.
fn missing_capacity_device(
    cfg: &ServeConfig,
    index: usize,
    group: Option<&Superblock>,
) -> Result<()> {
    let Some(sb) = group else { return Ok(()) };
    let path = &cfg.capacity_devices[index];
    Err(anyhow!(
        "capacity device {} does not exist, and disk group {} on fast device {} has it as \
         capacity device #{index}: {} was not created, as a new file would be blank. Check \
         first that the path is right ({}), and that the file system that holds it is mounted",
        path.display(),
        strata_engine::format::uuid_hex(&sb.group),
        cfg.fast_device.display(),
        path.display(),
        named_by(
            cfg,
            path,
            "--capacity-device, or capacity_devices in the config file"
        )
    ))
}

/// The setting that names device file `path`: the data directory for a file in it, else
/// `setting`, the device's own.
fn named_by<'a>(cfg: &ServeConfig, path: &Path, setting: &'a str) -> &'a str {
    match path.parent() == Some(cfg.data_dir.as_path()) {
        true => "--data-dir, or data_dir in the config file, names the directory that holds it",
        false => setting,
    }
}

/// The first valid superblock copy of a device not opened yet, read with a plain open that
/// changes nothing; None for a device that holds none, or cannot be read.
fn superblock_at(path: &Path) -> Option<Superblock> {
    use std::os::unix::fs::FileExt;
    use strata_engine::format::BLOCK;
    let file = std::fs::File::open(path).ok()?;
    let mut copies = vec![0u8; 2 * BLOCK];
    file.read_exact_at(&mut copies, 0).ok()?;
    copies
        .chunks(BLOCK)
        .find_map(|copy| match Superblock::decode(copy) {
            SuperblockRead::Valid(sb) => Some(sb),
            _ => None,
        })
}

/// A fast device file whose overwrites take new space on its file system (copy-on-write):
/// once that file system is full, a write to the log fails and the disk group goes offline.
/// Files Strata creates on btrfs are marked No_COW; this is for one made before, or by hand.
pub fn copy_on_write_fast_file(path: &Path) -> Option<String> {
    let Some(fs) = strata_device::copy_on_write_file(path) else {
        let shared = strata_device::shared_bytes_of(path).filter(|&n| n > 0)?;
        return Some(format!(
            "fast device file {} shares {} of its blocks with another file or a file system \
             snapshot (a reflinked copy, cp --reflink; a btrfs snapshot): the first overwrite \
             of each takes new space, so if that file system fills up before, a write to the \
             log fails and the disk group goes offline until a restart; delete the copy or \
             snapshot, or keep that file system from filling",
            path.display(),
            format_size(shared)
        ));
    };
    let how = match fs {
        "btrfs" => {
            "mark a copy of it No_COW with Strata stopped (README, \"The fast tier on btrfs\"), \
             or keep that file system from filling"
        }
        _ => "give the fast tier a file system that overwrites in place, or a device of its own",
    };
    Some(format!(
        "fast device file {} is on {fs}, which writes every overwrite to new space: if that \
         file system fills up, a write to the log fails and the disk group goes offline until \
         a restart; {how}",
        path.display()
    ))
}

/// A sparse capacity file whose file system has less room than the file may still take: once
/// it is used, capacity writes fail with ENOSPC (the engine pauses destaging until there is
/// room again, and host writes fail once the write log fills). None for a block device, a
/// file allocated in full, or a file system with room enough.
pub fn unbacked_capacity_file(path: &Path, size_bytes: u64) -> Option<String> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok().filter(|m| m.is_file())?;
    let unallocated = size_bytes.saturating_sub(meta.blocks() * 512);
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: a zeroed statvfs is a valid value for the kernel to fill.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: statvfs reads the NUL-terminated path and writes one statvfs through the
    // pointer, which points to `st`.
    if unsafe { libc::statvfs(name.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    (unallocated > free).then(|| {
        format!(
            "capacity file {} is {} but its file system has only {} free: once that is used, \
             destaging pauses and writes fail with ENOSPC until there is room again (make room \
             there, or give the capacity tier a file system or device of its own)",
            path.display(),
            format_size(size_bytes),
            format_size(free)
        )
    })
}

/// A fast device of an existing group names how many capacity devices the group has: a start
/// that names another number is refused here, saying how to name them (a group first started
/// with two `--capacity-device` flags and started again with the defaults names one).
fn check_capacity_count(fast: &dyn Device, given: usize) -> Result<()> {
    let Ok(Some(sb)) = strata_engine::read_superblock(fast) else {
        // Blank (a new group), or unreadable: the engine says what is wrong with it.
        return Ok(());
    };
    let has = sb.capacity_devices as usize;
    if sb.role != Role::Fast || has == given {
        return Ok(());
    }
    let devices = |n: usize| match n {
        1 => "1 capacity device".to_string(),
        n => format!("{n} capacity devices"),
    };
    let named = if given == 1 { "was" } else { "were" };
    Err(anyhow!(
        "the disk group on {} has {}, but {} {named} named: name each of them, in the order of the group's first start, with --capacity-device (or capacity_devices in the config file)",
        fast.name(),
        devices(has),
        given
    ))
}

/// A size asked for applies only to a file this start creates: says so when an existing
/// device has another size (block devices included: their size is their own).
fn warn_unused_size(device: &Arc<dyn Device>, asked: u64, given: bool, key: &str) {
    if given && device.size_bytes() != asked {
        tracing::warn!(
            device = device.name(),
            size_bytes = device.size_bytes(),
            asked_bytes = asked,
            "{key} is not applied: the device exists with another size, and Strata never resizes one"
        );
    }
}

fn warn_grown(device: &dyn Device) {
    if let Some(note) = grown_device(device) {
        tracing::warn!(
            device = device.name(),
            size_bytes = device.size_bytes(),
            "{note}"
        );
    }
}

/// A device of a disk group that is larger than when the group was formatted on it (a LUN or
/// a file grown since): the group keeps to the size in its superblock, so the rest stays
/// unused. The device tables show both sizes, and wear is a share of the formatted one
/// (`WearJson::formatted_size_bytes`). None for a blank device, one of its formatted size, or
/// one the engine will refuse (unreadable; smaller).
pub fn grown_device(device: &dyn Device) -> Option<String> {
    let sb = strata_engine::read_superblock(device).ok()??;
    let size = device.size_bytes() / 4096 * 4096;
    (size > sb.device_size_bytes).then(|| {
        format!(
            "device {} is {}, but its disk group was formatted on the first {} of it and uses \
             only those: a disk group never grows onto a larger device, so the rest stays unused",
            device.name(),
            format_size(device.size_bytes()),
            format_size(sb.device_size_bytes)
        )
    })
}

/// What to tell a user whose `segment-size` differs from the size the disk group was formatted
/// with: only a group's first start applies it, and a group's segments never change size.
pub fn unused_segment_size(cfg: &ServeConfig, formatted_bytes: u64) -> Option<String> {
    let asked = cfg.engine.segment_size_bytes;
    (cfg.segment_size_given && asked != formatted_bytes).then(|| {
        format!(
            "segment-size {} is not applied: the disk group was formatted with {} segments, and a group keeps the size it was made with",
            crate::config::format_size(asked),
            crate::config::format_size(formatted_bytes)
        )
    })
}

/// Wraps a device in its emulated model, if one was asked for.
fn emulate(device: Arc<dyn Device>, spec: Option<&EmulationSpec>) -> Arc<dyn Device> {
    let Some(spec) = spec else { return device };
    tracing::warn!(device = device.name(), model = %spec.label, "device emulation on: a benchmarking aid, not for production");
    Arc::new(Throttled::new(device, spec.config).with_label(&spec.label))
}

/// Opens `path`, creating it when it does not exist and `refuse_creation` does not refuse.
fn open_one(
    path: &Path,
    create_size_bytes: u64,
    preallocate: bool,
    cfg: &ServeConfig,
    created: &mut Created,
    abandon: &Arc<AtomicBool>,
    refuse_creation: &dyn Fn() -> Result<()>,
) -> Result<Arc<dyn Device>> {
    let fresh = !path.exists();
    // A missing path under /dev is a disk that is not there (not attached yet, or a typo): a
    // file made in its place would live in memory, and everything written to it would be
    // gone at the next boot. (/dev/shm is memory by choice: benchmarks use it.)
    if fresh && path.starts_with("/dev") && !path.starts_with("/dev/shm") {
        return Err(anyhow!(
            "device {} does not exist: is the disk attached, and the path right? (Strata \
             creates missing device files, but not under /dev)",
            path.display()
        ));
    }
    // A link to nothing (a disk named by a link that is not attached) is not a file to create.
    if fresh && path.symlink_metadata().is_ok() {
        let target = std::fs::read_link(path).unwrap_or_default();
        return Err(anyhow!(
            "device {} is a symbolic link to {}, which does not exist",
            path.display(),
            target.display()
        ));
    }
    if fresh {
        refuse_creation()?;
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            let missing: Vec<PathBuf> = parent
                .ancestors()
                .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
                .map(Path::to_path_buf)
                .collect();
            std::fs::create_dir_all(parent).map_err(|e| {
                // The OS says "file exists" of a file where a directory should be made.
                if let Some(file) = parent.ancestors().find(|d| d.exists() && !d.is_dir()) {
                    let hint = if file == cfg.data_dir {
                        " (--data-dir, or data_dir in the config file, names the directory that holds the device files)"
                    } else {
                        ""
                    };
                    return anyhow!(
                        "cannot create device file {}: {} is a file, not a directory{hint}",
                        path.display(),
                        file.display()
                    );
                }
                anyhow!(
                    "cannot create directory {}: {}",
                    parent.display(),
                    crate::io_reason(&e)
                )
            })?;
            created.dirs.extend(missing.into_iter().rev());
        }
        tracing::info!(path = %path.display(), size_bytes = create_size_bytes, preallocate, "creating device file");
    }
    if let Some(why) = read_only_block_device(Path::new("/sys"), path) {
        return Err(anyhow!("cannot open device {}: {why}", path.display()));
    }
    let device = if preallocate && !fresh && path.is_file() {
        open_existing_fast_file(path, create_size_bytes, cfg)?
    } else {
        let (backend, durable_write) = (cfg.io_backend, cfg.durable_write);
        let how = How {
            preallocate,
            backend,
            durable_write,
            abandon: Some(abandon.clone()),
        };
        open_with(path, create_size_bytes, how)?
    };
    if fresh {
        created.files.push(path.to_path_buf());
    }
    tracing::info!(path = %path.display(), size_bytes = device.size_bytes(), backend = device.io_backend_name(), "opened device");
    Ok(device)
}

/// Opens an existing regular file for the fast tier, allocated in full only if the engine will
/// take it: blank, or holding a Strata fast-device superblock. Anything else (another group's
/// sparse capacity file given by mistake, a disk image) the engine refuses, and allocating it
/// first could fill the file system for nothing; it is handed on as it is, to be refused.
fn open_existing_fast_file(
    path: &Path,
    create_size_bytes: u64,
    cfg: &ServeConfig,
) -> Result<Arc<dyn Device>> {
    let (backend, durable_write) = (cfg.io_backend, cfg.durable_write);
    let how = |preallocate| How {
        preallocate,
        backend,
        durable_write,
        abandon: None,
    };
    let device = open_with(path, create_size_bytes, how(false))?;
    let takes = blank_or_fast(device.as_ref());
    if !takes {
        tracing::warn!(path = %path.display(), "the fast device file is neither blank nor a Strata fast device: not allocating it");
        return Ok(device);
    }
    // The device layer locks a file and claims it in the process while it is open: the
    // first handle must be closed before the second opens.
    drop(device);
    open_with(path, create_size_bytes, how(true))
}

/// Whether the engine will take `device` as a fast device: a valid fast-device superblock, or
/// a blank device (no superblock, and zeros near either end: the engine's own checks). A device
/// whose superblock cannot be read or decoded is not: the engine refuses it with the reason.
fn blank_or_fast(device: &dyn Device) -> bool {
    match strata_engine::read_superblock(device) {
        Ok(Some(sb)) => sb.role == Role::Fast,
        Ok(None) => strata_engine::check_blank(device).is_ok(),
        Err(_) => false,
    }
}

/// How [`open_with`] opens a device.
struct How {
    preallocate: bool,
    backend: IoBackendChoice,
    durable_write: DurableWrite,
    /// Stops the creation of a preallocated file ([`OpenOptions::abandon_creation`]).
    abandon: Option<Arc<AtomicBool>>,
}

/// The one place that knows the device layer's opening API.
fn open_with(path: &Path, create_size_bytes: u64, how: How) -> Result<Arc<dyn Device>> {
    let backend = match how.backend {
        IoBackendChoice::Auto => IoBackend::Auto,
        IoBackendChoice::IoUring => IoBackend::IoUring,
        IoBackendChoice::Threads => IoBackend::ThreadPool,
    };
    let options = OpenOptions {
        create_size_bytes: Some(create_size_bytes),
        preallocate: how.preallocate,
        backend,
        durable_write: how.durable_write,
        abandon_creation: how.abandon,
    };
    strata_device::open_with(path, &options).map_err(|e| match e {
        // Already names the path; but a device that cannot be written at all is said to be so
        // rather than to lack O_DIRECT (the device layer's open says which it tried).
        DeviceError::Open(msg) => match unwritable(path) {
            Some(reason) => anyhow!("cannot open device {}: {reason}", path.display()),
            None => anyhow!("cannot open device {}", crate::one_line(&msg)),
        },
        // Kept as it is, for `is_abandoned`.
        e @ DeviceError::Abandoned(_) => anyhow::Error::new(e),
        e => anyhow!(
            "cannot open device {}: {}",
            path.display(),
            crate::one_line(&e.to_string())
        ),
    })
}

/// Why block device `path` cannot be written, when the kernel holds it read-only
/// (`/sys/dev/block/MAJOR:MINOR/ro`: `blockdev --setro`, `losetup -r`, a write-protected
/// disk). Such a device opens for writing and takes reads but fails every write, so a first
/// start formatted the devices named before it and then failed on it ("Operation not
/// permitted"), leaving them marked as part of a group that was never made. None for a file,
/// or when sysfs does not say.
fn read_only_block_device(sys_root: &Path, path: &Path) -> Option<String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(path).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let (major, minor) = crate::read_cache::split_dev(meta.rdev());
    let flag = std::fs::read_to_string(sys_root.join(format!("dev/block/{major}:{minor}/ro")));
    (flag.ok()?.trim() == "1").then(|| {
        "it is a read-only block device (the kernel refuses writes to it: `blockdev --setrw`, \
         or a loop device attached without -r)"
            .to_string()
    })
}

/// Why `path` cannot be written, if that is why a device open failed: it is on a read-only
/// file system, or this user may not write it (or, for a file still to be made, its
/// directory). Asked only after a failure, with plain opens that change nothing.
fn unwritable(path: &Path) -> Option<String> {
    let probe = if path.exists() {
        std::fs::OpenOptions::new().write(true).open(path).map(drop)
    } else {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let dir = dir.unwrap_or(Path::new("."));
        // A directory cannot be opened for writing: ask the kernel whether it could be written.
        let c_dir = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
        // SAFETY: a valid NUL-terminated path; access() only reads it.
        match unsafe { libc::access(c_dir.as_ptr(), libc::W_OK) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    };
    let e = probe.err()?;
    match e.raw_os_error() {
        Some(libc::EROFS) => Some("it is on a read-only file system".into()),
        Some(libc::EACCES) | Some(libc::EPERM) => Some(format!(
            "permission denied: this user may not write {}",
            if path.exists() { "it" } else { "its directory" }
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{merge, parse_file};
    use crate::ServeArgs;
    use strata_engine::format::Superblock;

    fn args_in(dir: &Path) -> ServeArgs {
        ServeArgs {
            data_dir: Some(dir.to_path_buf()),
            fast_size: Some(16 << 20),
            capacity_size: Some(16 << 20),
            ..ServeArgs::default()
        }
    }

    /// A data directory, or a device file's directory, that is a regular file is named as
    /// such, not with the OS's "file exists"; the file is left as it was.
    #[test]
    fn a_file_where_a_directory_should_be_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"keep me").unwrap();
        let refusal = |args: &ServeArgs| {
            let cfg = merge(args, Default::default()).unwrap();
            let e = open_devices(&cfg, &Default::default()).err();
            e.expect("refused").to_string()
        };
        assert_eq!(
            refusal(&args_in(&file)),
            format!(
                "cannot create device file {}: {} is a file, not a directory (--data-dir, or \
                 data_dir in the config file, names the directory that holds the device files)",
                file.join("fast.img").display(),
                file.display()
            )
        );
        // A device path under a file deeper down: the file is named, without the data-dir hint.
        let mut args = args_in(dir.path());
        args.fast_device = Some(file.join("sub").join("fast.img"));
        assert_eq!(
            refusal(&args),
            format!(
                "cannot create device file {}: {} is a file, not a directory",
                file.join("sub").join("fast.img").display(),
                file.display()
            )
        );
        assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    }

    #[test]
    fn emulated_devices_say_so_in_their_names() {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args_in(dir.path());
        args.fast_emulate = Some("nand-a,scale=0.01".into());
        let file = parse_file("capacity_emulate = \"bw=20MB\"").unwrap();
        let cfg = merge(&args, file).unwrap();
        let devs = open_devices(&cfg, &Default::default()).unwrap();
        assert!(
            devs.fast
                .name()
                .ends_with("[emulated nand-a x0.01: bw 19.8 MB/s, 50/50 7.7 MB/s]"),
            "{}",
            devs.fast.name()
        );
        assert_eq!(devs.fast.stats().name, devs.fast.name());
        assert!(devs.capacity[0]
            .name()
            .ends_with("[emulated: bw 20.0 MB/s]"));
        assert!(!devs.io_backend.contains("emulated"));
    }

    #[test]
    fn without_emulation_devices_keep_their_paths() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = merge(&args_in(dir.path()), Default::default()).unwrap();
        let devs = open_devices(&cfg, &Default::default()).unwrap();
        assert!(
            devs.fast.name().ends_with("fast.img"),
            "{}",
            devs.fast.name()
        );
    }

    /// A superblock of either role, encoded as the engine writes it.
    fn superblock(role: Role) -> Vec<u8> {
        Superblock {
            version: strata_engine::format::GROUP_VERSION,
            role,
            group: [7; 16],
            device_index: 0,
            capacity_devices: 1,
            device_size_bytes: 16 << 20,
            segment_size_bytes: 1 << 20,
            checkpoint_offsets: [1 << 20, 2 << 20],
            checkpoint_size_bytes: 1 << 20,
            log_offset: 4 << 20,
            log_size_bytes: 12 << 20,
            segments_offset: 1 << 20,
            segment_count: 15,
            stamp: 0,
        }
        .encode()
    }

    #[test]
    fn an_existing_fast_file_is_allocated_only_if_the_engine_will_take_it() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let size: u64 = 16 << 20;
        // What is written where in a sparse file, and whether it is then allocated.
        type Writes<'a> = &'a [(u64, Vec<u8>)];
        let cases: [(&str, Writes, bool); 5] = [
            ("blank", &[], true),
            (
                "a fast device",
                &[(0, superblock(Role::Fast)), (4096, superblock(Role::Fast))],
                true,
            ),
            (
                "a capacity device",
                &[
                    (0, superblock(Role::Capacity)),
                    (4096, superblock(Role::Capacity)),
                ],
                false,
            ),
            ("not Strata's", &[(0, b"not a superblock".to_vec())], false),
            (
                "a label at the end",
                &[(size - 512, vec![0xaa; 512])],
                false,
            ),
        ];
        for (what, writes, allocated) in cases {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("fast.img");
            let file = std::fs::File::create(&path).unwrap();
            file.set_len(size).unwrap();
            for (at, bytes) in writes {
                file.write_all_at(bytes, *at).unwrap();
            }
            file.sync_all().unwrap();
            drop(file);
            // A capacity file of a group that is missing is not created: here it is blank.
            let capacity = std::fs::File::create(dir.path().join("capacity-0.img")).unwrap();
            capacity.set_len(16 << 20).unwrap();
            let before = std::fs::read(&path).unwrap();
            let cfg = merge(&args_in(dir.path()), Default::default()).unwrap();
            let devs = open_devices(&cfg, &Default::default()).unwrap();
            drop(devs);
            let allocated_bytes = std::fs::metadata(&path).unwrap().blocks() * 512;
            if allocated {
                assert!(
                    allocated_bytes >= size,
                    "{what}: {allocated_bytes} bytes allocated"
                );
            } else {
                assert!(
                    allocated_bytes < 1 << 20,
                    "{what}: {allocated_bytes} bytes allocated"
                );
            }
            assert!(
                std::fs::read(&path).unwrap() == before,
                "{what}: the file changed"
            );
        }
    }

    /// A device grown since its group was formatted on it is named at start, with both sizes
    /// (it was used at its formatted size without a word, while the device tables showed
    /// its new size).
    #[test]
    fn a_device_grown_since_it_was_formatted_is_named() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fast.img");
        let file = std::fs::File::create(&path).unwrap();
        // `superblock` says 16 MiB: first the file as formatted, then grown to 32 MiB.
        file.set_len(16 << 20).unwrap();
        file.write_all_at(&superblock(Role::Fast), 0).unwrap();
        file.write_all_at(&superblock(Role::Fast), 4096).unwrap();
        // A capacity file of a group that is missing is not created: here it is blank.
        let capacity = std::fs::File::create(dir.path().join("capacity-0.img")).unwrap();
        capacity.set_len(16 << 20).unwrap();
        let cfg = merge(&args_in(dir.path()), Default::default()).unwrap();
        let devs = open_devices(&cfg, &Default::default()).unwrap();
        assert_eq!(grown_device(devs.fast.as_ref()), None);
        assert_eq!(grown_device(devs.capacity[0].as_ref()), None, "blank");
        drop(devs);
        file.set_len(32 << 20).unwrap();
        let devs = open_devices(&cfg, &Default::default()).unwrap();
        let note = grown_device(devs.fast.as_ref()).expect("a note for the grown device");
        assert!(
            note.ends_with(
                "fast.img is 32 MiB, but its disk group was formatted on the first 16 MiB of it \
                 and uses only those: a disk group never grows onto a larger device, so the \
                 rest stays unused"
            ),
            "{note}"
        );
    }

    /// A capacity file shrunk since its group was made on it is refused, saying by how much
    /// (the refusal named neither size).
    #[test]
    fn a_device_shrunk_since_it_was_formatted_is_refused_with_both_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args_in(dir.path());
        args.capacity_size = Some(64 << 20);
        let cfg = merge(&args, Default::default()).unwrap();
        let open = || {
            let devs = open_devices(&cfg, &Default::default()).unwrap();
            let engine = strata_engine::EngineConfig::default();
            strata_engine::DiskGroup::open(devs.fast, devs.capacity, engine, true)
                .map(|group| group.shutdown().unwrap())
        };
        open().unwrap();
        let capacity = dir.path().join("capacity-0.img");
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&capacity)
            .unwrap();
        file.set_len(32 << 20).unwrap();
        let e = open().unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "device {} is smaller than when it was formatted: 33554432 bytes, where its \
                 disk group was formatted on 67108864 bytes of it",
                capacity.display()
            )
        );
    }

    #[test]
    fn a_link_to_nothing_is_refused_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("disk-not-attached");
        std::os::unix::fs::symlink(&missing, dir.path().join("fast.img")).unwrap();
        let cfg = merge(&args_in(dir.path()), Default::default()).unwrap();
        let e = open_devices(&cfg, &Default::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("is a symbolic link to") && e.contains("which does not exist"),
            "{e}"
        );
        assert!(!missing.exists());
        assert!(!dir.path().join("capacity-0.img").exists());
    }

    #[test]
    fn a_bad_spec_is_refused_before_any_device_is_touched() {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args_in(&dir.path().join("never"));
        args.fast_emulate = Some("bw=fast".into());
        let e = merge(&args, Default::default()).unwrap_err().to_string();
        assert!(e.starts_with("fast-emulate: invalid emulation spec"), "{e}");
        assert!(!dir.path().join("never").exists());
    }

    /// Opens the group the configuration names, as serve does, and closes it again.
    fn formatted_segment_size(cfg: &ServeConfig) -> u64 {
        let devs = open_devices(cfg, &Default::default()).unwrap();
        let group =
            strata_engine::DiskGroup::open(devs.fast, devs.capacity, cfg.engine.clone(), true)
                .unwrap();
        let formatted = group.open_report().segment_size_bytes;
        group.shutdown().unwrap();
        formatted
    }

    /// `strata serve`'s defaults format a new group of format 3: every segment summary twice.
    #[test]
    fn a_new_group_is_formatted_with_two_summary_copies() {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args_in(dir.path());
        args.fast_size = Some(64 << 20);
        args.capacity_size = Some(64 << 20);
        let cfg = merge(&args, Default::default()).unwrap();
        let devs = open_devices(&cfg, &Default::default()).unwrap();
        let group =
            strata_engine::DiskGroup::open(devs.fast, devs.capacity, cfg.engine.clone(), true)
                .unwrap();
        assert_eq!(group.open_report().format_version, 3);
        group.shutdown().unwrap();
    }

    #[test]
    fn a_segment_size_the_group_was_not_made_with_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args_in(dir.path());
        args.fast_size = Some(64 << 20);
        args.capacity_size = Some(64 << 20);
        args.segment_size = Some(8 << 20);
        let first = merge(&args, Default::default()).unwrap();
        assert_eq!(formatted_segment_size(&first), 8 << 20);
        assert_eq!(unused_segment_size(&first, 8 << 20), None);

        args.segment_size = Some(16 << 20);
        let later = merge(&args, Default::default()).unwrap();
        let formatted = formatted_segment_size(&later);
        assert_eq!(formatted, 8 << 20, "a group keeps its segment size");
        let note = unused_segment_size(&later, formatted).expect("a note for 16 MiB against 8 MiB");
        assert!(note.contains("16 MiB") && note.contains("8 MiB"), "{note}");

        args.segment_size = None;
        let unasked = merge(&args, Default::default()).unwrap();
        assert_eq!(
            unused_segment_size(&unasked, formatted_segment_size(&unasked)),
            None
        );
    }

    /// A group first started with two capacity devices, started again naming one (the
    /// defaults): refused with how to name them, and no capacity file is made for it. The
    /// engine's own refusal said "1 were given".
    #[test]
    fn a_start_naming_fewer_capacity_devices_than_the_group_has_says_how_to_name_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut args = args_in(dir.path());
        args.fast_size = Some(64 << 20);
        args.capacity_size = Some(64 << 20);
        args.capacity_devices = vec![dir.path().join("c0.img"), dir.path().join("c1.img")];
        let two = merge(&args, Default::default()).unwrap();
        formatted_segment_size(&two);

        args.capacity_devices.clear();
        let one = merge(&args, Default::default()).unwrap();
        let e = open_devices(&one, &Default::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("has 2 capacity devices, but 1 was named: name each of them"),
            "{e}"
        );
        assert!(
            !dir.path().join("capacity-0.img").exists(),
            "a capacity file was made"
        );
        args.capacity_devices = ["c0.img", "c1.img", "c2.img"]
            .map(|f| dir.path().join(f))
            .into();
        let three = merge(&args, Default::default()).unwrap();
        let e = open_devices(&three, &Default::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("has 2 capacity devices, but 3 were named"),
            "{e}"
        );
        assert!(
            !dir.path().join("c2.img").exists(),
            "a capacity file was made"
        );
    }

    /// A device file of a disk group that is missing (a wrong path, or its file system not
    /// mounted) is not created: the start is refused, naming the path and what to check first.
    /// It was created, refused by the engine as blank (a missing fast device with the advice to
    /// wipe the capacity device), and removed again.
    #[test]
    fn a_missing_device_file_of_a_disk_group_is_not_created() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("elsewhere");
        let mut args = args_in(dir.path());
        args.fast_size = Some(64 << 20);
        args.capacity_size = Some(64 << 20);
        let in_data_dir = merge(&args, Default::default()).unwrap();
        args.fast_device = Some(elsewhere.join("f.img"));
        args.capacity_devices = vec![elsewhere.join("c.img")];
        let named = merge(&args, Default::default()).unwrap();
        let data_dir_hint = "--data-dir, or data_dir in the config file, names the directory \
                             that holds it";
        let configs = [
            (&in_data_dir, data_dir_hint, data_dir_hint),
            (
                &named,
                "--fast-device, or fast_device in the config file",
                "--capacity-device, or capacity_devices in the config file",
            ),
        ];
        for (cfg, fast_hint, capacity_hint) in configs {
            formatted_segment_size(cfg);
            let (fast, capacity) = (&cfg.fast_device, &cfg.capacity_devices[0]);
            let group = strata_engine::format::uuid_hex(&superblock_at(fast).unwrap().group);
            let (f, c) = (fast.display(), capacity.display());
            let cases = [
                (
                    fast,
                    format!(
                        "fast device {f} does not exist, and capacity device {c} belongs to \
                         disk group {group}, which cannot be opened without its fast device: \
                         {f} was not created. Check first that the path is right \
                         ({fast_hint}), and that the file system that holds it is mounted"
                    ),
                ),
                (
                    capacity,
                    format!(
                        "capacity device {c} does not exist, and disk group {group} on fast \
                         device {f} has it as capacity device #0: {c} was not created, as a \
                         new file would be blank. Check first that the path is right \
                         ({capacity_hint}), and that the file system that holds it is mounted"
                    ),
                ),
            ];
            for (missing, expected) in cases {
                let aside = dir.path().join("aside.img");
                std::fs::rename(missing, &aside).unwrap();
                let e = open_devices(cfg, &Default::default())
                    .err()
                    .map(|e| e.to_string());
                assert_eq!(e.as_deref(), Some(expected.as_str()));
                assert!(!missing.exists(), "{} was created", missing.display());
                std::fs::rename(&aside, missing).unwrap();
            }
            formatted_segment_size(cfg);
        }
    }

    /// A tmpfs mounted for a test, unmounted when dropped.
    struct Mount(std::ffi::CString);

    impl Mount {
        /// None where this process may not mount (not root, or a sandbox that forbids it).
        fn tmpfs(dir: &Path) -> Option<Mount> {
            let target = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: valid NUL-terminated strings for the duration of the call.
            let rc = unsafe {
                libc::mount(
                    c"tmpfs".as_ptr(),
                    target.as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    c"size=8m".as_ptr().cast(),
                )
            };
            (rc == 0).then_some(Mount(target))
        }

        fn make_read_only(&self) {
            let flags = libc::MS_REMOUNT | libc::MS_RDONLY;
            // SAFETY: as in `tmpfs`; remounts what this guard mounted.
            let rc = unsafe {
                libc::mount(
                    std::ptr::null(),
                    self.0.as_ptr(),
                    std::ptr::null(),
                    flags,
                    std::ptr::null(),
                )
            };
            assert_eq!(
                rc,
                0,
                "remount read-only: {}",
                std::io::Error::last_os_error()
            );
        }
    }

    impl Drop for Mount {
        fn drop(&mut self) {
            // SAFETY: unmounts what this guard mounted.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }

    /// A loop device over a file, detached on drop; None where this process may not attach
    /// one (not root, no loop devices, no losetup).
    struct LoopDevice(String);

    impl LoopDevice {
        fn attach(file: &Path, read_only: bool) -> Option<LoopDevice> {
            let mut cmd = std::process::Command::new("losetup");
            if read_only {
                cmd.arg("--read-only");
            }
            let out = cmd.args(["--find", "--show"]).arg(file).output().ok()?;
            let device = String::from_utf8_lossy(&out.stdout).trim().to_string();
            (out.status.success() && device.starts_with("/dev/loop")).then_some(LoopDevice(device))
        }
    }

    impl Drop for LoopDevice {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.0])
                .status();
        }
    }

    /// A read-only block device as the fast device, a writable one as the capacity device: the
    /// start is refused, naming why, before anything is written. It failed in the middle of
    /// formatting ("device error: /dev/loopN: I/O error at offset 1048576: Operation not
    /// permitted"), with the capacity device already marked as a member of a group that was
    /// never made, so the next start, on a writable fast device, was refused too.
    #[test]
    fn a_read_only_block_device_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (fast_file, cap_file) = (dir.path().join("fast.raw"), dir.path().join("cap.raw"));
        for (file, len) in [(&fast_file, 32 << 20), (&cap_file, 64 << 20)] {
            std::fs::File::create(file).unwrap().set_len(len).unwrap();
        }
        let (Some(fast), Some(cap)) = (
            LoopDevice::attach(&fast_file, true),
            LoopDevice::attach(&cap_file, false),
        ) else {
            eprintln!("SKIPPED: this process may not attach loop devices");
            return;
        };
        let mut args = args_in(dir.path());
        args.fast_device = Some(PathBuf::from(&fast.0));
        args.capacity_devices = vec![PathBuf::from(&cap.0)];
        let cfg = merge(&args, Default::default()).unwrap();
        // As `strata serve` goes: the devices, then the group (formatted, as they are blank).
        let opened = open_devices(&cfg, &Default::default()).and_then(|devs| {
            let engine = strata_engine::EngineConfig::default();
            strata_engine::DiskGroup::open(devs.fast, devs.capacity, engine, true)
                .map(drop)
                .map_err(|e| anyhow!("cannot open the disk group: {e}"))
        });
        let e = opened.expect_err("a read-only fast device").to_string();
        let fast_name = fast.0.clone();
        drop((fast, cap));
        let written = std::fs::read(&cap_file).unwrap().iter().any(|&b| b != 0);
        assert!(
            !written,
            "the capacity device was written; the start said: {e}"
        );
        assert_eq!(
            e,
            format!(
                "cannot open device {}: it is a read-only block device (the kernel refuses \
                 writes to it: `blockdev --setrw`, or a loop device attached without -r)",
                fast_name
            )
        );
    }

    /// Device files on a read-only file system, there or still to be made, are refused as
    /// such: the device layer's open names O_DIRECT, which was not the trouble.
    #[test]
    fn a_read_only_file_system_is_named_as_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let Some(mount) = Mount::tmpfs(dir.path()) else {
            eprintln!("SKIPPED: this process may not mount a tmpfs to make read-only");
            return;
        };
        let (existing, empty) = (dir.path().join("existing"), dir.path().join("empty"));
        std::fs::create_dir(&existing).unwrap();
        std::fs::create_dir(&empty).unwrap();
        for name in ["fast.img", "capacity-0.img"] {
            let file = std::fs::File::create(existing.join(name)).unwrap();
            file.set_len(2 << 20).unwrap();
        }
        mount.make_read_only();
        for data_dir in [&existing, &empty] {
            let mut args = args_in(data_dir);
            args.fast_size = Some(2 << 20);
            let cfg = merge(&args, Default::default()).unwrap();
            let e = open_devices(&cfg, &Default::default())
                .err()
                .unwrap()
                .to_string();
            let fast = data_dir.join("fast.img");
            assert_eq!(
                e,
                format!(
                    "cannot open device {}: it is on a read-only file system",
                    fast.display()
                )
            );
        }
        drop(mount);
    }
}

//! A real filesystem on a Strata volume: nbdfuse exposes the export as a file, a loop device
//! turns it into a block device, ext4 goes on top. Needs root and /dev/fuse.
use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const FS_TOOLS: &[&str] = &[
    "nbdfuse",
    "fusermount3",
    "losetup",
    "mkfs.ext4",
    "fsck.ext4",
    "mount",
    "umount",
];
const FILE_COUNT: usize = 12;

fn environment_allows_it() -> bool {
    let missing = if !is_root() {
        Some("not running as root")
    } else if !Path::new("/dev/fuse").exists() {
        Some("/dev/fuse is missing")
    } else if !Path::new("/dev/loop-control").exists() {
        Some("/dev/loop-control is missing (no loop devices)")
    } else {
        None
    };
    if let Some(why) = missing {
        eprintln!("\n!!!!!!!! SKIPPING e2e_fs: {why}; the filesystem test needs root, FUSE and loop devices !!!!!!!!\n");
        return false;
    }
    require_tools(FS_TOOLS)
}

/// nbdfuse serving the export as `dir/disk`; unmounted and stopped on drop.
struct FuseFile {
    dir: PathBuf,
    process: ChildGuard,
}

impl FuseFile {
    fn start(dir: &Path, uri: &str) -> FuseFile {
        std::fs::create_dir_all(dir).expect("fuse dir");
        let file = dir.join("disk");
        let mut process = ChildGuard::spawn(
            cmd("nbdfuse", &[file.to_str().expect("utf-8"), uri])
                .stdin(std::process::Stdio::null()),
        );
        let appeared = wait_until(Duration::from_secs(20), || {
            std::fs::metadata(&file)
                .map(|m| m.len() > 0)
                .unwrap_or(false)
        });
        if !appeared {
            let status = process.wait_timeout(Duration::ZERO);
            panic!(
                "nbdfuse did not expose {} within 20 s (status {status:?})",
                file.display()
            );
        }
        FuseFile {
            dir: dir.to_path_buf(),
            process,
        }
    }

    fn file(&self) -> PathBuf {
        self.dir.join("disk")
    }

    fn unmount(mut self) {
        run_ok(
            &mut cmd("fusermount3", &["-u", self.dir.to_str().expect("utf-8")]),
            CMD_TIMEOUT,
        );
        let status = self.process.wait_timeout(Duration::from_secs(20));
        assert!(
            matches!(status, Some(s) if s.success()),
            "nbdfuse exit after unmount: {status:?}"
        );
    }
}

impl Drop for FuseFile {
    fn drop(&mut self) {
        if self.process.child.is_some() {
            let _ = cmd(
                "fusermount3",
                &["-u", "-z", self.dir.to_str().unwrap_or_default()],
            )
            .status();
        }
    }
}

/// A loop device over a file; detached on drop.
struct Loop {
    device: Option<String>,
}

impl Loop {
    fn attach(file: &Path) -> Loop {
        let out = run_ok(
            &mut cmd(
                "losetup",
                &["--find", "--show", file.to_str().expect("utf-8")],
            ),
            CMD_TIMEOUT,
        );
        let device = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(
            device.starts_with("/dev/loop"),
            "losetup printed {device:?}"
        );
        Loop {
            device: Some(device),
        }
    }

    fn device(&self) -> &str {
        self.device.as_deref().expect("attached")
    }

    fn detach(mut self) {
        let device = self.device.take().expect("attached");
        run_ok(&mut cmd("losetup", &["-d", &device]), CMD_TIMEOUT);
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        if let Some(device) = self.device.take() {
            let _ = cmd("losetup", &["-d", &device]).status();
        }
    }
}

/// A mounted filesystem; lazily unmounted on drop.
struct Mount {
    dir: Option<PathBuf>,
}

impl Mount {
    fn new(device: &str, dir: &Path) -> Mount {
        std::fs::create_dir_all(dir).expect("mount dir");
        run_ok(
            &mut cmd(
                "mount",
                &["-t", "ext4", device, dir.to_str().expect("utf-8")],
            ),
            CMD_TIMEOUT,
        );
        Mount {
            dir: Some(dir.to_path_buf()),
        }
    }

    fn path(&self) -> &Path {
        self.dir.as_deref().expect("mounted")
    }

    fn unmount(mut self) {
        let dir = self.dir.take().expect("mounted");
        run_ok(
            &mut cmd("umount", &[dir.to_str().expect("utf-8")]),
            CMD_TIMEOUT,
        );
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(dir) = self.dir.take() {
            let _ = cmd("umount", &["-l", dir.to_str().unwrap_or_default()]).status();
        }
    }
}

/// Files of assorted sizes (a few MiB in all), some in a subdirectory.
fn test_files(seed: u64) -> Vec<(String, Vec<u8>)> {
    (0..FILE_COUNT)
        .map(|i| {
            let name = if i % 3 == 0 {
                format!("sub/file-{i}")
            } else {
                format!("file-{i}")
            };
            let len = [1, 4095, 4096, 65537, 300_000, 1 << 20][i % 6] + i * 512;
            (name, random_bytes(len, seed ^ i as u64))
        })
        .collect()
}

#[test]
fn ext4_on_nbdfuse_and_a_loop_device_stays_clean() {
    if !environment_allows_it() {
        return;
    }
    let daemon = Daemon::start_default();
    daemon.create_volume("fs", "256M");
    let uri = daemon.nbd_uri("fs");
    let dir = daemon.scratch_dir();
    let files = test_files(test_seed("ext4_on_nbdfuse_and_a_loop_device_stays_clean"));

    // Declared in this order so that on a panic the guards drop in reverse: umount, losetup -d,
    // fusermount3 -u.
    let fuse = FuseFile::start(&dir.join("fuse"), &uri);
    let lo = Loop::attach(&fuse.file());
    run_ok(
        &mut cmd(
            "mkfs.ext4",
            &[
                "-F",
                "-q",
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0",
                lo.device(),
            ],
        ),
        Duration::from_secs(120),
    );
    let mnt = Mount::new(lo.device(), &dir.join("mnt"));
    std::fs::create_dir_all(mnt.path().join("sub")).expect("mkdir");
    for (name, content) in &files {
        std::fs::write(mnt.path().join(name), content).expect("write file");
    }
    run_ok(&mut cmd("sync", &[]), CMD_TIMEOUT);
    mnt.unmount();
    lo.detach();
    fuse.unmount();

    // A new FUSE mount, loop device and page cache: everything below comes from the daemon.
    let fuse = FuseFile::start(&dir.join("fuse"), &uri);
    let lo = Loop::attach(&fuse.file());
    let out = run_timeout(
        &mut cmd("fsck.ext4", &["-f", "-n", lo.device()]),
        Duration::from_secs(120),
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "fsck found problems\n{}",
        output_report("fsck.ext4 -f -n", &out)
    );
    let mnt = Mount::new(lo.device(), &dir.join("mnt"));
    for (name, content) in &files {
        let actual = std::fs::read(mnt.path().join(name)).expect("read file back");
        assert_same_bytes(name, content, &actual);
    }
    mnt.unmount();
    lo.detach();
    fuse.unmount();
}

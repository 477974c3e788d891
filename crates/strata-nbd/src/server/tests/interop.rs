//! Real clients against the in-memory server: nbdinfo (libnbd) and qemu-io (QEMU's NBD
//! client). Each test prints a notice and passes if its binary is not installed.

use std::process::Output;
use std::time::Duration;

use tokio::process::Command;

use super::backend::{Op, DISK_SIZE};
use super::TestServer;

fn installed(binary: &str) -> bool {
    let found = std::process::Command::new("which")
        .arg(binary)
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        println!("NOTICE: {binary} not installed; skipping this interoperability test");
    }
    found
}

/// Runs a client command with a deadline so a protocol bug fails instead of hanging.
async fn run(program: &str, args: &[&str]) -> Output {
    let mut command = Command::new(program);
    command.args(args).kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(20), command.output())
        .await
        .unwrap_or_else(|_| panic!("{program} {args:?} timed out"))
        .unwrap_or_else(|e| panic!("{program} failed to start: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_reads_export_details_list_and_map() {
    if !installed("nbdinfo") {
        return;
    }
    let server = TestServer::default().await;
    let uri = format!("nbd://{}/disk", server.addr);
    let details = stdout(&run("nbdinfo", &[&uri]).await);
    assert!(
        details.contains(&format!("export-size: {DISK_SIZE}")),
        "{details}"
    );
    assert!(details.contains("can_multi_conn: true"), "{details}");
    assert!(details.contains("base:allocation"), "{details}");

    let list = stdout(&run("nbdinfo", &["--list", &format!("nbd://{}", server.addr)]).await);
    assert!(
        list.contains("export=\"disk\"") || list.contains("export=disk"),
        "{list}"
    );
    assert!(list.contains("test disk"), "{list}");
    assert!(list.contains("read-only disk"), "{list}");

    let map = stdout(&run("nbdinfo", &["--map", &uri]).await);
    assert!(map.contains("hole,zero"), "a fresh disk is one hole: {map}");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_writes_reads_zeroes_discards_and_flushes() {
    if !installed("qemu-io") {
        return;
    }
    let server = TestServer::default().await;
    let uri = format!("nbd://{}/disk", server.addr);
    // Offsets avoid the backend's gated (1 MiB) and failing (2 MiB) reads.
    let commands = [
        "write -P 0x5a 0 64k",
        "read -P 0x5a 0 64k",
        "write -z 64k 64k",
        "read -P 0 64k 64k",
        "write -z -u -n 128k 64k",    // may unmap, fast zero
        "write -f -P 0x33 512k 128k", // FUA
        "read -P 0x33 512k 128k",
        "discard 512k 64k",
        "write -P 0x77 3m 1m",
        "read -P 0x77 3m 1m",
        "flush",
    ];
    let mut args = vec!["-f", "raw", uri.as_str()];
    for c in &commands {
        args.extend(["-c", c]);
    }
    let output = run("qemu-io", &args).await;
    let text = format!(
        "{}{}",
        stdout(&output),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!text.contains("failed"), "{text}");
    assert!(!text.contains("Pattern verification"), "{text}");
    assert_eq!(server.backend.disk.bytes(0, 4), [0x5a; 4]);
    assert_eq!(server.backend.disk.bytes(3 << 20, 4), [0x77; 4]);
    let ops = server.backend.disk.ops();
    assert!(
        ops.contains(&Op::Write {
            offset: 512 << 10,
            len: 128 << 10,
            fua: true
        }),
        "{ops:?}"
    );
    assert!(
        ops.contains(&Op::WriteZeroes {
            offset: 128 << 10,
            len: 64 << 10,
            may_trim: true
        }),
        "{ops:?}"
    );
    assert!(
        ops.contains(&Op::Trim {
            offset: 512 << 10,
            len: 64 << 10
        }),
        "{ops:?}"
    );
    assert!(ops.contains(&Op::Flush), "{ops:?}");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_sees_a_read_only_export() {
    if !installed("qemu-io") {
        return;
    }
    let server = TestServer::default().await;
    let uri = format!("nbd://{}/ro", server.addr);
    let output = run(
        "qemu-io",
        &["-r", "-f", "raw", &uri, "-c", "read -P 0xa5 0 1m"],
    )
    .await;
    assert!(!stdout(&output).contains("failed"));
    let refused = Command::new("qemu-io")
        .args(["-f", "raw", &uri, "-c", "write 0 4k"])
        .kill_on_drop(true)
        .output();
    let refused = tokio::time::timeout(Duration::from_secs(60), refused)
        .await
        .unwrap()
        .unwrap();
    let text = format!(
        "{}{}",
        stdout(&refused),
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(
        !refused.status.success()
            || text.contains("failed")
            || text.contains("read-only")
            || text.contains("Permission"),
        "{text}"
    );
    server.stop().await.unwrap();
}

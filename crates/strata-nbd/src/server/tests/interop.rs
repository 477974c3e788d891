//! Real clients against the in-memory server: nbdinfo (libnbd) and qemu-io (QEMU's NBD
//! client). Each test prints a notice and passes if its binary is not installed.
//!
//! Clients run with stdin closed and in their own process group: qemu-io switches terminal
//! echo off when its stdin is a terminal, and if the test runs in a background process group
//! of that terminal the kernel answers with SIGTTOU to the whole group, which would stop the
//! test process itself, and with it every timeout here.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;

use super::backend::{Op, DISK_SIZE};
use super::TestServer;

/// How long a client may run before it is killed and the test fails.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long to wait for a client's output to end once it has exited or been killed.
const OUTPUT_GRACE: Duration = Duration::from_secs(5);

/// Looks `binary` up on PATH without starting a process.
fn installed(binary: &str) -> bool {
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| executable(&dir.join(binary))));
    if !found {
        println!("NOTICE: {binary} not installed; skipping this interoperability test");
    }
    found
}

async fn read_all(pipe: Option<impl AsyncRead + Unpin>) -> Vec<u8> {
    let mut buf = Vec::new();
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_end(&mut buf).await;
    }
    buf
}

/// Runs a client to completion; if it takes longer than [`CLIENT_TIMEOUT`] it is killed
/// and the test fails with whatever it printed. Its exit status is not checked.
async fn run_client(program: &str, args: &[&str]) -> Output {
    run_client_env(program, args, &[]).await
}

/// [`run_client`] with more environment variables.
async fn run_client_env(program: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{program} failed to start: {e}"));
    // Drained while it runs, so a chatty client never blocks on a full pipe.
    let stdout = tokio::spawn(read_all(child.stdout.take()));
    let stderr = tokio::spawn(read_all(child.stderr.take()));
    let status = tokio::time::timeout(CLIENT_TIMEOUT, child.wait()).await;
    if status.is_err() {
        let _ = child.kill().await; // SIGKILL, then reap
    }
    // Bounded too, in case the client left a helper process holding its pipes.
    let collect = |pipe: tokio::task::JoinHandle<Vec<u8>>| async {
        match tokio::time::timeout(OUTPUT_GRACE, pipe).await {
            Ok(Ok(bytes)) => bytes,
            _ => b"<output not collected>".to_vec(),
        }
    };
    let (stdout, stderr) = (collect(stdout).await, collect(stderr).await);
    let Ok(status) = status else {
        panic!(
            "{program} {args:?} timed out after {CLIENT_TIMEOUT:?} and was killed\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        );
    };
    let status = status.unwrap_or_else(|e| panic!("waiting for {program}: {e}"));
    Output {
        status,
        stdout,
        stderr,
    }
}

/// Runs a client (see [`run_client`]) and asserts that it succeeded.
async fn run(program: &str, args: &[&str]) -> Output {
    let output = run_client(program, args).await;
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
    let refused = run_client("qemu-io", &["-f", "raw", &uri, "-c", "write 0 4k"]).await;
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

/// Over the connection limit, qemu-io and nbdinfo fail with the server's reason, not a bare
/// "server disconnected". libnbd 1.14 (nbdinfo) logs an option error's message only in its
/// debug output, so nbdinfo runs with LIBNBD_DEBUG=1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_over_the_connection_limit_say_why() {
    let server = TestServer::start(crate::ServerConfig {
        max_connections: 1,
        ..crate::ServerConfig::default()
    })
    .await;
    let (mut holder, _) = super::client::Client::simple(server.addr, "disk").await;
    let uri = format!("nbd://{}/disk", server.addr);
    let qemu_io = ["-f", "raw", &uri, "-c", "read 0 4k"];
    assert_refused_with_reason("qemu-io", &qemu_io, &[]).await;
    assert_refused_with_reason("nbdinfo", &[&uri], &[("LIBNBD_DEBUG", "1")]).await;
    assert_eq!(holder.read(0, 8).await.error, 0, "the holder is unaffected");
    server.stop().await.unwrap();
}

/// Runs a client that must fail and print why the server refused it (if it is installed).
async fn assert_refused_with_reason(program: &str, args: &[&str], env: &[(&str, &str)]) {
    if !installed(program) {
        return;
    }
    let output = run_client_env(program, args, env).await;
    let text = format!(
        "{}{}",
        stdout(&output),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "{program}: {text}");
    let reason = "too many connections (limit 1); try again later";
    assert!(text.contains(reason), "{program} does not say why: {text}");
}

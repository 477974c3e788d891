//! fio's nbd engine with data verification against a live daemon.
use crate::common;

use std::time::Duration;

use common::*;
use serde_json::Value;

/// One fio pass over 64 MiB of small durable writes takes 5-30 s on a busy 2-core machine.
const FIO_TIMEOUT: Duration = Duration::from_secs(180);

/// Mixed 4 KiB / 512 B random writes over a 64 MiB region, queue depth 16, every block
/// carrying a crc32c header that fio checks on read-back.
fn fio_verify_cmd(uri: &str, out_json: &str, extra: &[&str]) -> std::process::Command {
    let mut c = cmd(
        "fio",
        &[
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bssplit=4k/70:512/30",
            "--size=64m",
            "--iodepth=16",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--randseed=20240611",
            "--output-format=json",
            &format!("--output={out_json}"),
        ],
    );
    c.args(extra);
    in_scratch(c, out_json)
}

/// fio drops verify state files into its working directory; keep them out of the repo.
fn in_scratch(mut c: std::process::Command, out_json: &str) -> std::process::Command {
    c.arg("--verify_state_save=0");
    c.current_dir(
        std::path::Path::new(out_json)
            .parent()
            .expect("scratch dir"),
    );
    c
}

fn fio_job(out_json: &str) -> Value {
    let text = std::fs::read_to_string(out_json).expect("fio output");
    let report: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("fio JSON ({e}):\n{text}"));
    report["jobs"][0].clone()
}

fn assert_fio_ok(run: &str, out_json: &str, out: &std::process::Output) {
    let job = fio_job(out_json);
    assert!(
        out.status.success() && job["error"] == 0,
        "fio {run}: exit {} error {}\n{}\n{job:#}",
        out.status,
        job["error"],
        output_report("fio", out)
    );
}

#[test]
fn fio_random_mixed_size_writes_verify_crc32c() {
    if !require_tools(&["fio"]) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    let dir = daemon.scratch_dir();
    let region_bytes = 64 * MIB;

    // Write every block once, then read all of it back and check each block's crc32c.
    let first = dir.join("write.json");
    let first = first.to_str().expect("utf-8");
    let out = run_timeout(
        &mut fio_verify_cmd(&uri, first, &["--do_verify=1"]),
        FIO_TIMEOUT,
    );
    assert_fio_ok("write+verify", first, &out);
    let job = fio_job(first);
    assert_eq!(
        job["write"]["io_bytes"].as_u64(),
        Some(region_bytes),
        "{job:#}"
    );
    assert_eq!(
        job["read"]["io_bytes"].as_u64(),
        Some(region_bytes),
        "verify pass did not read everything: {job:#}"
    );

    // A second process on a fresh connection verifies the same blocks again.
    let second = dir.join("verify.json");
    let second = second.to_str().expect("utf-8");
    let out = run_timeout(
        &mut fio_verify_cmd(&uri, second, &["--verify_only=1"]),
        FIO_TIMEOUT,
    );
    assert_fio_ok("verify_only", second, &out);
    assert_eq!(
        fio_job(second)["read"]["io_bytes"].as_u64(),
        Some(region_bytes)
    );

    // The check has teeth: after clobbering one block, verify_only must fail.
    qemu_io_ok(&uri, &["write -P 0 1048576 65536"]);
    let third = dir.join("corrupt.json");
    let third = third.to_str().expect("utf-8");
    let out = run_timeout(
        &mut fio_verify_cmd(&uri, third, &["--verify_only=1"]),
        FIO_TIMEOUT,
    );
    assert!(
        !out.status.success() && fio_job(third)["error"] != 0,
        "fio missed a clobbered block"
    );
}

#[test]
fn fio_two_jobs_on_separate_connections_verify() {
    if !require_tools(&["fio"]) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    let dir = daemon.scratch_dir();
    let out_json = dir.join("jobs.json");
    let out_json = out_json.to_str().expect("utf-8");
    // Two connections writing neighbouring 32 MiB ranges at once, each verifying its own.
    let c = cmd(
        "fio",
        &[
            "--name=pair",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bssplit=4k/50:64k/20:512/30",
            "--size=32m",
            "--offset_increment=32m",
            "--numjobs=2",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--output-format=json",
            &format!("--output={out_json}"),
        ],
    );
    let mut c = in_scratch(c, out_json);
    let out = run_timeout(&mut c, FIO_TIMEOUT);
    let text = std::fs::read_to_string(out_json).expect("fio output");
    let report: Value = serde_json::from_str(&text).expect("fio JSON");
    let jobs = report["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 2, "{report:#}");
    for job in jobs {
        assert!(
            out.status.success() && job["error"] == 0,
            "fio job failed: {job:#}\n{}",
            output_report("fio", &out)
        );
        assert_eq!(job["read"]["io_bytes"].as_u64(), Some(32 * MIB), "{job:#}");
    }
}

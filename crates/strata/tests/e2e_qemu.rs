//! qemu's NBD client (qemu-io, qemu-img) against a live daemon.
use crate::common;

use common::*;

const QEMU: &[&str] = &["qemu-io", "qemu-img"];

#[test]
fn patterns_sector_and_unaligned_writes_read_back() {
    if !require_tools(QEMU) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    qemu_io_ok(
        &uri,
        &[
            "write -P 0x11 0 65536",
            "write -P 0x22 512 512",     // one sector inside the first block
            "write -P 0x5a 1000 3000",   // unaligned at both ends, overlaps the sector above
            "write -P 0x33 1048476 200", // unaligned, straddles the 4 KiB (and 1 MiB) boundary
            "write -P 0x44 3145728 1048576",
            "write -P 0x45 3146240 1", // a single byte
        ],
    );
    // A fresh connection sees every byte where the last write put it.
    qemu_io_ok(
        &uri,
        &[
            "read -P 0x11 0 512",
            "read -P 0x22 512 488",
            "read -P 0x5a 1000 3000",
            "read -P 0x11 4000 61536",
            "read -P 0x00 1044480 3996", // unwritten bytes before the straddling write
            "read -P 0x33 1048476 200",
            "read -P 0x00 1048676 3996",
            "read -P 0x44 3145728 512",
            "read -P 0x45 3146240 1",
            "read -P 0x44 3146241 1048063",
        ],
    );
    // The verification itself can fail: a wrong pattern must be reported.
    let out = qemu_io(&uri, &["read -P 0x77 0 512"]);
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stdout).contains("Pattern verification failed"),
        "qemu-io accepted a wrong pattern\n{}",
        output_report("qemu-io read -P 0x77 0 512", &out)
    );
}

#[test]
fn concurrent_aio_writes_into_one_block() {
    if !require_tools(QEMU) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    // Eight 512-byte writes into the same 4 KiB block, all in flight together, plus
    // unaligned 100-byte writes into the next block: a server doing read-modify-write
    // without serializing overlapping blocks loses some of them.
    let mut commands: Vec<String> = (0..8u64)
        .map(|i| format!("aio_write -P {} {} 512", 0x41 + i, 8192 + i * 512))
        .collect();
    commands.extend(
        (0..8u64).map(|i| format!("aio_write -P {} {} 100", 0x61 + i, 12288 + 7 + i * 500)),
    );
    commands.push("aio_flush".into());
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    qemu_io_ok(&uri, &commands);

    let mut checks: Vec<String> = (0..8u64)
        .map(|i| format!("read -P {} {} 512", 0x41 + i, 8192 + i * 512))
        .collect();
    for i in 0..8u64 {
        let start = 12288 + 7 + i * 500;
        checks.push(format!("read -P {} {} 100", 0x61 + i, start));
        checks.push(format!("read -P 0 {} 400", start + 100)); // gap between them stays zero
    }
    let checks: Vec<&str> = checks.iter().map(String::as_str).collect();
    qemu_io_ok(&uri, &checks);
}

#[test]
fn write_zeroes_and_discard_read_back_zeros() {
    if !require_tools(QEMU) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    qemu_io_ok(&uri, &["write -P 0xaa 0 2097152"]);
    qemu_io_ok(
        &uri,
        &[
            "write -z 65536 131072",     // WRITE_ZEROES with NO_HOLE
            "write -z -u 262144 131072", // WRITE_ZEROES that may punch a hole
            "write -z 400000 5000",      // unaligned
            "discard 524288 262144",     // TRIM
            "discard 1048576 4096",
        ],
    );
    // Strata promises zeros after TRIM (stronger than the NBD spec requires).
    qemu_io_ok(
        &uri,
        &[
            "read -P 0xaa 0 65536",
            "read -P 0 65536 131072",
            "read -P 0xaa 196608 65536",
            "read -P 0 262144 131072",
            "read -P 0xaa 393216 6784",
            "read -P 0 400000 5000",
            "read -P 0xaa 405000 119288",
            "read -P 0 524288 262144",
            "read -P 0xaa 786432 262144",
            "read -P 0 1048576 4096",
            "read -P 0xaa 1052672 1044480",
        ],
    );
    // Zeroed and trimmed ranges take new data again.
    qemu_io_ok(
        &uri,
        &[
            "write -P 0xbb 266240 4096",
            "read -P 0xbb 266240 4096",
            "read -P 0 270336 4096",
        ],
    );
}

#[test]
fn reads_across_written_and_unwritten_boundaries() {
    if !require_tools(QEMU) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    let base: u64 = 2 << 20;
    qemu_io_ok(
        &uri,
        &[
            &format!("write -P 0x77 {base} 4096"),
            &format!("write -P 0x78 {} 512", base + 12288),
        ],
    );
    // Single requests that each span unwritten, written and unwritten space; -s/-l check
    // one part of the buffer that request returned.
    let span_start = base - 2048;
    let span_len = 16384;
    let reads = [
        format!("read -P 0 -s 0 -l 2048 {span_start} {span_len}"),
        format!("read -P 0x77 -s 2048 -l 4096 {span_start} {span_len}"),
        format!("read -P 0 -s 6144 -l 8192 {span_start} {span_len}"),
        format!("read -P 0x78 -s 14336 -l 512 {span_start} {span_len}"),
        format!("read -P 0 -s 14848 -l 1536 {span_start} {span_len}"),
        // A read that starts inside the data and ends far out in never-written space.
        format!("read -P 0x77 -s 0 -l 1000 {} 1048576", base + 3096),
        format!("read -P 0 -s 1000 -l 8192 {} 1048576", base + 3096),
        format!("read -P 0 -s 9704 -l 1038872 {} 1048576", base + 3096),
    ];
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    qemu_io_ok(&uri, &reads);
}

#[test]
fn qemu_img_info_shows_the_volume_size() {
    if !require_tools(QEMU) {
        return;
    }
    let daemon = Daemon::start_default();
    let out = run_ok(
        &mut cmd(
            "qemu-img",
            &["info", "--output=json", &daemon.nbd_uri(VOL0)],
        ),
        CMD_TIMEOUT,
    );
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("qemu-img info JSON");
    assert_eq!(
        info["virtual-size"].as_u64(),
        Some(VOL0_SIZE_BYTES),
        "qemu-img info: {info}"
    );
}

#[test]
fn qemu_img_convert_then_compare() {
    if !require_tools(QEMU) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    let src = daemon.scratch_dir().join("src.raw");
    write_random_file(&src, 64 << 20, test_seed("qemu_img_convert_then_compare"));
    let src = src.to_str().expect("utf-8 path");
    run_ok(
        &mut cmd(
            "qemu-img",
            &["convert", "-n", "-f", "raw", "-O", "raw", src, &uri],
        ),
        CMD_TIMEOUT,
    );
    // Without -s, compare also checks that the volume is zero past the source's end.
    let out = run_ok(
        &mut cmd(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", src, &uri],
        ),
        CMD_TIMEOUT,
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Images are identical"));

    // And compare notices a single changed sector, so the pass above means something.
    qemu_io_ok(&uri, &["write -P 0xff 33554432 512"]);
    let out = run_timeout(
        &mut cmd(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", src, &uri],
        ),
        CMD_TIMEOUT,
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        output_report("qemu-img compare after a change", &out)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Content mismatch at offset 33554432"));
}

#[test]
fn read_past_the_end_fails() {
    if !require_tools(QEMU) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    let end = VOL0_SIZE_BYTES;
    let out = qemu_io(&uri, &[&format!("read {end} 512")]);
    assert!(
        !out.status.success(),
        "read at the end succeeded\n{}",
        output_report("qemu-io read", &out)
    );
    let out = qemu_io(&uri, &[&format!("read {} 1024", end - 512)]);
    assert!(
        !out.status.success(),
        "read across the end succeeded\n{}",
        output_report("qemu-io read", &out)
    );
    // The last sector itself is readable and writable.
    qemu_io_ok(
        &uri,
        &[
            &format!("write -P 0x9 {} 512", end - 512),
            &format!("read -P 0x9 {} 512", end - 512),
        ],
    );
}

//! libnbd's tools (nbdinfo, nbdcopy) against a live daemon.
use crate::common;

use common::*;
use serde_json::Value;

fn nbdinfo_json(args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = run_ok(&mut cmd("nbdinfo", &all), CMD_TIMEOUT);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "nbdinfo {all:?}: invalid JSON ({e})\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn export_named<'a>(listing: &'a Value, name: &str) -> &'a Value {
    listing["exports"]
        .as_array()
        .expect("exports array")
        .iter()
        .find(|e| e["export-name"] == name)
        .unwrap_or_else(|| panic!("export {name:?} not listed: {listing:#}"))
}

#[test]
fn nbdinfo_lists_every_volume_with_its_size() {
    if !require_tools(&["nbdinfo"]) {
        return;
    }
    let daemon = Daemon::start_default();
    daemon.create_volume("second", "64M");
    let listing = nbdinfo_json(&["--list", &daemon.nbd_server_uri()]);
    assert_eq!(
        listing["exports"].as_array().map(Vec::len),
        Some(2),
        "{listing:#}"
    );
    assert_eq!(
        export_named(&listing, VOL0)["export-size"].as_u64(),
        Some(VOL0_SIZE_BYTES)
    );
    assert_eq!(
        export_named(&listing, "second")["export-size"].as_u64(),
        Some(64 * MIB)
    );
}

#[test]
fn nbdinfo_reports_the_negotiated_capabilities() {
    if !require_tools(&["nbdinfo"]) {
        return;
    }
    let daemon = Daemon::start_default();
    let info = nbdinfo_json(&[&daemon.nbd_uri(VOL0)]);
    assert_eq!(info["protocol"], "newstyle-fixed", "{info:#}");
    assert_eq!(info["structured"], true, "{info:#}");
    let export = export_named(&info, VOL0);
    for flag in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_df",
        "can_cache",
        "can_multi_conn",
    ] {
        assert_eq!(export[flag], true, "{flag} not advertised: {export:#}");
    }
    assert_eq!(export["is_read_only"], false, "{export:#}");
    let contexts = export["contexts"].as_array().expect("contexts");
    assert!(
        contexts.iter().any(|c| c == "base:allocation"),
        "{export:#}"
    );
    // NBD_INFO_BLOCK_SIZE was answered with sane values.
    let min = export["block_size_minimum"]
        .as_u64()
        .expect("block_size_minimum");
    let preferred = export["block_size_preferred"]
        .as_u64()
        .expect("block_size_preferred");
    let max = export["block_size_maximum"]
        .as_u64()
        .expect("block_size_maximum");
    assert!(min.is_power_of_two() && min <= 4096, "{export:#}");
    assert!(
        preferred.is_power_of_two() && preferred >= min,
        "{export:#}"
    );
    assert!(max >= preferred && max >= 1 << 20, "{export:#}");
}

/// `type` bits in nbdinfo --map for base:allocation: 1 = hole, 2 = zero.
fn extent_type_at(map: &Value, offset: u64) -> u64 {
    let extents = map.as_array().expect("map array");
    let hit = extents.iter().find(|e| {
        let start = e["offset"].as_u64().expect("offset");
        let len = e["length"].as_u64().expect("length");
        start <= offset && offset < start + len
    });
    hit.unwrap_or_else(|| panic!("no extent covers {offset}: {map:#}"))["type"]
        .as_u64()
        .expect("type")
}

#[test]
fn nbdinfo_map_shows_data_and_holes() {
    if !require_tools(&["nbdinfo", "qemu-io"]) {
        return;
    }
    let daemon = Daemon::start_default();
    let uri = daemon.nbd_uri(VOL0);
    qemu_io_ok(
        &uri,
        &[
            "write -P 0x1 0 1048576",
            "write -P 0x2 8388608 1048576",
            "write -z -u 8388608 524288",
            "discard 8912896 262144",
        ],
    );
    let map = nbdinfo_json(&["--map", &uri]);
    // The map covers the whole volume without gaps.
    let mut next = 0;
    for extent in map.as_array().expect("map array") {
        assert_eq!(
            extent["offset"].as_u64(),
            Some(next),
            "gap or overlap in the map: {map:#}"
        );
        next += extent["length"].as_u64().expect("length");
    }
    assert_eq!(
        next, VOL0_SIZE_BYTES,
        "map does not cover the volume: {map:#}"
    );

    for offset in [0, 4096, 1048575, 9175040, 9437183] {
        assert_eq!(
            extent_type_at(&map, offset),
            0,
            "written data at {offset} must be data: {map:#}"
        );
    }
    for offset in [1048576, 4 << 20, 8388607, 1 << 30, VOL0_SIZE_BYTES - 1] {
        assert_eq!(
            extent_type_at(&map, offset),
            3,
            "never-written {offset} must be hole,zero: {map:#}"
        );
    }
    for offset in [8388608, 8650752, 8912896, 9109504] {
        let t = extent_type_at(&map, offset);
        assert!(
            t & 2 != 0,
            "zeroed/trimmed {offset} must read as zero (type {t}): {map:#}"
        );
    }
}

#[test]
fn nbdcopy_with_four_connections_round_trips() {
    if !require_tools(&["nbdcopy", "nbdinfo"]) {
        return;
    }
    let daemon = Daemon::start_default();
    let size: usize = 128 << 20;
    daemon.create_volume("copy", "128M");
    let uri = daemon.nbd_uri("copy");
    // nbdcopy only opens several connections to a server that advertises multi-conn.
    let info = nbdinfo_json(&[&uri]);
    assert_eq!(
        export_named(&info, "copy")["can_multi_conn"],
        true,
        "{info:#}"
    );

    let dir = daemon.scratch_dir();
    let src = dir.join("src.raw");
    let back = dir.join("back.raw");
    let data = write_random_file(
        &src,
        size,
        test_seed("nbdcopy_with_four_connections_round_trips"),
    );
    let (src, back) = (src.to_str().expect("utf-8"), back.to_str().expect("utf-8"));
    run_ok(
        &mut cmd("nbdcopy", &["--connections=4", "--flush", src, &uri]),
        CMD_TIMEOUT,
    );
    run_ok(
        &mut cmd("nbdcopy", &["--connections=4", &uri, back]),
        CMD_TIMEOUT,
    );
    let copied = std::fs::read(back).expect("read copy");
    assert_same_bytes("nbdcopy round trip", &data, &copied);
    if find_tool("cmp").is_some() {
        run_ok(&mut cmd("cmp", &[src, back]), CMD_TIMEOUT);
    }
}

#[test]
fn unknown_export_is_refused() {
    if !require_tools(&["nbdinfo", "qemu-io"]) {
        return;
    }
    let daemon = Daemon::start_default();
    let out = run_fails(
        &mut cmd("nbdinfo", &[&daemon.nbd_uri("no-such-volume")]),
        CMD_TIMEOUT,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("opt_go") || stderr.contains("export"),
        "unexpected nbdinfo error: {stderr}"
    );
    run_fails(
        &mut qemu_io_cmd(&daemon.nbd_uri("no-such-volume"), &["read 0 512"]),
        CMD_TIMEOUT,
    );
    // The refusal cost nothing else.
    assert_fresh_client_works(&daemon);
}

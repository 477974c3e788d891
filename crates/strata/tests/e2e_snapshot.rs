//! Snapshots end to end: the CLI lifecycle (with clone and rollback), its errors, snapshot
//! exports over NBD (read-only, listed), and deletes and rollbacks against connected clients.
//! Clones, rollback and space accounting in detail are in e2e_snapshot_data.rs; snapshots taken
//! under a running writer, and across a SIGKILL, in e2e_snapshot_writes.rs.
use crate::common;
use crate::snapshot;

use common::*;
use serde_json::Value;
use snapshot::*;

const EPERM: u32 = 1;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;
const FLAG_READ_ONLY: u16 = 1 << 1;

#[test]
fn snapshot_clone_rollback_lifecycle_through_the_cli() {
    if !require_tools(&["qemu-io"]) {
        return;
    }
    let daemon = Daemon::start_default();
    daemon.create_volume("db", "64M");
    daemon.create_volume("logs", "16M");
    qemu_io_ok(&daemon.nbd_uri("db"), &["write -P 0x11 0 1M"]);

    let text = daemon.cli_ok(&["snapshot", "create", "db", "s1"]);
    assert!(text.contains("db@s1"), "{text}");
    qemu_io_ok(&daemon.nbd_uri("db"), &["write -P 0x22 0 512K"]);
    let s2 = daemon.cli_json(&["snapshot", "create", "db", "s2"]);
    assert_eq!(s2["export_name"], "db@s2", "{s2:#}");
    assert_eq!(s2["size_bytes"], 64 * MIB, "{s2:#}");
    daemon.cli_ok(&["snapshot", "create", "logs", "daily"]);

    assert_eq!(
        export_names(&snapshots(&daemon, None)),
        ["db@s1", "db@s2", "logs@daily"]
    );
    assert_eq!(
        export_names(&snapshots(&daemon, Some("db"))),
        ["db@s1", "db@s2"]
    );
    let table = daemon.cli_ok(&["snapshot", "list"]);
    assert!(table.starts_with("VOLUME"), "{table}");
    assert_eq!(table.lines().count(), 4, "{table}");
    let info = daemon.cli_ok(&["snapshot", "info", "db", "s1"]);
    assert!(
        info.contains("exclusive:") && info.contains("db@s1"),
        "{info}"
    );
    let vol = daemon.cli_json(&["volume", "info", "db"]);
    assert_eq!(vol["snapshot_count"], 2, "{vol:#}");
    // The first 512 KiB differ between s1 and the volume: s1 alone holds its copy.
    let s1 = daemon.cli_json(&["snapshot", "info", "db", "s1"]);
    let s1_exclusive = s1["space"]["exclusive_fast_bytes"].as_u64().unwrap()
        + s1["space"]["exclusive_capacity_bytes"].as_u64().unwrap();
    assert_eq!(s1_exclusive, 512 << 10, "{s1:#}");

    // The volume moves on; its snapshots keep their images.
    qemu_io_ok(&daemon.nbd_uri("db"), &["write -P 0x33 0 1M"]);
    read_ok(&daemon, "db@s1", &["read -P 0x11 0 1M", "read -P 0 1M 1M"]);
    read_ok(
        &daemon,
        "db@s2",
        &["read -P 0x22 0 512K", "read -P 0x11 512K 512K"],
    );

    let text = daemon.cli_ok(&["volume", "clone", "db@s1", "dbclone"]);
    assert!(text.contains("dbclone"), "{text}");
    read_ok(&daemon, "dbclone", &["read -P 0x11 0 1M"]);

    wait_no_clients(&daemon);
    let rolled = daemon.cli_json(&["volume", "rollback", "db", "s2"]);
    assert_eq!(rolled["name"], "db", "{rolled:#}");
    read_ok(
        &daemon,
        "db",
        &["read -P 0x22 0 512K", "read -P 0x11 512K 512K"],
    );
    // A rollback keeps every snapshot, the older one included.
    assert_eq!(
        export_names(&snapshots(&daemon, Some("db"))),
        ["db@s1", "db@s2"]
    );

    wait_no_clients(&daemon);
    daemon.cli_ok(&["snapshot", "delete", "db", "s2"]);
    assert_eq!(export_names(&snapshots(&daemon, Some("db"))), ["db@s1"]);
    read_ok(&daemon, "db", &["read -P 0x22 0 512K"]);

    wait_no_clients(&daemon);
    let refused = daemon.cli(&["volume", "delete", "db"]);
    assert_one_line_reason("delete a volume with snapshots", &refused);
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--with-snapshots"),
        "{refused:?}"
    );
    assert_eq!(
        snapshots(&daemon, Some("db")).len(),
        1,
        "a refused delete changed something"
    );
    daemon.cli_ok(&["volume", "delete", "db", "--with-snapshots"]);
    assert_eq!(export_names(&snapshots(&daemon, None)), ["logs@daily"]);
    // The clone keeps what it shares with the deleted snapshot.
    read_ok(
        &daemon,
        "dbclone",
        &["read -P 0x11 0 1M", "read -P 0 1M 1M"],
    );
}

#[test]
fn snapshot_cli_failures_are_one_line_and_change_nothing() {
    let daemon = Daemon::start_default();
    daemon.create_volume("db", "64M");
    daemon.cli_ok(&["snapshot", "create", "db", "s"]);
    let cases: [(&str, &[&str]); 14] = [
        ("duplicate snapshot", &["snapshot", "create", "db", "s"]),
        (
            "snapshot of a missing volume",
            &["snapshot", "create", "nope", "s"],
        ),
        ("bad snapshot name", &["snapshot", "create", "db", "a/b"]),
        ("name with @", &["snapshot", "create", "db", "x@y"]),
        ("missing name", &["snapshot", "create", "db"]),
        ("list of a missing volume", &["snapshot", "list", "nope"]),
        (
            "info of a missing snapshot",
            &["snapshot", "info", "db", "nope"],
        ),
        (
            "delete of a missing snapshot",
            &["snapshot", "delete", "db", "nope"],
        ),
        ("clone without @", &["volume", "clone", "db", "c"]),
        (
            "clone of a missing snapshot",
            &["volume", "clone", "db@nope", "c"],
        ),
        (
            "clone onto an existing name",
            &["volume", "clone", "db@s", "db"],
        ),
        (
            "clone with a bad name",
            &["volume", "clone", "db@s", "bad name"],
        ),
        (
            "rollback to a missing snapshot",
            &["volume", "rollback", "db", "nope"],
        ),
        (
            "rollback of a missing volume",
            &["volume", "rollback", "nope", "s"],
        ),
    ];
    for (what, args) in cases {
        assert_one_line_reason(what, &daemon.cli(args));
    }
    // An empty snapshot name is named as such, not as an endpoint the CLI happened to call.
    for command in ["info", "delete"] {
        let out = daemon.cli(&["snapshot", command, "db", ""]);
        assert_one_line_reason(command, &out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("empty snapshot name"),
            "snapshot {command} db '': {stderr}"
        );
    }
    assert_eq!(export_names(&snapshots(&daemon, None)), ["db@s"]);
    let volumes = daemon.cli_json(&["volume", "list"]);
    let names: Vec<&str> = volumes["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| v["name"].as_str().expect("name"))
        .collect();
    assert_eq!(
        names,
        ["db", VOL0],
        "a failed command created or removed a volume"
    );
}

#[test]
fn snapshot_exports_are_listed_read_only_and_refuse_writes() {
    if !require_tools(&["nbdinfo", "qemu-io"]) {
        return;
    }
    let daemon = Daemon::start_default();
    daemon.create_volume("db", "16M");
    qemu_io_ok(&daemon.nbd_uri("db"), &["write -P 0x5c 0 64K"]);
    daemon.cli_ok(&["snapshot", "create", "db", "frozen"]);

    let out = run_ok(
        &mut cmd("nbdinfo", &["--json", "--list", &daemon.nbd_server_uri()]),
        CMD_TIMEOUT,
    );
    let listing: Value = serde_json::from_slice(&out.stdout).expect("nbdinfo JSON");
    let exports = listing["exports"].as_array().expect("exports");
    let find = |name: &str| {
        exports
            .iter()
            .find(|e| e["export-name"] == name)
            .unwrap_or_else(|| panic!("{name} not listed: {listing:#}"))
    };
    assert_eq!(find("db@frozen")["is_read_only"], true, "{listing:#}");
    assert_eq!(find("db@frozen")["export-size"], 16 * MIB);
    assert_eq!(find("db")["is_read_only"], false, "{listing:#}");

    // qemu-io opens images read-write by default: a read-only export refuses that.
    let out = qemu_io(&daemon.nbd_uri("db@frozen"), &["write -P 0x01 0 4K"]);
    assert!(
        !out.status.success(),
        "qemu-io wrote to a snapshot: {out:?}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        stderr.contains("permission denied") || stderr.contains("read-only"),
        "{stderr}"
    );

    // A client that ignores the read-only flag gets EPERM for every kind of write.
    let mut client = nbd::go(daemon.nbd_addr, "db@frozen").expect("NBD_OPT_GO db@frozen");
    assert_ne!(
        client.transmission_flags & FLAG_READ_ONLY,
        0,
        "NBD_FLAG_READ_ONLY not set"
    );
    assert_eq!(client.write(0, &[1u8; 4096]).expect("io"), Err(EPERM));
    for command in [CMD_TRIM, CMD_WRITE_ZEROES] {
        let cookie = client.send(command, 0, 4096, &[]).expect("send");
        assert_eq!(
            client.read_reply_header().expect("reply"),
            (EPERM, cookie),
            "command {command}"
        );
    }
    let data = client.read(0, 4096).expect("io").expect("read");
    assert!(data.iter().all(|b| *b == 0x5c), "the snapshot changed");
    client.disconnect();
    read_ok(&daemon, "db@frozen", &["read -P 0x5c 0 64K"]);
}

fn connections(daemon: &Daemon, what: &[&str]) -> u64 {
    daemon.cli_json(what)["connections"]
        .as_u64()
        .expect("connections")
}

#[test]
fn delete_and_rollback_are_refused_while_clients_are_connected_unless_forced() {
    let daemon = Daemon::start_default();
    daemon.create_volume("db", "16M");
    let mut writer = nbd::go(daemon.nbd_addr, "db").expect("GO db");
    assert_eq!(writer.write(0, &[0x41; 4096]).expect("io"), Ok(()));
    daemon.cli_ok(&["snapshot", "create", "db", "s"]);
    assert_eq!(writer.write(0, &[0x42; 4096]).expect("io"), Ok(()));

    let mut reader = nbd::go(daemon.nbd_addr, "db@s").expect("GO db@s");
    assert_eq!(connections(&daemon, &["snapshot", "info", "db", "s"]), 1);
    assert_one_line_reason(
        "delete an open snapshot",
        &daemon.cli(&["snapshot", "delete", "db", "s"]),
    );
    assert_one_line_reason(
        "rollback an open volume",
        &daemon.cli(&["volume", "rollback", "db", "s"]),
    );
    assert_eq!(
        reader.read(0, 4096).expect("io").expect("read"),
        vec![0x41; 4096]
    );
    assert_eq!(
        writer.read(0, 4096).expect("io").expect("read"),
        vec![0x42; 4096]
    );

    // Forced: the volume's client is cut off and new clients see the snapshot's image.
    daemon.cli_ok(&["volume", "rollback", "db", "s", "--force"]);
    match writer.read(0, 4096) {
        Ok(Ok(_)) => panic!("a client of a rolled-back volume still reads"),
        Ok(Err(errno)) => assert_ne!(errno, 0),
        Err(_) => {} // disconnected
    }
    assert_eq!(connections(&daemon, &["volume", "info", "db"]), 0);
    let mut fresh = nbd::go(daemon.nbd_addr, "db").expect("GO db again");
    assert_eq!(
        fresh.read(0, 4096).expect("io").expect("read"),
        vec![0x41; 4096]
    );
    fresh.disconnect();

    daemon.cli_ok(&["snapshot", "delete", "db", "s", "--force"]);
    match reader.read(0, 4096) {
        Ok(Ok(_)) => panic!("a client of a deleted snapshot still reads"),
        Ok(Err(errno)) => assert_ne!(errno, 0),
        Err(_) => {}
    }
    assert!(snapshots(&daemon, None).is_empty());
    assert_fresh_client_works(&daemon);
}

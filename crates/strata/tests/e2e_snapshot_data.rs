//! Clones, rollback and space accounting end to end: a clone is writable and independent of its
//! origin, a rollback returns the old content and size, and deleting snapshots and volumes gives
//! their space back on both tiers (the admin API's figures, after the engine's background
//! release).
use crate::common;
use crate::snapshot;

use std::time::Duration;

use common::http::{get_json, request};
use common::*;
use serde_json::Value;
use snapshot::*;

/// Bound on waiting for the engine's background release of deleted data.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn a_clone_is_writable_and_independent_of_its_origin() {
    if !require_tools(&["qemu-io", "qemu-img"]) {
        return;
    }
    let daemon = Daemon::start_default();
    daemon.create_volume("gold", "32M");
    qemu_io_ok(
        &daemon.nbd_uri("gold"),
        &["write -P 0x61 0 4M", "write -P 0x62 8M 1M"],
    );
    daemon.cli_ok(&["snapshot", "create", "gold", "v1"]);
    daemon.cli_ok(&["volume", "clone", "gold@v1", "vm1"]);
    daemon.cli_ok(&["volume", "clone", "gold@v1", "vm2"]);

    // Same image as the snapshot, byte for byte.
    for clone in ["vm1", "vm2"] {
        let out = run_timeout(
            &mut cmd(
                "qemu-img",
                &[
                    "compare",
                    "-f",
                    "raw",
                    "-F",
                    "raw",
                    &daemon.nbd_uri("gold@v1"),
                    &daemon.nbd_uri(clone),
                ],
            ),
            CMD_TIMEOUT,
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{clone} differs from gold@v1: {out:?}"
        );
    }
    let vm1 = daemon.cli_json(&["volume", "info", "vm1"]);
    let shared = vm1["space"]["shared_fast_bytes"].as_u64().unwrap()
        + vm1["space"]["shared_capacity_bytes"].as_u64().unwrap();
    assert_eq!(
        shared,
        5 * MIB,
        "a fresh clone shares all its data: {vm1:#}"
    );

    // Writes to a clone show nowhere else, and writes to the origin do not reach the clones.
    qemu_io_ok(
        &daemon.nbd_uri("vm1"),
        &["write -P 0x71 0 1M", "write -z 8M 64K"],
    );
    qemu_io_ok(&daemon.nbd_uri("gold"), &["write -P 0x81 2M 1M"]);
    read_ok(
        &daemon,
        "vm1",
        &[
            "read -P 0x71 0 1M",
            "read -P 0x61 1M 3M",
            "read -P 0 8M 64K",
            "read -P 0x62 8256K 960K",
        ],
    );
    read_ok(&daemon, "vm2", &["read -P 0x61 0 4M", "read -P 0x62 8M 1M"]);
    read_ok(
        &daemon,
        "gold",
        &[
            "read -P 0x61 0 2M",
            "read -P 0x81 2M 1M",
            "read -P 0x62 8M 1M",
        ],
    );
    read_ok(
        &daemon,
        "gold@v1",
        &["read -P 0x61 0 4M", "read -P 0x62 8M 1M"],
    );

    // The origin and its snapshot can go; the clones keep their data.
    wait_no_clients(&daemon);
    daemon.cli_ok(&["volume", "delete", "gold", "--with-snapshots"]);
    read_ok(&daemon, "vm2", &["read -P 0x61 0 4M", "read -P 0x62 8M 1M"]);
    read_ok(&daemon, "vm1", &["read -P 0x71 0 1M", "read -P 0x61 1M 3M"]);
}

#[test]
fn rollback_returns_the_old_content_and_size() {
    if !require_tools(&["qemu-io", "qemu-img"]) {
        return;
    }
    let daemon = Daemon::start_default();
    daemon.create_volume("db", "16M");
    qemu_io_ok(&daemon.nbd_uri("db"), &["write -P 0x10 0 2M"]);
    daemon.cli_ok(&["snapshot", "create", "db", "before"]);
    qemu_io_ok(
        &daemon.nbd_uri("db"),
        &["write -P 0x20 1M 2M", "write -z 0 64K"],
    );
    daemon.cli_ok(&["volume", "resize", "db", "--size", "32M"]);
    qemu_io_ok(&daemon.nbd_uri("db"), &["write -P 0x30 20M 1M"]);
    daemon.cli_ok(&["snapshot", "create", "db", "after"]);

    wait_no_clients(&daemon);
    let rolled = daemon.cli_json(&["volume", "rollback", "db", "before"]);
    assert_eq!(rolled["size_bytes"], 16 * MIB, "{rolled:#}");
    let out = run_timeout(
        &mut cmd(
            "qemu-img",
            &[
                "compare",
                "-f",
                "raw",
                "-F",
                "raw",
                &daemon.nbd_uri("db@before"),
                &daemon.nbd_uri("db"),
            ],
        ),
        CMD_TIMEOUT,
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "db differs from db@before after rollback: {out:?}"
    );
    read_ok(&daemon, "db", &["read -P 0x10 0 2M", "read -P 0 2M 14M"]);
    // The later snapshot stays, and the volume can be rolled forward to it.
    read_ok(
        &daemon,
        "db@after",
        &[
            "read -P 0 0 64K",
            "read -P 0x20 1M 2M",
            "read -P 0x30 20M 1M",
        ],
    );
    wait_no_clients(&daemon);
    daemon.cli_ok(&["volume", "rollback", "db", "after"]);
    assert_eq!(
        daemon.cli_json(&["volume", "info", "db"])["size_bytes"],
        32 * MIB
    );
    read_ok(
        &daemon,
        "db",
        &[
            "read -P 0x10 64K 960K",
            "read -P 0x20 1M 2M",
            "read -P 0x30 20M 1M",
        ],
    );
}

/// Live bytes per tier as the status API reports them for the disk group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stored {
    fast_bytes: u64,
    capacity_bytes: u64,
    segments_free: u64,
}

impl Stored {
    fn total(&self) -> u64 {
        self.fast_bytes + self.capacity_bytes
    }
}

fn stored(daemon: &Daemon) -> Stored {
    let status = get_json(&format!("{}/api/v1/status", daemon.http_url()));
    let dg = &status["disk_groups"][0];
    let get = |k: &str| {
        dg[k]
            .as_u64()
            .unwrap_or_else(|| panic!("{k} missing: {dg:#}"))
    };
    Stored {
        fast_bytes: get("fast_resident_bytes"),
        capacity_bytes: get("capacity_live_bytes"),
        segments_free: get("segments_free"),
    }
}

/// Waits until the figures stay the same over two readings 300 ms apart with the log below
/// its low mark (the destager idle), and returns them.
fn settled(daemon: &Daemon) -> Stored {
    let mut last = stored(daemon);
    let mut now = last;
    let calm = wait_until(SETTLE_TIMEOUT, || {
        std::thread::sleep(Duration::from_millis(300));
        now = stored(daemon);
        let dg = &get_json(&format!("{}/api/v1/diskgroups", daemon.http_url()))["disk_groups"][0];
        let idle = dg["log_fill_ratio"].as_f64() <= dg["fill_ratio_low"].as_f64();
        let same = now == last;
        last = now;
        same && idle
    });
    assert!(calm, "space figures never settled: last {now:?}");
    now
}

/// (exclusive fast, exclusive capacity) of a volume or snapshot from the API.
fn exclusive(v: &Value) -> (u64, u64) {
    let s = &v["space"];
    (
        s["exclusive_fast_bytes"].as_u64().expect("space"),
        s["exclusive_capacity_bytes"].as_u64().expect("space"),
    )
}

/// Waits (bounded) until the stored total reaches `want`, and returns the figures then.
fn wait_total(daemon: &Daemon, want: u64, what: &str) -> Stored {
    let mut now = stored(daemon);
    let reached = wait_until(SETTLE_TIMEOUT, || {
        now = stored(daemon);
        now.total() == want
    });
    assert!(
        reached,
        "{what}: stored bytes never came down to {want}: {now:?}"
    );
    now
}

/// The value of one sample on the `/metrics` page.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let line = text
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .unwrap_or_else(|| panic!("no {name} {labels:?} on /metrics"));
    let value = line.rsplit(' ').next().unwrap_or_default();
    value.parse().unwrap_or_else(|e| panic!("{line}: {e}"))
}

/// `/metrics` shows the snapshot `sp@old` with the API's figures, and passes promtool.
fn check_metrics(daemon: &Daemon, exclusive_fast: u64, exclusive_capacity: u64) {
    let reply = request("GET", &format!("{}/metrics", daemon.http_url()), None, None);
    assert_eq!(reply.status, 200);
    let text = reply.body;
    let snap = |tier| [("volume", "sp"), ("snapshot", "old"), ("tier", tier)];
    let name = "strata_snapshot_exclusive_bytes";
    assert_eq!(metric(&text, name, &snap("fast")), exclusive_fast as f64);
    assert_eq!(metric(&text, name, &snap("capacity")), exclusive_capacity as f64);
    let stored = metric(&text, "strata_snapshot_stored_bytes", &snap("fast"))
        + metric(&text, "strata_snapshot_stored_bytes", &snap("capacity"));
    assert_eq!(stored, (24 * MIB) as f64, "the snapshot's image is 24 MiB of data");
    assert_eq!(metric(&text, "strata_volume_snapshots", &[("volume", "sp")]), 1.0);
    if require_tool("promtool") {
        let out = run_with_stdin(
            &mut cmd("promtool", &["check", "metrics"]),
            Some(text.into_bytes()),
            CMD_TIMEOUT,
        );
        assert!(out.status.success(), "promtool: {out:?}");
    }
}

#[test]
fn deleting_snapshots_and_volumes_gives_their_space_back() {
    if !require_tools(&["qemu-io"]) {
        return;
    }
    // A 64 MiB fast tier: 24 MiB written cross its 30% low mark, so part is destaged.
    let daemon = Daemon::start(DaemonOpts {
        fast_size: "64M".into(),
        capacity_size: "1G".into(),
        ..Default::default()
    });
    let empty = settled(&daemon);
    assert_eq!(empty.total(), 0, "a fresh daemon stores nothing: {empty:?}");
    daemon.create_volume("sp", "64M");
    qemu_io_ok(&daemon.nbd_uri("sp"), &["write -P 0x01 0 24M"]);
    let written = settled(&daemon);
    assert_eq!(written.total(), 24 * MIB, "{written:?}");
    assert!(
        written.capacity_bytes > 0 && written.fast_bytes > 0,
        "data on both tiers: {written:?}"
    );

    // Overwrite the oldest data (destaged first) and the newest (still on the fast tier):
    // the snapshot alone holds the old copies, on both tiers.
    daemon.cli_ok(&["snapshot", "create", "sp", "old"]);
    qemu_io_ok(
        &daemon.nbd_uri("sp"),
        &["write -P 0x02 0 4M", "write -P 0x03 20M 4M"],
    );
    let before = settled(&daemon);
    assert_eq!(before.total(), 32 * MIB, "{before:?}");
    let snap = daemon.cli_json(&["snapshot", "info", "sp", "old"]);
    let (snap_fast, snap_capacity) = exclusive(&snap);
    assert_eq!(snap_fast + snap_capacity, 8 * MIB, "{snap:#}");
    assert!(
        snap_capacity > 0,
        "the snapshot holds destaged data of its own: {snap:#}"
    );
    check_metrics(&daemon, snap_fast, snap_capacity);

    wait_no_clients(&daemon);
    daemon.cli_ok(&["snapshot", "delete", "sp", "old"]);
    let after_snapshot = wait_total(&daemon, before.total() - 8 * MIB, "snapshot delete");
    // Releasing may also destage what the volume keeps (moving it, not freeing it), so the
    // fast tier gives back at least the snapshot's own fast bytes.
    assert!(
        after_snapshot.fast_bytes <= before.fast_bytes - snap_fast,
        "{before:?} -> {after_snapshot:?}"
    );
    let vol = daemon.cli_json(&["volume", "info", "sp"]);
    let (vol_fast, vol_capacity) = exclusive(&vol);
    assert_eq!(
        vol_fast + vol_capacity,
        24 * MIB,
        "everything is the volume's own now: {vol:#}"
    );

    // The volume, with data on both tiers once more.
    qemu_io_ok(&daemon.nbd_uri("sp"), &["write -P 0x04 28M 8M"]);
    let before = settled(&daemon);
    assert!(
        before.fast_bytes > 0 && before.capacity_bytes > 0,
        "{before:?}"
    );
    wait_no_clients(&daemon);
    daemon.cli_ok(&["volume", "delete", "sp"]);
    let gone = wait_total(&daemon, 0, "volume delete");
    assert_eq!(gone.fast_bytes, 0);
    // Segments whose blocks are all released are free again.
    let freed = wait_until(SETTLE_TIMEOUT, || {
        stored(&daemon).segments_free >= empty.segments_free
    });
    assert!(
        freed,
        "segments not given back: {empty:?} -> {:?}",
        stored(&daemon)
    );
    let status = request(
        "GET",
        &format!("{}/api/v1/volumes/sp", daemon.http_url()),
        None,
        None,
    );
    assert_eq!(status.status, 404);
}

/// (exclusive, shared) per tier of a `space` object.
fn space_of(v: &Value) -> [u64; 4] {
    let s = &v["space"];
    let get = |k: &str| {
        s[k].as_u64()
            .unwrap_or_else(|| panic!("{k} missing: {v:#}"))
    };
    [
        get("exclusive_fast_bytes"),
        get("exclusive_capacity_bytes"),
        get("shared_fast_bytes"),
        get("shared_capacity_bytes"),
    ]
}

/// The pages that show many views at once count a volume, its snapshots and clones in one
/// walk: the snapshot lists (of one volume and of all), the volume list and `/metrics` show
/// for every view the figures its own page (one view's walk) shows, snapshot counts
/// included, with views of two unrelated volumes, a clone and a snapshot of the clone.
#[test]
fn listings_show_each_view_as_its_own_page_does() {
    if !require_tools(&["qemu-io"]) {
        return;
    }
    // Nothing destaged (the log stays under its low mark, no idle destage), so the figures
    // per tier stay put between the pages compared.
    let daemon = Daemon::start(DaemonOpts {
        extra_args: vec!["--idle-destage-after".into(), "off".into()],
        ..Default::default()
    });
    let url = daemon.http_url();
    daemon.create_volume("a", "16M");
    daemon.create_volume("b", "8M");
    qemu_io_ok(
        &daemon.nbd_uri("a"),
        &["write -P 1 0 4M", "write -P 2 8M 1M"],
    );
    qemu_io_ok(&daemon.nbd_uri("b"), &["write -P 3 0 2M"]);
    daemon.cli_ok(&["snapshot", "create", "a", "s1"]);
    qemu_io_ok(
        &daemon.nbd_uri("a"),
        &["write -P 4 1M 1M", "write -P 5 12M 1M"],
    );
    daemon.cli_ok(&["snapshot", "create", "a", "s2"]);
    qemu_io_ok(&daemon.nbd_uri("a"), &["write -P 6 0 512K"]);
    daemon.cli_ok(&["snapshot", "create", "b", "x"]);
    daemon.cli_ok(&["volume", "clone", "a@s1", "ca"]);
    qemu_io_ok(&daemon.nbd_uri("ca"), &["write -P 7 2M 1M"]);
    daemon.cli_ok(&["snapshot", "create", "ca", "t1"]);
    qemu_io_ok(&daemon.nbd_uri("ca"), &["write -P 8 3M 256K"]);
    wait_no_clients(&daemon);
    settled(&daemon);

    let all = get_json(&format!("{url}/api/v1/snapshots"));
    let listed = all["snapshots"].as_array().expect("snapshots");
    assert_eq!(listed.len(), 4, "{all:#}");
    let of_a = get_json(&format!("{url}/api/v1/volumes/a/snapshots"));
    let metrics = request("GET", &format!("{url}/metrics"), None, None).body;
    for s in listed
        .iter()
        .chain(of_a["snapshots"].as_array().expect("a's"))
    {
        let (vol, name) = (s["volume"].as_str().unwrap(), s["name"].as_str().unwrap());
        let own = get_json(&format!("{url}/api/v1/volumes/{vol}/snapshots/{name}"));
        assert_eq!(space_of(s), space_of(&own), "{vol}@{name}");
        let [ef, ec, sf, sc] = space_of(&own);
        let labels = |tier| [("volume", vol), ("snapshot", name), ("tier", tier)];
        let exclusive = "strata_snapshot_exclusive_bytes";
        let stored = "strata_snapshot_stored_bytes";
        assert_eq!(
            metric(&metrics, exclusive, &labels("fast")),
            ef as f64,
            "{vol}@{name}"
        );
        assert_eq!(
            metric(&metrics, exclusive, &labels("capacity")),
            ec as f64,
            "{vol}@{name}"
        );
        assert_eq!(
            metric(&metrics, stored, &labels("fast")),
            (ef + sf) as f64,
            "{vol}@{name}"
        );
        assert_eq!(
            metric(&metrics, stored, &labels("capacity")),
            (ec + sc) as f64,
            "{vol}@{name}"
        );
    }
    let s1 = get_json(&format!("{url}/api/v1/volumes/a/snapshots/s1"));
    assert!(space_of(&s1).iter().sum::<u64>() >= 5 * MIB, "{s1:#}");

    let vols = get_json(&format!("{url}/api/v1/volumes"));
    let vols = vols["volumes"].as_array().expect("volumes");
    let names: Vec<&str> = vols.iter().filter_map(|v| v["name"].as_str()).collect();
    assert!(
        ["a", "b", "ca"].iter().all(|n| names.contains(n)),
        "{names:?}"
    );
    // Any other volume is the daemon's default one, with no snapshot.
    for v in vols {
        let name = v["name"].as_str().unwrap();
        let snapshots = match name {
            "a" => 2,
            "b" | "ca" => 1,
            _ => 0,
        };
        let own = get_json(&format!("{url}/api/v1/volumes/{name}"));
        assert_eq!(space_of(v), space_of(&own), "{name}");
        assert_eq!(v["snapshot_count"], snapshots, "{name}");
        assert_eq!(own["snapshot_count"], snapshots, "{name}");
        let [ef, ec, sf, sc] = space_of(&own);
        let labels = |tier| [("volume", name), ("tier", tier)];
        let exclusive = "strata_volume_exclusive_bytes";
        let stored = "strata_volume_stored_bytes";
        assert_eq!(
            metric(&metrics, exclusive, &labels("fast")),
            ef as f64,
            "{name}"
        );
        assert_eq!(
            metric(&metrics, exclusive, &labels("capacity")),
            ec as f64,
            "{name}"
        );
        assert_eq!(
            metric(&metrics, stored, &labels("fast")),
            (ef + sf) as f64,
            "{name}"
        );
        assert_eq!(
            metric(&metrics, stored, &labels("capacity")),
            (ec + sc) as f64,
            "{name}"
        );
        let count = metric(&metrics, "strata_volume_snapshots", &[("volume", name)]);
        assert_eq!(count, snapshots as f64, "{name}");
    }
}

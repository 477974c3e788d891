//! The `strata` CLI and the daemon's lifecycle, driven as a user would.
use crate::common;

use std::time::Duration;

use common::*;
use serde_json::Value;

/// `volume list --json`: an array of volumes, bare or under "volumes".
fn volumes(daemon: &Daemon) -> Vec<Value> {
    let listing = daemon.cli_json(&["volume", "list"]);
    let array = listing.get("volumes").unwrap_or(&listing);
    array
        .as_array()
        .unwrap_or_else(|| panic!("volume list --json is not a list: {listing:#}"))
        .clone()
}

fn volume<'a>(list: &'a [Value], name: &str) -> Option<&'a Value> {
    list.iter().find(|v| v["name"] == name)
}

fn size_bytes(v: &Value) -> u64 {
    v["size_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("no size_bytes in {v:#}"))
}

#[test]
fn volume_lifecycle_through_the_cli() {
    let daemon = Daemon::start_default();
    let list = volumes(&daemon);
    assert_eq!(list.len(), 1, "first start creates exactly vol0: {list:?}");
    assert_eq!(
        size_bytes(volume(&list, VOL0).expect("vol0")),
        VOL0_SIZE_BYTES
    );

    daemon.create_volume("alpha", "1G");
    daemon.create_volume("beta", "512M");
    let list = volumes(&daemon);
    assert_eq!(list.len(), 3, "{list:?}");
    assert_eq!(
        size_bytes(volume(&list, "alpha").expect("alpha listed")),
        1 << 30
    );
    assert_eq!(
        size_bytes(volume(&list, "beta").expect("beta listed")),
        512 * MIB
    );

    let text = daemon.cli_ok(&["volume", "list"]);
    for name in [VOL0, "alpha", "beta"] {
        assert!(
            text.contains(name),
            "plain `volume list` misses {name}:\n{text}"
        );
    }
    let info = daemon.cli_json(&["volume", "info", "alpha"]);
    assert_eq!(info["name"], "alpha");
    assert_eq!(size_bytes(&info), 1 << 30);
    assert!(daemon
        .cli_ok(&["volume", "info", "alpha"])
        .contains("alpha"));

    // Grow: the API and an NBD client both see the new size.
    daemon.cli_ok(&["volume", "resize", "alpha", "--size", "2G"]);
    assert_eq!(
        size_bytes(&daemon.cli_json(&["volume", "info", "alpha"])),
        2 << 30
    );
    if require_tool("qemu-img") {
        let out = run_ok(
            &mut cmd(
                "qemu-img",
                &["info", "--output=json", &daemon.nbd_uri("alpha")],
            ),
            CMD_TIMEOUT,
        );
        let img: Value = serde_json::from_slice(&out.stdout).expect("qemu-img JSON");
        assert_eq!(img["virtual-size"].as_u64(), Some(2 << 30), "{img:#}");
    }
    // The same size again changes nothing, and says so.
    let same = daemon.cli_ok(&["volume", "resize", "alpha", "--size", "2G"]);
    assert!(same.contains("is already 2 GiB: unchanged"), "{same}");
    // Shrinking is refused and changes nothing.
    assert_one_line_reason(
        "shrink",
        &daemon.cli(&["volume", "resize", "alpha", "--size", "1G"]),
    );
    assert_eq!(
        size_bytes(&daemon.cli_json(&["volume", "info", "alpha"])),
        2 << 30
    );

    daemon.cli_ok(&["volume", "delete", "beta"]);
    let list = volumes(&daemon);
    assert!(
        volume(&list, "beta").is_none(),
        "beta still listed after delete: {list:?}"
    );
    assert_one_line_reason(
        "info after delete",
        &daemon.cli(&["volume", "info", "beta"]),
    );
    // The name is free again.
    daemon.create_volume("beta", "64M");

    // STRATA_SERVER stands in for --server.
    let mut c = cmd(STRATA_BIN, &["--json", "volume", "list"]);
    c.env("STRATA_SERVER", daemon.http_url());
    let out = run_ok(&mut c, CMD_TIMEOUT);
    assert!(String::from_utf8_lossy(&out.stdout).contains("alpha"));
}

#[test]
fn cli_failures_give_one_line_reasons() {
    let daemon = Daemon::start_default();
    let cases: [(&str, &[&str]); 8] = [
        (
            "duplicate name",
            &["volume", "create", VOL0, "--size", "1G"],
        ),
        ("unknown volume info", &["volume", "info", "nope"]),
        ("unknown volume delete", &["volume", "delete", "nope"]),
        (
            "unknown volume resize",
            &["volume", "resize", "nope", "--size", "1G"],
        ),
        ("bad size unit", &["volume", "create", "x", "--size", "12Q"]),
        (
            "size not a number",
            &["volume", "create", "x", "--size", "lots"],
        ),
        ("missing size", &["volume", "create", "x"]),
        ("unknown subcommand", &["volume", "explode", "x"]),
    ];
    for (what, args) in cases {
        assert_one_line_reason(what, &daemon.cli(args));
    }
    // With --json a refusal is also a JSON object on stdout, with the daemon's HTTP status.
    for (args, status) in [
        (&["--json", "volume", "info", "nope"][..], 404),
        (
            &["--json", "volume", "create", VOL0, "--size", "1G"][..],
            409,
        ),
    ] {
        let out = daemon.cli(args);
        assert_one_line_reason("refusal with --json", &out);
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not JSON ({e})"));
        assert_eq!(v["status"], status, "{args:?}: {v}");
        assert!(v["error"].as_str().is_some_and(|r| !r.is_empty()), "{v}");
    }
    // A usage error too, with no status: the daemon was not asked.
    let out = daemon.cli(&["--json", "volume", "create", "x", "--size", "12Q"]);
    assert_eq!(out.status.code(), Some(2), "usage error with --json");
    assert_one_line_reason("usage error with --json", &out);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "usage error with --json: stdout is not JSON ({e}): {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    assert!(v["status"].is_null(), "{v}");
    assert!(v["error"].as_str().is_some_and(|r| r.contains("12Q")), "{v}");
    // The one line names what is missing.
    let missing = daemon.cli(&["volume", "create", "x"]);
    let reason = String::from_utf8_lossy(&missing.stderr);
    assert!(reason.contains("--size"), "{reason}");
    let list = volumes(&daemon);
    assert_eq!(
        list.len(),
        1,
        "a failed command created something: {list:?}"
    );
    assert_eq!(
        size_bytes(volume(&list, VOL0).expect("vol0")),
        VOL0_SIZE_BYTES,
        "duplicate create changed vol0"
    );

    // Nothing listens on port 1.
    let out = run_timeout(
        &mut cmd(
            STRATA_BIN,
            &["--server", "http://127.0.0.1:1", "volume", "list"],
        ),
        CMD_TIMEOUT,
    );
    assert_one_line_reason("unreachable server", &out);

    // Names that the URL would resolve to another endpoint are refused by name: sent, `..`
    // made `snapshot list ..` list every volume's snapshots and exit 0, and `.` made `volume
    // info .` ask for /api/v1/volumes/.
    daemon.cli_ok(&["snapshot", "create", VOL0, "s1"]);
    let cases: [(&[&str], &str); 5] = [
        (&["snapshot", "list", ".."], r#"invalid volume name "..""#),
        (&["volume", "info", "."], r#"invalid volume name ".""#),
        (&["volume", "delete", ".."], r#"invalid volume name "..""#),
        (
            &["snapshot", "info", VOL0, ".."],
            r#"invalid snapshot name "..""#,
        ),
        (&["volume", "info", ""], r#"invalid volume name """#),
    ];
    for (args, reason) in cases {
        let out = daemon.cli(args);
        assert_one_line_reason(&format!("{args:?}"), &out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(reason),
            "{args:?}: expected {reason:?}, got {stderr}"
        );
    }
}

/// `strata volume list | head -1`: a reader that went away ends the command as it ends other
/// Unix tools, by SIGPIPE, instead of a panic ("failed printing to stdout: Broken pipe") and
/// exit status 101.
#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let daemon = Daemon::start_default();
    let cases: [&[&str]; 4] = [
        &["volume", "list"],
        &["--json", "status"],
        &["--json", "volume", "info", "nope"],
        &["size", "--list-devices"],
    ];
    for args in cases {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let mut c = daemon.cli_cmd(args);
        c.stdin(std::process::Stdio::null())
            .stdout(writer)
            .stderr(std::process::Stdio::piped());
        let mut guard = ChildGuard::spawn(&mut c);
        let stderr = guard.child().stderr.take().expect("stderr");
        let status = guard
            .wait_timeout(CMD_TIMEOUT)
            .unwrap_or_else(|| panic!("{args:?} did not end"));
        let stderr = std::io::read_to_string(stderr).expect("read stderr");
        assert!(
            status.signal() == Some(libc::SIGPIPE) && !stderr.contains("panicked"),
            "{args:?}: expected an end by SIGPIPE, got {status}, stderr:\n{stderr}"
        );
    }
}

/// On a node without a read cache nothing is promoted, whatever the volume's policy: `volume
/// info` and `set-policy` say so on the promote line, which showed "after 2 read(s)" alone.
#[test]
fn volume_info_says_when_the_node_has_no_read_cache() {
    let promote_line = |daemon: &Daemon, args: &[&str]| {
        let out = daemon.cli_ok(args);
        let line = out.lines().find(|l| l.starts_with("promote:"));
        line.unwrap_or_else(|| panic!("{args:?}: no promote line in\n{out}"))
            .to_string()
    };
    let note = "(none: the node has no read cache)";
    for (ratio, noted) in [("0", true), ("0.5", false)] {
        let daemon = Daemon::start(DaemonOpts {
            extra_args: vec!["--read-cache".into(), ratio.into()],
            ..DaemonOpts::default()
        });
        let line = promote_line(&daemon, &["volume", "info", VOL0]);
        assert!(line.contains("after 2 read(s)"), "{line}");
        assert_eq!(line.contains(note), noted, "--read-cache {ratio}: {line}");
        let args = ["volume", "set-policy", VOL0, "--promote-after-reads", "3"];
        let line = promote_line(&daemon, &args);
        assert_eq!(line.contains(note), noted, "--read-cache {ratio}: {line}");
        // Promotion off says "never" already.
        let args = ["volume", "set-policy", VOL0, "--promote-after-reads", "0"];
        let line = promote_line(&daemon, &args);
        assert!(line.contains("never") && !line.contains(note), "{line}");
        // The JSON is the volume's alone.
        let v = daemon.cli_json(&["volume", "info", VOL0]);
        assert!(v.get("read_cache").is_none(), "{v:#}");
    }
}

fn connections(daemon: &Daemon, name: &str) -> Option<u64> {
    daemon.cli_json(&["volume", "info", name])["connections"].as_u64()
}

#[test]
fn delete_is_refused_while_a_client_is_connected() {
    let daemon = Daemon::start_default();
    daemon.create_volume("busy", "64M");
    daemon.create_volume("later", "64M");

    let held = nbd::go(daemon.nbd_addr, "busy").expect("NBD_OPT_GO busy");
    assert_eq!(held.size_bytes, 64 * MIB);
    if let Some(n) = connections(&daemon, "busy") {
        assert_eq!(n, 1, "volume info should count the open connection");
    }
    assert_one_line_reason(
        "delete while connected",
        &daemon.cli(&["volume", "delete", "busy"]),
    );
    assert!(
        volume(&volumes(&daemon), "busy").is_some(),
        "refused delete removed the volume"
    );
    daemon.cli_ok(&["volume", "delete", "busy", "--force"]);
    assert!(
        volume(&volumes(&daemon), "busy").is_none(),
        "forced delete left the volume"
    );
    // The client of a force-deleted volume gets errors (or is disconnected), never stale data.
    let mut held = held;
    match held.read(0, 512) {
        Ok(Ok(_)) => panic!("a read on a force-deleted volume succeeded"),
        Ok(Err(errno)) => assert_ne!(errno, 0),
        Err(_) => {} // disconnected
    }
    drop(held);

    // Once the client goes away, a plain delete is allowed.
    let mut held = nbd::go(daemon.nbd_addr, "later").expect("NBD_OPT_GO later");
    assert_eq!(held.write(0, &[7u8; 512]).expect("io"), Ok(()));
    assert_one_line_reason(
        "delete while connected",
        &daemon.cli(&["volume", "delete", "later"]),
    );
    held.disconnect();
    let deleted = wait_until(Duration::from_secs(10), || {
        daemon.cli(&["volume", "delete", "later"]).status.success()
    });
    assert!(
        deleted,
        "delete still refused 10 s after the client disconnected"
    );
    assert_fresh_client_works(&daemon);
}

#[test]
fn sigterm_exits_zero_and_data_survives_restart() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    daemon.create_volume("kept", "256M");
    let uri = daemon.nbd_uri(VOL0);
    qemu_io_ok(
        &uri,
        &[
            "write -P 0x3c 0 1048576",
            "write -P 0x3d 4194304 512",
            "write -z 65536 4096",
        ],
    );
    qemu_io_ok(&daemon.nbd_uri("kept"), &["write -P 0x4e 1000 3000"]);

    daemon.terminate(); // asserts exit status 0
    daemon.restart();

    let list = volumes(&daemon);
    assert_eq!(list.len(), 2, "volumes after restart: {list:?}");
    assert_eq!(
        size_bytes(volume(&list, "kept").expect("kept survives restart")),
        256 * MIB
    );
    let uri = daemon.nbd_uri(VOL0);
    qemu_io_ok(
        &uri,
        &[
            "read -P 0x3c 0 65536",
            "read -P 0 65536 4096",
            "read -P 0x3c 69632 978944",
            "read -P 0x3d 4194304 512",
        ],
    );
    qemu_io_ok(
        &daemon.nbd_uri("kept"),
        &[
            "read -P 0 0 1000",
            "read -P 0x4e 1000 3000",
            "read -P 0 4000 4096",
        ],
    );
}

/// An admin client that sent half a request (and then nothing) is not work in flight: it must
/// not hold SIGTERM's shutdown until the drain timeout.
#[test]
fn sigterm_is_not_held_by_a_half_sent_admin_request() {
    use std::io::Write;
    let mut daemon = Daemon::start_default();
    let mut header = std::net::TcpStream::connect(daemon.http_addr).expect("connect");
    header
        .write_all(b"GET /api/v1/volumes HTTP/1.1\r\nHost: strata\r\n")
        .expect("half a header");
    let mut body = std::net::TcpStream::connect(daemon.http_addr).expect("connect");
    body.write_all(
        b"POST /api/v1/volumes HTTP/1.1\r\nHost: strata\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"name\":",
    )
    .expect("half a body");
    std::thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    daemon.terminate(); // asserts exit status 0
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "SIGTERM took {took:?}");
    assert!(
        daemon.stderr_log().contains("shut down cleanly"),
        "{}",
        daemon.stderr_log()
    );
}

#[test]
fn serve_with_bad_flags_fails_with_one_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let data = data.to_str().expect("utf-8");
    let small = ["--fast-size", "64M", "--capacity-size", "256M"];
    let nbd = ["--nbd-listen", "127.0.0.1:0"];
    let http = ["--http-listen", "127.0.0.1:0"];
    let cases: [(&str, Vec<&str>); 3] = [
        (
            "unknown flag",
            [
                &["serve", "--no-such-flag", "--data-dir", data][..],
                &small,
                &nbd,
                &http,
            ]
            .concat(),
        ),
        (
            "bad size",
            [
                &["serve", "--data-dir", data, "--fast-size", "banana"][..],
                &nbd,
                &http,
            ]
            .concat(),
        ),
        (
            "bad address",
            [
                &[
                    "serve",
                    "--data-dir",
                    data,
                    "--nbd-listen",
                    "not-an-address",
                ][..],
                &small,
                &http,
            ]
            .concat(),
        ),
    ];
    for (what, args) in cases {
        let mut c = cmd(STRATA_BIN, &args);
        c.current_dir(dir.path());
        let out = run_timeout(&mut c, Duration::from_secs(20));
        assert_one_line_reason(what, &out);
        assert_eq!(out.status.code(), Some(2), "{what}: a usage error");
    }
    // The NBD server's stall timeout is what bounds a client that stops mid-request.
    let args = [
        &["serve", "--data-dir", data, "--nbd-stall-timeout", "off"][..],
        &small,
        &nbd,
        &http,
    ]
    .concat();
    let mut c = cmd(STRATA_BIN, &args);
    c.current_dir(dir.path());
    let out = run_timeout(&mut c, Duration::from_secs(20));
    assert_one_line_reason("stall timeout off", &out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "stall timeout off: a usage error"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("nbd-stall-timeout cannot be off"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("data").exists(),
        "the refused start made its data directory"
    );
}

/// A value `strata serve` refuses is a usage error, exit 2, whichever part of it checks the
/// value and whether a flag or the config file gave it: `--fill-high 150%` exited 2 while
/// `--read-cache 0.95`, `--max-connections 0` and `--fill-low 0.8 --fill-high 0.7` exited 1.
/// A start that fails (a config file that cannot be read) still exits 1.
#[test]
fn bad_serve_values_are_usage_errors_from_flags_and_the_config_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write config");
        path.display().to_string()
    };
    let bad_key = config("bad-key.toml", "max_connections = 0\n");
    let unknown_key = config("unknown-key.toml", "max_conections = 8\n");
    let contradiction = config("marks.toml", "fill_low = 0.8\nfill_high = \"70%\"\n");
    let missing = dir.path().join("missing.toml").display().to_string();
    let cases: [(&[&str], &str, i32); 12] = [
        (&["--read-cache", "0.95"], "read cache", 2),
        (
            &["--max-connections", "0"],
            "max-connections must be between",
            2,
        ),
        (
            &["--fill-low", "0.8", "--fill-high", "0.7"],
            "must be below fill-high",
            2,
        ),
        (&["--fill-high", "150%"], "out of range", 2),
        (&["--wear-projection-after", "soon"], "is not a duration", 2),
        (&["--io-backend", "aio"], "unknown I/O backend", 2),
        (&["--index-cache", "4K"], "index-cache", 2),
        (
            &["--config", &bad_key],
            "max-connections must be between",
            2,
        ),
        (&["--config", &unknown_key], "unknown field", 2),
        (&["--config", &contradiction], "must be below fill-high", 2),
        // A file the flag names that cannot be read is a failed start, not a refused value.
        (&["--config", &missing], "cannot read config", 1),
        (
            &["--http-token-file", &missing],
            "cannot read the HTTP token file",
            1,
        ),
    ];
    for (flags, reason, code) in cases {
        let args = [
            &["serve", "--data-dir", "data", "--fast-size", "64M"][..],
            &[
                "--nbd-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ],
            flags,
        ]
        .concat();
        let mut c = cmd(STRATA_BIN, &args);
        c.current_dir(dir.path());
        let out = run_timeout(&mut c, Duration::from_secs(20));
        assert_one_line_reason(&format!("{flags:?}"), &out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{flags:?}: {stderr}");
        assert!(stderr.contains(reason), "{flags:?}: {stderr}");
    }
    // (An unknown device model: e2e_wear's unknown_model_or_bad_catalog_stops_start_up.)
    assert!(
        !dir.path().join("data").exists(),
        "a refused start made its data directory"
    );
}

/// A failed `serve` after logging started: a non-zero exit, and the reason as the last line.
fn assert_serve_fails_with(what: &str, out: &std::process::Output, reason: &str) {
    assert!(
        !out.status.success(),
        "{what}: expected failure, got {}",
        out.status
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
    assert!(
        last.starts_with("strata: ") && last.contains(reason),
        "{what}: the last line must be `strata: ...{reason}...`, got:\n{stderr}"
    );
}

#[test]
fn a_failed_start_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listen = [
        "--nbd-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    let missing_disk = "/dev/strata-e2e-no-such-disk";
    let cases: [(&str, &[&str], &str); 4] = [
        ("fast tier too small", &["--fast-size", "2M"], "at least"),
        (
            "a disk that is not there",
            &["--capacity-device", missing_disk],
            "does not exist",
        ),
        // Exactly two segments of the least size a format chooses (1 MiB): the superblocks
        // before them leave room for one, and the reason says how large the device must be.
        (
            "capacity tier too small",
            &["--fast-size", "64M", "--capacity-size", "2M"],
            "at least 3145728 are needed",
        ),
        (
            "one file given twice",
            &[
                "--fast-size",
                "64M",
                "--capacity-device",
                "data/c.img",
                "--capacity-device",
                "./data/c.img",
            ],
            "in use",
        ),
    ];
    for (what, args, reason) in cases {
        let args = [&["serve", "--data-dir", "data"][..], args, &listen].concat();
        let mut c = cmd(STRATA_BIN, &args);
        c.current_dir(dir.path());
        let out = run_timeout(&mut c, Duration::from_secs(60));
        assert_serve_fails_with(what, &out, reason);
        assert!(
            !dir.path().join("data").exists(),
            "{what}: the failed start left its data directory behind"
        );
    }
    assert!(
        !std::path::Path::new(missing_disk).exists(),
        "a file was made under /dev"
    );
    // `serve` prints no JSON, not even its failure's, when a --json comes before it (from an
    // alias), and refuses one after it with a usage error in text.
    for (args, code) in [
        (&["--json", "serve", "--data-dir", "data", "--fast-size", "2M"][..], 1),
        (&["serve", "--data-dir", "data", "--json"][..], 2),
    ] {
        let mut c = cmd(STRATA_BIN, &[args, &listen].concat());
        c.current_dir(dir.path());
        let out = run_timeout(&mut c, Duration::from_secs(60));
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        assert!(
            out.stdout.is_empty(),
            "{args:?}: stdout {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert_serve_fails_with(&format!("{args:?}"), &out, "");
    }
}

/// A device file of a disk group missing at a start (set aside here; a wrong path or a file
/// system not mounted, for real) is not created: the start is refused, naming the path and
/// what to check, and the group starts once the file is back. It was created, refused by the
/// engine as blank (the fast device with advice to wipe the capacity device), then removed.
#[test]
fn a_missing_device_file_of_a_disk_group_is_refused_not_created() {
    let mut daemon = Daemon::start_default();
    daemon.terminate();
    let data = daemon.data_dir();
    let data_str = data.to_str().expect("utf-8");
    for name in ["capacity-0.img", "fast.img"] {
        let path = data.join(name);
        let aside = daemon.scratch_dir().join(name);
        std::fs::rename(&path, &aside).expect("set the device file aside");
        let args = [
            "serve",
            "--data-dir",
            data_str,
            "--nbd-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ];
        let out = run_timeout(&mut cmd(STRATA_BIN, &args), Duration::from_secs(60));
        let reason = format!("{} does not exist, and ", path.display());
        assert_serve_fails_with(name, &out, &reason);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("Check first that the path is right (--data-dir")
                && stderr.contains("that the file system that holds it is mounted")
                && !stderr.contains("wipe"),
            "{name}: {stderr}"
        );
        assert!(!path.exists(), "{name} was left created");
        std::fs::rename(&aside, &path).expect("put the device file back");
    }
    daemon.restart();
    daemon.assert_alive();
}

/// Another group's sparse capacity file given by mistake as `--fast-device` is refused, and is
/// not allocated in full first: that could fill the file system before the engine said no.
#[test]
fn a_capacity_file_given_as_the_fast_device_is_refused_unallocated() {
    use std::os::unix::fs::MetadataExt;
    let mut other = Daemon::start(DaemonOpts {
        capacity_size: "1G".into(),
        ..Default::default()
    });
    other.terminate();
    let capacity = other.data_dir().join("capacity-0.img");
    let before = std::fs::metadata(&capacity).expect("the other group's capacity file");
    assert!(
        before.blocks() * 512 < before.len() / 4,
        "the capacity file should be sparse: {} of {} bytes allocated",
        before.blocks() * 512,
        before.len()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let args = [
        "serve",
        "--data-dir",
        "data",
        "--fast-device",
        capacity.to_str().expect("utf-8"),
        "--capacity-size",
        "256M",
        "--nbd-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    let mut c = cmd(STRATA_BIN, &args);
    c.current_dir(dir.path());
    let out = run_timeout(&mut c, Duration::from_secs(60));
    assert_serve_fails_with(
        "capacity file as the fast device",
        &out,
        "is a capacity device, not a fast device",
    );
    let after = std::fs::metadata(&capacity).expect("the capacity file after");
    assert_eq!(after.len(), before.len(), "the file changed size");
    assert!(
        after.blocks() <= before.blocks(),
        "the refused start allocated the file: {} -> {} bytes",
        before.blocks() * 512,
        after.blocks() * 512
    );
    assert!(
        !dir.path().join("data").exists(),
        "the failed start left its data directory behind"
    );
}

#[test]
fn a_second_daemon_on_the_same_data_directory_is_refused() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let data = daemon.data_dir();
    let args = [
        "serve",
        "--data-dir",
        data.to_str().expect("utf-8"),
        "--nbd-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    let out = run_timeout(&mut cmd(STRATA_BIN, &args), Duration::from_secs(60));
    assert_serve_fails_with("second daemon", &out, "is in use");
    daemon.assert_alive();
    assert_fresh_client_works(&daemon);
}

#[test]
fn a_deleted_default_volume_is_not_created_again() {
    let mut daemon = Daemon::start_default();
    daemon.cli_ok(&["volume", "delete", VOL0]);
    daemon.restart();
    let list = volumes(&daemon);
    assert!(list.is_empty(), "vol0 came back after a restart: {list:?}");
}

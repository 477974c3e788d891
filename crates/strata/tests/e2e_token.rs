//! The admin API's access token against a live daemon: loopback by default, off-loopback only
//! with a token, every mutating request checked (401 without or with a wrong token), reads
//! open, the CLI sending it, and the token never reaching the daemon's logs.
use crate::common;

use std::time::Duration;

use common::http::{get, request};
use common::*;
use serde_json::json;

const SECRET: &str = "observe-secret-7f3a9c21d04b";
const WRONG: &str = "wrong-guess-5e6d7c8b9a0f1e2d";

fn token_file(daemon_root: &std::path::Path, secret: &str) -> std::path::PathBuf {
    let path = daemon_root.join(format!("token-{}", secret.len()));
    std::fs::write(&path, format!("{secret}\n")).expect("write token file");
    path
}

/// A daemon with a token, logging at debug level (and hyper/axum at trace) to stderr.
fn daemon_with_token(http_listen: &str) -> (Daemon, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = token_file(dir.path(), SECRET);
    let opts = DaemonOpts {
        extra_args: vec!["--http-token-file".into(), path.display().to_string()],
        http_listen: http_listen.into(),
        env: vec![("RUST_LOG".into(), "debug,hyper=trace,axum=trace,tower=trace".into())],
        ..Default::default()
    };
    (Daemon::start(opts), dir)
}

fn volume_names(base: &str) -> Vec<String> {
    let v = common::http::get_json(&format!("{base}/api/v1/volumes"));
    v["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|x| x["name"].as_str().expect("name").to_string())
        .collect()
}

fn assert_refused(reply: &common::http::Reply, what: &str) {
    assert_eq!(reply.status, 401, "{what}: {}", reply.body);
    assert_eq!(reply.www_authenticate.as_deref(), Some("Bearer"), "{what}");
    let error = reply.json()["error"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("token"), "{what}: {error}");
    assert!(!error.contains(SECRET) && !error.contains(WRONG), "{what}: {error}");
}

#[test]
fn every_mutation_needs_the_token_and_reads_stay_open() {
    let (mut daemon, _dir) = daemon_with_token("127.0.0.1:0");
    let base = daemon.http_url();
    let create = json!({"name": "guarded", "size_bytes": 1 << 20});
    let url = |p: &str| format!("{base}{p}");

    for (token, what) in [(None, "no token"), (Some(WRONG), "a wrong token"), (Some(""), "an empty token")] {
        assert_refused(&request("POST", &url("/api/v1/volumes"), Some(&create), token), what);
        assert_refused(
            &request("POST", &url("/api/v1/volumes/vol0/resize"), Some(&json!({"size_bytes": 16u64 << 30})), token),
            what,
        );
        assert_refused(&request("DELETE", &url("/api/v1/volumes/vol0?force=true"), None, token), what);
        assert_refused(&request("POST", &url("/api/v1/volumes/vol0/snapshots"), None, token), what);
        assert_refused(&request("DELETE", &url("/api/v1/volumes/vol0/snapshots/s"), None, token), what);
        assert_refused(&request("POST", &url("/api/v1/volumes/vol0/clone"), None, token), what);
        assert_refused(&request("POST", &url("/api/v1/volumes/vol0/rollback"), None, token), what);
    }
    assert_eq!(volume_names(&base), ["vol0"], "a refused request changed nothing");
    let vol0 = common::http::get_json(&url("/api/v1/volumes/vol0"));
    assert_eq!(vol0["size_bytes"], VOL0_SIZE_BYTES);

    // Reads need no token: the API, /metrics and the dashboard.
    for path in ["/", "/metrics", "/api/v1/status", "/api/v1/history", "/api/v1/devices", "/api/v1/openapi.json"] {
        assert_eq!(get(&url(path)).status, 200, "GET {path}");
    }

    let r = request("POST", &url("/api/v1/volumes"), Some(&create), Some(SECRET));
    assert_eq!(r.status, 201, "{}", r.body);
    let r = request("POST", &url("/api/v1/volumes/guarded/resize"), Some(&json!({"size_bytes": 2 << 20})), Some(SECRET));
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request("POST", &url("/api/v1/volumes/guarded/snapshots"), Some(&json!({"name": "s"})), Some(SECRET));
    assert_eq!(r.status, 201, "{}", r.body);
    let r = request("DELETE", &url("/api/v1/volumes/guarded?with_snapshots=true"), None, Some(SECRET));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(volume_names(&base), ["vol0"]);

    daemon.terminate();
    let log = daemon.stderr_log();
    assert!(log.contains("admin request refused"), "the refusals are logged:\n{log}");
    assert!(log.contains("DEBUG") || log.contains("TRACE"), "the daemon logged at debug level");
    assert!(!log.contains(SECRET), "the token appears in the daemon's log");
    assert!(!log.contains(WRONG), "a presented token appears in the daemon's log");
}

#[test]
fn the_cli_sends_the_token_from_a_file_or_the_environment() {
    let (mut daemon, dir) = daemon_with_token("127.0.0.1:0");
    let create = |extra: &[&str], env: Option<&str>, name: &str| {
        let mut args: Vec<&str> = extra.to_vec();
        args.extend(["volume", "create", name, "--size", "1M"]);
        let mut c = daemon.cli_cmd(&args);
        c.env_remove("STRATA_TOKEN").env_remove("STRATA_TOKEN_FILE");
        if let Some(t) = env {
            c.env("STRATA_TOKEN", t);
        }
        run_timeout(&mut c, Duration::from_secs(30))
    };
    let out = create(&[], None, "a");
    assert_one_line_reason("create without a token", &out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("token"), "{stderr}");

    let out = create(&[], Some(WRONG), "a");
    assert_one_line_reason("create with a wrong token", &out);
    assert!(String::from_utf8_lossy(&out.stderr).contains("wrong"));
    assert!(!String::from_utf8_lossy(&out.stderr).contains(WRONG));

    let out = create(&[], Some(SECRET), "from-env");
    assert!(out.status.success(), "{}", output_report("STRATA_TOKEN", &out));
    let file = token_file(dir.path(), SECRET);
    let file = file.to_str().expect("utf-8 path");
    let out = create(&["--token-file", file], None, "from-file");
    assert!(out.status.success(), "{}", output_report("--token-file", &out));
    let missing = dir.path().join("nope");
    let out = create(&["--token-file", missing.to_str().expect("utf-8")], None, "x");
    assert_one_line_reason("a missing token file", &out);

    // Reads need none.
    let list = daemon.cli_ok(&["volume", "list"]);
    assert!(list.contains("from-env") && list.contains("from-file"), "{list}");
    daemon.terminate();
    assert!(!daemon.stderr_log().contains(SECRET));
}

#[test]
fn off_loopback_needs_a_token_and_works_with_one() {
    // Refused without a token, before any device is touched.
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let mut c = cmd(STRATA_BIN, &["serve", "--nbd-listen", "127.0.0.1:0", "--http-listen", "0.0.0.0:0"]);
    c.arg("--data-dir").arg(&data);
    let out = run_timeout(&mut c, Duration::from_secs(30));
    assert_one_line_reason("serve on 0.0.0.0 without a token", &out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("token") && stderr.contains("loopback"), "{stderr}");
    assert!(!data.exists(), "a refused start must not create the data directory");

    // With a token it serves (reached here through loopback), and still guards mutations.
    let (daemon, _dir) = daemon_with_token("0.0.0.0:0");
    assert!(daemon.http_addr.ip().is_unspecified(), "{}", daemon.http_addr);
    let base = daemon.http_url();
    assert_eq!(get(&format!("{base}/api/v1/node")).status, 200);
    let r = request("POST", &format!("{base}/api/v1/volumes"), Some(&json!({"name": "x", "size_bytes": 4096})), None);
    assert_refused(&r, "off-loopback, no token");
}

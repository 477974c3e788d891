//! In-process tests of the admin API handlers (the router called through tower's `oneshot`).
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Value};
use strata_nbd::Backend;
use tower::ServiceExt;

use super::*;
use crate::adapter::NbdBackend;
use crate::testutil::test_group;

pub(crate) fn app() -> (Router, Arc<AppState>) {
    app_with("127.0.0.1:9090", None)
}

/// The router of a daemon whose admin port listens on `http_addr`, with `token` if any.
fn app_with(http_addr: &str, token: Option<&str>) -> (Router, Arc<AppState>) {
    let state = Arc::new(AppState {
        registry: Registry::new(test_group()),
        started: Instant::now(),
        nbd_addr: "127.0.0.1:10809".parse().unwrap(),
        http_addr: http_addr.parse().unwrap(),
        io_backend: "threads".into(),
        history: crate::history::History::new(),
        token: token.map(|t| crate::config::Token::new(t).unwrap()),
        devices: Vec::new(),
        scrub: crate::api_scrub::ScrubConfig { interval: None, rate_bytes_per_s: 0 },
        // The sender is dropped at once: a closed channel never says "stopping".
        stopping: tokio::sync::watch::channel(false).1,
        read_cache: crate::read_cache::decide_with(
            crate::read_cache::ReadCacheSetting::Ratio(0.0),
            &crate::read_cache::Devices { fast: std::path::Path::new("/fast"), capacity: &[], capacity_emulated: false },
            |p| crate::read_cache::Probe { disk: Some(p.to_path_buf()), rotational: Ok(false) },
        ),
        space: Default::default(),
    });
    (router(state.clone()), state)
}

pub(crate) async fn call(app: &Router, method: &str, uri: &str, body: Option<Value>) -> (StatusCode, Value) {
    let builder = Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "127.0.0.1:9090");
    let req = match body {
        Some(b) => builder
            .header("content-type", "application/json")
            .body(Body::from(b.to_string())),
        None => builder.body(Body::empty()),
    }
    .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    let value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (status, value)
}

#[tokio::test]
async fn create_get_list_resize_delete() {
    let (app, _) = app();
    let (s, v) = call(
        &app,
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "a", "size_bytes": 1 << 30})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["name"], "a");
    assert_eq!(v["size_bytes"], 1u64 << 30);
    assert_eq!(v["connections"], 0);
    assert_eq!(v["export_uri"], "nbd://127.0.0.1:10809/a");

    let (s, v) = call(&app, "GET", "/api/v1/volumes/a", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["name"], "a");

    call(
        &app,
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "b", "size_bytes": 4096})),
    )
    .await;
    let (s, v) = call(&app, "GET", "/api/v1/volumes", None).await;
    assert_eq!(s, StatusCode::OK);
    let names: Vec<&str> = v["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["a", "b"]);

    let (s, v) = call(
        &app,
        "POST",
        "/api/v1/volumes/a/resize",
        Some(json!({"size_bytes": 2u64 << 30})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["size_bytes"], 2u64 << 30);

    let (s, v) = call(&app, "DELETE", "/api/v1/volumes/a", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["deleted"], "a");
    let (s, _) = call(&app, "GET", "/api/v1/volumes/a", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn errors_are_json_with_proper_status() {
    let (app, _) = app();
    let (s, v) = call(&app, "GET", "/api/v1/volumes/nope", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_eq!(v["error"], "volume \"nope\" not found");
    // A name that does not decode (not UTF-8) in any route's path: JSON too.
    for (method, uri) in [
        ("GET", "/api/v1/volumes/%FF"),
        ("GET", "/api/v1/volumes/%FF/snapshots"),
        ("GET", "/api/v1/volumes/a/snapshots/%FF"),
        ("PUT", "/api/v1/volumes/%FF/policy"),
    ] {
        let (s, v) = call(&app, method, uri, None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{method} {uri}: {v}");
        assert!(v["error"].as_str().is_some(), "{method} {uri}: {v}");
    }

    call(
        &app,
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "a", "size_bytes": 4096})),
    )
    .await;
    let (s, v) = call(
        &app,
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "a", "size_bytes": 4096})),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(v["error"].as_str().unwrap().contains("already exists"));

    for bad in [
        json!({"name": "", "size_bytes": 4096}),
        json!({"name": "../x", "size_bytes": 4096}),
        json!({"name": "a b", "size_bytes": 4096}),
        json!({"name": "ok", "size_bytes": 0}),
        json!({"name": "ok", "size_bytes": 1000}),
        json!({"name": "ok", "size_bytes": u64::MAX - 4095}),
        json!({"name": "ok"}),
        json!({"name": "ok", "size_bytes": 4096, "extra": 1}),
        json!({"name": "ok", "size_bytes": -1}),
    ] {
        let (s, v) = call(&app, "POST", "/api/v1/volumes", Some(bad.clone())).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad} -> {v}");
        assert!(v["error"].is_string(), "{bad} -> {v}");
    }

    let (s, v) = call(
        &app,
        "POST",
        "/api/v1/volumes/a/resize",
        Some(json!({"size_bytes": 0})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    call(
        &app,
        "POST",
        "/api/v1/volumes/a/resize",
        Some(json!({"size_bytes": 1 << 20})),
    )
    .await;
    let (s, v) = call(
        &app,
        "POST",
        "/api/v1/volumes/a/resize",
        Some(json!({"size_bytes": 4096})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "shrink: {v}");
    assert!(v["error"].as_str().unwrap().contains("shrinking"));
    let (s, _) = call(
        &app,
        "POST",
        "/api/v1/volumes/zz/resize",
        Some(json!({"size_bytes": 4096})),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let (s, v) = call(&app, "GET", "/api/v1/nothing", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(v["error"].is_string());
    let (s, v) = call(&app, "PUT", "/api/v1/volumes", None).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    assert!(v["error"].is_string());
    let (s, _) = call(&app, "DELETE", "/api/v1/volumes/a?force=maybe", None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn malformed_and_oversized_bodies_are_refused() {
    let (app, _) = app();
    let req = Request::builder()
        .method("POST")
        .uri("/api/v1/volumes")
        .header("content-type", "application/json")
        .body(Body::from("{not json"))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);

    let huge = format!(
        "{{\"name\": \"{}\", \"size_bytes\": 4096}}",
        "a".repeat(MAX_BODY_BYTES)
    );
    let req = Request::builder()
        .method("POST")
        .uri("/api/v1/volumes")
        .body(Body::from(huge))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(v["error"].is_string());
}

#[tokio::test]
async fn a_delete_with_a_misspelt_parameter_is_refused_and_deletes_nothing() {
    let (app, state) = app();
    create(&app, "db", 1 << 20).await;
    for query in ["forse=true", "with_snapshot=true", "force=true&with_snapshot=true"] {
        let (s, v) = call(&app, "DELETE", &format!("/api/v1/volumes/db?{query}"), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{query}: {v}");
        assert!(v["error"].as_str().is_some_and(|e| e.contains("unknown field")), "{query}: {v}");
    }
    assert!(state.registry.group().volume("db").is_some());
    let (s, v) = call(&app, "DELETE", "/api/v1/volumes/db?force=false&with_snapshots=false", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

/// A page of another site posting `text/plain` (no CORS preflight) must change nothing: a
/// forced rollback from it would discard a volume's writes.
#[tokio::test]
async fn a_web_page_of_another_origin_changes_nothing() {
    let (app, state) = app();
    create(&app, "db", 1 << 20).await;
    let (s, _) = call(&app, "POST", "/api/v1/volumes/db/snapshots", Some(json!({"name": "s1"}))).await;
    assert_eq!(s, StatusCode::CREATED);
    let page = |method: &str, uri: &str, origin: &str, host: &str, body: &str| {
        Request::builder()
            .method(method)
            .uri(uri)
            .header("host", host)
            .header("origin", origin)
            .header("content-type", "text/plain;charset=UTF-8")
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let attacks = [
        ("POST", "/api/v1/volumes", r#"{"name": "csrf", "size_bytes": 4096}"#),
        ("POST", "/api/v1/volumes/db/rollback", r#"{"snapshot": "s1", "force": true}"#),
        ("POST", "/api/v1/volumes/db/resize", r#"{"size_bytes": 2097152}"#),
        ("DELETE", "/api/v1/volumes/db/snapshots/s1?force=true", ""),
        ("DELETE", "/api/v1/volumes/db?force=true&with_snapshots=true", ""),
    ];
    // Another site, and a site whose name points at 127.0.0.1 (DNS rebinding).
    for (origin, host) in [("https://evil.example", "127.0.0.1:9090"), ("http://evil.example:9090", "evil.example:9090")] {
        for (method, uri, body) in attacks {
            let resp = app.clone().oneshot(page(method, uri, origin, host, body)).await.unwrap();
            assert_eq!(resp.status(), StatusCode::FORBIDDEN, "{method} {uri} from {origin}");
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            assert!(v["error"].as_str().is_some_and(|e| e.contains(origin)), "{v}");
        }
    }
    let group = state.registry.group();
    assert!(group.volume("csrf").is_none());
    assert_eq!(group.volume("db").map(|v| v.size_bytes), Some(1 << 20));
    let (s, _) = call(&app, "GET", "/api/v1/volumes/db/snapshots/s1", None).await;
    assert_eq!(s, StatusCode::OK, "the snapshot is still there");
    // The daemon's own page on loopback, and clients that are not browsers, go on as before.
    let own = page("POST", "/api/v1/volumes", "http://127.0.0.1:9090", "127.0.0.1:9090", r#"{"name": "mine", "size_bytes": 4096}"#);
    assert_eq!(app.clone().oneshot(own).await.unwrap().status(), StatusCode::CREATED);
    let (s, _) = call(&app, "POST", "/api/v1/volumes/db/resize", Some(json!({"size_bytes": 2 << 20}))).await;
    assert_eq!(s, StatusCode::OK);
}

/// A page whose site name its DNS points at 127.0.0.1 (DNS rebinding) reaches a loopback
/// daemon as its own origin; its requests name that site in `Host`.
#[tokio::test]
async fn a_loopback_daemon_answers_only_requests_for_loopback_names() {
    const TOKEN: &str = "rebinding-test-token-0123456789";
    let read = |host: Option<&str>, token: Option<&str>, uri: &str| {
        let mut r = Request::builder().uri(uri);
        if let Some(h) = host {
            r = r.header("host", h);
        }
        if let Some(t) = token {
            r = r.header("authorization", format!("Bearer {t}"));
        }
        r.body(Body::empty()).unwrap()
    };
    for token in [None, Some(TOKEN)] {
        let (app, _) = app_with("127.0.0.1:9090", token);
        for uri in ["/api/v1/volumes", "/api/v1/status", "/metrics", "/"] {
            let resp = app.clone().oneshot(read(Some("attacker.example:9090"), None, uri)).await.unwrap();
            assert_eq!(resp.status(), StatusCode::MISDIRECTED_REQUEST, "{uri} with token {token:?}");
            let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            let e = v["error"].as_str().unwrap_or_default();
            assert!(e.contains("\"attacker.example:9090\"") && e.contains("listen on a non-loopback address"), "{v}");
            // The CLI, curl and Prometheus on a loopback name, and HTTP/1.0 tools without Host.
            for host in [Some("127.0.0.1:9090"), Some("localhost:9090"), Some("[::1]:9090"), None] {
                let resp = app.clone().oneshot(read(host, None, uri)).await.unwrap();
                assert_eq!(resp.status(), StatusCode::OK, "{uri} for {host:?}");
            }
        }
        // A change is refused too.
        let (app, state) = app_with("127.0.0.1:9090", token);
        let post = Request::builder()
            .method("POST")
            .uri("/api/v1/volumes")
            .header("host", "attacker.example:9090")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"name": "a", "size_bytes": 4096}"#))
            .unwrap();
        let resp = app.clone().oneshot(post).await.unwrap();
        assert_eq!(resp.status(), StatusCode::MISDIRECTED_REQUEST, "token {token:?}");
        assert!(state.registry.group().volume("a").is_none());
    }
    // The token, which a page cannot send, admits another name (a proxy that passes it on).
    let (app, _) = app_with("127.0.0.1:9090", Some(TOKEN));
    let resp = app.clone().oneshot(read(Some("storage.example"), Some(TOKEN), "/metrics")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = app.clone().oneshot(read(Some("storage.example"), Some("wrong-token-0123456789"), "/metrics")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::MISDIRECTED_REQUEST);
    // A daemon on a routable address is asked for under names it cannot know.
    let (app, _) = app_with("0.0.0.0:9090", Some(TOKEN));
    let resp = app.clone().oneshot(read(Some("storage.example:9090"), None, "/api/v1/volumes")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test]
async fn delete_is_refused_while_connected_unless_forced() {
    let (app, state) = app();
    call(
        &app,
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "v", "size_bytes": 1 << 20})),
    )
    .await;
    let backend = NbdBackend(state.registry.clone());
    let handle = backend.open("v").unwrap();

    let (_, v) = call(&app, "GET", "/api/v1/volumes/v", None).await;
    assert_eq!(v["connections"], 1);
    let (s, v) = call(&app, "DELETE", "/api/v1/volumes/v", None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let (s, _) = call(&app, "DELETE", "/api/v1/volumes/v?force=false", None).await;
    assert_eq!(s, StatusCode::CONFLICT);
    let (s, _) = call(&app, "DELETE", "/api/v1/volumes/v?force=true", None).await;
    assert_eq!(s, StatusCode::OK);
    let mut buf = [0u8; 512];
    assert_eq!(handle.read(0, &mut buf), Err(strata_nbd::Errno::Shutdown));
}

#[tokio::test]
async fn status_summarizes_the_node() {
    let (app, state) = app();
    call(
        &app,
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "v", "size_bytes": 1 << 20})),
    )
    .await;
    let _handle = NbdBackend(state.registry.clone()).open("v").unwrap();
    let (s, v) = call(&app, "GET", "/api/v1/status", None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["io_backend"], "threads");
    assert_eq!(v["nbd_listen"], "127.0.0.1:10809");
    assert_eq!(v["volume_count"], 1);
    assert_eq!(v["nbd_connections_total"], 1);
    assert_eq!(v["volumes"][0]["name"], "v");
    assert_eq!(v["volumes"][0]["connections"], 1);
    assert_eq!(v["volumes"][0]["policy"]["mode"], "cache");
    assert!(v["engine"]["log_fill_ratio"].is_number());
    assert!(v["engine"]["fast_device"].is_object());
    assert_eq!(v["disk_groups"][0]["id"], "dg0");
    assert!(v["warnings"].as_array().unwrap().is_empty(), "{v}");
}

/// The routes of the OpenAPI document, as (METHOD, path) pairs, sorted.
fn documented_routes() -> Vec<(String, String)> {
    let doc: Value = serde_json::from_str(crate::api_observe::OPENAPI_JSON)
        .expect("docs/openapi.json is JSON");
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("path item").keys() {
            if ["get", "put", "post", "delete", "patch", "head", "options"].contains(&method.as_str()) {
                out.push((method.to_uppercase(), path.clone()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_served_route_is_documented_and_every_documented_one_served() {
    let served: Vec<(String, String)> = served_routes()
        .iter()
        .map(|r| (r.method.to_string(), r.path.to_string()))
        .collect();
    let documented = documented_routes();
    let undocumented: Vec<_> = served.iter().filter(|r| !documented.contains(r)).collect();
    let unserved: Vec<_> = documented.iter().filter(|r| !served.contains(r)).collect();
    assert!(
        undocumented.is_empty() && unserved.is_empty(),
        "served but not in docs/openapi.json: {undocumented:?}; documented but not served: {unserved:?}"
    );
    assert!(served.len() >= 16, "{served:?}");
}

pub(crate) async fn create(app: &Router, name: &str, size_bytes: u64) {
    let (s, v) = call(app, "POST", "/api/v1/volumes", Some(json!({"name": name, "size_bytes": size_bytes}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
}

#[tokio::test]
async fn snapshot_create_list_get_delete() {
    let (app, state) = app();
    create(&app, "v", 1 << 20).await;
    let vol = NbdBackend(state.registry.clone()).open("v").unwrap();
    vol.write(0, &[1u8; 8192], false).unwrap();

    let (s, v) = call(&app, "POST", "/api/v1/volumes/v/snapshots", Some(json!({"name": "s1"}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["name"], "s1");
    assert_eq!(v["volume"], "v");
    assert_eq!(v["export_name"], "v@s1");
    assert_eq!(v["export_uri"], "nbd://127.0.0.1:10809/v@s1");
    assert_eq!(v["size_bytes"], 1 << 20);
    assert!(v.get("space").is_none(), "a create does not walk the map: {v}");
    // Nothing overwritten yet: the volume and its snapshot share the two blocks.
    let (_, v) = call(&app, "GET", "/api/v1/volumes/v/snapshots/s1", None).await;
    assert_eq!(v["space"]["shared_fast_bytes"], 8192, "{v}");
    assert_eq!(v["space"]["exclusive_fast_bytes"], 0, "{v}");

    vol.write(0, &[2u8; 4096], false).unwrap();
    let (s, v) = call(&app, "GET", "/api/v1/volumes/v/snapshots/s1", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["space"]["exclusive_fast_bytes"], 4096, "the overwritten block is the snapshot's alone: {v}");
    assert_eq!(v["space"]["shared_fast_bytes"], 4096, "{v}");
    let (_, v) = call(&app, "GET", "/api/v1/volumes/v", None).await;
    assert_eq!(v["snapshot_count"], 1);
    assert_eq!(v["space"]["exclusive_fast_bytes"], 4096, "{v}");
    assert_eq!(v["space"]["shared_fast_bytes"], 4096, "{v}");
    assert_eq!(v["fast_tier_bytes"], 8192, "{v}");

    call(&app, "POST", "/api/v1/volumes/v/snapshots", Some(json!({"name": "s2"}))).await;
    create(&app, "w", 4096).await;
    call(&app, "POST", "/api/v1/volumes/w/snapshots", Some(json!({"name": "a"}))).await;
    let (s, v) = call(&app, "GET", "/api/v1/snapshots", None).await;
    assert_eq!(s, StatusCode::OK);
    let names: Vec<&str> = v["snapshots"].as_array().unwrap().iter().map(|x| x["export_name"].as_str().unwrap()).collect();
    assert_eq!(names, ["v@s1", "v@s2", "w@a"]);
    let (_, v) = call(&app, "GET", "/api/v1/volumes/w/snapshots", None).await;
    assert_eq!(v["snapshots"].as_array().unwrap().len(), 1);

    let (s, v) = call(&app, "DELETE", "/api/v1/volumes/v/snapshots/s1", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["deleted"], "v@s1");
    let (s, _) = call(&app, "GET", "/api/v1/volumes/v/snapshots/s1", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn snapshot_errors_have_proper_statuses() {
    let (app, state) = app();
    create(&app, "v", 1 << 20).await;
    call(&app, "POST", "/api/v1/volumes/v/snapshots", Some(json!({"name": "s"}))).await;
    let cases = [
        ("POST", "/api/v1/volumes/v/snapshots", Some(json!({"name": "s"})), StatusCode::CONFLICT),
        ("POST", "/api/v1/volumes/v/snapshots", Some(json!({"name": "a@b"})), StatusCode::BAD_REQUEST),
        ("POST", "/api/v1/volumes/v/snapshots", Some(json!({"name": ""})), StatusCode::BAD_REQUEST),
        ("POST", "/api/v1/volumes/v/snapshots", Some(json!({"nam": "x"})), StatusCode::BAD_REQUEST),
        ("POST", "/api/v1/volumes/v/snapshots", None, StatusCode::BAD_REQUEST),
        ("POST", "/api/v1/volumes/nope/snapshots", Some(json!({"name": "s"})), StatusCode::NOT_FOUND),
        ("GET", "/api/v1/volumes/nope/snapshots", None, StatusCode::NOT_FOUND),
        ("GET", "/api/v1/volumes/v/snapshots/nope", None, StatusCode::NOT_FOUND),
        ("DELETE", "/api/v1/volumes/v/snapshots/nope", None, StatusCode::NOT_FOUND),
        ("DELETE", "/api/v1/volumes/v/snapshots/s?force=maybe", None, StatusCode::BAD_REQUEST),
        ("POST", "/api/v1/volumes/v/clone", Some(json!({"snapshot": "nope", "name": "c"})), StatusCode::NOT_FOUND),
        ("POST", "/api/v1/volumes/v/clone", Some(json!({"snapshot": "s", "name": "v"})), StatusCode::CONFLICT),
        ("POST", "/api/v1/volumes/v/clone", Some(json!({"snapshot": "s", "name": "../c"})), StatusCode::BAD_REQUEST),
        ("POST", "/api/v1/volumes/v/clone", Some(json!({"snapshot": "s"})), StatusCode::BAD_REQUEST),
        ("POST", "/api/v1/volumes/v/rollback", Some(json!({"snapshot": "nope"})), StatusCode::NOT_FOUND),
        ("POST", "/api/v1/volumes/nope/rollback", Some(json!({"snapshot": "s"})), StatusCode::NOT_FOUND),
        ("POST", "/api/v1/volumes/v/rollback", Some(json!({"snapshot": "s", "force": "yes"})), StatusCode::BAD_REQUEST),
        ("DELETE", "/api/v1/volumes/v", None, StatusCode::CONFLICT),
    ];
    for (method, uri, body, want) in cases {
        let (s, v) = call(&app, method, uri, body.clone()).await;
        assert_eq!(s, want, "{method} {uri} {body:?}: {v}");
        assert!(v["error"].is_string(), "{method} {uri}: {v}");
    }
    let (_, v) = call(&app, "DELETE", "/api/v1/volumes/v", None).await;
    assert!(v["error"].as_str().unwrap().contains("snapshot"), "{v}");
    // A missing or duplicate snapshot is called a snapshot, not a volume.
    for (method, uri, body, want) in [
        ("GET", "/api/v1/volumes/v/snapshots/nope", None, "snapshot \"v@nope\" not found"),
        ("POST", "/api/v1/volumes/v/rollback", Some(json!({"snapshot": "nope"})), "snapshot \"v@nope\" not found"),
        ("POST", "/api/v1/volumes/v/snapshots", Some(json!({"name": "s"})), "snapshot \"v@s\" already exists"),
        ("GET", "/api/v1/volumes/nope", None, "volume \"nope\" not found"),
    ] {
        let (_, v) = call(&app, method, uri, body).await;
        assert_eq!(v["error"], want, "{method} {uri}");
    }
    // Nothing changed: one volume with its one snapshot.
    let (_, v) = call(&app, "GET", "/api/v1/snapshots", None).await;
    assert_eq!(v["snapshots"].as_array().unwrap().len(), 1, "{v}");
    assert_eq!(state.registry.group().volumes().len(), 1);

    let (s, v) = call(&app, "DELETE", "/api/v1/volumes/v?with_snapshots=true", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (_, v) = call(&app, "GET", "/api/v1/snapshots", None).await;
    assert!(v["snapshots"].as_array().unwrap().is_empty(), "{v}");
}

#[tokio::test]
async fn clone_and_rollback() {
    let (app, state) = app();
    let backend = NbdBackend(state.registry.clone());
    create(&app, "v", 1 << 20).await;
    let vol = backend.open("v").unwrap();
    vol.write(0, &[1u8; 4096], false).unwrap();
    call(&app, "POST", "/api/v1/volumes/v/snapshots", Some(json!({"name": "s"}))).await;
    vol.write(0, &[2u8; 4096], false).unwrap();

    let (s, v) = call(&app, "POST", "/api/v1/volumes/v/clone", Some(json!({"snapshot": "s", "name": "c"}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["name"], "c");
    assert_eq!(v["size_bytes"], 1 << 20);
    assert_eq!(v["space"]["shared_fast_bytes"], 4096, "the clone shares the snapshot's block: {v}");
    let clone = backend.open("c").unwrap();
    let mut buf = vec![0u8; 4096];
    clone.read(0, &mut buf).unwrap();
    assert_eq!(buf[0], 1);

    let (s, v) = call(&app, "POST", "/api/v1/volumes/v/rollback", Some(json!({"snapshot": "s"}))).await;
    assert_eq!(s, StatusCode::CONFLICT, "the volume is open: {v}");
    assert!(v["error"].as_str().unwrap().contains("--force"), "{v}");
    vol.read(0, &mut buf).unwrap();
    assert_eq!(buf[0], 2, "a refused rollback changes nothing");
    let (s, v) = call(&app, "POST", "/api/v1/volumes/v/rollback", Some(json!({"snapshot": "s", "force": true}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["name"], "v");
    assert_eq!(vol.read(0, &mut buf), Err(strata_nbd::Errno::Shutdown));
    backend.open("v").unwrap().read(0, &mut buf).unwrap();
    assert_eq!(buf[0], 1, "rolled back");
}

#[test]
fn the_dashboard_is_one_self_contained_page() {
    let html = include_str!("dashboard.html");
    assert!(html.len() > 10_000, "the dashboard is missing");
    let lower = html.to_ascii_lowercase();
    for forbidden in ["<script src", "<link", "@import", "http://", "https://", "url("] {
        assert!(!lower.contains(forbidden), "the dashboard must embed every asset; found {forbidden:?}");
    }
    for endpoint in ["/api/v1/history", "/api/v1/devices", "/api/v1/volumes", "/api/v1/diskgroups", "/api/v1/node"] {
        assert!(html.contains(endpoint), "the dashboard does not poll {endpoint}");
    }
}

#[test]
fn export_uri_uses_the_request_host_for_wildcard_listeners() {
    let mut headers = HeaderMap::new();
    headers.insert(header::HOST, "storage1:9090".parse().unwrap());
    assert_eq!(
        export_base("0.0.0.0:10809".parse().unwrap(), &headers),
        "nbd://storage1:10809"
    );
    assert_eq!(
        export_base("10.0.0.5:10809".parse().unwrap(), &headers),
        "nbd://10.0.0.5:10809"
    );
    assert_eq!(
        export_base("[::]:10809".parse().unwrap(), &HeaderMap::new()),
        "nbd://127.0.0.1:10809"
    );
}

#[tokio::test]
async fn a_snapshot_named_where_a_volume_goes_is_no_volume_and_stays() {
    let (app, _) = app();
    create(&app, "db", 1 << 20).await;
    let (s, v) = call(&app, "POST", "/api/v1/volumes/db/snapshots", Some(json!({"name": "s2"}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    for (method, path) in [
        ("GET", "/api/v1/volumes/db@s2"),
        ("DELETE", "/api/v1/volumes/db@s2"),
        ("GET", "/api/v1/volumes/db@s2/snapshots"),
        ("POST", "/api/v1/volumes/db@s2/resize"),
    ] {
        let (s, v) = call(&app, method, path, Some(json!({"size_bytes": 2 << 20}))).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{method} {path}: {v}");
        let e = v["error"].as_str().unwrap();
        assert!(
            e.starts_with("volume \"db@s2\" not found")
                && e.contains("/api/v1/volumes/db/snapshots/s2"),
            "{method} {path}: {e}"
        );
    }
    let (s, v) = call(&app, "GET", "/api/v1/volumes/db/snapshots/s2", None).await;
    assert_eq!(s, StatusCode::OK, "the snapshot is still there: {v}");
}

/// A size past the engine's 256 TiB is refused by the API, naming the limit and the size
/// asked for in units (it let through up to 1 PiB, and the engine refused it as "must be a
/// non-zero multiple of 512 bytes, at most 281474976710656").
#[tokio::test]
async fn a_size_over_the_largest_volume_is_refused_naming_the_limit() {
    let (app, _) = app();
    let max = strata_engine::MAX_VOLUME_BYTES;
    let over = 300u64 << 40;
    let (s, v) = call(
        &app,
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "a", "size_bytes": over})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let want = "size (329853488332800 bytes, 300 TiB) is larger than the limit of 256 TiB";
    assert_eq!(v["error"], want);
    let (s, v) = call(
        &app,
        "POST",
        "/api/v1/volumes",
        Some(json!({"name": "a", "size_bytes": max})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, v) = call(
        &app,
        "POST",
        "/api/v1/volumes/a/resize",
        Some(json!({"size_bytes": max + 4096})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let error = v["error"].as_str().unwrap();
    assert!(
        error.ends_with("is larger than the limit of 256 TiB"),
        "{error}"
    );
}

/// The scheme of `Authorization` is matched without regard to case (RFC 9110 §11.1): curl
/// users and proxies write `bearer` too. Another scheme, or none, is refused.
#[tokio::test]
async fn the_bearer_scheme_is_matched_in_any_case() {
    const TOKEN: &str = "scheme-case-test-token-0123456789";
    let (app, state) = app_with("127.0.0.1:9090", Some(TOKEN));
    let create = |name: &str, authorization: String| {
        Request::builder()
            .method("POST")
            .uri("/api/v1/volumes")
            .header("host", "127.0.0.1:9090")
            .header("content-type", "application/json")
            .header("authorization", authorization)
            .body(Body::from(format!(r#"{{"name": "{name}", "size_bytes": 4096}}"#)))
            .unwrap()
    };
    for (name, scheme) in [("a", "Bearer"), ("b", "bearer"), ("c", "BEARER")] {
        let resp = app.clone().oneshot(create(name, format!("{scheme} {TOKEN}"))).await.unwrap();
        assert_eq!(resp.status(), StatusCode::CREATED, "{scheme}");
        assert!(state.registry.group().volume(name).is_some());
    }
    for (name, value) in [("d", format!("Basic {TOKEN}")), ("e", format!("Bearer{TOKEN}")), ("f", TOKEN.to_string())] {
        let resp = app.clone().oneshot(create(name, value.clone())).await.unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{value}");
        assert!(state.registry.group().volume(name).is_none());
    }
}

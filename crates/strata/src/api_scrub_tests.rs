//! In-process tests of `/api/v1/scrub` on a disk group in memory (damage found by a scrub is
//! tested end to end in tests/e2e_scrub.rs, on real files).
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use serde_json::json;
use strata_nbd::Backend;

use crate::adapter::NbdBackend;
use crate::api::tests::{app, call, create};

#[tokio::test]
async fn a_scrub_of_a_healthy_group_is_clean_and_becomes_the_last_result() {
    let (app, state) = app();
    create(&app, "v", 1 << 20).await;
    let vol = NbdBackend(state.registry.clone()).open("v").unwrap();
    vol.write(0, &[7u8; 16384], false).unwrap();

    let (s, v) = call(&app, "GET", "/api/v1/scrub", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["running"], false);
    assert!(v["last"].is_null(), "{v}");

    let (s, v) = call(&app, "POST", "/api/v1/scrub", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["scope"], "all");
    assert_eq!(v["clean"], true, "{v}");
    assert_eq!(v["bad_blocks_total"], 0);
    assert!(v["data_bytes_verified"].as_u64().unwrap() >= 16384, "{v}");
    assert!(v["metadata_copies_checked"].as_u64().unwrap() >= 4, "{v}");

    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(json!({"volume": "v", "rate_bytes_per_s": 0}))).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["scope"], "v");

    let (_, v) = call(&app, "GET", "/api/v1/scrub", None).await;
    assert_eq!(v["last"]["scope"], "v", "{v}");
    let (_, v) = call(&app, "GET", "/api/v1/status", None).await;
    let scrub = &v["disk_groups"][0]["scrub"];
    assert_eq!(scrub["running"], false, "{v}");
    assert_eq!(scrub["last_result"]["clean"], true, "{v}");
    assert!(v["warnings"].as_array().unwrap().is_empty(), "{v}");
}

#[tokio::test]
async fn bad_scrub_requests_are_refused_with_reasons() {
    let (app, _) = app();
    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(json!({"volume": "nope"}))).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");
    assert!(v["error"].as_str().unwrap().contains("nope"), "{v}");
    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(json!({"volume": "a b"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(json!({"rate": 5}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(json!({"rate_bytes_per_s": -1}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    // None of them ran a scrub.
    let (_, v) = call(&app, "GET", "/api/v1/scrub", None).await;
    assert!(v["last"].is_null(), "{v}");
}

/// Writes 64 KiB over a new volume `v`, starts a scrub of everything at `rate_bytes_per_s`
/// and returns its request once the scrub shows as running.
async fn scrub_running(
    app: &axum::Router,
    state: &crate::api::AppState,
    rate_bytes_per_s: u64,
) -> tokio::task::JoinHandle<(StatusCode, serde_json::Value)> {
    create(app, "v", 64 << 20).await;
    let vol = NbdBackend(state.registry.clone()).open("v").unwrap();
    for i in 0..16u64 {
        vol.write(i * (1 << 20), &[1u8; 4096], false).unwrap();
    }
    let slow = {
        let app = app.clone();
        let body = json!({ "rate_bytes_per_s": rate_bytes_per_s });
        tokio::spawn(async move { call(&app, "POST", "/api/v1/scrub", Some(body)).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, v) = call(app, "GET", "/api/v1/scrub", None).await;
        if v["running"] == true {
            return slow;
        }
        assert!(Instant::now() < deadline, "the scrub never showed as running: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_second_scrub_is_refused_while_one_runs() {
    let (app, state) = app();
    // 64 KiB of data and some metadata at 64 KiB/s: a scrub of a second or two.
    let slow = scrub_running(&app, &state, 65536).await;
    let (s, v) = call(&app, "POST", "/api/v1/scrub", None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert!(v["error"].as_str().unwrap().contains("already running"), "{v}");
    let (s, v) = slow.await.unwrap();
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["clean"], true, "{v}");
}

#[tokio::test]
async fn a_scrub_not_waited_for_answers_at_once_and_runs_to_its_end() {
    let (app, state) = app();
    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(json!({"wait": "no"}))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    // At 1 KiB/s this scrub would take over a minute: it is still running when answered.
    let slow = scrub_running(&app, &state, 1024).await;
    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(json!({"wait": false}))).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    call(&app, "DELETE", "/api/v1/scrub", None).await;
    let (s, _) = slow.await.unwrap();
    assert_ne!(s, StatusCode::OK);
    let body = json!({"wait": false, "volume": "v", "rate_bytes_per_s": 1024});
    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(body)).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["running"], true, "{v}");
    assert!(v["last"].is_null(), "{v}");
    let (s, v) = call(&app, "DELETE", "/api/v1/scrub", None).await;
    assert_eq!((s, &v["running"]), (StatusCode::OK, &json!(false)), "{v}");
    // Unlimited: it ends by itself and its report is the last one.
    let (s, v) = call(&app, "POST", "/api/v1/scrub", Some(json!({"wait": false}))).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, v) = call(&app, "GET", "/api/v1/scrub", None).await;
        if v["running"] == false {
            assert_eq!(v["last"]["scope"], "all", "{v}");
            assert_eq!(v["last"]["clean"], true, "{v}");
            break;
        }
        assert!(Instant::now() < deadline, "the scrub never ended: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_scrub_whose_client_went_away_stops() {
    let (app, state) = app();
    // At 1 KiB/s this scrub would take over a minute; the client leaves once it runs.
    let slow = scrub_running(&app, &state, 1024).await;
    slow.abort();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, v) = call(&app, "GET", "/api/v1/scrub", None).await;
        if v["running"] == false {
            assert!(v["last"].is_null(), "a cancelled scrub is no result: {v}");
            break;
        }
        assert!(Instant::now() < deadline, "the scrub ran on after its client left: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn delete_stops_the_running_scrub_and_its_requester_hears_why() {
    let (app, state) = app();
    let (s, v) = call(&app, "DELETE", "/api/v1/scrub", None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["error"], "no scrub is running", "{v}");
    // At 1 KiB/s this scrub would take over a minute.
    let slow = scrub_running(&app, &state, 1024).await;
    let (s, v) = call(&app, "DELETE", "/api/v1/scrub", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["running"], false, "answered once the scrub stopped: {v}");
    assert!(v["last"].is_null(), "a cancelled scrub is no result: {v}");
    let (s, v) = slow.await.unwrap();
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(v["error"].as_str().unwrap().contains("cancelled"), "{v}");
}

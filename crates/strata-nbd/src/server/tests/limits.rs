//! Hostile and unlucky clients, concurrency, bounds, timeouts and shutdown.

use std::time::Duration;

use super::backend::GATE_OFFSET;
use super::client::Client;
use super::{eventually, TestServer};
use crate::proto::cmd;
use crate::ServerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_magic_closes_only_that_connection() {
    let server = TestServer::default().await;
    let (mut good, _) = Client::simple(server.addr, "disk").await;
    let (mut bad, _) = Client::simple(server.addr, "disk").await;
    bad.write_raw(&[0xde; 28]).await.unwrap();
    assert!(bad.is_closed().await);
    assert_eq!(good.write(0, b"still here").await.error, 0);
    assert_eq!(good.read(0, 10).await.data, b"still here");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_write_closes_the_connection_but_oversized_read_is_einval() {
    let cfg = ServerConfig {
        max_payload_bytes: 64 * 1024,
        ..ServerConfig::default()
    };
    let server = TestServer::start(cfg).await;
    let (mut c, facts) = Client::simple(server.addr, "disk").await;
    assert_eq!(c.read(0, 1 << 20).await.error, crate::Errno::Inval.code());
    assert_eq!(facts.size, super::backend::DISK_SIZE);
    // Claim a 1 GiB payload: the server must not try to buffer it.
    c.send(cmd::WRITE, 0, 0, 1 << 30, &[]).await;
    assert!(c.is_closed().await);
    eventually("handle dropped", || server.backend.open_count() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_vanishing_mid_payload_costs_only_its_connection() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    c.send(cmd::WRITE, 0, 0, 65536, &[0x11; 1000]).await;
    drop(c);
    eventually("handle dropped", || server.backend.open_count() == 0).await;
    assert!(
        server.backend.disk.ops().is_empty(),
        "a partial write never reaches the export"
    );
    let (mut next, _) = Client::simple(server.addr, "disk").await;
    assert_eq!(next.read(0, 16).await.data, [0; 16]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_come_back_in_completion_order() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::structured(server.addr, "disk").await;
    let slow = c.send(cmd::READ, 0, GATE_OFFSET, 4096, &[]).await;
    eventually("gated read started", || {
        server.backend.disk.gate.waiting() == 1
    })
    .await;
    let mut fast = Vec::new();
    for i in 0..32u64 {
        fast.push(c.send(cmd::READ, 0, i * 4096, 4096, &[]).await);
    }
    let mut answered = Vec::new();
    for _ in 0..32 {
        answered.push(c.reply().await.unwrap().cookie);
    }
    answered.sort();
    assert_eq!(
        answered, fast,
        "all quick reads answered while the slow one is held"
    );
    server.backend.disk.gate.open();
    let reply = c.reply().await.unwrap();
    assert_eq!(
        (reply.cookie, reply.error, reply.data.len()),
        (slow, 0, 4096)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_requests_are_bounded_per_connection() {
    let cfg = ServerConfig {
        max_in_flight_per_connection: 4,
        ..ServerConfig::default()
    };
    let server = TestServer::start(cfg).await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    for _ in 0..6 {
        c.send(cmd::READ, 0, GATE_OFFSET, 512, &[]).await;
    }
    eventually("four reads held", || {
        server.backend.disk.gate.waiting() == 4
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        server.backend.disk.gate.waiting(),
        4,
        "the server stopped reading at the limit"
    );
    server.backend.disk.gate.open();
    for _ in 0..6 {
        assert_eq!(c.reply().await.unwrap().error, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_requests_already_read() {
    let mut server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    let (mut idle, _) = Client::simple(server.addr, "ro").await;
    let mut handshaking = Client::connect(server.addr).await;
    c.write(GATE_OFFSET, b"durable").await;
    let cookie = c.send(cmd::READ, 0, GATE_OFFSET, 7, &[]).await;
    eventually("read in flight", || server.backend.disk.gate.waiting() == 1).await;
    server.request_stop();
    assert!(idle.is_closed().await, "idle connections close at once");
    assert!(
        handshaking.is_closed().await,
        "so do connections still haggling"
    );
    assert!(
        !server.is_finished(),
        "serve waits for the request in flight"
    );
    server.backend.disk.gate.open();
    let reply = c.reply().await.unwrap();
    assert_eq!(
        (reply.cookie, reply.data.as_slice()),
        (cookie, &b"durable"[..])
    );
    assert!(c.is_closed().await);
    let addr = server.addr;
    server.stop().await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no longer listening"
    );
}

/// A client that pipelines has requests whose headers the server has taken from the socket
/// but not started (here: held back by the in-flight limit); at shutdown they are run like
/// the ones started, the write among them made, and then the connection closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_runs_requests_waiting_in_the_read_buffer() {
    let cfg = ServerConfig {
        max_in_flight_per_connection: 2,
        ..ServerConfig::default()
    };
    let mut server = TestServer::start(cfg).await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    let first = c.send(cmd::READ, 0, GATE_OFFSET, 512, &[]).await;
    eventually("first read held", || {
        server.backend.disk.gate.waiting() == 1
    })
    .await;
    let queued = c
        .send_at_once(&[
            (cmd::READ, GATE_OFFSET, 512, Vec::new()),
            (cmd::WRITE, 0, 8, b"arrived!".to_vec()),
            (cmd::READ, 0, 512, Vec::new()),
        ])
        .await;
    eventually("second read held", || {
        server.backend.disk.gate.waiting() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.request_stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.backend.disk.gate.open();
    let mut answers = std::collections::HashMap::new();
    for _ in 0..4 {
        let reply = c.reply().await.expect("every request read is answered");
        answers.insert(reply.cookie, reply.error);
    }
    for cookie in [first, queued[0], queued[1], queued[2]] {
        assert_eq!(answers[&cookie], 0, "request {cookie}: served");
    }
    assert!(c.is_closed().await);
    assert_eq!(
        server.backend.disk.bytes(0, 8),
        *b"arrived!",
        "the write read before the stop was made"
    );
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_spares_connections_waiting_on_the_server() {
    let cfg = ServerConfig {
        idle_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let server = TestServer::start(cfg).await;
    let (mut busy, _) = Client::simple(server.addr, "disk").await;
    let (mut silent, _) = Client::simple(server.addr, "disk").await;
    busy.send(cmd::READ, 0, GATE_OFFSET, 512, &[]).await;
    assert!(silent.is_closed().await, "a silent connection is closed");
    tokio::time::sleep(Duration::from_millis(700)).await;
    server.backend.disk.gate.open();
    assert_eq!(
        busy.reply().await.unwrap().error,
        0,
        "a slow request is not idleness"
    );
    assert!(busy.is_closed().await, "then it idles out too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_outlives_the_stall_timeout_and_still_works() {
    let cfg = ServerConfig {
        stall_timeout: Duration::from_millis(200),
        ..ServerConfig::default()
    };
    assert!(
        cfg.idle_timeout.is_zero(),
        "idle connections are kept by default"
    );
    let server = TestServer::start(cfg).await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    assert_eq!(c.write(0, b"before").await.error, 0);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(c.write(0, b"after, still open").await.error, 0);
    assert_eq!(c.read(0, 17).await.data, b"after, still open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_stalling_mid_request_is_dropped_after_the_stall_timeout() {
    let cfg = ServerConfig {
        stall_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let server = TestServer::start(cfg).await;
    let (mut mid_payload, _) = Client::simple(server.addr, "disk").await;
    mid_payload
        .send(cmd::WRITE, 0, 0, 65536, &[0x11; 1000])
        .await;
    let (mut mid_header, _) = Client::simple(server.addr, "disk").await;
    mid_header
        .write_raw(&[0x25, 0x60, 0x95, 0x13, 0, 0])
        .await
        .unwrap();
    assert!(mid_payload.is_closed().await, "stalled in a payload");
    assert!(mid_header.is_closed().await, "stalled in a header");
    eventually("handles dropped", || server.backend.open_count() == 0).await;
    assert!(server.backend.disk.ops().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_replies_is_dropped_after_the_stall_timeout() {
    let cfg = ServerConfig {
        stall_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    };
    let server = TestServer::start(cfg).await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    // 64 MiB of replies, far more than the sockets buffer, and the client reads none.
    for _ in 0..16 {
        c.send(cmd::READ, 0, 0, 4 << 20, &[]).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        c.is_closed().await,
        "the server gave up writing to a client that stopped reading"
    );
    eventually("handle dropped", || server.backend.open_count() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_config_is_rejected() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend = std::sync::Arc::new(super::backend::MemBackend::new());
    let cfg = ServerConfig {
        max_payload_bytes: 100,
        ..ServerConfig::default()
    };
    let err = crate::serve(listener, backend, cfg, std::future::pending())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

/// Sends the start of a request (`part`), then stops the server: shutdown waits for the rest
/// no longer than its grace, and then hangs up (a client may send the request again).
async fn stop_with_a_request_cut_short(part: &[u8]) {
    let server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    c.write_raw(part).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    server.stop().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "bounded by the shutdown grace"
    );
    assert!(c.is_closed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_forever_for_a_stalled_payload() {
    let mut write = Vec::new();
    let header = crate::proto::RequestHeader {
        flags: 0,
        command: cmd::WRITE,
        cookie: 1,
        offset: 0,
        len_bytes: 65536,
    };
    crate::proto::encode_request(&mut write, &header);
    write.extend([0x22; 100]);
    stop_with_a_request_cut_short(&write).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_forever_for_a_stalled_header() {
    stop_with_a_request_cut_short(&0x2560_9513u32.to_be_bytes()).await;
}

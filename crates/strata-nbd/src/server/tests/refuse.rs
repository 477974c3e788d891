//! Connections over `max_connections`: told why, within bounds.

use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

use super::client::{Client, OptReply};
use super::{eventually, TestServer};
use crate::proto::{opt, rep};
use crate::server::refuse::{MAX_REFUSALS_IN_PROGRESS, REFUSAL_TIMEOUT};
use crate::ServerConfig;

const MESSAGE: &str = "too many connections (limit 1); try again later";

async fn one_connection_server() -> TestServer {
    TestServer::start(ServerConfig {
        max_connections: 1,
        ..ServerConfig::default()
    })
    .await
}

fn assert_refused(what: &str, replies: &[OptReply]) {
    assert_eq!(replies.len(), 1, "{what}: one reply");
    assert_eq!(replies[0].reply_type, rep::ERR_POLICY, "{what}");
    let text = String::from_utf8_lossy(&replies[0].data);
    assert_eq!(text, MESSAGE, "{what}: the message says why");
}

/// Whether the peer closes `stream` before sending anything, within 5 s.
async fn closed_without_a_word(stream: &mut tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await;
    matches!(read, Ok(Ok(0)) | Ok(Err(_)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_beyond_the_limit_is_told_why() {
    let server = one_connection_server().await;
    let (mut first, _) = Client::simple(server.addr, "disk").await;

    // Every option but ABORT and EXPORT_NAME is refused with the reason, as many as a client
    // sends before it gives up (qemu and libnbd ignore the refusal of their first options).
    let mut refused = Client::connect(server.addr).await;
    let replies = refused.option(opt::STRUCTURED_REPLY, &[]).await;
    assert_refused("STRUCTURED_REPLY", &replies);
    let replies = refused
        .option(opt::GO, &Client::info_payload("disk", &[]))
        .await;
    assert_refused("GO", &replies);
    let replies = refused.option(opt::ABORT, &[]).await;
    assert_eq!(replies[0].reply_type, rep::ACK, "ABORT is acknowledged");
    assert!(refused.is_closed().await, "closed after ABORT");

    // EXPORT_NAME cannot carry an error: the connection is closed instead.
    let mut old_style = Client::connect(server.addr).await;
    old_style.send_option(opt::EXPORT_NAME, b"disk").await;
    assert!(old_style.is_closed().await, "closed after EXPORT_NAME");

    assert_eq!(
        first.read(0, 8).await.error,
        0,
        "the admitted connection is unaffected"
    );
    drop(first);
    eventually("slot freed", || server.backend.open_count() == 0).await;
    // The slot is free again once the first connection is gone (its task may take a moment
    // to end after the handle is dropped, so a refusal in between is retried).
    let mut again = None;
    for _ in 0..50 {
        let mut c = Client::connect(server.addr).await;
        let replies = c.option(opt::GO, &Client::info_payload("disk", &[])).await;
        if replies.last().is_some_and(|r| r.reply_type == rep::ACK) {
            again = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut again = again.expect("admitted after the first left");
    assert_eq!(again.read(0, 8).await.error, 0);
}

/// Refusals hold a bounded number of sockets for a bounded time: beyond
/// MAX_REFUSALS_IN_PROGRESS, a connection over the limit is closed without a greeting, and a
/// refused client that says nothing is closed after REFUSAL_TIMEOUT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_bounded_in_number_and_time() {
    let server = one_connection_server().await;
    let (_first, _) = Client::simple(server.addr, "disk").await;
    let started = Instant::now();
    // Each gets its greeting, then says nothing.
    let mut silent = Vec::new();
    for _ in 0..MAX_REFUSALS_IN_PROGRESS {
        silent.push(Client::connect(server.addr).await);
    }
    let mut beyond = Client::raw(server.addr).await;
    assert!(
        closed_without_a_word(&mut beyond).await,
        "beyond {MAX_REFUSALS_IN_PROGRESS} refusals a connection is closed at once"
    );
    for (i, c) in silent.iter_mut().enumerate() {
        assert!(c.is_closed().await, "silent refused client {i} closed");
    }
    let took = started.elapsed();
    assert!(
        took >= REFUSAL_TIMEOUT && took < REFUSAL_TIMEOUT + Duration::from_secs(5),
        "silent refused clients closed after {took:?}, the timeout being {REFUSAL_TIMEOUT:?}"
    );
    // Their slots are free again: the next connection over the limit is told why.
    let mut later = Client::connect(server.addr).await;
    let replies = later.option(opt::STRUCTURED_REPLY, &[]).await;
    assert_refused("after the timeout", &replies);
}

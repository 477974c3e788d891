//! Handshake phase: greeting, option haggling, metadata contexts.

use super::backend::{DISK_SIZE, RO_SIZE};
use super::client::Client;
use super::{eventually, TestServer};
use crate::proto::{client_flags, cmd, info, opt, rep, transmission_flags as tf, BASE_ALLOCATION};
use crate::ServerConfig;

const RW_FLAGS: u16 = tf::HAS_FLAGS
    | tf::SEND_FLUSH
    | tf::SEND_FUA
    | tf::SEND_TRIM
    | tf::SEND_WRITE_ZEROES
    | tf::SEND_FAST_ZERO
    | tf::SEND_CACHE
    | tf::CAN_MULTI_CONN;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_reports_export_info_and_enters_transmission() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    let payload = Client::info_payload("disk", &[info::NAME, info::DESCRIPTION, info::BLOCK_SIZE]);
    let facts = Client::facts(&c.option(opt::GO, &payload).await);
    assert_eq!(facts.size, DISK_SIZE);
    assert_eq!(
        facts.flags, RW_FLAGS,
        "no DF without structured replies, no READ_ONLY"
    );
    assert_eq!(facts.name.as_deref(), Some("disk"));
    assert_eq!(facts.description.as_deref(), Some("test disk"));
    assert_eq!(facts.block_size, Some((1, 4096, 32 << 20)));
    let reply = c.read(0, 512).await;
    assert_eq!((reply.error, reply.data.len()), (0, 512));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_holds_no_handle_and_go_opens_afresh() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    let facts = Client::facts(&c.option(opt::INFO, &Client::info_payload("ro", &[])).await);
    assert_eq!(facts.size, RO_SIZE);
    assert_eq!(facts.flags & tf::READ_ONLY, tf::READ_ONLY);
    assert_eq!(
        facts.flags & (tf::SEND_TRIM | tf::SEND_WRITE_ZEROES),
        0,
        "nothing to trim on a read-only export"
    );
    // Held, INFO's handle would count as a client of the export until GO, and GO would
    // use it even after the export was deleted and created again.
    eventually("INFO's handle dropped", || server.backend.open_count() == 0).await;
    c.go("ro").await;
    assert_eq!(server.backend.open_count(), 1, "GO opened the export");
    drop(c);
    eventually("handle dropped", || server.backend.open_count() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_reports_every_export_and_rejects_data() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    let replies = c.option(opt::LIST, &[]).await;
    let names: Vec<String> = replies
        .iter()
        .filter(|r| r.reply_type == rep::SERVER)
        .map(|r| {
            let len = u32::from_be_bytes(r.data[..4].try_into().unwrap()) as usize;
            String::from_utf8(r.data[4..4 + len].to_vec()).unwrap()
        })
        .collect();
    assert_eq!(names, ["disk", "ro"]);
    assert_eq!(replies.last().unwrap().reply_type, rep::ACK);
    let replies = c.option(opt::LIST, b"junk").await;
    assert_eq!(replies[0].reply_type, rep::ERR_INVALID);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_options_and_exports_are_refused_but_negotiation_continues() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    assert_eq!(
        c.option(99, b"whatever").await[0].reply_type,
        rep::ERR_UNSUP
    );
    assert_eq!(
        c.option(opt::STARTTLS, &[]).await[0].reply_type,
        rep::ERR_UNSUP
    );
    let replies = c.option(opt::GO, &Client::info_payload("nope", &[])).await;
    assert_eq!(replies.len(), 1, "no INFO for an unknown export");
    assert_eq!(replies[0].reply_type, rep::ERR_UNKNOWN);
    assert_eq!(
        c.option(opt::GO, &[0, 0, 0, 9, b'x']).await[0].reply_type,
        rep::ERR_INVALID
    );
    assert_eq!(server.backend.open_count(), 0);
    c.go("disk").await;
    assert_eq!(c.read(0, 8).await.error, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_name_pads_unless_no_zeroes_and_closes_on_unknown_export() {
    let server = TestServer::default().await;
    for (flags, reply_len) in [
        (client_flags::FIXED_NEWSTYLE, 134),
        (client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES, 10),
    ] {
        let mut c = Client::connect_with_flags(server.addr, flags)
            .await
            .unwrap();
        c.send_option(opt::EXPORT_NAME, b"disk").await;
        let reply = c.read_n(reply_len).await.unwrap();
        assert_eq!(
            u64::from_be_bytes(reply[..8].try_into().unwrap()),
            DISK_SIZE
        );
        assert_eq!(u16::from_be_bytes([reply[8], reply[9]]), RW_FLAGS);
        assert!(reply[10..].iter().all(|&b| b == 0));
        assert_eq!(
            c.read(4096, 16).await.error,
            0,
            "transmission works right after the reply"
        );
    }
    let mut c = Client::connect(server.addr).await;
    c.send_option(opt::EXPORT_NAME, b"nope").await;
    assert!(
        c.is_closed().await,
        "EXPORT_NAME cannot report errors: the server must hang up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_client_flags_close_the_connection() {
    let server = TestServer::default().await;
    let mut c = Client::connect_with_flags(server.addr, 1 << 5)
        .await
        .unwrap();
    assert!(c.is_closed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_is_acknowledged_then_closed() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    assert_eq!(c.option(opt::ABORT, &[]).await[0].reply_type, rep::ACK);
    assert!(c.is_closed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn option_data_too_big_to_keep_is_refused_and_haggling_goes_on() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    for (option, len) in [
        (opt::GO, 64 * 1024 + 1),
        (opt::LIST, 1 << 20),
        (99, 300_000),
    ] {
        let replies = c.option(option, &vec![0x55; len]).await;
        assert_eq!(replies.len(), 1, "option {option}, {len} bytes");
        assert_eq!(replies[0].reply_type, rep::ERR_TOO_BIG);
    }
    let facts = c.go("disk").await;
    assert_eq!(facts.size, DISK_SIZE);
    assert_eq!(c.read(0, 8).await.error, 0);
}

fn option_header(option: u32, len: u32) -> Vec<u8> {
    let mut header = b"IHAVEOPT".to_vec();
    header.extend_from_slice(&option.to_be_bytes());
    header.extend_from_slice(&len.to_be_bytes());
    header
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_option_closes_only_that_connection() {
    let server = TestServer::default().await;
    let mut bystander = Client::connect(server.addr).await;
    for (option, len) in [
        (opt::GO, 1 << 30),
        (opt::GO, (1 << 20) + 1),
        // It cannot carry an error, so the first bound applies.
        (opt::EXPORT_NAME, 64 * 1024 + 1),
    ] {
        let mut c = Client::connect(server.addr).await;
        c.write_raw(&option_header(option, len)).await.unwrap();
        assert!(c.is_closed().await, "option {option}, {len} bytes");
    }
    let mut bad_magic = Client::connect(server.addr).await;
    bad_magic
        .write_raw(b"IHAVEOPS\0\0\0\x07\0\0\0\0")
        .await
        .unwrap();
    assert!(bad_magic.is_closed().await);
    bystander.go("disk").await;
    assert_eq!(bystander.read(0, 8).await.error, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_timeout_closes_a_silent_client() {
    let cfg = ServerConfig {
        handshake_timeout: std::time::Duration::from_millis(200),
        ..ServerConfig::default()
    };
    let server = TestServer::start(cfg).await;
    let mut c = Client::connect(server.addr).await;
    assert!(c.is_closed().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_reply_needs_no_data_and_enables_df() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    assert_eq!(
        c.option(opt::STRUCTURED_REPLY, b"x").await[0].reply_type,
        rep::ERR_INVALID
    );
    c.structured_replies().await;
    let facts = c.go("disk").await;
    assert_eq!(facts.flags, RW_FLAGS | tf::SEND_DF);
    let reply = c.read(0, 16).await;
    assert_eq!(reply.chunk_types, [crate::proto::chunk::OFFSET_DATA]);
}

fn context_names(replies: &[super::client::OptReply]) -> Vec<(u32, String)> {
    replies
        .iter()
        .filter(|r| r.reply_type == rep::META_CONTEXT)
        .map(|r| {
            (
                u32::from_be_bytes(r.data[..4].try_into().unwrap()),
                String::from_utf8(r.data[4..].to_vec()).unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_meta_context_follows_the_query_rules() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    c.structured_replies().await;
    let expect = vec![(0, BASE_ALLOCATION.to_string())];
    for queries in [
        &[][..],
        &["base:"],
        &["base:allocation"],
        &["base:", "base:allocation", "x-other:"],
    ] {
        let replies = c
            .option(
                opt::LIST_META_CONTEXT,
                &Client::meta_payload("disk", queries),
            )
            .await;
        assert_eq!(context_names(&replies), expect, "queries {queries:?}");
        assert_eq!(replies.last().unwrap().reply_type, rep::ACK);
    }
    let replies = c
        .option(
            opt::LIST_META_CONTEXT,
            &Client::meta_payload("disk", &["qemu:dirty-bitmap:x"]),
        )
        .await;
    assert_eq!(replies.len(), 1, "unknown namespaces are ignored: just ACK");
    assert_eq!(replies[0].reply_type, rep::ACK);
    let replies = c
        .option(
            opt::LIST_META_CONTEXT,
            &Client::meta_payload("disk", &["nocolon"]),
        )
        .await;
    assert_eq!(replies[0].reply_type, rep::ERR_INVALID);
    let replies = c.option(opt::LIST_META_CONTEXT, &[0, 0, 0, 1]).await;
    assert_eq!(replies[0].reply_type, rep::ERR_INVALID);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_meta_context_selects_base_allocation_for_the_named_export_only() {
    let server = TestServer::default().await;
    let mut c = Client::connect(server.addr).await;
    let payload = Client::meta_payload("disk", &["base:allocation"]);
    let replies = c.option(opt::SET_META_CONTEXT, &payload).await;
    assert_eq!(
        replies[0].reply_type,
        rep::ERR_INVALID,
        "structured replies come first"
    );
    c.structured_replies().await;
    let replies = c
        .option(
            opt::SET_META_CONTEXT,
            &Client::meta_payload("disk", &["base:"]),
        )
        .await;
    assert!(
        context_names(&replies).is_empty(),
        "`base:` selects nothing in SET"
    );
    let replies = c.option(opt::SET_META_CONTEXT, &payload).await;
    let selected = context_names(&replies);
    assert_eq!(selected.len(), 1);
    assert_eq!(selected[0].1, BASE_ALLOCATION);
    // Selected for "disk", but the client goes to "ro": no block status there.
    c.go("ro").await;
    let reply = c.request(cmd::BLOCK_STATUS, 0, 0, 4096, &[]).await;
    assert_eq!(reply.error, crate::Errno::Inval.code());
}

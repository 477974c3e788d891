//! Transmission phase: commands, flags, errors, simple and structured replies.

use super::backend::{Op, DISK_SIZE, EIO_OFFSET, GATE_OFFSET, PANIC_OFFSET, RO_SIZE};
use super::client::Client;
use super::TestServer;
use crate::proto::{chunk, cmd, cmd_flags, state};
use crate::{Errno, ServerConfig};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_read_flush_with_simple_replies() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    let data = pattern(8192, 7);
    let reply = c
        .request(cmd::WRITE, cmd_flags::FUA, 4096, 8192, &data)
        .await;
    assert_eq!(reply.error, 0);
    assert_eq!(c.read(4096, 8192).await.data, data);
    assert_eq!(c.read(4095, 2).await.data, [0, data[0]]);
    assert_eq!(c.request(cmd::FLUSH, 0, 0, 0, &[]).await.error, 0);
    assert_eq!(c.write(0, &[]).await.error, 0, "an empty write is a no-op");
    let ops = server.backend.disk.ops();
    assert_eq!(
        ops,
        [
            Op::Write {
                offset: 4096,
                len: 8192,
                fua: true
            },
            Op::Flush
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_reads_and_errors_use_chunks() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::structured(server.addr, "disk").await;
    let data = pattern(65536, 3);
    assert_eq!(c.write(0, &data).await.chunk_types, [chunk::NONE]);
    let reply = c.request(cmd::READ, cmd_flags::DF, 0, 65536, &[]).await;
    assert_eq!(
        reply.chunk_types,
        [chunk::OFFSET_DATA],
        "one final data chunk"
    );
    assert_eq!(reply.data, data);
    assert_eq!(
        c.read(100, 0).await.chunk_types,
        [chunk::NONE],
        "an empty read has no data chunk"
    );
    let reply = c.read(DISK_SIZE - 1, 2).await;
    assert_eq!(
        (reply.error, reply.chunk_types.as_slice()),
        (Errno::Inval.code(), &[chunk::ERROR][..])
    );
    assert!(
        !reply.message.is_empty(),
        "errors carry a message for humans"
    );
    let reply = c.read(EIO_OFFSET, 4096).await;
    assert_eq!(
        reply.error,
        Errno::Io.code(),
        "the export's error reaches the client"
    );
}

/// An export whose trims and write-zeroes are durable once done gets no flush for their
/// FUA: one would be counted as a FLUSH the client never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fua_on_a_durable_trim_or_write_zeroes_adds_no_flush() {
    let server = TestServer::default().await;
    server
        .backend
        .disk
        .durable_replies
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    for command in [cmd::TRIM, cmd::WRITE_ZEROES] {
        let reply = c.request(command, cmd_flags::FUA, 0, 4096, &[]).await;
        assert_eq!(reply.error, 0);
    }
    let ops = server.backend.disk.ops();
    assert!(!ops.contains(&Op::Flush), "{ops:?}");
    assert_eq!(ops.len(), 2, "{ops:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trim_write_zeroes_and_cache_reach_the_export() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    c.write(0, &pattern(16384, 1)).await;
    assert_eq!(
        c.request(cmd::TRIM, cmd_flags::FUA, 0, 4096, &[])
            .await
            .error,
        0
    );
    assert_eq!(
        c.request(cmd::WRITE_ZEROES, 0, 4096, 4096, &[]).await.error,
        0
    );
    let flags = cmd_flags::NO_HOLE | cmd_flags::FAST_ZERO;
    assert_eq!(
        c.request(cmd::WRITE_ZEROES, flags, 8192, 4096, &[])
            .await
            .error,
        0
    );
    assert_eq!(c.request(cmd::CACHE, 0, 0, 65536, &[]).await.error, 0);
    assert_eq!(c.read(0, 12288).await.data, vec![0; 12288]);
    assert_eq!(c.read(12288, 4096).await.data, pattern(16384, 1)[12288..]);
    let ops = server.backend.disk.ops();
    assert_eq!(
        &ops[1..],
        [
            Op::Trim {
                offset: 0,
                len: 4096
            },
            Op::Flush, // FUA on trim is honoured with a flush
            Op::WriteZeroes {
                offset: 4096,
                len: 4096,
                may_trim: true
            },
            Op::WriteZeroes {
                offset: 8192,
                len: 4096,
                may_trim: false
            },
            Op::Cache {
                offset: 0,
                len: 65536
            },
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_zero_without_a_whole_aligned_block_is_enotsup_and_changes_nothing() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::structured(server.addr, "disk").await;
    let data = pattern(16384, 4);
    assert_eq!(c.write(0, &data).await.error, 0);
    let fast = cmd_flags::FAST_ZERO;
    for (flags, offset, len) in [
        (fast, 512, 512),
        (fast, 4096 + 100, 4000),
        (fast, 4000, 200),
        (fast, 8191, 2),
        (fast | cmd_flags::NO_HOLE, 512, 512),
    ] {
        let reply = c.request(cmd::WRITE_ZEROES, flags, offset, len, &[]).await;
        assert_eq!(
            (reply.error, reply.chunk_types.as_slice()),
            (Errno::NotSup.code(), &[chunk::ERROR][..]),
            "fast zero of {len} bytes at {offset}"
        );
    }
    assert!(c.read(0, 16384).await.data == data, "nothing was zeroed");
    // Without FAST_ZERO the same range is zeroed; with it, any range holding a whole
    // aligned block is accepted, ragged ends included, and so is an empty one.
    let accepted = [
        (0, 512, 512),
        (fast, 2048, 8192),
        (fast, 12288, 4096),
        (fast, 100, 0),
    ];
    for (flags, offset, len) in accepted {
        let reply = c.request(cmd::WRITE_ZEROES, flags, offset, len, &[]).await;
        assert_eq!(reply.error, 0, "zero of {len} bytes at {offset}");
    }
    let mut expect = data;
    expect[512..1024].fill(0);
    expect[2048..10240].fill(0);
    expect[12288..].fill(0);
    assert!(
        c.read(0, 16384).await.data == expect,
        "the accepted ones zeroed"
    );
    let zeroes: Vec<Op> = server.backend.disk.ops().into_iter().skip(1).collect();
    let op = |offset, len| Op::WriteZeroes {
        offset,
        len,
        may_trim: true,
    };
    assert_eq!(zeroes, [op(512, 512), op(2048, 8192), op(12288, 4096)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_reports_clipped_extents() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::structured(server.addr, "disk").await;
    c.write(0, &pattern(8192, 9)).await;
    let reply = c.request(cmd::BLOCK_STATUS, 0, 0, 65536, &[]).await;
    assert_eq!(reply.chunk_types, [chunk::BLOCK_STATUS]);
    assert_ne!(reply.context_id, Some(0));
    assert_eq!(
        reply.extents,
        [(8192, 0), (65536 - 8192, state::HOLE | state::ZERO)]
    );
    // The backend reports the whole 4 MiB hole; the reply must stop at the requested length.
    let reply = c.request(cmd::BLOCK_STATUS, 0, 8192, 4096, &[]).await;
    assert_eq!(reply.extents, [(4096, state::HOLE | state::ZERO)]);
    let reply = c
        .request(cmd::BLOCK_STATUS, cmd_flags::REQ_ONE, 0, 65536, &[])
        .await;
    assert_eq!(reply.extents, [(8192, 0)]);
    let reply = c
        .request(cmd::BLOCK_STATUS, cmd_flags::REQ_ONE, 4096, 1024, &[])
        .await;
    assert_eq!(reply.extents, [(1024, 0)]);
    let reply = c
        .request(cmd::BLOCK_STATUS, 0, DISK_SIZE - 4096, 8192, &[])
        .await;
    assert_eq!(reply.error, Errno::Inval.code());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_status_without_meta_context_is_einval() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    assert_eq!(
        c.request(cmd::BLOCK_STATUS, 0, 0, 4096, &[]).await.error,
        Errno::Inval.code()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_get_the_spec_errors() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    let inval = Errno::Inval.code();
    assert_eq!(c.read(DISK_SIZE - 512, 1024).await.error, inval);
    assert_eq!(
        c.read(u64::MAX - 10, 512).await.error,
        inval,
        "offset + length overflows"
    );
    let reply = c
        .request(cmd::WRITE, 0, DISK_SIZE, 4096, &pattern(4096, 0))
        .await;
    assert_eq!(reply.error, Errno::NoSpc.code());
    assert_eq!(
        c.request(cmd::WRITE_ZEROES, 0, DISK_SIZE - 1, 2, &[])
            .await
            .error,
        Errno::NoSpc.code()
    );
    assert_eq!(
        c.request(cmd::TRIM, 0, DISK_SIZE, 1, &[]).await.error,
        inval
    );
    assert_eq!(
        c.request(42, 0, 0, 0, &[]).await.error,
        inval,
        "unknown command"
    );
    assert_eq!(
        c.request(cmd::READ, cmd_flags::REQ_ONE, 0, 8, &[])
            .await
            .error,
        inval,
        "flag of another command"
    );
    assert_eq!(
        c.request(cmd::READ, cmd_flags::DF, 0, 8, &[]).await.error,
        inval,
        "DF needs structured replies"
    );
    assert_eq!(
        c.request(cmd::READ, 1 << 9, 0, 8, &[]).await.error,
        inval,
        "unknown flag"
    );
    assert_eq!(
        c.read(0, 64 << 20).await.error,
        inval,
        "read above the maximum block size"
    );
    // A refused write's payload was consumed: the stream is still in step.
    assert_eq!(c.write(0, &pattern(512, 5)).await.error, 0);
    assert_eq!(c.read(0, 512).await.data, pattern(512, 5));
    assert!(
        server.backend.disk.ops().len() == 1,
        "refused requests never reach the export"
    );
}

/// Every request the server answers with an error on its own is told to the export
/// (`Export::refused`), which counts requests: a client sees those errors as much as the
/// export's. What the export answers, failures included, and empty requests are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_refused_without_the_export_are_told_to_it() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::structured(server.addr, "disk").await;
    let inval = Errno::Inval;
    let refused = [
        (cmd::WRITE, 0, DISK_SIZE, 4096, Errno::NoSpc),
        (cmd::READ, 0, DISK_SIZE + 4096, 512, inval),
        (cmd::READ, 1 << 9, 0, 8, inval),
        (cmd::READ, cmd_flags::DF, 0, 64 << 20, Errno::Overflow),
        (cmd::READ, 0, 0, 64 << 20, inval),
        (cmd::FLUSH, cmd_flags::DF, 0, 0, inval),
        (cmd::TRIM, 0, DISK_SIZE, 1, inval),
        (cmd::WRITE_ZEROES, 0, DISK_SIZE - 1, 2, Errno::NoSpc),
        (cmd::WRITE_ZEROES, cmd_flags::FAST_ZERO, 512, 512, Errno::NotSup),
        (cmd::CACHE, 0, u64::MAX - 10, 512, inval),
        (cmd::BLOCK_STATUS, 0, 4096, 0, inval),
        (42, 0, 0, 0, inval),
    ];
    for (command, flags, offset, len, errno) in refused {
        let payload = match command {
            cmd::WRITE => pattern(len as usize, 1),
            _ => Vec::new(),
        };
        let reply = c.request(command, flags, offset, len, &payload).await;
        assert_eq!(reply.error, errno.code(), "command {command}, {len} bytes at {offset}");
    }
    assert_eq!(c.read(EIO_OFFSET, 512).await.error, Errno::Io.code());
    assert_eq!(c.write(0, &pattern(512, 2)).await.error, 0);
    assert_eq!(c.request(cmd::TRIM, 0, 0, 0, &[]).await.error, 0);
    let told: Vec<(u16, Errno)> = refused.iter().map(|r| (r.0, r.4)).collect();
    assert_eq!(server.backend.disk.refusals(), told);

    let (mut ro, _) = Client::simple(server.addr, "ro").await;
    assert_eq!(ro.write(0, &pattern(4096, 3)).await.error, Errno::Perm.code());
    assert_eq!(ro.read(0, 4).await.error, 0);
    assert_eq!(server.backend.ro.refusals(), [(cmd::WRITE, Errno::Perm)]);
}

/// A panic in the export is answered with EIO, and the export, which never answered the
/// request, is told of it as of a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_the_export_is_eio_and_told_to_it() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    assert_eq!(c.read(PANIC_OFFSET, 512).await.error, Errno::Io.code());
    assert_eq!(c.read(0, 512).await.error, 0, "the connection carries on");
    assert_eq!(server.backend.disk.refusals(), [(cmd::READ, Errno::Io)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn df_read_too_large_is_eoverflow() {
    let cfg = ServerConfig {
        max_payload_bytes: 64 * 1024,
        ..ServerConfig::default()
    };
    let server = TestServer::start(cfg).await;
    let (mut c, _) = Client::structured(server.addr, "disk").await;
    let reply = c
        .request(cmd::READ, cmd_flags::DF, 0, 128 * 1024, &[])
        .await;
    assert_eq!(
        (reply.error, reply.chunk_types.as_slice()),
        (Errno::Overflow.code(), &[chunk::ERROR][..])
    );
    assert_eq!(c.read(0, 128 * 1024).await.error, Errno::Inval.code());
    assert_eq!(
        c.request(cmd::READ, cmd_flags::DF, 0, 64 * 1024, &[])
            .await
            .error,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_export_refuses_writes_with_eperm() {
    let server = TestServer::default().await;
    let (mut c, facts) = Client::simple(server.addr, "ro").await;
    assert_eq!(facts.size, RO_SIZE);
    let perm = Errno::Perm.code();
    assert_eq!(c.write(0, &pattern(4096, 0)).await.error, perm);
    assert_eq!(c.request(cmd::TRIM, 0, 0, 4096, &[]).await.error, perm);
    assert_eq!(
        c.request(cmd::WRITE_ZEROES, 0, 0, 4096, &[]).await.error,
        perm
    );
    assert_eq!(c.read(0, 4).await.data, [0xa5; 4]);
    assert!(server.backend.ro.ops().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disc_closes_after_answering_what_was_sent() {
    let server = TestServer::default().await;
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    let cookie = c.send(cmd::WRITE, 0, 0, 4, b"abcd").await;
    c.send(cmd::DISC, 0, 0, 0, &[]).await;
    assert_eq!(c.reply().await.unwrap().cookie, cookie);
    assert!(c.is_closed().await);
    assert_eq!(server.backend.disk.bytes(0, 4), b"abcd");
}

/// A write the client waits for before sending the next is offered to the export as alone
/// (`write_nowait_alone`, which may block the reader), from the second such write on; writes
/// sent together, queued behind one another, never are: the reader must go on reading them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_writes_sent_one_at_a_time_are_offered_as_alone() {
    use std::sync::atomic::Ordering::Relaxed;
    let server = TestServer::default().await;
    let disk = &server.backend.disk;
    disk.elsewhere.store(true, Relaxed);
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    for i in 0..10u64 {
        assert_eq!(c.write(i * 4096, &[i as u8 + 1; 4096]).await.error, 0);
    }
    assert_eq!(
        disk.alone_writes.load(Relaxed),
        9,
        "all but the first of ten lone writes"
    );
    let writes: Vec<(u64, Vec<u8>)> = (0..16u64)
        .map(|i| (64 * 1024 + i * 512, vec![0xA0 + i as u8; 512]))
        .collect();
    let mut cookies: Vec<u64> = c.send_writes_at_once(&writes).await;
    for _ in 0..writes.len() {
        let r = c.reply().await.expect("a reply");
        assert_eq!(r.error, 0);
        cookies.retain(|&k| k != r.cookie);
    }
    assert!(cookies.is_empty(), "every write answered once");
    // The first of them may have been read before the rest reached the socket; no more.
    let offered = disk.alone_writes.load(Relaxed) - 9;
    assert!(
        offered <= 1,
        "{offered} of 16 writes sent together were offered as alone"
    );
    for (offset, data) in &writes {
        assert_eq!(&disk.bytes(*offset, data.len()), data);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_from_completing_threads_stay_whole_when_the_socket_fills() {
    const N: u64 = 300;
    const LEN: u32 = 60 * 1024;
    let server = TestServer::start(ServerConfig {
        max_in_flight_per_connection: 512,
        max_buffered_bytes_per_connection: 64 << 20,
        max_buffered_bytes_total: 64 << 20,
        ..ServerConfig::default()
    })
    .await;
    let disk = &server.backend.disk;
    disk.elsewhere.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut c, _) = Client::simple(server.addr, "disk").await;
    let data = pattern(DISK_SIZE as usize, 5);
    for (i, part) in data.chunks(1 << 20).enumerate() {
        assert_eq!(c.write(i as u64 * (1 << 20), part).await.error, 0);
    }
    // One at a time: each reply is written by the thread that completes it.
    for i in 0..20u64 {
        let off = i * 4096 * 7;
        assert_eq!(c.read(off, 4096).await.data, data[off as usize..][..4096]);
    }
    // Reads sent one by one without reading a reply: each completes alone, so its thread
    // writes it, until ~18 MiB of replies fill the socket; then one is written in part, and
    // the writer task finishes it before the others queued behind it.
    let offset = |i: u64| match (i * 4096 * 13) % (DISK_SIZE - u64::from(LEN)) {
        o if o == GATE_OFFSET || o == EIO_OFFSET => o + 4096,
        o => o,
    };
    let mut expect = std::collections::HashMap::new();
    for i in 0..N {
        let cookie = c.send(cmd::READ, 0, offset(i), LEN, &[]).await;
        expect.insert(cookie, offset(i));
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    for _ in 0..N {
        let r = c.reply().await.expect("a whole reply");
        assert_eq!(r.error, 0);
        let off = expect.remove(&r.cookie).expect("a cookie asked for, answered once");
        assert!(r.data == data[off as usize..][..LEN as usize], "reply {} garbled", r.cookie);
    }
    assert_eq!(c.write(0, &[9u8; 4096]).await.error, 0, "the connection goes on");
    assert_eq!(disk.bytes(0, 4096), [9u8; 4096]);
}

//! Misbehaving clients on raw TCP: each abuse costs that connection and nothing else. After
//! every abuse a bystander connection opened beforehand and a fresh qemu-io client still work.
use crate::common;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use common::nbd::{self, Closed};
use common::*;

const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection opened before the abuse, used after it.
fn bystander(daemon: &Daemon) -> nbd::Client {
    let mut client = nbd::go(daemon.nbd_addr, VOL0).expect("bystander NBD_OPT_GO");
    assert_eq!(client.size_bytes, VOL0_SIZE_BYTES);
    assert_eq!(
        client.write(5 << 20, &[0x5b; 4096]).expect("bystander io"),
        Ok(())
    );
    client
}

fn assert_unharmed(daemon: &mut Daemon, bystander: &mut nbd::Client) {
    daemon.assert_alive();
    let data = bystander
        .read(5 << 20, 4096)
        .expect("bystander io after abuse");
    assert_eq!(data, Ok(vec![0x5b; 4096]), "bystander read after abuse");
    assert_fresh_client_works(daemon);
}

fn assert_closed(what: &str, stream: &mut TcpStream) {
    let closed = nbd::wait_closed(stream, CLOSE_TIMEOUT);
    assert!(
        matches!(closed, Closed::Yes { .. }),
        "{what}: connection still open after {CLOSE_TIMEOUT:?}"
    );
}

/// A connection that completed the greeting (flags exchanged), ready for options.
fn negotiating(daemon: &Daemon) -> TcpStream {
    let mut stream = nbd::connect(daemon.nbd_addr);
    nbd::greet(&mut stream).expect("greeting");
    stream
}

#[test]
fn bad_option_magic_drops_only_that_client() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    let mut stream = negotiating(&daemon);
    let mut msg = nbd::option_bytes(nbd::OPT_GO, &nbd::go_payload(VOL0));
    msg[0..8].copy_from_slice(b"NOTMAGIC");
    stream.write_all(&msg).expect("send");
    assert_closed("bad option magic", &mut stream);
    assert_unharmed(&mut daemon, &mut other);
}

#[test]
fn garbage_instead_of_a_handshake_drops_only_that_client() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    // An HTTP request on the NBD port: wrong client flags, then junk.
    let mut stream = nbd::connect(daemon.nbd_addr);
    let _ = stream.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_closed("garbage handshake", &mut stream);
    assert_unharmed(&mut daemon, &mut other);
}

#[test]
fn oversized_option_length_costs_the_connection() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    // Claims a 4 GiB option payload and sends a few bytes of it: the server must not wait
    // for (or allocate) what the client claims.
    let mut stream = negotiating(&daemon);
    let mut msg = Vec::new();
    msg.extend_from_slice(&nbd::IHAVEOPT.to_be_bytes());
    msg.extend_from_slice(&nbd::OPT_GO.to_be_bytes());
    msg.extend_from_slice(&0xffff_fff0u32.to_be_bytes());
    msg.extend_from_slice(&[0u8; 64]);
    stream.write_all(&msg).expect("send");
    assert_closed("oversized option length", &mut stream);
    assert_unharmed(&mut daemon, &mut other);
}

#[test]
fn oversized_write_length_costs_the_connection() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    let mut client = nbd::go(daemon.nbd_addr, VOL0).expect("go");
    // A 2 GiB WRITE whose payload never comes: the server cannot resynchronise, so it must
    // drop the connection instead of buffering 2 GiB.
    client
        .stream
        .write_all(&nbd::request_bytes(0, nbd::CMD_WRITE, 1, 0, 0x8000_0000))
        .expect("send");
    client.stream.write_all(&[0xee; 4096]).expect("send");
    assert_closed("oversized write length", &mut client.stream);
    // Nothing of the refused write landed.
    qemu_io_ok(&daemon.nbd_uri(VOL0), &["read -P 0 0 4096"]);
    assert_unharmed(&mut daemon, &mut other);
}

#[test]
fn oversized_read_length_is_refused() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    let mut client = nbd::go(daemon.nbd_addr, VOL0).expect("go");
    let cookie = client.send(nbd::CMD_READ, 0, u32::MAX, &[]).expect("send");
    // Either an error reply (EINVAL/EOVERFLOW/ENOMEM) or a dropped connection; never 4 GiB
    // of data.
    match client.read_reply_header() {
        Ok((errno, got)) => {
            assert_eq!(got, cookie);
            assert_ne!(errno, 0, "the server accepted a 4 GiB read");
        }
        Err(_) => assert_closed("oversized read", &mut client.stream),
    }
    assert_unharmed(&mut daemon, &mut other);
}

#[test]
fn error_replies_follow_the_spec() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    let mut client = nbd::go(daemon.nbd_addr, VOL0).expect("go");
    let size = client.size_bytes;

    // Unknown command: EINVAL.
    let cookie = client.send(0x42, 0, 0, &[]).expect("send");
    assert_eq!(
        client.read_reply_header().expect("reply"),
        (nbd::EINVAL, cookie),
        "unknown command"
    );
    // READ past the end: EINVAL.
    assert_eq!(
        client.read(size, 512).expect("io"),
        Err(nbd::EINVAL),
        "read at the end"
    );
    assert_eq!(
        client.read(size - 512, 1024).expect("io"),
        Err(nbd::EINVAL),
        "read across the end"
    );
    // WRITE past the end: ENOSPC, after the payload was consumed.
    assert_eq!(
        client.write(size, &[1u8; 512]).expect("io"),
        Err(nbd::ENOSPC),
        "write at the end"
    );
    assert_eq!(
        client.write(size - 512, &[1u8; 1024]).expect("io"),
        Err(nbd::ENOSPC),
        "write across the end"
    );
    // The connection is still in sync: the last sector takes a write and reads it back.
    assert_eq!(client.write(size - 512, &[9u8; 512]).expect("io"), Ok(()));
    assert_eq!(
        client.read(size - 512, 512).expect("io"),
        Ok(vec![9u8; 512])
    );
    client.disconnect();
    assert_unharmed(&mut daemon, &mut other);
}

/// With structured replies negotiated (as qemu and libnbd do), every error comes back as an
/// ERROR chunk with the spec's errno and a message, reads as data chunks at their offsets,
/// and the connection stays in sync after each error.
#[test]
fn structured_error_replies_carry_the_specs_errno() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    let mut client = nbd::go_structured(daemon.nbd_addr, VOL0).expect("go");
    let size = client.size_bytes;
    let errno = |r: Result<(), (u32, String)>, what: &str| match r {
        Ok(()) => panic!("{what}: succeeded"),
        Err((errno, message)) => {
            assert!(
                !message.is_empty(),
                "{what}: an error chunk without a message"
            );
            errno
        }
    };
    let unknown = client.outcome(0x42, 0, 0, &[]).expect("io");
    assert_eq!(errno(unknown, "unknown command"), nbd::EINVAL);
    for (offset, len, what) in [
        (size, 512, "read at the end"),
        (size - 512, 1024, "read across the end"),
    ] {
        let read = client.read_structured(offset, len).expect("io").map(drop);
        assert_eq!(errno(read, what), nbd::EINVAL, "{what}");
    }
    for (offset, len, what) in [
        (size, 512, "write at the end"),
        (size - 512, 1024, "write across the end"),
    ] {
        let payload = vec![1u8; len];
        let write = client
            .outcome(nbd::CMD_WRITE, offset, len as u32, &payload)
            .expect("io");
        assert_eq!(errno(write, what), nbd::ENOSPC, "{what}");
    }
    // Still in sync: the last sector takes a write and reads it back; around it, unwritten
    // space reads as zeros.
    let last = client
        .outcome(nbd::CMD_WRITE, size - 512, 512, &[9u8; 512])
        .expect("io");
    assert_eq!(last, Ok(()), "write of the last sector");
    let mut expected = vec![0u8; 8192];
    expected[8192 - 512..].fill(9);
    let back = client.read_structured(size - 8192, 8192).expect("io");
    assert_eq!(back, Ok(expected), "the end of the volume read back");
    client.disconnect();
    assert_unharmed(&mut daemon, &mut other);
}

#[test]
fn disconnect_mid_payload_applies_nothing() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    let offset = 16 << 20;
    for sent in [0usize, 1000, 65536, (1 << 20) - 1] {
        let mut client = nbd::go(daemon.nbd_addr, VOL0).expect("go");
        client
            .stream
            .write_all(&nbd::request_bytes(0, nbd::CMD_WRITE, 1, offset, 1 << 20))
            .expect("send");
        client.stream.write_all(&vec![0xd1; sent]).expect("send");
        drop(client);
    }
    // Also mid-header.
    let mut client = nbd::go(daemon.nbd_addr, VOL0).expect("go");
    client
        .stream
        .write_all(&nbd::request_bytes(0, nbd::CMD_WRITE, 1, offset, 4096)[..13])
        .expect("send");
    drop(client);
    // A write whose payload never fully arrived was never acknowledged, and a server that
    // executes only complete requests leaves the range untouched. Read only once the daemon
    // has let go of every abused connection (each holds its handle until its requests are
    // done), so a partial write applied late is caught rather than raced.
    daemon.assert_alive();
    let node = format!("{}/api/v1/node", daemon.http_url());
    let only_bystander = wait_until(CLOSE_TIMEOUT, || {
        common::http::get_json(&node)["nbd_connections_total"] == 1
    });
    assert!(
        only_bystander,
        "abused connections still open after {CLOSE_TIMEOUT:?}: {}",
        common::http::get_json(&node)
    );
    qemu_io_ok(
        &daemon.nbd_uri(VOL0),
        &[&format!("read -P 0 {offset} 1048576")],
    );
    assert_unharmed(&mut daemon, &mut other);
}

#[test]
fn unknown_option_is_unsupported_and_negotiation_continues() {
    if !require_tool("qemu-io") {
        return;
    }
    let mut daemon = Daemon::start_default();
    let mut other = bystander(&daemon);
    let mut stream = negotiating(&daemon);
    nbd::send_option(&mut stream, 0x7777, b"whatever").expect("send");
    let reply = nbd::read_option_reply(&mut stream).expect("reply to unknown option");
    assert_eq!(
        (reply.option, reply.reply_type),
        (0x7777, nbd::REP_ERR_UNSUP)
    );
    // Unknown export: NBD_REP_ERR_UNKNOWN, and negotiation still continues.
    nbd::send_option(&mut stream, nbd::OPT_GO, &nbd::go_payload("no-such-volume")).expect("send");
    let reply = nbd::read_option_reply(&mut stream).expect("reply to GO");
    assert_eq!(reply.reply_type, nbd::REP_ERR_UNKNOWN, "unknown export");
    let mut client = nbd::go_on(stream, VOL0).expect("GO after refusals");
    assert_eq!(
        client.read(5 << 20, 4096).expect("io"),
        Ok(vec![0x5b; 4096])
    );
    assert_unharmed(&mut daemon, &mut other);
}

#[test]
fn option_list_and_export_name_work() {
    let daemon = Daemon::start_default();
    daemon.create_volume("other", "64M");
    let mut stream = negotiating(&daemon);
    nbd::send_option(&mut stream, nbd::OPT_LIST, &[]).expect("send");
    let mut names = Vec::new();
    loop {
        let reply = nbd::read_option_reply(&mut stream).expect("LIST reply");
        match reply.reply_type {
            nbd::REP_SERVER => {
                let len =
                    u32::from_be_bytes(reply.data[0..4].try_into().expect("4 bytes")) as usize;
                names.push(String::from_utf8(reply.data[4..4 + len].to_vec()).expect("utf-8 name"));
            }
            nbd::REP_ACK => break,
            t => panic!("unexpected LIST reply type {t:#x}"),
        }
    }
    names.sort();
    assert_eq!(names, ["other", VOL0]);

    // The oldest way in: NBD_OPT_EXPORT_NAME answers with size and flags, no reply header.
    let server_flags = {
        let mut s = nbd::connect(daemon.nbd_addr);
        let flags = nbd::greet(&mut s).expect("greeting");
        stream = s;
        flags
    };
    nbd::send_option(&mut stream, nbd::OPT_EXPORT_NAME, b"other").expect("send");
    let mut answer = vec![0u8; 10];
    std::io::Read::read_exact(&mut stream, &mut answer).expect("EXPORT_NAME answer");
    assert_eq!(
        u64::from_be_bytes(answer[0..8].try_into().expect("8 bytes")),
        64 * MIB
    );
    if server_flags & nbd::FLAG_NO_ZEROES == 0 {
        let mut zeroes = [0u8; 124];
        std::io::Read::read_exact(&mut stream, &mut zeroes).expect("124 zero bytes");
    }
    let mut client = nbd::Client::from_stream(stream, 64 * MIB);
    assert_eq!(client.write(0, &[3u8; 512]).expect("io"), Ok(()));
    assert_eq!(client.read(0, 512).expect("io"), Ok(vec![3u8; 512]));
}

/// `--nbd-idle-timeout`: a connection that has gone quiet after its requests is closed once
/// the timeout has passed, while on a daemon with the default (off) a quiet connection stays.
/// The bounds are loose on purpose: at least most of the timeout, at most many times it.
#[test]
fn the_idle_timeout_closes_quiet_connections_only_when_set() {
    let idle = Duration::from_secs(2);
    let strict = Daemon::start(DaemonOpts {
        extra_args: vec!["--nbd-idle-timeout".into(), "2s".into()],
        ..Default::default()
    });
    let lenient = Daemon::start_default();
    let mut quiet = nbd::go(strict.nbd_addr, VOL0).expect("NBD_OPT_GO, idle timeout set");
    let mut kept = nbd::go(lenient.nbd_addr, VOL0).expect("NBD_OPT_GO, default");
    assert_eq!(quiet.write(0, &[7u8; 4096]).expect("io"), Ok(()));
    assert_eq!(kept.write(0, &[9u8; 4096]).expect("io"), Ok(()));

    let quiet_since = std::time::Instant::now();
    let closed = nbd::wait_closed(&mut quiet.stream, idle * 15);
    let waited = quiet_since.elapsed();
    assert!(
        matches!(closed, nbd::Closed::Yes { .. }),
        "a quiet connection outlived --nbd-idle-timeout 2s by far\n{}",
        strict.stderr_log()
    );
    assert!(
        waited >= idle / 2,
        "closed after {waited:?}, before the idle timeout"
    );

    // The default connection has been quiet as long, and longer than the other's timeout.
    assert_eq!(
        nbd::wait_closed(&mut kept.stream, idle),
        nbd::Closed::StillOpen,
        "without --nbd-idle-timeout a quiet connection is kept"
    );
    assert_eq!(kept.read(0, 4096).expect("io"), Ok(vec![9u8; 4096]));
    // A fresh connection to the strict daemon still works: only the quiet one was closed.
    let mut fresh = nbd::go(strict.nbd_addr, VOL0).expect("NBD_OPT_GO after the close");
    assert_eq!(fresh.read(0, 4096).expect("io"), Ok(vec![7u8; 4096]));
}

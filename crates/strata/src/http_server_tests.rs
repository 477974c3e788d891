//! The admin port's accept loop on a real socket, with clients that connect and then send half
//! a request or nothing.
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::{serve, HttpLimits};

/// A bound on how long a test waits for the server, so one that never acts fails the test
/// instead of hanging it. Far above the short limits the tests set.
const WAIT: Duration = Duration::from_secs(30);

struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

async fn start(limits: HttpLimits) -> Server {
    let (_, state) = crate::api::tests::app();
    let app = crate::api::router(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, app, limits, async {
        let _ = stopped.await;
    }));
    Server {
        addr,
        stop: Some(stop),
        task,
    }
}

/// Connects and sends `text`, the start of a request that never comes whole.
fn stalled(addr: SocketAddr, text: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(text.as_bytes()).unwrap();
    s
}

const HALF_HEADERS: &str = "GET /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\n";
const LIST: &str = "GET /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";

/// Everything the server sends on `s` until it closes the connection, or None when it is still
/// open after [`WAIT`].
fn until_closed(s: &mut TcpStream) -> Option<String> {
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&got).into_owned()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return None
            }
            Err(_) => return Some(String::from_utf8_lossy(&got).into_owned()),
        }
    }
}

/// The answer to a request sent whole with `Connection: close`.
fn request(addr: SocketAddr, text: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(text.as_bytes()).unwrap();
    until_closed(&mut s)
}

/// Sockets of the port `port` that this process holds open and that are not listening: the
/// server's side of its accepted connections (a connection still in the listen backlog has no
/// descriptor; the tests' own ends have another local port).
fn accepted_sockets(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/self/net/tcp").unwrap();
    let inodes: std::collections::HashSet<String> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok()?;
            let listening = f[3] == "0A";
            (local_port == port && !listening && f[9] != "0").then(|| f[9].to_string())
        })
        .collect();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|link| {
            let link = link.to_string_lossy();
            link.strip_prefix("socket:[")
                .and_then(|l| l.strip_suffix(']'))
                .is_some_and(|inode| inodes.contains(inode))
        })
        .count()
}

/// Waits until the server holds at least `n` accepted connections, and returns how many (None
/// if it never does in [`WAIT`]).
fn wait_for_accepted(port: u16, n: usize) -> Option<usize> {
    let began = Instant::now();
    loop {
        let held = accepted_sockets(port);
        if held >= n {
            return Some(held);
        }
        if began.elapsed() > WAIT {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_send_no_whole_headers_in_time_are_closed() {
    let limits = HttpLimits {
        max_connections: 16,
        header_read_timeout: Duration::from_millis(300),
        ..HttpLimits::default()
    };
    let server = start(limits).await;
    let addr = server.addr;
    let ends = tokio::task::spawn_blocking(move || {
        let mut silent = TcpStream::connect(addr).unwrap();
        let mut half_line = stalled(addr, "GET /api/v1/vol");
        let mut half_headers = stalled(addr, HALF_HEADERS);
        // One whole request on a kept-alive connection, answered, then nothing more.
        let mut idle = stalled(
            addr,
            "GET /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        );
        [&mut silent, &mut half_line, &mut half_headers, &mut idle].map(until_closed)
    })
    .await
    .unwrap();
    let [silent, half_line, half_headers, idle] = ends;
    for (what, end) in [
        ("silent", &silent),
        ("half a line", &half_line),
        ("half the headers", &half_headers),
    ] {
        let end = end
            .as_deref()
            .unwrap_or_else(|| panic!("{what}: still open after {WAIT:?}"));
        assert!(!end.contains(" 200 "), "{what}: {end}");
    }
    let idle = idle.expect("the idle kept-alive connection was still open");
    assert!(idle.starts_with("HTTP/1.1 200"), "{idle}");
    // The server goes on answering.
    let list = tokio::task::spawn_blocking(move || request(addr, LIST))
        .await
        .unwrap();
    assert!(list.is_some_and(|a| a.starts_with("HTTP/1.1 200")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cap_bounds_the_connections_held_and_the_next_one_waits_for_a_place() {
    const CAP: usize = 4;
    let limits = HttpLimits {
        max_connections: CAP,
        header_read_timeout: Duration::from_secs(600),
        ..HttpLimits::default()
    };
    let server = start(limits).await;
    let addr = server.addr;
    let (held, after, answer) = tokio::task::spawn_blocking(move || {
        let held_open: Vec<TcpStream> = (0..CAP + 6).map(|_| stalled(addr, HALF_HEADERS)).collect();
        let held = wait_for_accepted(addr.port(), CAP);
        // Had the server gone on accepting, it would have done so by now.
        std::thread::sleep(Duration::from_millis(300));
        let after = accepted_sockets(addr.port());
        // One more, a whole request: it waits in the backlog until places are freed.
        let mut waiting = stalled(addr, LIST);
        drop(held_open);
        (held, after, until_closed(&mut waiting))
    })
    .await
    .unwrap();
    assert_eq!(held, Some(CAP), "the server never held {CAP} connections");
    assert_eq!(after, CAP, "connections accepted past the cap");
    let answer = answer.expect("the waiting request was never answered");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_answered_while_stalled_clients_hold_every_place() {
    const CAP: usize = 8;
    let limits = HttpLimits {
        max_connections: CAP,
        header_read_timeout: Duration::from_millis(500),
        ..HttpLimits::default()
    };
    let server = start(limits).await;
    let addr = server.addr;
    let (held, answer) = tokio::task::spawn_blocking(move || {
        // Kept open (not dropped) until the answer has come: only the timeout frees a place.
        let held_open: Vec<TcpStream> = (0..CAP).map(|_| stalled(addr, HALF_HEADERS)).collect();
        let held = wait_for_accepted(addr.port(), CAP);
        let answer = request(addr, LIST);
        drop(held_open);
        (held, answer)
    })
    .await
    .unwrap();
    assert_eq!(held, Some(CAP));
    let answer = answer.expect("no answer while stalled clients held every place");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// A client that sends requests and reads none of the answers: once the socket is full, the
/// server's write waits `write_stall_timeout` and the connection is closed, freeing its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_no_answers_loses_its_place() {
    let limits = HttpLimits {
        max_connections: 1,
        header_read_timeout: Duration::from_secs(600),
        write_stall_timeout: Duration::from_millis(300),
    };
    let server = start(limits).await;
    let addr = server.addr;
    // A small receive buffer, so that the answers fill it (and the server's send buffer) soon.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let deaf = socket.connect(addr).await.unwrap().into_std().unwrap();
    deaf.set_nonblocking(false).unwrap();
    let (held, answer) = tokio::task::spawn_blocking(move || {
        let mut requests = deaf.try_clone().unwrap();
        requests.set_write_timeout(Some(WAIT)).unwrap();
        // Requests until the server stops taking them (it reads the next only once it has
        // written the last answer) and then until it closes the connection.
        let sender = std::thread::spawn(move || {
            let keep_alive = "GET /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
            for _ in 0..1_000_000 {
                if requests.write_all(keep_alive.as_bytes()).is_err() {
                    return;
                }
            }
        });
        let held = wait_for_accepted(addr.port(), 1);
        // The one place is the deaf client's until the stall frees it.
        let answer = request(addr, LIST);
        drop(deaf);
        let _ = sender.join();
        (held, answer)
    })
    .await
    .unwrap();
    assert_eq!(held, Some(1));
    let answer = answer.expect("the client that reads nothing kept the only place");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_closes_the_listener_and_idle_connections_and_ends_the_server() {
    let mut server = start(HttpLimits::default()).await;
    let addr = server.addr;
    let mut idle = tokio::task::spawn_blocking(move || {
        let mut s = stalled(
            addr,
            "GET /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        );
        let mut buf = [0u8; 64];
        s.set_read_timeout(Some(WAIT)).unwrap();
        assert!(s.read(&mut buf).unwrap() > 0, "no answer");
        s
    })
    .await
    .unwrap();
    server.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(WAIT, &mut server.task)
        .await
        .expect("the server did not end")
        .unwrap();
    let closed = tokio::task::spawn_blocking(move || {
        let rest = until_closed(&mut idle);
        (rest, TcpStream::connect(addr).is_err())
    })
    .await
    .unwrap();
    assert!(closed.0.is_some(), "the idle connection was left open");
    assert!(closed.1, "the listener still accepts");
}

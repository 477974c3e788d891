//! The admin router on a real socket, with clients that send a POST's headers and stop.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::api::{router_with_body_deadline, MAX_CONCURRENT_REQUESTS};

/// A bound on how long a test waits for an answer, so a daemon that never answers fails the
/// test instead of hanging it.
const ANSWER_WAIT: Duration = Duration::from_secs(60);

async fn serve(deadline: Duration) -> SocketAddr {
    let (_, state) = crate::api::tests::app();
    let app = router_with_body_deadline(state, deadline);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Sends the headers of a POST whose body never comes whole.
fn stalled_post(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"POST /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        .unwrap();
    s
}

/// The status line and body of the answer on `s`, or what was read when none came in time.
fn answer(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(ANSWER_WAIT)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= length {
                return format!("{}\n{body}", head.lines().next().unwrap_or(""));
            }
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return format!("no whole answer: {text:?}"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

fn request(addr: SocketAddr, text: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(text.as_bytes()).unwrap();
    answer(&mut s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_stop_sending_a_body_do_not_lock_the_api_out() {
    let addr = serve(Duration::from_secs(600)).await;
    let answers = tokio::task::spawn_blocking(move || {
        let _stalled: Vec<TcpStream> = (0..MAX_CONCURRENT_REQUESTS + 8).map(|_| stalled_post(addr)).collect();
        // Asked a few times, as the stalled requests reach the router in their own time.
        let mut answers = Vec::new();
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(200));
            answers.push(request(addr, "GET /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"));
        }
        let body = r#"{"name": "after", "size_bytes": 4096}"#;
        answers.push(request(
            addr,
            &format!("POST /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()),
        ));
        answers
    })
    .await
    .unwrap();
    for a in &answers[..3] {
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
    }
    assert!(answers[3].starts_with("HTTP/1.1 201"), "{}", answers[3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_does_not_come_in_time_is_answered_408_and_changes_nothing() {
    let addr = serve(Duration::from_millis(300)).await;
    let reply = tokio::task::spawn_blocking(move || answer(&mut stalled_post(addr)))
        .await
        .unwrap();
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("did not arrive within 0.3 s"), "{reply}");
    let list = tokio::task::spawn_blocking(move || {
        request(
            addr,
            "GET /api/v1/volumes HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        )
    })
    .await
    .unwrap();
    assert!(
        list.starts_with("HTTP/1.1 200") && list.contains(r#""volumes":[]"#),
        "{list}"
    );
}

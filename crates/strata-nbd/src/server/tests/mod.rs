//! Server tests: `serve` on 127.0.0.1:0 with an in-memory backend, driven by a small
//! hand-written client ([`client`]) and, where installed, by qemu-io and nbdinfo.

mod backend;
mod client;
mod handshake;
mod interop;
mod limits;
mod refuse;
mod transmission;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use self::backend::MemBackend;
use super::{serve, ServerConfig};

pub struct TestServer {
    pub addr: SocketAddr,
    pub backend: Arc<MemBackend>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<io::Result<()>>,
}

impl TestServer {
    pub async fn start(cfg: ServerConfig) -> TestServer {
        // RUST_LOG=strata_nbd=debug shows the server's side of a failing test.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let backend = Arc::new(MemBackend::new());
        let (stop, stopped) = oneshot::channel::<()>();
        // Dropping the sender (a test that ends early) also stops the server.
        let shutdown = async move {
            let _ = stopped.await;
        };
        let task = tokio::spawn(serve(listener, backend.clone(), cfg, shutdown));
        TestServer {
            addr,
            backend,
            stop: Some(stop),
            task,
        }
    }

    pub async fn default() -> TestServer {
        Self::start(ServerConfig::default()).await
    }

    /// Asks the server to stop without waiting for it.
    pub fn request_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the server and waits (bounded) for `serve` to return.
    pub async fn stop(mut self) -> io::Result<()> {
        self.request_stop();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("serve returns")
            .expect("no panic")
    }
}

/// Polls `cond` every 10 ms for up to 5 s.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

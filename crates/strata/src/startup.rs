//! The admin port while the node starts. The HTTP listener is bound, and served, before the
//! devices are opened: until the disk group is open (its log replayed, which takes a while
//! after a crash) every request is answered at once with 503, a reason and how far the start
//! has come, rather than left unanswered in the listen backlog. `strata` commands see
//! `starting` in that answer and wait for the node (client.rs); scripts get a clear status. Once
//! the node is ready, requests go to the admin API's router; the gate never answers again.
//!
//! How far the start has come is cheap to tell without the engine's help: the phase, the time
//! since start, and while the group opens, the bytes read from the fast device (replay reads
//! every batch of the log from the checkpoint's tail).
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use parking_lot::Mutex;
use strata_device::Device;
use tower::ServiceExt;

use crate::config::format_size;

/// Seconds a client is asked to wait before it asks again (`Retry-After`).
const RETRY_AFTER_S: &str = "1";

/// What the start is doing now.
pub enum Stage {
    OpeningDevices,
    /// Writing a new fast-tier file with zeros, once, on the first start.
    CreatingFastFile,
    /// `DiskGroup::open`: recovery, mostly the log's replay. `fast` is read for progress.
    OpeningGroup {
        fast: Arc<dyn Device>,
        read_before_bytes: u64,
    },
    CreatingDefaultVolume,
    /// A signal came during the start: the daemon exits without serving. Final.
    Stopping,
}

impl Stage {
    fn phase(&self) -> String {
        match self {
            Stage::OpeningDevices => "opening its devices".into(),
            Stage::CreatingFastFile => {
                "writing its new fast-tier file with zeros (once, on the first start)".into()
            }
            Stage::OpeningGroup {
                fast,
                read_before_bytes,
            } => {
                let read = fast.stats().read_bytes.saturating_sub(*read_before_bytes);
                format!(
                    "opening its disk group, replaying its write log: {} of the fast device read",
                    format_size(read)
                )
            }
            Stage::CreatingDefaultVolume => "creating the default volume".into(),
            Stage::Stopping => "stopping".into(),
        }
    }
}

pub struct Startup {
    began: Instant,
    stage: Mutex<Stage>,
    /// The admin API, once the node serves.
    ready: OnceLock<Router>,
}

impl Startup {
    pub fn new() -> Arc<Startup> {
        Arc::new(Startup {
            began: Instant::now(),
            stage: Mutex::new(Stage::OpeningDevices),
            ready: OnceLock::new(),
        })
    }

    /// Moves the start on to `stage`; a start being stopped stays stopping.
    pub fn enter(&self, stage: Stage) {
        let mut now = self.stage.lock();
        if !matches!(*now, Stage::Stopping) {
            *now = stage;
        }
    }

    /// From now on every request goes to `api`.
    pub fn serve(&self, api: Router) {
        // Set once, by the one start-up; a second call would be a bug, and changes nothing.
        let _ = self.ready.set(api);
        // Lets go of the fast device, should the stage still hold it.
        self.enter(Stage::OpeningDevices);
    }

    /// The router of the admin port, from the moment its listener is bound.
    pub fn router(self: &Arc<Startup>) -> Router {
        Router::new().fallback(gate).with_state(self.clone())
    }

    /// The answer to every request before the node serves.
    fn answer(&self) -> Response {
        let stage = self.stage.lock();
        let body = match &*stage {
            Stage::Stopping => serde_json::json!({
                "error": "the daemon is stopping: it was asked to stop while it started, and exits without serving"
            }),
            stage => {
                let phase = stage.phase();
                let elapsed_s = self.began.elapsed().as_secs();
                serde_json::json!({
                    "error": format!("the daemon is starting ({elapsed_s} s so far): {phase}"),
                    "starting": { "phase": phase, "elapsed_s": elapsed_s },
                })
            }
        };
        drop(stage);
        let mut response = (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_S));
        response
    }
}

async fn gate(State(startup): State<Arc<Startup>>, request: Request) -> Response {
    match startup.ready.get() {
        Some(api) => match api.clone().oneshot(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        },
        None => startup.answer(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use strata_device::{Device, MemDevice};

    async fn get(router: &Router, path: &str) -> (StatusCode, Option<String>, serde_json::Value) {
        let request = Request::builder().uri(path).body(Body::empty()).unwrap();
        let response = router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let retry = response
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string());
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            retry,
            serde_json::from_slice(&bytes).unwrap_or_default(),
        )
    }

    #[tokio::test]
    async fn before_the_node_serves_every_request_is_told_how_far_the_start_is() {
        let startup = Startup::new();
        let router = startup.router();
        let (status, retry, body) = get(&router, "/api/v1/volumes").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry.as_deref(), Some("1"));
        assert_eq!(body["starting"]["phase"], "opening its devices", "{body}");

        let fast: Arc<dyn Device> = Arc::new(MemDevice::new("fast", 1 << 20));
        let before = fast.stats().read_bytes;
        startup.enter(Stage::OpeningGroup {
            fast: fast.clone(),
            read_before_bytes: before,
        });
        let mut buf = strata_device::AlignedBuf::new_zeroed(8192);
        fast.read_at(&mut buf, 0).unwrap();
        let (_, _, body) = get(&router, "/anything").await;
        let phase = body["starting"]["phase"].as_str().unwrap_or_default();
        assert!(
            phase.contains("replaying its write log: 8 KiB of the fast device read"),
            "{body}"
        );
        assert!(
            body["error"]
                .as_str()
                .unwrap()
                .starts_with("the daemon is starting ("),
            "{body}"
        );

        startup.enter(Stage::Stopping);
        startup.enter(Stage::CreatingDefaultVolume);
        let (status, _, body) = get(&router, "/api/v1/status").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body.get("starting").is_none(),
            "a stopping daemon is not starting: {body}"
        );
        assert!(
            body["error"].as_str().unwrap().contains("stopping"),
            "{body}"
        );
    }

    #[tokio::test]
    async fn once_the_node_serves_the_api_answers() {
        let startup = Startup::new();
        let fast: Arc<dyn Device> = Arc::new(MemDevice::new("fast", 1 << 20));
        startup.enter(Stage::OpeningGroup {
            fast: fast.clone(),
            read_before_bytes: 0,
        });
        let router = startup.router();
        startup
            .serve(Router::new().route("/api/v1/volumes", axum::routing::get(|| async { "[]" })));
        let request = Request::builder()
            .uri("/api/v1/volumes")
            .body(Body::empty())
            .unwrap();
        let response = router.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            Arc::strong_count(&fast),
            1,
            "the gate still holds the fast device"
        );
    }
}

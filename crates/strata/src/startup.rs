//! The admin port while the node starts. The HTTP listener is bound, and served, before the
//! devices are opened: until the disk group is open (its log replayed, which takes a while
//! after a crash) every request is answered at once with 503, a reason and how far the start
//! has come, rather than left unanswered in the listen backlog. `strata` commands see
//! `starting` in that answer and wait for the node (client.rs); scripts get a clear status. Once
//! the node is ready, requests go to the admin API's router; the gate never answers again.
//!
//! How far the start has come is cheap to tell: the phase, the time since start, and while the
//! group opens, the engine's `OpenProgress`: what the open is doing, and during the replay how
//! much of the log it has read from the checkpoint's tail, against the log area's size (the
//! most it can read: nothing on the devices says how full the log was before it is read).
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use parking_lot::Mutex;
use strata_engine::{OpenProgress, OpenStep};
use tower::ServiceExt;

use crate::config::format_size;

/// Seconds a client is asked to wait before it asks again (`Retry-After`).
const RETRY_AFTER_S: &str = "1";

/// What the start is doing now.
pub enum Stage {
    OpeningDevices,
    /// Writing a new fast-tier file with zeros, once, on the first start.
    CreatingFastFile,
    /// `DiskGroup::open_with`: recovery, mostly the log's replay.
    OpeningGroup {
        progress: Arc<OpenProgress>,
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
            Stage::OpeningGroup { progress } => opening_phase(
                progress.step(),
                progress.log_replayed_bytes(),
                progress.log_area_bytes(),
            ),
            Stage::CreatingDefaultVolume => "creating the default volume".into(),
            Stage::Stopping => "stopping".into(),
        }
    }
}

/// The phase while the disk group opens, at `step`, `replayed_bytes` of the log replayed, the
/// log area `log_bytes` long.
fn opening_phase(step: OpenStep, replayed_bytes: u64, log_bytes: u64) -> String {
    let replayed = format_size(replayed_bytes);
    match step {
        OpenStep::Reading => "opening its disk group: reading its metadata".into(),
        OpenStep::Replaying => format!(
            "opening its disk group, replaying its write log: {replayed} read, of at most {} (the log's size)",
            format_size(log_bytes)
        ),
        OpenStep::CheckingEnd => format!(
            "opening its disk group, replaying its write log: {replayed} read, looking past its end for later writes"
        ),
        OpenStep::Writing => format!(
            "opening its disk group: its write log replayed ({replayed}), writing its new checkpoint"
        ),
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
        // Lets go of what the stage holds (the open's progress): nothing reads it any more.
        self.enter(Stage::OpeningDevices);
    }

    /// What the start is doing now, in words.
    pub fn phase(&self) -> String {
        self.stage.lock().phase()
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

        startup.enter(Stage::OpeningGroup {
            progress: Arc::new(OpenProgress::default()),
        });
        let (_, _, body) = get(&router, "/anything").await;
        let phase = body["starting"]["phase"].as_str().unwrap_or_default();
        assert_eq!(
            phase, "opening its disk group: reading its metadata",
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

    /// While the log replays, how much of it is read, against the most there can be.
    #[test]
    fn the_replay_is_told_in_bytes_of_the_log_read_of_its_size() {
        let replaying = opening_phase(OpenStep::Replaying, 120 << 20, 1 << 30);
        assert_eq!(
            replaying,
            "opening its disk group, replaying its write log: 120 MiB read, of at most 1 GiB (the log's size)"
        );
        let end = opening_phase(OpenStep::CheckingEnd, 600 << 20, 1 << 30);
        assert!(end.contains("600 MiB read, looking past its end"), "{end}");
        let writing = opening_phase(OpenStep::Writing, 600 << 20, 1 << 30);
        assert!(writing.contains("replayed (600 MiB), writing"), "{writing}");
    }

    #[tokio::test]
    async fn once_the_node_serves_the_api_answers() {
        let startup = Startup::new();
        let progress = Arc::new(OpenProgress::default());
        startup.enter(Stage::OpeningGroup {
            progress: progress.clone(),
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
            Arc::strong_count(&progress),
            1,
            "the gate still holds the open's progress"
        );
    }
}

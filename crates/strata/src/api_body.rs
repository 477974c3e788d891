//! Request bodies read whole, within a deadline, before a request may take one of the API's
//! `MAX_CONCURRENT_REQUESTS` places. A handler that read its own body held its place while the
//! body came: 64 clients that sent a POST's headers and stopped (a script stopped half-way, a
//! peer that vanished) held every place for as long as they kept their connections, and every
//! command of the CLI hung behind them. A body is a few dozen bytes sent at once, so a client
//! that has not sent it within `BODY_READ_TIMEOUT` gets 408 and its place is never taken.
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::{ApiError, MAX_BODY_BYTES};

/// How long a client may take to send a request's body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Middleware: reads the body of every request that may carry one, within `deadline`, then
/// runs the rest with it.
pub async fn read_body_in_time(
    State(deadline): State<Duration>,
    request: Request,
    next: Next,
) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return too_large().into_response();
    }
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        // Past the limit, or a connection closed half-way (whose client reads no answer).
        Ok(Err(_)) => too_large().into_response(),
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request's body did not arrive within {} s",
                deadline.as_secs_f64()
            ),
        )
        .into_response(),
    }
}

fn too_large() -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("the request's body is larger than {MAX_BODY_BYTES} bytes, or was cut off"),
    )
}

#[cfg(test)]
#[path = "api_body_tests.rs"]
mod tests;

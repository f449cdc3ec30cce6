//! Liveness, readiness and metrics: what a load balancer and Prometheus ask.

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::problem::Problem;
use crate::state::AppState;

pub async fn healthz() -> &'static str {
    "ok\n"
}

/// Longest a node may go without applying the control events other nodes recorded and
/// still take traffic.
const CONTROL_STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

pub async fn readyz(State(state): State<AppState>) -> Response {
    let behind = state.control.complete_since();
    if behind > CONTROL_STALE_AFTER {
        return Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Catching up",
            format!(
                "this node has not applied the control events recorded on the ledger for {} s \
                 (policies, engines, rollouts, snapshots of the other nodes); see the server log",
                behind.as_secs()
            ),
        )
        .retry_after(1)
        .into_response();
    }
    match state.store.head().await {
        Ok(head) => axum::Json(json!({
            "status": "ready",
            "backend": state.store.backend_name(),
            "head_seq": head.map_or(0, |(seq, _)| seq),
            "control_seq": state.control.followed_through(),
        }))
        .into_response(),
        Err(e) => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "Not ready",
            format!("ledger database unreachable: {e}"),
        )
        .retry_after(1)
        .into_response(),
    }
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

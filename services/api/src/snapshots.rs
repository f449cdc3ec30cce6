//! Consistent snapshots and rollback over HTTP: take (operator), list (operator,
//! regulator), roll back (operator). The in-process participants are the control state's.

use std::time::Duration;

use aether_control::SnapshotError;
use aether_control::snapshot::DEFAULT_TTL;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::access::{Operator, authorize};
use crate::auth::Role;
use crate::params::json_body;
use crate::problem::Problem;
use crate::state::AppState;

/// Longest ttl a caller may ask for: a prepare must not pin versions for long.
const MAX_TTL_MS: u64 = 300_000;

/// The snapshot routes, documented (see the `openapi` module).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(take, list))
        .routes(routes!(rollback))
}

#[derive(Deserialize, Default, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct TakeRequest {
    /// How long prepare may take, 1..=300000 ms (default 30000).
    #[schema(minimum = 1, maximum = 300000)]
    #[serde(default, deserialize_with = "crate::params::json_integer_opt")]
    ttl_ms: Option<u64>,
}

/// `POST /v1/snapshots` (operator), body optional `{ttl_ms}`: 201 with the committed
/// snapshot; 409 when a participant refused, 503 when the ttl passed.
#[utoipa::path(post, path = "/v1/snapshots", tag = "snapshots",
    description = "Two-phase snapshot of gateway routing, rule set and corpus under a ttl (default 30 s): `SnapshotCommitted`, or `SnapshotAborted` and nothing changed. Role: operator.",
    request_body(content = Option<TakeRequest>, description = "Optional"),
    responses(
        (status = 201, description = "The committed snapshot with every participant's pin and digest", body = serde_json::Value),
        (status = 409, description = "A participant refused (recorded as SnapshotAborted), or another node of the cluster is taking a snapshot or rolling back (`holder`; nothing recorded; `Retry-After`)"),
        (status = 422, description = "ttl_ms out of range"),
        (status = 503, description = "The ttl passed before every participant pinned; recorded as SnapshotAborted")))]
async fn take(
    State(state): State<AppState>,
    Operator(origin): Operator,
    body: Bytes,
) -> Result<Response, Problem> {
    // No body, or `null`: the defaults.
    let request: TakeRequest = if body.is_empty() {
        TakeRequest::default()
    } else {
        json_body::<Option<TakeRequest>>(&body, "snapshot {ttl_ms}")?.unwrap_or_default()
    };
    let ttl = match request.ttl_ms {
        None => DEFAULT_TTL,
        Some(ms @ 1..=MAX_TTL_MS) => Duration::from_millis(ms),
        Some(ms) => {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid ttl",
                format!("ttl_ms must be 1..={MAX_TTL_MS}, got {ms}"),
            ));
        }
    };
    let participants = state.control.participants();
    match state
        .control
        .snapshots
        .take(&participants, ttl, &origin)
        .await
    {
        Ok(record) => Ok((StatusCode::CREATED, axum::Json(record)).into_response()),
        Err(e) => Err(problem(e)),
    }
}

fn problem(e: SnapshotError) -> Problem {
    match e {
        SnapshotError::Aborted {
            ref id,
            ref participant,
            ref reason,
            timed_out,
        } => {
            let status = if timed_out {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::CONFLICT
            };
            Problem::new(status, "Snapshot aborted", e.to_string())
                .with("snapshot_id", json!(id))
                .with("participant", json!(participant))
                .with("reason", json!(reason))
        }
        SnapshotError::UnknownSnapshot(_) => {
            Problem::new(StatusCode::NOT_FOUND, "Unknown snapshot", e.to_string())
        }
        SnapshotError::Restore { .. } => {
            Problem::new(StatusCode::CONFLICT, "Rollback failed", e.to_string())
        }
        SnapshotError::Busy { ref holder } => Problem::new(
            StatusCode::CONFLICT,
            "Snapshot coordinator busy",
            e.to_string(),
        )
        .with("holder", json!(holder))
        .retry_after(1),
        SnapshotError::Ledger(e) => e.into(),
    }
}

/// `GET /v1/snapshots` (operator, regulator): committed snapshots and rollbacks.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    description = "Committed snapshots and rollbacks, oldest first, and the snapshot in force. Role: operator or regulator.",
    responses((status = 200, description = "`{snapshots, rollbacks, in_force}`", body = serde_json::Value)))]
async fn list(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let snapshots = &state.control.snapshots;
    Ok(axum::Json(json!({
        "in_force": snapshots.in_force(),
        "snapshots": snapshots.snapshots(),
        "rollbacks": snapshots.rollbacks(),
    }))
    .into_response())
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct RollbackRequest {
    /// A committed snapshot's id, or `previous` (the one before the newest).
    #[schema(pattern = "^[^\\x00]+$")]
    snapshot_id: String,
    /// Why, for the record: not only spaces.
    #[schema(pattern = "^[^\\x00]*\\S[^\\x00]*$")]
    reason: String,
}

/// `POST /v1/rollback` (operator) `{snapshot_id | "previous", reason}`: restores routing,
/// rules and corpora to the snapshot's pins and records one `RolledBack`.
#[utoipa::path(post, path = "/v1/rollback", tag = "snapshots",
    description = "Restores routing, rule set and corpus versions to a committed snapshot (`snapshot_id`, or `previous`) and records one `RolledBack`; if any part cannot be restored, nothing changes. Role: operator.",
    request_body = RollbackRequest,
    responses(
        (status = 200, description = "The rollback record with the restored digests, and where it is in force: `in_force_on` (this node and every live node of the cluster that has applied it) and `lagging` (live nodes that had not within 2 s)", body = serde_json::Value),
        (status = 404, description = "No committed snapshot of that id"),
        (status = 409, description = "A participant could not be restored, or another node of the cluster is taking a snapshot or rolling back (`holder`; `Retry-After`); nothing changed"),
        (status = 422, description = "Empty reason")))]
async fn rollback(
    State(state): State<AppState>,
    Operator(origin): Operator,
    body: Bytes,
) -> Result<Response, Problem> {
    let request: RollbackRequest = json_body(&body, "rollback {snapshot_id, reason}")?;
    if request.reason.trim().is_empty() {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid rollback",
            "reason must not be empty",
        ));
    }
    let participants = state.control.participants();
    let record = state
        .control
        .snapshots
        .rollback(
            &participants,
            &request.snapshot_id,
            &request.reason,
            &origin,
        )
        .await
        .map_err(problem)?;
    // In force here; the other live nodes of the cluster get up to 2 s to apply it.
    let (in_force_on, lagging) = state
        .store
        .in_force(&state.node_id, record.seq, ROLLBACK_PATIENCE)
        .await;
    let mut answer = serde_json::to_value(&record).unwrap_or_default();
    answer["in_force_on"] = serde_json::json!(in_force_on);
    answer["lagging"] = serde_json::json!(lagging);
    Ok(axum::Json(answer).into_response())
}

/// How long a rollback's answer waits for the other nodes to apply it.
const ROLLBACK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

//! `GET /v1/cluster`: the nodes on this node's ledger, their duties, and the checkpoint key.

use aether_ledger::checkpoint::key_fingerprint as fingerprint;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::access::authorize;
use crate::auth::Role;
use crate::problem::Problem;
use crate::state::AppState;

/// The cluster routes, documented (see the `openapi` module).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(cluster))
}

/// `GET /v1/cluster` (operator, regulator): the nodes and who holds which duty.
#[utoipa::path(get, path = "/v1/cluster", tag = "cluster",
    description = "The nodes of this node's cluster (those on the same PostgreSQL ledger): id, addresses, version, last heartbeat, and the duties (leases) each holds, with their fencing tokens; and the fingerprint of the key that signs the checkpoints now, with the number of key rotations. On SQLite, the one node. Role: operator or regulator.",
    responses((status = 200, description = "`{node_id, ledger, nodes: [{node_id, http_address, grpc_address, version, started_at, heartbeat_at, silent_ms, control_seq, duties}], leases: [{name, holder, token, acquired_at, expires_at, live}], checkpoint_key: {fingerprint (null before the first checkpoint), rotations}}`", body = serde_json::Value)))]
async fn cluster(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let leases = state.store.leases().await?;
    let nodes: Vec<serde_json::Value> = state
        .store
        .nodes()
        .await?
        .into_iter()
        .map(|n| {
            let duties: Vec<&str> = leases
                .iter()
                .filter(|l| l.live && l.holder == n.node_id)
                .map(|l| l.name.as_str())
                .collect();
            let mut node = serde_json::to_value(&n).unwrap_or_default();
            node["duties"] = json!(duties);
            node
        })
        .collect();
    let ledger = if state.store.postgres_pool().is_some() {
        "postgres"
    } else {
        "sqlite"
    };
    // Which key signs the cluster's checkpoints now, and how many times it was rotated.
    let in_force = aether_ledger::key_rotation::key_in_force(&state.store).await?;
    let rotations = aether_ledger::key_rotation::key_rotations(&state.store)
        .await?
        .len();
    Ok(axum::Json(json!({
        "node_id": &*state.node_id,
        "ledger": ledger,
        "nodes": nodes,
        "leases": leases,
        "checkpoint_key": {
            "fingerprint": in_force.as_deref().map(fingerprint),
            "rotations": rotations,
        },
    }))
    .into_response())
}

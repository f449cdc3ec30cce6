//! The HTTP API of Aether: every route of `aether serve` (the ledger, the audit API with
//! its proofs, the control plane, snapshots, the cluster view, console sessions, the
//! Marquez-compatible lineage API, health and metrics), its OpenAPI document, and the
//! console's pages.
//!
//! No business rule lives here: a handler parses and bounds its input, authorises the
//! caller, calls one function of a domain crate (ledger, control, lineage, audit) and
//! renders the answer; every error is `application/problem+json` (RFC 9457).
//!
//! The modules stand in floors, each importing only those below it: `auth`, `problem`;
//! `sessions`, `params`; `state`; `access`, `proofs`, `middleware`; the route modules;
//! this file, which mounts them.

mod access;
mod audit;
mod audit_decisions;
pub mod auth;
mod cluster;
mod console;
mod control;
mod corpus;
mod events;
mod health;
mod lineage;
mod middleware;
pub mod openapi;
mod params;
mod problem;
mod proofs;
pub mod reserved;
mod session;
mod sessions;
mod snapshots;
mod state;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::header;
use axum::routing::get;

pub use access::{ACCESS_EVENT_TYPE, ACCESS_STREAM};
pub use audit::CheckpointCadence;
pub use events::parse_append;
pub use problem::Problem;
pub use sessions::Sessions;
pub use state::AppState;

/// Largest request body: several events of up to 1 MiB each.
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Every route, documented, behind the middleware every request passes (NUL refused,
/// colouring and traces, the console session).
pub fn router(state: AppState) -> Router {
    let (documented, doc) = openapi::split(
        openapi::documented()
            .merge(events::routes())
            .merge(audit::routes())
            .merge(control::routes())
            .merge(corpus::routes())
            .merge(snapshots::routes())
            .merge(cluster::routes())
            .merge(session::routes())
            .merge(lineage::routes()),
    );
    // Rendered once: the document is fixed for the life of the process.
    let doc: Arc<str> = serde_json::to_string(&doc).unwrap_or_default().into();
    Router::new()
        .route(
            openapi::PATH,
            get(move || async move {
                (
                    [(header::CONTENT_TYPE, "application/json")],
                    doc.to_string(),
                )
            }),
        )
        .merge(documented)
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .route(
            "/openlineage/facets/aether_ledger/1-0-0.json",
            get(events::aether_ledger_facet_schema),
        )
        .route(
            "/openlineage/facets/aether_clearing_batch/1-0-0.json",
            get(events::aether_clearing_batch_facet_schema),
        )
        .merge(console::routes())
        .fallback(problem::not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            session::resolve_session,
        ))
        .layer(axum::middleware::from_fn(middleware::colour))
        .layer(axum::middleware::from_fn(middleware::refuse_nul))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use crate::openapi::{NO_NUL, documented, split};

    #[test]
    fn every_documented_operation_is_secured_and_answers_problems() {
        let (_, doc) = split(documented().merge(crate::control::routes()));
        let value = serde_json::to_value(&doc).unwrap();
        let ingest = &value["paths"]["/v1/policy/ingest"]["post"];
        assert_eq!(ingest["security"][0]["bearer"], serde_json::json!([]));
        assert_eq!(
            ingest["responses"]["422"]["content"]["application/problem+json"]["schema"]["$ref"],
            "#/components/schemas/Problem"
        );
        assert!(ingest["responses"]["401"].is_object());
        assert!(ingest["responses"]["201"]["content"]["application/json"].is_object());
        // Every string parameter says it may not hold NUL (the middleware refuses it).
        let versions = &value["paths"]["/v1/policies/{name}/versions"]["get"];
        assert_eq!(versions["parameters"][0]["schema"]["pattern"], NO_NUL);
    }
}

//! The Marquez-compatible lineage API under `/api/v1`, and the lineage UI at `/ui`.
//!
//! `POST /api/v1/lineage` (operator) takes OpenLineage events from other producers (one
//! event or a JSON array), validated against the 2-0-2 spec before anything is stored; the
//! reads (operator or regulator) answer from Aether's own records and those events joined
//! into one graph: `GET /api/v1/lineage?nodeId=&depth=&asOf=`, namespaces, jobs, datasets,
//! dataset versions, runs, and the stored events. Shapes are Marquez's, so its clients and
//! UI work against Aether; `asOf` (point-in-time lineage) is Aether's own addition.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use aether_lineage::external::{IngestError, StoreError, events_page, parse_request, run_events};
use aether_lineage::graph::{LineageGraph, Name, run_from_events};
use aether_lineage::index::LineageIndex;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::audit_http::{Params, params, time_param};
use crate::auth::Role;
use crate::http::{AppState, Problem, authorize, parse_u64};

/// Marquez's default graph depth.
const DEFAULT_DEPTH: u64 = 20;
const MAX_DEPTH: u64 = 1000;
const DEFAULT_LIMIT: u64 = 100;
const MAX_LIMIT: u64 = 1000;
/// Deepest offset of a stored-events page: each page reads `offset + limit` rows.
const MAX_OFFSET: u64 = 100_000;
const READERS: &[Role] = &[Role::Operator, Role::Regulator];

/// The graph index of this router's store, made on first use.
#[derive(Clone, Default)]
struct Lineage(Arc<OnceLock<LineageIndex>>);

impl Lineage {
    fn index(&self, state: &AppState) -> &LineageIndex {
        self.0
            .get_or_init(|| LineageIndex::new(state.reads.clone()))
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ui", get(ui))
        .route("/api/v1/lineage", get(graph).post(ingest))
        .route("/api/v1/namespaces", get(namespaces))
        .route(
            "/api/v1/namespaces/{namespace}/{kind}",
            get(namespace_nodes),
        )
        .route(
            "/api/v1/namespaces/{namespace}/datasets/{dataset}/versions",
            get(dataset_versions),
        )
        .route("/api/v1/jobs/runs/{id}", get(run))
        .route("/api/v1/events/lineage", get(events))
        .layer(Extension(Lineage::default()))
}

/// `GET /ui`: the lineage UI (public: the page holds no data; it calls the API with the
/// token the user pastes).
async fn ui() -> Response {
    (
        [(header::CACHE_CONTROL, "no-cache")],
        Html(aether_lineage::UI_HTML),
    )
        .into_response()
}

fn unavailable(e: StoreError) -> Problem {
    tracing::error!(error = %e, "lineage store read failed");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "Lineage unavailable",
        "the lineage store could not be read; see the server log",
    )
}

fn bounded(
    params: &HashMap<String, String>,
    name: &str,
    default: u64,
    max: u64,
) -> Result<u64, Problem> {
    let value = parse_u64(params, name, default)?;
    if value > max {
        return Err(Problem::bad_request(format!(
            "{name} must be at most {max}, got {value}"
        )));
    }
    Ok(value)
}

/// A page of `items` (`limit`, `offset`) under `key`, with the total, as Marquez lists.
fn page(
    params: &HashMap<String, String>,
    key: &str,
    items: Vec<Value>,
) -> Result<Response, Problem> {
    let limit = bounded(params, "limit", DEFAULT_LIMIT, MAX_LIMIT)? as usize;
    let offset = parse_u64(params, "offset", 0)? as usize;
    let total = items.len();
    let items: Vec<Value> = items.into_iter().skip(offset).take(limit).collect();
    Ok(axum::Json(json!({ key: items, "totalCount": total })).into_response())
}

/// `POST /api/v1/lineage` (operator): one OpenLineage event or a batch (a JSON array), all
/// valid or none stored.
async fn ingest(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, &[Role::Operator])?;
    let events = parse_request(&body).map_err(|e| {
        let problem = Problem::new(
            StatusCode::BAD_REQUEST,
            "Invalid OpenLineage event",
            e.to_string(),
        );
        match e {
            IngestError::Schema { index, source } => problem
                .with("errors", json!(source.violations))
                .with("event_index", json!(index)),
            _ => problem,
        }
    })?;
    let stored =
        aether_lineage::external::store_external(&state.store, &events, &caller.actor, Utc::now())
            .await
            .map_err(unavailable)?;
    // Fold them now, so that the answer's effect is visible to the next read at once.
    let _ = lineage.index(&state).read(|_| ()).await;
    tracing::info!(actor = %caller.actor, received = events.len(), stored, "external lineage ingested");
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({ "received": events.len(), "stored": stored })),
    )
        .into_response())
}

/// Runs `read` on the live graph, or on the graph as of `as_of`.
async fn with_graph<R>(
    state: &AppState,
    lineage: &Lineage,
    as_of: Option<DateTime<Utc>>,
    read: impl FnOnce(&LineageGraph) -> R,
) -> Result<R, Problem> {
    let index = lineage.index(state);
    match as_of {
        Some(at) => index.as_of(at).await.map(|g| read(&g)),
        None => index.read(read).await,
    }
    .map_err(unavailable)
}

/// `GET /api/v1/lineage?nodeId=job:<ns>:<name>|dataset:<ns>:<name>&depth=20&asOf=<RFC 3339>`.
async fn graph(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    query: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let params = params(query, &["nodeId", "depth", "asOf"])?;
    let node_id = params
        .get("nodeId")
        .ok_or_else(|| {
            Problem::bad_request(
                "nodeId is required: job:<namespace>:<name> or dataset:<namespace>:<name>",
            )
        })?
        .clone();
    if !node_id.starts_with("job:") && !node_id.starts_with("dataset:") {
        return Err(Problem::bad_request(format!(
            "nodeId must be job:<namespace>:<name> or dataset:<namespace>:<name>, got {node_id:?}"
        )));
    }
    let depth = bounded(&params, "depth", DEFAULT_DEPTH, MAX_DEPTH)? as u32;
    let as_of = time_param(&params, "asOf")?;
    let answer = with_graph(&state, &lineage, as_of, |g| {
        g.resolve(&node_id).map(|start| g.lineage(&start, depth))
    })
    .await?;
    match answer {
        Some(graph) => Ok(axum::Json(graph).into_response()),
        None => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "No such node",
            match as_of {
                Some(at) => format!("no node {node_id} in the lineage as of {}", at.to_rfc3339()),
                None => format!("no node {node_id} in the lineage"),
            },
        )),
    }
}

/// `GET /api/v1/namespaces`.
async fn namespaces(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    query: Params,
) -> Result<Response, Problem> {
    namespace_page(
        &state,
        &lineage,
        &headers,
        query,
        "namespaces",
        LineageGraph::namespaces,
    )
    .await
}

/// `GET /api/v1/namespaces/{namespace}/jobs` and `.../datasets`.
async fn namespace_nodes(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path((namespace, kind)): Path<(String, String)>,
    query: Params,
) -> Result<Response, Problem> {
    match kind.as_str() {
        "jobs" => {
            let list = |g: &LineageGraph| g.jobs(&namespace);
            namespace_page(&state, &lineage, &headers, query, "jobs", list).await
        }
        "datasets" => {
            let list = |g: &LineageGraph| g.datasets(&namespace);
            namespace_page(&state, &lineage, &headers, query, "datasets", list).await
        }
        _ => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "Not found",
            "no such resource",
        )),
    }
}

/// A page of what `list` finds in the live graph, under `key`.
async fn namespace_page(
    state: &AppState,
    lineage: &Lineage,
    headers: &HeaderMap,
    query: Params,
    key: &str,
    list: impl FnOnce(&LineageGraph) -> Vec<Value>,
) -> Result<Response, Problem> {
    authorize(state, headers, READERS)?;
    let params = params(query, &["limit", "offset"])?;
    let items = with_graph(state, lineage, None, list).await?;
    page(&params, key, items)
}

/// `GET /api/v1/namespaces/{namespace}/datasets/{dataset}/versions`, newest first.
async fn dataset_versions(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    query: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let params = params(query, &["limit", "offset"])?;
    let dataset = Name { namespace, name };
    let items = with_graph(&state, &lineage, None, |g| g.dataset_versions(&dataset)).await?;
    match items {
        Some(items) => page(&params, "versions", items),
        None => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "No such dataset",
            format!(
                "no dataset {} in namespace {}",
                dataset.name, dataset.namespace
            ),
        )),
    }
}

/// `GET /api/v1/jobs/runs/{id}`: one run from all of its events.
async fn run(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let events = run_events(&state.store, &id).await.map_err(unavailable)?;
    let run = run_from_events(&events).map_err(|e| {
        tracing::error!(run = %id, error = %e, "a stored lineage event is unreadable");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Unreadable lineage event",
            "a stored event of this run could not be read; see the server log",
        )
    })?;
    run.map(|r| axum::Json(r).into_response()).ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "No such run",
            format!("no lineage event names run {id}"),
        )
    })
}

/// `GET /api/v1/events/lineage?limit=100&offset=0&after=<RFC 3339>`: stored OpenLineage
/// events (Aether's and external), oldest first.
async fn events(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let params = params(query, &["limit", "offset", "after"])?;
    let limit = bounded(&params, "limit", DEFAULT_LIMIT, MAX_LIMIT)?.max(1) as u32;
    let offset = bounded(&params, "offset", 0, MAX_OFFSET)? as u32;
    let after = time_param(&params, "after")?;
    let events = events_page(&state.store, after, offset, limit)
        .await
        .map_err(unavailable)?;
    Ok(axum::Json(json!({ "events": events })).into_response())
}

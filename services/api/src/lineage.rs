//! The Marquez-compatible lineage API under `/api/v1` (the console at `/ui` draws it).
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
use aether_lineage::graph::{LineageGraph, Name, NodeKind, run_from_events};
use aether_lineage::index::LineageIndex;
use axum::Extension;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::access::authorize;
use crate::auth::Role;
use crate::params::{Params, params, parse_u64, time_param};
use crate::problem::Problem;
use crate::state::AppState;

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

/// The lineage routes, documented (see the `openapi` module).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(graph, ingest))
        .routes(routes!(search))
        .routes(routes!(namespaces))
        .routes(routes!(namespace))
        .routes(routes!(jobs))
        .routes(routes!(datasets))
        .routes(routes!(job))
        .routes(routes!(dataset))
        .routes(routes!(job_runs))
        .routes(routes!(job_versions))
        .routes(routes!(dataset_versions))
        .routes(routes!(dataset_version))
        .routes(routes!(sources))
        .routes(routes!(tags))
        .routes(routes!(column_lineage))
        .routes(routes!(run))
        .routes(routes!(events))
        .routes(routes!(events_by_client))
        .layer(Extension(Lineage::default()))
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
#[utoipa::path(post, path = "/api/v1/lineage", tag = "lineage",
    description = "OpenLineage events from other producers: one event or a JSON array, each validated against the OpenLineage 2-0-2 spec and the facet schemas it names; all stored or none (a resent event is stored once). Role: operator.",
    request_body(content = serde_json::Value, description = "An OpenLineage RunEvent, DatasetEvent or JobEvent, or an array of them"),
    responses((status = 201, description = "`{received, stored}`", body = serde_json::Value),
              (status = 400, description = "An event is not valid OpenLineage: `errors` names the violations, `event_index` the event")))]
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
#[utoipa::path(get, path = "/api/v1/lineage", tag = "lineage",
    description = "The lineage graph around a node, in Marquez's shape (`{graph: [{id, type, data, inEdges, outEdges}]}`), live or as it stood at `asOf` (Aether's addition). Role: operator or regulator.",
    params(("nodeId" = String, Query, pattern = "^(job|dataset):", description = "`job:<namespace>:<name>` or `dataset:<namespace>:<name>`"),
           ("depth" = Option<u64>, Query, maximum = 1000, description = "Jobs away in each direction (default 20)"),
           ("asOf" = Option<String>, Query, format = DateTime, description = "RFC 3339: the graph as it stood then")),
    responses((status = 200, description = "The graph", body = serde_json::Value),
              (status = 404, description = "No such node (at that time)")))]
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

/// Marquez's default and Aether's largest number of search results.
const SEARCH_DEFAULT_LIMIT: u64 = 10;
const SEARCH_MAX_LIMIT: u64 = 100;

/// `GET /api/v1/search?q=&filter=JOB|DATASET|RUN|EVENT_TYPE|REQUEST&sort=NAME|UPDATE_AT&limit=10`:
/// Marquez's search (jobs and datasets whose name or namespace contains `q`) and, Aether's
/// own, a run by its id, ledger event types by name (each with its job's node), and a
/// clearing decision by its request id.
#[utoipa::path(get, path = "/api/v1/search", tag = "lineage",
    description = "Marquez's search (jobs and datasets whose name or namespace contains `q`, ignoring case) and Aether's own: a run by id, ledger event types by name, a clearing decision by request id. `{totalCount, results: [{type, name, namespace, nodeId, updatedAt}]}`. Role: operator or regulator.",
    params(("q" = String, Query, pattern = "^[^\\x00]*\\S[^\\x00]*$", max_length = 64, description = "The text, 1 to 256 bytes (not only spaces; 64 characters are at most 256 bytes)"),
           ("filter" = Option<String>, Query, pattern = "^(JOB|DATASET|RUN|EVENT_TYPE|REQUEST)$", description = "JOB, DATASET, RUN, EVENT_TYPE or REQUEST"),
           ("sort" = Option<String>, Query, pattern = "^(NAME|UPDATE_AT)$", description = "NAME (default) or UPDATE_AT"),
           ("limit" = Option<u64>, Query, maximum = 100, description = "Results, default 10")),
    responses((status = 200, description = "The results", body = serde_json::Value)))]
async fn search(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    query: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let params = params(query, &["q", "filter", "sort", "limit"])?;
    let q = params.get("q").map(|q| q.trim()).unwrap_or_default();
    if q.is_empty() || q.len() > 256 {
        return Err(Problem::bad_request(
            "q is required: the text to search for, 1 to 256 bytes",
        ));
    }
    let filter = params.get("filter").map(String::as_str);
    // The kind of graph node asked for; `None` with a filter: none at all.
    let kind = match filter {
        None => None,
        Some("JOB") => Some(NodeKind::Job),
        Some("DATASET") => Some(NodeKind::Dataset),
        Some("RUN" | "EVENT_TYPE" | "REQUEST") => None,
        Some(other) => {
            return Err(Problem::bad_request(format!(
                "filter must be JOB, DATASET, RUN, EVENT_TYPE or REQUEST, got {other:?}"
            )));
        }
    };
    let newest_first = match params.get("sort").map(String::as_str) {
        None | Some("NAME") => false,
        Some("UPDATE_AT") => true,
        Some(other) => {
            return Err(Problem::bad_request(format!(
                "sort must be NAME or UPDATE_AT, got {other:?}"
            )));
        }
    };
    let limit = bounded(&params, "limit", SEARCH_DEFAULT_LIMIT, SEARCH_MAX_LIMIT)?.max(1) as usize;
    let wants = |name: &str| filter.is_none() || filter == Some(name);
    let mut results = Vec::new();
    if wants("REQUEST") {
        let decided = state
            .reads
            .find_by_metadata("request_id", &[q.to_owned()], "ClearingDecided")
            .await?;
        results.extend(decided.iter().map(|e| {
            json!({
                "type": "REQUEST", "name": q, "namespace": aether_lineage::JOB_NAMESPACE,
                "nodeId": format!("job:{}:{}", aether_lineage::JOB_NAMESPACE, aether_lineage::job::CLEARING_BATCH),
                "updatedAt": e.recorded_at, "seq": e.seq, "requestId": q,
            })
        }));
    }
    if wants("RUN") && uuid::Uuid::parse_str(q).is_ok() {
        let events = run_events(&state.store, q).await.map_err(unavailable)?;
        if let Ok(Some(run)) = run_from_events(&events) {
            let job = &run["jobVersion"];
            let namespace = job["namespace"].as_str().unwrap_or_default();
            results.push(json!({
                "type": "RUN", "name": q, "namespace": namespace,
                "nodeId": format!("job:{namespace}:{}", job["name"].as_str().unwrap_or_default()),
                "updatedAt": run["updatedAt"], "runId": q,
            }));
        }
    }
    if wants("EVENT_TYPE") {
        let needle = q.to_lowercase();
        results.extend(
            aether_lineage::job::EVENT_TYPES
                .iter()
                .filter(|t| t.to_lowercase().contains(&needle))
                .map(|t| {
                    json!({
                        "type": "EVENT_TYPE", "name": t, "namespace": aether_lineage::JOB_NAMESPACE,
                        "nodeId": format!("job:{}:{}", aether_lineage::JOB_NAMESPACE, aether_lineage::job_name(t)),
                        "updatedAt": null,
                    })
                }),
        );
    }
    if filter.is_none() || kind.is_some() {
        let nodes = with_graph(&state, &lineage, None, |g| g.search(q, kind, newest_first)).await?;
        results.extend(nodes);
    }
    let total = results.len();
    results.truncate(limit);
    Ok(axum::Json(json!({ "totalCount": total, "results": results })).into_response())
}

/// `GET /api/v1/namespaces`.
#[utoipa::path(get, path = "/api/v1/namespaces", tag = "lineage",
    description = "Every namespace holding a job or a dataset, in Marquez's shape. Role: operator or regulator.",
    params(("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 9007199254740991.0)),
    responses((status = 200, description = "`{namespaces, totalCount}`", body = serde_json::Value)))]
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

/// `GET /api/v1/namespaces/{namespace}/jobs`.
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}/jobs", tag = "lineage",
    description = "The jobs of a namespace, by name, in Marquez's shape (`{jobs, totalCount}`). Role: operator or regulator.",
    params(("namespace" = String, Path), ("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 9007199254740991.0)),
    responses((status = 200, description = "A page of jobs", body = serde_json::Value)))]
async fn jobs(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path(namespace): Path<String>,
    query: Params,
) -> Result<Response, Problem> {
    let list = |g: &LineageGraph| g.jobs(&namespace);
    namespace_page(&state, &lineage, &headers, query, "jobs", list).await
}

/// `GET /api/v1/namespaces/{namespace}/datasets`.
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}/datasets", tag = "lineage",
    description = "The datasets of a namespace, by name, in Marquez's shape (`{datasets, totalCount}`). Role: operator or regulator.",
    params(("namespace" = String, Path), ("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 9007199254740991.0)),
    responses((status = 200, description = "A page of datasets", body = serde_json::Value)))]
async fn datasets(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path(namespace): Path<String>,
    query: Params,
) -> Result<Response, Problem> {
    let list = |g: &LineageGraph| g.datasets(&namespace);
    namespace_page(&state, &lineage, &headers, query, "datasets", list).await
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
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}/datasets/{dataset}/versions", tag = "lineage",
    description = "A dataset's versions, newest first, each with the run that made it. Role: operator or regulator.",
    params(("namespace" = String, Path), ("dataset" = String, Path), ("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 9007199254740991.0)),
    responses((status = 200, description = "`{versions, totalCount}`", body = serde_json::Value),
              (status = 404, description = "No such dataset")))]
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

/// `GET /api/v1/namespaces/{namespace}`: one namespace.
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}", tag = "lineage",
    description = "One namespace, in Marquez's shape. Role: operator or regulator.",
    params(("namespace" = String, Path)),
    responses((status = 200, description = "The namespace", body = serde_json::Value),
              (status = 404, description = "No job or dataset in that namespace")))]
async fn namespace(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path(namespace): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    with_graph(&state, &lineage, None, |g| g.namespace(&namespace))
        .await?
        .map(|n| axum::Json(n).into_response())
        .ok_or_else(|| {
            Problem::new(
                StatusCode::NOT_FOUND,
                "No such namespace",
                format!("no job or dataset in namespace {namespace}"),
            )
        })
}

/// `GET /api/v1/namespaces/{namespace}/datasets/{dataset}/versions/{version}`.
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}/datasets/{dataset}/versions/{version}", tag = "lineage",
    description = "One version of a dataset. Role: operator or regulator.",
    params(("namespace" = String, Path), ("dataset" = String, Path), ("version" = String, Path)),
    responses((status = 200, description = "The version", body = serde_json::Value),
              (status = 404, description = "No such dataset version")))]
async fn dataset_version(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path((namespace, name, version)): Path<(String, String, String)>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let dataset = Name { namespace, name };
    with_graph(&state, &lineage, None, |g| {
        g.dataset_version(&dataset, &version)
    })
    .await?
    .map(|v| axum::Json(v).into_response())
    .ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "No such dataset version",
            format!(
                "no version {version} of dataset {} in namespace {}",
                dataset.name, dataset.namespace
            ),
        )
    })
}

/// `GET /api/v1/namespaces/{namespace}/jobs/{job}/versions`: Aether keeps no job versions
/// (a job is the kind of change, its runs carry what changed), so a known job has none.
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}/jobs/{job}/versions", tag = "lineage",
    description = "A job's versions: Aether keeps none (a job is a kind of change; its runs carry what changed), so a known job answers an empty list. Role: operator or regulator.",
    params(("namespace" = String, Path), ("job" = String, Path)),
    responses((status = 200, description = "`{versions: [], totalCount: 0}`", body = serde_json::Value),
              (status = 404, description = "No such job")))]
async fn job_versions(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path((namespace, job)): Path<(String, String)>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let name = Name {
        namespace,
        name: job,
    };
    let exists = with_graph(&state, &lineage, None, |g| {
        g.node_json(NodeKind::Job, &name).is_some()
    })
    .await?;
    if !exists {
        return Err(Problem::new(
            StatusCode::NOT_FOUND,
            "No such node",
            format!("no job {} in namespace {}", name.name, name.namespace),
        ));
    }
    Ok(axum::Json(json!({ "versions": [], "totalCount": 0 })).into_response())
}

/// `GET /api/v1/sources`: one source per dataset namespace.
#[utoipa::path(get, path = "/api/v1/sources", tag = "lineage",
    description = "One source per namespace holding datasets (a dataset's `sourceName` is its namespace). Role: operator or regulator.",
    params(("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 9007199254740991.0)),
    responses((status = 200, description = "`{sources, totalCount}`", body = serde_json::Value)))]
async fn sources(
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
        "sources",
        LineageGraph::sources,
    )
    .await
}

/// `GET /api/v1/tags`: Aether tags nothing, so the list is empty.
#[utoipa::path(get, path = "/api/v1/tags", tag = "lineage",
    description = "Tags: Aether tags nothing, so the list is empty. Role: operator or regulator.",
    params(("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 9007199254740991.0)),
    responses((status = 200, description = "`{tags: [], totalCount: 0}`", body = serde_json::Value)))]
async fn tags(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let params = params(query, &["limit", "offset"])?;
    page(&params, "tags", Vec::new())
}

/// `GET /api/v1/column-lineage?nodeId=&depth=&withDownstream=`.
#[utoipa::path(get, path = "/api/v1/column-lineage", tag = "lineage",
    description = "Column lineage from the datasets' `columnLineage` facets, in Marquez's shape (nodes `datasetField:<ns>:<dataset>:<field>`), upstream up to `depth` and downstream too with `withDownstream`. Role: operator or regulator.",
    params(("nodeId" = String, Query, description = "`dataset:…`, `datasetField:…` or `job:…` (a `#version` suffix is ignored)"),
           ("depth" = Option<u64>, Query, maximum = 1000),
           ("withDownstream" = Option<bool>, Query)),
    responses((status = 200, description = "`{graph}`", body = serde_json::Value),
              (status = 404, description = "No such node")))]
async fn column_lineage(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    query: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let params = params(query, &["nodeId", "depth", "withDownstream"])?;
    let node_id = params.get("nodeId").cloned().ok_or_else(|| {
        Problem::bad_request(
            "nodeId is required: dataset:<ns>:<name>, datasetField:<ns>:<name>:<field> or job:<ns>:<name>",
        )
    })?;
    let depth = bounded(&params, "depth", DEFAULT_DEPTH, MAX_DEPTH)? as u32;
    // Any case: the Marquez Python client sends Python's `False`.
    let downstream = match params.get("withDownstream").map(|v| v.to_ascii_lowercase()) {
        None => false,
        Some(v) if v == "false" => false,
        Some(v) if v == "true" => true,
        Some(other) => {
            return Err(Problem::bad_request(format!(
                "withDownstream must be true or false, got {other:?}"
            )));
        }
    };
    with_graph(&state, &lineage, None, |g| {
        g.column_lineage(&node_id, depth, downstream)
    })
    .await?
    .map(|g| axum::Json(g).into_response())
    .ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "No such node",
            format!("no node {node_id} in the column lineage"),
        )
    })
}

/// `GET /api/v1/namespaces/{namespace}/jobs/{job}`.
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}/jobs/{job}", tag = "lineage",
    description = "One job in Marquez's shape. Role: operator or regulator.",
    params(("namespace" = String, Path), ("job" = String, Path)),
    responses((status = 200, description = "The job", body = serde_json::Value),
              (status = 404, description = "No such job")))]
async fn job(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
) -> Result<Response, Problem> {
    one_node(
        &state,
        &lineage,
        &headers,
        NodeKind::Job,
        Name { namespace, name },
    )
    .await
}

/// `GET /api/v1/namespaces/{namespace}/datasets/{dataset}`.
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}/datasets/{dataset}", tag = "lineage",
    description = "One dataset in Marquez's shape (fields from its schema facet, its current version). Role: operator or regulator.",
    params(("namespace" = String, Path), ("dataset" = String, Path)),
    responses((status = 200, description = "The dataset", body = serde_json::Value),
              (status = 404, description = "No such dataset")))]
async fn dataset(
    State(state): State<AppState>,
    Extension(lineage): Extension<Lineage>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
) -> Result<Response, Problem> {
    one_node(
        &state,
        &lineage,
        &headers,
        NodeKind::Dataset,
        Name { namespace, name },
    )
    .await
}

async fn one_node(
    state: &AppState,
    lineage: &Lineage,
    headers: &HeaderMap,
    kind: NodeKind,
    name: Name,
) -> Result<Response, Problem> {
    authorize(state, headers, READERS)?;
    let found = with_graph(state, lineage, None, |g| g.node_json(kind, &name)).await?;
    found.map(|n| axum::Json(n).into_response()).ok_or_else(|| {
        let what = if kind == NodeKind::Job {
            "job"
        } else {
            "dataset"
        };
        Problem::new(
            StatusCode::NOT_FOUND,
            "No such node",
            format!("no {what} {} in namespace {}", name.name, name.namespace),
        )
    })
}

/// `GET /api/v1/namespaces/{namespace}/jobs/{job}/runs?limit=&offset=`: the job's runs in
/// Marquez's shape, newest first (each with its facets, `aether_ledger` naming the ledger
/// events behind it).
#[utoipa::path(get, path = "/api/v1/namespaces/{namespace}/jobs/{job}/runs", tag = "lineage",
    description = "A job's runs, newest first, in Marquez's shape; each run's `aether_ledger` facet names the ledger event behind it. Role: operator or regulator.",
    params(("namespace" = String, Path), ("job" = String, Path), ("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 100000)),
    responses((status = 200, description = "`{runs}`", body = serde_json::Value)))]
async fn job_runs(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((namespace, job)): Path<(String, String)>,
    query: Params,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let params = params(query, &["limit", "offset"])?;
    let limit = bounded(&params, "limit", 20, MAX_LIMIT)?.max(1) as u32;
    let offset = bounded(&params, "offset", 0, MAX_OFFSET)? as u32;
    let ids = aether_lineage::external::job_runs(&state.store, &namespace, &job, offset, limit)
        .await
        .map_err(unavailable)?;
    let mut runs = Vec::with_capacity(ids.len());
    for id in ids {
        let events = run_events(&state.store, &id).await.map_err(unavailable)?;
        if let Some(run) = run_from_events(&events).map_err(|e| unreadable(&id, e))? {
            runs.push(run);
        }
    }
    Ok(axum::Json(json!({ "runs": runs })).into_response())
}

fn unreadable(run: &str, e: aether_lineage::graph::GraphError) -> Problem {
    tracing::error!(run = %run, error = %e, "a stored lineage event is unreadable");
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "Unreadable lineage event",
        "a stored event of this run could not be read; see the server log",
    )
}

/// `GET /api/v1/jobs/runs/{id}`: one run from all of its events.
#[utoipa::path(get, path = "/api/v1/jobs/runs/{id}", tag = "lineage",
    description = "One run from all of its events, in Marquez's shape. Role: operator or regulator.",
    params(("id" = String, Path, description = "The run id")),
    responses((status = 200, description = "The run", body = serde_json::Value),
              (status = 404, description = "No event names that run")))]
async fn run(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, READERS)?;
    let events = run_events(&state.store, &id).await.map_err(unavailable)?;
    let run = run_from_events(&events).map_err(|e| unreadable(&id, e))?;
    run.map(|r| axum::Json(r).into_response()).ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "No such run",
            format!("no lineage event names run {id}"),
        )
    })
}

/// `GET /api/v1/events/lineage?limit=100&offset=0&after=<RFC 3339>` (and `/api/v1/events`,
/// where the Marquez Python client asks): stored OpenLineage events (Aether's and
/// external), oldest first.
#[utoipa::path(get, path = "/api/v1/events/lineage", tag = "lineage",
    description = "Stored OpenLineage events (Aether's and other producers'), oldest first. Role: operator or regulator.",
    params(("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 100000), ("after" = Option<String>, Query, format = DateTime, description = "RFC 3339: events after this time")),
    responses((status = 200, description = "`{events}`", body = serde_json::Value)))]
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

/// `GET /api/v1/events`: the same, where the Marquez Python client's `list_events` asks.
#[utoipa::path(get, path = "/api/v1/events", tag = "lineage",
    description = "The same as `/api/v1/events/lineage`, where the Marquez Python client asks. Role: operator or regulator.",
    params(("limit" = Option<u64>, Query, maximum = 1000), ("offset" = Option<u64>, Query, maximum = 100000), ("after" = Option<String>, Query, format = DateTime)),
    responses((status = 200, description = "`{events}`", body = serde_json::Value)))]
async fn events_by_client(
    state: State<AppState>,
    headers: HeaderMap,
    query: Params,
) -> Result<Response, Problem> {
    events(state, headers, query).await
}

//! The regulatory corpus over HTTP: ingest (operator) and read (operator, regulator).

use aether_control::{CorpusError, CorpusIngest};
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::access::{Operator, authorize};
use crate::auth::Role;
use crate::params::json_body;
use crate::problem::Problem;
use crate::state::AppState;

/// The corpus routes, documented (see the `openapi` module).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(ingest))
        .routes(routes!(list))
        .routes(routes!(versions))
        .routes(routes!(search))
        .routes(routes!(clause))
}

/// `POST /v1/corpus/ingest` (operator): `{name, documents: [{id, format, text}], replace}`.
#[utoipa::path(post, path = "/v1/corpus/ingest", tag = "corpora", request_body = CorpusIngest,
    description = "Adds documents to (or, with `replace`, makes up) the corpus's next version, recorded as `CorpusIngested` with the version digest; a refusal is recorded as `CorpusIngestRejected`. Role: operator.",
    responses(
        (status = 201, description = "`{corpus, event}` with the new version", body = serde_json::Value),
        (status = 409, description = "A concurrent ingest changed the corpus"),
        (status = 422, description = "Empty or malformed documents")))]
async fn ingest(
    State(state): State<AppState>,
    Operator(origin): Operator,
    body: Bytes,
) -> Result<Response, Problem> {
    let request: CorpusIngest = json_body(
        &body,
        "corpus ingest {name, documents: [{id, format, text}], replace}",
    )?;
    match state.control.corpora.ingest(request, &origin).await {
        Ok((record, Some(event))) => Ok((
            StatusCode::CREATED,
            axum::Json(json!({ "corpus": record, "event": event })),
        )
            .into_response()),
        Ok((record, None)) => Ok(axum::Json(json!({
            "corpus": record,
            "event": null,
            "note": "these documents are already in the current version; nothing changed",
        }))
        .into_response()),
        Err(e @ (CorpusError::Invalid(_) | CorpusError::NoDocuments)) => Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid corpus",
            e.to_string(),
        )),
        Err(e @ CorpusError::Conflict { .. }) => Err(Problem::new(
            StatusCode::CONFLICT,
            "Corpus version conflict",
            e.to_string(),
        )),
        Err(CorpusError::Ledger(e)) => Err(e.into()),
    }
}

fn not_found(name: &str) -> Problem {
    Problem::new(
        StatusCode::NOT_FOUND,
        "Not found",
        format!("no corpus named {name:?}"),
    )
}

/// `GET /v1/corpora`: every corpus with its current version.
#[utoipa::path(get, path = "/v1/corpora", tag = "corpora",
    description = "Every corpus with its current version. Role: operator or regulator.",
    responses((status = 200, description = "`{corpora: [...]}`", body = serde_json::Value)))]
async fn list(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let corpora: Vec<_> = state
        .control
        .corpora
        .corpora()
        .into_iter()
        .map(|(name, versions)| {
            json!({ "name": name, "current": versions.last(), "versions": versions.len() })
        })
        .collect();
    Ok(axum::Json(json!({ "corpora": corpora })).into_response())
}

/// `GET /v1/corpora/{name}/versions`: one corpus's versions, oldest first.
#[utoipa::path(get, path = "/v1/corpora/{name}/versions", tag = "corpora",
    description = "One corpus's versions, oldest first. Role: operator or regulator.",
    params(("name" = String, Path, description = "Corpus name")),
    responses((status = 200, description = "The versions", body = serde_json::Value),
              (status = 404, description = "No such corpus")))]
async fn versions(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let versions = state
        .control
        .corpora
        .corpora()
        .remove(&name)
        .ok_or_else(|| not_found(&name))?;
    Ok(axum::Json(json!({ "name": name, "versions": versions })).into_response())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SearchQuery {
    q: String,
    limit: Option<usize>,
}

/// `GET /v1/corpora/{name}/search?q=&limit=`: BM25 search of the current version.
#[utoipa::path(get, path = "/v1/corpora/{name}/search", tag = "corpora",
    description = "BM25 search of the current version's clauses. Role: operator or regulator.",
    params(("name" = String, Path, description = "Corpus name"),
           ("q" = String, Query, description = "Search terms"),
           ("limit" = Option<u32>, Query, description = "Most hits to return (default 5)")),
    responses((status = 200, description = "`{corpus, version, hits}`", body = serde_json::Value),
              (status = 404, description = "No such corpus")))]
async fn search(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
    query: Result<Query<SearchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let Query(query) = query.map_err(|e| Problem::bad_request(e.body_text()))?;
    let corpus = state
        .control
        .corpora
        .corpus(&name)
        .ok_or_else(|| not_found(&name))?;
    let version = corpus.current();
    let hits = version
        .search(&query.q, query.limit.unwrap_or(5))
        .map_err(|e| Problem::bad_request(e.to_string()))?;
    Ok(axum::Json(json!({
        "corpus": name,
        "version": version.digest().to_hex(),
        "hits": hits,
    }))
    .into_response())
}

/// `GET /v1/corpora/{name}/clauses/{id}`: one clause of the current version.
#[utoipa::path(get, path = "/v1/corpora/{name}/clauses/{id}", tag = "corpora",
    description = "One clause of the current version by its stable id. Role: operator or regulator.",
    params(("name" = String, Path, description = "Corpus name"),
           ("id" = String, Path, description = "Clause id")),
    responses((status = 200, description = "The clause", body = serde_json::Value),
              (status = 404, description = "No such corpus or clause")))]
async fn clause(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path((name, id)): Path<(String, String)>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let corpus = state
        .control
        .corpora
        .corpus(&name)
        .ok_or_else(|| not_found(&name))?;
    let version = corpus.current();
    let clause = version.clause(&id).ok_or_else(|| {
        Problem::new(
            StatusCode::NOT_FOUND,
            "Not found",
            format!(
                "corpus {name:?} version {} has no clause {id:?}",
                version.digest().to_hex()
            ),
        )
    })?;
    Ok(axum::Json(json!({
        "corpus": name,
        "version": version.digest().to_hex(),
        "clause": clause,
    }))
    .into_response())
}

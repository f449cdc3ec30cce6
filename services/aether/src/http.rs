//! The HTTP surface of `aether serve`: health, metrics, and the ledger under `/v1/events`.
//! Every error is `application/problem+json` (RFC 9457).

use std::collections::HashMap;
use std::sync::Arc;

use aether_ledger::{
    AppendToStream, EventStore, ExpectedVersion, LedgerError, MerkleLog, NewEvent,
};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::json;

use aether_control::Origin;

use crate::auth::{Caller, Role, Tokens};

/// Largest request body: several events of up to 1 MiB each.
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// Largest page of events one request returns.
const MAX_PAGE: u32 = 1000;

#[derive(Clone)]
pub struct AppState {
    pub store: EventStore,
    pub tokens: Arc<Tokens>,
    pub metrics: PrometheusHandle,
    /// Every event hash in memory, for proofs.
    pub merkle: MerkleLog,
    /// The control plane's projections (policies and the live rule engine, models,
    /// engines, rollouts), rebuilt from the ledger at start.
    pub control: aether_control::ControlState,
    /// This node's id in its cluster.
    pub node_id: Arc<str>,
    /// Where regulators' reads go: a streaming replica (`--read-database-url`), or the
    /// ledger itself. See [`AppState::reads_through`].
    pub reads: EventStore,
    /// Console sessions opened on this node (`/v1/session`).
    pub sessions: crate::session::Sessions,
}

impl AppState {
    /// The store to read events up to `seq` from: the replica once it has replayed that
    /// far (waiting up to 500 ms for it), else the primary, so that no answer pairs a proof
    /// for a tree size with events the replica has not reached.
    pub async fn reads_through(&self, seq: u64) -> &EventStore {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(500);
        loop {
            match self.reads.head().await {
                Ok(head) if head.map_or(0, |(s, _)| s) >= seq => return &self.reads,
                Ok(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                _ => {
                    metrics::counter!("aether_audit_replica_behind_total").increment(1);
                    return &self.store;
                }
            }
        }
    }
}

pub fn router(state: AppState) -> Router {
    let (documented, doc) = crate::openapi::split(
        crate::openapi::documented()
            .routes(utoipa_axum::routes!(list_events, append_events))
            .routes(utoipa_axum::routes!(get_event))
            .routes(utoipa_axum::routes!(redact))
            .routes(utoipa_axum::routes!(lineage_record))
            .merge(crate::audit_http::routes())
            .merge(crate::control_http::routes())
            .merge(crate::corpus_http::routes())
            .merge(crate::snapshot_http::routes())
            .merge(crate::cluster::routes())
            .merge(crate::session::routes())
            .merge(crate::lineage_api::routes()),
    );
    // Rendered once: the document is fixed for the life of the process.
    let doc: Arc<str> = serde_json::to_string(&doc).unwrap_or_default().into();
    Router::new()
        .route(
            crate::openapi::PATH,
            get(move || async move {
                (
                    [(header::CONTENT_TYPE, "application/json")],
                    doc.to_string(),
                )
            }),
        )
        .merge(documented)
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route(
            "/openlineage/facets/aether_ledger/1-0-0.json",
            get(aether_ledger_facet_schema),
        )
        .merge(crate::console::routes())
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::session::resolve_session,
        ))
        .layer(axum::middleware::from_fn(colour))
        .layer(axum::middleware::from_fn(refuse_nul))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The largest seq a caller may name: the largest integer JSON carries exactly (and that
/// access records and answers can hold). A ledger reaches it after 285 years at a million
/// events a second.
pub(crate) const MAX_SEQ: u64 = (1 << 53) - 1;

/// A seq from a path or query: an integer from 1 to [`MAX_SEQ`].
pub(crate) fn parse_seq(seq: &str) -> Result<u64, Problem> {
    seq.parse()
        .ok()
        .filter(|s| (1..=MAX_SEQ).contains(s))
        .ok_or_else(|| {
            Problem::bad_request(format!(
                "seq must be an integer from 1 to {MAX_SEQ}, got {seq:?}"
            ))
        })
}

/// Refuses a request whose path or query holds U+0000 (`%00`) with 400: no route takes
/// one, and passed on it would reach a database query (PostgreSQL refuses NUL in text)
/// and come back as a server error instead of the caller's.
async fn refuse_nul(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let uri = request.uri();
    let raw = [uri.path(), uri.query().unwrap_or("")];
    let has_nul = raw.iter().any(|part| {
        part.contains('\0') || percent_encoding::percent_decode_str(part).any(|b| b == 0)
    });
    if has_nul {
        return Problem::bad_request(
            "the request's path or query contains U+0000 (%00), which no parameter accepts",
        )
        .into_response();
    }
    next.run(request).await
}

/// Traffic colouring on every call: validates `X-Trace-ID`, `traceparent`,
/// `X-Model-Stage` and `X-Semantic-Tag` (400 when malformed), generates a trace id when
/// absent, hands the [`Origin`] (without actor) to handlers, and returns `X-Trace-ID`.
async fn colour(mut request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let origin = {
        let headers = request.headers();
        let header = |name: &str| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap_or("\u{fffd}").to_owned())
        };
        Origin::from_headers(
            "",
            header("x-trace-id").as_deref(),
            header("traceparent").as_deref(),
            header("x-model-stage").as_deref(),
            header("x-semantic-tag").as_deref(),
        )
    };
    let origin = match origin {
        Ok(o) => o,
        Err(e) => return Problem::bad_request(e.to_string()).into_response(),
    };
    let trace_id = HeaderValue::from_str(&origin.trace_id).ok();
    // The call's span (off unless traces are exported): a child of the caller's
    // `traceparent`, validated just above.
    let traceparent = request
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let traced = aether_gateway::telemetry::sampled(&origin.trace_id, &traceparent);
    let span = if !traced {
        tracing::Span::none()
    } else {
        tracing::debug_span!(
        target: "aether",
        "http.request",
        otel.name = %format!("{} {}", request.method(), request.uri().path()),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %request.method(),
        url.path = %request.uri().path(),
        http.response.status_code = tracing::field::Empty,
        aether.trace_id = %origin.trace_id,
        )
    };
    let tracestate = request
        .headers()
        .get("tracestate")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    aether_gateway::telemetry::follow_with_state(&span, &traceparent, tracestate);
    let ids = aether_gateway::telemetry::LogIds::new(&origin.trace_id);
    request.extensions_mut().insert(origin);
    let mut response = {
        use tracing::Instrument as _;
        aether_gateway::telemetry::with_log_ids(ids, next.run(request).instrument(span.clone()))
            .await
    };
    span.record("http.response.status_code", response.status().as_u16());
    if response.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    if let Some(id) = trace_id {
        response.headers_mut().insert("x-trace-id", id);
    }
    response
}

/// An operator's write: the caller authenticated as an operator, and the request's
/// colouring with that caller as actor and the snapshot in force, which every event
/// written on the request names. Extracted before the body, so a caller without the role
/// is refused before anything is read.
pub(crate) struct Operator(pub Origin);

impl axum::extract::FromRequestParts<AppState> for Operator {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Problem> {
        let caller = authorize(state, &parts.headers, &[Role::Operator])?;
        Ok(Operator(state.control.under_snapshot(Origin {
            actor: caller.actor,
            ..coloured(parts)?.clone()
        })))
    }
}

/// The request's colouring, which the middleware sets on every request.
pub(crate) fn coloured(parts: &axum::http::request::Parts) -> Result<&Origin, Problem> {
    parts.extensions.get::<Origin>().ok_or_else(|| {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Internal error",
            "the request was not coloured (trace id missing)",
        )
    })
}

/// An RFC 9457 problem.
#[derive(Debug)]
pub struct Problem {
    status: StatusCode,
    title: &'static str,
    detail: String,
    extra: serde_json::Map<String, serde_json::Value>,
    /// Seconds for `Retry-After`, when asking again soon may succeed.
    retry_after: Option<u32>,
}

impl Problem {
    pub(crate) fn new(
        status: StatusCode,
        title: &'static str,
        detail: impl Into<String>,
    ) -> Problem {
        Problem {
            status,
            title,
            detail: detail.into(),
            extra: serde_json::Map::new(),
            retry_after: None,
        }
    }

    /// Adds `Retry-After: seconds`.
    pub(crate) fn retry_after(mut self, seconds: u32) -> Problem {
        self.retry_after = Some(seconds);
        self
    }

    /// What went wrong, for a log line where no answer can carry it any more.
    pub(crate) fn detail(&self) -> &str {
        &self.detail
    }

    pub(crate) fn bad_request(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, "Bad request", detail)
    }

    pub(crate) fn with(mut self, key: &str, value: serde_json::Value) -> Problem {
        self.extra.insert(key.to_owned(), value);
        self
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = self.extra;
        body.insert("type".into(), json!("about:blank"));
        body.insert("title".into(), json!(self.title));
        body.insert("status".into(), json!(self.status.as_u16()));
        body.insert("detail".into(), json!(self.detail));
        let mut response = (self.status, axum::Json(body)).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<LedgerError> for Problem {
    fn from(e: LedgerError) -> Problem {
        match &e {
            LedgerError::TooLarge { .. } => Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Payload too large",
                e.to_string(),
            ),
            e if e.is_input_error() => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid event",
                e.to_string(),
            ),
            LedgerError::WrongExpectedVersion { actual, .. } => Problem::new(
                StatusCode::CONFLICT,
                "Wrong expected version",
                e.to_string(),
            )
            .with("actual_version", json!(actual)),
            LedgerError::DuplicateEventId { .. } => {
                Problem::new(StatusCode::CONFLICT, "Duplicate event id", e.to_string())
            }
            LedgerError::Overloaded => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "Ledger overloaded",
                e.to_string(),
            ),
            LedgerError::WriterClosed => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "Shutting down",
                e.to_string(),
            ),
            e if e.is_unavailable() => {
                tracing::warn!(error = %e, "the ledger database is unavailable");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Ledger unavailable",
                    "the ledger database cannot be reached or did not answer in time; nothing was written, try again",
                )
                .retry_after(1)
            }
            _ => {
                tracing::error!(error = %e, "ledger error");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Ledger unavailable",
                    "the ledger could not complete the request; see the server log",
                )
            }
        }
    }
}

/// Checks the caller and that its role is one of `allowed`: the bearer token, or without
/// one the console's session cookie (whose writes [`crate::session::resolve_session`] checked).
pub(crate) fn authorize(
    state: &AppState,
    headers: &HeaderMap,
    allowed: &[Role],
) -> Result<Caller, Problem> {
    let caller = match headers.get(header::AUTHORIZATION) {
        Some(value) => {
            let token = value
                .to_str()
                .unwrap_or_default()
                .strip_prefix("Bearer ")
                .ok_or_else(|| {
                    Problem::new(
                        StatusCode::UNAUTHORIZED,
                        "Unauthorized",
                        "Authorization must use the Bearer scheme",
                    )
                })?;
            state.tokens.caller(token.trim()).ok_or_else(|| {
                Problem::new(StatusCode::UNAUTHORIZED, "Unauthorized", "unknown token")
            })?
        }
        None => match crate::session::cookie(headers) {
            Some(id) => state
                .sessions
                .get(id, chrono::Utc::now())
                .map(|s| s.caller)
                .ok_or_else(|| {
                    Problem::new(
                        StatusCode::UNAUTHORIZED,
                        "Unauthorized",
                        "the console session has ended (signed out, expired, or opened on \
                         another node); sign in again",
                    )
                })?,
            None => {
                return Err(Problem::new(
                    StatusCode::UNAUTHORIZED,
                    "Unauthorized",
                    "missing Authorization: Bearer <token>",
                ));
            }
        },
    };
    if allowed.contains(&caller.role) {
        Ok(caller)
    } else {
        Err(Problem::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("role {} may not do this", caller.role.name()),
        ))
    }
}

/// The custom facet's JSON schema, at the immutable URL its `_schemaURL` names (public).
async fn aether_ledger_facet_schema(headers: HeaderMap) -> Response {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1:8080");
    let schema = aether_lineage::aether_ledger_facet_schema(&format!("http://{host}"));
    (
        [(header::CACHE_CONTROL, "public, max-age=31536000, immutable")],
        axum::Json(schema),
    )
        .into_response()
}

/// `GET /v1/lineage/events/{seq}`: an event's lineage records (OpenLineage run, Delta).
#[utoipa::path(get, path = "/v1/lineage/events/{seq}", tag = "ledger",
    description = "An event's lineage records: its OpenLineage run event and the Delta table version holding it. Role: operator or regulator.",
    params(("seq" = u64, Path, minimum = 1, maximum = 9007199254740991.0, description = "Ledger position")),
    responses((status = 200, description = "The records", body = serde_json::Value),
              (status = 404, description = "No lineage record yet (the relays follow the ledger)"),
              (status = 503, description = "The lineage records cannot be read")))]
async fn lineage_record(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(seq): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let seq = crate::http::parse_seq(&seq)?;
    match aether_lineage::relay::record(&state.store, seq).await {
        Ok(Some(r)) => Ok(axum::Json(r).into_response()),
        Ok(None) => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "No lineage record",
            format!("no lineage record for seq {seq} (yet: the relay follows the ledger)"),
        )),
        Err(e) => {
            tracing::error!(error = %e, "lineage record read failed");
            Err(Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "Lineage unavailable",
                "the lineage records could not be read; see the server log",
            ))
        }
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Longest a node may go without applying the control events other nodes recorded and
/// still take traffic.
const CONTROL_STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(5);

async fn readyz(State(state): State<AppState>) -> Response {
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

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

async fn not_found() -> Problem {
    Problem::new(StatusCode::NOT_FOUND, "Not found", "no such resource")
}

pub(crate) fn parse_u64(
    params: &HashMap<String, String>,
    name: &str,
    default: u64,
) -> Result<u64, Problem> {
    match params.get(name) {
        None => Ok(default),
        // Every numeric parameter is a seq, a size or a count, recorded as JSON in access
        // records: bounded by what JSON carries exactly.
        Some(v) => v.parse().ok().filter(|n| *n <= MAX_SEQ).ok_or_else(|| {
            Problem::bad_request(format!(
                "query parameter {name} must be an integer from 0 to {MAX_SEQ}, got {v:?}"
            ))
        }),
    }
}

/// `GET /v1/events?from_seq=1&limit=100`: a page of the ledger in seq order.
#[utoipa::path(get, path = "/v1/events", tag = "ledger",
    description = "A page of the ledger in seq order. Role: operator or regulator.",
    params(("from_seq" = Option<u64>, Query, description = "First seq (default 1)"),
           ("limit" = Option<u64>, Query, minimum = 1, maximum = 1000, description = "Page size, 1 to 1000")),
    responses((status = 200, description = "`{events, next_from_seq}`: each event with `payload` and `metadata` as JSON objects (re-canonicalise them to recompute the hash, HASHING.md); `next_from_seq` is absent on the last page", body = serde_json::Value),
              (status = 400, description = "A malformed parameter or one out of its range")))]
async fn list_events(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let Query(params) = query.map_err(|e| Problem::bad_request(e.body_text()))?;
    if let Some(unknown) = params
        .keys()
        .find(|k| !matches!(k.as_str(), "from_seq" | "limit"))
    {
        return Err(Problem::bad_request(format!(
            "unknown query parameter {unknown:?}; expected from_seq, limit"
        )));
    }
    let from_seq = parse_u64(&params, "from_seq", 1)?.max(1);
    let limit = parse_u64(&params, "limit", 100)?;
    if limit == 0 || limit > u64::from(MAX_PAGE) {
        return Err(Problem::bad_request(format!(
            "limit must be between 1 and {MAX_PAGE}, got {limit}"
        )));
    }
    let events = state.store.read_all(from_seq, limit as u32).await?;
    let next = (events.len() as u64 == limit).then(|| events.last().map(|e| e.seq + 1));
    Ok(axum::Json(json!({ "events": events, "next_from_seq": next.flatten() })).into_response())
}

/// `GET /v1/events/{seq}`: one event.
#[utoipa::path(get, path = "/v1/events/{seq}", tag = "ledger",
    description = "One event with its hashes. Role: operator or regulator.",
    params(("seq" = u64, Path, minimum = 1, maximum = 9007199254740991.0, description = "Ledger position")),
    responses((status = 200, description = "The event", body = serde_json::Value),
              (status = 404, description = "No event at that seq")))]
async fn get_event(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(seq): Path<String>,
) -> Result<Response, Problem> {
    authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
    let seq = crate::http::parse_seq(&seq)?;
    let event = state.store.read_all(seq, 1).await?.into_iter().next();
    match event {
        Some(e) if e.seq == seq => Ok(axum::Json(e).into_response()),
        _ => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "Not found",
            format!("no event at seq {seq}"),
        )),
    }
}

/// One stream's part of `POST /v1/events`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamBody {
    stream_id: String,
    /// `"any"` (default), `"no_stream"`, `"stream_exists"` or an exact version number.
    #[serde(default)]
    expected_version: Option<serde_json::Value>,
    events: Vec<NewEvent>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MultiBody {
    appends: Vec<StreamBody>,
}

fn expected_version(v: Option<serde_json::Value>) -> Result<ExpectedVersion, Problem> {
    match &v {
        None => Ok(ExpectedVersion::Any),
        Some(serde_json::Value::Number(n)) if n.as_u64().is_some() => {
            Ok(ExpectedVersion::Exact(n.as_u64().unwrap_or_default()))
        }
        Some(serde_json::Value::String(s)) if s == "any" => Ok(ExpectedVersion::Any),
        Some(serde_json::Value::String(s)) if s == "no_stream" => Ok(ExpectedVersion::NoStream),
        Some(serde_json::Value::String(s)) if s == "stream_exists" => {
            Ok(ExpectedVersion::StreamExists)
        }
        Some(other) => Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid event",
            format!(
                "expected_version must be a non-negative integer, \"any\", \"no_stream\" or \"stream_exists\", got {other}"
            ),
        )),
    }
}

/// Reads `{stream_id, expected_version, events}` or `{appends: [...]}` (atomic).
fn parse_append(body: &[u8]) -> Result<Vec<AppendToStream>, Problem> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        Problem::bad_request(format!(
            "request body is not JSON (line {}, column {}): {e}",
            e.line(),
            e.column()
        ))
    })?;
    let invalid = |e: serde_json::Error| {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid event",
            format!("request body is not a valid append: {e}"),
        )
    };
    let streams = if value.get("appends").is_some() {
        serde_json::from_value::<MultiBody>(value)
            .map_err(invalid)?
            .appends
    } else {
        vec![serde_json::from_value::<StreamBody>(value).map_err(invalid)?]
    };
    streams
        .into_iter()
        .map(|s| {
            Ok(AppendToStream {
                stream_id: s.stream_id,
                expected: expected_version(s.expected_version)?,
                events: s.events,
            })
        })
        .collect()
}

/// The body of `POST /v1/events` as the OpenAPI document gives it (`parse_append` reads it):
/// one stream's append, or several (`{appends: [...]}`) committed atomically.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
#[allow(dead_code)] // documents the wire format
enum AppendDoc {
    One(StreamAppendDoc),
    Many {
        #[schema(min_items = 1)]
        appends: Vec<StreamAppendDoc>,
    },
}

/// One stream's events.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // documents the wire format
struct StreamAppendDoc {
    /// 1 to 256 bytes (64 characters are at most 256), no control characters, no
    /// surrounding spaces; the system's own streams are refused (403).
    #[schema(
        max_length = 64,
        pattern = "^[^\\x00-\\x1f\\x7f-\\x9f\\s]([^\\x00-\\x1f\\x7f-\\x9f]*[^\\x00-\\x1f\\x7f-\\x9f\\s])?$"
    )]
    stream_id: String,
    /// `any` (default), `no_stream`, `stream_exists` or the stream's exact version.
    expected_version: Option<serde_json::Value>,
    #[schema(min_items = 1)]
    events: Vec<EventDoc>,
}

/// One event. Every number in `payload`, `metadata` and `personal` is within ±(2^53 − 1)
/// and no text holds NUL (refused with 422: JSON Schema cannot say it at every depth).
#[derive(Deserialize, utoipa::ToSchema)]
#[allow(dead_code)] // documents the wire format
struct EventDoc {
    /// A UUID of the caller's (made when absent); unique across the ledger.
    #[schema(
        pattern = "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
    )]
    event_id: Option<String>,
    /// 1 to 128 ASCII letters, digits, `.`, `_` or `-`, starting with a letter.
    #[schema(pattern = "^[A-Za-z][A-Za-z0-9._-]{0,127}$")]
    event_type: String,
    #[schema(minimum = 0, maximum = 2147483647)]
    schema_version: Option<u32>,
    payload: serde_json::Map<String, serde_json::Value>,
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// Payload members that are personal data (kept as salted commitments, erasable).
    personal: Option<serde_json::Map<String, serde_json::Value>>,
}

/// `POST /v1/events` (operator): appends and answers once committed.
#[utoipa::path(post, path = "/v1/events", tag = "ledger",
    description = "Appends events to one or several streams atomically, with expected versions; answers once committed. Role: operator. The system's own streams (`ledger/`, `access/`, `clearing/`, `netting`, `worker/`, `engine/`, `model/`, `policy/`, `policy-rejections`, `corpus/`, `corpus-rejections`, `rollout/`, `analysis/`, `snapshot`, `lineage/`, `cluster/`) and event types (`CheckpointSigned`, `ClearingDecided`, `AuditQueried`, the control plane's ...) are refused with 403: each is written only by the component that owns it.",
    request_body(content = AppendDoc, description = "`{stream_id, expected_version, events: [{event_type, payload, metadata}]}`, or `{appends: [...]}` of them"),
    responses((status = 201, description = "`{committed: [{seq, stream_id, stream_version, event_id, hash, recorded_at}]}`", body = serde_json::Value),
              (status = 403, description = "A reserved stream or event type; nothing was appended"),
              (status = 409, description = "A stream is not at the expected version; nothing was appended"),
              (status = 422, description = "An invalid event; nothing was appended")))]
async fn append_events(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, &[Role::Operator])?;
    let appends = parse_append(&body)?;
    for append in &appends {
        for event in &append.events {
            if let Some(why) = crate::reserved::refusal(&append.stream_id, &event.event_type) {
                return Err(Problem::new(
                    StatusCode::FORBIDDEN,
                    "Reserved namespace",
                    why,
                ));
            }
        }
    }
    let committed = state.store.append_multi(appends).await?;
    tracing::debug!(actor = %caller.actor, events = committed.len(), "appended over HTTP");
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({ "committed": committed })),
    )
        .into_response())
}

/// A JSON integer in a request body, written `7` or `7.0` (JSON Schema's `integer` admits
/// both), from 0 to 2^53 − 1 (what JSON carries exactly).
pub(crate) fn json_integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    use serde::de::Error as _;
    let number = serde_json::Number::deserialize(d)?;
    let exact = number.as_u64().or_else(|| {
        number
            .as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= MAX_SEQ as f64)
            .map(|f| f as u64)
    });
    exact.filter(|n| *n <= MAX_SEQ).ok_or_else(|| {
        D::Error::custom(format!(
            "expected an integer from 0 to {MAX_SEQ}, got {number}"
        ))
    })
}

/// [`json_integer`] for an optional member.
pub(crate) fn json_integer_opt<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Wrapped(#[serde(deserialize_with = "json_integer")] u64);
    Ok(Option::<Wrapped>::deserialize(d)?.map(|Wrapped(n)| n))
}

/// The body of a redaction.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Redaction {
    /// The event's ledger position.
    #[schema(minimum = 1, maximum = 9007199254740991_u64)]
    #[serde(deserialize_with = "json_integer")]
    seq: u64,
    /// The personal member of its payload, as its placeholder names it.
    #[schema(pattern = "^[^\\x00]+$")]
    member: String,
    /// Why, for the record: not only spaces.
    #[schema(pattern = "^[^\\x00]*\\S[^\\x00]*$")]
    reason: String,
}

/// `POST /v1/redactions` (operator) `{seq, member, reason}`: erases one personal value.
#[utoipa::path(post, path = "/v1/redactions", tag = "ledger",
    description = "Erases one personal value of an event: appends `RedactionApplied`, then deletes the value; the chain still verifies (the event keeps its salted commitment). Role: operator.",
    request_body(content = Redaction, description = "Which value, and why"),
    responses((status = 201, description = "The `RedactionApplied` event", body = serde_json::Value),
              (status = 404, description = "No such event or personal member"),
              (status = 422, description = "Malformed, or no reason")))]
async fn redact(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, Problem> {
    let caller = authorize(&state, &headers, &[Role::Operator])?;
    let r: Redaction = serde_json::from_slice(&body).map_err(|e| {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid redaction",
            format!("expected {{seq, member, reason}}: {e}"),
        )
    })?;
    if r.reason.trim().is_empty() {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid redaction",
            "a redaction needs a reason",
        ));
    }
    let event = state
        .store
        .read_all(r.seq, 1)
        .await?
        .into_iter()
        .next()
        .filter(|e| e.seq == r.seq)
        .ok_or_else(|| {
            Problem::new(
                StatusCode::NOT_FOUND,
                "Not found",
                format!("no event at seq {}", r.seq),
            )
        })?;
    let committed = state
        .store
        .redact(&event, &r.member, &r.reason, &caller.actor)
        .await
        .map_err(|e| match e {
            LedgerError::NoSuchPersonalField { .. } => Problem::new(
                StatusCode::NOT_FOUND,
                "No such personal field",
                e.to_string(),
            ),
            e => e.into(),
        })?;
    Ok((
        StatusCode::CREATED,
        axum::Json(json!({ "redaction": committed })),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The append decoder answers every input with appends or a 4xx problem, never a
        /// panic or a 5xx.
        #[test]
        fn append_decoder_is_total(body in prop::collection::vec(any::<u8>(), 0..256)) {
            if let Err(p) = parse_append(&body) {
                prop_assert!(p.status.is_client_error());
            }
        }

        #[test]
        fn append_decoder_handles_structured_garbage(
            stream in any::<String>(),
            version in prop_oneof![Just(json!(null)), any::<i64>().prop_map(|n| json!(n)), any::<String>().prop_map(|s| json!(s))],
            kind in "[A-Za-z ]{0,10}",
        ) {
            let body = json!({"stream_id": stream, "expected_version": version,
                              "events": [{"event_type": kind, "payload": {}}]});
            match parse_append(body.to_string().as_bytes()) {
                Ok(appends) => prop_assert_eq!(appends.len(), 1),
                Err(p) => prop_assert!(p.status.is_client_error()),
            }
        }
    }

    #[test]
    fn expected_version_forms() {
        assert_eq!(expected_version(None).unwrap(), ExpectedVersion::Any);
        assert_eq!(
            expected_version(Some(json!(4))).unwrap(),
            ExpectedVersion::Exact(4)
        );
        assert_eq!(
            expected_version(Some(json!("no_stream"))).unwrap(),
            ExpectedVersion::NoStream
        );
        assert_eq!(
            expected_version(Some(json!("stream_exists"))).unwrap(),
            ExpectedVersion::StreamExists
        );
        assert!(expected_version(Some(json!(-1))).is_err());
        assert!(expected_version(Some(json!(1.5))).is_err());
        assert!(expected_version(Some(json!("later"))).is_err());
    }
}

//! The ledger itself over HTTP: a page of events, one event, the generic append (system
//! namespaces refused), redaction of a personal value, and an event's lineage records.

use std::collections::HashMap;

use aether_ledger::{AppendToStream, LedgerError, NewEvent};
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::access::authorize;
use crate::auth::Role;
use crate::params::{expected_version, json_integer, parse_seq, parse_u64};
use crate::problem::Problem;
use crate::state::AppState;

/// Largest page of events one request returns.
const MAX_PAGE: u32 = 1000;

/// The ledger's routes, documented (see the `openapi` module).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_events, append_events))
        .routes(routes!(get_event))
        .routes(routes!(redact))
        .routes(routes!(lineage_record))
}

/// The `aether_ledger` facet's JSON schema, at the immutable URL its `_schemaURL` names
/// (public).
pub async fn aether_ledger_facet_schema(headers: HeaderMap) -> Response {
    facet_schema(&headers, aether_lineage::aether_ledger_facet_schema)
}

/// The `aether_clearing_batch` facet's JSON schema, likewise.
pub async fn aether_clearing_batch_facet_schema(headers: HeaderMap) -> Response {
    facet_schema(&headers, aether_lineage::aether_clearing_batch_facet_schema)
}

/// A custom facet's schema as served at this request's host.
fn facet_schema(headers: &HeaderMap, schema: fn(&str) -> serde_json::Value) -> Response {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1:8080");
    let schema = schema(&format!("http://{host}"));
    (
        [(header::CACHE_CONTROL, "public, max-age=31536000, immutable")],
        axum::Json(schema),
    )
        .into_response()
}

/// `GET /v1/lineage/events/{seq}`: an event's lineage records (OpenLineage run, Delta).
#[utoipa::path(get, path = "/v1/lineage/events/{seq}", tag = "ledger",
    description = "An event's lineage records: its OpenLineage run event and the Delta table version holding it. A clearing decision's record is its scoring batch's (one `clearing.batch` run covering `seq..=last_seq`, the batch's netting and decisions, each named in the run's `aether_clearing_batch` facet). Role: operator or regulator.",
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
    let seq = parse_seq(&seq)?;
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
    let seq = parse_seq(&seq)?;
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

/// Reads `{stream_id, expected_version, events}` or `{appends: [...]}` (atomic). Public for
/// the fuzz targets (`fuzz/`): the body decoder of `POST /v1/events`, reached by any operator.
pub fn parse_append(body: &[u8]) -> Result<Vec<AppendToStream>, Problem> {
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

/// The body of a redaction.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Redaction {
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
    use aether_ledger::ExpectedVersion;
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

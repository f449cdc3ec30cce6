//! The regulator's HTTP API under `/v1/audit`: read only, regulator role, and every call
//! is itself appended to the `access/audit` stream before it is answered (auditors are
//! audited; if that record cannot be written, the query is refused).

use std::collections::HashMap;

use aether_ledger::checkpoint::{CHECKPOINT_STREAM, SignedCheckpoint};
use aether_ledger::{Direction, EventFilter, RecordedEvent};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use aether_control::ControlState;

use crate::access::{Auditor, record_access};
use crate::params::{Params, params, parse_u64, time_param};
use crate::problem::Problem;
use crate::proofs::{
    MAX_REPAIRS, hex_list, inclusion_against_latest, latest_checkpoint, proof_note, proven,
};
use crate::state::AppState;

/// Largest page of events one audit query returns.
const MAX_PAGE: u64 = 1000;

/// The audit routes, documented (see the `openapi` module).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(events))
        .routes(routes!(event))
        .routes(routes!(state_as_of))
        .routes(routes!(crate::audit_decisions::decision))
        .routes(routes!(checkpoints))
        .routes(routes!(inclusion))
        .routes(routes!(consistency))
        .routes(routes!(export))
}

/// Most events one export may hold (see BENCHMARKS.md for the time it takes).
const MAX_EXPORT_EVENTS: u64 = 100_000;

/// The filter named by query parameters or export members (validated).
fn event_filter(p: &HashMap<String, String>) -> Result<EventFilter, Problem> {
    let metadata = ["actor", "trace_id", "member", "snapshot_id", "request_id"]
        .into_iter()
        .filter_map(|key| p.get(key).map(|v| (key.to_owned(), v.clone())))
        .collect();
    let filter = EventFilter {
        from: time_param(p, "from")?,
        to: time_param(p, "to")?,
        event_type: p.get("event_type").cloned(),
        stream_prefix: p.get("stream_prefix").cloned(),
        metadata,
        max_seq: None,
    };
    filter
        .validate()
        .map_err(|e| Problem::bad_request(e.to_string()))?;
    Ok(filter)
}

/// `GET /v1/audit/events`: filtered events, in seq order, with a cursor.
#[utoipa::path(get, path = "/v1/audit/events", tag = "audit",
    description = "Filtered events in seq order with a cursor; stable while events are appended. Role: regulator; the query is recorded on `access/audit` first.",
    params(
           ("from" = Option<String>, Query, description = "Recorded at or after (RFC 3339)"),
           ("to" = Option<String>, Query, description = "Recorded before (RFC 3339)"),
           ("event_type" = Option<String>, Query, description = "Exact event type"),
           ("stream_prefix" = Option<String>, Query, description = "Stream id prefix, e.g. `engine/`"),
           ("actor" = Option<String>, Query, description = "metadata.actor"),
           ("trace_id" = Option<String>, Query, description = "metadata.trace_id"),
           ("member" = Option<String>, Query, description = "metadata.member"),
           ("snapshot_id" = Option<String>, Query, description = "metadata.snapshot_id"),
           ("request_id" = Option<String>, Query, description = "metadata.request_id"),
           ("cursor" = Option<u64>, Query, description = "Events after this seq (the previous page's next_cursor)"),
           ("limit" = Option<u64>, Query, minimum = 1, maximum = 1000, description = "Page size, 1 to 1000 (default 100)")),
    responses((status = 200, description = "`{events, next_cursor}`", body = serde_json::Value)))]
async fn events(
    State(state): State<AppState>,
    auditor: Auditor,
    query: Params,
) -> Result<Response, Problem> {
    let p = params(
        query,
        &[
            "from",
            "to",
            "event_type",
            "stream_prefix",
            "actor",
            "trace_id",
            "member",
            "snapshot_id",
            "request_id",
            "cursor",
            "limit",
        ],
    )?;
    let filter = event_filter(&p)?;
    let cursor = parse_u64(&p, "cursor", 0)?;
    let limit = parse_u64(&p, "limit", 100)?;
    if limit == 0 || limit > MAX_PAGE {
        return Err(Problem::bad_request(format!(
            "limit must be between 1 and {MAX_PAGE}, got {limit}"
        )));
    }
    record_access(&state, &auditor, "events", json!(p)).await?;
    // A plain page carries no proof: the replica's, however far it has replayed.
    let found = state.reads.query(&filter, cursor, limit as u32).await?;
    let next = (found.len() as u64 == limit)
        .then(|| found.last().map(|e| e.seq.to_string()))
        .flatten();
    Ok(axum::Json(json!({ "events": found, "next_cursor": next })).into_response())
}

/// The events an export holds, a page at a time: those `filter` selects, up to `limit`,
/// none past the anchor checkpoint's `tree_size`.
struct ExportPages {
    filter: EventFilter,
    limit: u64,
    tree_size: u64,
    after: u64,
    taken: u64,
    done: bool,
}

impl ExportPages {
    fn new(filter: EventFilter, limit: u64, tree_size: u64) -> Self {
        ExportPages {
            filter,
            limit,
            tree_size,
            after: 0,
            taken: 0,
            done: false,
        }
    }

    /// The next page in ascending seq; `None` once the export holds all it will.
    async fn next(&mut self, state: &AppState) -> Result<Option<Vec<RecordedEvent>>, Problem> {
        if self.done || self.taken >= self.limit {
            return Ok(None);
        }
        let want = (self.limit - self.taken).min(MAX_PAGE) as u32;
        let page = state
            .reads_through(self.tree_size)
            .await
            .query(&self.filter, self.after, want)
            .await?;
        let Some(last) = page.last() else {
            self.done = true;
            return Ok(None);
        };
        self.after = last.seq;
        let covered: Vec<RecordedEvent> = page
            .into_iter()
            .filter(|e| e.seq <= self.tree_size)
            .collect();
        self.done = covered.len() < want as usize || self.after >= self.tree_size;
        self.taken += covered.len() as u64;
        Ok(Some(covered))
    }
}

/// `GET /v1/audit/events/{seq}`: one event with its inclusion proof against the latest
/// signed checkpoint.
#[utoipa::path(get, path = "/v1/audit/events/{seq}", tag = "audit",
    description = "One event with its lineage records, its snapshot, and an inclusion proof against the latest signed checkpoint. Role: regulator.",
    params(("seq" = u64, Path, minimum = 1, maximum = 9007199254740991.0, description = "Ledger position")),
    responses((status = 200, description = "The event, lineage, snapshot and proof", body = serde_json::Value),
              (status = 404, description = "No event at that seq")))]
async fn event(
    State(state): State<AppState>,
    auditor: Auditor,
    policy: crate::audit_decisions::Policy,
    Path(seq): Path<String>,
) -> Result<Response, Problem> {
    let seq = crate::params::parse_seq(&seq)?;
    record_access(&state, &auditor, "event", json!({ "seq": seq })).await?;
    let event: RecordedEvent = state
        .store
        .read_all(seq, 1)
        .await?
        .into_iter()
        .next()
        .filter(|e| e.seq == seq)
        .ok_or_else(|| {
            Problem::new(
                StatusCode::NOT_FOUND,
                "Not found",
                format!("no event at seq {seq}"),
            )
        })?;
    let proof = inclusion_against_latest(&state, seq).await?;
    // Personal values the redaction policy reveals, with their salts, so that the regulator
    // can check them against the commitments in the hashed payload.
    let policy = crate::audit_decisions::policy_of(policy);
    let (shown, held) = crate::audit_decisions::presented(&state, &event, &policy).await?;
    let lineage = aether_lineage::relay::record(&state.store, seq)
        .await
        .ok()
        .flatten();
    Ok(axum::Json(json!({
        "event": event,
        "personal": shown.revealed(&held),
        "personal_fields": shown.fields,
        "redaction_policy": policy.to_string(),
        "lineage": lineage,
        "note": proof_note(&proof),
        "inclusion_proof": proof,
    }))
    .into_response())
}

/// A point in the ledger's history, as a regulator names it.
enum At {
    Seq(u64),
    Time(DateTime<Utc>),
}

const AT_FORMS: &str =
    "a seq (a decimal integer ≥ 0, e.g. 1234) or an RFC 3339 time (e.g. 2026-12-01T09:30:00Z)";

fn parse_at(p: &HashMap<String, String>) -> Result<At, Problem> {
    let raw = p.get("at").ok_or_else(|| {
        Problem::bad_request(format!("query parameter at is required: {AT_FORMS}"))
    })?;
    if !raw.is_empty() && raw.bytes().all(|b| b.is_ascii_digit()) {
        // Digits only: a seq; one too large for any ledger is past the head, like any other.
        return Ok(At::Seq(raw.parse().unwrap_or(u64::MAX)));
    }
    DateTime::parse_from_rfc3339(raw)
        .map(|t| At::Time(t.with_timezone(&Utc)))
        .map_err(|e| {
            // A `+` offset sent unencoded arrives as a space.
            let hint = if raw.contains(' ') {
                "; write + in an offset as %2B"
            } else {
                ""
            };
            Problem::bad_request(format!("at must be {AT_FORMS}; got {raw:?} ({e}){hint}"))
        })
}

/// `GET /v1/audit/state?at=<seq|RFC 3339>`: the control plane (engines, policies with
/// versions, models, rollouts and weights, corpora) and the snapshot in force as they stood
/// at that seq, or after the last event recorded by that time, rebuilt from the ledger up to
/// it, with an inclusion proof of that event. A point past the head is answered at the head,
/// and the answer says so.
#[utoipa::path(get, path = "/v1/audit/state", tag = "audit",
    description = "The control plane and the snapshot in force as they stood at a seq or time, rebuilt from the ledger, with an inclusion proof. Role: regulator.",
    params(("at" = String, Query, description = "A seq or an RFC 3339 time")),
    responses((status = 200, description = "`{seq, state, digest, snapshot, proof}`", body = serde_json::Value)))]
async fn state_as_of(
    State(state): State<AppState>,
    auditor: Auditor,
    query: Params,
) -> Result<Response, Problem> {
    let p = params(query, &["at"])?;
    let at = parse_at(&p)?;
    record_access(&state, &auditor, "state", json!(p)).await?;
    let head = state.store.head().await?.map_or(0, |(seq, _)| seq);
    let wanted = match at {
        At::Seq(seq) => seq,
        At::Time(t) => state.store.seq_at_time(t).await?.map_or(0, |(seq, _)| seq),
    };
    let resolved = wanted.min(head);
    let event = match resolved {
        0 => None,
        seq => state
            .store
            .read_all(seq, 1)
            .await?
            .into_iter()
            .find(|e| e.seq == seq),
    };
    let clamped = match at {
        At::Seq(seq) => seq > head,
        At::Time(t) => resolved == head && event.as_ref().is_some_and(|e| t > e.recorded_at),
    };
    let past = ControlState::replay_until(&state.store, resolved).await?;
    let proof = match resolved {
        0 => Value::Null,
        seq => inclusion_against_latest(&state, seq).await?,
    };
    let mut note = String::new();
    if clamped {
        note.push_str(&format!(
            "at is past the newest event: this is the state at the head (seq {head}), which later events may change. "
        ));
    }
    if resolved == 0 {
        note.push_str("at is before the first event: the empty state.");
    } else {
        note.push_str(proof_note(&proof));
    }
    Ok(axum::Json(json!({
        "at": p.get("at"),
        "resolved_seq": resolved,
        "recorded_at": event.as_ref().map(|e| aether_ledger::hashing::format_timestamp(&e.recorded_at)),
        "head": head,
        "clamped": clamped,
        "state": past.document(),
        "digest": past.digest(),
        "snapshot": past.snapshot(),
        "event": event,
        "inclusion_proof": proof,
        "note": note,
    }))
    .into_response())
}

/// How often the checkpointer signs (`serve --checkpoint-every-events/-secs`): a reader
/// can tell a checkpoint that is late from one not yet due.
#[derive(Clone, Copy, Debug)]
pub struct CheckpointCadence {
    pub every_events: u64,
    pub every_secs: u64,
}

/// `GET /v1/audit/checkpoints?from_version=1&limit=100`: signed tree heads, oldest first.
#[utoipa::path(get, path = "/v1/audit/checkpoints", tag = "audit",
    description = "SM2-signed tree heads, oldest first, and the cadence they are signed at (`cadence`: after `every_events` new events, and at least every `every_secs` seconds while events arrive). Role: regulator.",
    params(("from_version" = Option<u64>, Query, description = "First checkpoint (default 1)"),
           ("limit" = Option<u64>, Query, minimum = 1, maximum = 1000, description = "Page size, 1 to 1000")),
    responses((status = 200, description = "The checkpoints and the public key", body = serde_json::Value),
              (status = 400, description = "A malformed parameter or one out of its range")))]
async fn checkpoints(
    State(state): State<AppState>,
    auditor: Auditor,
    cadence: Option<axum::Extension<CheckpointCadence>>,
    query: Params,
) -> Result<Response, Problem> {
    let p = params(query, &["from_version", "limit"])?;
    let from = parse_u64(&p, "from_version", 1)?.max(1);
    let limit = parse_u64(&p, "limit", 100)?;
    if limit == 0 || limit > MAX_PAGE {
        return Err(Problem::bad_request(format!(
            "limit must be between 1 and {MAX_PAGE}, got {limit}"
        )));
    }
    record_access(&state, &auditor, "checkpoints", json!(p)).await?;
    let events = state
        .store
        .read_stream(CHECKPOINT_STREAM, from, Direction::Forward, limit as u32)
        .await?;
    let list: Vec<Value> = events
        .iter()
        .filter_map(|e| {
            SignedCheckpoint::from_event(e)
                .and_then(Result::ok)
                .map(|c| json!({ "seq": e.seq, "version": e.stream_version, "checkpoint": c }))
        })
        .collect();
    let cadence = cadence.map(
        |axum::Extension(c)| json!({ "every_events": c.every_events, "every_secs": c.every_secs }),
    );
    Ok(axum::Json(json!({ "checkpoints": list, "cadence": cadence })).into_response())
}

/// `GET /v1/audit/proofs/inclusion?seq=&tree_size=` (tree size defaults to the latest
/// checkpoint's).
#[utoipa::path(get, path = "/v1/audit/proofs/inclusion", tag = "audit",
    description = "RFC 9162 inclusion proof (SM3) of an event in a tree size (default: the latest checkpoint's). Role: regulator.",
    params(("seq" = u64, Query, minimum = 1, maximum = 9007199254740991.0, description = "The event"),
           ("tree_size" = Option<u64>, Query, minimum = 1, maximum = 9007199254740991.0, description = "The tree the proof is against")),
    responses((status = 200, description = "The proof", body = serde_json::Value),
              (status = 404, description = "No such event or tree size"),
              (status = 409, description = "No signed checkpoint yet (without `tree_size`)"),
              (status = 422, description = "No such proof: the event lies beyond the tree size asked for")))]
async fn inclusion(
    State(state): State<AppState>,
    auditor: Auditor,
    query: Params,
) -> Result<Response, Problem> {
    let p = params(query, &["seq", "tree_size"])?;
    let seq = p
        .get("seq")
        .ok_or_else(|| Problem::bad_request("query parameter seq is required"))
        .and_then(|_| parse_u64(&p, "seq", 0))?;
    let tree_size = match p.get("tree_size") {
        Some(_) => parse_u64(&p, "tree_size", 0)?,
        None => latest_checkpoint(&state)
            .await?
            .map(|(_, c)| c.tree_size)
            .ok_or_else(|| {
                Problem::new(
                    StatusCode::CONFLICT,
                    "No checkpoint yet",
                    "no signed checkpoint exists yet; give tree_size explicitly",
                )
            })?,
    };
    record_access(&state, &auditor, "inclusion_proof", json!(p)).await?;
    let (hashes, root) = proven(&state, |log| {
        Ok((
            log.inclusion_proof(seq, tree_size)?,
            log.root_at(tree_size)?,
        ))
    })
    .await?;
    Ok(axum::Json(json!({
        "seq": seq,
        "leaf_index": seq - 1,
        "tree_size": tree_size,
        "root_hash": hex::encode(root),
        "hashes": hex_list(&hashes),
    }))
    .into_response())
}

/// `GET /v1/audit/proofs/consistency?from=&to=`.
#[utoipa::path(get, path = "/v1/audit/proofs/consistency", tag = "audit",
    description = "RFC 9162 consistency proof between two tree sizes. Role: regulator.",
    params(("from" = u64, Query, minimum = 1, maximum = 9007199254740991.0, description = "Older tree size"),
           ("to" = u64, Query, minimum = 1, maximum = 9007199254740991.0, description = "Newer tree size, at least `from`")),
    responses((status = 200, description = "The proof", body = serde_json::Value),
              (status = 422, description = "No such proof: `from` is 0 or above `to`, or `to` beyond the log")))]
async fn consistency(
    State(state): State<AppState>,
    auditor: Auditor,
    query: Params,
) -> Result<Response, Problem> {
    let p = params(query, &["from", "to"])?;
    for required in ["from", "to"] {
        if !p.contains_key(required) {
            return Err(Problem::bad_request(format!(
                "query parameter {required} is required"
            )));
        }
    }
    let from = parse_u64(&p, "from", 0)?;
    let to = parse_u64(&p, "to", 0)?;
    record_access(&state, &auditor, "consistency_proof", json!(p)).await?;
    let (hashes, from_root, to_root) = proven(&state, |log| {
        Ok((
            log.consistency_proof(from, to)?,
            log.root_at(from)?,
            log.root_at(to)?,
        ))
    })
    .await?;
    Ok(axum::Json(json!({
        "from": from,
        "to": to,
        "from_root": hex::encode(from_root),
        "to_root": hex::encode(to_root),
        "hashes": hex_list(&hashes),
    }))
    .into_response())
}

/// The signed checkpoint of exactly `size` events, for a bundle that proves the ledger
/// only grew since (`None` when it is the anchor itself). Checkpoints are read newest first
/// until the size is passed: a regulator's earlier checkpoint is found by reading the
/// checkpoints signed since.
async fn checkpoint_of_size(
    state: &AppState,
    size: u64,
    anchor_size: u64,
) -> Result<Option<SignedCheckpoint>, Problem> {
    if size == 0 || size > anchor_size {
        return Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid since_tree_size",
            format!(
                "since_tree_size must be from 1 to the latest checkpoint's {anchor_size}, got {size}"
            ),
        ));
    }
    if size == anchor_size {
        return Ok(None);
    }
    let mut before = u64::MAX;
    loop {
        let page = state
            .store
            .read_stream(CHECKPOINT_STREAM, before, Direction::Backward, 1000)
            .await?;
        for event in &page {
            before = event.stream_version.saturating_sub(1);
            if let Some(Ok(checkpoint)) = SignedCheckpoint::from_event(event) {
                if checkpoint.tree_size == size {
                    return Ok(Some(checkpoint));
                }
                if checkpoint.tree_size < size {
                    break;
                }
            }
        }
        let passed = page
            .last()
            .and_then(|e| SignedCheckpoint::from_event(e)?.ok())
            .is_some_and(|c| c.tree_size < size);
        if page.len() < 1000 || passed || before == 0 {
            return Err(Problem::new(
                StatusCode::NOT_FOUND,
                "No such checkpoint",
                format!("no signed checkpoint covers exactly {size} events"),
            ));
        }
    }
}

/// Exports running at once: a bundle holds its events and proofs in memory while it is
/// built (about 12 KB an event), so they are bounded in total and per regulator.
const MAX_EXPORTS: usize = 2;
const MAX_EXPORTS_PER_REGULATOR: usize = 1;

/// The exports running now, by regulator.
static EXPORTS: std::sync::Mutex<Option<HashMap<String, usize>>> = std::sync::Mutex::new(None);

/// One running export's place; given back when dropped.
struct ExportSlot(String);

impl ExportSlot {
    fn take(actor: &str) -> Result<ExportSlot, Problem> {
        let mut running = EXPORTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let running = running.get_or_insert_with(HashMap::new);
        let total: usize = running.values().sum();
        let own = running.get(actor).copied().unwrap_or(0);
        if own >= MAX_EXPORTS_PER_REGULATOR || total >= MAX_EXPORTS {
            return Err(Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                "Too many exports",
                format!(
                    "{own} of your exports and {total} in all are being built (at most \
                     {MAX_EXPORTS_PER_REGULATOR} per regulator and {MAX_EXPORTS} in all); \
                     retry when one has finished"
                ),
            )
            .retry_after(5));
        }
        *running.entry(actor.to_owned()).or_default() += 1;
        Ok(ExportSlot(actor.to_owned()))
    }
}

impl Drop for ExportSlot {
    fn drop(&mut self) {
        let mut running = EXPORTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(running) = running.as_mut()
            && let Some(n) = running.get_mut(&self.0)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                running.remove(&self.0);
            }
        }
    }
}

/// `POST /v1/audit/exports` with a JSON body of the same filters as `GET /v1/audit/events`
/// (`from`, `to`, `event_type`, `stream_prefix`, `actor`, `trace_id`, `member`,
/// `snapshot_id`, `request_id`, and `limit` up to 100,000): an evidence bundle of the
/// matching events covered by the latest signed checkpoint, with their inclusion proofs.
#[utoipa::path(post, path = "/v1/audit/exports", tag = "audit",
    description = "An evidence bundle (audit/BUNDLE.md) of the matching events covered by the latest signed checkpoint, with proofs, checkpoints and lineage records; verify it offline with `aether audit verify`. Role: regulator.",
    request_body(content = serde_json::Value, description = "The filters of `GET /v1/audit/events` as JSON members, `limit` up to 100000, and `since_tree_size`: the tree size of a checkpoint the regulator already holds, which the bundle then includes with a consistency proof to the anchor"),
    responses((status = 200, description = "The bundle", body = serde_json::Value),
              (status = 404, description = "No signed checkpoint has exactly `since_tree_size` events"),
              (status = 409, description = "No signed checkpoint covers the events yet"),
              (status = 429, description = "Too many exports being built (1 per regulator, 2 in all); `Retry-After` says when to try again")))]
async fn export(
    State(state): State<AppState>,
    auditor: Auditor,
    body: axum::body::Bytes,
) -> Result<Response, Problem> {
    let filters: serde_json::Map<String, Value> = if body.is_empty() {
        serde_json::Map::new()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            Problem::bad_request(format!(
                "the export body must be a JSON object of filters: {e}"
            ))
        })?
    };
    let mut p = HashMap::new();
    for (k, v) in &filters {
        let text = match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            other => {
                return Err(Problem::bad_request(format!(
                    "filter {k:?} must be a string or a number, got {other}"
                )));
            }
        };
        p.insert(k.clone(), text);
    }
    let allowed = [
        "from",
        "to",
        "event_type",
        "stream_prefix",
        "actor",
        "trace_id",
        "member",
        "snapshot_id",
        "request_id",
        "limit",
        "since_tree_size",
    ];
    if let Some(unknown) = p.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(Problem::bad_request(format!(
            "unknown filter {unknown:?}; expected one of {}",
            allowed.join(", ")
        )));
    }
    let filter = event_filter(&p)?;
    let limit = parse_u64(&p, "limit", MAX_EXPORT_EVENTS)?;
    if limit == 0 || limit > MAX_EXPORT_EVENTS {
        return Err(Problem::bad_request(format!(
            "limit must be between 1 and {MAX_EXPORT_EVENTS}, got {limit}"
        )));
    }
    let slot = ExportSlot::take(&auditor.actor)?;
    let Some((_, anchor)) = latest_checkpoint(&state).await? else {
        return Err(Problem::new(
            StatusCode::CONFLICT,
            "No checkpoint yet",
            "no signed checkpoint exists yet, so nothing can be proven; retry after the first one",
        ));
    };
    // A regulator who holds an earlier checkpoint asks for it to be proven extended.
    let since = match p.get("since_tree_size") {
        None => None,
        Some(_) => {
            let size = parse_u64(&p, "since_tree_size", 0)?;
            checkpoint_of_size(&state, size, anchor.tree_size).await?
        }
    };
    record_access(&state, &auditor, "export", Value::Object(filters.clone())).await?;
    let mut filters = filters;
    filters.insert("anchor_tree_size".into(), json!(anchor.tree_size));
    let checkpoints: Vec<SignedCheckpoint> = since.into_iter().chain([anchor.clone()]).collect();
    let rotations = aether_ledger::key_rotation::key_rotations(&state.store).await?;
    // The follower may be a moment behind the newest checkpoint.
    if state.merkle.len() < anchor.tree_size {
        state.merkle.catch_up(&state.store).await?;
    }
    let mut export = StreamedExport {
        pages: ExportPages::new(filter, limit, anchor.tree_size),
        writer: None,
        repairs: 0,
        _slot: slot,
    };
    let (head, writer) = export
        .proven(&state, |tree| {
            aether_audit::Bundle::begin_rotated(
                tree,
                checkpoints.clone(),
                rotations.clone(),
                Value::Object(filters.clone()),
                Utc::now(),
            )
        })
        .await?;
    export.writer = Some(writer);
    // The head and the first page before the answer, so that what usually fails (the
    // database, a proof) is still a problem document; past this a failure can only cut the
    // download short, which the CLI reports and never saves as a bundle.
    let mut first = head;
    export.next_chunk(&state, &mut first).await?;
    let (chunks, body) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(2);
    let _ = chunks.send(Ok(first)).await;
    tokio::spawn(async move {
        export.pump(&state, &chunks).await;
        // The export's place is given back before the download is seen to end.
        drop(export);
        drop(chunks);
    });
    Ok((
        [
            (axum::http::header::CONTENT_TYPE, "application/json"),
            (
                axum::http::header::CONTENT_DISPOSITION,
                "attachment; filename=\"aether-evidence.json\"",
            ),
        ],
        axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(body)),
    )
        .into_response())
}

/// An evidence bundle written a page of events at a time (issue: a 100,000-event export
/// held 1.2 GB when it was built whole); holds the export's place until it ends.
struct StreamedExport {
    pages: ExportPages,
    writer: Option<aether_audit::EventWriter>,
    repairs: usize,
    _slot: ExportSlot,
}

impl StreamedExport {
    /// Appends the next page of events to `out`, or the bundle's end; `false` once the
    /// bundle is whole.
    async fn next_chunk(&mut self, state: &AppState, out: &mut Vec<u8>) -> Result<bool, Problem> {
        let Some(page) = self.pages.next(state).await? else {
            if let Some(writer) = self.writer.take() {
                out.extend_from_slice(writer.finish());
            }
            return Ok(false);
        };
        let Some(mut writer) = self.writer.take() else {
            return Ok(false);
        };
        for event in &page {
            self.proven(state, |tree| writer.write(event, tree, out))
                .await?;
        }
        self.writer = Some(writer);
        Ok(true)
    }

    /// Sends the rest of the bundle a page at a time until it is whole, the regulator goes
    /// away, or a page fails (then the download is cut short).
    async fn pump(
        &mut self,
        state: &AppState,
        chunks: &tokio::sync::mpsc::Sender<Result<Vec<u8>, std::io::Error>>,
    ) {
        loop {
            let mut chunk = Vec::new();
            let more = match self.next_chunk(state, &mut chunk).await {
                Ok(more) => more,
                Err(problem) => {
                    tracing::error!(detail = %problem.detail(), "an evidence export stopped part way");
                    let _ = chunks
                        .send(Err(std::io::Error::other("the export stopped part way")))
                        .await;
                    return;
                }
            };
            if chunks.send(Ok(chunk)).await.is_err() || !more {
                return;
            }
        }
    }

    /// Runs `build` against the Merkle log; a block of its file found changed is rewritten
    /// from the ledger (`MerkleLog::repair`) and `build` run again.
    async fn proven<T>(
        &mut self,
        state: &AppState,
        mut build: impl FnMut(
            &aether_ledger::merkle_log::LogProofs<'_>,
        ) -> Result<T, aether_audit::BundleError>,
    ) -> Result<T, Problem> {
        loop {
            match build(&state.merkle.proofs()) {
                Ok(done) => return Ok(done),
                Err(aether_audit::BundleError::Proof(e))
                    if self.repairs < MAX_REPAIRS
                        && state.merkle.repair(&state.store, &e).await? =>
                {
                    self.repairs += 1;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot build an evidence bundle");
                    return Err(Problem::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "Export failed",
                        e.to_string(),
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod export_slot_tests {
    use super::*;

    /// One export per regulator and two in all; a finished export gives its place back.
    #[test]
    fn exports_are_bounded_per_regulator_and_in_all() {
        let status = |r: Result<ExportSlot, Problem>| match r {
            Ok(_) => panic!("expected a refusal"),
            Err(p) => p.into_response().status(),
        };
        let a = ExportSlot::take("regulator:a").unwrap();
        assert_eq!(
            status(ExportSlot::take("regulator:a")),
            StatusCode::TOO_MANY_REQUESTS
        );
        let b = ExportSlot::take("regulator:b").unwrap();
        let refused = ExportSlot::take("regulator:c")
            .err()
            .unwrap()
            .into_response();
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.headers()["retry-after"], "5");
        drop(a);
        let c = ExportSlot::take("regulator:c").unwrap();
        drop((b, c));
        drop(ExportSlot::take("regulator:a").unwrap());
    }
}

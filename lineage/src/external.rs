//! OpenLineage events from other producers (`POST /api/v1/lineage`), and the reads that
//! join them with Aether's own records for the lineage API.
//!
//! An ingest is all or nothing: every event of a request is validated against the
//! OpenLineage spec ([`crate::schema`]) before any is stored, and all are stored in one
//! transaction. Each distinct event is stored once (keyed by the SM3 of its RFC 8785 form),
//! so a producer that resends after a timeout changes nothing. Inserts are serialised (a
//! table lock on PostgreSQL, the single writer on SQLite), so ids commit in order and a
//! reader that follows them by id misses none.

use aether_ledger::hashing::{canonical_json, sm3};
use aether_ledger::{EventStore, LedgerError};
use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::graph::{Name, parse_time};
use crate::schema::{EventKind, OpenLineageSchemas, SchemaViolation};

/// Most events one request may carry.
pub const MAX_EVENTS_PER_REQUEST: usize = 1000;

/// Why a request's events were refused; nothing of it was stored.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("request body is not JSON (line {line}, column {column}): {message}")]
    NotJson {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("expected one OpenLineage event (a JSON object) or a batch of them (an array)")]
    NotAnEvent,
    #[error("an empty batch: send at least one event")]
    Empty,
    #[error("a batch of {0} events: at most {MAX_EVENTS_PER_REQUEST} per request")]
    TooMany(usize),
    /// The event (its index in a batch, when the request was one) breaks the spec.
    #[error("{}invalid OpenLineage event: {source}", .index.map(|i| format!("event {i}: ")).unwrap_or_default())]
    Schema {
        index: Option<usize>,
        source: SchemaViolation,
    },
    #[error("{}eventTime {time:?} is not an RFC 3339 time", .index.map(|i| format!("event {i}: ")).unwrap_or_default())]
    EventTime { index: Option<usize>, time: String },
    #[error("cannot canonicalise an event: {0}")]
    Canonical(String),
}

/// Why the lineage store could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("lineage store: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// One validated external event, ready to store.
#[derive(Clone, Debug, PartialEq)]
pub struct ExternalEvent {
    pub kind: EventKind,
    pub event_time: DateTime<Utc>,
    /// `run.runId`, lowercase (run events).
    pub run_id: Option<String>,
    pub job: Option<Name>,
    /// The event as received (re-serialised, members in received order).
    pub json: String,
    /// SM3 (hex) of the event's RFC 8785 form.
    pub digest: String,
}

impl ExternalEvent {
    /// Validates one event against the spec.
    fn from_value(value: &Value, index: Option<usize>) -> Result<ExternalEvent, IngestError> {
        let kind = OpenLineageSchemas::get()
            .validate(value)
            .map_err(|source| IngestError::Schema { index, source })?;
        let time = value["eventTime"].as_str().unwrap_or_default();
        let event_time = parse_time(time).ok_or_else(|| IngestError::EventTime {
            index,
            time: time.to_owned(),
        })?;
        let canonical = canonical_json(value).map_err(|e| IngestError::Canonical(e.to_string()))?;
        let text = |v: &Value| v.as_str().map(str::to_owned);
        let job = match (
            text(&value["job"]["namespace"]),
            text(&value["job"]["name"]),
        ) {
            (Some(namespace), Some(name)) => Some(Name { namespace, name }),
            _ => None,
        };
        Ok(ExternalEvent {
            kind,
            event_time,
            run_id: text(&value["run"]["runId"]).map(|id| id.to_ascii_lowercase()),
            job,
            json: value.to_string(),
            digest: aether_ledger::hashing::to_hex(&sm3(canonical.as_bytes())),
        })
    }
}

/// The events of a `POST /api/v1/lineage` body: one event (an object) or a batch (an
/// array), every one valid, or the first reason why not.
pub fn parse_request(body: &[u8]) -> Result<Vec<ExternalEvent>, IngestError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| IngestError::NotJson {
        line: e.line(),
        column: e.column(),
        message: e.to_string(),
    })?;
    match value {
        Value::Object(_) => Ok(vec![ExternalEvent::from_value(&value, None)?]),
        Value::Array(events) if events.is_empty() => Err(IngestError::Empty),
        Value::Array(events) if events.len() > MAX_EVENTS_PER_REQUEST => {
            Err(IngestError::TooMany(events.len()))
        }
        Value::Array(events) => events
            .iter()
            .enumerate()
            .map(|(i, e)| ExternalEvent::from_value(e, Some(i)))
            .collect(),
        _ => Err(IngestError::NotAnEvent),
    }
}

fn kind_name(kind: EventKind) -> &'static str {
    match kind {
        EventKind::Run => "RUN",
        EventKind::Dataset => "DATASET",
        EventKind::Job => "JOB",
    }
}

/// Stores the events in one transaction; returns how many were new (a resent event is
/// stored once).
pub async fn store_external(
    store: &EventStore,
    events: &[ExternalEvent],
    actor: &str,
    now: DateTime<Utc>,
) -> Result<u64, StoreError> {
    let stored: u64 = either_pool!(store, |pool, time, postgres| {
        let mut tx = pool.begin().await?;
        if postgres {
            // Ids commit in id order, so the index that follows them by id misses none.
            sqlx::query("LOCK TABLE external_lineage_events IN EXCLUSIVE MODE")
                .execute(&mut *tx)
                .await?;
        }
        let mut stored = 0;
        for e in events {
            stored += sqlx::query(
                "INSERT INTO external_lineage_events (digest, kind, event_time, run_id, \
                 job_namespace, job_name, event, received_at, actor) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (digest) DO NOTHING",
            )
            .bind(&e.digest)
            .bind(kind_name(e.kind))
            .bind(time(e.event_time))
            .bind(&e.run_id)
            .bind(e.job.as_ref().map(|j| &j.namespace))
            .bind(e.job.as_ref().map(|j| &j.name))
            .bind(&e.json)
            .bind(time(now))
            .bind(actor)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        }
        tx.commit().await?;
        stored
    });
    Ok(stored)
}

/// Aether's own OpenLineage records with `after < seq ≤ until`, in seq order, at most
/// `limit`: `(seq, event JSON)`.
pub async fn own_records(
    store: &EventStore,
    after: u64,
    until: Option<u64>,
    limit: u32,
) -> Result<Vec<(u64, String)>, StoreError> {
    let until = until.map_or(i64::MAX, |u| i64::try_from(u).unwrap_or(i64::MAX));
    let after = i64::try_from(after).unwrap_or(i64::MAX);
    let rows: Vec<(i64, String)> = either_pool!(store, |pool, _time, _postgres| {
        sqlx::query_as(
            "SELECT seq, openlineage_event FROM lineage_records \
             WHERE seq > $1 AND seq <= $2 ORDER BY seq LIMIT $3",
        )
        .bind(after)
        .bind(until)
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?
    });
    Ok(rows.into_iter().map(|(s, e)| (s as u64, e)).collect())
}

/// External events with `id > after` and `eventTime ≤ until`, in id order, at most
/// `limit`: `(id, event JSON)`.
pub async fn external_events(
    store: &EventStore,
    after: i64,
    until: Option<DateTime<Utc>>,
    limit: u32,
) -> Result<Vec<(i64, String)>, StoreError> {
    // No bound is NULL: the comparison is then NULL, taken as true.
    let rows = either_pool!(store, |pool, time, _postgres| {
        sqlx::query_as(
            "SELECT id, event FROM external_lineage_events \
             WHERE id > $1 AND COALESCE(event_time <= $2, TRUE) ORDER BY id LIMIT $3",
        )
        .bind(after)
        .bind(until.map(time))
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?
    });
    Ok(rows)
}

/// Every stored event of one run (Aether's and external), as JSON text.
pub async fn run_events(store: &EventStore, run_id: &str) -> Result<Vec<String>, StoreError> {
    let run_id = run_id.to_ascii_lowercase();
    let uuid = uuid::Uuid::parse_str(&run_id).ok();
    let mut out: Vec<String> = match uuid {
        Some(uuid) => either_pool!(store, |pool, _time, _postgres| {
            sqlx::query_scalar(
                "SELECT openlineage_event FROM lineage_records WHERE run_id = $1 ORDER BY seq",
            )
            .bind(uuid)
            .fetch_all(pool)
            .await?
        }),
        None => Vec::new(),
    };
    let external: Vec<String> = either_pool!(store, |pool, _time, _postgres| {
        sqlx::query_scalar(
            "SELECT event FROM external_lineage_events WHERE run_id = $1 ORDER BY id",
        )
        .bind(&run_id)
        .fetch_all(pool)
        .await?
    });
    out.extend(external);
    Ok(out)
}

/// The ids of a job's runs (Aether's records, then external events), newest first, skipping
/// `offset`, at most `limit`. Aether's jobs are all in [`crate::JOB_NAMESPACE`]; only an
/// engine activation's run spans several records, so a few more rows than asked are read.
pub async fn job_runs(
    store: &EventStore,
    namespace: &str,
    job: &str,
    offset: u32,
    limit: u32,
) -> Result<Vec<String>, StoreError> {
    let wanted = offset.saturating_add(limit) as usize;
    let mut runs: Vec<String> = Vec::with_capacity(wanted);
    let mut push = |id: String| {
        if !runs.contains(&id) {
            runs.push(id);
        }
    };
    if namespace == crate::JOB_NAMESPACE {
        let rows = i64::try_from(wanted.saturating_mul(4).max(16)).unwrap_or(i64::MAX);
        let own: Vec<uuid::Uuid> = either_pool!(store, |pool, _time, _postgres| {
            sqlx::query_scalar(
                "SELECT run_id FROM lineage_records WHERE job = $1 ORDER BY seq DESC LIMIT $2",
            )
            .bind(job)
            .bind(rows)
            .fetch_all(pool)
            .await?
        });
        own.into_iter().for_each(|id| push(id.to_string()));
    }
    let external: Vec<String> = either_pool!(store, |pool, _time, _postgres| {
        sqlx::query_scalar(
            "SELECT run_id FROM external_lineage_events \
             WHERE job_namespace = $1 AND job_name = $2 AND run_id IS NOT NULL \
             GROUP BY run_id ORDER BY MAX(id) DESC LIMIT $3",
        )
        .bind(namespace)
        .bind(job)
        .bind(i64::try_from(wanted).unwrap_or(i64::MAX))
        .fetch_all(pool)
        .await?
    });
    external.into_iter().for_each(&mut push);
    Ok(runs
        .into_iter()
        .skip(offset as usize)
        .take(limit as usize)
        .collect())
}

/// `GET /api/v1/events/lineage`: stored events (Aether's and external) with an eventTime
/// after `after`, oldest first, skipping the first `offset`, at most `limit`. Many events
/// share one time (a group commit records a batch at one instant), so a client pages with
/// `offset` from one `after`, not with the last time it saw.
pub async fn events_page(
    store: &EventStore,
    after: Option<DateTime<Utc>>,
    offset: u32,
    limit: u32,
) -> Result<Vec<Value>, StoreError> {
    let wanted = offset.saturating_add(limit);
    // Aether's event times are the ledger's recorded_at, non-decreasing in seq.
    let from_seq = match after {
        Some(t) => store.seq_at_time(t).await?.map_or(0, |(seq, _)| seq),
        None => 0,
    };
    let own = own_records(store, from_seq, None, wanted).await?;
    let external: Vec<String> = either_pool!(store, |pool, time, _postgres| {
        sqlx::query_scalar(
            "SELECT event FROM external_lineage_events \
             WHERE COALESCE(event_time > $1, TRUE) ORDER BY event_time, id LIMIT $2",
        )
        .bind(after.map(time))
        .bind(i64::from(wanted))
        .fetch_all(pool)
        .await?
    });
    let mut merged: Vec<(DateTime<Utc>, u8, Value)> = Vec::new();
    for (source, json) in own
        .into_iter()
        .map(|(_, j)| (0u8, j))
        .chain(external.into_iter().map(|j| (1u8, j)))
    {
        let Ok(value) = serde_json::from_str::<Value>(&json) else {
            continue;
        };
        let at = value["eventTime"]
            .as_str()
            .and_then(parse_time)
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        merged.push((at, source, value));
    }
    // Stable: within one time, Aether's in seq order, then external ones in id order.
    merged.sort_by_key(|(at, source, _)| (*at, *source));
    Ok(merged
        .into_iter()
        .skip(offset as usize)
        .take(limit as usize)
        .map(|(_, _, v)| v)
        .collect())
}

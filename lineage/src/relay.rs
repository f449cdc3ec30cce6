//! The lineage relay: follows the ledger from its stored cursor and writes each event's
//! OpenLineage record into `lineage_records` (and, when configured, a JSON-lines file).
//!
//! A scoring batch (its `NettingComputed` event and the `ClearingDecided` events appended
//! with it, at the seqs right after it) is one record, one `clearing.batch` run keyed by the
//! netting's seq, whose `last_seq` is the batch's last decision: the gateway appends a batch
//! atomically, so the relay always sees it whole, and a page that ends inside one reads on
//! until it closes (or the ledger's head, which ends an append). [`record`] finds the record
//! covering any seq.
//!
//! At-least-once and idempotent: records are keyed by seq, a page goes in as one binary COPY
//! (or, when one of its records is already there, with "do nothing on conflict"), the
//! cursor is saved only after they commit, and the mapping is deterministic,
//! so a crash between the two repeats identical work. The relay reads the ledger through
//! a subscription, so a slow or failing relay never slows an append; its lag is a metric.

use std::path::PathBuf;
use std::sync::Arc;

use aether_ledger::pg_binary::{BinaryRows, copy_in};
use aether_ledger::{EventStore, RecordedEvent};
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::Row;
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use uuid::Uuid;

use crate::decisions::{CLEARING_DECIDED, DECISIONS_TABLE, NETTING_COMPUTED};
pub use crate::error::RelayError;
use crate::retry::retry_until_stopped;
use crate::{MappingContext, job_name};

/// Name of the relay's cursor in the ledger's subscription positions.
pub const OPENLINEAGE_CURSOR: &str = "lineage-openlineage";
/// Events mapped per database transaction.
const BATCH: usize = 500;

/// One event's lineage records (or a scoring batch's: then `seq..=last_seq` are its netting
/// and decisions).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LineageRecord {
    pub seq: u64,
    /// The last seq the record covers: `seq` itself except for a scoring batch.
    pub last_seq: u64,
    pub event_id: Uuid,
    pub run_id: Uuid,
    pub job: String,
    pub openlineage_at: String,
    pub delta_table: Option<String>,
    pub delta_version: Option<i64>,
    /// The OpenLineage RunEvent as stored.
    pub openlineage_event: serde_json::Value,
}

struct Mapped {
    seq: i64,
    last_seq: i64,
    event_id: Uuid,
    run_id: Uuid,
    job: &'static str,
    json: String,
}

/// The records `events` make, as index ranges: a scoring batch's netting and the decisions
/// of its batch right after it are one range, any other event one of its own. The last
/// range is `open` when it is a batch that may go on past `events` (more decisions could
/// follow), unless `whole_at_end` says the events end at the end of an append.
#[derive(Debug, PartialEq, Eq)]
struct Records {
    ranges: Vec<std::ops::Range<usize>>,
    open: bool,
}

fn records(events: &[Arc<RecordedEvent>], whole_at_end: bool) -> Records {
    let mut ranges = Vec::new();
    let mut i = 0;
    let mut open = false;
    while i < events.len() {
        let mut end = i + 1;
        if events[i].event_type == NETTING_COMPUTED {
            let batch = crate::run_event::batch_of(&events[i]);
            while end < events.len()
                && events[end].event_type == CLEARING_DECIDED
                && batch.is_some()
                && crate::run_event::batch_of(&events[end]) == batch
            {
                end += 1;
            }
            open = end == events.len() && !whole_at_end && batch.is_some();
        }
        ranges.push(i..end);
        i = end;
    }
    Records { ranges, open }
}

/// How many of `events` (ranged by `records`) make whole records within the first `ready`.
fn whole_prefix(records: &Records, ready: usize) -> (usize, usize) {
    let mut events = 0;
    let mut count = 0;
    let last = records.ranges.len().saturating_sub(1);
    for (i, r) in records.ranges.iter().enumerate() {
        if r.end > ready || (i == last && records.open) {
            break;
        }
        events = r.end;
        count += 1;
    }
    (events, count)
}

/// Maps the records of `events` (its first `ranges`), each with the Delta `events` table
/// version `delta_version(seq)` names and (decisions) the `clearing_decisions` version
/// `decisions_version(seq)` names, at the record's last seq.
fn map(
    events: &[Arc<RecordedEvent>],
    ranges: &[std::ops::Range<usize>],
    ctx: &MappingContext,
    delta_version: impl Fn(u64) -> Option<i64>,
    decisions_version: impl Fn(u64) -> Option<i64>,
) -> Result<Vec<Mapped>, RelayError> {
    let mut ctx = ctx.clone();
    let base = crate::run_event::schema_base_url(&ctx.schema_base_url)?;
    // Sized up front: collecting through `Result` gives no size hint, and a page of
    // hundreds of rows grew (and was copied) many times over.
    let mut rows = Vec::with_capacity(ranges.len());
    for range in ranges {
        let e = &events[range.start];
        let last = &events[range.end - 1];
        ctx.delta_version = delta_version(last.seq);
        ctx.clearing_decisions_version = decisions_version(last.seq);
        let run_event = if e.event_type == NETTING_COMPUTED {
            let decisions: Vec<&RecordedEvent> = events[range.start + 1..range.end]
                .iter()
                .map(|d| d.as_ref())
                .collect();
            crate::run_event::batch_run_event_under(e, &decisions, &ctx, &base)?
        } else {
            crate::run_event::to_run_event_under(e, &ctx, &base)?
        };
        let run_id = run_event.run.run_id;
        // Straight to text, members in the types' field order: through a sorted
        // `Value` tree, this was a third of the relay's work per event.
        let json = serde_json::to_string(&run_event)?;
        rows.push(Mapped {
            seq: e.seq as i64,
            last_seq: last.seq as i64,
            event_id: e.event_id,
            run_id,
            job: job_name(&e.event_type),
            json,
        });
    }
    Ok(rows)
}

/// Rows per INSERT statement on SQLite: one statement per chunk rather than per event (7
/// bound parameters each, well under its limit).
const ROWS_PER_STATEMENT: usize = 200;

async fn insert(
    store: &EventStore,
    rows: &[Mapped],
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    if let Some(pool) = store.postgres_pool() {
        // A page as one binary COPY: PostgreSQL inserts the rows in bulk, with none of the
        // array parsing and speculative insertion of the statement below (which cost it
        // ~17 µs per record under clearing load against ~6 µs for the insert itself).
        // COPY refuses the whole page if one record is already there (a page written again
        // after a crash between the insert and the cursor's save, or a second relay on the
        // same database), and the page then goes in through "do nothing on conflict".
        match copy_page(pool, rows, now).await {
            Ok(()) => return Ok(()),
            Err(e) if is_unique_violation(&e) => {
                metrics::counter!("aether_lineage_openlineage_copy_conflicts_total").increment(1);
            }
            Err(e) => return Err(e),
        }
        // A page in one statement (columns as arrays), which is its own transaction: one
        // round trip instead of BEGIN, a statement per chunk and COMMIT.
        let seq: Vec<i64> = rows.iter().map(|r| r.seq).collect();
        let last_seq: Vec<i64> = rows.iter().map(|r| r.last_seq).collect();
        let event_id: Vec<Uuid> = rows.iter().map(|r| r.event_id).collect();
        let run_id: Vec<Uuid> = rows.iter().map(|r| r.run_id).collect();
        let job: Vec<&str> = rows.iter().map(|r| r.job).collect();
        let json: Vec<&str> = rows.iter().map(|r| r.json.as_str()).collect();
        sqlx::query(
            "INSERT INTO lineage_records \
                 (seq, last_seq, event_id, run_id, job, openlineage_event, openlineage_at) \
             SELECT seq, last_seq, event_id, run_id, job, openlineage_event, $7 \
             FROM UNNEST($1::bigint[], $2::bigint[], $3::uuid[], $4::uuid[], $5::text[], \
                         $6::text[]) \
                 AS r(seq, last_seq, event_id, run_id, job, openlineage_event) \
             ON CONFLICT (seq) DO NOTHING",
        )
        .bind(&seq)
        .bind(&last_seq)
        .bind(&event_id)
        .bind(&run_id)
        .bind(&job)
        .bind(&json)
        .bind(now)
        .execute(pool)
        .await?;
        Ok(())
    } else if let Some(pool) = store.sqlite_pool() {
        const HEAD: &str = "INSERT INTO lineage_records \
                            (seq, last_seq, event_id, run_id, job, openlineage_event, \
                             openlineage_at) ";
        const TAIL: &str = " ON CONFLICT (seq) DO NOTHING";
        let mut tx = pool.begin().await?;
        for chunk in rows.chunks(ROWS_PER_STATEMENT) {
            let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new(HEAD);
            q.push_values(chunk, |mut b, r| {
                b.push_bind(r.seq)
                    .push_bind(r.last_seq)
                    .push_bind(r.event_id)
                    .push_bind(r.run_id)
                    .push_bind(r.job)
                    .push_bind(&r.json)
                    .push_bind(now.timestamp_micros());
            });
            q.push(TAIL).build().execute(&mut *tx).await?;
        }
        tx.commit().await
    } else {
        Ok(())
    }
}

const COPY_RECORDS: &str = "COPY lineage_records \
     (seq, last_seq, event_id, run_id, job, openlineage_event, openlineage_at) \
     FROM STDIN (FORMAT binary)";

async fn copy_page(
    pool: &sqlx::PgPool,
    rows: &[Mapped],
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    copy_in(
        &mut conn,
        COPY_RECORDS,
        binary_page(rows, now)?,
        "the lineage relay",
    )
    .await
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
}

/// A page of records as binary COPY data, in [`COPY_RECORDS`]' column order.
fn binary_page(rows: &[Mapped], now: DateTime<Utc>) -> Result<Vec<u8>, sqlx::Error> {
    let text_bytes: usize = rows.iter().map(|r| r.job.len() + r.json.len()).sum();
    let mut data = BinaryRows::new(7, rows.len() * 90 + text_bytes);
    for r in rows {
        data.row()
            .int8(r.seq)
            .int8(r.last_seq)
            .uuid(&r.event_id)
            .uuid(&r.run_id)
            .text(r.job)?
            .text(&r.json)?
            .timestamptz(&now);
    }
    Ok(data.finish())
}

/// Follows the ledger until `stop` turns true, writing OpenLineage records (and lines to
/// `jsonl`, when given). Failures are logged and retried with backoff from the stored
/// cursor: lineage is delayed, never dropped.
///
/// Each record names the version of the Delta `events` table that holds its event (the
/// `version` facet of the `delta/events` output) and, for a decision, the version of the
/// `clearing_decisions` table that holds its row, so the relay maps only events whose
/// commits the Delta relay has linked in `delta_commits`: it follows behind the Delta
/// relay, and a slow Delta sink delays OpenLineage, never drops it.
pub async fn run_openlineage_relay(
    store: EventStore,
    ctx: MappingContext,
    jsonl: Option<PathBuf>,
    stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    run_openlineage_relay_with(store, ctx, jsonl, DeltaVersions::Wait, stop).await
}

/// Whether the OpenLineage relay waits for each event's Delta table version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaVersions {
    /// Map an event only once the Delta relay has linked its commits, naming their versions.
    Wait,
    /// Map at once, with no Delta version (a ledger without a Delta sink).
    None,
}

/// [`run_openlineage_relay`], choosing whether to wait for Delta versions.
pub async fn run_openlineage_relay_with(
    store: EventStore,
    ctx: MappingContext,
    jsonl: Option<PathBuf>,
    delta: DeltaVersions,
    stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    retry_until_stopped("openlineage", stop.clone(), || {
        follow(
            store.clone(),
            ctx.clone(),
            jsonl.clone(),
            delta,
            stop.clone(),
        )
    })
    .await
}

/// How often the relay looks for the Delta commit of the events it holds.
const DELTA_POLL: std::time::Duration = std::time::Duration::from_millis(50);

async fn follow(
    store: EventStore,
    ctx: MappingContext,
    jsonl: Option<PathBuf>,
    delta: DeltaVersions,
    mut stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let mut subscription = store.subscribe_named(OPENLINEAGE_CURSOR).await?;
    let committed = store.committed_seq();
    // Read from the ledger, not yet mapped: waiting for their Delta commit, or for the rest
    // of a scoring batch that the last read cut.
    let mut pending: Vec<Arc<RecordedEvent>> = Vec::new();
    // `pending` ends at the end of an append (the ledger's head when read).
    let mut whole_at_end = false;
    // The records `pending` makes, kept while it is unchanged: each look for its Delta
    // commits would otherwise read every decision's batch id again.
    let mut ranged: Option<((u64, usize, bool), Records)> = None;
    loop {
        if pending.is_empty() {
            pending = tokio::select! {
                batch = subscription.next_batch(BATCH) => batch?,
                _ = stop.changed() => return Ok(()),
            };
            whole_at_end = false;
        }
        let (Some(first), Some(last)) = (pending.first(), pending.last()) else {
            continue;
        };
        let (first, last) = (first.seq, last.seq);
        let commits = match delta {
            DeltaVersions::Wait => {
                crate::delta_relay::both_tables_covering(&store, first, last).await?
            }
            DeltaVersions::None => Vec::new(),
        };
        let version_in = |table: &str, seq: u64| {
            commits
                .iter()
                .find(|c| c.table == table && c.first_seq <= seq && seq <= c.last_seq)
                .map(|c| c.version)
        };
        let version_of = |seq: u64| version_in(crate::delta::TABLE_NAME, seq);
        let decisions_version_of = |seq: u64| version_in(DECISIONS_TABLE, seq);
        // The Delta relay links a batch's `clearing_decisions` commit before its `events`
        // commit, so a decision whose events commit is linked has its decisions version
        // too, unless the relay stopped between the two (a crash) or writes no decisions
        // table. Its cursor, saved once it is done with a batch, tells those apart; read
        // only then.
        let is_decision = |e: &RecordedEvent| e.event_type == CLEARING_DECIDED;
        let linked_through = match delta {
            DeltaVersions::Wait
                if pending.iter().any(|e| {
                    is_decision(e)
                        && version_of(e.seq).is_some()
                        && decisions_version_of(e.seq).is_none()
                }) =>
            {
                store
                    .load_position(crate::delta_relay::DELTA_CURSOR)
                    .await?
                    .unwrap_or(0)
            }
            _ => 0,
        };
        let ready = match delta {
            DeltaVersions::Wait => pending
                .iter()
                .take_while(|e| {
                    version_of(e.seq).is_some()
                        && (!is_decision(e)
                            || decisions_version_of(e.seq).is_some()
                            || e.seq <= linked_through)
                })
                .count(),
            DeltaVersions::None => pending.len(),
        };
        let key = (first, pending.len(), whole_at_end);
        if ranged.as_ref().map(|(k, _)| *k) != Some(key) {
            ranged = Some((key, records(&pending, whole_at_end)));
        }
        let Some((_, records)) = &ranged else {
            continue;
        };
        let (whole, count) = whole_prefix(records, ready);
        if whole == 0 {
            if ready == pending.len() {
                // A scoring batch runs to the end of what was read: read on (never
                // waiting; nothing more means the head, which ends an append).
                let more = subscription.next_batch_now(BATCH).await?;
                whole_at_end = more.is_empty();
                pending.extend(more);
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep(DELTA_POLL) => continue,
                _ = stop.changed() => return Ok(()),
            }
        }
        let rows = map(
            &pending,
            &records.ranges[..count],
            &ctx,
            version_of,
            decisions_version_of,
        )?;
        let batch: Vec<Arc<RecordedEvent>> = pending.drain(..whole).collect();
        insert(&store, &rows, Utc::now()).await?;
        if let Some(path) = &jsonl {
            append_lines(path, &rows).await?;
        }
        if let Some(last) = batch.last() {
            subscription.save_position(last.seq).await?;
            let head = *committed.borrow();
            metrics::gauge!("aether_lineage_openlineage_lag_events")
                .set(head.saturating_sub(last.seq) as f64);
        }
        metrics::counter!("aether_lineage_openlineage_records_total").increment(rows.len() as u64);
    }
}

/// The JSON-lines transport: one RunEvent per line, flushed to disk before the cursor moves.
async fn append_lines(path: &PathBuf, rows: &[Mapped]) -> Result<(), RelayError> {
    let err = |source| RelayError::File {
        path: path.display().to_string(),
        source,
    };
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await
        .map_err(err)?;
    let mut buf = String::new();
    for r in rows {
        buf.push_str(&r.json);
        buf.push('\n');
    }
    file.write_all(buf.as_bytes()).await.map_err(err)?;
    file.sync_data().await.map_err(err)
}

/// The lineage records of one event, if written: its own, or its scoring batch's.
pub async fn record(store: &EventStore, seq: u64) -> Result<Option<LineageRecord>, RelayError> {
    let asked = seq;
    let seq = seq as i64;
    // The record with the greatest first seq at or before `seq`; it covers `seq` if its
    // range reaches it (records written before batches were kept whole have no last seq).
    let row = if let Some(pool) = store.postgres_pool() {
        sqlx::query(
            "SELECT seq, COALESCE(last_seq, seq) AS last_seq, event_id, run_id, job, \
                    openlineage_event, openlineage_at::text AS at \
             FROM lineage_records WHERE seq <= $1 ORDER BY seq DESC LIMIT 1",
        )
        .bind(seq)
        .fetch_optional(pool)
        .await?
        .map(|r| decode(&r, r.try_get::<String, _>("at")))
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query(
            "SELECT seq, COALESCE(last_seq, seq) AS last_seq, event_id, run_id, job, \
                    openlineage_event, openlineage_at \
             FROM lineage_records WHERE seq <= ? ORDER BY seq DESC LIMIT 1",
        )
        .bind(seq)
        .fetch_optional(pool)
        .await?
        .map(|r| {
            let at = r.try_get::<i64, _>("openlineage_at").map(|m| {
                DateTime::from_timestamp_micros(m)
                    .map(|t| aether_ledger::hashing::format_timestamp(&t))
                    .unwrap_or_default()
            });
            decode(&r, at)
        })
    } else {
        None
    };
    let Some(mut record) = row.transpose()?.filter(|r| r.last_seq >= asked) else {
        return Ok(None);
    };
    // The version that holds every event of the record, as its run event names.
    if let Some(commit) = crate::delta_relay::commit_of(store, record.last_seq).await? {
        record.delta_table = Some(commit.table);
        record.delta_version = Some(commit.version);
    }
    Ok(Some(record))
}

fn decode<R>(r: &R, at: Result<String, sqlx::Error>) -> Result<LineageRecord, sqlx::Error>
where
    R: Row,
    for<'a> &'a str: sqlx::ColumnIndex<R>,
    for<'a> i64: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> String: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
    for<'a> Uuid: sqlx::Decode<'a, R::Database> + sqlx::Type<R::Database>,
{
    let json: String = r.try_get("openlineage_event")?;
    Ok(LineageRecord {
        seq: r.try_get::<i64, _>("seq")? as u64,
        last_seq: r.try_get::<i64, _>("last_seq")? as u64,
        event_id: r.try_get("event_id")?,
        run_id: r.try_get("run_id")?,
        job: r.try_get("job")?,
        openlineage_at: at?,
        delta_table: None,
        delta_version: None,
        openlineage_event: serde_json::from_str(&json).unwrap_or(serde_json::Value::Null),
    })
}

/// What `aether lineage reconcile` reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Reconciliation {
    pub events: u64,
    /// Seqs with no OpenLineage record.
    pub missing_openlineage: Vec<u64>,
    /// Seqs with no Delta table version.
    pub missing_delta: Vec<u64>,
    /// Seqs the `OPENLINEAGE_URL` endpoint rejected (400, 413, 422) and has not accepted
    /// since: skipped by the HTTP transport, so listed here rather than lost.
    pub rejected_by_endpoint: Vec<u64>,
}

/// Compares the ledger's seqs `1..=head` with the OpenLineage records and the Delta
/// commits, and lists the events the OpenLineage HTTP endpoint rejected.
pub async fn reconcile(store: &EventStore) -> Result<Reconciliation, RelayError> {
    let head = store.head().await?.map_or(0, |(s, _)| s);
    const RANGES: &str = "SELECT seq, COALESCE(last_seq, seq) FROM lineage_records ORDER BY seq";
    let ranges: Vec<(i64, i64)> = if let Some(pool) = store.postgres_pool() {
        sqlx::query_as(RANGES).fetch_all(pool).await?
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query_as(RANGES).fetch_all(pool).await?
    } else {
        Vec::new()
    };
    let mut report = Reconciliation {
        events: head,
        missing_openlineage: missing(head, ranges.into_iter().map(|(f, l)| (f as u64, l as u64))),
        ..Reconciliation::default()
    };
    let commits = crate::delta_relay::commits(store).await?;
    report.missing_delta = missing(
        head,
        commits
            .iter()
            .filter(|c| c.table == crate::delta::TABLE_NAME)
            .map(|c| (c.first_seq, c.last_seq)),
    );
    report.rejected_by_endpoint = crate::http_transport::rejections(store)
        .await?
        .iter()
        .map(|r| r.seq)
        .collect();
    Ok(report)
}

/// The seqs in `1..=head` covered by none of `ranges` (inclusive, sorted by start).
fn missing(head: u64, ranges: impl Iterator<Item = (u64, u64)>) -> Vec<u64> {
    let mut out = Vec::new();
    let mut next = 1;
    for (first, last) in ranges {
        out.extend(next..first.min(head + 1));
        next = next.max(last.saturating_add(1));
    }
    out.extend(next..=head);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, event_type: &str, batch: Option<&str>) -> Arc<RecordedEvent> {
        let payload = match batch {
            Some(b) => format!("{{\"batch_id\":\"{b}\",\"trade\":{{\"amount\":1}}}}"),
            None => "{}".to_owned(),
        };
        Arc::new(RecordedEvent {
            seq,
            stream_id: "s".into(),
            stream_version: seq,
            event_id: Uuid::from_u128(seq.into()),
            event_type: event_type.into(),
            schema_version: 1,
            payload: serde_json::value::RawValue::from_string(payload).expect("json"),
            metadata: serde_json::value::RawValue::from_string("{}".into()).expect("json"),
            recorded_at: DateTime::from_timestamp(1_800_000_000, 0).expect("a time"),
            prev_hash: [0; 32],
            hash: [0; 32],
        })
    }

    #[test]
    fn a_batch_id_is_read_from_any_layout_of_the_payload() {
        let with = |payload: &str| {
            let mut e = (*event(1, CLEARING_DECIDED, None)).clone();
            e.payload = serde_json::value::RawValue::from_string(payload.into()).expect("json");
            crate::run_event::batch_of(&e)
        };
        let b = |s: &str| Some(s.to_owned());
        assert_eq!(with(r#"{"batch_id":"b-1","score":1}"#), b("b-1"));
        // Not first (not canonical), escaped, or not a string: the full parse decides.
        assert_eq!(with(r#"{"amount":1,"batch_id":"b-2"}"#), b("b-2"));
        assert_eq!(with(r#"{"batch_id":"b\"3","x":1}"#), b("b\"3"));
        assert_eq!(with(r#"{"batch_id":"","x":1}"#), None);
        assert_eq!(with(r#"{"batch_id":7}"#), b("7"));
        assert_eq!(with(r#"{"x":1}"#), None);
        let mut policy = (*event(1, "PolicyIngested", None)).clone();
        policy.payload =
            serde_json::value::RawValue::from_string(r#"{"batch_id":"b"}"#.into()).expect("json");
        assert_eq!(
            crate::run_event::batch_of(&policy),
            None,
            "only batch events"
        );
    }

    #[test]
    fn a_batch_is_one_record_and_one_cut_off_at_the_end_waits() {
        let events = vec![
            event(1, "PolicyIngested", None),
            event(2, NETTING_COMPUTED, Some("a")),
            event(3, CLEARING_DECIDED, Some("a")),
            event(4, CLEARING_DECIDED, Some("a")),
            // Another batch's decision right after: a record of its own.
            event(5, CLEARING_DECIDED, Some("b")),
            event(6, NETTING_COMPUTED, Some("c")),
            event(7, CLEARING_DECIDED, Some("c")),
        ];
        let open = records(&events, false);
        assert_eq!(open.ranges, [0..1, 1..4, 4..5, 5..7]);
        assert!(open.open, "batch c may go on past what was read");
        // Everything ready: all but the open batch.
        assert_eq!(whole_prefix(&open, 7), (5, 3));
        // Only seqs 1..=3 ready (Delta lags): the batch a is not whole yet.
        assert_eq!(whole_prefix(&open, 3), (1, 1));
        assert_eq!(whole_prefix(&open, 0), (0, 0));
        // At the end of an append, batch c is whole.
        let whole = records(&events, true);
        assert!(!whole.open);
        assert_eq!(whole_prefix(&whole, 7), (7, 4));
        // A netting that ends what was read may still get decisions.
        let netting_last = records(&events[..6], false);
        assert!(netting_last.open);
        assert_eq!(whole_prefix(&netting_last, 6), (5, 3));
        // A decision ending it does not open anything.
        assert!(!records(&events[..5], false).open);
        // A netting that names no batch is a record of its own, never open.
        let unnamed = [
            event(1, NETTING_COMPUTED, None),
            event(2, CLEARING_DECIDED, None),
        ];
        let alone = records(&unnamed, false);
        assert_eq!(alone.ranges, [0..1, 1..2]);
        assert!(!records(&unnamed[..1], false).open);
    }

    #[test]
    fn a_binary_page_is_laid_out_as_postgres_reads_copy() {
        let row = Mapped {
            seq: 258,
            last_seq: 260,
            event_id: Uuid::from_bytes([1; 16]),
            run_id: Uuid::from_bytes([2; 16]),
            job: "ledger.x",
            json: "{\"a\":1}".to_owned(),
        };
        // PostgreSQL's epoch plus one second.
        let now = DateTime::from_timestamp(946_684_801, 0).expect("a valid time");
        let page = binary_page(&[row], now).expect("encodes");

        let mut want = b"PGCOPY\n\xff\r\n\0".to_vec();
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]); // flags, header extension
        want.extend_from_slice(&[0, 7]); // seven fields
        want.extend_from_slice(&[0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 1, 2]); // seq 258
        want.extend_from_slice(&[0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 1, 4]); // last seq 260
        want.extend_from_slice(&[0, 0, 0, 16]);
        want.extend_from_slice(&[1; 16]);
        want.extend_from_slice(&[0, 0, 0, 16]);
        want.extend_from_slice(&[2; 16]);
        want.extend_from_slice(&[0, 0, 0, 8]);
        want.extend_from_slice(b"ledger.x");
        want.extend_from_slice(&[0, 0, 0, 7]);
        want.extend_from_slice(b"{\"a\":1}");
        want.extend_from_slice(&[0, 0, 0, 8]);
        want.extend_from_slice(&1_000_000i64.to_be_bytes()); // µs after 2000-01-01
        want.extend_from_slice(&[0xff, 0xff]); // end of data
        assert_eq!(page, want);
    }
}

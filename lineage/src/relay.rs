//! The lineage relay: follows the ledger from its stored cursor and writes each event's
//! OpenLineage record into `lineage_records` (and, when configured, a JSON-lines file).
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

use crate::decisions::{CLEARING_DECIDED, DECISIONS_TABLE};
pub use crate::error::RelayError;
use crate::retry::retry_until_stopped;
use crate::{MappingContext, job_name};

/// Name of the relay's cursor in the ledger's subscription positions.
pub const OPENLINEAGE_CURSOR: &str = "lineage-openlineage";
/// Events mapped per database transaction.
const BATCH: usize = 500;

/// One event's lineage records.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LineageRecord {
    pub seq: u64,
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
    event_id: Uuid,
    run_id: Uuid,
    job: &'static str,
    json: String,
}

/// Maps `events`, each with the Delta `events` table version `delta_version(seq)` names
/// and (decisions) the `clearing_decisions` version `decisions_version(seq)` names.
fn map(
    events: &[Arc<RecordedEvent>],
    ctx: &MappingContext,
    delta_version: impl Fn(u64) -> Option<i64>,
    decisions_version: impl Fn(u64) -> Option<i64>,
) -> Result<Vec<Mapped>, RelayError> {
    let mut ctx = ctx.clone();
    let base = crate::run_event::schema_base_url(&ctx.schema_base_url)?;
    // Sized up front: collecting through `Result` gives no size hint, and a page of
    // hundreds of rows grew (and was copied) many times over.
    let mut rows = Vec::with_capacity(events.len());
    for e in events {
        ctx.delta_version = delta_version(e.seq);
        ctx.clearing_decisions_version = decisions_version(e.seq);
        let run_event = crate::run_event::to_run_event_under(e, &ctx, &base)?;
        let run_id = run_event.run.run_id;
        // Straight to text, members in the types' field order: through a sorted
        // `Value` tree, this was a third of the relay's work per event.
        let json = serde_json::to_string(&run_event)?;
        rows.push(Mapped {
            seq: e.seq as i64,
            event_id: e.event_id,
            run_id,
            job: job_name(&e.event_type),
            json,
        });
    }
    Ok(rows)
}

/// Rows per INSERT statement on SQLite: one statement per chunk rather than per event (6
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
        let event_id: Vec<Uuid> = rows.iter().map(|r| r.event_id).collect();
        let run_id: Vec<Uuid> = rows.iter().map(|r| r.run_id).collect();
        let job: Vec<&str> = rows.iter().map(|r| r.job).collect();
        let json: Vec<&str> = rows.iter().map(|r| r.json.as_str()).collect();
        sqlx::query(
            "INSERT INTO lineage_records \
                 (seq, event_id, run_id, job, openlineage_event, openlineage_at) \
             SELECT seq, event_id, run_id, job, openlineage_event, $6 \
             FROM UNNEST($1::bigint[], $2::uuid[], $3::uuid[], $4::text[], $5::text[]) \
                 AS r(seq, event_id, run_id, job, openlineage_event) \
             ON CONFLICT (seq) DO NOTHING",
        )
        .bind(&seq)
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
                            (seq, event_id, run_id, job, openlineage_event, openlineage_at) ";
        const TAIL: &str = " ON CONFLICT (seq) DO NOTHING";
        let mut tx = pool.begin().await?;
        for chunk in rows.chunks(ROWS_PER_STATEMENT) {
            let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new(HEAD);
            q.push_values(chunk, |mut b, r| {
                b.push_bind(r.seq)
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
     (seq, event_id, run_id, job, openlineage_event, openlineage_at) FROM STDIN (FORMAT binary)";

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
    let mut data = BinaryRows::new(6, rows.len() * 80 + text_bytes);
    for r in rows {
        data.row()
            .int8(r.seq)
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
    // Read from the ledger, not yet mapped: waiting for their Delta commit.
    let mut pending: Vec<Arc<RecordedEvent>> = Vec::new();
    loop {
        if pending.is_empty() {
            pending = tokio::select! {
                batch = subscription.next_batch(BATCH) => batch?,
                _ = stop.changed() => return Ok(()),
            };
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
        if ready == 0 {
            tokio::select! {
                _ = tokio::time::sleep(DELTA_POLL) => continue,
                _ = stop.changed() => return Ok(()),
            }
        }
        let batch: Vec<Arc<RecordedEvent>> = pending.drain(..ready).collect();
        let rows = map(&batch, &ctx, version_of, decisions_version_of)?;
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

/// The lineage records of one event, if written.
pub async fn record(store: &EventStore, seq: u64) -> Result<Option<LineageRecord>, RelayError> {
    let seq = seq as i64;
    let row = if let Some(pool) = store.postgres_pool() {
        sqlx::query(
            "SELECT seq, event_id, run_id, job, openlineage_event, openlineage_at::text AS at \
             FROM lineage_records WHERE seq = $1",
        )
        .bind(seq)
        .fetch_optional(pool)
        .await?
        .map(|r| decode(&r, r.try_get::<String, _>("at")))
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query(
            "SELECT seq, event_id, run_id, job, openlineage_event, openlineage_at \
             FROM lineage_records WHERE seq = ? ",
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
    let Some(mut record) = row.transpose()? else {
        return Ok(None);
    };
    if let Some(commit) = crate::delta_relay::commit_of(store, record.seq).await? {
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
    let seqs: Vec<i64> = if let Some(pool) = store.postgres_pool() {
        sqlx::query_scalar("SELECT seq FROM lineage_records ORDER BY seq")
            .fetch_all(pool)
            .await?
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query_scalar("SELECT seq FROM lineage_records ORDER BY seq")
            .fetch_all(pool)
            .await?
    } else {
        Vec::new()
    };
    let mut report = Reconciliation {
        events: head,
        missing_openlineage: missing(head, seqs.into_iter().map(|s| (s as u64, s as u64))),
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

    #[test]
    fn a_binary_page_is_laid_out_as_postgres_reads_copy() {
        let row = Mapped {
            seq: 258,
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
        want.extend_from_slice(&[0, 6]); // six fields
        want.extend_from_slice(&[0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 1, 2]); // seq 258
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

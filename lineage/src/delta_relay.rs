//! The Delta relay: follows the ledger into the `events` Delta table, many events per
//! commit, and links each commit's seq range to its table version in `delta_commits`.
//!
//! Exactly once into Delta: the table's application transaction (app id
//! [`APP_ID`](crate::delta::APP_ID), version = last seq written) is the relay's cursor, so
//! after a crash it resumes at the first seq the table does not hold and can never write an
//! event twice. The `delta_commits` row is written after the Delta commit; a crash in
//! between is repaired on the next start from the commit metadata in the Delta log. The
//! relay reads the ledger through a subscription, so a slow or failing Delta sink delays
//! only itself; its lag is a metric.

use std::path::PathBuf;
use std::time::Duration;
use tracing::Instrument as _;

use aether_ledger::EventStore;
use chrono::{DateTime, Utc};
use deltalake::DeltaTable;
use serde::Serialize;
use tokio::sync::watch;

use crate::decisions::{CLEARING_DECIDED, DECISIONS_TABLE, DecisionsSink};
use crate::delta::{
    DeltaSink, META_FIRST_SEQ, META_LAST_HASH, META_LAST_SEQ, StorageOptions, TABLE_NAME,
};
use crate::error::RelayError;
use crate::retry::retry_until_stopped;

/// Where the relay's progress is stored for `aether serve`'s drain at shutdown (the Delta
/// table itself is the cursor the relay resumes from).
pub const DELTA_CURSOR: &str = "lineage-delta";

/// How the Delta relay batches events into commits.
#[derive(Clone, Debug)]
pub struct DeltaRelayConfig {
    /// Directory of the `events` table (created on first start).
    pub location: PathBuf,
    /// Directory of the `clearing_decisions` table; `None`: not written.
    pub decisions: Option<PathBuf>,
    /// A commit is made once this many events are waiting ...
    pub max_events: usize,
    /// ... or once the oldest waiting event has waited this long.
    pub max_wait: Duration,
    /// The object store's settings beyond the environment's (empty: local tables, or
    /// `AWS_*` variables only).
    pub storage_options: StorageOptions,
}

impl DeltaRelayConfig {
    /// Defaults: commits of up to 10,000 events, at most 1 s apart while events arrive;
    /// the decisions table beside the events table.
    pub fn new(location: impl Into<PathBuf>) -> Self {
        let location: PathBuf = location.into();
        DeltaRelayConfig {
            decisions: location.parent().map(|p| p.join(DECISIONS_TABLE)),
            location,
            max_events: 10_000,
            max_wait: Duration::from_secs(1),
            storage_options: StorageOptions::new(),
        }
    }
}

/// One Delta commit of the relay: the table version and the seqs it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeltaCommit {
    pub table: String,
    pub version: i64,
    pub first_seq: u64,
    pub last_seq: u64,
    pub last_hash: String,
}

/// How long an idle relay waits before it looks for a finished merge to commit.
const IDLE_MERGE_CHECK: Duration = Duration::from_millis(500);

/// Follows the ledger until `stop` turns true, writing events to the Delta table. Failures
/// are logged and retried with backoff from the table's own cursor: delayed, never dropped.
pub async fn run_delta_relay(
    store: EventStore,
    config: DeltaRelayConfig,
    stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    retry_until_stopped("delta", stop.clone(), || {
        let store = store.clone();
        let attempt = follow(store.clone(), config.clone(), stop.clone());
        async move {
            let result = attempt.await;
            if result.is_err() {
                report_lag(&store).await;
            }
            result
        }
    })
    .await
}

/// The lag as it stands after a failed attempt: a relay that cannot write (its volume
/// full, its store away) must show its lag growing, not the figure of its last success.
async fn report_lag(store: &EventStore) {
    let head = *store.committed_seq().borrow();
    if let Ok(at) = store.load_position(DELTA_CURSOR).await {
        metrics::gauge!("aether_lineage_delta_lag_events")
            .set(head.saturating_sub(at.unwrap_or(0)) as f64);
    }
}

async fn follow(
    store: EventStore,
    config: DeltaRelayConfig,
    mut stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let mut sink =
        DeltaSink::open_or_create_with(&config.location, &config.storage_options).await?;
    let mut decisions = match &config.decisions {
        Some(path) => {
            Some(DecisionsSink::open_or_create_with(path, &config.storage_options).await?)
        }
        None => None,
    };
    let mut repaired = link_unrecorded_commits(&store, &sink).await?;
    if let Some(d) = &decisions {
        repaired += link_unrecorded(&store, DECISIONS_TABLE, d.table()).await?;
    }
    if repaired > 0 {
        tracing::warn!(
            commits = repaired,
            "linked Delta commits whose link was lost in a crash"
        );
    }
    // Resume at the first seq some table still lacks. The decisions table's transaction
    // only moves when a batch holds decisions, so the saved cursor (written after both
    // tables took a batch) bounds how far back that is.
    let saved = store.load_position(DELTA_CURSOR).await?.unwrap_or(0);
    let resume = match &decisions {
        Some(d) => sink.last_seq().min(d.last_seq().max(saved)),
        None => sink.last_seq(),
    };
    let mut subscription = store.subscribe(resume + 1);
    let mut committed = store.committed_seq();
    let max_events = config.max_events.max(1);
    'relay: loop {
        let merging =
            sink.merge_in_flight() || decisions.as_ref().is_some_and(|d| d.merge_in_flight());
        let mut batch = tokio::select! {
            // Cancel-safe: a page read but not returned is read again.
            batch = subscription.next_batch(max_events) => batch?,
            _ = stop.changed() => break 'relay,
            // No events for a while: commit a finished merge rather than leave it for the
            // next append (a crash meanwhile would leave its file unnamed by any commit).
            _ = tokio::time::sleep(IDLE_MERGE_CHECK), if merging => {
                sink.commit_finished_merge().await;
                if let Some(d) = decisions.as_mut() {
                    d.commit_finished_merge().await;
                }
                continue 'relay;
            }
        };
        // Gather more until the commit is full or the first event has waited long enough;
        // a stop request commits what was gathered first. The ledger is read when a
        // commit's worth is there or at the deadline, not after every group commit (that
        // was hundreds of small reads a second under load).
        let deadline = tokio::time::Instant::now() + config.max_wait;
        let mut stopping = false;
        while batch.len() < max_events {
            let wanted = max_events - batch.len();
            let unread = usize::try_from(
                committed
                    .borrow_and_update()
                    .saturating_sub(subscription.next_seq().saturating_sub(1)),
            )
            .unwrap_or(usize::MAX);
            if unread >= wanted {
                batch.extend(subscription.next_batch(wanted).await?);
                continue;
            }
            tokio::select! {
                changed = committed.changed() => {
                    // The writer is gone (the store is shutting down): commit what is here.
                    if changed.is_err() {
                        break;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    // Everything this process committed meanwhile, page by page (taking
                    // one page here held a relay that was behind by less than a commit's
                    // worth to ~1,000 events a commit); another process's events come
                    // with the next commit.
                    let mut left = unread;
                    while left > 0 {
                        let page = subscription.next_batch(left).await?;
                        left = left.saturating_sub(page.len());
                        batch.extend(page);
                    }
                    break;
                }
                _ = stop.changed() => { stopping = true; break; }
            }
        }
        let Some(last) = batch.last() else {
            if stopping {
                break 'relay;
            }
            continue;
        };
        let last_hash = aether_ledger::hashing::to_hex(&last.hash);
        let before = sink.last_seq();
        // A span per commit when traces are exported (`lineage.delta.commit`).
        let commit_span = tracing::debug_span!(
            "lineage.delta.commit",
            db.system.name = "delta",
            aether.first_seq = batch.first().map_or(0, |e| e.seq),
            aether.last_seq = last.seq,
            aether.events = batch.len(),
        );
        // The batch may start below a table's cursor (a resume); each commit holds only
        // what its table lacked.
        let events_commit = off_worker(sink.append(&batch))
            .instrument(commit_span.clone())
            .await?
            .map(|version| DeltaCommit {
                table: TABLE_NAME.to_owned(),
                version,
                first_seq: before + 1,
                last_seq: last.seq,
                last_hash: last_hash.clone(),
            });
        let mut decisions_commit = None;
        if let Some(d) = decisions.as_mut() {
            let before = d.last_seq();
            if let Some(version) = off_worker(d.append(&batch))
                .instrument(commit_span.clone())
                .await?
                && let Some(first) = batch
                    .iter()
                    .find(|e| e.seq > before && e.event_type == CLEARING_DECIDED)
            {
                decisions_commit = Some(DeltaCommit {
                    table: DECISIONS_TABLE.to_owned(),
                    version,
                    first_seq: first.seq,
                    last_seq: last.seq,
                    last_hash,
                });
            }
        }
        // Linked once both tables hold the batch, the decisions commit first: the
        // OpenLineage relay takes a linked events commit to mean the batch's decisions are
        // linked too, and the cursor below settles a stop between the two.
        if let Some(commit) = &decisions_commit {
            insert_commit(&store, commit, Utc::now()).await?;
            metrics::counter!("aether_lineage_delta_decision_commits_total").increment(1);
        }
        if let Some(commit) = &events_commit {
            insert_commit(&store, commit, Utc::now()).await?;
            metrics::counter!("aether_lineage_delta_commits_total").increment(1);
            metrics::counter!("aether_lineage_delta_events_total").increment(batch.len() as u64);
        }
        store.save_position(DELTA_CURSOR, last.seq).await?;
        let head = *committed.borrow();
        metrics::gauge!("aether_lineage_delta_lag_events")
            .set(head.saturating_sub(last.seq) as f64);
        if stopping {
            break 'relay;
        }
    }
    // A stop leaves no merge half done: its file committed, not orphaned on disk.
    sink.finish_compaction().await;
    if let Some(d) = decisions.as_mut() {
        d.finish_compaction().await;
    }
    Ok(())
}

/// Runs a Delta write (Arrow batches and Parquet encoding, tens of milliseconds for a
/// commit of thousands of events) with the runtime worker's other tasks handed to another
/// thread meanwhile, so that requests are not held up behind it (seen as a 300–500 ms p99.9
/// in the clearing bench). On a single-threaded runtime it simply runs.
async fn off_worker<F: std::future::Future>(write: F) -> F::Output {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| handle.block_on(write))
        }
        _ => write.await,
    }
}

/// Writes the `delta_commits` rows missing for commits already in the Delta log (a crash
/// between the Delta commit and its row), read back from each commit's metadata. Returns
/// how many were written.
pub async fn link_unrecorded_commits(
    store: &EventStore,
    sink: &DeltaSink,
) -> Result<usize, RelayError> {
    link_unrecorded(store, TABLE_NAME, sink.table()).await
}

/// [`link_unrecorded_commits`] for the commits of `table`, named `name` in `delta_commits`.
async fn link_unrecorded(
    store: &EventStore,
    name: &str,
    table: &DeltaTable,
) -> Result<usize, RelayError> {
    let recorded = commits(store)
        .await?
        .iter()
        .filter(|c| c.table == name)
        .map(|c| c.version)
        .max()
        .unwrap_or(-1);
    let head = table
        .version()
        .map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX));
    // The relay links each commit right after making it, so the unlinked ones are the
    // newest: walk back from the head to the newest linked one. A decisions commit made
    // before decisions commits named their last hash ends the walk too: it and every
    // older one stay unlinked, and are not read again on every start.
    let mut unlinked = Vec::new();
    for version in ((recorded + 1).max(0)..=head).rev() {
        let Some(meta) = crate::delta::commit_info(table, version).await? else {
            continue;
        };
        let first = meta.get(META_FIRST_SEQ).and_then(|v| v.as_u64());
        let last = meta.get(META_LAST_SEQ).and_then(|v| v.as_u64());
        let hash = meta.get(META_LAST_HASH).and_then(|v| v.as_str());
        match (first, last, hash) {
            (Some(first_seq), Some(last_seq), Some(hash)) => unlinked.push(DeltaCommit {
                table: name.to_owned(),
                version,
                first_seq,
                last_seq,
                last_hash: hash.to_owned(),
            }),
            (Some(_), Some(_), None) => break,
            // No seq range: the table's creation or a schema change, holding no rows.
            _ => {}
        }
    }
    let written = unlinked.len();
    for commit in unlinked.iter().rev() {
        insert_commit(store, commit, Utc::now()).await?;
    }
    Ok(written)
}

async fn insert_commit(
    store: &EventStore,
    c: &DeltaCommit,
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    let (first, last) = (c.first_seq as i64, c.last_seq as i64);
    if let Some(pool) = store.postgres_pool() {
        sqlx::query(
            "INSERT INTO delta_commits (delta_table, version, first_seq, last_seq, last_hash, committed_at) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
        )
        .bind(&c.table)
        .bind(c.version)
        .bind(first)
        .bind(last)
        .bind(&c.last_hash)
        .bind(now)
        .execute(pool)
        .await?;
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query(
            "INSERT INTO delta_commits (delta_table, version, first_seq, last_seq, last_hash, committed_at) \
             VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        )
        .bind(&c.table)
        .bind(c.version)
        .bind(first)
        .bind(last)
        .bind(&c.last_hash)
        .bind(now.timestamp_micros())
        .execute(pool)
        .await?;
    }
    Ok(())
}

type CommitRow = (String, i64, i64, i64, String);

/// Every recorded Delta commit, by table version.
pub async fn commits(store: &EventStore) -> Result<Vec<DeltaCommit>, sqlx::Error> {
    const SQL: &str = "SELECT delta_table, version, first_seq, last_seq, last_hash \
                       FROM delta_commits ORDER BY delta_table, version";
    let rows: Vec<CommitRow> = if let Some(pool) = store.postgres_pool() {
        sqlx::query_as(SQL).fetch_all(pool).await?
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query_as(SQL).fetch_all(pool).await?
    } else {
        Vec::new()
    };
    Ok(rows.into_iter().map(to_commit).collect())
}

/// The Delta commit holding `seq`, if it has been written.
pub async fn commit_of(store: &EventStore, seq: u64) -> Result<Option<DeltaCommit>, sqlx::Error> {
    Ok(commits_covering(store, seq, seq).await?.into_iter().next())
}

/// The `events` table's commits holding any seq in `first..=last`, by seq.
pub async fn commits_covering(
    store: &EventStore,
    first: u64,
    last: u64,
) -> Result<Vec<DeltaCommit>, sqlx::Error> {
    table_commits_covering(store, TABLE_NAME, first, last).await
}

/// The commits of the table named `table` in `delta_commits` (`events` or
/// `clearing_decisions`) whose seq range meets `first..=last`, by seq.
pub async fn table_commits_covering(
    store: &EventStore,
    table: &str,
    first: u64,
    last: u64,
) -> Result<Vec<DeltaCommit>, sqlx::Error> {
    covering(store, [table, table], first, last).await
}

/// The commits of both tables whose seq range meets `first..=last`, by seq: what the
/// OpenLineage relay names, in one query per page.
pub async fn both_tables_covering(
    store: &EventStore,
    first: u64,
    last: u64,
) -> Result<Vec<DeltaCommit>, sqlx::Error> {
    covering(store, [TABLE_NAME, DECISIONS_TABLE], first, last).await
}

async fn covering(
    store: &EventStore,
    tables: [&str; 2],
    first: u64,
    last: u64,
) -> Result<Vec<DeltaCommit>, sqlx::Error> {
    const SQL: &str = "SELECT delta_table, version, first_seq, last_seq, last_hash \
                       FROM delta_commits WHERE delta_table IN ($1, $2) AND last_seq >= $3 \
                       AND first_seq <= $4 ORDER BY first_seq";
    let (first, last) = (first as i64, last as i64);
    let rows: Vec<CommitRow> = either_pool!(store, |pool, _time, _postgres| {
        sqlx::query_as(SQL)
            .bind(tables[0])
            .bind(tables[1])
            .bind(first)
            .bind(last)
            .fetch_all(pool)
            .await?
    });
    Ok(rows.into_iter().map(to_commit).collect())
}

fn to_commit((table, version, first, last, last_hash): CommitRow) -> DeltaCommit {
    DeltaCommit {
        table,
        version,
        first_seq: first as u64,
        last_seq: last as u64,
        last_hash,
    }
}

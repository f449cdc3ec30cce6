//! The group-commit writer: the only task that inserts events. It gathers concurrent
//! appends into one transaction (bounded by `max_batch` events and `max_wait`), computes
//! the chain inside it, and answers each caller only after the commit.

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use crate::error::LedgerError;
use std::collections::HashMap;

use crate::event::ledger_now;
use crate::store::Db;
use crate::store::plan::{Head, RequestOutcome, StreamAppend, plan_batch, streams_of};

pub(crate) enum WriterMsg {
    Append {
        appends: Vec<StreamAppend>,
        reply: oneshot::Sender<RequestOutcome>,
        enqueued: Instant,
    },
    /// Commit everything received before this message, then stop.
    Shutdown { ack: oneshot::Sender<()> },
}

/// Scheduler turns without a new append after which the writer stops gathering.
const IDLE_TURNS: u32 = 3;

/// Waits for one more append while appenders that are ready to run still submit: gives up
/// after a few idle scheduler turns or at `deadline`. (Tokio's timers tick in milliseconds,
/// too coarse for a group-commit wait.)
async fn gather_more(rx: &mut mpsc::Receiver<WriterMsg>, deadline: Instant) -> Option<WriterMsg> {
    let mut idle = 0;
    while idle < IDLE_TURNS && Instant::now() < deadline {
        tokio::task::yield_now().await;
        match rx.try_recv() {
            Ok(m) => return Some(m),
            Err(mpsc::error::TryRecvError::Empty) => idle += 1,
            Err(mpsc::error::TryRecvError::Disconnected) => return None,
        }
    }
    None
}

struct Pending {
    appends: Vec<StreamAppend>,
    reply: oneshot::Sender<RequestOutcome>,
    enqueued: Instant,
}

impl Pending {
    fn events(&self) -> usize {
        self.appends.iter().map(|a| a.events.len()).sum()
    }
}

pub(crate) async fn run(
    db: Db,
    mut rx: mpsc::Receiver<WriterMsg>,
    committed: watch::Sender<u64>,
    max_batch: usize,
    max_wait: Duration,
) {
    let mut carry: Option<Pending> = None;
    let mut stopping: Option<oneshot::Sender<()>> = None;
    // A lone appender is never made to wait for company: the wait applies only once the
    // previous batch showed concurrent appenders.
    let mut concurrent = false;
    let mut cache = ChainCache::default();
    loop {
        let first = match carry.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(WriterMsg::Append {
                    appends,
                    reply,
                    enqueued,
                }) => Pending {
                    appends,
                    reply,
                    enqueued,
                },
                Some(WriterMsg::Shutdown { ack }) => {
                    stopping = Some(ack);
                    break;
                }
                None => break,
            },
        };
        let mut size = first.events();
        let mut batch = vec![first];
        let wait = if concurrent { max_wait } else { Duration::ZERO };
        let deadline = Instant::now() + wait;
        while size < max_batch {
            let msg = match rx.try_recv() {
                Ok(m) => Some(m),
                Err(mpsc::error::TryRecvError::Disconnected) => None,
                Err(mpsc::error::TryRecvError::Empty) if wait.is_zero() => None,
                Err(mpsc::error::TryRecvError::Empty) => gather_more(&mut rx, deadline).await,
            };
            match msg {
                Some(WriterMsg::Append {
                    appends,
                    reply,
                    enqueued,
                }) => {
                    let p = Pending {
                        appends,
                        reply,
                        enqueued,
                    };
                    if size + p.events() > max_batch {
                        carry = Some(p);
                        break;
                    }
                    size += p.events();
                    batch.push(p);
                }
                Some(WriterMsg::Shutdown { ack }) => {
                    stopping = Some(ack);
                    break;
                }
                None => break,
            }
        }
        concurrent = batch.len() > 1;
        commit(&db, &mut cache, batch, &committed).await;
        if stopping.is_some() {
            if let Some(p) = carry.take() {
                commit(&db, &mut cache, vec![p], &committed).await;
            }
            break;
        }
    }
    // Anything still queued after a shutdown request is refused, never half-done.
    rx.close();
    while let Ok(msg) = rx.try_recv() {
        if let WriterMsg::Append { reply, .. } = msg {
            let _ = reply.send(Err(LedgerError::WriterClosed));
        }
    }
    if let Some(ack) = stopping {
        let _ = ack.send(());
    }
}

/// What the writer knows of the chain: the head and recent stream versions. Single-process
/// deployments never read them back; if another process writes the same database, the
/// primary key on `seq` and the unique `(stream_id, stream_version)` refuse the stale batch,
/// the cache is dropped and the batch retried on fresh state.
#[derive(Default)]
pub(crate) struct ChainCache {
    /// `None` until read; `Some(None)` for an empty ledger.
    head: Option<Option<Head>>,
    versions: HashMap<String, u64>,
}

/// Streams remembered before the version cache is reset (bounds memory).
const MAX_CACHED_STREAMS: usize = 100_000;

impl ChainCache {
    fn invalidate(&mut self) {
        self.head = None;
        self.versions.clear();
    }
}

/// Plans and inserts one batch against the cached chain state; answers per request.
async fn write(
    db: &Db,
    cache: &mut ChainCache,
    requests: &[&[StreamAppend]],
) -> Result<Vec<RequestOutcome>, sqlx::Error> {
    let head = match cache.head {
        Some(h) => h,
        None => {
            let h = db.read_head().await?;
            cache.head = Some(h);
            h
        }
    };
    let missing: Vec<String> = streams_of(requests)
        .into_iter()
        .filter(|s| !cache.versions.contains_key(s))
        .collect();
    if !missing.is_empty() {
        let found = db.read_versions(&missing).await?;
        for stream in missing {
            let v = found.get(&stream).copied().unwrap_or(0);
            cache.versions.insert(stream, v);
        }
    }
    let mut plan = plan_batch(head, &cache.versions, requests, ledger_now());
    if !plan.conflicts.is_empty() {
        // Before refusing an expected version, make sure it is not our cache that is stale.
        let fresh = db.read_versions(&plan.conflicts).await?;
        let mut stale = false;
        for stream in &plan.conflicts {
            let v = fresh.get(stream).copied().unwrap_or(0);
            stale |= cache.versions.insert(stream.clone(), v) != Some(v);
        }
        if stale {
            plan = plan_batch(head, &cache.versions, requests, ledger_now());
        }
    }
    if !plan.rows.is_empty() {
        db.insert_rows(&plan.rows).await?;
    }
    cache.head = Some(plan.head);
    if cache.versions.len() + plan.versions.len() > MAX_CACHED_STREAMS {
        cache.versions.clear();
    }
    cache.versions.extend(plan.versions);
    Ok(plan.outcomes)
}

/// Commits one batch. If the database refuses it over a uniqueness conflict (another
/// writer moved the chain, or a caller reused an event id), the cache is dropped and each
/// request is retried alone on fresh state, so only an offender fails.
async fn commit(
    db: &Db,
    cache: &mut ChainCache,
    batch: Vec<Pending>,
    committed: &watch::Sender<u64>,
) {
    let started = Instant::now();
    let requests: Vec<&[StreamAppend]> = batch.iter().map(|p| p.appends.as_slice()).collect();
    let result = write(db, cache, &requests).await;
    metrics::histogram!("aether_ledger_commit_seconds").record(started.elapsed().as_secs_f64());
    metrics::histogram!("aether_ledger_batch_requests").record(batch.len() as f64);
    match result {
        Ok(outcomes) => answer(batch, outcomes, committed),
        Err(e) if is_unique_violation(&e) => {
            cache.invalidate();
            for p in batch {
                let outcome = write_alone(db, cache, &p.appends).await;
                answer(vec![p], vec![outcome], committed);
            }
        }
        Err(e) => {
            // The commit's fate is unknown to us: forget the chain state and reread it.
            cache.invalidate();
            tracing::error!(error = %e, requests = batch.len(), "ledger batch commit failed");
            let message = e.to_string();
            let outcomes = batch
                .iter()
                .map(|_| Err(LedgerError::CommitFailed(message.clone())))
                .collect();
            answer(batch, outcomes, committed);
        }
    }
}

/// Writes one request on its own, re-reading the chain after each uniqueness conflict: a
/// reused event id is the caller's error; anything else is another writer that got there
/// first, so it is retried a few times.
async fn write_alone(db: &Db, cache: &mut ChainCache, appends: &[StreamAppend]) -> RequestOutcome {
    const ATTEMPTS: u32 = 5;
    for _ in 0..ATTEMPTS {
        match write(db, cache, &[appends]).await {
            Ok(mut outcomes) => return outcomes.pop().unwrap_or(Err(LedgerError::WriterClosed)),
            Err(e) if is_unique_violation(&e) => {
                cache.invalidate();
                if let Some(event_id) = duplicate_id(db, appends).await {
                    return Err(LedgerError::DuplicateEventId { event_id });
                }
            }
            Err(e) => {
                cache.invalidate();
                return Err(LedgerError::CommitFailed(e.to_string()));
            }
        }
    }
    Err(LedgerError::CommitFailed(format!(
        "another writer on the same database won the race {ATTEMPTS} times; retry"
    )))
}

fn answer(batch: Vec<Pending>, outcomes: Vec<RequestOutcome>, committed: &watch::Sender<u64>) {
    let last = outcomes
        .iter()
        .filter_map(|o| o.as_ref().ok())
        .flat_map(|c| c.iter().map(|c| c.seq))
        .max();
    if let Some(last) = last {
        committed.send_if_modified(|seen| {
            let newer = last > *seen;
            if newer {
                *seen = last;
            }
            newer
        });
    }
    let mut appended = 0u64;
    for (p, outcome) in batch.into_iter().zip(outcomes) {
        if let Ok(c) = &outcome {
            appended += c.len() as u64;
        }
        metrics::histogram!("aether_ledger_append_seconds")
            .record(p.enqueued.elapsed().as_secs_f64());
        let _ = p.reply.send(outcome);
    }
    metrics::counter!("aether_ledger_events_appended_total").increment(appended);
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.is_unique_violation())
}

/// The first of the request's event ids that is already in the ledger, if any.
async fn duplicate_id(db: &Db, appends: &[StreamAppend]) -> Option<uuid::Uuid> {
    let ids: Vec<uuid::Uuid> = appends
        .iter()
        .flat_map(|a| a.events.iter().map(|ev| ev.event_id))
        .collect();
    db.existing_event_ids(&ids).await.ok()?.first().copied()
}

//! The group-commit writer: the only task that inserts events. It gathers concurrent
//! appends into one transaction (bounded by `max_batch` events and `max_wait`), computes
//! the chain for it, and answers each caller only after the commit.
//!
//! Batches are pipelined: while batch N is in the database, the writer gathers and plans
//! batch N+1 on the chain N will leave. Where the database allows
//! (`StoreConfig::pipeline_depth`, PostgreSQL), N+1 is inserted on a second connection at once,
//! but its transaction commits only after N's has; if N fails, N+1 rolls back and is
//! planned again on fresh state with everything after it. So batches commit in seq order,
//! the chain never has a gap, and a caller never hears "committed" for a batch that was
//! not.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use crate::error::LedgerError;
use crate::event::ledger_now;
use crate::store::plan::{
    EventRow, Head, Plan, RequestOutcome, StreamAppend, plan_batch, streams_of,
};
use crate::store::{Db, InsertError};
use crate::tail::Tail;

pub(crate) enum WriterMsg {
    Append {
        appends: Vec<StreamAppend>,
        reply: oneshot::Sender<RequestOutcome>,
        enqueued: Instant,
    },
    /// Commit everything received before this message, then stop.
    Shutdown { ack: oneshot::Sender<()> },
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

/// Collects appends into batches of at most `max_batch` events.
struct Gatherer {
    rx: mpsc::Receiver<WriterMsg>,
    max_batch: usize,
    max_wait: Duration,
    /// Appends taken from the channel (or handed back) but not yet batched, oldest first.
    queue: VecDeque<Pending>,
    stopping: Option<oneshot::Sender<()>>,
    closed: bool,
}

impl Gatherer {
    fn done(&self) -> bool {
        self.stopping.is_some() || self.closed
    }

    /// The next batch. Waits for a first append only if `block`; then takes whatever else
    /// is ready, waiting up to `max_wait` for more when appenders are `concurrent`.
    async fn next(&mut self, block: bool, concurrent: bool) -> Vec<Pending> {
        let first = match self.queue.pop_front() {
            Some(p) => p,
            None if self.done() => return Vec::new(),
            None => {
                let msg = if block {
                    self.rx.recv().await
                } else {
                    match self.rx.try_recv() {
                        Ok(m) => Some(m),
                        Err(mpsc::error::TryRecvError::Empty) => return Vec::new(),
                        Err(mpsc::error::TryRecvError::Disconnected) => None,
                    }
                };
                match self.accept(msg) {
                    Some(p) => p,
                    None => return Vec::new(),
                }
            }
        };
        let mut size = first.events();
        let mut batch = vec![first];
        let wait = if concurrent {
            self.max_wait
        } else {
            Duration::ZERO
        };
        let deadline = Instant::now() + wait;
        loop {
            size = self.top_up(&mut batch, size);
            // Full (or an append left queued for the next), stopping, or not to wait.
            if size >= self.max_batch || !self.queue.is_empty() || self.done() || wait.is_zero() {
                break;
            }
            match gather_more(&mut self.rx, deadline).await {
                Some(m) => {
                    let Some(p) = self.accept(Some(m)) else { break };
                    self.queue.push_back(p);
                }
                None => break,
            }
        }
        batch
    }

    /// Adds to `batch` (of `size` events), without waiting, the appends ready now, up to
    /// `max_batch` events; returns its size.
    fn top_up(&mut self, batch: &mut Vec<Pending>, mut size: usize) -> usize {
        while size < self.max_batch {
            let p = match self.queue.pop_front() {
                Some(p) => p,
                None if self.done() => break,
                None => match self.rx.try_recv() {
                    Ok(m) => match self.accept(Some(m)) {
                        Some(p) => p,
                        None => break,
                    },
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        self.closed = true;
                        break;
                    }
                },
            };
            if size + p.events() > self.max_batch {
                self.queue.push_front(p);
                break;
            }
            size += p.events();
            batch.push(p);
        }
        size
    }

    /// Waits until an append (or a shutdown) is at hand and keeps it for [`Self::next`].
    /// Cancel-safe: dropped while waiting, it has taken nothing from the channel.
    async fn wait_first(&mut self) {
        if !self.queue.is_empty() || self.done() {
            return;
        }
        let msg = self.rx.recv().await;
        let accepted = self.accept(msg);
        self.queue.extend(accepted);
    }

    /// Takes every append waiting now (queued, or in the channel without waiting), for a
    /// failure they share: while the database is unreachable, appends that queued behind a
    /// failed attempt fail with it instead of each waiting out an attempt of their own.
    fn drain_waiting(&mut self) -> Vec<Pending> {
        let mut waiting: Vec<Pending> = self.queue.drain(..).collect();
        while !self.done() {
            let msg = match self.rx.try_recv() {
                Ok(m) => Some(m),
                Err(mpsc::error::TryRecvError::Disconnected) => None,
                Err(mpsc::error::TryRecvError::Empty) => break,
            };
            match self.accept(msg) {
                Some(p) => waiting.push(p),
                None => break,
            }
        }
        waiting
    }

    /// Hands back batches that must be planned again, ahead of everything newer.
    fn requeue(&mut self, batches: impl DoubleEndedIterator<Item = Vec<Pending>>) {
        for batch in batches.rev() {
            for p in batch.into_iter().rev() {
                self.queue.push_front(p);
            }
        }
    }

    /// An append to batch; records a shutdown request or a closed channel.
    fn accept(&mut self, msg: Option<WriterMsg>) -> Option<Pending> {
        match msg {
            Some(WriterMsg::Append {
                appends,
                reply,
                enqueued,
            }) => Some(Pending {
                appends,
                reply,
                enqueued,
            }),
            Some(WriterMsg::Shutdown { ack }) => {
                self.stopping = Some(ack);
                None
            }
            None => {
                self.closed = true;
                None
            }
        }
    }
}

/// A batch whose rows are being inserted by a spawned task.
struct InFlight {
    batch: Vec<Pending>,
    /// Published to the tail once committed.
    rows: Arc<Vec<EventRow>>,
    outcomes: Vec<RequestOutcome>,
    started: Instant,
    insert: JoinHandle<Result<(), InsertError>>,
    /// The insert's result, once seen while waiting for the next batch.
    landed: Option<Result<(), InsertError>>,
}

impl InFlight {
    async fn result(
        self,
    ) -> (
        Vec<Pending>,
        Vec<RequestOutcome>,
        Arc<Vec<EventRow>>,
        Instant,
        Result<(), InsertError>,
    ) {
        let result = match self.landed {
            Some(r) => r,
            None => joined(self.insert.await),
        };
        (self.batch, self.outcomes, self.rows, self.started, result)
    }
}

fn joined(r: Result<Result<(), InsertError>, tokio::task::JoinError>) -> Result<(), InsertError> {
    r.unwrap_or_else(|e| {
        Err(InsertError::Sql(sqlx::Error::Protocol(format!(
            "ledger insert task failed: {e}"
        ))))
    })
}

pub(crate) async fn run(
    db: Db,
    rx: mpsc::Receiver<WriterMsg>,
    committed: watch::Sender<u64>,
    tail: Arc<Tail>,
    max_batch: usize,
    max_wait: Duration,
    depth: usize,
) {
    let mut gatherer = Gatherer {
        rx,
        max_batch,
        max_wait,
        queue: VecDeque::new(),
        stopping: None,
        closed: false,
    };
    let mut cache = ChainCache::default();
    let mut contention = Contention::default();
    let mut inflight: VecDeque<InFlight> = VecDeque::new();
    // The newest in-flight batch's commit, which the next batch commits after.
    let mut last_commit: Option<oneshot::Receiver<bool>> = None;
    // A lone appender is never made to wait for company: the wait applies only once the
    // previous batch showed concurrent appenders.
    let mut concurrent = false;
    // Committed batches whose callers are answered once the next insert is on its way, so
    // that the database does not sit idle while a few hundred callers are woken.
    let mut answers: Vec<(Vec<Pending>, Vec<RequestOutcome>)> = Vec::new();
    loop {
        // Never wait for anything with callers unanswered: their next appends may be what
        // the wait is for.
        for (batch, outcomes) in answers.drain(..) {
            answer(batch, outcomes, &committed);
        }
        // While a batch is in the database, the next one is gathered as soon as its first
        // append arrives, so that it is planned before the database is free again.
        let batch = match inflight.front_mut() {
            None => gatherer.next(true, concurrent).await,
            Some(f) if f.landed.is_some() => gatherer.next(false, concurrent).await,
            Some(f) if gatherer.done() && gatherer.queue.is_empty() => {
                f.landed = Some(joined((&mut f.insert).await));
                Vec::new()
            }
            Some(f) => {
                tokio::select! {
                    r = &mut f.insert => f.landed = Some(joined(r)),
                    () = gatherer.wait_first() => {}
                }
                gatherer.next(false, concurrent).await
            }
        };
        if batch.is_empty() && inflight.is_empty() {
            if gatherer.done() {
                break;
            }
            continue;
        }
        if !batch.is_empty() {
            concurrent = batch.len() > 1;
        }
        // Plan on the chain the in-flight batches will leave, while they are in the database.
        let requests: Vec<&[StreamAppend]> = batch.iter().map(|p| p.appends.as_slice()).collect();
        // While other processes append too, each batch is planned and committed under the
        // append lock, after everything in flight (see `Contention`).
        let locked = contention.on() && db.postgres().is_some();
        let planned = if batch.is_empty() || cache.head.is_none() || locked {
            None
        } else {
            Some(prepare(&db, &mut cache, &requests, inflight.is_empty()).await)
        };
        drop(requests);
        // Answer the batches that have landed, oldest first; then, with a batch to send,
        // wait for the oldest while the pipeline is full or until nothing is in flight
        // when the plan needs a settled chain (none could be made, or expected versions
        // must be checked in the database).
        let mut rolled_back: Option<Vec<Vec<Pending>>> = None;
        loop {
            let optimistic = matches!(&planned, Some(Ok(p)) if p.conflicts.is_empty());
            let Some(oldest) = inflight.front() else {
                break;
            };
            let landed = oldest.landed.is_some() || oldest.insert.is_finished();
            let wait = !batch.is_empty() && (inflight.len() >= depth || !optimistic);
            if !landed && !wait {
                break;
            }
            let Some(oldest) = inflight.pop_front() else {
                break;
            };
            match finish(
                &db,
                &mut cache,
                &mut contention,
                oldest,
                &mut inflight,
                &committed,
                &tail,
            )
            .await
            {
                Ok(committed_batch) => answers.push(committed_batch),
                Err(batches) => rolled_back = Some(batches),
            }
        }
        if let Some(batches) = rolled_back {
            // The batches that rolled back behind a failed one, then this one, go back
            // ahead of anything newer, to be planned on fresh state.
            gatherer.requeue(batches.into_iter().chain(std::iter::once(batch)));
            continue;
        }
        if batch.is_empty() {
            continue;
        }
        if let (true, Some(pool)) = (locked, db.postgres()) {
            let mut batch = batch;
            let written = match lock_chain(pool, &cache).await {
                Ok((lock, chain)) => {
                    // What queued while the lock was awaited goes in with this batch
                    // rather than waiting for the lock once more.
                    let size = batch.iter().map(Pending::events).sum();
                    gatherer.top_up(&mut batch, size);
                    let requests: Vec<&[StreamAppend]> =
                        batch.iter().map(|p| p.appends.as_slice()).collect();
                    commit_locked(lock, chain, &mut cache, &mut contention, &requests).await
                }
                Err(e) => Err(e),
            };
            match written {
                Ok((rows, outcomes)) => {
                    tail.publish(rows);
                    answers.push((batch, outcomes));
                }
                Err(e) if is_unique_violation(&e) || is_refused_row(&e) => {
                    cache.invalidate();
                    for p in batch {
                        let outcome =
                            write_alone(&db, &mut cache, &mut contention, &p.appends).await;
                        answer(vec![p], vec![outcome], &committed);
                    }
                }
                Err(e) => {
                    cache.invalidate();
                    tracing::error!(error = %e, requests = batch.len(), "ledger batch commit failed");
                    let outcomes = batch
                        .iter()
                        .map(|_| Err(LedgerError::CommitFailed(e.to_string())))
                        .collect();
                    answer(batch, outcomes, &committed);
                }
            }
            continue;
        }
        let requests: Vec<&[StreamAppend]> = batch.iter().map(|p| p.appends.as_slice()).collect();
        let plan = match planned {
            Some(Ok(plan)) if plan.conflicts.is_empty() => Ok(plan),
            // No optimistic plan, a failed read, or expected-version conflicts that need a
            // fresh look at the database now that nothing is in flight.
            _ => prepare(&db, &mut cache, &requests, true).await,
        };
        drop(requests);
        match plan {
            Ok(plan) => {
                apply(&mut cache, &plan);
                let Plan { rows, outcomes, .. } = plan;
                if rows.is_empty() {
                    answer(batch, outcomes, &committed);
                } else {
                    let db = db.clone();
                    let rows = Arc::new(rows);
                    let inserted = Arc::clone(&rows);
                    let (done, commit) = oneshot::channel();
                    // Only a batch still in flight is waited for: one already answered
                    // has committed, or everything after it was planned again.
                    let after = last_commit.replace(commit).filter(|_| !inflight.is_empty());
                    inflight.push_back(InFlight {
                        batch,
                        rows,
                        outcomes,
                        started: Instant::now(),
                        insert: tokio::spawn(async move {
                            let result = db.insert_rows_after(&inserted, after).await;
                            let _ = done.send(result.is_ok());
                            result
                        }),
                        landed: None,
                    });
                }
            }
            Err(e) => {
                cache.invalidate();
                tracing::error!(error = %e, "ledger cannot read its chain state");
                let mut failed = batch;
                if matches!(
                    e,
                    sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed
                ) {
                    // Unreachable: what queued during this attempt fails with it, so that a
                    // caller hears within one attempt (`StoreConfig::acquire_timeout`), not two.
                    failed.extend(gatherer.drain_waiting());
                }
                let outcomes = failed
                    .iter()
                    .map(|_| Err(LedgerError::CommitFailed(e.to_string())))
                    .collect();
                answer(failed, outcomes, &committed);
            }
        }
    }
    for (batch, outcomes) in answers {
        answer(batch, outcomes, &committed);
    }
    // Anything still queued after a shutdown request is refused, never half-done.
    let mut rx = gatherer.rx;
    rx.close();
    let queued = gatherer.queue.into_iter().map(|p| p.reply);
    let received = std::iter::from_fn(|| rx.try_recv().ok()).filter_map(|msg| match msg {
        WriterMsg::Append { reply, .. } => Some(reply),
        WriterMsg::Shutdown { .. } => None,
    });
    for reply in queued.chain(received) {
        let _ = reply.send(Err(LedgerError::WriterClosed));
    }
    if let Some(ack) = gatherer.stopping {
        let _ = ack.send(());
    }
}

/// Waits for the oldest in-flight batch. If it committed, returns it with its outcomes for
/// the caller to answer (after starting the next insert). If it did not commit,
/// the batches behind it roll back (they commit only after it) and are returned, oldest
/// first, to be planned again. On a uniqueness conflict (another writer moved the chain,
/// or a caller reused an event id) each request of the failed batch is retried alone on
/// fresh state, so only an offender fails.
async fn finish(
    db: &Db,
    cache: &mut ChainCache,
    contention: &mut Contention,
    f: InFlight,
    later: &mut VecDeque<InFlight>,
    committed: &watch::Sender<u64>,
    tail: &Tail,
) -> Result<(Vec<Pending>, Vec<RequestOutcome>), Vec<Vec<Pending>>> {
    let (batch, outcomes, rows, started, result) = f.result().await;
    metrics::histogram!("aether_ledger_commit_seconds").record(started.elapsed().as_secs_f64());
    metrics::histogram!("aether_ledger_batch_requests").record(batch.len() as f64);
    if result.is_ok() {
        // Before the callers are answered and the commit is signalled.
        tail.publish(rows);
        return Ok((batch, outcomes));
    }
    cache.invalidate();
    let mut rolled_back = Vec::new();
    for f in later.drain(..) {
        let (batch, _, _, _, result) = f.result().await;
        if !matches!(result, Err(InsertError::PredecessorFailed)) {
            tracing::error!("ledger batch behind a failed one did not roll back as expected");
        }
        rolled_back.push(batch);
    }
    match result {
        Ok(()) => {}
        // The database refused a row (a uniqueness conflict, or data it will not store):
        // the batch did not commit, so each request is tried alone and only the offender
        // fails, never the other callers that happened to share its batch.
        Err(InsertError::Sql(e)) if is_unique_violation(&e) || is_refused_row(&e) => {
            if violates(&e, SEQ_KEY) {
                // Another process took these seqs: plan under the append lock from now on
                // (the retries below may well win their race and never show it).
                contention.seen();
            }
            for p in batch {
                let outcome = write_alone(db, cache, contention, &p.appends).await;
                answer(vec![p], vec![outcome], committed);
            }
        }
        Err(e) => {
            // The commit's fate is unknown to us: forget the chain state and reread it.
            let message = match e {
                InsertError::Sql(e) => e.to_string(),
                InsertError::PredecessorFailed => "an earlier batch did not commit".into(),
            };
            tracing::error!(error = %message, requests = batch.len(), "ledger batch commit failed");
            let outcomes = batch
                .iter()
                .map(|_| Err(LedgerError::CommitFailed(message.clone())))
                .collect();
            answer(batch, outcomes, committed);
        }
    }
    Err(rolled_back)
}

/// What the writer knows of the chain: the head and recent stream versions, including
/// those of the batch in flight. Single-process deployments never read them back; if
/// another process writes the same database, the primary key on `seq` and the unique
/// `(stream_id, stream_version)` refuse the stale batch, the cache is dropped and the
/// batch retried on fresh state.
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

/// Plans a batch on the cached chain, reading what the cache lacks. With `settled` (no
/// batch in flight), a request refused for its expected version is checked against the
/// database first, in case the cache is stale.
async fn prepare(
    db: &Db,
    cache: &mut ChainCache,
    requests: &[&[StreamAppend]],
    settled: bool,
) -> Result<Plan, sqlx::Error> {
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
    let plan = plan_batch(head, &cache.versions, requests, ledger_now());
    if plan.conflicts.is_empty() || !settled {
        return Ok(plan);
    }
    let fresh = db.read_versions(&plan.conflicts).await?;
    let mut stale = false;
    for stream in &plan.conflicts {
        let v = fresh.get(stream).copied().unwrap_or(0);
        stale |= cache.versions.insert(stream.clone(), v) != Some(v);
    }
    if !stale {
        // The refusals stand: hand the plan on as settled.
        return Ok(Plan {
            conflicts: Vec::new(),
            ..plan
        });
    }
    let mut plan = plan_batch(head, &cache.versions, requests, ledger_now());
    plan.conflicts.clear();
    Ok(plan)
}

/// Whether other processes append to the same PostgreSQL ledger. Alone, a writer plans
/// on its cached head and pipelines batches; once another process moved the chain under it
/// (a batch refused by the seq key), every batch is planned and committed under the
/// append lock, one at a time, for [`CONTENDED_FOR`] after another writer was last seen:
/// without it, two busy nodes lose race after race and answer UNAVAILABLE.
#[derive(Default)]
struct Contention {
    until: Option<Instant>,
}

/// Most rows of other writers read to bring the version cache up to date; past it the
/// cache is dropped and the batch's streams are read afresh.
const MAX_CATCH_UP_ROWS: u64 = 10_000;

/// How long the writer stays in contention mode after it last saw another writer.
const CONTENDED_FOR: Duration = Duration::from_secs(30);

impl Contention {
    fn on(&self) -> bool {
        self.until.is_some_and(|until| Instant::now() < until)
    }

    fn seen(&mut self) {
        if !self.on() {
            tracing::info!(
                "another process appends to this ledger: batches are committed under the append lock"
            );
        }
        metrics::counter!("aether_ledger_other_writer_seen_total").increment(1);
        self.until = Some(Instant::now() + CONTENDED_FOR);
    }
}

/// Plans `requests` and commits them under the append lock, on the chain as it stands
/// inside the lock: nothing can move it in between, so the only refusals are the
/// requests' own (a duplicate id, an expected version, a stale fence).
async fn write_locked(
    pool: &sqlx::PgPool,
    cache: &mut ChainCache,
    contention: &mut Contention,
    requests: &[&[StreamAppend]],
) -> Result<(Arc<Vec<EventRow>>, Vec<RequestOutcome>), sqlx::Error> {
    let (locked, chain) = lock_chain(pool, cache).await?;
    commit_locked(locked, chain, cache, contention, requests).await
}

/// Takes the append lock and reads the chain as it stands inside it.
async fn lock_chain(
    pool: &sqlx::PgPool,
    cache: &ChainCache,
) -> Result<
    (
        crate::store::postgres::LockedAppend,
        crate::store::postgres::ChainInLock,
    ),
    sqlx::Error,
> {
    let after = cache.head.flatten().map(|h| h.seq);
    crate::store::postgres::LockedAppend::begin(pool, after, MAX_CATCH_UP_ROWS).await
}

/// Plans `requests` on `chain` and commits them in the lock's transaction, releasing it.
async fn commit_locked(
    mut locked: crate::store::postgres::LockedAppend,
    chain: crate::store::postgres::ChainInLock,
    cache: &mut ChainCache,
    contention: &mut Contention,
    requests: &[&[StreamAppend]],
) -> Result<(Arc<Vec<EventRow>>, Vec<RequestOutcome>), sqlx::Error> {
    let plan = match plan_locked(&mut locked, chain, cache, contention, requests).await {
        Ok(plan) => plan,
        Err(e) => {
            // The lock goes now, not when the connection is next used.
            let _ = locked.release().await;
            return Err(e);
        }
    };
    if plan.rows.is_empty() {
        locked.release().await?;
    } else {
        locked.commit(&plan.rows).await?;
    }
    apply(cache, &plan);
    let Plan { rows, outcomes, .. } = plan;
    Ok((Arc::new(rows), outcomes))
}

/// Plans `requests` on the chain as it stands inside the lock: the head, the versions
/// another writer changed since this one's last batch, and those the cache lacks.
async fn plan_locked(
    locked: &mut crate::store::postgres::LockedAppend,
    chain: crate::store::postgres::ChainInLock,
    cache: &mut ChainCache,
    contention: &mut Contention,
    requests: &[&[StreamAppend]],
) -> Result<Plan, sqlx::Error> {
    let head = chain.head;
    let moved = match cache.head {
        Some(cached) => cached.map(|h| (h.seq, h.hash)) != head.map(|h| (h.seq, h.hash)),
        None => false,
    };
    if moved {
        // Another process appended since this one's last batch: the versions it changed
        // were read from its rows with the head (a short range of seqs), the rest of the
        // cache holds.
        contention.seen();
        let complete = match (cache.head, head) {
            (Some(Some(cached)), Some(now)) => {
                now.seq > cached.seq && now.seq - cached.seq <= MAX_CATCH_UP_ROWS
            }
            _ => false,
        };
        if complete {
            cache.versions.extend(chain.versions_after);
        } else {
            cache.invalidate();
        }
    }
    cache.head = Some(head);
    let missing: Vec<String> = streams_of(requests)
        .into_iter()
        .filter(|s| !cache.versions.contains_key(s))
        .collect();
    if !missing.is_empty() {
        let found = locked.versions(&missing).await?;
        for stream in missing {
            let v = found.get(&stream).copied().unwrap_or(0);
            cache.versions.insert(stream, v);
        }
    }
    let mut plan = plan_batch(head, &cache.versions, requests, ledger_now());
    // The versions are the database's: an expected-version refusal stands.
    plan.conflicts.clear();
    Ok(plan)
}

/// Records a plan's effect on the chain, before its commit (see the module doc).
fn apply(cache: &mut ChainCache, plan: &Plan) {
    cache.head = Some(plan.head);
    if cache.versions.len() + plan.versions.len() > MAX_CACHED_STREAMS {
        cache.versions.clear();
    }
    cache
        .versions
        .extend(plan.versions.iter().map(|(k, v)| (k.clone(), *v)));
}

/// Writes one request on its own, re-reading the chain after each uniqueness conflict: a
/// reused event id is the caller's error; anything else is another writer that got there
/// first, so it is retried a few times.
async fn write_alone(
    db: &Db,
    cache: &mut ChainCache,
    contention: &mut Contention,
    appends: &[StreamAppend],
) -> RequestOutcome {
    // Races lost while planning on the cache; under the append lock a race is lost only to
    // a writer that has not yet seen this one (its first loss puts it under the lock too),
    // so those get a longer budget.
    const ATTEMPTS: u32 = 5;
    const LOCKED_ATTEMPTS: u32 = 50;
    let (mut lost, mut lost_locked) = (0, 0);
    while lost < ATTEMPTS && lost_locked < LOCKED_ATTEMPTS {
        let locked = contention.on() && db.postgres().is_some();
        if locked {
            lost_locked += 1;
        } else {
            lost += 1;
        }
        let result = match db.postgres().filter(|_| locked) {
            // Under the append lock no other locked writer moves the chain.
            Some(pool) => write_locked(pool, cache, contention, &[appends])
                .await
                .map(|(_, outcomes)| outcomes),
            None => match prepare(db, cache, &[appends], true).await {
                Ok(plan) => {
                    let inserted = if plan.rows.is_empty() {
                        Ok(())
                    } else {
                        db.insert_rows(&plan.rows).await
                    };
                    inserted.map(|()| {
                        apply(cache, &plan);
                        plan.outcomes
                    })
                }
                Err(e) => Err(e),
            },
        };
        match result {
            Ok(mut outcomes) => return outcomes.pop().unwrap_or(Err(LedgerError::WriterClosed)),
            Err(e) if is_unique_violation(&e) => {
                cache.invalidate();
                if let Some(event_id) = duplicate_id(db, appends).await {
                    return Err(LedgerError::DuplicateEventId { event_id });
                }
                if violates(&e, ONE_DECISION_INDEX) {
                    return Err(request_id_taken(&e));
                }
                // Another process moved the chain: append under the lock from now on.
                contention.seen();
            }
            Err(e) if has_code(&e, crate::error::FENCED_SQLSTATE) => {
                cache.invalidate();
                let message = match &e {
                    sqlx::Error::Database(d) => d.message().to_owned(),
                    other => other.to_string(),
                };
                return Err(LedgerError::Fenced(message));
            }
            Err(e) if is_refused_row(&e) => {
                cache.invalidate();
                return Err(LedgerError::RowRefused(e.to_string()));
            }
            Err(e) => {
                cache.invalidate();
                return Err(LedgerError::CommitFailed(e.to_string()));
            }
        }
    }
    Err(LedgerError::CommitFailed(format!(
        "another writer on the same database won the race {} times; retry",
        lost + lost_locked
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

/// The unique index that allows one decision per stream and request id.
const ONE_DECISION_INDEX: &str = "events_one_decision";
/// The primary key on `seq` (PostgreSQL's name): a batch refused by it met another writer.
const SEQ_KEY: &str = "events_pkey";

/// Whether the database named `index` as the one the row violated (PostgreSQL names the
/// constraint; SQLite's message names the index or its columns).
fn violates(e: &sqlx::Error, index: &str) -> bool {
    let sqlx::Error::Database(d) = e else {
        return false;
    };
    d.constraint() == Some(index)
        || d.message().contains(index)
        || d.message()
            .contains("json_extract(metadata, '$.request_id')")
}

fn has_code(e: &sqlx::Error, code: &str) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some(code))
}

/// What the database said of the decision that already took a request id.
fn request_id_taken(e: &sqlx::Error) -> LedgerError {
    let detail = match e {
        sqlx::Error::Database(d) => d
            .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .and_then(|p| p.detail())
            .map_or_else(|| d.message().to_owned(), str::to_owned),
        other => other.to_string(),
    };
    LedgerError::RequestIdTaken { detail }
}

/// A row the database will not store, as opposed to a failure whose outcome is unknown (a
/// lost connection): PostgreSQL's data exceptions and integrity violations (SQLSTATE classes
/// 22 and 23), SQLite's constraint, mismatch and too-big results (primary codes 19, 20, 18).
fn is_refused_row(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(d) = e else {
        return false;
    };
    let Some(code) = d.code() else {
        return false;
    };
    if code.starts_with("22") || code.starts_with("23") || code == crate::error::FENCED_SQLSTATE {
        return true;
    }
    code.parse::<i32>()
        .is_ok_and(|c| matches!(c & 0xff, 18..=20))
}

/// The first of the request's event ids that is already in the ledger, if any.
async fn duplicate_id(db: &Db, appends: &[StreamAppend]) -> Option<uuid::Uuid> {
    let ids: Vec<uuid::Uuid> = appends
        .iter()
        .flat_map(|a| a.events.iter().map(|ev| ev.event_id))
        .collect();
    db.existing_event_ids(&ids).await.ok()?.first().copied()
}

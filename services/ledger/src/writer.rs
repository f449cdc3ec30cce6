//! The group-commit writer: the only task that inserts events. It gathers concurrent
//! appends into one transaction (bounded by `max_batch` events and `max_wait`), computes
//! the chain inside it, and answers each caller only after the commit.

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

use crate::error::LedgerError;
use crate::store::Db;
use crate::store::plan::{RequestOutcome, StreamAppend};

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

pub(crate) async fn run(
    db: Db,
    mut rx: mpsc::Receiver<WriterMsg>,
    committed: watch::Sender<u64>,
    max_batch: usize,
    max_wait: Duration,
) {
    let mut carry: Option<Pending> = None;
    let mut stopping: Option<oneshot::Sender<()>> = None;
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
        let deadline = tokio::time::Instant::now() + max_wait;
        while size < max_batch {
            let msg = match rx.try_recv() {
                Ok(m) => Some(m),
                Err(mpsc::error::TryRecvError::Disconnected) => None,
                Err(mpsc::error::TryRecvError::Empty) if max_wait.is_zero() => None,
                Err(mpsc::error::TryRecvError::Empty) => {
                    tokio::time::timeout_at(deadline, rx.recv())
                        .await
                        .ok()
                        .flatten()
                }
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
        commit(&db, batch, &committed).await;
        if stopping.is_some() {
            if let Some(p) = carry.take() {
                commit(&db, vec![p], &committed).await;
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

/// Commits one batch. If the database refuses it over a uniqueness conflict (a caller
/// reused an event id), each request is retried alone so only the offender fails.
async fn commit(db: &Db, batch: Vec<Pending>, committed: &watch::Sender<u64>) {
    let started = Instant::now();
    let requests: Vec<&[StreamAppend]> = batch.iter().map(|p| p.appends.as_slice()).collect();
    let result = db.commit_batch(&requests).await;
    metrics::histogram!("aether_ledger_commit_seconds").record(started.elapsed().as_secs_f64());
    metrics::histogram!("aether_ledger_batch_requests").record(batch.len() as f64);
    match result {
        Ok(outcomes) => answer(batch, outcomes, committed),
        Err(e) if is_unique_violation(&e) => {
            for p in batch {
                let outcome = match db.commit_batch(&[p.appends.as_slice()]).await {
                    Ok(mut o) => o.pop().unwrap_or(Err(LedgerError::WriterClosed)),
                    Err(e) if is_unique_violation(&e) => Err(duplicate_id(db, &p.appends, e).await),
                    Err(e) => Err(e.into()),
                };
                answer(vec![p], vec![outcome], committed);
            }
        }
        Err(e) => {
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

/// Names the event id that already exists, falling back to the database's own error.
async fn duplicate_id(db: &Db, appends: &[StreamAppend], e: sqlx::Error) -> LedgerError {
    let ids: Vec<uuid::Uuid> = appends
        .iter()
        .flat_map(|a| a.events.iter().map(|ev| ev.event_id))
        .collect();
    match db.existing_event_ids(&ids).await {
        Ok(found) => match found.first() {
            Some(&event_id) => LedgerError::DuplicateEventId { event_id },
            None => e.into(),
        },
        Err(_) => e.into(),
    }
}

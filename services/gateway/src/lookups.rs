//! "Was `(member, request_id)` decided already?", asked for every new request, answered in
//! batches: the lookups that arrive while one query runs go together into the next, one
//! indexed query for all of them, on a connection of its own where that query is planned
//! once ([`EventStore::metadata_lookup`]).
//!
//! Why: a query per request, planned each time, cost PostgreSQL about as much CPU as
//! recording the decision itself.

use std::collections::HashMap;

use aether_ledger::{EventStore, MAX_LOOKUP_VALUES};
use tokio::sync::{mpsc, oneshot};

use crate::decision::{Answer, CLEARING_DECIDED, ClearError, answer_of, clearing_stream};

/// Lookups waiting for the next query; a caller beyond this waits to queue.
const QUEUE: usize = 10_000;
/// Request ids in one query.
const MAX_PER_QUERY: usize = 500;
const _: () = assert!(MAX_PER_QUERY <= MAX_LOOKUP_VALUES);

/// Most times one query waits for more lookups by yielding to the runtime.
const MAX_YIELDS: usize = 4;

type Reply = oneshot::Sender<Result<Option<Answer>, ClearError>>;

struct Lookup {
    member: String,
    request_id: String,
    reply: Reply,
}

/// Handle to the lookup task; it stops when every handle is dropped.
pub(crate) struct RecordedLookups {
    tx: mpsc::Sender<Lookup>,
}

impl RecordedLookups {
    pub(crate) fn start(store: EventStore) -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(run(store, rx));
        RecordedLookups { tx }
    }

    /// The answer recorded on the ledger for `(member, request_id)`, if any.
    pub(crate) async fn recorded(
        &self,
        member: &str,
        request_id: &str,
    ) -> Result<Option<Answer>, ClearError> {
        let stopped = || ClearError::Ledger("the decision lookup has stopped".into());
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Lookup {
                member: member.to_owned(),
                request_id: request_id.to_owned(),
                reply,
            })
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

async fn run(store: EventStore, mut rx: mpsc::Receiver<Lookup>) {
    // One connection of its own, its statement planned once (see `MetadataLookup`).
    let mut lookup = store.metadata_lookup();
    let mut batch = Vec::with_capacity(MAX_PER_QUERY);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        drain(&mut rx, &mut batch);
        // Let the requests already queued on the runtime reach the queue too, while they
        // keep arriving: a query costs PostgreSQL ~70 µs however few ids it holds, and
        // without this each held a handful. An idle runtime runs this task again at once.
        for _ in 0..MAX_YIELDS {
            let before = batch.len();
            if before >= MAX_PER_QUERY {
                break;
            }
            tokio::task::yield_now().await;
            drain(&mut rx, &mut batch);
            if batch.len() == before {
                break;
            }
        }
        let mut ids: Vec<String> = batch.iter().map(|l| l.request_id.clone()).collect();
        ids.sort_unstable();
        ids.dedup();
        metrics::histogram!("aether_clearing_lookup_batch_size").record(batch.len() as f64);
        match lookup.find("request_id", &ids, CLEARING_DECIDED).await {
            Ok(events) => {
                // The first decision of each (stream, request id): there is only one, as a
                // repeat is never recorded.
                let mut decided = HashMap::with_capacity(events.len());
                for event in &events {
                    let Ok(metadata) = event.metadata_value() else {
                        continue;
                    };
                    if let Some(request_id) = metadata["request_id"].as_str() {
                        decided
                            .entry((event.stream_id.as_str(), request_id.to_owned()))
                            .or_insert(event);
                    }
                }
                for lookup in batch.drain(..) {
                    let stream = clearing_stream(&lookup.member);
                    let answer = decided
                        .get(&(stream.as_str(), lookup.request_id))
                        .and_then(|event| answer_of(event));
                    // The caller may have gone (its client cancelled): nothing to do.
                    let _ = lookup.reply.send(Ok(answer));
                }
            }
            Err(e) => {
                let message = e.to_string();
                for lookup in batch.drain(..) {
                    let _ = lookup.reply.send(Err(ClearError::Ledger(message.clone())));
                }
            }
        }
    }
}

/// Moves queued lookups into `batch`, up to [`MAX_PER_QUERY`].
fn drain(rx: &mut mpsc::Receiver<Lookup>, batch: &mut Vec<Lookup>) {
    while batch.len() < MAX_PER_QUERY {
        match rx.try_recv() {
            Ok(lookup) => batch.push(lookup),
            Err(_) => break,
        }
    }
}

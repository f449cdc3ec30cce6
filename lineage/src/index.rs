//! The live lineage graph of a running service: Aether's own records (`lineage_records`,
//! by seq) and external events (`external_lineage_events`, by id) folded into one
//! [`LineageGraph`], caught up on each read from where the last read stopped.
//!
//! Why in memory: the graph has a few nodes per kind of change (jobs, policies, models,
//! Delta tables), however many millions of events made it, so folding each event once and
//! keeping the result answers every query without reading the records again. A
//! point-in-time graph ([`LineageIndex::as_of`]) is folded afresh from the events up to
//! that time; its cost grows with the events before it.

use aether_ledger::EventStore;
use chrono::{DateTime, Utc};
use tokio::sync::Mutex;

use crate::external::{StoreError, external_events, own_records};
use crate::graph::LineageGraph;

/// Rows read per query while catching up.
const PAGE: u32 = 5000;

#[derive(Default)]
struct Folded {
    graph: LineageGraph,
    /// Last `lineage_records` seq folded.
    own_seq: u64,
    /// Last `external_lineage_events` id folded.
    external_id: i64,
}

/// The graph of one store, caught up on each read.
pub struct LineageIndex {
    store: EventStore,
    folded: Mutex<Folded>,
}

impl std::fmt::Debug for LineageIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LineageIndex").finish_non_exhaustive()
    }
}

impl LineageIndex {
    pub fn new(store: EventStore) -> LineageIndex {
        LineageIndex {
            store,
            folded: Mutex::new(Folded::default()),
        }
    }

    /// Catches up with every record stored so far, then answers `read` from the graph.
    pub async fn read<R>(&self, read: impl FnOnce(&LineageGraph) -> R) -> Result<R, StoreError> {
        let mut folded = self.folded.lock().await;
        let Folded {
            graph,
            own_seq,
            external_id,
        } = &mut *folded;
        fold(&self.store, graph, own_seq, external_id, None).await?;
        Ok(read(graph))
    }

    /// The graph from the events with an eventTime at or before `at` alone.
    pub async fn as_of(&self, at: DateTime<Utc>) -> Result<LineageGraph, StoreError> {
        let mut graph = LineageGraph::default();
        let (mut own_seq, mut external_id) = (0, 0);
        fold(
            &self.store,
            &mut graph,
            &mut own_seq,
            &mut external_id,
            Some(at),
        )
        .await?;
        Ok(graph)
    }
}

/// Folds the records after the cursors into `graph` (those with eventTime ≤ `until`, when
/// given), moving the cursors. An unreadable record is logged and skipped: it cannot be
/// mapped later either, and the rest of the graph must stay available.
async fn fold(
    store: &EventStore,
    graph: &mut LineageGraph,
    own_seq: &mut u64,
    external_id: &mut i64,
    until: Option<DateTime<Utc>>,
) -> Result<(), StoreError> {
    // Aether's event times are the ledger's recorded_at, non-decreasing in seq.
    let own_until = match until {
        Some(t) => Some(store.seq_at_time(t).await?.map_or(0, |(seq, _)| seq)),
        None => None,
    };
    fold_pages(graph, own_seq, "lineage record", |after| {
        own_records(store, after, own_until, PAGE)
    })
    .await?;
    fold_pages(graph, external_id, "external lineage event", |after| {
        external_events(store, after, until, PAGE)
    })
    .await
}

/// Folds pages of `(cursor, event JSON)` from `fetch(cursor)` until a page is not full.
async fn fold_pages<C, F, Fut>(
    graph: &mut LineageGraph,
    cursor: &mut C,
    what: &'static str,
    mut fetch: F,
) -> Result<(), StoreError>
where
    C: Copy + std::fmt::Display,
    F: FnMut(C) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<(C, String)>, StoreError>>,
{
    loop {
        let page = fetch(*cursor).await?;
        for (at, json) in &page {
            if let Err(e) = graph.apply_json(json) {
                tracing::warn!(what, at = %at, error = %e, "left out of the lineage graph");
            }
            *cursor = *at;
        }
        if page.len() < PAGE as usize {
            return Ok(());
        }
    }
}

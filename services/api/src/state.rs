//! What every handler is given: the ledger, the control plane, tokens and sessions.

use std::sync::Arc;

use aether_ledger::{EventStore, MerkleLog};
use metrics_exporter_prometheus::PrometheusHandle;

use crate::auth::Tokens;
use crate::sessions::Sessions;

#[derive(Clone)]
pub struct AppState {
    pub store: EventStore,
    pub tokens: Arc<Tokens>,
    pub metrics: PrometheusHandle,
    /// Every event hash in memory, for proofs.
    pub merkle: MerkleLog,
    /// The control plane's projections (policies and the live rule engine, models,
    /// engines, rollouts), rebuilt from the ledger at start.
    pub control: aether_control::ControlState,
    /// This node's id in its cluster.
    pub node_id: Arc<str>,
    /// Where regulators' reads go: a streaming replica (`--read-database-url`), or the
    /// ledger itself. See [`AppState::reads_through`].
    pub reads: EventStore,
    /// Console sessions opened on this node (`/v1/session`).
    pub sessions: Sessions,
}

impl AppState {
    /// The store to read events up to `seq` from: the replica once it has replayed that
    /// far (waiting up to 500 ms for it), else the primary, so that no answer pairs a proof
    /// for a tree size with events the replica has not reached.
    pub async fn reads_through(&self, seq: u64) -> &EventStore {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(500);
        loop {
            match self.reads.head().await {
                Ok(head) if head.map_or(0, |(s, _)| s) >= seq => return &self.reads,
                Ok(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                _ => {
                    metrics::counter!("aether_audit_replica_behind_total").increment(1);
                    return &self.store;
                }
            }
        }
    }
}

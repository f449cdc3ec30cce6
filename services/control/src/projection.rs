//! The control plane's whole projected state as one canonical document, so that a replay
//! from seq 1 can be compared with the live service byte for byte, and so that the state
//! at any past seq can be rebuilt for auditors (time travel).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aether_ledger::hashing::{canonical_json, sm3};
use aether_ledger::{EventFilter, EventStore, LedgerError, RecordedEvent};
use serde_json::{Value, json};

use crate::{
    CorpusRegistry, EngineRegistry, ModelRegistry, Origin, PolicyRegistry, RolloutRegistry,
    SnapshotCoordinator,
};

/// Event type of a committed consistent snapshot (gateway, rules and RAG digests).
pub const SNAPSHOT_COMMITTED: &str = "SnapshotCommitted";
/// The stream the snapshot coordinator writes.
pub const SNAPSHOT_STREAM: &str = "snapshot";

/// The registries that make up the control plane's state.
#[derive(Clone)]
pub struct ControlState {
    pub policies: PolicyRegistry,
    pub models: ModelRegistry,
    pub engines: EngineRegistry,
    pub rollouts: RolloutRegistry,
    pub corpora: CorpusRegistry,
    /// Committed snapshots and rollbacks (stream `snapshot`).
    pub snapshots: SnapshotCoordinator,
    /// The ledger the projections follow.
    store: EventStore,
    /// The seq through which everything recorded by other nodes has been applied here
    /// ([`Self::follow`]); 0 before its first step.
    followed: Arc<AtomicU64>,
    /// When the control plane was last known complete: the replay, then each successful
    /// step of [`Self::follow`].
    complete_at: Arc<std::sync::Mutex<std::time::Instant>>,
}

impl ControlState {
    /// Rebuilds every projection from the ledger, from seq 1.
    pub async fn replay(store: &EventStore) -> Result<ControlState, LedgerError> {
        Self::replay_bounded(store, None).await
    }

    /// The state as it stood just after event `upto_seq` (0: before the first event), from
    /// the events up to it alone, with the snapshot in force then. Nothing is written, and
    /// the answer offers no way to write: a past state must not act (it would, say, fail
    /// an activation that was still running at that seq).
    pub async fn replay_until(store: &EventStore, upto_seq: u64) -> Result<StateAsOf, LedgerError> {
        let (state, snapshot) = tokio::try_join!(
            Self::replay_bounded(store, Some(upto_seq)),
            snapshot_at(store, upto_seq),
        )?;
        Ok(StateAsOf {
            seq: upto_seq,
            state,
            snapshot,
        })
    }

    async fn replay_bounded(
        store: &EventStore,
        upto_seq: Option<u64>,
    ) -> Result<ControlState, LedgerError> {
        // The projections read disjoint streams, so they load side by side; engines and
        // rollouts only keep handles to the model and policy registries.
        let (policies, models, corpora, snapshots) = tokio::try_join!(
            PolicyRegistry::load_until(store.clone(), upto_seq),
            ModelRegistry::load_until(store.clone(), upto_seq),
            CorpusRegistry::load_until(store.clone(), upto_seq),
            SnapshotCoordinator::load_until(store.clone(), upto_seq),
        )?;
        snapshots.reapply(&corpora, &policies).await?;
        let engines =
            EngineRegistry::load_until(store.clone(), models.clone(), policies.clone(), upto_seq)
                .await?;
        let rollouts =
            RolloutRegistry::load_until(store.clone(), models.clone(), engines.clone(), upto_seq)
                .await?;
        Ok(ControlState {
            store: store.clone(),
            followed: Arc::default(),
            complete_at: Arc::new(std::sync::Mutex::new(std::time::Instant::now())),
            corpora,
            policies,
            models,
            engines,
            rollouts,
            snapshots,
        })
    }

    /// Applies, on this node, the policies, models, corpus versions, engines (activations,
    /// promotions) and snapshots and rollbacks that other nodes of the cluster record on the
    /// shared ledger, every `every`, until `stop`: a policy ingested, an engine activated or
    /// a rollback made through one node is in force on the others within about `every`.
    /// Rollouts started and moved through another node are followed too.
    pub async fn follow(
        self,
        every: std::time::Duration,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut policies_after = self.policies.following();
        let mut models_after = self.models.following();
        let mut corpora_after = self.corpora.following();
        let mut engines_after = self.engines.following();
        let mut rollouts_after = self.rollouts.following();
        let mut failing = false;
        loop {
            let step = async {
                // Everything committed by now is applied once the step succeeds.
                let head = self.store.head().await?.map_or(0, |(seq, _)| seq);
                self.models.follow_step(&mut models_after).await?;
                self.corpora.follow_step(&mut corpora_after).await?;
                self.policies.follow_step(&mut policies_after).await?;
                self.engines.follow_step(&mut engines_after).await?;
                self.rollouts.follow_step(&mut rollouts_after).await?;
                self.snapshots
                    .follow_step(&self.corpora, &self.policies, &self.rollouts)
                    .await?;
                self.followed.fetch_max(head, Ordering::Relaxed);
                if let Ok(mut at) = self.complete_at.lock() {
                    *at = std::time::Instant::now();
                }
                Ok::<(), LedgerError>(())
            };
            match step.await {
                Ok(_) if failing => {
                    failing = false;
                    tracing::info!("following the ledger's control events again");
                }
                Ok(_) => {}
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "cannot follow the ledger's control events; retrying");
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
        }
    }

    /// The seq through which the control plane recorded by other nodes is applied here
    /// (reported with the heartbeat, so that a rollback can say where it is in force).
    pub fn followed_through(&self) -> u64 {
        self.followed.load(Ordering::Relaxed)
    }

    /// How long ago this node's control plane was last known to hold everything recorded
    /// on the ledger (at the replay, then at each step of [`Self::follow`]): a node that
    /// cannot follow the others is not ready for traffic.
    pub fn complete_since(&self) -> std::time::Duration {
        self.complete_at
            .lock()
            .map(|at| at.elapsed())
            .unwrap_or(std::time::Duration::MAX)
    }

    /// `origin` naming the snapshot in force, as every control event must.
    pub fn under_snapshot(&self, origin: Origin) -> Origin {
        Origin {
            snapshot_id: self.snapshots.in_force(),
            ..origin
        }
    }

    /// The state as one JSON document (engines, models, policies with versions, the rule
    /// set digest, rollouts, corpora with their versions).
    pub fn document(&self) -> Value {
        json!({
            "engines": self.engines.engines(),
            "models": self.models.all(),
            "policies": self.policies.policies(),
            "rule_set_digest": hex::encode(self.policies.engine().snapshot().digest()),
            "rollouts": self.rollouts.all(),
            "corpora": self.corpora.corpora(),
        })
    }

    /// SM3 of the document's RFC 8785 text, hex.
    pub fn digest(&self) -> String {
        let text = canonical_json(&self.document()).unwrap_or_default();
        hex::encode(sm3(text.as_bytes()))
    }
}

/// The control plane as it stood at one seq: read-only by construction.
pub struct StateAsOf {
    seq: u64,
    state: ControlState,
    snapshot: Option<RecordedEvent>,
}

impl StateAsOf {
    /// The last event the state includes (0: none).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// As [`ControlState::document`]; equal to the live one's at that seq.
    pub fn document(&self) -> Value {
        self.state.document()
    }

    /// As [`ControlState::digest`].
    pub fn digest(&self) -> String {
        self.state.digest()
    }

    /// The last `SnapshotCommitted` at or before the seq: the snapshot in force then.
    pub fn snapshot(&self) -> Option<&RecordedEvent> {
        self.snapshot.as_ref()
    }
}

/// The newest committed snapshot with seq ≤ `upto_seq` (one backward index probe).
async fn snapshot_at(
    store: &EventStore,
    upto_seq: u64,
) -> Result<Option<RecordedEvent>, LedgerError> {
    let filter = EventFilter {
        event_type: Some(SNAPSHOT_COMMITTED.into()),
        stream_prefix: Some(SNAPSHOT_STREAM.into()),
        max_seq: Some(upto_seq),
        ..EventFilter::default()
    };
    Ok(store.query_backward(&filter, u64::MAX, 1).await?.pop())
}

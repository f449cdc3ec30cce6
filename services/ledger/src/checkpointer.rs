//! Background task that appends a signed checkpoint every N events or T seconds.
//!
//! It follows the ledger's hashes (not whole events), keeps the Merkle frontier in memory,
//! and appends through the normal append path, so checkpoints are chained like any event.

use std::time::Duration;

use tokio::sync::watch;

pub use crate::checkpoint::latest_checkpoint;
use crate::checkpoint::{CHECKPOINT_STREAM, CheckpointSigner, key_fingerprint};
use crate::cluster::HeldLease;
use crate::error::LedgerError;
use crate::event::{ExpectedVersion, ledger_now};
use crate::key_rotation::{KEY_ROTATION_STREAM, KeyRotation, key_in_force};
use crate::merkle::Frontier;
use crate::retrying::{RETRY_EVERY, Retrying};
use crate::store::EventStore;

/// When to sign a new tree head.
#[derive(Clone, Debug)]
pub struct CheckpointPolicy {
    /// Sign once this many events are not yet covered by a checkpoint.
    pub every_events: u64,
    /// Sign at least this often while new events arrive.
    pub every: Duration,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        CheckpointPolicy {
            every_events: 1000,
            every: Duration::from_secs(10),
        }
    }
}

/// Hashes fetched per read while following the ledger.
const PAGE: u32 = 5000;

/// Runs until `stop` turns true; then signs a final checkpoint if anything is uncovered.
///
/// A failed read or signing (the database gone for a moment, an append refused) is logged
/// once and retried every second: a checkpointer that ended silently would leave
/// regulators' proofs against an ever older tree head. Only a failure of the final
/// checkpoint, at stop, is returned.
pub async fn run_checkpointer(
    store: EventStore,
    signer: CheckpointSigner,
    policy: CheckpointPolicy,
    stop: watch::Receiver<bool>,
) -> Result<(), LedgerError> {
    run_checkpointer_under(
        store,
        signer,
        policy,
        HeldLease::always(CHECKPOINTER_LEASE),
        stop,
    )
    .await
}

/// The lease under which one node of a cluster signs checkpoints.
pub const CHECKPOINTER_LEASE: &str = "checkpointer";

/// [`run_checkpointer`] that signs only while `lease` is held, each checkpoint fenced
/// with its token: on a cluster every node follows the ledger, one signs, and a node that
/// lost the lease while paused cannot append a checkpoint when it wakes.
pub async fn run_checkpointer_under(
    store: EventStore,
    signer: CheckpointSigner,
    policy: CheckpointPolicy,
    lease: HeldLease,
    stop: watch::Receiver<bool>,
) -> Result<(), LedgerError> {
    run_checkpointer_rotating(store, signer, None, policy, lease, stop).await
}

/// [`run_checkpointer_under`] that may hand the ledger over to `signer` from `previous`:
/// while the ledger's checkpoints are signed by `previous`, the first time it is to sign
/// it appends a `CheckpointKeyRotated` (signed by both, fenced like a checkpoint) and
/// signs with `signer` from the next checkpoint on. It ends with
/// [`LedgerError::CheckpointKeyRetired`] when the ledger's key is neither: another node
/// rotated it, and this one must not sign.
pub async fn run_checkpointer_rotating(
    store: EventStore,
    signer: CheckpointSigner,
    previous: Option<CheckpointSigner>,
    policy: CheckpointPolicy,
    mut lease: HeldLease,
    mut stop: watch::Receiver<bool>,
) -> Result<(), LedgerError> {
    let mut committed = store.committed_seq();
    let mut ticker = tokio::time::interval(policy.every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut signing = Signing {
        store,
        signer,
        every_events: policy.every_events,
        frontier: Frontier::new(),
        last_size: None,
        lease: lease.clone(),
        signed_under: None,
        previous,
        in_force: None,
        rotated_at: None,
    };
    let mut retrying = Retrying::new("checkpointer", "aether_ledger_checkpointer_failing");
    loop {
        let step = signing.catch_up(&mut committed).await;
        if *stop.borrow() {
            step?;
            return signing.sign_uncovered().await;
        }
        let step = match step {
            Ok(()) => {
                retrying.succeeded(signing.frontier.size());
                tokio::select! {
                    _ = ticker.tick() => signing.sign_uncovered().await,
                    _ = committed.changed() => Ok(()),
                    _ = stop.changed() => Ok(()),
                    _ = lease.changed() => Ok(()),
                    // Other processes may write the same database.
                    _ = tokio::time::sleep(RETRY_EVERY) => Ok(()),
                }
            }
            Err(e) => Err(e),
        };
        if let Err(e) = step {
            if matches!(e, LedgerError::CheckpointKeyRetired { .. }) {
                return Err(e);
            }
            retrying.failed(&e);
            Retrying::wait(&mut stop).await;
        }
    }
}

/// The checkpointer's state: the Merkle frontier of what it has read, and the size of the
/// newest checkpoint (read from the ledger on first use).
struct Signing {
    store: EventStore,
    signer: CheckpointSigner,
    every_events: u64,
    frontier: Frontier,
    last_size: Option<u64>,
    lease: HeldLease,
    /// The token this process last signed under: another token means another node may
    /// have signed meanwhile, so the newest checkpoint is read again.
    signed_under: Option<u64>,
    /// The key this node hands over from, if it is to rotate.
    previous: Option<CheckpointSigner>,
    /// The ledger's key in force as last read (again at each new token).
    in_force: Option<String>,
    /// The tree size this process rotated the key at.
    rotated_at: Option<u64>,
}

impl Signing {
    /// The token to sign under now, if this process holds the lease.
    fn token(&mut self) -> Option<u64> {
        let token = self.lease.token()?;
        if self.signed_under != Some(token) {
            self.signed_under = Some(token);
            self.last_size = None;
            self.in_force = None;
        }
        Some(token)
    }

    async fn sign(&mut self, token: u64) -> Result<(), LedgerError> {
        let own = self.signer.public_key_hex();
        let in_force = match &self.in_force {
            Some(key) => key.clone(),
            None => {
                let key = key_in_force(&self.store).await?.unwrap_or(own.clone());
                self.in_force = Some(key.clone());
                key
            }
        };
        if in_force != own {
            return self.rotate(token, &in_force).await;
        }
        // A checkpoint after a rotation covers it: verifiers hold the keys apart by size.
        if self
            .rotated_at
            .is_some_and(|size| self.frontier.size() <= size)
        {
            return Ok(());
        }
        self.last_size = Some(
            sign(
                &self.store,
                &self.signer,
                &self.frontier,
                &self.lease,
                token,
            )
            .await?,
        );
        Ok(())
    }

    /// Hands the ledger over from `in_force` to this node's key, if this node holds it;
    /// the next checkpoint (of the events after the rotation) is signed with the new key.
    async fn rotate(&mut self, token: u64, in_force: &str) -> Result<(), LedgerError> {
        let own = self.signer.public_key_hex();
        let Some(previous) = self
            .previous
            .as_ref()
            .filter(|p| p.public_key_hex() == in_force)
        else {
            return Err(LedgerError::CheckpointKeyRetired {
                in_force: key_fingerprint(in_force),
                own: key_fingerprint(&own),
            });
        };
        let rotation = KeyRotation::sign(
            previous,
            &self.signer,
            self.frontier.size(),
            self.frontier.root(),
            ledger_now(),
        );
        let mut event = rotation.to_event();
        self.lease.fence(&mut event.metadata, token);
        self.store
            .append(KEY_ROTATION_STREAM, ExpectedVersion::Any, vec![event])
            .await?;
        tracing::info!(
            from = %key_fingerprint(in_force),
            to = %key_fingerprint(&own),
            tree_size = rotation.tree_size,
            "checkpoint key rotated"
        );
        metrics::counter!("aether_ledger_checkpoint_key_rotations_total").increment(1);
        self.in_force = Some(own);
        self.rotated_at = Some(rotation.tree_size);
        Ok(())
    }

    async fn last_size(&mut self) -> Result<u64, LedgerError> {
        match self.last_size {
            Some(size) => Ok(size),
            None => {
                let size = last_checkpoint_size(&self.store).await?;
                self.last_size = Some(size);
                Ok(size)
            }
        }
    }

    /// Reads everything committed so far, signing whenever `every_events` are uncovered.
    async fn catch_up(&mut self, committed: &mut watch::Receiver<u64>) -> Result<(), LedgerError> {
        loop {
            committed.borrow_and_update();
            let page = self
                .store
                .read_hashes_following(self.frontier.size() + 1, PAGE)
                .await?;
            // A short page is the end (no second read that finds nothing).
            let at_end = page.len() < PAGE as usize;
            for (_, hash) in &page {
                self.frontier.push(hash);
                let Some(token) = self.token() else {
                    continue;
                };
                if self.frontier.size() >= self.last_size().await? + self.every_events {
                    self.sign(token).await?;
                }
            }
            if at_end {
                return Ok(());
            }
        }
    }

    /// Signs if any event but the last checkpoint itself is uncovered.
    async fn sign_uncovered(&mut self) -> Result<(), LedgerError> {
        let Some(token) = self.token() else {
            return Ok(());
        };
        let last_size = self.last_size().await?;
        // The checkpoint event itself is the one uncovered event after a signing.
        let size = self.frontier.size();
        if size > last_size + 1 || (last_size == 0 && size > 0) {
            self.sign(token).await?;
        }
        Ok(())
    }
}

async fn sign(
    store: &EventStore,
    signer: &CheckpointSigner,
    frontier: &Frontier,
    lease: &HeldLease,
    token: u64,
) -> Result<u64, LedgerError> {
    let checkpoint = signer.sign(frontier.size(), frontier.root(), ledger_now());
    let mut event = checkpoint.to_event();
    lease.fence(&mut event.metadata, token);
    store
        .append(CHECKPOINT_STREAM, ExpectedVersion::Any, vec![event])
        .await?;
    metrics::counter!("aether_ledger_checkpoints_total").increment(1);
    metrics::gauge!("aether_ledger_checkpoint_tree_size").set(frontier.size() as f64);
    Ok(frontier.size())
}

/// Tree size of the newest checkpoint in the ledger (0 if none).
pub async fn last_checkpoint_size(store: &EventStore) -> Result<u64, LedgerError> {
    Ok(latest_checkpoint(store).await?.map_or(0, |c| c.tree_size))
}

//! Background task that appends a signed checkpoint every N events or T seconds.
//!
//! It follows the ledger's hashes (not whole events), keeps the Merkle frontier in memory,
//! and appends through the normal append path, so checkpoints are chained like any event.

use std::time::Duration;

use tokio::sync::watch;

use crate::checkpoint::{CHECKPOINT_STREAM, CheckpointSigner, SignedCheckpoint};
use crate::error::LedgerError;
use crate::event::{ExpectedVersion, ledger_now};
use crate::merkle::Frontier;
use crate::store::{Direction, EventStore};

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
pub async fn run_checkpointer(
    store: EventStore,
    signer: CheckpointSigner,
    policy: CheckpointPolicy,
    mut stop: watch::Receiver<bool>,
) -> Result<(), LedgerError> {
    let mut frontier = Frontier::new();
    let mut last_size = last_checkpoint_size(&store).await?;
    let mut committed = store.committed_seq();
    let mut ticker = tokio::time::interval(policy.every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Catch up with everything committed so far.
        loop {
            committed.borrow_and_update();
            let page = store
                .read_hashes_following(frontier.size() + 1, PAGE)
                .await?;
            // A short page is the end (no second read that finds nothing).
            let at_end = page.len() < PAGE as usize;
            for (_, hash) in &page {
                frontier.push(hash);
                if frontier.size() >= last_size + policy.every_events {
                    last_size = sign(&store, &signer, &frontier).await?;
                }
            }
            if at_end {
                break;
            }
        }
        if *stop.borrow() {
            // The checkpoint event itself is the one uncovered event after a signing.
            if frontier.size() > last_size + 1 || (last_size == 0 && frontier.size() > 0) {
                sign(&store, &signer, &frontier).await?;
            }
            return Ok(());
        }
        tokio::select! {
            _ = ticker.tick() => {
                if frontier.size() > last_size + 1 || (last_size == 0 && frontier.size() > 0) {
                    last_size = sign(&store, &signer, &frontier).await?;
                }
            }
            _ = committed.changed() => {}
            _ = stop.changed() => {}
            // Other processes may write the same database.
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

async fn sign(
    store: &EventStore,
    signer: &CheckpointSigner,
    frontier: &Frontier,
) -> Result<u64, LedgerError> {
    let checkpoint = signer.sign(frontier.size(), frontier.root(), ledger_now());
    store
        .append(
            CHECKPOINT_STREAM,
            ExpectedVersion::Any,
            vec![checkpoint.to_event()],
        )
        .await?;
    metrics::counter!("aether_ledger_checkpoints_total").increment(1);
    metrics::gauge!("aether_ledger_checkpoint_tree_size").set(frontier.size() as f64);
    Ok(frontier.size())
}

/// Tree size of the newest checkpoint in the ledger (0 if none).
pub async fn last_checkpoint_size(store: &EventStore) -> Result<u64, LedgerError> {
    let last = store
        .read_stream(CHECKPOINT_STREAM, u64::MAX, Direction::Backward, 1)
        .await?;
    Ok(last
        .first()
        .and_then(SignedCheckpoint::from_event)
        .and_then(Result::ok)
        .map_or(0, |c| c.tree_size))
}

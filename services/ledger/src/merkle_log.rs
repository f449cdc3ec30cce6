//! The ledger's Merkle log kept in memory: every event hash, so that roots, inclusion and
//! consistency proofs at any tree size cost O(log n) (about 64 bytes per event).
//!
//! Followers read hashes from the store (not whole events) and never write.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use crate::error::LedgerError;
use crate::hashing::Hash;
use crate::merkle::{MerkleProofs, MerkleTree, ProofError};
use crate::store::EventStore;

/// Hashes read per page while loading or following.
const PAGE: u32 = 10_000;

/// A shared, growing Merkle tree over the ledger's event hashes (leaf index = seq − 1).
#[derive(Clone, Default)]
pub struct MerkleLog {
    tree: Arc<RwLock<MerkleTree>>,
}

/// [`MerkleLog::proofs`].
#[derive(Clone, Copy, Debug)]
pub struct LogProofs<'a>(&'a MerkleLog);

impl MerkleProofs for LogProofs<'_> {
    fn root_at(&self, size: u64) -> Result<Hash, ProofError> {
        self.0.read(|t| t.root_at(size))
    }

    fn inclusion_proof(&self, index: u64, tree_size: u64) -> Result<Vec<Hash>, ProofError> {
        self.0.read(|t| t.inclusion_proof(index, tree_size))
    }

    fn consistency_proof(&self, old_size: u64, new_size: u64) -> Result<Vec<Hash>, ProofError> {
        self.0.read(|t| t.consistency_proof(old_size, new_size))
    }
}

impl std::fmt::Debug for MerkleLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MerkleLog({} leaves)", self.len())
    }
}

impl MerkleLog {
    /// Number of events in the log.
    pub fn len(&self) -> u64 {
        self.tree.read().map_or(0, |t| t.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Root of the first `tree_size` events.
    pub fn root_at(&self, tree_size: u64) -> Result<Hash, ProofError> {
        self.read(|t| t.root_at(tree_size))
    }

    /// Inclusion proof of event `seq` in the tree of `tree_size` events.
    pub fn inclusion_proof(&self, seq: u64, tree_size: u64) -> Result<Vec<Hash>, ProofError> {
        let index = seq.checked_sub(1).ok_or(ProofError::IndexOutOfRange {
            index: 0,
            tree_size,
        })?;
        self.read(|t| t.inclusion_proof(index, tree_size))
    }

    /// Consistency proof between the trees of `old_size` and `new_size` events.
    pub fn consistency_proof(&self, old_size: u64, new_size: u64) -> Result<Vec<Hash>, ProofError> {
        self.read(|t| t.consistency_proof(old_size, new_size))
    }

    /// The log's roots and proofs by leaf index, each answered under a brief read lock:
    /// for building a bundle of many proofs without copying the tree (~64 bytes per event)
    /// or holding the lock throughout. The log only grows, so proofs at a fixed size do not
    /// change between calls.
    pub fn proofs(&self) -> LogProofs<'_> {
        LogProofs(self)
    }

    fn read<T>(
        &self,
        f: impl FnOnce(&MerkleTree) -> Result<T, ProofError>,
    ) -> Result<T, ProofError> {
        match self.tree.read() {
            Ok(t) => f(&t),
            // A panic while appending cannot leave a half-pushed leaf visible to readers
            // of a consistent size, but refuse rather than guess.
            Err(_) => Err(ProofError::TreeSizeOutOfRange {
                tree_size: 0,
                available: 0,
            }),
        }
    }

    /// Reads every hash committed so far, in pages.
    pub async fn catch_up(&self, store: &EventStore) -> Result<u64, LedgerError> {
        loop {
            let next = self.len() + 1;
            let page = store.read_hashes_following(next, PAGE).await?;
            // A short page is the end (no second read that finds nothing).
            let at_end = page.len() < PAGE as usize;
            if let Ok(mut tree) = self.tree.write() {
                // Pages come in seq order from the current length on; anything else would
                // be a broken store, which `verify` reports. Hashes another catch-up added
                // meanwhile are skipped; the consecutive rest is added at once.
                let len = tree.len();
                let run: Vec<Hash> = page
                    .iter()
                    .skip_while(|(seq, _)| *seq <= len)
                    .zip(len + 1..)
                    .take_while(|((seq, _), want)| seq == want)
                    .map(|((_, hash), _)| *hash)
                    .collect();
                tree.extend(&run);
            }
            if at_end {
                return Ok(self.len());
            }
        }
    }

    /// Keeps the log up to date until `stop` turns true.
    pub async fn follow(
        self,
        store: EventStore,
        mut stop: watch::Receiver<bool>,
    ) -> Result<(), LedgerError> {
        let mut committed = store.committed_seq();
        loop {
            committed.borrow_and_update();
            self.catch_up(&store).await?;
            if *stop.borrow() {
                return Ok(());
            }
            tokio::select! {
                _ = committed.changed() => {}
                _ = stop.changed() => {}
                // Other processes may write the same database.
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log's proofs are the tree's, by leaf index, at every size it has reached, and a
    /// size it has not reached is refused rather than answered from a shorter tree.
    #[test]
    fn the_logs_proofs_are_the_trees() {
        let hashes: Vec<Hash> = (0u8..37).map(|i| [i; 32]).collect();
        let mut tree = MerkleTree::new();
        tree.extend(&hashes);
        let log = MerkleLog {
            tree: Arc::new(RwLock::new(tree.clone())),
        };
        let proofs = log.proofs();
        for size in 1..=37 {
            assert_eq!(
                MerkleProofs::root_at(&proofs, size),
                tree.root_at(size),
                "{size}"
            );
            for index in 0..size {
                assert_eq!(
                    MerkleProofs::inclusion_proof(&proofs, index, size),
                    tree.inclusion_proof(index, size)
                );
            }
            for old in 1..=size {
                assert_eq!(
                    MerkleProofs::consistency_proof(&proofs, old, size),
                    tree.consistency_proof(old, size)
                );
            }
        }
        assert!(MerkleProofs::root_at(&proofs, 38).is_err());
        assert!(MerkleProofs::inclusion_proof(&proofs, 0, 38).is_err());
    }
}

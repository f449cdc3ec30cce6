//! The ledger's Merkle log: roots, inclusion and consistency proofs at any tree size in
//! O(log n), following the store.
//!
//! [`MerkleLog::open`] keeps the event hashes in a file and in memory only the nodes at and
//! above 128-leaf blocks (about half a byte per event; see [`crate::merkle_file`]): what
//! `aether serve` runs. [`MerkleLog::default`] holds every hash in memory (~64 bytes per
//! event), for tools and tests on small ledgers. Followers read hashes from the store (not
//! whole events) and never write to it.

use std::path::Path;
use std::sync::{Arc, RwLock};

use tokio::sync::watch;

use crate::checkpoint::SignedCheckpoint;
use crate::checkpoint::latest_checkpoint;
use crate::error::LedgerError;
use crate::hashing::Hash;
use crate::merkle::{MerkleProofs, MerkleTree, ProofError, StoredNodes};
use crate::merkle_file::{BLOCK_LEVEL, PagedTree};
use crate::retrying::{RETRY_EVERY, Retrying};
use crate::store::EventStore;

/// Hashes read per page while loading or following.
const PAGE: u32 = 10_000;

/// A shared, growing Merkle tree over the ledger's event hashes (leaf index = seq − 1).
#[derive(Clone, Default)]
pub struct MerkleLog {
    tree: Arc<RwLock<Tree>>,
}

enum Tree {
    Memory(MerkleTree),
    File(PagedTree),
}

impl Default for Tree {
    fn default() -> Self {
        Tree::Memory(MerkleTree::new())
    }
}

impl Tree {
    fn nodes(&self) -> &dyn StoredNodes {
        match self {
            Tree::Memory(t) => t,
            Tree::File(t) => t,
        }
    }

    fn extend(&mut self, event_hashes: &[Hash]) -> Result<(), LedgerError> {
        match self {
            Tree::Memory(t) => {
                t.extend(event_hashes);
                Ok(())
            }
            Tree::File(t) => t.extend(event_hashes).map_err(merkle_file_error),
        }
    }
}

fn merkle_file_error(e: std::io::Error) -> LedgerError {
    LedgerError::MerkleFile(e.to_string())
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
    /// The log with its event hashes in the file at `path` (created if missing), brought
    /// up to date with `store`.
    ///
    /// The file is trusted only as this ledger's prefix, which two checks establish: its
    /// hashes after the latest signed checkpoint are the store's, and its root at that
    /// checkpoint's size is the signed root. If either fails (another ledger's file, a
    /// ledger restored from an older backup, pages lost in a power cut: the file is not
    /// synced, being derived), it is emptied and rebuilt from the store, with a warning.
    /// How many event hashes the file at `path` holds (0 when there is none), without
    /// opening the tree: the highest seq this node's Merkle log has seen.
    pub fn recorded_events(path: &Path) -> Result<u64, LedgerError> {
        match std::fs::metadata(path) {
            Ok(meta) => Ok(meta.len() / 32),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(LedgerError::MerkleFile(e.to_string())),
        }
    }

    pub async fn open(path: &Path, store: &EventStore) -> Result<MerkleLog, LedgerError> {
        let had = Self::recorded_events(path)?;
        let path = path.to_owned();
        let tree = tokio::task::spawn_blocking(move || PagedTree::open(&path, BLOCK_LEVEL))
            .await
            .map_err(|e| LedgerError::MerkleFile(e.to_string()))?
            .map_err(merkle_file_error)?;
        let log = MerkleLog {
            tree: Arc::new(RwLock::new(Tree::File(tree))),
        };
        let checkpoint = latest_checkpoint(store).await?;
        let signed_size = checkpoint.as_ref().map_or(0, |cp| cp.tree_size);
        if let Some(why) = log.disagreement_with_ledger(store, signed_size).await? {
            tracing::warn!(reason = %why, "Merkle log file rebuilt from the ledger");
            log.clear()?;
        }
        log.catch_up(store).await?;
        if had == 0 && !log.is_empty() {
            tracing::warn!(
                events = log.len(),
                "Merkle log file was missing or empty; rebuilt from the ledger"
            );
        }
        if let Some(why) = checkpoint.and_then(|cp| log.disagreement_with_checkpoint(&cp)) {
            tracing::warn!(reason = %why, "Merkle log file rebuilt from the ledger");
            log.clear()?;
            log.catch_up(store).await?;
        }
        Ok(log)
    }

    /// Why the file's event hashes from leaf `from` to its end are not the store's, if
    /// they are not.
    async fn disagreement_with_ledger(
        &self,
        store: &EventStore,
        from: u64,
    ) -> Result<Option<String>, LedgerError> {
        let len = self.len();
        let mut next = from.min(len);
        while next < len {
            let count = (len - next).min(u64::from(PAGE));
            let ours = {
                let tree = self.tree.read().map_err(|_| poisoned())?;
                match &*tree {
                    Tree::File(t) => t.event_hashes(next, count).map_err(merkle_file_error)?,
                    Tree::Memory(_) => return Ok(None),
                }
            };
            let stored = store
                .read_hashes_following(next + 1, u32::try_from(count).unwrap_or(PAGE))
                .await?;
            for (i, hash) in ours.iter().enumerate() {
                let seq = next + 1 + i as u64;
                match stored.get(i) {
                    Some((s, h)) if *s == seq && h == hash => {}
                    Some((s, _)) if *s == seq => {
                        return Ok(Some(format!(
                            "its event hash at seq {seq} is not the ledger's"
                        )));
                    }
                    _ => {
                        return Ok(Some(format!(
                            "it holds {len} event hashes; the ledger has no event at seq {seq}"
                        )));
                    }
                }
            }
            next += count;
        }
        Ok(None)
    }

    /// Why the log's root at the signed checkpoint's size is not its root, if it is not.
    fn disagreement_with_checkpoint(&self, cp: &SignedCheckpoint) -> Option<String> {
        match self.root_at(cp.tree_size) {
            Ok(root) if root == cp.root_hash => None,
            Ok(_) => Some(format!(
                "its root at the checkpoint's {} events is not the signed root",
                cp.tree_size
            )),
            // Not reached yet (written by another process after our catch-up), or the
            // file failed: only a wrong root is evidence against the file.
            Err(_) => None,
        }
    }

    fn clear(&self) -> Result<(), LedgerError> {
        let mut tree = self.tree.write().map_err(|_| poisoned())?;
        match &mut *tree {
            Tree::File(t) => t.clear().map_err(merkle_file_error),
            Tree::Memory(t) => {
                *t = MerkleTree::new();
                Ok(())
            }
        }
    }

    /// Number of events in the log.
    pub fn len(&self) -> u64 {
        self.tree.read().map_or(0, |t| t.nodes().leaves())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hashes the log holds in memory: about two per event without a file, one per 64
    /// events with one (not counting the few blocks it keeps after reading them back).
    pub fn resident_hashes(&self) -> usize {
        self.tree.read().map_or(0, |t| match &*t {
            Tree::Memory(t) => t.stored_nodes(),
            Tree::File(t) => t.resident_hashes(),
        })
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
    /// for building a bundle of many proofs without copying the tree or holding the lock
    /// throughout. The log only grows, so proofs at a fixed size do not change between
    /// calls.
    pub fn proofs(&self) -> LogProofs<'_> {
        LogProofs(self)
    }

    fn read<T>(
        &self,
        f: impl FnOnce(&dyn StoredNodes) -> Result<T, ProofError>,
    ) -> Result<T, ProofError> {
        match self.tree.read() {
            Ok(t) => f(t.nodes()),
            // A panic while appending cannot leave a half-pushed leaf visible to readers
            // of a consistent size, but refuse rather than guess.
            Err(_) => Err(ProofError::TreeSizeOutOfRange {
                tree_size: 0,
                available: 0,
            }),
        }
    }

    /// Repairs what `error` names, if it is a block of the file that no longer gives its
    /// root (changed or unreadable under the running log): the block's hashes are read
    /// from `store`, checked against the root in memory and written again. Returns whether
    /// it repaired anything, so that the caller can ask for its proof again.
    pub async fn repair(
        &self,
        store: &EventStore,
        error: &ProofError,
    ) -> Result<bool, LedgerError> {
        let ProofError::LeafFile { block, .. } = error else {
            return Ok(false);
        };
        let block = *block;
        let complete = {
            let tree = self.tree.read().map_err(|_| poisoned())?;
            match &*tree {
                Tree::File(t) => t.complete_block(block),
                Tree::Memory(_) => None,
            }
        };
        let Some((first, size)) = complete else {
            return Ok(false);
        };
        let count = u32::try_from(size).unwrap_or(u32::MAX);
        let stored = store.read_hashes_following(first + 1, count).await?;
        let hashes: Vec<Hash> = stored
            .iter()
            .zip(first + 1..)
            .take_while(|((seq, _), want)| seq == want)
            .map(|((_, hash), _)| *hash)
            .collect();
        let tree = self.tree.read().map_err(|_| poisoned())?;
        let Tree::File(t) = &*tree else {
            return Ok(false);
        };
        t.rewrite_block(block, &hashes)
            .map_err(|e| LedgerError::MerkleFile(e.to_string()))?;
        tracing::warn!(
            block,
            first_seq = first + 1,
            events = size,
            reason = %error,
            "Merkle log block rewritten from the ledger"
        );
        Ok(true)
    }

    /// Reads every hash committed so far, in pages.
    pub async fn catch_up(&self, store: &EventStore) -> Result<u64, LedgerError> {
        loop {
            let next = self.len() + 1;
            let page = store.read_hashes_following(next, PAGE).await?;
            // A short page is the end (no second read that finds nothing).
            let at_end = page.len() < PAGE as usize;
            {
                let mut tree = self.tree.write().map_err(|_| poisoned())?;
                // Pages come in seq order from the current length on; anything else would
                // be a broken store, which `verify` reports. Hashes another catch-up added
                // meanwhile are skipped; the consecutive rest is added at once.
                let len = tree.nodes().leaves();
                let run: Vec<Hash> = page
                    .iter()
                    .skip_while(|(seq, _)| *seq <= len)
                    .zip(len + 1..)
                    .take_while(|((seq, _), want)| seq == want)
                    .map(|((_, hash), _)| *hash)
                    .collect();
                tree.extend(&run)?;
            }
            if at_end {
                return Ok(self.len());
            }
        }
    }

    /// Keeps the log up to date until `stop` turns true. A failed catch-up (the database
    /// gone for a moment, a full disk under the file) is logged once and retried every
    /// second until it succeeds: the audit API's proofs depend on this task staying alive.
    pub async fn follow(self, store: EventStore, mut stop: watch::Receiver<bool>) {
        let mut committed = store.committed_seq();
        let mut retrying = Retrying::new(
            "Merkle log follower",
            "aether_ledger_merkle_follower_failing",
        );
        loop {
            committed.borrow_and_update();
            match self.catch_up(&store).await {
                Ok(len) => retrying.succeeded(len),
                Err(e) => retrying.failed(&e),
            }
            if *stop.borrow() {
                return;
            }
            if retrying.is_failing() {
                Retrying::wait(&mut stop).await;
                continue;
            }
            tokio::select! {
                _ = committed.changed() => {}
                _ = stop.changed() => {}
                // Other processes may write the same database.
                _ = tokio::time::sleep(RETRY_EVERY) => {}
            }
        }
    }
}

fn poisoned() -> LedgerError {
    LedgerError::MerkleFile("a writer of the Merkle log panicked".into())
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
            tree: Arc::new(RwLock::new(Tree::Memory(tree.clone()))),
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

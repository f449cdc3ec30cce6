//! The Merkle log's tree with its leaves in a file, so that its memory does not grow with
//! the ledger at 64 bytes per event (~33 GB a day at 6,000 decisions a second).
//!
//! The file holds the event hashes in leaf order, 32 bytes each, nothing else. The tree is
//! cut into blocks of `2^block_level` leaves: what stays in memory is every node at or above
//! the block level (about `64 / 2^block_level` bytes per event: half a byte at the default
//! 128-leaf blocks) and the leaves of the incomplete last block. A node below the block level
//! of a complete block is recomputed from the block's event hashes, read back from the file
//! (4 KiB at the default, in the page cache when recently used) and checked against the
//! block's root held in memory, so a changed file gives an error, never a wrong proof.
//!
//! The file is derived data: it is written without `fsync`, a torn last hash is cut off on
//! open, and [`crate::MerkleLog::open`] checks it against the ledger before trusting it.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::hashing::Hash;
use crate::merkle::{MerkleTree, ProofError, StoredNodes, push_node};

/// Leaves per block as a power of two: 128 event hashes, one 4 KiB page of the file.
pub(crate) const BLOCK_LEVEL: u32 = 7;

/// Blocks kept after being rebuilt: an export's proofs for neighbouring events share them.
const CACHED_BLOCKS: usize = 16;

/// Hashes read per chunk while rebuilding from the file on open.
const OPEN_CHUNK: usize = 32 * 1024;

const HASH_LEN: u64 = 32;

/// See the module documentation.
pub(crate) struct PagedTree {
    file: File,
    block_level: u32,
    /// Complete blocks: their leaves are in the file only.
    full_blocks: u64,
    /// `upper[j][i]`: root of the perfect subtree at level `block_level + j`, index `i`.
    upper: Vec<Vec<Hash>>,
    /// The incomplete last block (fewer than `2^block_level` leaves), in memory.
    tail: MerkleTree,
    /// Recently rebuilt blocks, newest last.
    cache: Mutex<VecDeque<(u64, Arc<MerkleTree>)>>,
}

impl PagedTree {
    /// An empty tree on an unnamed temporary file (in `TMPDIR`), gone when the tree is
    /// dropped: for one pass over a ledger that must not hold every hash in memory.
    pub(crate) fn scratch(block_level: u32) -> io::Result<Self> {
        Ok(Self::on(tempfile::tempfile()?, block_level))
    }

    fn on(file: File, block_level: u32) -> Self {
        PagedTree {
            file,
            block_level,
            full_blocks: 0,
            upper: Vec::new(),
            tail: MerkleTree::new(),
            cache: Mutex::new(VecDeque::new()),
        }
    }

    /// Opens (or creates) the file at `path` and rebuilds the levels kept in memory from it;
    /// a torn last hash (a crash mid-write) is cut off.
    pub(crate) fn open(path: &Path, block_level: u32) -> io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        let bytes = file.metadata()?.len();
        let whole = bytes - bytes % HASH_LEN;
        if whole != bytes {
            file.set_len(whole)?;
        }
        let mut tree = Self::on(file, block_level);
        let mut reader = tree.file.try_clone()?;
        let mut bytes = vec![0u8; OPEN_CHUNK * HASH_LEN as usize];
        let mut left = whole;
        while left > 0 {
            let n = usize::try_from(left).map_or(bytes.len(), |l| l.min(bytes.len()));
            let chunk = &mut bytes[..n];
            reader.read_exact(chunk)?;
            tree.absorb(&hashes_of(chunk));
            left -= n as u64;
        }
        Ok(tree)
    }

    /// Number of leaves.
    pub(crate) fn len(&self) -> u64 {
        (self.full_blocks << self.block_level) + self.tail.len()
    }

    fn block_size(&self) -> u64 {
        1 << self.block_level
    }

    /// Appends event hashes: written to the file first, so that on a write error (a full
    /// disk) the tree is unchanged and the next call writes the same place again.
    pub(crate) fn extend(&mut self, event_hashes: &[Hash]) -> io::Result<()> {
        if event_hashes.is_empty() {
            return Ok(());
        }
        let bytes: Vec<u8> = event_hashes.iter().flatten().copied().collect();
        self.file.write_all_at(&bytes, self.len() * HASH_LEN)?;
        self.absorb(event_hashes);
        Ok(())
    }

    /// Forgets every leaf, in the file and in memory.
    pub(crate) fn clear(&mut self) -> io::Result<()> {
        self.file.set_len(0)?;
        self.full_blocks = 0;
        self.upper.clear();
        self.tail = MerkleTree::new();
        if let Ok(mut cache) = self.cache.lock() {
            cache.clear();
        }
        Ok(())
    }

    /// The `count` event hashes from leaf `from` on, read from the file (fewer past its end).
    pub(crate) fn event_hashes(&self, from: u64, count: u64) -> io::Result<Vec<Hash>> {
        let count = count.min(self.len().saturating_sub(from));
        let mut bytes = vec![0u8; usize::try_from(count * HASH_LEN).map_err(io::Error::other)?];
        self.file.read_exact_at(&mut bytes, from * HASH_LEN)?;
        Ok(hashes_of(&bytes))
    }

    /// Hashes held in memory (nodes, not counting the block cache): what the log costs.
    pub(crate) fn resident_hashes(&self) -> usize {
        self.upper.iter().map(Vec::len).sum::<usize>() + self.tail.stored_nodes()
    }

    /// Adds event hashes to the levels in memory (they are already in the file).
    fn absorb(&mut self, mut event_hashes: &[Hash]) {
        let block = self.block_size();
        while !event_hashes.is_empty() {
            let room = usize::try_from(block - self.tail.len()).unwrap_or(usize::MAX);
            let (now, rest) = event_hashes.split_at(room.min(event_hashes.len()));
            self.tail.extend(now);
            event_hashes = rest;
            if self.tail.len() == block {
                let full = std::mem::take(&mut self.tail);
                if let Ok(root) = full.root_at(block) {
                    push_node(&mut self.upper, root);
                }
                self.full_blocks += 1;
            }
        }
    }

    /// The first leaf of complete block `block` and the block's size, if it is complete.
    pub(crate) fn complete_block(&self, block: u64) -> Option<(u64, u64)> {
        (block < self.full_blocks).then(|| (block << self.block_level, self.block_size()))
    }

    /// Writes complete block `block`'s event hashes again (from the ledger, after the file
    /// was found changed), once they are shown to hash to the block's root in memory.
    pub(crate) fn rewrite_block(
        &self,
        block: u64,
        event_hashes: &[Hash],
    ) -> Result<(), ProofError> {
        let failed = |reason: String| ProofError::LeafFile { block, reason };
        let Some((first, size)) = self.complete_block(block) else {
            return Err(failed("not a complete block".into()));
        };
        if event_hashes.len() as u64 != size {
            return Err(failed(format!(
                "{} hashes given for a block of {size}",
                event_hashes.len()
            )));
        }
        let tree = MerkleTree::from_event_hashes(event_hashes);
        if tree.root_at(size)? != self.node(self.block_level, block)? {
            return Err(failed(
                "the hashes given do not hash to the block's root held in memory".into(),
            ));
        }
        let bytes: Vec<u8> = event_hashes.iter().flatten().copied().collect();
        self.file
            .write_all_at(&bytes, first * HASH_LEN)
            .map_err(|e| failed(e.to_string()))
    }

    /// Complete block `block`, rebuilt from the file (or the cache) and checked against
    /// its root in memory.
    fn block(&self, block: u64) -> Result<Arc<MerkleTree>, ProofError> {
        if let Some(hit) = self.cache.lock().ok().and_then(|cache| {
            cache
                .iter()
                .find(|(b, _)| *b == block)
                .map(|(_, tree)| Arc::clone(tree))
        }) {
            return Ok(hit);
        }
        let failed = |reason: String| ProofError::LeafFile { block, reason };
        let size = self.block_size();
        let mut bytes = vec![0u8; (size * HASH_LEN) as usize];
        self.file
            .read_exact_at(&mut bytes, (block << self.block_level) * HASH_LEN)
            .map_err(|e| failed(e.to_string()))?;
        let tree = MerkleTree::from_event_hashes(&hashes_of(&bytes));
        let expected = self.node(self.block_level, block)?;
        if tree.root_at(size)? != expected {
            return Err(failed(
                "its event hashes do not hash to the block's root held in memory: the file \
                 was changed under the running log"
                    .into(),
            ));
        }
        let tree = Arc::new(tree);
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() == CACHED_BLOCKS {
                cache.pop_front();
            }
            cache.push_back((block, Arc::clone(&tree)));
        }
        Ok(tree)
    }
}

/// The 32-byte hashes laid end to end in `bytes`.
fn hashes_of(bytes: &[u8]) -> Vec<Hash> {
    bytes
        .chunks_exact(32)
        .map(|c| {
            let mut h = [0u8; 32];
            h.copy_from_slice(c);
            h
        })
        .collect()
}

impl StoredNodes for PagedTree {
    fn leaves(&self) -> u64 {
        self.len()
    }

    fn node(&self, level: u32, index: u64) -> Result<Hash, ProofError> {
        let missing = ProofError::MissingNode { level, index };
        if level >= self.block_level {
            return self
                .upper
                .get((level - self.block_level) as usize)
                .zip(usize::try_from(index).ok())
                .and_then(|(nodes, i)| nodes.get(i))
                .copied()
                .ok_or(missing);
        }
        let shift = self.block_level - level;
        let block = index >> shift;
        let within = index - (block << shift);
        match block.cmp(&self.full_blocks) {
            std::cmp::Ordering::Less => self.block(block)?.node(level, within),
            std::cmp::Ordering::Equal => self.tail.node(level, within),
            std::cmp::Ordering::Greater => Err(missing),
        }
    }
}

impl std::fmt::Debug for PagedTree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedTree")
            .field("len", &self.len())
            .field("block_level", &self.block_level)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sm3::{Digest, Sm3};

    fn event(i: u64) -> Hash {
        Sm3::digest(i.to_be_bytes()).into()
    }

    fn events(n: u64) -> Vec<Hash> {
        (0..n).map(event).collect()
    }

    /// Every root, inclusion and consistency proof of `paged` equals the in-memory tree's.
    fn assert_same_as_memory(paged: &PagedTree, hashes: &[Hash]) {
        let memory = MerkleTree::from_event_hashes(hashes);
        let n = hashes.len() as u64;
        assert_eq!(paged.len(), n);
        for size in 1..=n {
            assert_eq!(StoredNodes::root_at(paged, size), memory.root_at(size));
            for index in 0..size {
                assert_eq!(
                    StoredNodes::inclusion_proof(paged, index, size),
                    memory.inclusion_proof(index, size),
                    "inclusion of {index} at {size}"
                );
            }
            for old in 1..=size {
                assert_eq!(
                    StoredNodes::consistency_proof(paged, old, size),
                    memory.consistency_proof(old, size),
                    "consistency {old} → {size}"
                );
            }
        }
        assert!(StoredNodes::root_at(paged, n + 1).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Appended in any chunks, across block boundaries, the paged tree answers exactly
        /// as the tree held wholly in memory; so does the same file opened again.
        #[test]
        fn proofs_equal_the_in_memory_trees(
            chunks in proptest::collection::vec(0usize..13, 1..8),
            block_level in 1u32..4,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("hashes");
            let mut paged = PagedTree::open(&path, block_level).unwrap();
            let mut all = Vec::new();
            for len in chunks {
                let chunk: Vec<Hash> = (all.len() as u64..(all.len() + len) as u64).map(event).collect();
                paged.extend(&chunk).unwrap();
                all.extend(chunk);
            }
            assert_same_as_memory(&paged, &all);
            drop(paged);
            let reopened = PagedTree::open(&path, block_level).unwrap();
            assert_same_as_memory(&reopened, &all);
        }
    }

    /// Memory holds the nodes above the block level and the last block's, not the leaves:
    /// at 128-leaf blocks about one hash per 64 events.
    #[test]
    fn memory_holds_a_sixty_fourth_of_the_hashes() {
        let dir = tempfile::tempdir().unwrap();
        let mut paged = PagedTree::open(&dir.path().join("h"), BLOCK_LEVEL).unwrap();
        let n = 100_000u64;
        paged.extend(&events(n)).unwrap();
        let memory = MerkleTree::from_event_hashes(&events(n));
        assert_eq!(paged.root_at(n), memory.root_at(n));
        let resident = paged.resident_hashes();
        assert!(
            resident <= (n as usize) / 64 + 2 * 128,
            "{resident} hashes in memory for {n} events"
        );
        assert!(memory.stored_nodes() >= 2 * n as usize - 64);
        assert_eq!(
            std::fs::metadata(dir.path().join("h")).unwrap().len(),
            n * 32
        );
    }

    /// A crash mid-write leaves part of a hash: opening cuts it off and goes on from the
    /// last whole one.
    #[test]
    fn a_torn_last_hash_is_cut_off_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h");
        let mut paged = PagedTree::open(&path, 2).unwrap();
        paged.extend(&events(9)).unwrap();
        drop(paged);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[7u8; 13]);
        std::fs::write(&path, &bytes).unwrap();
        let mut reopened = PagedTree::open(&path, 2).unwrap();
        assert_eq!(reopened.len(), 9);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 9 * 32);
        reopened.extend(&events(12)[9..]).unwrap();
        assert_same_as_memory(&reopened, &events(12));
    }

    /// A file changed under the running log gives an error naming the block, not a proof
    /// built from the changed hashes.
    #[test]
    fn a_changed_file_gives_an_error_not_a_wrong_proof() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h");
        let mut paged = PagedTree::open(&path, 2).unwrap();
        paged.extend(&events(10)).unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[5 * 32 + 3] ^= 1; // leaf 5: block 1
        std::fs::write(&path, &bytes).unwrap();
        match StoredNodes::inclusion_proof(&paged, 5, 10) {
            Err(ProofError::LeafFile { block: 1, .. }) => {}
            other => panic!("expected a leaf-file error, got {other:?}"),
        }
        // Blocks the change did not touch still prove.
        let memory = MerkleTree::from_event_hashes(&events(10));
        assert_eq!(
            StoredNodes::inclusion_proof(&paged, 9, 10),
            memory.inclusion_proof(9, 10)
        );
    }
}

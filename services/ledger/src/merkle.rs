//! Merkle log over the ledger's event hashes, as defined by RFC 6962 §2.1 and
//! RFC 9162 §2.1, with SM3 in place of SHA-256.
//!
//! The leaves are the 32-byte *event hashes* of the ledger (leaf index =
//! ledger seq − 1). This module applies the RFC's domain separation itself:
//! a leaf is `SM3(0x00 ‖ event_hash)` and an interior node is
//! `SM3(0x01 ‖ left ‖ right)`, so an interior node can never be passed off as
//! a leaf (second-preimage protection). The empty tree's root is `SM3("")`,
//! the RFC's `MTH({})`.
//!
//! The module has three layers:
//! - reference functions ([`root`], [`inclusion_proof`], [`consistency_proof`])
//!   written straight from the RFC's recursive definitions: O(n), obviously
//!   correct, and the oracle the fast structures are tested against;
//! - verifiers ([`verify_inclusion`], [`verify_consistency`]) following the
//!   RFC 9162 algorithms. They take attacker-controlled input, check every size
//!   and the proof length up front and never panic;
//! - [`Frontier`] (incremental root in O(log n) memory) and [`MerkleTree`]
//!   (every complete subtree in memory, O(log n) roots and proofs at any size); the
//!   proofs are written once, over any `StoredNodes`, which the ledger's file-backed
//!   log also implements.
//!
//! Conventions for degenerate sizes (RFC 6962 §2.1.2 defines `PROOF(m, D[n])`
//! for `0 < m < n`, and RFC 9162 §2.1.4.2 rejects an empty proof):
//! - consistency from `old_size == 0` is rejected with [`ProofError::BadSizes`]
//!   by both the provers and the verifier: every tree is trivially consistent
//!   with the empty one, so such a "proof" proves nothing and is most likely a
//!   caller bug;
//! - `old_size > new_size` is [`ProofError::BadSizes`];
//! - `old_size == new_size` gives an empty proof, which verifies iff the two
//!   roots are equal (the RFC 9162 algorithm alone would reject the empty
//!   proof; any non-empty proof is rejected here).
//!
//! An inclusion proof does not bind the tree size on its own: the verifier
//! must check it against the root *of the claimed size* (e.g. from a signed
//! checkpoint).

use std::fmt;

use crate::sm3_lanes::sm3_many;
use sm3::{Digest, Sm3};

/// A 32-byte SM3 digest: an event hash, a leaf hash or an interior node hash.
pub type Hash = [u8; 32];

/// RFC 6962 domain-separation prefix of leaf hashes.
const LEAF_PREFIX: u8 = 0x00;
/// RFC 6962 domain-separation prefix of interior node hashes.
const NODE_PREFIX: u8 = 0x01;

/// Why a proof could not be produced or did not verify.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProofError {
    /// The leaf index is not inside the tree of the requested size.
    #[error("leaf index {index} is out of range for a tree of size {tree_size}")]
    IndexOutOfRange {
        /// Requested leaf index (0-based).
        index: u64,
        /// Size of the tree the index was checked against.
        tree_size: u64,
    },
    /// The requested tree size is larger than the number of leaves held.
    #[error("tree size {tree_size} exceeds the {available} leaves available")]
    TreeSizeOutOfRange {
        /// Requested tree size.
        tree_size: u64,
        /// Number of leaves actually available.
        available: u64,
    },
    /// A consistency proof needs `0 < old_size <= new_size`.
    #[error(
        "invalid consistency sizes: old size {old_size}, new size {new_size} \
         (need 0 < old size <= new size)"
    )]
    BadSizes {
        /// Size of the older tree.
        old_size: u64,
        /// Size of the newer tree.
        new_size: u64,
    },
    /// The proof is truncated or extended: its length is fixed by the sizes.
    #[error("proof has {actual} hashes but {expected} were expected for these sizes")]
    WrongProofLength {
        /// Number of hashes the sizes call for.
        expected: usize,
        /// Number of hashes supplied.
        actual: usize,
    },
    /// The inclusion proof does not lead from the leaf to the given root.
    #[error("inclusion proof does not lead to the given root")]
    RootMismatch,
    /// The consistency proof does not reproduce the given old root.
    #[error("consistency proof does not reproduce the given old root")]
    OldRootMismatch,
    /// The consistency proof does not reproduce the given new root (for equal
    /// sizes: the two given roots differ).
    #[error("consistency proof does not reproduce the given new root")]
    NewRootMismatch,
    /// A [`MerkleTree`] lacks a node it should hold; an internal invariant is
    /// broken. Reported instead of panicking.
    #[error("merkle tree has no node {index} at level {level} (internal invariant broken)")]
    MissingNode {
        /// Level of the missing node (0 = leaves).
        level: u32,
        /// Index of the missing node within its level.
        index: u64,
    },
    /// The Merkle log's file could not give back a block of event hashes a proof needs,
    /// or what it gave does not hash to the block's root held in memory. The log's state,
    /// not the request, is at fault; no proof is given rather than a wrong one.
    #[error("the Merkle log's file failed at block {block}: {reason}")]
    LeafFile {
        /// Index of the block of leaves.
        block: u64,
        /// What went wrong.
        reason: String,
    },
}

/// RFC 6962 leaf hash `SM3(0x00 ‖ event_hash)`; the prefix keeps leaves and
/// interior nodes in separate domains.
#[must_use]
pub fn leaf_hash(event_hash: &Hash) -> Hash {
    Sm3::new()
        .chain_update([LEAF_PREFIX])
        .chain_update(event_hash)
        .finalize()
        .into()
}

/// RFC 6962 interior node hash `SM3(0x01 ‖ left ‖ right)`.
#[must_use]
pub fn node_hash(left: &Hash, right: &Hash) -> Hash {
    Sm3::new()
        .chain_update([NODE_PREFIX])
        .chain_update(left)
        .chain_update(right)
        .finalize()
        .into()
}

/// Root of the empty tree, `SM3("")`, as RFC 6962 defines `MTH({})`.
#[must_use]
pub fn empty_root() -> Hash {
    Sm3::digest([]).into()
}

/// Largest power of two strictly smaller than `n` (the RFC's `k`); 0 for n < 2.
fn split_u64(n: u64) -> u64 {
    n.saturating_sub(1)
        .checked_ilog2()
        .map_or(0, |bit| 1 << bit)
}

/// [`split_u64`] for slice lengths.
fn split_usize(n: usize) -> usize {
    n.saturating_sub(1)
        .checked_ilog2()
        .map_or(0, |bit| 1 << bit)
}

/// Consistency proofs are defined for `0 < old_size <= new_size` (see the
/// module docs for why 0 is rejected).
fn check_sizes(old_size: u64, new_size: u64) -> Result<(), ProofError> {
    if old_size == 0 || old_size > new_size {
        return Err(ProofError::BadSizes { old_size, new_size });
    }
    Ok(())
}

/// The first `tree_size` event hashes, or why there are not that many.
fn prefix(event_hashes: &[Hash], tree_size: u64) -> Result<&[Hash], ProofError> {
    usize::try_from(tree_size)
        .ok()
        .and_then(|n| event_hashes.get(..n))
        .ok_or(ProofError::TreeSizeOutOfRange {
            tree_size,
            available: event_hashes.len() as u64,
        })
}

/// Reference implementation straight from the RFC's recursive definition (MTH); O(n).
#[must_use]
pub fn root(event_hashes: &[Hash]) -> Hash {
    match event_hashes {
        [] => empty_root(),
        [leaf] => leaf_hash(leaf),
        _ => match event_hashes.split_at_checked(split_usize(event_hashes.len())) {
            Some((left, right)) => node_hash(&root(left), &root(right)),
            None => empty_root(), // unreachable: k < n
        },
    }
}

/// Reference RFC 6962 `PATH(m, D[n])` over the first `tree_size` event hashes:
/// the audit path of leaf `index`, leaf to root. O(n).
pub fn inclusion_proof(
    event_hashes: &[Hash],
    index: u64,
    tree_size: u64,
) -> Result<Vec<Hash>, ProofError> {
    if index >= tree_size {
        return Err(ProofError::IndexOutOfRange { index, tree_size });
    }
    let leaves = prefix(event_hashes, tree_size)?;
    // index < tree_size <= leaves.len(), so it fits in usize.
    let m = usize::try_from(index).map_err(|_| ProofError::IndexOutOfRange { index, tree_size })?;
    let mut proof = Vec::new();
    reference_path(m, leaves, &mut proof);
    Ok(proof)
}

/// `PATH(m, D)` appended to `proof` (deepest element first).
fn reference_path(m: usize, leaves: &[Hash], proof: &mut Vec<Hash>) {
    if leaves.len() <= 1 {
        return;
    }
    let k = split_usize(leaves.len());
    let Some((left, right)) = leaves.split_at_checked(k) else {
        return;
    };
    if m < k {
        reference_path(m, left, proof);
        proof.push(root(right));
    } else {
        reference_path(m - k, right, proof);
        proof.push(root(left));
    }
}

/// Reference RFC 6962 `PROOF(m, D[n])` with m = `old_size`, n = `new_size`:
/// the consistency proof between the first `old_size` and the first
/// `new_size` event hashes. O(n).
pub fn consistency_proof(
    event_hashes: &[Hash],
    old_size: u64,
    new_size: u64,
) -> Result<Vec<Hash>, ProofError> {
    check_sizes(old_size, new_size)?;
    let leaves = prefix(event_hashes, new_size)?;
    // old_size <= new_size <= leaves.len(), so it fits in usize.
    let m = usize::try_from(old_size).map_err(|_| ProofError::BadSizes { old_size, new_size })?;
    let mut proof = Vec::new();
    reference_subproof(m, leaves, true, &mut proof);
    Ok(proof)
}

/// `SUBPROOF(m, D, b)` appended to `proof`; `complete` is the RFC's `b`
/// (whether `D[0:m]` is the whole old tree, whose root the verifier has).
fn reference_subproof(m: usize, leaves: &[Hash], complete: bool, proof: &mut Vec<Hash>) {
    if m == leaves.len() {
        if !complete {
            proof.push(root(leaves));
        }
        return;
    }
    let k = split_usize(leaves.len());
    let Some((left, right)) = leaves.split_at_checked(k) else {
        return;
    };
    if m <= k {
        reference_subproof(m, left, complete, proof);
        proof.push(root(right));
    } else {
        reference_subproof(m - k, right, false, proof);
        proof.push(root(left));
    }
}

/// One step of the RFC 9162 proof walk (§2.1.3.2 step 4, §2.1.4.2 step 6) on
/// `fn`/`sn`: says whether this step's proof element is a left sibling, then
/// advances both. Shared by the length computation and the verifiers so the
/// two cannot disagree.
fn walk_step(first: &mut u64, second: &mut u64) -> bool {
    let left_sibling = *first & 1 == 1 || *first == *second;
    if left_sibling {
        // Skip levels where the node is the last one and has no right sibling.
        while *first & 1 == 0 && *first != 0 {
            *first >>= 1;
            *second >>= 1;
        }
    }
    *first >>= 1;
    *second >>= 1;
    left_sibling
}

/// Number of proof elements the RFC 9162 walk consumes from (`fn`, `sn`)
/// until `sn` reaches 0; at most 64.
fn walk_len(mut first: u64, mut second: u64) -> usize {
    let mut len = 0;
    while second != 0 {
        walk_step(&mut first, &mut second);
        len += 1;
    }
    len
}

/// Folds `path` into `second_root` (and into `first_root` when tracking the
/// old root of a consistency proof) per RFC 9162. `None` if the path does not
/// end exactly where `sn` reaches 0.
fn walk(
    mut first: u64,
    mut second: u64,
    mut first_root: Option<Hash>,
    mut second_root: Hash,
    path: &[Hash],
) -> Option<(Option<Hash>, Hash)> {
    for sibling in path {
        if second == 0 {
            return None;
        }
        if walk_step(&mut first, &mut second) {
            if let Some(fr) = first_root.as_mut() {
                *fr = node_hash(sibling, fr);
            }
            second_root = node_hash(sibling, &second_root);
        } else {
            second_root = node_hash(&second_root, sibling);
        }
    }
    (second == 0).then_some((first_root, second_root))
}

/// Verifies that `event_hash` is leaf `index` of the tree of size `tree_size`
/// with root `root` (RFC 9162 §2.1.3.2). The proof length is checked against
/// the one the sizes dictate before any hashing.
pub fn verify_inclusion(
    event_hash: &Hash,
    index: u64,
    tree_size: u64,
    proof: &[Hash],
    root: &Hash,
) -> Result<(), ProofError> {
    if index >= tree_size {
        return Err(ProofError::IndexOutOfRange { index, tree_size });
    }
    let last = tree_size - 1;
    let expected = walk_len(index, last);
    let wrong_length = ProofError::WrongProofLength {
        expected,
        actual: proof.len(),
    };
    if proof.len() != expected {
        return Err(wrong_length);
    }
    let (_, computed) =
        walk(index, last, None, leaf_hash(event_hash), proof).ok_or(wrong_length)?;
    if computed != *root {
        return Err(ProofError::RootMismatch);
    }
    Ok(())
}

/// Verifies that the tree of size `new_size` with root `new_root` extends the
/// tree of size `old_size` with root `old_root` (RFC 9162 §2.1.4.2). Needs
/// `0 < old_size <= new_size`; equal sizes need an empty proof and equal roots.
pub fn verify_consistency(
    old_size: u64,
    new_size: u64,
    old_root: &Hash,
    new_root: &Hash,
    proof: &[Hash],
) -> Result<(), ProofError> {
    check_sizes(old_size, new_size)?;
    if old_size == new_size {
        if !proof.is_empty() {
            return Err(ProofError::WrongProofLength {
                expected: 0,
                actual: proof.len(),
            });
        }
        if old_root != new_root {
            return Err(ProofError::NewRootMismatch);
        }
        return Ok(());
    }
    // Here 0 < old_size < new_size.
    let (mut first, mut second) = (old_size - 1, new_size - 1);
    while first & 1 == 1 {
        first >>= 1;
        second >>= 1;
    }
    // When the old tree is a complete subtree of the new one its root is the
    // walk's seed and the proof omits it (RFC 9162 step 2).
    let old_is_subtree = old_size.is_power_of_two();
    let expected = walk_len(first, second) + usize::from(!old_is_subtree);
    let wrong_length = ProofError::WrongProofLength {
        expected,
        actual: proof.len(),
    };
    if proof.len() != expected {
        return Err(wrong_length);
    }
    let (seed, rest) = if old_is_subtree {
        (*old_root, proof)
    } else {
        match proof.split_first() {
            Some((seed, rest)) => (*seed, rest),
            None => return Err(wrong_length),
        }
    };
    let (first_root, second_root) =
        walk(first, second, Some(seed), seed, rest).ok_or(wrong_length)?;
    if first_root != Some(*old_root) {
        return Err(ProofError::OldRootMismatch);
    }
    if second_root != *new_root {
        return Err(ProofError::NewRootMismatch);
    }
    Ok(())
}

/// Incremental root over an append-only sequence using O(log n) memory (the "frontier"/compact range): used by the ledger writer and by the verifier streaming 1M events.
///
/// Keeps one "peak" per set bit of the size: the roots of the perfect
/// subtrees the tree decomposes into, which is all the RFC's `MTH` needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frontier {
    /// Peaks, largest (leftmost) first.
    peaks: Vec<Hash>,
    /// Number of leaves pushed.
    size: u64,
}

impl Frontier {
    /// Frontier of the empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one event hash; amortised O(1) hashes, at most O(log n).
    pub fn push(&mut self, event_hash: &Hash) {
        let mut node = leaf_hash(event_hash);
        // Like a binary increment: every trailing 1 bit of the size is a peak
        // of equal height that merges with the new node.
        let mut carry = self.size;
        while carry & 1 == 1 {
            let Some(left) = self.peaks.pop() else { break };
            node = node_hash(&left, &node);
            carry >>= 1;
        }
        self.peaks.push(node);
        self.size += 1;
    }

    /// Number of leaves pushed.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Root of the tree of all pushed leaves (`MTH`), folding the peaks right
    /// to left; O(log n).
    pub fn root(&self) -> Hash {
        let mut peaks = self.peaks.iter().rev();
        match peaks.next() {
            None => empty_root(),
            Some(last) => peaks.fold(*last, |acc, peak| node_hash(peak, &acc)),
        }
    }
}

/// Whole tree kept in memory level by level (only complete subtrees' nodes are stored), built once in O(n) and appendable, so that roots at any size ≤ len, inclusion proofs and consistency proofs are O(log n) each (the audit API needs p99 ≤ 1 ms at 1,000,000 leaves).
///
/// `levels[l][i]` is the root of the perfect subtree over leaves
/// `[i·2^l, (i+1)·2^l)`, so level `l` holds `⌊len / 2^l⌋` nodes. Every subtree
/// the RFC recursion visits for a size ≤ len is either such a perfect subtree
/// or splits into O(log n) of them, and appending never changes a stored node.
/// Memory: about 2·32 bytes per leaf (64 MB at 1,000,000 leaves).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct MerkleTree {
    levels: Vec<Vec<Hash>>,
}

/// Roots and proofs of a Merkle tree at any size it has reached: what an evidence bundle
/// needs. [`MerkleTree`] answers them directly; [`crate::MerkleLog::proofs`] answers each
/// under a brief read lock of the shared log, so that a bundle neither copies every hash
/// nor holds the log's follower off for its whole build. Leaves are counted from 0.
pub trait MerkleProofs {
    /// Root of the first `size` leaves.
    fn root_at(&self, size: u64) -> Result<Hash, ProofError>;
    /// Inclusion proof of leaf `index` in the tree of `tree_size` leaves.
    fn inclusion_proof(&self, index: u64, tree_size: u64) -> Result<Vec<Hash>, ProofError>;
    /// Consistency proof between the trees of `old_size` and `new_size` leaves.
    fn consistency_proof(&self, old_size: u64, new_size: u64) -> Result<Vec<Hash>, ProofError>;
}

impl MerkleProofs for MerkleTree {
    fn root_at(&self, size: u64) -> Result<Hash, ProofError> {
        MerkleTree::root_at(self, size)
    }

    fn inclusion_proof(&self, index: u64, tree_size: u64) -> Result<Vec<Hash>, ProofError> {
        MerkleTree::inclusion_proof(self, index, tree_size)
    }

    fn consistency_proof(&self, old_size: u64, new_size: u64) -> Result<Vec<Hash>, ProofError> {
        MerkleTree::consistency_proof(self, old_size, new_size)
    }
}

impl fmt::Debug for MerkleTree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The levels can hold millions of hashes: show the size only.
        f.debug_struct("MerkleTree")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl MerkleTree {
    /// Empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds the tree over `event_hashes` level by level in O(n) hashes.
    pub fn from_event_hashes(event_hashes: &[Hash]) -> Self {
        let mut tree = Self::new();
        tree.extend(event_hashes);
        tree
    }

    /// Appends many event hashes; the same tree as [`push`](Self::push) one by one, but
    /// each level's new nodes are hashed together on SIMD lanes ([`sm3_many`]).
    pub fn extend(&mut self, event_hashes: &[Hash]) {
        let mut messages = Vec::with_capacity(event_hashes.len() * 33);
        for h in event_hashes {
            messages.push(LEAF_PREFIX);
            messages.extend_from_slice(h);
        }
        let mut added = sm3_many(&messages.chunks(33).collect::<Vec<_>>());
        let mut level = 0;
        while !added.is_empty() {
            if self.levels.len() == level {
                self.levels.push(Vec::new());
            }
            let Some(nodes) = self.levels.get_mut(level) else {
                return;
            };
            let before = nodes.len();
            nodes.extend(added);
            // Pairs whose right half is new: their parents are new one level up.
            messages.clear();
            for pair in nodes[before / 2 * 2..].chunks_exact(2) {
                messages.push(NODE_PREFIX);
                messages.extend_from_slice(&pair[0]);
                messages.extend_from_slice(&pair[1]);
            }
            added = sm3_many(&messages.chunks(65).collect::<Vec<_>>());
            level += 1;
        }
    }

    /// Appends one event hash; amortised O(1) hashes, at most O(log n).
    pub fn push(&mut self, event_hash: &Hash) {
        push_node(&mut self.levels, leaf_hash(event_hash));
    }

    /// Number of leaves.
    pub fn len(&self) -> u64 {
        self.levels.first().map_or(0, |leaves| leaves.len() as u64)
    }

    /// Whether the tree has no leaves.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Hashes held, at every level: about two per leaf.
    pub fn stored_nodes(&self) -> usize {
        self.levels.iter().map(Vec::len).sum()
    }

    /// Root (`MTH`) of the tree made of the first `size` leaves; O(log n).
    pub fn root_at(&self, size: u64) -> Result<Hash, ProofError> {
        StoredNodes::root_at(self, size)
    }

    /// RFC 6962 `PATH(index, D[tree_size])`, equal to [`inclusion_proof`]; O(log n).
    pub fn inclusion_proof(&self, index: u64, tree_size: u64) -> Result<Vec<Hash>, ProofError> {
        StoredNodes::inclusion_proof(self, index, tree_size)
    }

    /// RFC 6962 `PROOF(old_size, D[new_size])`, equal to [`consistency_proof`]; O(log n).
    pub fn consistency_proof(&self, old_size: u64, new_size: u64) -> Result<Vec<Hash>, ProofError> {
        StoredNodes::consistency_proof(self, old_size, new_size)
    }
}

impl StoredNodes for MerkleTree {
    fn leaves(&self) -> u64 {
        self.len()
    }

    fn node(&self, level: u32, index: u64) -> Result<Hash, ProofError> {
        self.levels
            .get(level as usize)
            .zip(usize::try_from(index).ok())
            .and_then(|(nodes, i)| nodes.get(i))
            .copied()
            .ok_or(ProofError::MissingNode { level, index })
    }
}

/// A Merkle tree that can give the root of any perfect subtree it holds (`level`, `index`:
/// leaves `[index·2^level, (index+1)·2^level)`): all the RFC's recursions need, so roots and
/// proofs at any size are O(log n) stored nodes whether the nodes live in memory
/// ([`MerkleTree`]) or partly in a file ([`crate::merkle_log`]).
pub(crate) trait StoredNodes {
    /// Number of leaves held.
    fn leaves(&self) -> u64;

    /// Root of a perfect subtree within the first [`leaves`](Self::leaves) leaves.
    fn node(&self, level: u32, index: u64) -> Result<Hash, ProofError>;

    /// Root (`MTH`) of the first `size` leaves.
    fn root_at(&self, size: u64) -> Result<Hash, ProofError> {
        check_available(self.leaves(), size)?;
        subtree_hash(self, 0, size)
    }

    /// RFC 6962 `PATH(index, D[tree_size])`.
    fn inclusion_proof(&self, index: u64, tree_size: u64) -> Result<Vec<Hash>, ProofError> {
        if index >= tree_size {
            return Err(ProofError::IndexOutOfRange { index, tree_size });
        }
        check_available(self.leaves(), tree_size)?;
        let mut proof = Vec::new();
        path(self, index, 0, tree_size, &mut proof)?;
        Ok(proof)
    }

    /// RFC 6962 `PROOF(old_size, D[new_size])`.
    fn consistency_proof(&self, old_size: u64, new_size: u64) -> Result<Vec<Hash>, ProofError> {
        check_sizes(old_size, new_size)?;
        check_available(self.leaves(), new_size)?;
        let mut proof = Vec::new();
        subproof(self, old_size, 0, new_size, true, &mut proof)?;
        Ok(proof)
    }
}

/// Appends a node to the lowest of `levels` and every parent it completes above it.
pub(crate) fn push_node(levels: &mut Vec<Vec<Hash>>, mut node: Hash) {
    let mut level = 0;
    loop {
        if levels.len() == level {
            levels.push(Vec::new());
        }
        let Some(nodes) = levels.get_mut(level) else {
            return;
        };
        nodes.push(node);
        // An even count means the new node completed a pair, whose parent
        // is now a complete subtree one level up.
        match nodes.as_slice() {
            [.., left, right] if nodes.len().is_multiple_of(2) => node = node_hash(left, right),
            _ => return,
        }
        level += 1;
    }
}

fn check_available(available: u64, tree_size: u64) -> Result<(), ProofError> {
    if tree_size > available {
        return Err(ProofError::TreeSizeOutOfRange {
            tree_size,
            available,
        });
    }
    Ok(())
}

/// `MTH` of leaves `[start, start + size)`, for the subtrees the RFC recursion visits
/// (`start` is a multiple of the largest power of two ≤ `size`): one stored node per set
/// bit of `size`.
fn subtree_hash<T: StoredNodes + ?Sized>(
    tree: &T,
    start: u64,
    size: u64,
) -> Result<Hash, ProofError> {
    if size == 0 {
        return Ok(empty_root());
    }
    if size.is_power_of_two() {
        let level = size.trailing_zeros();
        return tree.node(level, start >> level);
    }
    let k = split_u64(size);
    let left = subtree_hash(tree, start, k)?;
    let right = subtree_hash(tree, start + k, size - k)?;
    Ok(node_hash(&left, &right))
}

/// `PATH(m, D[start..start + size])` appended to `proof`.
fn path<T: StoredNodes + ?Sized>(
    tree: &T,
    m: u64,
    start: u64,
    size: u64,
    proof: &mut Vec<Hash>,
) -> Result<(), ProofError> {
    if size <= 1 {
        return Ok(());
    }
    let k = split_u64(size);
    if m < k {
        path(tree, m, start, k, proof)?;
        proof.push(subtree_hash(tree, start + k, size - k)?);
    } else {
        path(tree, m - k, start + k, size - k, proof)?;
        proof.push(subtree_hash(tree, start, k)?);
    }
    Ok(())
}

/// `SUBPROOF(m, D[start..start + size], complete)` appended to `proof`; needs
/// `0 < m <= size`.
fn subproof<T: StoredNodes + ?Sized>(
    tree: &T,
    m: u64,
    start: u64,
    size: u64,
    complete: bool,
    proof: &mut Vec<Hash>,
) -> Result<(), ProofError> {
    if m == size {
        if !complete {
            proof.push(subtree_hash(tree, start, size)?);
        }
        return Ok(());
    }
    let k = split_u64(size);
    if m <= k {
        subproof(tree, m, start, k, complete, proof)?;
        proof.push(subtree_hash(tree, start + k, size - k)?);
    } else {
        subproof(tree, m - k, start + k, size - k, false, proof)?;
        proof.push(subtree_hash(tree, start, k)?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::sample::Index;

    // SM3 runs unoptimised in debug test builds (several µs per hash), so the
    // case counts are sized to keep the whole module at a few seconds.
    const REFERENCE_CASES: u32 = 8;
    const VERIFY_CASES: u32 = 24;
    const TAMPER_CASES: u32 = 48;

    use crate::hashing::to_hex as hex;

    fn flip(hash: &Hash, bit: usize) -> Hash {
        let mut flipped = *hash;
        flipped[(bit / 8) % 32] ^= 1 << (bit % 8);
        flipped
    }

    /// Synthetic event hash `i`.
    fn event(i: u64) -> Hash {
        Sm3::digest(i.to_be_bytes()).into()
    }

    /// Random event hashes, made pairwise distinct by stamping the position
    /// into the first 8 bytes (so "another leaf" really is another value).
    fn event_hashes(len: std::ops::Range<usize>) -> impl Strategy<Value = Vec<Hash>> {
        prop::collection::vec(any::<[u8; 32]>(), len).prop_map(|mut hashes| {
            for (i, hash) in hashes.iter_mut().enumerate() {
                hash[..8].copy_from_slice(&(i as u64).to_le_bytes());
            }
            hashes
        })
    }

    // ---------------------------------------------------------------- known answers

    #[test]
    fn sm3_known_answers() {
        // GB/T 32905-2016 example 1 and example 2.
        assert_eq!(
            hex(&Sm3::digest(b"abc")),
            "66c7f0f462eeedd9d1f2d46bdc10e4e24167c4875cf2f7a2297da02b8f4ba8e0"
        );
        assert_eq!(
            hex(&Sm3::digest(b"abcd".repeat(16))),
            "debe9ff92275b8a138604889c18e5a4d6fdb70e5387e5765293dcba39c0c5732"
        );
    }

    #[test]
    fn empty_root_is_sm3_of_empty_input() {
        assert_eq!(
            hex(&empty_root()),
            "1ab21d8355cfa17f8e61194831e81a8f22bec8c728fefb747ed035eb5082aa2b"
        );
        assert_eq!(root(&[]), empty_root());
        assert_eq!(MerkleTree::new().root_at(0), Ok(empty_root()));
        assert_eq!(Frontier::new().root(), empty_root());
        assert_eq!(MerkleTree::from_event_hashes(&[]), MerkleTree::new());
        assert!(MerkleTree::new().is_empty());
        assert_eq!(Frontier::new().size(), 0);
    }

    #[test]
    fn leaf_and_node_hashes_use_rfc6962_prefixes() {
        let (a, b) = (event(1), event(2));
        let mut leaf_input = vec![0x00];
        leaf_input.extend_from_slice(&a);
        assert_eq!(leaf_hash(&a), Hash::from(Sm3::digest(&leaf_input)));
        let mut node_input = vec![0x01];
        node_input.extend_from_slice(&a);
        node_input.extend_from_slice(&b);
        assert_eq!(node_hash(&a, &b), Hash::from(Sm3::digest(&node_input)));
        // Domain separation: neither is the bare hash of the same bytes.
        assert_ne!(leaf_hash(&a), Hash::from(Sm3::digest(a)));
        assert_ne!(node_hash(&a, &b), node_hash(&b, &a));
    }

    #[test]
    fn three_leaf_tree_by_hand() {
        let events = [event(0), event(1), event(2)];
        let [l0, l1, l2] = events.map(|e| leaf_hash(&e));
        let h01 = node_hash(&l0, &l1);
        let expected_root = node_hash(&h01, &l2);

        let tree = MerkleTree::from_event_hashes(&events);
        let mut frontier = Frontier::new();
        events.iter().for_each(|e| frontier.push(e));
        assert_eq!(root(&events), expected_root);
        assert_eq!(tree.root_at(3), Ok(expected_root));
        assert_eq!(tree.root_at(2), Ok(h01));
        assert_eq!(tree.root_at(1), Ok(l0));
        assert_eq!(frontier.root(), expected_root);
        assert_eq!(frontier.size(), 3);
        assert_eq!(tree.len(), 3);

        // Audit paths, leaf to root.
        let paths = [vec![l1, l2], vec![l0, l2], vec![h01]];
        for (index, path) in paths.iter().enumerate() {
            let index = index as u64;
            assert_eq!(inclusion_proof(&events, index, 3).as_ref(), Ok(path));
            assert_eq!(tree.inclusion_proof(index, 3).as_ref(), Ok(path));
            assert_eq!(
                verify_inclusion(&events[index as usize], index, 3, path, &expected_root),
                Ok(())
            );
        }
        assert_eq!(tree.inclusion_proof(0, 1), Ok(vec![]));
        assert_eq!(verify_inclusion(&events[0], 0, 1, &[], &l0), Ok(()));

        // Consistency: 1 -> 3 is [l1, l2]; 2 -> 3 is [l2] (old root omitted,
        // the old tree being a complete subtree); 1 -> 2 is [l1].
        let consistency = [
            (1, 3, vec![l1, l2], l0),
            (2, 3, vec![l2], h01),
            (1, 2, vec![l1], l0),
        ];
        for (old, new, proof, old_root) in consistency {
            assert_eq!(consistency_proof(&events, old, new).as_ref(), Ok(&proof));
            assert_eq!(tree.consistency_proof(old, new).as_ref(), Ok(&proof));
            let new_root = tree.root_at(new).unwrap();
            assert_eq!(
                verify_consistency(old, new, &old_root, &new_root, &proof),
                Ok(())
            );
        }
    }

    #[test]
    fn non_power_of_two_old_tree_includes_its_own_subtree_hash() {
        // 3 -> 4: PROOF = [l2, l3, h01] (RFC 6962 §2.1.2 shape).
        let events: Vec<Hash> = (0..4).map(event).collect();
        let leaves: Vec<Hash> = events.iter().map(leaf_hash).collect();
        let h01 = node_hash(&leaves[0], &leaves[1]);
        let proof = vec![leaves[2], leaves[3], h01];
        assert_eq!(consistency_proof(&events, 3, 4), Ok(proof.clone()));
        let tree = MerkleTree::from_event_hashes(&events);
        assert_eq!(tree.consistency_proof(3, 4), Ok(proof.clone()));
        let (old_root, new_root) = (tree.root_at(3).unwrap(), tree.root_at(4).unwrap());
        assert_eq!(
            verify_consistency(3, 4, &old_root, &new_root, &proof),
            Ok(())
        );
    }

    #[test]
    fn exhaustive_small_trees_match_reference() {
        let events: Vec<Hash> = (0..24).map(event).collect();
        let tree = MerkleTree::from_event_hashes(&events);
        for size in 1..=events.len() as u64 {
            let prefix = &events[..size as usize];
            let size_root = tree.root_at(size).unwrap();
            assert_eq!(size_root, root(prefix));
            for index in 0..size {
                let proof = tree.inclusion_proof(index, size).unwrap();
                assert_eq!(Ok(&proof), inclusion_proof(&events, index, size).as_ref());
                assert_eq!(
                    verify_inclusion(&events[index as usize], index, size, &proof, &size_root),
                    Ok(())
                );
            }
            for old in 1..=size {
                let proof = tree.consistency_proof(old, size).unwrap();
                assert_eq!(Ok(&proof), consistency_proof(&events, old, size).as_ref());
                let old_root = tree.root_at(old).unwrap();
                assert_eq!(
                    verify_consistency(old, size, &old_root, &size_root, &proof),
                    Ok(())
                );
            }
        }
    }

    // ---------------------------------------------------------------- argument errors

    #[test]
    fn out_of_range_arguments_are_errors() {
        let events: Vec<Hash> = (0..5).map(event).collect();
        let tree = MerkleTree::from_event_hashes(&events);
        let r = tree.root_at(5).unwrap();

        fn index_err<T>(index: u64, tree_size: u64) -> Result<T, ProofError> {
            Err(ProofError::IndexOutOfRange { index, tree_size })
        }
        fn size_err<T>(tree_size: u64) -> Result<T, ProofError> {
            Err(ProofError::TreeSizeOutOfRange {
                tree_size,
                available: 5,
            })
        }
        fn sizes_err<T>(old_size: u64, new_size: u64) -> Result<T, ProofError> {
            Err(ProofError::BadSizes { old_size, new_size })
        }

        assert_eq!(tree.root_at(6), size_err(6));
        assert_eq!(tree.inclusion_proof(5, 5), index_err(5, 5));
        assert_eq!(tree.inclusion_proof(0, 0), index_err(0, 0));
        assert_eq!(tree.inclusion_proof(0, 6), size_err(6));
        assert_eq!(inclusion_proof(&events, 5, 5), index_err(5, 5));
        assert_eq!(inclusion_proof(&events, 0, 6), size_err(6));
        assert_eq!(inclusion_proof(&events, 0, u64::MAX), size_err(u64::MAX));
        assert_eq!(
            tree.inclusion_proof(u64::MAX - 1, u64::MAX),
            size_err(u64::MAX)
        );

        assert_eq!(tree.consistency_proof(0, 5), sizes_err(0, 5));
        assert_eq!(tree.consistency_proof(0, 0), sizes_err(0, 0));
        assert_eq!(tree.consistency_proof(4, 3), sizes_err(4, 3));
        assert_eq!(tree.consistency_proof(3, 6), size_err(6));
        assert_eq!(consistency_proof(&events, 0, 5), sizes_err(0, 5));
        assert_eq!(consistency_proof(&events, 4, 3), sizes_err(4, 3));
        assert_eq!(consistency_proof(&events, 3, 6), size_err(6));
        assert_eq!(tree.consistency_proof(5, 5), Ok(vec![]));
        assert_eq!(consistency_proof(&events, 2, 2), Ok(vec![]));

        assert_eq!(verify_inclusion(&events[0], 5, 5, &[], &r), index_err(5, 5));
        assert_eq!(verify_inclusion(&events[0], 0, 0, &[], &r), index_err(0, 0));
        assert_eq!(verify_consistency(0, 5, &r, &r, &[]), sizes_err(0, 5));
        assert_eq!(verify_consistency(0, 0, &r, &r, &[]), sizes_err(0, 0));
        assert_eq!(verify_consistency(5, 4, &r, &r, &[]), sizes_err(5, 4));
        // Equal sizes: empty proof, equal roots.
        assert_eq!(verify_consistency(5, 5, &r, &r, &[]), Ok(()));
        assert_eq!(
            verify_consistency(5, 5, &r, &flip(&r, 0), &[]),
            Err(ProofError::NewRootMismatch)
        );
        assert_eq!(
            verify_consistency(5, 5, &r, &r, &[r]),
            Err(ProofError::WrongProofLength {
                expected: 0,
                actual: 1
            })
        );
    }

    #[test]
    fn huge_claimed_sizes_are_rejected_without_panicking() {
        let e = event(7);
        let r = leaf_hash(&e);
        let long_proof = vec![r; 70];
        for (index, size) in [(0, u64::MAX), (u64::MAX - 1, u64::MAX), (1 << 63, u64::MAX)] {
            assert!(verify_inclusion(&e, index, size, &[], &r).is_err());
            assert!(verify_inclusion(&e, index, size, &long_proof, &r).is_err());
            assert!(verify_inclusion(&e, index, size, &long_proof[..64], &r).is_err());
        }
        for (old, new) in [
            (1, u64::MAX),
            (u64::MAX - 1, u64::MAX),
            (1 << 63, u64::MAX),
            (3, 1 << 40),
        ] {
            assert!(verify_consistency(old, new, &r, &r, &[]).is_err());
            assert!(verify_consistency(old, new, &r, &r, &long_proof).is_err());
            assert!(verify_consistency(old, new, &r, &r, &long_proof[..64]).is_err());
        }
    }

    #[test]
    fn error_messages_say_what_was_wrong() {
        assert_eq!(
            ProofError::IndexOutOfRange {
                index: 7,
                tree_size: 5
            }
            .to_string(),
            "leaf index 7 is out of range for a tree of size 5"
        );
        assert_eq!(
            ProofError::WrongProofLength {
                expected: 3,
                actual: 4
            }
            .to_string(),
            "proof has 4 hashes but 3 were expected for these sizes"
        );
        assert_eq!(
            ProofError::TreeSizeOutOfRange {
                tree_size: 9,
                available: 5
            }
            .to_string(),
            "tree size 9 exceeds the 5 leaves available"
        );
    }

    // ---------------------------------------------------------------- properties

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(REFERENCE_CASES))]

        /// MerkleTree (built at once and by appending) and Frontier agree with
        /// the reference functions at every size.
        #[test]
        fn tree_and_frontier_match_reference(
            events in event_hashes(1..300),
            picks in prop::collection::vec(any::<(Index, Index)>(), 300),
        ) {
            let n = events.len() as u64;
            let tree = MerkleTree::from_event_hashes(&events);
            prop_assert_eq!(tree.len(), n);
            let mut appended = MerkleTree::new();
            let mut frontier = Frontier::new();
            prop_assert_eq!(tree.root_at(0), Ok(empty_root()));
            for (m, (index_pick, old_pick)) in (1..=n).zip(&picks) {
                let prefix = &events[..m as usize];
                appended.push(&prefix[prefix.len() - 1]);
                frontier.push(&prefix[prefix.len() - 1]);
                let reference_root = root(prefix);
                prop_assert_eq!(tree.root_at(m), Ok(reference_root));
                prop_assert_eq!(appended.root_at(m), Ok(reference_root));
                prop_assert_eq!(frontier.root(), reference_root);
                prop_assert_eq!(frontier.size(), m);

                let index = index_pick.index(m as usize) as u64;
                prop_assert_eq!(
                    tree.inclusion_proof(index, m),
                    inclusion_proof(&events, index, m)
                );
                let old = old_pick.index(m as usize) as u64 + 1;
                prop_assert_eq!(
                    tree.consistency_proof(old, m),
                    consistency_proof(&events, old, m)
                );
            }
            prop_assert_eq!(&appended, &tree);
            prop_assert_eq!(appended.len(), n);
        }

        /// Extending in chunks of any sizes (verify extends a page at a time, the Merkle
        /// log a read at a time) gives the tree that pushing one by one gives.
        #[test]
        fn extending_in_chunks_equals_pushing(
            events in event_hashes(0..300),
            cuts in prop::collection::vec(0usize..300, 0..6),
        ) {
            let mut pushed = MerkleTree::new();
            for e in &events {
                pushed.push(e);
            }
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(events.len())).collect();
            cuts.push(events.len());
            cuts.sort_unstable();
            let mut extended = MerkleTree::new();
            let mut from = 0;
            for to in cuts {
                extended.extend(&events[from..to]);
                from = to;
            }
            prop_assert_eq!(&extended, &pushed);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(VERIFY_CASES))]

        /// Every inclusion proof of leaves at the full size, and of a first,
        /// last and random leaf at every smaller size, verifies.
        #[test]
        fn inclusion_proofs_verify(
            events in event_hashes(1..300),
            picks in prop::collection::vec(any::<Index>(), 300),
        ) {
            let n = events.len() as u64;
            let tree = MerkleTree::from_event_hashes(&events);
            let full_root = tree.root_at(n).unwrap();
            for index in 0..n {
                let proof = tree.inclusion_proof(index, n).unwrap();
                prop_assert_eq!(
                    verify_inclusion(&events[index as usize], index, n, &proof, &full_root),
                    Ok(())
                );
            }
            for (m, pick) in (1..=n).zip(&picks) {
                let size_root = tree.root_at(m).unwrap();
                for index in [0, m - 1, pick.index(m as usize) as u64] {
                    let proof = tree.inclusion_proof(index, m).unwrap();
                    prop_assert_eq!(
                        verify_inclusion(&events[index as usize], index, m, &proof, &size_root),
                        Ok(())
                    );
                }
            }
        }

        /// Every consistency proof from each old size to the full size, and
        /// from a random old size to every size, verifies.
        #[test]
        fn consistency_proofs_verify(
            events in event_hashes(1..300),
            picks in prop::collection::vec(any::<Index>(), 300),
        ) {
            let n = events.len() as u64;
            let tree = MerkleTree::from_event_hashes(&events);
            let roots: Vec<Hash> = (0..=n).map(|m| tree.root_at(m).unwrap()).collect();
            for old in 1..=n {
                let proof = tree.consistency_proof(old, n).unwrap();
                prop_assert_eq!(
                    verify_consistency(old, n, &roots[old as usize], &roots[n as usize], &proof),
                    Ok(())
                );
            }
            for (new, pick) in (1..=n).zip(&picks) {
                let old = pick.index(new as usize) as u64 + 1;
                let proof = tree.consistency_proof(old, new).unwrap();
                prop_assert_eq!(
                    verify_consistency(old, new, &roots[old as usize], &roots[new as usize], &proof),
                    Ok(())
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(TAMPER_CASES))]

        /// Any change to leaf, index, size, path or root makes an inclusion
        /// proof fail, with an error rather than a panic.
        #[test]
        fn tampered_inclusion_proofs_fail(
            events in event_hashes(1..300),
            size_pick in any::<Index>(),
            index_pick in any::<Index>(),
            bit in 0usize..256,
            extra in any::<[u8; 32]>(),
        ) {
            let n = events.len() as u64;
            let tree = MerkleTree::from_event_hashes(&events);
            let size = size_pick.index(n as usize) as u64 + 1;
            let index = index_pick.index(size as usize) as u64;
            let event_hash = events[index as usize];
            let size_root = tree.root_at(size).unwrap();
            let proof = tree.inclusion_proof(index, size).unwrap();
            prop_assert_eq!(verify_inclusion(&event_hash, index, size, &proof, &size_root), Ok(()));

            // Another leaf (every other event of the tree, and a near miss).
            for other in events.iter().filter(|e| **e != event_hash) {
                prop_assert_eq!(
                    verify_inclusion(other, index, size, &proof, &size_root),
                    Err(ProofError::RootMismatch)
                );
            }
            prop_assert_eq!(
                verify_inclusion(&flip(&event_hash, bit), index, size, &proof, &size_root),
                Err(ProofError::RootMismatch)
            );
            // Another index, including out of range ones.
            for other in (0..=size).filter(|i| *i != index) {
                prop_assert!(verify_inclusion(&event_hash, other, size, &proof, &size_root).is_err());
            }
            prop_assert!(verify_inclusion(&event_hash, u64::MAX, size, &proof, &size_root).is_err());
            // Another tree size, with that size's own root.
            for other in (1..=n).filter(|m| *m != size) {
                let other_root = tree.root_at(other).unwrap();
                prop_assert!(verify_inclusion(&event_hash, index, other, &proof, &other_root).is_err());
            }
            // Truncated paths (dropping the tail or the head).
            for keep in 0..proof.len() {
                prop_assert_eq!(
                    verify_inclusion(&event_hash, index, size, &proof[..keep], &size_root),
                    Err(ProofError::WrongProofLength { expected: proof.len(), actual: keep })
                );
            }
            if let Some((_, tail)) = proof.split_first() {
                prop_assert!(verify_inclusion(&event_hash, index, size, tail, &size_root).is_err());
            }
            // Extended paths (appending or prepending a hash).
            for pad in [extra, size_root, leaf_hash(&event_hash)] {
                let mut longer = proof.clone();
                longer.push(pad);
                prop_assert_eq!(
                    verify_inclusion(&event_hash, index, size, &longer, &size_root),
                    Err(ProofError::WrongProofLength { expected: proof.len(), actual: proof.len() + 1 })
                );
                longer.rotate_right(1);
                prop_assert!(verify_inclusion(&event_hash, index, size, &longer, &size_root).is_err());
            }
            // A flipped bit in any proof element.
            for position in 0..proof.len() {
                let mut corrupted = proof.clone();
                corrupted[position] = flip(&corrupted[position], bit);
                prop_assert_eq!(
                    verify_inclusion(&event_hash, index, size, &corrupted, &size_root),
                    Err(ProofError::RootMismatch)
                );
            }
            // A wrong root.
            prop_assert_eq!(
                verify_inclusion(&event_hash, index, size, &proof, &flip(&size_root, bit)),
                Err(ProofError::RootMismatch)
            );
            prop_assert_eq!(
                verify_inclusion(&event_hash, index, size, &proof, &extra),
                Err(ProofError::RootMismatch)
            );
        }

        /// Any change to sizes, roots or path makes a consistency proof fail,
        /// and so does a fork (the same sizes over different leaves).
        #[test]
        fn tampered_consistency_proofs_fail(
            events in event_hashes(2..300),
            new_pick in any::<Index>(),
            old_pick in any::<Index>(),
            fork_pick in any::<Index>(),
            bit in 0usize..256,
            extra in any::<[u8; 32]>(),
        ) {
            let n = events.len() as u64;
            let tree = MerkleTree::from_event_hashes(&events);
            let new = new_pick.index(n as usize - 1) as u64 + 2;
            let old = old_pick.index(new as usize - 1) as u64 + 1;
            prop_assert!(0 < old && old < new && new <= n);
            let roots: Vec<Hash> = (0..=n).map(|m| tree.root_at(m).unwrap()).collect();
            let (old_root, new_root) = (roots[old as usize], roots[new as usize]);
            let proof = tree.consistency_proof(old, new).unwrap();
            prop_assert!(!proof.is_empty());
            prop_assert_eq!(verify_consistency(old, new, &old_root, &new_root, &proof), Ok(()));

            // Another old size or new size, with that size's own root.
            for other in (1..=new).filter(|m| *m != old) {
                prop_assert!(
                    verify_consistency(other, new, &roots[other as usize], &new_root, &proof).is_err()
                );
            }
            for other in (old..=n).filter(|m| *m != new) {
                prop_assert!(
                    verify_consistency(old, other, &old_root, &roots[other as usize], &proof).is_err()
                );
            }
            prop_assert!(verify_consistency(0, new, &empty_root(), &new_root, &proof).is_err());
            prop_assert!(verify_consistency(new, old, &new_root, &old_root, &proof).is_err());
            // A fork: one event changed, anywhere in the new tree.
            let mut forked = events[..new as usize].to_vec();
            let changed = fork_pick.index(new as usize);
            forked[changed] = flip(&forked[changed], bit);
            let fork = MerkleTree::from_event_hashes(&forked);
            let (fork_old, fork_new) = (fork.root_at(old).unwrap(), fork.root_at(new).unwrap());
            let fork_proof = fork.consistency_proof(old, new).unwrap();
            prop_assert!(verify_consistency(old, new, &old_root, &fork_new, &proof).is_err());
            if (changed as u64) < old {
                // History rewritten: neither proof links the old root to the fork.
                prop_assert!(verify_consistency(old, new, &old_root, &fork_new, &fork_proof).is_err());
                prop_assert!(verify_consistency(old, new, &fork_old, &new_root, &proof).is_err());
            } else {
                // Only appended events differ: the fork does extend the old tree.
                prop_assert_eq!(
                    verify_consistency(old, new, &old_root, &fork_new, &fork_proof),
                    Ok(())
                );
            }
            // Truncated paths.
            for keep in 0..proof.len() {
                prop_assert_eq!(
                    verify_consistency(old, new, &old_root, &new_root, &proof[..keep]),
                    Err(ProofError::WrongProofLength { expected: proof.len(), actual: keep })
                );
            }
            // Extended paths.
            for pad in [extra, old_root, new_root] {
                let mut longer = proof.clone();
                longer.push(pad);
                prop_assert_eq!(
                    verify_consistency(old, new, &old_root, &new_root, &longer),
                    Err(ProofError::WrongProofLength { expected: proof.len(), actual: proof.len() + 1 })
                );
                longer.rotate_right(1);
                prop_assert!(verify_consistency(old, new, &old_root, &new_root, &longer).is_err());
            }
            // A flipped bit in any proof element.
            for position in 0..proof.len() {
                let mut corrupted = proof.clone();
                corrupted[position] = flip(&corrupted[position], bit);
                prop_assert!(verify_consistency(old, new, &old_root, &new_root, &corrupted).is_err());
            }
            // Wrong roots.
            prop_assert!(verify_consistency(old, new, &flip(&old_root, bit), &new_root, &proof).is_err());
            prop_assert_eq!(
                verify_consistency(old, new, &old_root, &flip(&new_root, bit), &proof),
                Err(ProofError::NewRootMismatch)
            );
            prop_assert!(verify_consistency(old, new, &new_root, &old_root, &proof).is_err());
            // Equal sizes: only the empty proof with equal roots.
            prop_assert_eq!(verify_consistency(old, old, &old_root, &old_root, &[]), Ok(()));
            prop_assert!(verify_consistency(old, old, &old_root, &new_root, &[]).is_err());
            prop_assert!(verify_consistency(new, new, &new_root, &new_root, &proof).is_err());
        }
    }
}

//! Verification of a whole ledger: the chain (gapless seqs, links, recomputed hashes,
//! non-decreasing time, gapless stream versions) and every signed checkpoint (signature
//! and Merkle root at its tree size). Reports the first broken seq and why.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::checkpoint::{CheckpointVerifier, SignedCheckpoint};
use crate::error::LedgerError;
use crate::event::RecordedEvent;
use crate::hashing::{self, GENESIS_PREV_HASH, Hash};
use crate::key_rotation::KeyRotation;
use crate::merkle::{ProofError, StoredNodes};
use crate::merkle_file::{BLOCK_LEVEL, PagedTree};
use crate::store::EventStore;

/// What is wrong at the first broken seq.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Problem {
    #[error("gap: expected seq {expected}, found seq {found}")]
    Gap { expected: u64, found: u64 },
    #[error("bad link: prev_hash is {found} but the hash of the previous event is {expected}")]
    BadLink { expected: String, found: String },
    #[error("hash mismatch: stored {stored}, recomputed from the fields {computed}")]
    HashMismatch { stored: String, computed: String },
    #[error("recorded_at {at} is earlier than the previous event's {previous}")]
    TimeWentBackwards { previous: String, at: String },
    #[error("stream {stream_id:?}: expected version {expected}, found {found}")]
    StreamVersionGap {
        stream_id: String,
        expected: u64,
        found: u64,
    },
    #[error("checkpoint is malformed or signed by an untrusted key: {reason}")]
    BadCheckpoint { reason: String },
    #[error("checkpoint signature does not verify")]
    BadSignature,
    #[error("checkpoint key rotation is malformed or not signed by the key in force: {reason}")]
    BadKeyRotation { reason: String },
    #[error("checkpoint claims tree size {tree_size}, beyond the events before it")]
    CheckpointBeyondLog { tree_size: u64 },
    #[error("checkpoint root for tree size {tree_size} is {claimed}, the events give {computed}")]
    RootMismatch {
        tree_size: u64,
        claimed: String,
        computed: String,
    },
    #[error(
        "the ledger no longer extends the trusted checkpoint: its first {tree_size} events have root {computed}, the trusted root is {trusted}"
    )]
    AnchorRootMismatch {
        tree_size: u64,
        trusted: String,
        computed: String,
    },
    #[error(
        "the ledger has {events} events, fewer than the {tree_size} of the trusted checkpoint: its newest events were removed"
    )]
    ShorterThanAnchor { tree_size: u64, events: u64 },
}

/// A tree head the verifier's user already trusts (from a bundle or a checkpoint they kept):
/// the ledger must still hold at least `tree_size` events whose root is `root_hash`, so
/// removing or rewriting the newest events is caught even where the checkpoints that covered
/// them went with them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrustedAnchor {
    pub tree_size: u64,
    pub root_hash: Hash,
}

impl std::str::FromStr for TrustedAnchor {
    type Err = String;

    /// `SIZE:ROOT`, the root in 64 lowercase hex digits.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (size, root) = s
            .split_once(':')
            .ok_or_else(|| format!("expected TREE_SIZE:ROOT_HASH, got {s:?}"))?;
        let tree_size: u64 =
            size.parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                format!("tree size must be an integer of at least 1, got {size:?}")
            })?;
        let root_hash = hashing::hex_hash::parse(root)
            .ok()
            .filter(|_| !root.bytes().any(|b| b.is_ascii_uppercase()))
            .ok_or_else(|| format!("root hash must be 64 lowercase hex digits, got {root:?}"))?;
        Ok(TrustedAnchor {
            tree_size,
            root_hash,
        })
    }
}

/// The first failure found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct VerifyFailure {
    pub seq: u64,
    pub problem: Problem,
}

/// What a verification run saw.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub events_checked: u64,
    pub checkpoints_checked: u64,
    /// Hash of the last event checked, hex.
    pub head_hash: Option<String>,
    pub latest_checkpoint: Option<SignedCheckpoint>,
    /// `CheckpointKeyRotated` events checked, in ledger order.
    pub key_rotations: Vec<KeyRotation>,
    pub failure: Option<VerifyFailure>,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.failure.is_none()
    }
}

/// Streaming verifier: feed events in seq order, then take the report. It reads nothing
/// itself (the caller brings the events), so any source of events can be checked with it.
pub struct ChainVerifier {
    trusted_key: Option<CheckpointVerifier>,
    expected_seq: u64,
    prev_hash: Hash,
    prev_time: Option<DateTime<Utc>>,
    stream_versions: HashMap<String, u64>,
    /// The event hashes in a scratch file, the tree above 128-event blocks in memory: a
    /// checkpoint's root is at any earlier size, and a ledger of billions of events would
    /// not fit in memory at ~64 bytes an event.
    tree: PagedTree,
    checkpoints: u64,
    latest_checkpoint: Option<SignedCheckpoint>,
    key_rotations: Vec<KeyRotation>,
    failure: Option<VerifyFailure>,
    /// Checked once the tree reaches its size; `None` after that.
    anchor: Option<TrustedAnchor>,
}

/// Why an event could not be checked: the ledger is broken there, or the verifier's own
/// scratch file failed (which says nothing about the ledger).
enum Checked {
    Broken(Problem),
    Scratch(LedgerError),
}

fn scratch_error(e: impl std::fmt::Display) -> LedgerError {
    LedgerError::MerkleFile(format!("the verifier's scratch file: {e}"))
}

impl ChainVerifier {
    /// Checkpoints must be signed by `trusted_key`; without one, each checkpoint is checked
    /// against the key it names (which proves integrity, not who signed). Fails only if
    /// the scratch file for the event hashes cannot be created.
    pub fn new(trusted_key: Option<CheckpointVerifier>) -> Result<Self, LedgerError> {
        let tree = PagedTree::scratch(BLOCK_LEVEL).map_err(scratch_error)?;
        Ok(ChainVerifier {
            trusted_key,
            expected_seq: 1,
            prev_hash: GENESIS_PREV_HASH,
            prev_time: None,
            stream_versions: HashMap::new(),
            tree,
            checkpoints: 0,
            latest_checkpoint: None,
            key_rotations: Vec::new(),
            failure: None,
            anchor: None,
        })
    }

    /// Also requires the ledger to extend `anchor` (see [`TrustedAnchor`]).
    pub fn with_anchor(mut self, anchor: TrustedAnchor) -> Self {
        self.anchor = Some(anchor);
        self
    }

    pub fn failed(&self) -> bool {
        self.failure.is_some()
    }

    /// Checks one event; `computed_hash` is its recomputed hash (computed by the caller so
    /// that it can be done in parallel). After the first failure, further events are ignored.
    /// An error is the scratch file's (the ledger's problems go in the report).
    pub fn push(&mut self, event: &RecordedEvent, computed_hash: Hash) -> Result<(), LedgerError> {
        self.push_page(std::slice::from_ref(event), &[computed_hash])
    }

    /// [`push`](Self::push) for consecutive events with their recomputed hashes; the
    /// page's Merkle leaves and nodes are hashed together first, on SIMD lanes.
    pub fn push_page(
        &mut self,
        events: &[RecordedEvent],
        computed_hashes: &[Hash],
    ) -> Result<(), LedgerError> {
        if self.failure.is_some() {
            return Ok(());
        }
        // The tree takes the events that extend it in seq order; the checks below report
        // anything else at the event where it happens, and stop there.
        let ahead: Vec<Hash> = events
            .iter()
            .zip(self.tree.len() + 1..)
            .take_while(|(e, seq)| e.seq == *seq)
            .map(|(e, _)| e.hash)
            .collect();
        self.tree.extend(&ahead).map_err(scratch_error)?;
        for (event, hash) in events.iter().zip(computed_hashes) {
            match self.check(event, *hash) {
                Ok(()) => {}
                Err(Checked::Scratch(e)) => return Err(e),
                Err(Checked::Broken(problem)) => {
                    self.failure = Some(VerifyFailure {
                        seq: event.seq,
                        problem,
                    });
                    return Ok(());
                }
            }
        }
        self.check_anchor()
    }

    /// Compares the trusted anchor's root once the checked events reach its size.
    fn check_anchor(&mut self) -> Result<(), LedgerError> {
        let Some(anchor) = self.anchor else {
            return Ok(());
        };
        if self.expected_seq - 1 < anchor.tree_size {
            return Ok(());
        }
        self.anchor = None;
        let computed = self.tree.root_at(anchor.tree_size).map_err(scratch_error)?;
        if computed != anchor.root_hash {
            self.failure = Some(VerifyFailure {
                seq: anchor.tree_size,
                problem: Problem::AnchorRootMismatch {
                    tree_size: anchor.tree_size,
                    trusted: hex::encode(anchor.root_hash),
                    computed: hex::encode(computed),
                },
            });
        }
        Ok(())
    }

    fn check(&mut self, event: &RecordedEvent, computed: Hash) -> Result<(), Checked> {
        if event.seq != self.expected_seq {
            return Err(Checked::Broken(Problem::Gap {
                expected: self.expected_seq,
                found: event.seq,
            }));
        }
        if event.prev_hash != self.prev_hash {
            return Err(Checked::Broken(Problem::BadLink {
                expected: hex::encode(self.prev_hash),
                found: hex::encode(event.prev_hash),
            }));
        }
        if computed != event.hash {
            return Err(Checked::Broken(Problem::HashMismatch {
                stored: hex::encode(event.hash),
                computed: hex::encode(computed),
            }));
        }
        if let Some(previous) = self.prev_time
            && event.recorded_at < previous
        {
            return Err(Checked::Broken(Problem::TimeWentBackwards {
                previous: previous.to_rfc3339(),
                at: event.recorded_at.to_rfc3339(),
            }));
        }
        // Look up before inserting: the stream id is copied once per stream, not per event.
        let version = match self.stream_versions.get_mut(event.stream_id.as_str()) {
            Some(version) => version,
            None => self
                .stream_versions
                .entry(event.stream_id.clone())
                .or_insert(0),
        };
        if event.stream_version != *version + 1 {
            return Err(Checked::Broken(Problem::StreamVersionGap {
                stream_id: event.stream_id.clone(),
                expected: *version + 1,
                found: event.stream_version,
            }));
        }
        *version += 1;
        if let Some(checkpoint) = SignedCheckpoint::from_event(event) {
            self.check_checkpoint(checkpoint)?;
        } else if let Some(rotation) = KeyRotation::from_event(event) {
            self.check_rotation(rotation)?;
        }
        self.expected_seq += 1;
        self.prev_hash = event.hash;
        self.prev_time = Some(event.recorded_at);
        Ok(())
    }

    fn check_checkpoint(
        &mut self,
        checkpoint: Result<SignedCheckpoint, crate::checkpoint::CheckpointError>,
    ) -> Result<(), Checked> {
        use crate::checkpoint::CheckpointError;
        let checkpoint = checkpoint.map_err(|e| {
            Checked::Broken(Problem::BadCheckpoint {
                reason: e.to_string(),
            })
        })?;
        let signature = match &self.trusted_key {
            Some(key) => key.verify(&checkpoint),
            None => checkpoint.verify_self_signed(),
        };
        match signature {
            Ok(()) => {}
            Err(CheckpointError::BadSignature) => {
                return Err(Checked::Broken(Problem::BadSignature));
            }
            Err(e) => {
                return Err(Checked::Broken(Problem::BadCheckpoint {
                    reason: e.to_string(),
                }));
            }
        }
        if let Some(rotation) = self.key_rotations.last()
            && checkpoint.tree_size <= rotation.tree_size
        {
            return Err(Checked::Broken(Problem::BadCheckpoint {
                reason: format!(
                    "a checkpoint of {} events follows the key rotation at {} events: checkpoints after a rotation cover it",
                    checkpoint.tree_size, rotation.tree_size
                ),
            }));
        }
        self.check_tree_head(checkpoint.tree_size, &checkpoint.root_hash)?;
        self.checkpoints += 1;
        self.latest_checkpoint = Some(checkpoint);
        Ok(())
    }

    /// A signed tree head (a checkpoint's or a key rotation's) must be of events before it,
    /// with the root those events have.
    fn check_tree_head(&mut self, tree_size: u64, root_hash: &Hash) -> Result<(), Checked> {
        // Only the events before the head count, whatever the tree holds already.
        if tree_size >= self.expected_seq {
            return Err(Checked::Broken(Problem::CheckpointBeyondLog { tree_size }));
        }
        let computed = match self.tree.root_at(tree_size) {
            Ok(root) => root,
            Err(e @ (ProofError::LeafFile { .. } | ProofError::MissingNode { .. })) => {
                return Err(Checked::Scratch(scratch_error(e)));
            }
            Err(_) => {
                return Err(Checked::Broken(Problem::CheckpointBeyondLog { tree_size }));
            }
        };
        if computed != *root_hash {
            return Err(Checked::Broken(Problem::RootMismatch {
                tree_size,
                claimed: hex::encode(root_hash),
                computed: hex::encode(computed),
            }));
        }
        Ok(())
    }

    /// A key rotation must be signed by the key in force (the trusted one, or without one
    /// the key of the newest checkpoint or rotation) and by the new key, over a tree head
    /// of this ledger; from then on checkpoints must be signed by the new key.
    fn check_rotation(
        &mut self,
        rotation: Result<KeyRotation, crate::checkpoint::CheckpointError>,
    ) -> Result<(), Checked> {
        use crate::checkpoint::CheckpointError;
        let broken = |reason: String| Checked::Broken(Problem::BadKeyRotation { reason });
        let rotation = rotation.map_err(|e| broken(e.to_string()))?;
        let in_force = match &self.trusted_key {
            Some(key) => Some(key.public_key_hex()),
            None => self
                .key_rotations
                .last()
                .map(|r| r.new_key.clone())
                .or_else(|| {
                    self.latest_checkpoint
                        .as_ref()
                        .map(|c| c.public_key.clone())
                }),
        };
        if let Some(in_force) = in_force
            && in_force != rotation.previous_key
        {
            return Err(broken(format!(
                "it hands over from key {}, but the key in force is {in_force}",
                rotation.previous_key
            )));
        }
        match rotation.verify() {
            Ok(()) => {}
            Err(CheckpointError::BadSignature) => {
                return Err(Checked::Broken(Problem::BadSignature));
            }
            Err(e) => return Err(broken(e.to_string())),
        }
        self.check_tree_head(rotation.tree_size, &rotation.root_hash)?;
        if self.trusted_key.is_some() {
            self.trusted_key = Some(
                CheckpointVerifier::from_hex(&rotation.new_key)
                    .map_err(|e| broken(e.to_string()))?,
            );
        }
        self.key_rotations.push(rotation);
        Ok(())
    }

    pub fn report(self) -> VerifyReport {
        let events = self.expected_seq - 1;
        let failure = match (self.failure, self.anchor) {
            (Some(failure), _) => Some(failure),
            // The anchor's size was never reached: the newest events are gone.
            (None, Some(anchor)) => Some(VerifyFailure {
                seq: events + 1,
                problem: Problem::ShorterThanAnchor {
                    tree_size: anchor.tree_size,
                    events,
                },
            }),
            (None, None) => None,
        };
        VerifyReport {
            events_checked: events,
            checkpoints_checked: self.checkpoints,
            head_hash: (self.expected_seq > 1).then(|| hex::encode(self.prev_hash)),
            latest_checkpoint: self.latest_checkpoint,
            key_rotations: self.key_rotations,
            failure,
        }
    }
}

/// Events read per page while verifying.
const PAGE: u32 = 10_000;

/// Walks the whole ledger in `store`. `progress` is called with the number of events
/// checked so far after each page.
pub async fn verify_store(
    store: &EventStore,
    trusted_key: Option<CheckpointVerifier>,
    progress: impl FnMut(u64),
) -> Result<VerifyReport, LedgerError> {
    verify_store_anchored(store, trusted_key, None, progress).await
}

/// [`verify_store`], also requiring the ledger to extend a trusted anchor.
pub async fn verify_store_anchored(
    store: &EventStore,
    trusted_key: Option<CheckpointVerifier>,
    anchor: Option<TrustedAnchor>,
    mut progress: impl FnMut(u64),
) -> Result<VerifyReport, LedgerError> {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Vec<RecordedEvent>, LedgerError>>(2);
    // Read ahead while hashing: the database read and the SM3 work overlap.
    let reader = {
        let store = store.clone();
        tokio::spawn(async move {
            if let Err(e) = store.read_all_into(1, PAGE, &tx).await {
                let _ = tx.send(Err(e)).await;
            }
        })
    };
    let mut verifier = ChainVerifier::new(trusted_key)?;
    if let Some(anchor) = anchor {
        verifier = verifier.with_anchor(anchor);
    }
    let mut checked = 0u64;
    while let Some(page) = rx.recv().await {
        let page = page?;
        if page.is_empty() {
            break;
        }
        let checking = tokio::task::spawn_blocking(move || {
            let hashes = recompute_hashes(&page);
            let pushed = verifier.push_page(&page, &hashes);
            pushed.map(|()| (verifier, page.len()))
        });
        let (checked_verifier, len) = checking
            .await
            .map_err(|e| LedgerError::CommitFailed(format!("verifier task failed: {e}")))??;
        verifier = checked_verifier;
        checked += len as u64;
        progress(checked);
        if verifier.failed() {
            break;
        }
    }
    reader.abort();
    Ok(verifier.report())
}

/// Recomputes every event's hash from its own fields and stored `prev_hash`, using all
/// cores (each hash is independent; links are checked separately).
pub fn recompute_hashes(events: &[RecordedEvent]) -> Vec<Hash> {
    let hash = |events: &[RecordedEvent]| {
        hashing::event_hashes(events.iter().map(|e| (&e.prev_hash, e.hashed_fields())))
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads < 2 || events.len() < 256 {
        return hash(events);
    }
    let chunk = events.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = events
            .chunks(chunk)
            .map(|c| s.spawn(move || hash(c)))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

//! Evidence bundles: a set of ledger events with everything needed to check them offline
//! (hashed fields, chain hashes, inclusion proofs, signed checkpoints and the consistency
//! proofs between them), as one JSON document. `BUNDLE.md` is the format's contract.
//!
//! Pure apart from reading and writing a bundle from or to bytes, a reader, a writer or a
//! file path. Building needs the ledger's in-memory tree ([`MerkleProofs`]); checking needs nothing
//! but the bundle (see [`crate::offline`]).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use aether_ledger::SignedCheckpoint;
use aether_ledger::event::RecordedEvent;
use aether_ledger::hashing::{self, Hash};
use aether_ledger::key_rotation::KeyRotation;
use aether_ledger::merkle::{MerkleProofs, ProofError};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// The `format` member of every version 1 bundle.
pub const FORMAT: &str = "aether.evidence-bundle.v1";

/// Sanity limits applied when a bundle is read: a bundle is attacker-controlled input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadLimits {
    /// Largest document accepted, in bytes.
    pub max_bytes: u64,
    /// Most events accepted.
    pub max_events: usize,
    /// Most checkpoints accepted.
    pub max_checkpoints: usize,
}

impl Default for ReadLimits {
    /// 512 MiB, 1,000,000 events, 10,000 checkpoints.
    fn default() -> Self {
        ReadLimits {
            max_bytes: 512 * 1024 * 1024,
            max_events: 1_000_000,
            max_checkpoints: 10_000,
        }
    }
}

/// Why a bundle could not be built, read or written. Problems *inside* a well-formed
/// bundle are not errors: [`crate::offline::verify_bundle`] reports them.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("a bundle needs at least one checkpoint")]
    NoCheckpoints,
    #[error(
        "checkpoints must be in strictly ascending tree size: checkpoint {index} has tree size \
         {tree_size}, not above the previous {previous}"
    )]
    CheckpointsNotAscending {
        index: usize,
        previous: u64,
        tree_size: u64,
    },
    #[error("checkpoint {index} has tree size 0; a checkpoint must cover at least one event")]
    EmptyCheckpoint { index: usize },
    #[error(
        "checkpoint {index} is signed by key {found}, but the key in force at its tree size is {expected}"
    )]
    MixedSigners {
        index: usize,
        expected: String,
        found: String,
    },
    #[error(
        "checkpoint with tree size {tree_size} has root {claimed}, but the tree given has {computed} at that size"
    )]
    CheckpointRootMismatch {
        tree_size: u64,
        claimed: String,
        computed: String,
    },
    #[error(
        "key rotation {index} hands over from key {found}, but the key in force then is {expected}"
    )]
    BrokenKeyChain {
        index: usize,
        expected: String,
        found: String,
    },
    #[error("event seq {seq} lies beyond the anchor checkpoint's tree size {anchor_tree_size}")]
    EventBeyondAnchor { seq: u64, anchor_tree_size: u64 },
    #[error("events must be written in ascending seq: {seq} came after {previous}")]
    EventsNotAscending { previous: u64, seq: u64 },
    #[error("event seq {seq} appears more than once")]
    DuplicateEvent { seq: u64 },
    #[error("filters must be a JSON object")]
    FiltersNotObject,
    #[error("cannot compute a proof: {0}")]
    Proof(#[from] ProofError),
    #[error("bundle is larger than the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("bundle holds {count} {what}, more than the limit of {limit}")]
    TooManyRecords {
        what: &'static str,
        count: usize,
        limit: usize,
    },
    #[error("unsupported bundle format {found:?}; this verifier reads {FORMAT:?}")]
    UnsupportedFormat { found: String },
    #[error("bundle is not valid JSON for {FORMAT}: {0}")]
    Json(#[from] serde_json::Error),
    #[error("cannot {action} {}: {source}", path.display())]
    File {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read or write the bundle: {0}")]
    Io(#[from] std::io::Error),
}

/// An evidence bundle, `aether.evidence-bundle.v1`.
///
/// Only the events' fields, hashes and proofs and the checkpoints are authenticated (by the
/// checkpoint signatures); `created_at`, `filters` and `lineage` are the exporter's word.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bundle {
    /// Always [`FORMAT`].
    pub format: String,
    /// When the bundle was made; RFC 3339 UTC with six fractional digits.
    #[serde(serialize_with = "hashing::serialize_timestamp")]
    pub created_at: DateTime<Utc>,
    /// What was asked for (a JSON object); free form, not authenticated.
    pub filters: serde_json::Value,
    /// The SM2 public key the signatures are checked from (SEC1 uncompressed, lowercase
    /// hex): the checkpoints' signer, or with key rotations the key before the first.
    #[serde(deserialize_with = "strict::lower_hex_string")]
    pub public_key: String,
    /// `CheckpointKeyRotated` payloads in ascending tree size, each below the anchor's: the
    /// chain from `public_key` to the key that signed the anchor. Absent when none.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "strict::key_rotations"
    )]
    pub key_rotations: Vec<KeyRotation>,
    /// Signed tree heads in strictly ascending tree size; the last is the anchor.
    #[serde(deserialize_with = "strict::checkpoints")]
    pub checkpoints: Vec<SignedCheckpoint>,
    /// `consistency[i]` links `checkpoints[i]` to `checkpoints[i + 1]`.
    pub consistency: Vec<ConsistencyProof>,
    /// Events in strictly ascending seq, each with its inclusion proof against the anchor.
    pub events: Vec<BundleEvent>,
    /// Opaque records linking events to lineage (OpenLineage run, Delta version); not
    /// authenticated and not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lineage: Option<Vec<serde_json::Map<String, serde_json::Value>>>,
}

/// RFC 9162 consistency proof between two consecutive checkpoints of a bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsistencyProof {
    /// Tree size of the earlier checkpoint.
    pub old_size: u64,
    /// Tree size of the later checkpoint.
    pub new_size: u64,
    /// `PROOF(old_size, D[new_size])`, lowercase hex.
    #[serde(with = "strict::hash_list")]
    pub proof: Vec<Hash>,
}

/// One ledger event with every hashed field, exactly as hashed, and its inclusion proof.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleEvent {
    pub seq: u64,
    pub stream_id: String,
    pub stream_version: u64,
    /// UUID, lowercase hyphenated.
    pub event_id: String,
    pub event_type: String,
    pub schema_version: u32,
    /// RFC 8785 text of the payload object: the exact bytes hashed.
    pub payload: String,
    /// RFC 8785 text of the metadata object: the exact bytes hashed.
    pub metadata: String,
    /// RFC 3339 UTC, exactly six fractional digits and `Z`: the exact text hashed.
    pub recorded_at: String,
    #[serde(with = "strict::hash")]
    pub prev_hash: Hash,
    #[serde(with = "strict::hash")]
    pub hash: Hash,
    /// `PATH(seq − 1, D[anchor tree size])`, leaf to root, lowercase hex.
    #[serde(with = "strict::hash_list")]
    pub inclusion_proof: Vec<Hash>,
}

impl BundleEvent {
    /// The bundle form of a recorded event, with its inclusion proof.
    pub fn from_recorded(event: &RecordedEvent, inclusion_proof: Vec<Hash>) -> Self {
        BundleEvent {
            seq: event.seq,
            stream_id: event.stream_id.clone(),
            stream_version: event.stream_version,
            event_id: event.event_id.hyphenated().to_string(),
            event_type: event.event_type.clone(),
            schema_version: event.schema_version,
            payload: event.payload.get().to_owned(),
            metadata: event.metadata.get().to_owned(),
            recorded_at: hashing::format_timestamp(&event.recorded_at),
            prev_hash: event.prev_hash,
            hash: event.hash,
            inclusion_proof,
        }
    }
}

impl Bundle {
    /// Builds a bundle of `events` (any order; sorted by seq here) proven against the last
    /// of `checkpoints` (the anchor), with consistency proofs between consecutive
    /// checkpoints, all computed from `tree`, the ledger's Merkle tree over at least the
    /// anchor's tree size.
    ///
    /// Checks that checkpoints are strictly ascending, share one signer and match `tree`,
    /// and that every event lies within the anchor. It does not check signatures or event
    /// hashes: [`crate::offline::verify_bundle`] does, on the result.
    pub fn build(
        events: Vec<RecordedEvent>,
        tree: &(impl MerkleProofs + ?Sized),
        checkpoints: Vec<SignedCheckpoint>,
        filters: serde_json::Value,
        created_at: DateTime<Utc>,
    ) -> Result<Bundle, BundleError> {
        Self::build_rotated(events, tree, checkpoints, Vec::new(), filters, created_at)
    }

    /// [`build`](Self::build) for a ledger whose checkpoint key was rotated: `rotations` are
    /// the ledger's `CheckpointKeyRotated` payloads in order; those below the anchor go in
    /// the bundle, and `public_key` is the key before the first of them, so a verifier
    /// that trusts the ledger's first key follows the chain to the anchor's signer.
    pub fn build_rotated(
        mut events: Vec<RecordedEvent>,
        tree: &(impl MerkleProofs + ?Sized),
        checkpoints: Vec<SignedCheckpoint>,
        rotations: Vec<KeyRotation>,
        filters: serde_json::Value,
        created_at: DateTime<Utc>,
    ) -> Result<Bundle, BundleError> {
        let mut bundle = Self::head(tree, checkpoints, rotations, filters, created_at)?;
        events.sort_by_key(|e| e.seq);
        let mut order = EventOrder::new(bundle.anchor_tree_size());
        bundle.events.reserve(events.len());
        for event in &events {
            order.admit(event.seq)?;
            bundle
                .events
                .push(bundle_event(event, tree, order.anchor_tree_size)?);
        }
        Ok(bundle)
    }

    /// Starts a bundle written as it is built, so that an export of any size holds one page
    /// of events in memory rather than all of them: the same checks as
    /// [`build_rotated`](Self::build_rotated), then the bytes that open the document (up to
    /// and including `"events":[`) and the [`EventWriter`] that appends each event. What the
    /// pieces make together is byte for byte what [`to_vec`](Self::to_vec) makes of the
    /// bundle built whole from the same events.
    pub fn begin_rotated(
        tree: &(impl MerkleProofs + ?Sized),
        checkpoints: Vec<SignedCheckpoint>,
        rotations: Vec<KeyRotation>,
        filters: serde_json::Value,
        created_at: DateTime<Utc>,
    ) -> Result<(Vec<u8>, EventWriter), BundleError> {
        let head = Self::head(tree, checkpoints, rotations, filters, created_at)?;
        let mut bytes = head.to_vec()?;
        // Compact JSON of a bundle without events or lineage ends `"events":[]}`.
        let closing = b"]}";
        if !bytes.ends_with(b"\"events\":[]}") {
            return Err(BundleError::Json(serde::ser::Error::custom(
                "the bundle head does not end with its events member",
            )));
        }
        bytes.truncate(bytes.len() - closing.len());
        Ok((
            bytes,
            EventWriter {
                order: EventOrder::new(head.anchor_tree_size()),
            },
        ))
    }

    /// The anchor's tree size (0 for a bundle without checkpoints, which no build makes).
    fn anchor_tree_size(&self) -> u64 {
        self.anchor().map_or(0, |a| a.tree_size)
    }

    /// A bundle without events: the checks on checkpoints and rotations, the public key and
    /// the consistency proofs.
    fn head(
        tree: &(impl MerkleProofs + ?Sized),
        checkpoints: Vec<SignedCheckpoint>,
        mut rotations: Vec<KeyRotation>,
        filters: serde_json::Value,
        created_at: DateTime<Utc>,
    ) -> Result<Bundle, BundleError> {
        if !filters.is_object() {
            return Err(BundleError::FiltersNotObject);
        }
        let Some(anchor) = checkpoints.last() else {
            return Err(BundleError::NoCheckpoints);
        };
        rotations.retain(|r| r.tree_size < anchor.tree_size);
        let public_key = rotations
            .first()
            .map_or_else(|| anchor.public_key.clone(), |r| r.previous_key.clone());
        for (index, pair) in rotations.windows(2).enumerate() {
            if let [before, after] = pair
                && after.previous_key != before.new_key
            {
                return Err(BundleError::BrokenKeyChain {
                    index: index + 1,
                    expected: before.new_key.clone(),
                    found: after.previous_key.clone(),
                });
            }
        }
        for rotation in &rotations {
            let computed = tree.root_at(rotation.tree_size)?;
            if computed != rotation.root_hash {
                return Err(BundleError::CheckpointRootMismatch {
                    tree_size: rotation.tree_size,
                    claimed: hex::encode(rotation.root_hash),
                    computed: hex::encode(computed),
                });
            }
        }
        let mut previous: Option<u64> = None;
        for (index, checkpoint) in checkpoints.iter().enumerate() {
            if checkpoint.tree_size == 0 {
                return Err(BundleError::EmptyCheckpoint { index });
            }
            if let Some(previous) = previous
                && checkpoint.tree_size <= previous
            {
                return Err(BundleError::CheckpointsNotAscending {
                    index,
                    previous,
                    tree_size: checkpoint.tree_size,
                });
            }
            previous = Some(checkpoint.tree_size);
            let in_force = key_in_force(&public_key, &rotations, checkpoint.tree_size);
            if checkpoint.public_key != in_force {
                return Err(BundleError::MixedSigners {
                    index,
                    expected: in_force.to_owned(),
                    found: checkpoint.public_key.clone(),
                });
            }
            let computed = tree.root_at(checkpoint.tree_size)?;
            if computed != checkpoint.root_hash {
                return Err(BundleError::CheckpointRootMismatch {
                    tree_size: checkpoint.tree_size,
                    claimed: hex::encode(checkpoint.root_hash),
                    computed: hex::encode(computed),
                });
            }
        }
        let consistency = checkpoints
            .windows(2)
            .filter_map(|pair| match pair {
                [old, new] => Some((old.tree_size, new.tree_size)),
                _ => None,
            })
            .map(|(old_size, new_size)| {
                Ok(ConsistencyProof {
                    old_size,
                    new_size,
                    proof: tree.consistency_proof(old_size, new_size)?,
                })
            })
            .collect::<Result<Vec<_>, BundleError>>()?;

        Ok(Bundle {
            format: FORMAT.to_owned(),
            created_at,
            filters,
            public_key,
            key_rotations: rotations,
            checkpoints,
            consistency,
            events: Vec::new(),
            lineage: None,
        })
    }

    /// Attaches lineage records (opaque to this crate).
    pub fn with_lineage(
        mut self,
        lineage: Vec<serde_json::Map<String, serde_json::Value>>,
    ) -> Self {
        self.lineage = Some(lineage);
        self
    }

    /// The anchor: the last checkpoint, against which every inclusion proof is made.
    pub fn anchor(&self) -> Option<&SignedCheckpoint> {
        self.checkpoints.last()
    }

    /// Compact JSON.
    pub fn to_vec(&self) -> Result<Vec<u8>, BundleError> {
        Ok(serde_json::to_vec(self)?)
    }

    /// Pretty JSON (two-space indent) with a final newline.
    pub fn to_vec_pretty(&self) -> Result<Vec<u8>, BundleError> {
        let mut out = serde_json::to_vec_pretty(self)?;
        out.push(b'\n');
        Ok(out)
    }

    /// Writes the bundle as JSON, compact or pretty.
    pub fn to_writer(&self, mut writer: impl Write, pretty: bool) -> Result<(), BundleError> {
        let bytes = if pretty {
            self.to_vec_pretty()?
        } else {
            self.to_vec()?
        };
        writer.write_all(&bytes)?;
        writer.flush()?;
        Ok(())
    }

    /// Writes the bundle to a file (created or truncated), compact or pretty.
    pub fn write_file(&self, path: &Path, pretty: bool) -> Result<(), BundleError> {
        let file_error = |source| BundleError::File {
            action: "write",
            path: path.to_owned(),
            source,
        };
        let mut file = std::fs::File::create(path).map_err(file_error)?;
        self.to_writer(&mut file, pretty).map_err(|e| match e {
            BundleError::Io(source) => file_error(source),
            other => other,
        })?;
        file.sync_all().map_err(file_error)
    }

    /// Parses a bundle with the default [`ReadLimits`].
    pub fn from_slice(bytes: &[u8]) -> Result<Bundle, BundleError> {
        Self::from_slice_with_limits(bytes, &ReadLimits::default())
    }

    /// Parses a bundle: size limit, strict JSON (unknown members are refused, hex must be
    /// lowercase), the v1 format tag, then the record-count limits. Never panics.
    pub fn from_slice_with_limits(
        bytes: &[u8],
        limits: &ReadLimits,
    ) -> Result<Bundle, BundleError> {
        if bytes.len() as u64 > limits.max_bytes {
            return Err(BundleError::TooLarge {
                limit: limits.max_bytes,
            });
        }
        let bundle: Bundle = match serde_json::from_slice(bytes) {
            Ok(bundle) => bundle,
            Err(e) => {
                // A newer format fails on its new members: say so rather than which member.
                return Err(match probe_format(bytes) {
                    Some(found) if found != FORMAT => BundleError::UnsupportedFormat { found },
                    _ => BundleError::Json(e),
                });
            }
        };
        if bundle.format != FORMAT {
            return Err(BundleError::UnsupportedFormat {
                found: bundle.format,
            });
        }
        for (what, count, limit) in [
            ("events", bundle.events.len(), limits.max_events),
            (
                "checkpoints",
                bundle.checkpoints.len(),
                limits.max_checkpoints,
            ),
            (
                "key rotations",
                bundle.key_rotations.len(),
                limits.max_checkpoints,
            ),
        ] {
            if count > limit {
                return Err(BundleError::TooManyRecords { what, count, limit });
            }
        }
        Ok(bundle)
    }

    /// Reads and parses a bundle, reading at most `limits.max_bytes` (+1 to detect more).
    pub fn from_reader(reader: impl Read, limits: &ReadLimits) -> Result<Bundle, BundleError> {
        let mut bytes = Vec::new();
        reader
            .take(limits.max_bytes.saturating_add(1))
            .read_to_end(&mut bytes)?;
        Self::from_slice_with_limits(&bytes, limits)
    }

    /// Reads and parses a bundle file.
    pub fn read_file(path: &Path, limits: &ReadLimits) -> Result<Bundle, BundleError> {
        let file_error = |source| BundleError::File {
            action: "read",
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(file_error)?;
        if file.metadata().map_err(file_error)?.len() > limits.max_bytes {
            return Err(BundleError::TooLarge {
                limit: limits.max_bytes,
            });
        }
        Self::from_reader(file, limits).map_err(|e| match e {
            BundleError::Io(source) => file_error(source),
            other => other,
        })
    }
}

/// Appends the events of a bundle started by [`Bundle::begin_rotated`], in ascending seq,
/// each with its inclusion proof against the anchor.
#[derive(Debug)]
pub struct EventWriter {
    order: EventOrder,
}

impl EventWriter {
    /// Appends `event` and its inclusion proof (from `tree`) to `out`. An event not above
    /// the previous one, or beyond the anchor, is refused and nothing is appended.
    pub fn write(
        &mut self,
        event: &RecordedEvent,
        tree: &(impl MerkleProofs + ?Sized),
        out: &mut Vec<u8>,
    ) -> Result<(), BundleError> {
        let first = self.order.last_seq.is_none();
        let mut order = self.order;
        order.admit(event.seq)?;
        let entry = bundle_event(event, tree, order.anchor_tree_size)?;
        if !first {
            out.push(b',');
        }
        serde_json::to_writer(&mut *out, &entry)?;
        self.order = order;
        Ok(())
    }

    /// How many events were written.
    pub fn written(&self) -> u64 {
        self.order.written
    }

    /// The bytes that close the document.
    pub fn finish(self) -> &'static [u8] {
        b"]}"
    }
}

/// The order a bundle's events must follow: strictly ascending seq, from 1 to the anchor.
#[derive(Clone, Copy, Debug)]
struct EventOrder {
    anchor_tree_size: u64,
    last_seq: Option<u64>,
    written: u64,
}

impl EventOrder {
    fn new(anchor_tree_size: u64) -> Self {
        EventOrder {
            anchor_tree_size,
            last_seq: None,
            written: 0,
        }
    }

    fn admit(&mut self, seq: u64) -> Result<(), BundleError> {
        match self.last_seq {
            Some(last) if last == seq => return Err(BundleError::DuplicateEvent { seq }),
            Some(last) if last > seq => {
                return Err(BundleError::EventsNotAscending {
                    previous: last,
                    seq,
                });
            }
            _ => {}
        }
        if seq == 0 || seq > self.anchor_tree_size {
            return Err(BundleError::EventBeyondAnchor {
                seq,
                anchor_tree_size: self.anchor_tree_size,
            });
        }
        self.last_seq = Some(seq);
        self.written += 1;
        Ok(())
    }
}

/// `event` in bundle form with its inclusion proof against a tree of `anchor_tree_size`.
fn bundle_event(
    event: &RecordedEvent,
    tree: &(impl MerkleProofs + ?Sized),
    anchor_tree_size: u64,
) -> Result<BundleEvent, BundleError> {
    let proof = tree.inclusion_proof(event.seq - 1, anchor_tree_size)?;
    Ok(BundleEvent::from_recorded(event, proof))
}

/// The `format` member of a JSON document, if it has a string one.
fn probe_format(bytes: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Probe {
        format: String,
    }
    serde_json::from_slice::<Probe>(bytes)
        .ok()
        .map(|p| p.format)
}

/// Strict deserializers: hashes are exactly 64 lowercase hex digits, key and signature
/// strings are lowercase hex, checkpoints have no unknown members. Writing uses the plain
/// encodings, which are all lowercase.
mod strict {
    use super::{Hash, KeyRotation, SignedCheckpoint};
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    fn is_lower_hex(s: &str) -> bool {
        s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }

    /// Exactly 64 lowercase hex digits.
    pub fn parse_hash(s: &str) -> Result<Hash, String> {
        if s.len() != 64 || !is_lower_hex(s) {
            return Err(format!(
                "expected a hash of 64 lowercase hex digits, got {:?}",
                s.chars().take(80).collect::<String>()
            ));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|e| e.to_string())?;
        Ok(out)
    }

    pub fn lower_hex_string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        let s = String::deserialize(d)?;
        if !is_lower_hex(&s) {
            return Err(D::Error::custom("expected lowercase hex digits"));
        }
        Ok(s)
    }

    pub mod hash {
        use super::*;

        pub fn serialize<S: Serializer>(h: &Hash, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&hex::encode(h))
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Hash, D::Error> {
            parse_hash(&String::deserialize(d)?).map_err(D::Error::custom)
        }
    }

    pub mod hash_list {
        use super::*;

        pub fn serialize<S: Serializer>(hashes: &[Hash], s: S) -> Result<S::Ok, S::Error> {
            s.collect_seq(hashes.iter().map(hex::encode))
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Hash>, D::Error> {
            Vec::<String>::deserialize(d)?
                .iter()
                .map(|s| parse_hash(s).map_err(D::Error::custom))
                .collect()
        }
    }

    /// A checkpoint as it must appear in a bundle.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Checkpoint {
        tree_size: u64,
        #[serde(with = "hash")]
        root_hash: Hash,
        signed_at: String,
        #[serde(deserialize_with = "lower_hex_string")]
        signature: String,
        #[serde(deserialize_with = "lower_hex_string")]
        public_key: String,
    }

    /// A key rotation as it must appear in a bundle.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Rotation {
        tree_size: u64,
        #[serde(with = "hash")]
        root_hash: Hash,
        rotated_at: String,
        #[serde(deserialize_with = "lower_hex_string")]
        previous_key: String,
        #[serde(deserialize_with = "lower_hex_string")]
        new_key: String,
        #[serde(deserialize_with = "lower_hex_string")]
        signature: String,
        #[serde(deserialize_with = "lower_hex_string")]
        new_key_signature: String,
    }

    pub fn key_rotations<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<KeyRotation>, D::Error> {
        Ok(Vec::<Rotation>::deserialize(d)?
            .into_iter()
            .map(|r| KeyRotation {
                tree_size: r.tree_size,
                root_hash: r.root_hash,
                rotated_at: r.rotated_at,
                previous_key: r.previous_key,
                new_key: r.new_key,
                signature: r.signature,
                new_key_signature: r.new_key_signature,
            })
            .collect())
    }

    pub fn checkpoints<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<SignedCheckpoint>, D::Error> {
        Ok(Vec::<Checkpoint>::deserialize(d)?
            .into_iter()
            .map(|c| SignedCheckpoint {
                tree_size: c.tree_size,
                root_hash: c.root_hash,
                signed_at: c.signed_at,
                signature: c.signature,
                public_key: c.public_key,
            })
            .collect())
    }
}

pub use strict::parse_hash;

/// The key that signs checkpoints of `tree_size` events: `first`, after every rotation
/// made at a smaller tree size (rotations in ascending order, a chain from `first`).
pub fn key_in_force<'a>(first: &'a str, rotations: &'a [KeyRotation], tree_size: u64) -> &'a str {
    rotations
        .iter()
        .take_while(|r| r.tree_size < tree_size)
        .last()
        .map_or(first, |r| r.new_key.as_str())
}

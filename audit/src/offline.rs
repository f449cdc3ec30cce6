//! The offline verifier: checks an evidence bundle with nothing but the bundle (and, ideally,
//! the operator's public key obtained independently). No database, no network.
//!
//! Every check of `BUNDLE.md` § "Verification" runs and every failure is collected; a
//! verdict is `ok` only when none was found.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use aether_ledger::checkpoint::CheckpointVerifier;
use aether_ledger::hashing::{self, GENESIS_PREV_HASH, HashedFields};
use aether_ledger::key_rotation::KeyRotation;
use aether_ledger::merkle::{verify_consistency, verify_inclusion};
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::bundle::{Bundle, BundleError, BundleEvent, FORMAT, ReadLimits, key_in_force};

/// What kind of check failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ProblemKind {
    /// The document does not follow the format (format tag, filters, signer key member).
    Format,
    /// A checkpoint is missing, malformed, signed by another key or badly signed.
    Checkpoint,
    /// A key rotation does not continue the chain of keys, is out of order, or is badly
    /// signed by either key.
    KeyRotation,
    /// Checkpoints are not in strictly ascending tree size, or one covers no event.
    CheckpointOrder,
    /// A consistency proof is missing, for the wrong sizes, or does not verify.
    Consistency,
    /// Events are not in strictly ascending seq, or a seq is 0.
    EventOrder,
    /// `event_id` or `recorded_at` is not written the way it is hashed.
    EventField,
    /// `payload` or `metadata` is not a canonical (RFC 8785) JSON object.
    NonCanonicalJson,
    /// The hash recomputed from the fields differs from `hash`.
    HashMismatch,
    /// The event lies beyond the anchor checkpoint, or its inclusion proof does not verify.
    Inclusion,
    /// `prev_hash` is not the previous event's `hash` (or not zero for seq 1).
    BrokenLink,
    /// `recorded_at` decreases along seq.
    TimeWentBackwards,
    /// `stream_version` does not increase along seq within a stream, or jumps too far.
    StreamVersion,
}

/// One failed check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// The event concerned, if the problem is about one.
    pub seq: Option<u64>,
    pub kind: ProblemKind,
    /// What is wrong, in words.
    pub what: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.seq {
            Some(seq) => write!(f, "seq {seq}: {}", self.what),
            None => f.write_str(&self.what),
        }
    }
}

/// The outcome of checking a bundle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Every check passed. With `signer_trusted == false` this proves the events are
    /// committed to by *whoever holds the key* of `key_fingerprint`, nothing more.
    pub ok: bool,
    pub events_checked: u64,
    pub checkpoints_checked: u64,
    /// Checkpoint key rotations followed from `public_key` to the anchor's signer.
    pub key_rotations_checked: u64,
    /// Tree size of the anchor (last) checkpoint, if the bundle has one.
    pub anchor_tree_size: Option<u64>,
    /// Root hash of the anchor checkpoint, lowercase hex.
    pub anchor_root_hash: Option<String>,
    /// Whether checkpoints were checked against a key supplied by the caller rather than
    /// the key the bundle itself names.
    pub signer_trusted: bool,
    /// [`key_fingerprint`] of the key the signatures were checked against.
    pub key_fingerprint: Option<String>,
    pub problems: Vec<Problem>,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ok {
            writeln!(f, "evidence bundle OK")?;
        } else {
            writeln!(
                f,
                "evidence bundle FAILED: {} problem(s)",
                self.problems.len()
            )?;
        }
        writeln!(
            f,
            "  {} event(s), {} checkpoint(s) checked",
            self.events_checked, self.checkpoints_checked
        )?;
        if self.key_rotations_checked > 0 {
            writeln!(
                f,
                "  {} checkpoint key rotation(s) followed",
                self.key_rotations_checked
            )?;
        }
        if let (Some(size), Some(root)) = (self.anchor_tree_size, &self.anchor_root_hash) {
            writeln!(f, "  anchor: tree size {size}, root {root}")?;
        }
        let fingerprint = self
            .key_fingerprint
            .as_deref()
            .unwrap_or("(unreadable key)");
        if self.signer_trusted {
            writeln!(f, "  signer: the trusted key, fingerprint {fingerprint}")?;
        } else {
            writeln!(
                f,
                "  signer: NOT independently trusted; checked against the key the bundle names, \
                 fingerprint {fingerprint}. Compare it with the operator's published key \
                 fingerprint, or verify with the operator's key."
            )?;
        }
        for problem in &self.problems {
            writeln!(f, "  - {problem}")?;
        }
        Ok(())
    }
}

/// Fingerprint of an SM2 public key given as SEC1 hex: `SM3(SEC1 bytes)`, lowercase hex.
/// `None` if the text is not hex.
pub fn key_fingerprint(public_key_hex: &str) -> Option<String> {
    hex::decode(public_key_hex)
        .ok()
        .map(|bytes| hex::encode(hashing::sm3(&bytes)))
}

/// Checks `bundle` (see `BUNDLE.md` § "Verification"). Checkpoint signatures are checked
/// against `trusted_key` when given, else against the key the bundle names, in which case
/// the verdict says the signer was not independently trusted.
pub fn verify_bundle(bundle: &Bundle, trusted_key: Option<&CheckpointVerifier>) -> Verdict {
    verify_bundle_with_progress(bundle, trusted_key, |_, _| {})
}

/// [`verify_bundle`], calling `progress(done, total)` as items are checked: first the
/// checkpoints, then the events (`total` = checkpoints + events).
pub fn verify_bundle_with_progress(
    bundle: &Bundle,
    trusted_key: Option<&CheckpointVerifier>,
    mut progress: impl FnMut(u64, u64),
) -> Verdict {
    let total = (bundle.checkpoints.len() + bundle.events.len()) as u64;
    let mut check = Checker::default();
    let (signer, signer_trusted, key_fingerprint) = check.signer(bundle, trusted_key);
    check.key_rotations(bundle);
    // The chain of keys the checkpoints are checked against: from the bundle's first key
    // through its rotations, unless the trusted key is not in that chain, in which case
    // every checkpoint must be the trusted key's own.
    let trusted_hex = trusted_key.map(CheckpointVerifier::public_key_hex);
    let chain = match (&signer, &trusted_hex) {
        (None, _) => None,
        (Some(_), Some(trusted))
            if *trusted != bundle.public_key
                && !bundle.key_rotations.iter().any(|r| r.new_key == *trusted) =>
        {
            Some((trusted.as_str(), &[][..]))
        }
        (Some(_), _) => Some((bundle.public_key.as_str(), &bundle.key_rotations[..])),
    };
    let mut done = 0;
    progress(done, total);
    check.checkpoints(bundle, chain, |_| {
        done += 1;
        progress(done, total);
    });
    check.consistency(bundle);
    check.events(bundle, |_| {
        done += 1;
        progress(done, total);
    });
    let anchor = bundle.anchor();
    Verdict {
        ok: check.problems.is_empty(),
        events_checked: bundle.events.len() as u64,
        checkpoints_checked: bundle.checkpoints.len() as u64,
        key_rotations_checked: bundle.key_rotations.len() as u64,
        anchor_tree_size: anchor.map(|a| a.tree_size),
        anchor_root_hash: anchor.map(|a| hex::encode(a.root_hash)),
        signer_trusted,
        key_fingerprint,
        problems: check.problems,
    }
}

/// Reads the bundle at `path` (default [`ReadLimits`]) and checks it, reporting progress
/// as [`verify_bundle_with_progress`] does. An unreadable or malformed file is an error;
/// problems inside a well-formed bundle are in the verdict.
pub fn verify_bundle_file(
    path: &Path,
    trusted_key: Option<&CheckpointVerifier>,
    progress: impl FnMut(u64, u64),
) -> Result<Verdict, BundleError> {
    let bundle = Bundle::read_file(path, &ReadLimits::default())?;
    Ok(verify_bundle_with_progress(&bundle, trusted_key, progress))
}

#[derive(Default)]
struct Checker {
    problems: Vec<Problem>,
}

impl Checker {
    fn problem(&mut self, seq: Option<u64>, kind: ProblemKind, what: impl Into<String>) {
        self.problems.push(Problem {
            seq,
            kind,
            what: what.into(),
        });
    }

    /// Step 1: the format tag, the filters object and the key to check signatures with.
    fn signer(
        &mut self,
        bundle: &Bundle,
        trusted_key: Option<&CheckpointVerifier>,
    ) -> (Option<CheckpointVerifier>, bool, Option<String>) {
        if bundle.format != FORMAT {
            self.problem(
                None,
                ProblemKind::Format,
                format!("format is {:?}, expected {FORMAT:?}", bundle.format),
            );
        }
        if !bundle.filters.is_object() {
            self.problem(None, ProblemKind::Format, "filters is not a JSON object");
        }
        match trusted_key {
            Some(key) => {
                let trusted = key.public_key_hex();
                // The trusted key may be the first of the chain or any key it was rotated
                // to: each rotation is signed by its new key too, which so vouches for the
                // keys before it.
                let in_chain = bundle.public_key == trusted
                    || bundle.key_rotations.iter().any(|r| r.new_key == trusted);
                if !in_chain {
                    self.problem(
                        None,
                        ProblemKind::Format,
                        format!(
                            "the bundle names signer key fingerprint {}, not the trusted key's {}",
                            key_fingerprint(&bundle.public_key)
                                .unwrap_or_else(|| "(not hex)".into()),
                            key_fingerprint(&trusted).unwrap_or_default(),
                        ),
                    );
                }
                (Some(key.clone()), true, key_fingerprint(&trusted))
            }
            None => {
                let fingerprint = key_fingerprint(&bundle.public_key);
                match CheckpointVerifier::from_hex(&bundle.public_key) {
                    Ok(key) => (Some(key), false, fingerprint),
                    Err(e) => {
                        self.problem(
                            None,
                            ProblemKind::Format,
                            format!("public_key is unusable, no signature can be checked: {e}"),
                        );
                        (None, false, fingerprint)
                    }
                }
            }
        }
    }

    /// Step 1a: the key rotations chain from `public_key`, each signed by both keys, in
    /// strictly ascending tree size below the anchor's.
    fn key_rotations(&mut self, bundle: &Bundle) {
        let mut in_force = bundle.public_key.as_str();
        let mut previous: Option<u64> = None;
        let anchor = bundle.anchor().map(|a| a.tree_size);
        for (index, rotation) in bundle.key_rotations.iter().enumerate() {
            let size = rotation.tree_size;
            let mut fail = |what: String| {
                self.problems.push(Problem {
                    seq: None,
                    kind: ProblemKind::KeyRotation,
                    what: format!("key rotation {index} (tree size {size}): {what}"),
                })
            };
            if rotation.previous_key != in_force {
                fail(format!(
                    "hands over from key fingerprint {}, but the key in force is {}",
                    key_fingerprint(&rotation.previous_key).unwrap_or_default(),
                    key_fingerprint(in_force).unwrap_or_default()
                ));
            }
            if let Err(e) = rotation.verify() {
                fail(e.to_string());
            }
            if previous.is_some_and(|p| size <= p) {
                fail("not above the previous rotation's tree size".into());
            }
            if anchor.is_some_and(|a| size >= a) {
                fail("not below the anchor checkpoint's tree size".into());
            }
            previous = Some(size);
            in_force = &rotation.new_key;
        }
    }

    /// Steps 2 and 3: each checkpoint's signature by the key in force at its tree size;
    /// strictly ascending, non-zero tree sizes.
    fn checkpoints(
        &mut self,
        bundle: &Bundle,
        chain: Option<(&str, &[KeyRotation])>,
        mut tick: impl FnMut(usize),
    ) {
        if bundle.checkpoints.is_empty() {
            self.problem(
                None,
                ProblemKind::Checkpoint,
                "the bundle has no checkpoint: nothing anchors its events",
            );
        }
        let mut previous: Option<u64> = None;
        for (index, checkpoint) in bundle.checkpoints.iter().enumerate() {
            let size = checkpoint.tree_size;
            if let Some((first, rotations)) = chain
                && let Err(e) = CheckpointVerifier::from_hex(key_in_force(first, rotations, size))
                    .and_then(|signer| signer.verify(checkpoint))
            {
                self.problem(
                    None,
                    ProblemKind::Checkpoint,
                    format!("checkpoint {index} (tree size {size}): {e}"),
                );
            }
            if size == 0 {
                self.problem(
                    None,
                    ProblemKind::CheckpointOrder,
                    format!("checkpoint {index} has tree size 0"),
                );
            }
            if let Some(previous) = previous
                && size <= previous
            {
                self.problem(
                    None,
                    ProblemKind::CheckpointOrder,
                    format!(
                        "checkpoint {index} has tree size {size}, not above the previous checkpoint's {previous}"
                    ),
                );
            }
            previous = Some(size);
            tick(index);
        }
    }

    /// Step 4: one consistency proof per consecutive pair of checkpoints.
    fn consistency(&mut self, bundle: &Bundle) {
        let pairs = bundle.checkpoints.len().saturating_sub(1);
        if bundle.consistency.len() != pairs {
            self.problem(
                None,
                ProblemKind::Consistency,
                format!(
                    "{} consistency proof(s) for {} checkpoint(s); expected {pairs}",
                    bundle.consistency.len(),
                    bundle.checkpoints.len()
                ),
            );
        }
        for (index, (pair, proof)) in bundle
            .checkpoints
            .windows(2)
            .zip(&bundle.consistency)
            .enumerate()
        {
            let [old, new] = pair else { continue };
            if proof.old_size != old.tree_size || proof.new_size != new.tree_size {
                self.problem(
                    None,
                    ProblemKind::Consistency,
                    format!(
                        "consistency proof {index} is from size {} to {}, but checkpoints {index} and {} have sizes {} and {}",
                        proof.old_size,
                        proof.new_size,
                        index + 1,
                        old.tree_size,
                        new.tree_size
                    ),
                );
                continue;
            }
            if old.tree_size == 0 || old.tree_size >= new.tree_size {
                continue; // already reported as a checkpoint order problem
            }
            if let Err(e) = verify_consistency(
                old.tree_size,
                new.tree_size,
                &old.root_hash,
                &new.root_hash,
                &proof.proof,
            ) {
                self.problem(
                    None,
                    ProblemKind::Consistency,
                    format!(
                        "consistency proof {index} from tree size {} to {}: {e}",
                        old.tree_size, new.tree_size
                    ),
                );
            }
        }
    }

    /// Steps 5 to 8: each event on its own, then against the events before it.
    fn events(&mut self, bundle: &Bundle, mut tick: impl FnMut(usize)) {
        let anchor = bundle.anchor();
        let mut previous: Option<(&BundleEvent, Option<DateTime<Utc>>)> = None;
        let mut streams: HashMap<&str, (u64, u64)> = HashMap::new();
        for (index, event) in bundle.events.iter().enumerate() {
            let seq = Some(event.seq);
            let recorded_at = self.event_alone(event);

            match anchor {
                None => {}
                Some(_) if event.seq == 0 => {} // reported below
                Some(anchor) if event.seq > anchor.tree_size => self.problem(
                    seq,
                    ProblemKind::Inclusion,
                    format!(
                        "seq lies beyond the anchor checkpoint's tree size {}",
                        anchor.tree_size
                    ),
                ),
                Some(anchor) => {
                    if let Err(e) = verify_inclusion(
                        &event.hash,
                        event.seq - 1,
                        anchor.tree_size,
                        &event.inclusion_proof,
                        &anchor.root_hash,
                    ) {
                        self.problem(
                            seq,
                            ProblemKind::Inclusion,
                            format!(
                                "inclusion proof of hash {} against the anchor (tree size {}): {e}",
                                hex::encode(event.hash),
                                anchor.tree_size
                            ),
                        );
                    }
                }
            }

            if event.seq == 0 {
                self.problem(seq, ProblemKind::EventOrder, "seq 0 does not exist");
            }
            if event.seq == 1 && event.prev_hash != GENESIS_PREV_HASH {
                self.problem(
                    seq,
                    ProblemKind::BrokenLink,
                    format!(
                        "prev_hash of seq 1 must be 32 zero bytes, found {}",
                        hex::encode(event.prev_hash)
                    ),
                );
            }
            match previous {
                Some((before, _)) if event.seq <= before.seq => self.problem(
                    seq,
                    ProblemKind::EventOrder,
                    format!(
                        "event {index} has seq {}, not above the previous event's seq {}",
                        event.seq, before.seq
                    ),
                ),
                Some((before, before_time)) => {
                    if event.seq == before.seq + 1 && event.prev_hash != before.hash {
                        self.problem(
                            seq,
                            ProblemKind::BrokenLink,
                            format!(
                                "prev_hash is {} but the hash of seq {} is {}",
                                hex::encode(event.prev_hash),
                                before.seq,
                                hex::encode(before.hash)
                            ),
                        );
                    }
                    if let (Some(before_time), Some(at)) = (before_time, recorded_at)
                        && at < before_time
                    {
                        self.problem(
                            seq,
                            ProblemKind::TimeWentBackwards,
                            format!(
                                "recorded_at {} is earlier than seq {}'s {}",
                                event.recorded_at, before.seq, before.recorded_at
                            ),
                        );
                    }
                    if let Some(&(before_seq, before_version)) =
                        streams.get(event.stream_id.as_str())
                    {
                        let seq_step = event.seq.saturating_sub(before_seq);
                        if event.stream_version <= before_version
                            || event.stream_version - before_version > seq_step
                        {
                            self.problem(
                                seq,
                                ProblemKind::StreamVersion,
                                format!(
                                    "stream {:?} is at version {} here but at version {before_version} at seq {before_seq}",
                                    event.stream_id, event.stream_version
                                ),
                            );
                        }
                    }
                }
                None => {}
            }
            if event.stream_version == 0 {
                self.problem(
                    seq,
                    ProblemKind::StreamVersion,
                    "stream_version 0 does not exist",
                );
            }
            let in_order = previous.is_none_or(|(before, _)| event.seq > before.seq);
            if in_order {
                streams.insert(&event.stream_id, (event.seq, event.stream_version));
                previous = Some((event, recorded_at));
            }
            tick(index);
        }
    }

    /// Steps 5 and 6 for one event: field encodings, canonical JSON and the recomputed
    /// hash. Returns the parsed `recorded_at` when it is well formed.
    fn event_alone(&mut self, event: &BundleEvent) -> Option<DateTime<Utc>> {
        let seq = Some(event.seq);
        let event_id = match Uuid::try_parse(&event.event_id) {
            Ok(id) => {
                if id.hyphenated().to_string() != event.event_id {
                    self.problem(
                        seq,
                        ProblemKind::EventField,
                        format!(
                            "event_id {:?} is not a lowercase hyphenated UUID",
                            event.event_id
                        ),
                    );
                }
                Some(id)
            }
            Err(e) => {
                self.problem(
                    seq,
                    ProblemKind::EventField,
                    format!("event_id is not a UUID ({e}); hash not recomputed"),
                );
                None
            }
        };
        let recorded_at = match DateTime::parse_from_rfc3339(&event.recorded_at) {
            Ok(t) => {
                let t = t.with_timezone(&Utc);
                if !hashing::is_canonical_timestamp(&event.recorded_at) {
                    self.problem(
                        seq,
                        ProblemKind::EventField,
                        format!(
                            "recorded_at {:?} is not RFC 3339 UTC with six fractional digits and Z (no leap second)",
                            event.recorded_at
                        ),
                    );
                }
                Some(t)
            }
            Err(e) => {
                self.problem(
                    seq,
                    ProblemKind::EventField,
                    format!("recorded_at is not an RFC 3339 time ({e}); hash not recomputed"),
                );
                None
            }
        };
        for (field, text) in [("payload", &event.payload), ("metadata", &event.metadata)] {
            if let Err(what) = check_canonical_object(field, text) {
                self.problem(seq, ProblemKind::NonCanonicalJson, what);
            }
        }
        if let (Some(event_id), Some(recorded_at)) = (event_id, recorded_at) {
            let computed = hashing::event_hash(
                &event.prev_hash,
                &HashedFields {
                    seq: event.seq,
                    stream_id: &event.stream_id,
                    stream_version: event.stream_version,
                    event_id,
                    event_type: &event.event_type,
                    schema_version: event.schema_version,
                    payload: &event.payload,
                    metadata: &event.metadata,
                    recorded_at,
                },
            );
            if computed != event.hash {
                self.problem(
                    seq,
                    ProblemKind::HashMismatch,
                    format!(
                        "hash is {} but the fields and prev_hash give {}",
                        hex::encode(event.hash),
                        hex::encode(computed)
                    ),
                );
            }
        }
        recorded_at
    }
}

/// `text` must parse as a JSON object whose RFC 8785 form is `text` itself.
fn check_canonical_object(field: &str, text: &str) -> Result<(), String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{field} is not JSON: {e}"))?;
    if !value.is_object() {
        return Err(format!("{field} is not a JSON object"));
    }
    let canonical = hashing::canonical_json(&value)
        .map_err(|e| format!("{field} cannot be canonicalized: {e}"))?;
    if canonical != text {
        let at = canonical
            .bytes()
            .zip(text.bytes())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| canonical.len().min(text.len()));
        return Err(format!(
            "{field} is not in RFC 8785 canonical form (first difference at byte {at}; \
             canonical form is {} bytes, given {})",
            canonical.len(),
            text.len()
        ));
    }
    Ok(())
}

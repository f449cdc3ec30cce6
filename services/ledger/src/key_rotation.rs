//! Rotating the checkpoint key: a `CheckpointKeyRotated` event names the next key and is
//! signed by the key in force and by the next one, over the tree head it was made at. A
//! verifier that trusts the first key follows the rotations in ledger order, so a ledger
//! signed by a sequence of keys verifies from one trusted key, and a retired key cannot
//! sign a checkpoint after its rotation.

use serde::{Deserialize, Serialize};

use crate::checkpoint::{CheckpointError, CheckpointSigner, CheckpointVerifier};
use crate::error::LedgerError;
use crate::event::{NewEvent, RecordedEvent};
use crate::hashing::{self, Hash, format_timestamp};
use crate::store::{Direction, EventStore};

/// Stream that holds every key rotation.
pub const KEY_ROTATION_STREAM: &str = "ledger/checkpoint-keys";
/// Event type of a key rotation.
pub const KEY_ROTATION_EVENT_TYPE: &str = "CheckpointKeyRotated";
/// First line of the signed statement.
pub const ROTATION_TAG: &str = "aether.checkpoint-key-rotation.v1";

/// The payload of a `CheckpointKeyRotated` event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyRotation {
    /// The ledger's size when the rotation was signed: checkpoints of at most this many
    /// events are signed by `previous_key`, later ones by `new_key`.
    pub tree_size: u64,
    /// Merkle root of those events.
    #[serde(with = "hashing::hex_hash")]
    pub root_hash: Hash,
    /// RFC 3339 UTC with six fractional digits, as in the statement.
    pub rotated_at: String,
    /// The key in force until now, SEC1 uncompressed, lowercase hex.
    pub previous_key: String,
    /// The key in force from now on.
    pub new_key: String,
    /// SM2 signature `r ‖ s` of the statement by `previous_key`: its holder hands over.
    pub signature: String,
    /// The same statement signed by `new_key`: its holder accepts (proof of possession).
    pub new_key_signature: String,
}

/// The exact bytes both keys sign: six lines, each ending in `\n`.
pub fn rotation_statement(
    tree_size: u64,
    root_hash: &Hash,
    rotated_at: &str,
    previous_key: &str,
    new_key: &str,
) -> Vec<u8> {
    format!(
        "{ROTATION_TAG}\n{tree_size}\n{}\n{rotated_at}\n{previous_key}\n{new_key}\n",
        hex::encode(root_hash)
    )
    .into_bytes()
}

impl KeyRotation {
    /// Hands the ledger over from `previous` to `next` at tree head `(tree_size, root_hash)`.
    pub fn sign(
        previous: &CheckpointSigner,
        next: &CheckpointSigner,
        tree_size: u64,
        root_hash: Hash,
        rotated_at: chrono::DateTime<chrono::Utc>,
    ) -> KeyRotation {
        let rotated_at = format_timestamp(&rotated_at);
        let previous_key = previous.public_key_hex();
        let new_key = next.public_key_hex();
        let statement =
            rotation_statement(tree_size, &root_hash, &rotated_at, &previous_key, &new_key);
        KeyRotation {
            tree_size,
            root_hash,
            rotated_at,
            signature: previous.sign_bytes(&statement),
            new_key_signature: next.sign_bytes(&statement),
            previous_key,
            new_key,
        }
    }

    /// Checks the statement's form and both signatures (not which key is in force: the
    /// caller compares `previous_key` with the key it trusts).
    pub fn verify(&self) -> Result<(), CheckpointError> {
        if !hashing::is_canonical_timestamp(&self.rotated_at) {
            return Err(CheckpointError::Malformed(format!(
                "rotated_at {:?} is not RFC 3339 UTC with six fractional digits and Z",
                self.rotated_at
            )));
        }
        for key in [&self.previous_key, &self.new_key] {
            if key.len() != 130 || !key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                return Err(CheckpointError::Malformed(format!(
                    "key {key:?} is not 130 lowercase hex digits"
                )));
            }
        }
        if self.previous_key == self.new_key {
            return Err(CheckpointError::Malformed(
                "a key rotation must name a new key".into(),
            ));
        }
        let statement = rotation_statement(
            self.tree_size,
            &self.root_hash,
            &self.rotated_at,
            &self.previous_key,
            &self.new_key,
        );
        CheckpointVerifier::from_hex(&self.previous_key)?
            .verify_bytes(&statement, &self.signature)?;
        CheckpointVerifier::from_hex(&self.new_key)?
            .verify_bytes(&statement, &self.new_key_signature)
    }

    /// The event that records this rotation in the ledger.
    pub fn to_event(&self) -> NewEvent {
        NewEvent::new(
            KEY_ROTATION_EVENT_TYPE,
            serde_json::to_value(self).unwrap_or(serde_json::Value::Null),
        )
        .with_metadata(serde_json::json!({"actor": "aether:checkpointer"}))
    }

    /// Reads a rotation back from its event; `None` if the event is not one.
    pub fn from_event(event: &RecordedEvent) -> Option<Result<Self, CheckpointError>> {
        if event.stream_id != KEY_ROTATION_STREAM || event.event_type != KEY_ROTATION_EVENT_TYPE {
            return None;
        }
        Some(
            serde_json::from_str(event.payload.get())
                .map_err(|e| CheckpointError::Malformed(e.to_string())),
        )
    }
}

/// The key the ledger's checkpoints are signed with now: the newest rotation's new key,
/// else the newest checkpoint's key; `None` before the first checkpoint.
pub async fn key_in_force(store: &EventStore) -> Result<Option<String>, LedgerError> {
    let last = store
        .read_stream(KEY_ROTATION_STREAM, u64::MAX, Direction::Backward, 1)
        .await?;
    if let Some(Ok(rotation)) = last.first().and_then(KeyRotation::from_event) {
        return Ok(Some(rotation.new_key));
    }
    Ok(crate::checkpoint::latest_checkpoint(store)
        .await?
        .map(|c| c.public_key))
}

/// Every key rotation of the ledger, in order (a few: one per key the ledger ever had).
pub async fn key_rotations(store: &EventStore) -> Result<Vec<KeyRotation>, LedgerError> {
    let mut rotations = Vec::new();
    let mut from = 0;
    loop {
        let page = store
            .read_stream(KEY_ROTATION_STREAM, from, Direction::Forward, 1000)
            .await?;
        for event in &page {
            if let Some(rotation) = KeyRotation::from_event(event) {
                rotations.push(rotation.map_err(|e| {
                    LedgerError::CheckpointKey(format!(
                        "the key rotation at seq {} is unreadable: {e}",
                        event.seq
                    ))
                })?);
            }
        }
        match page.last() {
            Some(last) if page.len() == 1000 => from = last.stream_version + 1,
            _ => return Ok(rotations),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rotation_needs_both_keys_signatures_over_its_own_statement() {
        let old = CheckpointSigner::generate().unwrap();
        let new = CheckpointSigner::generate().unwrap();
        let rotation = KeyRotation::sign(&old, &new, 41, [3u8; 32], chrono::Utc::now());
        rotation.verify().unwrap();

        let intruder = CheckpointSigner::generate().unwrap();
        // Signed by a third key in place of either of the two.
        let mut forged = rotation.clone();
        forged.signature =
            KeyRotation::sign(&intruder, &new, 41, [3u8; 32], chrono::Utc::now()).signature;
        assert_eq!(forged.verify(), Err(CheckpointError::BadSignature));
        let mut forged = rotation.clone();
        forged.new_key_signature =
            KeyRotation::sign(&old, &intruder, 41, [3u8; 32], chrono::Utc::now()).new_key_signature;
        assert_eq!(forged.verify(), Err(CheckpointError::BadSignature));
        // Any field changed after signing.
        for change in [
            |r: &mut KeyRotation| r.tree_size += 1,
            |r: &mut KeyRotation| r.root_hash[0] ^= 1,
            |r: &mut KeyRotation| r.rotated_at = "2026-01-01T00:00:00.000000Z".into(),
        ] {
            let mut changed = rotation.clone();
            change(&mut changed);
            assert_eq!(changed.verify(), Err(CheckpointError::BadSignature));
        }
        let mut to_intruder = rotation.clone();
        to_intruder.new_key = intruder.public_key_hex();
        assert_eq!(to_intruder.verify(), Err(CheckpointError::BadSignature));
        let mut upper = rotation.clone();
        upper.new_key = upper.new_key.to_uppercase();
        assert!(matches!(upper.verify(), Err(CheckpointError::Malformed(_))));
        let same = KeyRotation::sign(&old, &old, 41, [3u8; 32], chrono::Utc::now());
        assert!(matches!(same.verify(), Err(CheckpointError::Malformed(_))));
    }
}

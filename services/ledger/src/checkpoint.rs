//! Signed checkpoints: `(tree size, Merkle root, time)` signed with SM2 over SM3, with the
//! GM/T default user id. A checkpoint is appended to the ledger as an event so that the
//! chain itself records every tree head the operator ever vouched for.

use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sm2::dsa::signature::{Signer, Verifier};
use sm2::dsa::{Signature, SigningKey, VerifyingKey};
use sm2::elliptic_curve::Generate;
use sm2::pkcs8::{
    DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey, LineEnding,
};
use sm2::{PublicKey, SecretKey};

use crate::error::LedgerError;
use crate::event::{NewEvent, RecordedEvent};
use crate::hashing::{self, Hash, format_timestamp};
use crate::store::{Direction, EventStore};

/// GM/T 0009-2012 default distinguishing identifier.
pub const DEFAULT_USER_ID: &str = "1234567812345678";
/// Stream that holds every checkpoint event.
pub const CHECKPOINT_STREAM: &str = "ledger/checkpoints";
/// Event type of a checkpoint.
pub const CHECKPOINT_EVENT_TYPE: &str = "CheckpointSigned";
/// First line of the signed statement; names the format version.
pub const STATEMENT_TAG: &str = "aether.checkpoint.v1";
/// File names of the key pair inside `<data>/keys/`.
pub const PRIVATE_KEY_FILE: &str = "checkpoint-sm2.pem";
pub const PUBLIC_KEY_FILE: &str = "checkpoint-sm2.pub.pem";

/// A tree head and its SM2 signature, as stored in a `CheckpointSigned` payload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedCheckpoint {
    /// Number of events covered: seqs `1..=tree_size`.
    pub tree_size: u64,
    #[serde(with = "hashing::hex_hash")]
    pub root_hash: Hash,
    /// RFC 3339 UTC with six fractional digits, as in the statement.
    pub signed_at: String,
    /// SM2 signature `r ‖ s`, 64 bytes, lowercase hex.
    pub signature: String,
    /// Signer's public key, SEC1 uncompressed (65 bytes), lowercase hex.
    pub public_key: String,
}

/// Why a checkpoint does not verify.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CheckpointError {
    #[error("checkpoint payload is malformed: {0}")]
    Malformed(String),
    #[error("checkpoint was signed by key {found}, not the trusted key {trusted}")]
    UntrustedKey { found: String, trusted: String },
    #[error("checkpoint signature does not verify")]
    BadSignature,
}

/// A key's fingerprint as evidence bundles and error messages name it: SM3 of its SEC1
/// bytes, hex (the hex as given when it is not hex).
pub fn key_fingerprint(public_key_hex: &str) -> String {
    hex::decode(public_key_hex)
        .map(|bytes| hex::encode(hashing::sm3(&bytes)))
        .unwrap_or_else(|_| public_key_hex.to_owned())
}

/// The exact bytes signed: four lines, each ending in `\n`.
pub fn statement(tree_size: u64, root_hash: &Hash, signed_at: &str) -> Vec<u8> {
    format!(
        "{STATEMENT_TAG}\n{tree_size}\n{}\n{signed_at}\n",
        hex::encode(root_hash)
    )
    .into_bytes()
}

/// Holds the private key; signs tree heads.
#[derive(Clone)]
pub struct CheckpointSigner {
    key: SigningKey,
}

impl std::fmt::Debug for CheckpointSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("CheckpointSigner")
            .field("public_key", &self.public_key_hex())
            .finish()
    }
}

fn key_err(what: &str, path: &Path, e: impl std::fmt::Display) -> LedgerError {
    LedgerError::CheckpointKey(format!("{what} {}: {e}", path.display()))
}

impl CheckpointSigner {
    /// A fresh random key pair.
    pub fn generate() -> Result<Self, LedgerError> {
        Self::from_secret(&SecretKey::generate())
    }

    fn from_secret(secret: &SecretKey) -> Result<Self, LedgerError> {
        let key = SigningKey::new(DEFAULT_USER_ID, secret)
            .map_err(|e| LedgerError::CheckpointKey(e.to_string()))?;
        Ok(CheckpointSigner { key })
    }

    /// Loads a PKCS#8 PEM private key.
    pub fn from_pem_file(path: &Path) -> Result<Self, LedgerError> {
        let pem = std::fs::read_to_string(path).map_err(|e| key_err("cannot read", path, e))?;
        let secret = SecretKey::from_pkcs8_pem(&pem)
            .map_err(|e| key_err("not an SM2 PKCS#8 key:", path, e))?;
        Self::from_secret(&secret)
    }

    /// Loads `<dir>/checkpoint-sm2.pem`, or creates the pair there (private key mode 0600).
    /// Returns the signer and whether it was created now.
    pub fn load_or_create(dir: &Path) -> Result<(Self, bool), LedgerError> {
        let private = dir.join(PRIVATE_KEY_FILE);
        if private.exists() {
            return Ok((Self::from_pem_file(&private)?, false));
        }
        std::fs::create_dir_all(dir).map_err(|e| key_err("cannot create", dir, e))?;
        let secret = SecretKey::generate();
        let pem = secret
            .to_pkcs8_pem(LineEnding::LF)
            .map_err(|e| LedgerError::CheckpointKey(e.to_string()))?;
        write_private(&private, pem.as_bytes())?;
        let signer = Self::from_secret(&secret)?;
        let public = dir.join(PUBLIC_KEY_FILE);
        std::fs::write(&public, signer.public_key_pem()?)
            .map_err(|e| key_err("cannot write", &public, e))?;
        Ok((signer, true))
    }

    pub fn public_key_hex(&self) -> String {
        hex::encode(self.key.verifying_key().to_sec1_bytes())
    }

    pub fn public_key_pem(&self) -> Result<String, LedgerError> {
        PublicKey::from_sec1_bytes(&self.key.verifying_key().to_sec1_bytes())
            .map_err(|e| LedgerError::CheckpointKey(e.to_string()))?
            .to_public_key_pem(LineEnding::LF)
            .map_err(|e| LedgerError::CheckpointKey(e.to_string()))
    }

    pub fn verifier(&self) -> CheckpointVerifier {
        CheckpointVerifier {
            key: self.key.verifying_key().clone(),
        }
    }

    /// SM2 signature `r ‖ s` of `message`, lowercase hex.
    pub(crate) fn sign_bytes(&self, message: &[u8]) -> String {
        let signature: Signature = self.key.sign(message);
        hex::encode(signature.to_bytes())
    }

    /// Signs the tree head `(tree_size, root_hash)` as of `signed_at`.
    pub fn sign(
        &self,
        tree_size: u64,
        root_hash: Hash,
        signed_at: DateTime<Utc>,
    ) -> SignedCheckpoint {
        let signed_at = format_timestamp(&signed_at);
        let signature: Signature = self.key.sign(&statement(tree_size, &root_hash, &signed_at));
        SignedCheckpoint {
            tree_size,
            root_hash,
            signed_at,
            signature: hex::encode(signature.to_bytes()),
            public_key: self.public_key_hex(),
        }
    }
}

#[cfg(unix)]
fn write_private(path: &PathBuf, bytes: &[u8]) -> Result<(), LedgerError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| key_err("cannot create", path, e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| key_err("cannot write", path, e))
}

#[cfg(not(unix))]
fn write_private(path: &PathBuf, bytes: &[u8]) -> Result<(), LedgerError> {
    std::fs::write(path, bytes).map_err(|e| key_err("cannot write", path, e))
}

/// A trusted public key that checkpoints must be signed with.
#[derive(Clone, Debug)]
pub struct CheckpointVerifier {
    key: VerifyingKey,
}

impl CheckpointVerifier {
    /// From SEC1 bytes in hex (uncompressed, 65 bytes).
    pub fn from_hex(public_key: &str) -> Result<Self, CheckpointError> {
        let bytes = hex::decode(public_key)
            .map_err(|e| CheckpointError::Malformed(format!("public key is not hex: {e}")))?;
        let key = VerifyingKey::from_sec1_bytes(DEFAULT_USER_ID, &bytes)
            .map_err(|_| CheckpointError::Malformed("public key is not an SM2 point".into()))?;
        Ok(CheckpointVerifier { key })
    }

    /// From a PEM SubjectPublicKeyInfo file, or a PKCS#8 private key file.
    pub fn from_pem_file(path: &Path) -> Result<Self, LedgerError> {
        let pem = std::fs::read_to_string(path).map_err(|e| key_err("cannot read", path, e))?;
        if let Ok(public) = PublicKey::from_public_key_pem(&pem) {
            let key = VerifyingKey::new(DEFAULT_USER_ID, public)
                .map_err(|e| key_err("unusable public key", path, e))?;
            return Ok(CheckpointVerifier { key });
        }
        Ok(CheckpointSigner::from_pem_file(path)?.verifier())
    }

    pub fn public_key_hex(&self) -> String {
        hex::encode(self.key.to_sec1_bytes())
    }

    /// Checks that `checkpoint` carries this key and a valid signature over its statement.
    pub fn verify(&self, checkpoint: &SignedCheckpoint) -> Result<(), CheckpointError> {
        // The statement is four lines: a `signed_at` in any other form (a line break in it
        // would make a fifth) is refused before any signature is checked.
        if !crate::hashing::is_canonical_timestamp(&checkpoint.signed_at) {
            return Err(CheckpointError::Malformed(format!(
                "signed_at {:?} is not RFC 3339 UTC with six fractional digits and Z",
                checkpoint.signed_at
            )));
        }
        let trusted = self.public_key_hex();
        if !checkpoint.public_key.eq_ignore_ascii_case(&trusted) {
            return Err(CheckpointError::UntrustedKey {
                found: checkpoint.public_key.clone(),
                trusted,
            });
        }
        self.verify_bytes(
            &statement(
                checkpoint.tree_size,
                &checkpoint.root_hash,
                &checkpoint.signed_at,
            ),
            &checkpoint.signature,
        )
    }

    /// Checks an SM2 signature `r ‖ s` (hex) of `message` under this key.
    pub(crate) fn verify_bytes(
        &self,
        message: &[u8],
        signature: &str,
    ) -> Result<(), CheckpointError> {
        let sig_bytes = hex::decode(signature)
            .map_err(|e| CheckpointError::Malformed(format!("signature is not hex: {e}")))?;
        let signature = Signature::from_slice(&sig_bytes)
            .map_err(|_| CheckpointError::Malformed("signature is not 64 bytes r||s".into()))?;
        self.key
            .verify(message, &signature)
            .map_err(|_| CheckpointError::BadSignature)
    }
}

impl SignedCheckpoint {
    /// Verifies against the key the checkpoint names (for self-contained checks; a verifier
    /// that trusts a specific key uses [`CheckpointVerifier::verify`]).
    pub fn verify_self_signed(&self) -> Result<(), CheckpointError> {
        CheckpointVerifier::from_hex(&self.public_key)?.verify(self)
    }

    /// The event that records this checkpoint in the ledger.
    pub fn to_event(&self) -> NewEvent {
        NewEvent::new(
            CHECKPOINT_EVENT_TYPE,
            serde_json::to_value(self).unwrap_or(serde_json::Value::Null),
        )
        .with_metadata(serde_json::json!({"actor": "aether:checkpointer"}))
    }

    /// Reads a checkpoint back from its event; `None` if the event is not a checkpoint.
    pub fn from_event(event: &RecordedEvent) -> Option<Result<Self, CheckpointError>> {
        if event.stream_id != CHECKPOINT_STREAM || event.event_type != CHECKPOINT_EVENT_TYPE {
            return None;
        }
        Some(
            serde_json::from_str(event.payload.get())
                .map_err(|e| CheckpointError::Malformed(e.to_string())),
        )
    }
}

/// The newest checkpoint in the ledger, if there is one that parses.
pub async fn latest_checkpoint(
    store: &EventStore,
) -> Result<Option<SignedCheckpoint>, LedgerError> {
    let last = store
        .read_stream(CHECKPOINT_STREAM, u64::MAX, Direction::Backward, 1)
        .await?;
    Ok(last
        .first()
        .and_then(SignedCheckpoint::from_event)
        .and_then(Result::ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint validly signed over a `signed_at` in any form but the documented one is
    /// refused before its signature counts: no fraction, three digits, an offset, words, a
    /// line break (which made a five-line statement), a leap second.
    #[test]
    fn a_signed_at_in_another_form_is_refused_even_when_signed() {
        let signer = CheckpointSigner::generate().unwrap();
        let good = signer.sign(42, [7u8; 32], Utc::now());
        for signed_at in [
            "2026-11-30T09:30:02Z",
            "2026-11-30T09:30:02.500Z",
            "2026-11-30T17:30:02.500000+08:00",
            "yesterday",
            "2026-11-30T09:30:02.500000Z\nextra",
            "2016-12-31T23:59:60.000000Z",
        ] {
            let signature: Signature = signer.key.sign(&statement(42, &good.root_hash, signed_at));
            let forged = SignedCheckpoint {
                signed_at: signed_at.to_owned(),
                signature: hex::encode(signature.to_bytes()),
                ..good.clone()
            };
            match signer.verifier().verify(&forged) {
                Err(CheckpointError::Malformed(why)) => {
                    assert!(why.contains("signed_at"), "{signed_at:?}: {why}")
                }
                other => panic!("{signed_at:?} was not refused: {other:?}"),
            }
        }
        signer.verifier().verify(&good).unwrap();
    }

    #[test]
    fn a_signed_checkpoint_verifies_and_any_change_breaks_it() {
        let signer = CheckpointSigner::generate().unwrap();
        let cp = signer.sign(42, [7u8; 32], Utc::now());
        signer.verifier().verify(&cp).unwrap();
        cp.verify_self_signed().unwrap();

        let mut other = cp.clone();
        other.tree_size = 43;
        assert_eq!(
            signer.verifier().verify(&other),
            Err(CheckpointError::BadSignature)
        );
        let mut other = cp.clone();
        other.root_hash[0] ^= 1;
        assert_eq!(
            signer.verifier().verify(&other),
            Err(CheckpointError::BadSignature)
        );
        let mut other = cp.clone();
        other.signed_at = "2000-01-01T00:00:00.000000Z".into();
        assert_eq!(
            signer.verifier().verify(&other),
            Err(CheckpointError::BadSignature)
        );
        let mut other = cp.clone();
        other.signature.truncate(10);
        assert!(matches!(
            signer.verifier().verify(&other),
            Err(CheckpointError::Malformed(_))
        ));

        let stranger = CheckpointSigner::generate().unwrap();
        assert!(matches!(
            stranger.verifier().verify(&cp),
            Err(CheckpointError::UntrustedKey { .. })
        ));
        // A forger who swaps in their own key passes a self-signed check but not a trusted one.
        let forged = stranger.sign(42, [8u8; 32], Utc::now());
        forged.verify_self_signed().unwrap();
        assert!(signer.verifier().verify(&forged).is_err());
    }

    #[test]
    fn keys_persist_in_the_data_dir_with_a_private_mode() {
        let dir = tempfile::tempdir().unwrap();
        let (a, created) = CheckpointSigner::load_or_create(dir.path()).unwrap();
        assert!(created);
        let (b, created) = CheckpointSigner::load_or_create(dir.path()).unwrap();
        assert!(!created);
        assert_eq!(a.public_key_hex(), b.public_key_hex());
        let from_pub =
            CheckpointVerifier::from_pem_file(&dir.path().join(PUBLIC_KEY_FILE)).unwrap();
        assert_eq!(from_pub.public_key_hex(), a.public_key_hex());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join(PRIVATE_KEY_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}

//! SM2/SM4 envelope of the clearing gateway (GM/T algorithms, byte layout in
//! `proto/ENVELOPE.md`).
//!
//! A member encrypts each payload with SM4-GCM under a 16-byte key it picked itself, and
//! sends that key encrypted to the gateway's SM2 public key (C1C3C2, 113 bytes): either with
//! every request (metadata `x-sm4-key`), or once per session (`KeyExchange`, answered with a
//! key id), so that the SM2 work is not paid per request. The AAD binds direction, gRPC
//! method, request id, member id, key id and issue time, so a sealed payload cannot be moved
//! to another call. Responses are sealed with the same key.
//!
//! This module is pure: no I/O except reading/writing the server key file, no gRPC types.
//! Time is passed in (`now`, unix seconds) so that expiry and freshness are testable.

mod aad;
mod error;
mod key;
mod request_keys;
mod session;

use zeroize::Zeroize;

pub use aad::{Aad, Direction};
pub use error::{EnvelopeError, ErrorKind};
pub use key::{EnvelopeKey, decode_wrapped_key, encode_wrapped_key, wrap_key};
pub use request_keys::{RequestKeys, RequestKeysPolicy};
pub use session::{SessionGrant, SessionKeys, SessionPolicy};

/// Domain tag, first AAD field; names the format version.
pub const DOMAIN_TAG: &str = "aether.envelope.v1";
/// gRPC metadata key that carries a per-request wrapped key (standard base64, padded).
pub const KEY_HEADER: &str = "x-sm4-key";
/// Length of an SM4 key.
pub const SM4_KEY_LEN: usize = 16;
/// SM2 ciphertext of an SM4 key: C1 (65, uncompressed) ‖ C3 (32, SM3) ‖ C2 (16).
pub const WRAPPED_KEY_LEN: usize = 65 + 32 + SM4_KEY_LEN;
/// Length of `x-sm4-key`'s value: base64 of 113 bytes, one `=` of padding.
pub const KEY_HEADER_LEN: usize = 152;
/// SM4-GCM nonce length (the 96-bit IV of NIST SP 800-38D).
pub const NONCE_LEN: usize = 12;
/// SM4-GCM tag length, appended to the ciphertext.
pub const TAG_LEN: usize = 16;
/// Largest plaintext the envelope seals or opens (1 MiB); bounds memory per request.
pub const MAX_PLAINTEXT_LEN: usize = 1 << 20;
/// Largest single AAD text field (method, request id, member id, key id), in bytes.
pub const MAX_AAD_FIELD_LEN: usize = 1024;

/// SM4 in GCM mode, 12-byte nonce, 16-byte tag: the AEAD of RFC 8998 (TLS_SM4_GCM_SM3),
/// on the constant-time SM4 of `aether_gmtls` (no table indexed by key or data bytes).
type Sm4Gcm = aether_gmtls::aead::Sm4Gcm;

/// A 16-byte SM4 key and its SM4-GCM key schedule, made once: a session key opens and
/// seals many messages, and expanding it per message was ~1.5 % of a client's CPU. The
/// schedule (round keys and GHASH's 64 key powers, ~1.2 KB) is shared by the key's clones:
/// the gateway hands a session's key to each request it opens. Both are zeroed on drop
/// (the schedule with its last clone); its Debug output never shows them.
#[derive(Clone)]
pub struct Sm4Key {
    bytes: [u8; SM4_KEY_LEN],
    cipher: std::sync::Arc<Sm4Gcm>,
}

impl Sm4Key {
    pub fn from_bytes(bytes: [u8; SM4_KEY_LEN]) -> Self {
        Sm4Key {
            cipher: std::sync::Arc::new(Sm4Gcm::new(&bytes)),
            bytes,
        }
    }

    /// A fresh key from the operating system's random generator (what a client does).
    pub fn generate() -> Result<Self, EnvelopeError> {
        let mut bytes = [0u8; SM4_KEY_LEN];
        fill_random(&mut bytes)?;
        let key = Sm4Key::from_bytes(bytes);
        bytes.zeroize();
        Ok(key)
    }

    /// The raw key bytes; named so that every use of the secret is easy to find.
    pub fn expose_bytes(&self) -> &[u8; SM4_KEY_LEN] {
        &self.bytes
    }

    fn cipher(&self) -> &Sm4Gcm {
        &self.cipher
    }
}

impl Drop for Sm4Key {
    fn drop(&mut self) {
        // The cipher wipes its own round keys and GHASH key (on drop, `zeroize`).
        self.bytes.zeroize();
    }
}

impl std::fmt::Debug for Sm4Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sm4Key(<redacted>)")
    }
}

/// A sealed payload: the nonce and `ciphertext ‖ tag`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sealed {
    pub nonce: [u8; NONCE_LEN],
    pub ciphertext: Vec<u8>,
}

/// What a server-side open yields: the plaintext, and the key to seal the response with.
#[derive(Debug)]
pub struct Opened {
    pub plaintext: Vec<u8>,
    pub key: Sm4Key,
}

/// Seals `plaintext` under `key` with a fresh random nonce.
pub fn seal(key: &Sm4Key, aad: &Aad<'_>, plaintext: &[u8]) -> Result<Sealed, EnvelopeError> {
    let mut nonce = [0u8; NONCE_LEN];
    fill_random(&mut nonce)?;
    let ciphertext = seal_with_fixed_nonce(key, aad, &nonce, plaintext)?;
    Ok(Sealed { nonce, ciphertext })
}

/// Seals with a caller-chosen nonce. Only for test vectors: a nonce used twice with one key
/// reveals the XOR of the plaintexts and lets anyone forge tags. Use [`seal`].
pub fn seal_with_fixed_nonce(
    key: &Sm4Key,
    aad: &Aad<'_>,
    nonce: &[u8; NONCE_LEN],
    plaintext: &[u8],
) -> Result<Vec<u8>, EnvelopeError> {
    if plaintext.len() > MAX_PLAINTEXT_LEN {
        return Err(EnvelopeError::TooLarge {
            len: plaintext.len(),
            max: MAX_PLAINTEXT_LEN,
        });
    }
    let aad = aad.encode()?;
    let mut buffer = Vec::with_capacity(plaintext.len() + TAG_LEN);
    buffer.extend_from_slice(plaintext);
    let tag = key
        .cipher()
        .encrypt_in_place_detached(nonce, &aad, buffer.as_mut_slice());
    buffer.extend_from_slice(&tag);
    Ok(buffer)
}

/// Opens `ciphertext ‖ tag` sealed under `key` with `nonce` and the same AAD fields.
/// Checks only the cryptography; replay, expiry and use counts are [`SessionKeys`]' and
/// [`RequestKeys`]' business.
pub fn open(
    key: &Sm4Key,
    aad: &Aad<'_>,
    nonce: &[u8],
    ciphertext: &[u8],
) -> Result<Vec<u8>, EnvelopeError> {
    let nonce = check_nonce(nonce)?;
    check_ciphertext_len(ciphertext)?;
    let aad = aad.encode()?;
    let (body, tag) = ciphertext.split_at(ciphertext.len() - TAG_LEN);
    let tag =
        <&[u8; TAG_LEN]>::try_from(tag).map_err(|_| EnvelopeError::Truncated(ciphertext.len()))?;
    let mut plaintext = body.to_vec();
    key.cipher()
        .decrypt_in_place_detached(&nonce, &aad, plaintext.as_mut_slice(), tag)
        .map_err(|_| EnvelopeError::Authentication)?;
    Ok(plaintext)
}

fn check_nonce(nonce: &[u8]) -> Result<[u8; NONCE_LEN], EnvelopeError> {
    <[u8; NONCE_LEN]>::try_from(nonce).map_err(|_| EnvelopeError::NonceLength(nonce.len()))
}

fn check_ciphertext_len(ciphertext: &[u8]) -> Result<(), EnvelopeError> {
    if ciphertext.len() < TAG_LEN {
        return Err(EnvelopeError::Truncated(ciphertext.len()));
    }
    if ciphertext.len() - TAG_LEN > MAX_PLAINTEXT_LEN {
        return Err(EnvelopeError::TooLarge {
            len: ciphertext.len() - TAG_LEN,
            max: MAX_PLAINTEXT_LEN,
        });
    }
    Ok(())
}

/// Refuses an `issued_at` more than `max_age` seconds away from `now`, either way.
fn check_fresh(issued_at: u64, now: u64, max_age: u64) -> Result<(), EnvelopeError> {
    if issued_at.saturating_add(max_age) < now || issued_at > now.saturating_add(max_age) {
        return Err(EnvelopeError::Stale {
            issued_at,
            now,
            max_age,
        });
    }
    Ok(())
}

/// Current time in unix seconds, for callers that have no clock of their own.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn fill_random(buf: &mut [u8]) -> Result<(), EnvelopeError> {
    sm2::elliptic_curve::common::getrandom::fill(buf).map_err(|_| EnvelopeError::Random)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aad() -> Aad<'static> {
        Aad {
            direction: Direction::Request,
            method: "/aether.v1.ClearingService/Submit",
            request_id: "req-1",
            member_id: "bank-a",
            key_id: "",
            issued_at: 1_767_225_600,
        }
    }

    #[test]
    fn seal_then_open_round_trips_and_uses_fresh_nonces() {
        let key = Sm4Key::from_bytes([7; 16]);
        let a = seal(&key, &aad(), b"hello").unwrap();
        let b = seal(&key, &aad(), b"hello").unwrap();
        assert_ne!(a.nonce, b.nonce);
        assert_eq!(a.ciphertext.len(), 5 + TAG_LEN);
        assert_eq!(
            open(&key, &aad(), &a.nonce, &a.ciphertext).unwrap(),
            b"hello"
        );
    }

    #[test]
    fn key_debug_is_redacted() {
        let key = Sm4Key::from_bytes([0xab; 16]);
        let shown = format!("{key:?}");
        assert!(!shown.to_lowercase().contains("ab"), "{shown}");
    }

    #[test]
    fn freshness_window_is_inclusive_both_ways() {
        assert!(check_fresh(100, 400, 300).is_ok());
        assert!(check_fresh(700, 400, 300).is_ok());
        assert!(check_fresh(99, 400, 300).is_err());
        assert!(check_fresh(701, 400, 300).is_err());
        assert!(check_fresh(u64::MAX, 0, u64::MAX).is_ok());
    }
}

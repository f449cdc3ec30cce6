//! AEAD_SM4_GCM (RFC 8998 §3.5.1) as a rustls TLS 1.3 record protection.
//!
//! GCM (NIST SP 800-38D) with SM4 as the block cipher: 16-byte key, 12-byte nonce, 16-byte
//! tag. The per-record nonce is RFC 8446 §5.3's (the 12-byte write IV XOR the 64-bit record
//! sequence number, left-padded), as RFC 8998 §3.5.1 requires, and the additional data is the
//! record header (RFC 8446 §5.2).

use aes_gcm::aead::consts::U12;
use aes_gcm::{AeadInOut, KeyInit};
use rustls::crypto::cipher::{
    AeadKey, InboundOpaqueMessage, InboundPlainMessage, Iv, MessageDecrypter, MessageEncrypter,
    Nonce, OutboundOpaqueMessage, OutboundPlainMessage, PrefixedPayload, Tls13AeadAlgorithm,
    UnsupportedOperationError, make_tls13_aad,
};
use rustls::{ConnectionTrafficSecrets, ContentType, Error, ProtocolVersion};

/// SM4-GCM: RustCrypto's GCM is generic over any 128-bit block cipher; the block cipher is
/// ours, constant time on AES-NI ([`crate::sm4ct`]).
pub type Sm4Gcm = aes_gcm::AesGcm<crate::sm4ct::Sm4Ct, U12>;

/// SM4 key length (GB/T 32907-2016).
pub const SM4_KEY_LEN: usize = 16;
/// GCM tag length RFC 8998 §3.5.1 fixes.
pub const TAG_LEN: usize = 16;

/// The TLS 1.3 AEAD of `TLS_SM4_GCM_SM3`.
#[derive(Debug)]
pub struct Sm4GcmAead;

/// The one instance the cipher suite points at.
pub static SM4_GCM: Sm4GcmAead = Sm4GcmAead;

impl Sm4GcmAead {
    /// Record protection for a raw 16-byte key (rustls' `AeadKey` cannot be shortened
    /// outside rustls): for known-answer tests and tools.
    pub fn encrypter_for_key(&self, key: &[u8; SM4_KEY_LEN], iv: Iv) -> Box<dyn MessageEncrypter> {
        Box::new(Sm4GcmRecord::from_key(key, iv))
    }

    /// The decrypting side of [`Self::encrypter_for_key`].
    pub fn decrypter_for_key(&self, key: &[u8; SM4_KEY_LEN], iv: Iv) -> Box<dyn MessageDecrypter> {
        Box::new(Sm4GcmRecord::from_key(key, iv))
    }
}

impl Tls13AeadAlgorithm for Sm4GcmAead {
    fn encrypter(&self, key: AeadKey, iv: Iv) -> Box<dyn MessageEncrypter> {
        Box::new(Sm4GcmRecord::new(&key, iv))
    }

    fn decrypter(&self, key: AeadKey, iv: Iv) -> Box<dyn MessageDecrypter> {
        Box::new(Sm4GcmRecord::new(&key, iv))
    }

    fn key_len(&self) -> usize {
        SM4_KEY_LEN
    }

    fn extract_keys(
        &self,
        _key: AeadKey,
        _iv: Iv,
    ) -> Result<ConnectionTrafficSecrets, UnsupportedOperationError> {
        // `ConnectionTrafficSecrets` has no SM4 variant (it exists for kTLS offload, which
        // has no SM4-GCM either).
        Err(UnsupportedOperationError)
    }
}

/// One direction's record protection. `cipher` is `None` only if rustls ever handed over a
/// key of the wrong length; every record then fails instead of panicking.
struct Sm4GcmRecord {
    cipher: Option<Sm4Gcm>,
    iv: Iv,
}

impl Sm4GcmRecord {
    fn new(key: &AeadKey, iv: Iv) -> Self {
        Self {
            cipher: Sm4Gcm::new_from_slice(key.as_ref()).ok(),
            iv,
        }
    }

    fn from_key(key: &[u8; SM4_KEY_LEN], iv: Iv) -> Self {
        Self {
            cipher: Some(Sm4Gcm::new(key.into())),
            iv,
        }
    }
}

impl MessageEncrypter for Sm4GcmRecord {
    fn encrypt(
        &mut self,
        msg: OutboundPlainMessage<'_>,
        seq: u64,
    ) -> Result<OutboundOpaqueMessage, Error> {
        let cipher = self.cipher.as_ref().ok_or(Error::EncryptError)?;
        let total_len = self.encrypted_payload_len(msg.payload.len());
        let mut payload = PrefixedPayload::with_capacity(total_len);
        // TLSInnerPlaintext: content, then the real content type (no padding).
        payload.extend_from_chunks(&msg.payload);
        payload.extend_from_slice(&msg.typ.to_array());
        let nonce = Nonce::new(&self.iv, seq);
        let aad = make_tls13_aad(total_len);
        let tag = cipher
            .encrypt_inout_detached(&nonce.0.into(), &aad, payload.as_mut().into())
            .map_err(|_| Error::EncryptError)?;
        payload.extend_from_slice(&tag);
        Ok(OutboundOpaqueMessage::new(
            ContentType::ApplicationData,
            ProtocolVersion::TLSv1_2,
            payload,
        ))
    }

    fn encrypted_payload_len(&self, payload_len: usize) -> usize {
        payload_len + 1 + TAG_LEN
    }
}

impl MessageDecrypter for Sm4GcmRecord {
    fn decrypt<'a>(
        &mut self,
        mut msg: InboundOpaqueMessage<'a>,
        seq: u64,
    ) -> Result<InboundPlainMessage<'a>, Error> {
        let cipher = self.cipher.as_ref().ok_or(Error::DecryptError)?;
        let payload = &mut msg.payload;
        let len = payload.len();
        let Some(text_len) = len.checked_sub(TAG_LEN) else {
            return Err(Error::DecryptError);
        };
        let nonce = Nonce::new(&self.iv, seq);
        let aad = make_tls13_aad(len);
        let (text, tag) = payload.split_at_mut(text_len);
        let tag = aes_gcm::Tag::try_from(&*tag).map_err(|_| Error::DecryptError)?;
        cipher
            .decrypt_inout_detached(&nonce.0.into(), &aad, text.into(), &tag)
            .map_err(|_| Error::DecryptError)?;
        payload.truncate(text_len);
        msg.into_tls13_unpadded_message()
    }
}

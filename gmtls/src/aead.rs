//! AEAD_SM4_GCM (RFC 8998 §3.5.1) as a rustls TLS 1.3 record protection.
//!
//! GCM (NIST SP 800-38D) with SM4 as the block cipher: 16-byte key, 12-byte nonce, 16-byte
//! tag. The per-record nonce is RFC 8446 §5.3's (the 12-byte write IV XOR the 64-bit record
//! sequence number, left-padded), as RFC 8998 §3.5.1 requires, and the additional data is the
//! record header (RFC 8446 §5.2).

use ghash::GHash;
use ghash::universal_hash::UniversalHash;
use rustls::crypto::cipher::{
    AeadKey, InboundOpaqueMessage, InboundPlainMessage, Iv, MessageDecrypter, MessageEncrypter,
    Nonce, OutboundOpaqueMessage, OutboundPlainMessage, PrefixedPayload, Tls13AeadAlgorithm,
    UnsupportedOperationError, make_tls13_aad,
};
use rustls::{ConnectionTrafficSecrets, ContentType, Error, ProtocolVersion};

use crate::sm4ct::Sm4Ct;

/// SM4-GCM (NIST SP 800-38D, 96-bit nonces): CTR with SM4 ([`crate::sm4ct`], constant
/// time) and GHASH (ours on VPCLMULQDQ, sixteen blocks a reduction, where the CPU has it;
/// else the `ghash` crate's, four blocks a reduction on PCLMULQDQ).
///
/// On GFNI the counter blocks are made in the registers and the keystream is XORed into
/// the message there (`sm4ct::gfni::ctr`): no counter blocks written, no keystream in
/// memory, no padded copy of a partial block.
///
/// Why not RustCrypto's generic `AesGcm<Sm4Ct>`: its counter mode encrypts the blocks
/// left over after the last full group of eight one SM4 pass each, and the tag mask in a
/// pass of its own; an SM4 pass costs about the same for one block as for a register group
/// of them. Here a message's keystream, the tag mask with it, goes through the kernel in
/// as few passes as its width allows (a 600-byte record: one pass on GFNI, five on
/// AES-NI, against eleven). The tests check it against that generic GCM over the `sm4`
/// crate on random inputs and against RFC 8998's example.
///
/// A message under one nonce must stay below GCM's limit of 2³² − 2 blocks (64 GiB): past
/// it the 32-bit counter would repeat. The callers' messages are TLS records (16 KiB) and
/// envelopes (at most 1 MiB).
#[derive(Clone)]
pub struct Sm4Gcm {
    sm4: Sm4Ct,
    /// GHASH keyed with H = SM4(0¹²⁸).
    ghash: Hash,
}

/// Which GHASH: ours on VPCLMULQDQ where the CPU has it, else the `ghash` crate.
#[derive(Clone)]
enum Hash {
    #[cfg(target_arch = "x86_64")]
    Wide(crate::ghash512::Powers),
    Crate(GHash),
}

/// A tag that does not match: the message was not sent as it is, or not with this key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("SM4-GCM: the message or its tag does not match")]
pub struct TagMismatch;

/// Keystream blocks made at a time (1.5 KiB of message): two of the widest kernel's passes.
const CHUNK: usize = 96;

impl Sm4Gcm {
    /// SM4-GCM on the fastest kernels this CPU has.
    pub fn new(key: &[u8; SM4_KEY_LEN]) -> Self {
        Self::with_cipher(<Sm4Ct as sm4::cipher::KeyInit>::new(key.into()), true)
    }

    /// SM4-GCM over the given SM4 kernel, and the `ghash` crate's GHASH unless `wide_ghash`
    /// and the CPU has VPCLMULQDQ: for comparing the kernels with one another.
    pub fn with_cipher(sm4: Sm4Ct, wide_ghash: bool) -> Self {
        let mut h = [[0u8; 16]];
        sm4.encrypt_in_place(&mut h);
        #[cfg(target_arch = "x86_64")]
        let wide = wide_ghash
            .then(|| crate::ghash512::Powers::new(&h[0]))
            .flatten()
            .map(Hash::Wide);
        #[cfg(not(target_arch = "x86_64"))]
        let wide = None::<Hash>.filter(|_| wide_ghash);
        let ghash = wide.unwrap_or_else(|| Hash::Crate(GHash::new(&h[0].into())));
        zeroize::Zeroize::zeroize(&mut h[0]);
        Sm4Gcm { sm4, ghash }
    }

    /// Whether GHASH runs on VPCLMULQDQ (else the `ghash` crate).
    pub fn wide_ghash(&self) -> bool {
        match self.ghash {
            #[cfg(target_arch = "x86_64")]
            Hash::Wide(_) => true,
            Hash::Crate(_) => false,
        }
    }

    /// Encrypts `buf` in place; the tag.
    pub fn encrypt_in_place_detached(
        &self,
        nonce: &[u8; 12],
        aad: &[u8],
        buf: &mut [u8],
    ) -> [u8; TAG_LEN] {
        if let Some(tag) = self.in_one_pass(nonce, aad, buf, true) {
            return tag;
        }
        let mask = self.ctr(nonce, buf);
        xor16(self.ghash(aad, buf), &mask)
    }

    /// Decrypts `buf` in place if `tag` is its tag; otherwise leaves it zeroed (no
    /// unauthenticated plaintext is handed out) and says so.
    pub fn decrypt_in_place_detached(
        &self,
        nonce: &[u8; 12],
        aad: &[u8],
        buf: &mut [u8],
        tag: &[u8; TAG_LEN],
    ) -> Result<(), TagMismatch> {
        let expected = match self.in_one_pass(nonce, aad, buf, false) {
            Some(expected) => expected,
            None => {
                let hash = self.ghash(aad, buf);
                xor16(hash, &self.ctr(nonce, buf))
            }
        };
        // Constant time: every byte compared whatever the first difference.
        let difference = expected
            .iter()
            .zip(tag)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if std::hint::black_box(difference) != 0 {
            buf.fill(0);
            return Err(TagMismatch);
        }
        Ok(())
    }

    /// Seals or opens `data` and computes its tag in one pass over it (`crate::gcm512`),
    /// where the kernels and the message's length allow; `None`, with `data` untouched,
    /// where they do not.
    fn in_one_pass(
        &self,
        nonce: &[u8; 12],
        aad: &[u8],
        data: &mut [u8],
        seal: bool,
    ) -> Option<[u8; TAG_LEN]> {
        #[cfg(target_arch = "x86_64")]
        if let (Some(rk), Hash::Wide(powers)) = (self.sm4.gfni_round_keys(), &self.ghash) {
            // SAFETY: round keys for the GFNI kernel and a `Powers` exist only where the
            // CPU has AVX-512F/BW, GFNI, VPCLMULQDQ and PCLMULQDQ.
            return unsafe { crate::gcm512::crypt(rk, powers, nonce, aad, data, seal) };
        }
        let _ = (nonce, aad, data, seal);
        None
    }

    /// XORs `data` with the keystream from counter 2 on (J₀ = nonce ‖ 1 being counter 1);
    /// returns SM4(J₀), the tag mask, computed in the first pass with the data's.
    fn ctr(&self, nonce: &[u8; 12], data: &mut [u8]) -> [u8; 16] {
        #[cfg(target_arch = "x86_64")]
        if let Some(rk) = self.sm4.gfni_round_keys() {
            return crate::sm4ct::gfni_ctr(rk, nonce, data);
        }
        let counter_block = |counter: u32| {
            let mut block = [0u8; 16];
            block[..12].copy_from_slice(nonce);
            block[12..].copy_from_slice(&counter.to_be_bytes());
            block
        };
        let mut keystream = [[0u8; 16]; CHUNK];
        let mut mask = [0u8; 16];
        let mut counter = 1u32;
        let mut first = true;
        let mut rest = data;
        loop {
            let start = usize::from(first);
            let blocks = rest.len().div_ceil(16).min(CHUNK - start);
            for ks in keystream.iter_mut().take(start + blocks) {
                *ks = counter_block(counter);
                counter = counter.wrapping_add(1);
            }
            self.sm4.encrypt_in_place(&mut keystream[..start + blocks]);
            if first {
                mask = keystream[0];
                first = false;
            }
            let (now, later) = rest.split_at_mut(rest.len().min(blocks * 16));
            for (byte, k) in now.iter_mut().zip(keystream[start..].as_flattened().iter()) {
                *byte ^= k;
            }
            rest = later;
            if rest.is_empty() {
                break;
            }
        }
        zeroize::Zeroize::zeroize(keystream.as_flattened_mut());
        mask
    }

    /// GHASH_H(A, C): the AAD and the ciphertext each zero-padded to whole blocks, then
    /// their lengths in bits, 64 bits each, big-endian.
    fn ghash(&self, aad: &[u8], ciphertext: &[u8]) -> [u8; 16] {
        let ghash = match &self.ghash {
            #[cfg(target_arch = "x86_64")]
            Hash::Wide(powers) => return powers.ghash(aad, ciphertext),
            Hash::Crate(ghash) => ghash,
        };
        let mut ghash = ghash.clone();
        ghash.update_padded(aad);
        ghash.update_padded(ciphertext);
        let mut lengths = [0u8; 16];
        lengths[..8].copy_from_slice(&(aad.len() as u64 * 8).to_be_bytes());
        lengths[8..].copy_from_slice(&(ciphertext.len() as u64 * 8).to_be_bytes());
        ghash.update(&[lengths.into()]);
        ghash.finalize().into()
    }
}

impl std::fmt::Debug for Sm4Gcm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sm4Gcm")
            .field("kernel", &self.sm4.kernel())
            .field("wide_ghash", &self.wide_ghash())
            .finish_non_exhaustive()
    }
}

fn xor16(a: [u8; 16], b: &[u8; 16]) -> [u8; 16] {
    std::array::from_fn(|i| a[i] ^ b[i])
}

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
            cipher: <&[u8; SM4_KEY_LEN]>::try_from(key.as_ref())
                .ok()
                .map(Sm4Gcm::new),
            iv,
        }
    }

    fn from_key(key: &[u8; SM4_KEY_LEN], iv: Iv) -> Self {
        Self {
            cipher: Some(Sm4Gcm::new(key)),
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
        let tag = cipher.encrypt_in_place_detached(&nonce.0, &aad, payload.as_mut());
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
        let tag = <&[u8; TAG_LEN]>::try_from(&*tag).map_err(|_| Error::DecryptError)?;
        cipher
            .decrypt_in_place_detached(&nonce.0, &aad, text, tag)
            .map_err(|_| Error::DecryptError)?;
        payload.truncate(text_len);
        msg.into_tls13_unpadded_message()
    }
}

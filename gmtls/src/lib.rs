//! ShangMi (SM) cryptography for TLS 1.3 in rustls, after RFC 8998, in pure Rust (RustCrypto
//! `sm2`, `sm3`, `sm4`; no C library).
//!
//! # What RFC 8998 requires
//!
//! * Cipher suites `TLS_SM4_GCM_SM3` (0x00C6) and `TLS_SM4_CCM_SM3` (0x00C7), TLS 1.3 only
//!   (§3.1). The AEAD is SM4 in GCM (or CCM) with a 16-byte key, 12-byte nonce built as in
//!   RFC 8446 §5.3 (write IV XOR sequence number) and a 16-byte tag (§3.5); the key schedule
//!   is RFC 8446's HKDF with SM3 as the hash (§3.4).
//! * Key exchange group `curveSM2` (NamedGroup 41 = 0x0029): ECDHE on the SM2 curve of
//!   GB/T 32918.5, not the SM2 key exchange protocol (§3.4).
//! * Signature scheme `sm2sig_sm3` (0x0708): SM2 signatures over SM3 (§3.2.1). SM2 hashes a
//!   distinguishing identifier into its Z value, and §3.2.1 fixes two of them: the ASCII
//!   string `TLSv1.3+GM+Cipher+Suite` for the TLS 1.3 handshake signature
//!   (CertificateVerify), and `1234567812345678` (the GM/T 0009-2012 default) when verifying
//!   the signatures of the peer's SM2 certificates.
//! * A ClientHello for these suites carries curveSM2 in supported_groups and key_share and
//!   sm2sig_sm3 in signature_algorithms (§3.3.1.1); a CertificateRequest lists sm2sig_sm3
//!   only (§3.3.2); a server certificate holds an SM2 key, is signed with SM2-with-SM3 and
//!   may sign (digitalSignature) (§3.3.3); CertificateVerify uses sm2sig_sm3 (§3.3.4).
//!
//! # What this crate implements
//!
//! * [`TLS_SM4_GCM_SM3`]: SM4-GCM ([`aead::Sm4Gcm`]: our counter mode over
//!   [`sm4ct::Sm4Ct`], SM4 in constant time on the CPU's GFNI or AES instructions, up to 48
//!   blocks a pass, the counter blocks made in the registers on GFNI; GHASH on VPCLMULQDQ
//!   sixteen blocks a reduction where the CPU has it, else the `ghash` crate's) with HKDF
//!   over HMAC-SM3 (rustls' `HkdfUsingHmac`). `TLS_SM4_CCM_SM3` is not implemented.
//! * [`kx::CURVE_SM2`]: curveSM2 ECDHE, 65-byte uncompressed key shares, x-coordinate shared
//!   secret, invalid points refused; offered for TLS 1.3 only.
//! * `sm2sig_sm3` signing ([`Sm2SigningKey`], ID [`TLS13_SM2_ID`]) from PKCS#8 or SEC1 keys,
//!   and verification for webpki: [`verify::SM2_SM3_TLS13`] (CertificateVerify, ID
//!   `TLSv1.3+GM+Cipher+Suite`) and [`verify::SM2_SM3_CERT`] (certificate chains: public key
//!   id-ecPublicKey with the sm2p256v1 curve 1.2.156.10197.1.301, signature SM2-with-SM3
//!   1.2.156.10197.1.501, ID `1234567812345678`).
//! * Providers: [`gm_provider`] (SM only: its ClientHello and CertificateRequest offer
//!   exactly the RFC 8998 profile) and [`combined_provider`] (SM plus a base provider), and
//!   [`DualCertResolver`] for a server holding an SM2 and a standard certificate.
//! * [`certs`]: a development SM2 CA and server/client certificates for Aether.
//!
//! Interoperability with Tongsuo 8.5 (`openssl s_server`/`s_client` with
//! `-enable_sm_tls13_strict`) is tested in `tests/tongsuo.rs`.

use std::sync::{Arc, Mutex, OnceLock};

use rustls::SignatureScheme;
use rustls::crypto::{CryptoProvider, KeyProvider, SecureRandom, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, SignatureVerificationAlgorithm};
use rustls::sign::CertifiedKey;

pub mod aead;
pub mod certs;
mod error;
#[cfg(target_arch = "x86_64")]
mod gcm512;
#[cfg(target_arch = "x86_64")]
mod ghash512;
pub mod hash;
pub mod kx;
mod resolver;
pub mod sign;
pub mod sm4ct;
pub mod suite;
pub mod verify;

pub use error::Error;
pub use kx::CURVE_SM2_ID;
pub use resolver::DualCertResolver;
pub use sign::{Sm2KeyProvider, Sm2SigningKey};
pub use suite::{TLS_SM4_GCM_SM3, TLS_SM4_GCM_SM3_ID, TLS13_SM4_GCM_SM3};
pub use verify::{CERT_SM2_ID, SM2_ALGORITHMS, SM2SIG_SM3, TLS13_SM2_ID};

/// The ShangMi-only provider: `TLS_SM4_GCM_SM3`, curveSM2, SM2 chains and `sm2sig_sm3`
/// verification, SM2 keys. Its configs speak TLS 1.3 only (use
/// `builder_with_protocol_versions(&[&rustls::version::TLS13])`, or the default versions:
/// no TLS 1.2 suite exists here).
pub fn gm_provider() -> CryptoProvider {
    CryptoProvider {
        cipher_suites: vec![TLS_SM4_GCM_SM3],
        kx_groups: vec![&kx::CURVE_SM2],
        signature_verification_algorithms: SM2_ALGORITHMS,
        secure_random: &OS_RANDOM,
        key_provider: &sign::SM2_KEY_PROVIDER,
    }
}

/// `base` plus ShangMi: the SM suite and curveSM2 first (so SM-capable peers get them),
/// then `base`'s suites and groups; SM2 and `base`'s verification algorithms; a key
/// provider that loads SM2 keys itself and hands every other key to `base`'s; `base`'s
/// random source.
///
/// Because curveSM2 comes first, a client built on this provider sends its key share for
/// curveSM2 and costs a HelloRetryRequest against a server without it; put `base`'s groups
/// first (edit `kx_groups`) if the usual peer is not an SM one.
///
/// rustls wants `'static` verification tables and key provider, so the merged ones are
/// allocated once per distinct `base` (kept for the life of the process) and reused.
pub fn combined_provider(base: CryptoProvider) -> CryptoProvider {
    let mut cipher_suites = vec![TLS_SM4_GCM_SM3];
    cipher_suites.extend(
        base.cipher_suites
            .iter()
            .copied()
            .filter(|s| s.suite() != TLS_SM4_GCM_SM3_ID),
    );
    let mut kx_groups: Vec<&'static dyn rustls::crypto::SupportedKxGroup> = vec![&kx::CURVE_SM2];
    kx_groups.extend(
        base.kx_groups
            .iter()
            .copied()
            .filter(|g| g.name() != CURVE_SM2_ID),
    );
    CryptoProvider {
        cipher_suites,
        kx_groups,
        signature_verification_algorithms: merged_algorithms(
            &base.signature_verification_algorithms,
        ),
        secure_random: base.secure_random,
        key_provider: merged_key_provider(base.key_provider),
    }
}

/// A `CertifiedKey` from a certificate chain (leaf first) and an SM2 private key, checked to
/// belong together.
pub fn sm2_certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: &PrivateKeyDer<'_>,
) -> Result<CertifiedKey, Error> {
    let signing_key = Sm2SigningKey::from_der(key)?;
    let certified = CertifiedKey::new(chain, Arc::new(signing_key));
    certified
        .keys_match()
        .map_err(|e| Error::InvalidInput(format!("certificate and key: {e}")))?;
    Ok(certified)
}

/// Random bytes from the operating system (`getrandom`).
#[derive(Debug)]
struct OsRandom;

static OS_RANDOM: OsRandom = OsRandom;

impl SecureRandom for OsRandom {
    fn fill(&self, buf: &mut [u8]) -> Result<(), rustls::crypto::GetRandomFailed> {
        getrandom::fill(buf).map_err(|_| rustls::crypto::GetRandomFailed)
    }
}

type Mapping = [(
    SignatureScheme,
    &'static [&'static dyn SignatureVerificationAlgorithm],
)];

/// Identity of a base provider's tables: `'static` slices, so their addresses and lengths.
type AlgorithmsKey = (usize, usize, usize, usize);

fn merged_algorithms(base: &WebPkiSupportedAlgorithms) -> WebPkiSupportedAlgorithms {
    static MERGED: OnceLock<Mutex<Vec<(AlgorithmsKey, WebPkiSupportedAlgorithms)>>> =
        OnceLock::new();
    let key = (
        base.all.as_ptr() as usize,
        base.all.len(),
        base.mapping.as_ptr() as usize,
        base.mapping.len(),
    );
    let cache = MERGED.get_or_init(|| Mutex::new(Vec::new()));
    let mut cache = cache
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, merged)) = cache.iter().find(|(k, _)| *k == key) {
        return *merged;
    }
    let mut all: Vec<&'static dyn SignatureVerificationAlgorithm> = verify::SM2_ALL.to_vec();
    all.extend_from_slice(base.all);
    let mut mapping: Vec<(
        SignatureScheme,
        &'static [&'static dyn SignatureVerificationAlgorithm],
    )> = verify::SM2_MAPPING.to_vec();
    mapping.extend(
        base.mapping
            .iter()
            .filter(|(scheme, _)| *scheme != SM2SIG_SM3),
    );
    let merged = WebPkiSupportedAlgorithms {
        all: Vec::leak(all),
        mapping: Vec::leak(mapping) as &'static Mapping,
    };
    cache.push((key, merged));
    merged
}

fn merged_key_provider(base: &'static dyn KeyProvider) -> &'static dyn KeyProvider {
    static MERGED: OnceLock<Mutex<Vec<(usize, &'static sign::CombinedKeyProvider)>>> =
        OnceLock::new();
    let key = base as *const dyn KeyProvider as *const () as usize;
    let cache = MERGED.get_or_init(|| Mutex::new(Vec::new()));
    let mut cache = cache
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, merged)) = cache.iter().find(|(k, _)| *k == key) {
        return *merged;
    }
    let merged: &'static sign::CombinedKeyProvider =
        Box::leak(Box::new(sign::CombinedKeyProvider { base }));
    cache.push((key, merged));
    merged
}

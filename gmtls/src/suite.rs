//! `TLS_SM4_GCM_SM3` (RFC 8998 §2, code point 0x00C6) as a rustls TLS 1.3 suite.

use rustls::crypto::CipherSuiteCommon;
use rustls::{CipherSuite, SupportedCipherSuite, Tls13CipherSuite};

use crate::aead::SM4_GCM;
use crate::hash::{HKDF_SM3, SM3};

/// The suite's code point; rustls 0.23 has no named variant for it.
pub const TLS_SM4_GCM_SM3_ID: CipherSuite = CipherSuite::Unknown(0x00C6);

/// SM4-GCM records, SM3 transcript hash and HKDF-SM3 key schedule.
pub static TLS13_SM4_GCM_SM3: Tls13CipherSuite = Tls13CipherSuite {
    common: CipherSuiteCommon {
        suite: TLS_SM4_GCM_SM3_ID,
        hash_provider: &SM3,
        // RFC 8446 §5.5's limit for AES-GCM holds for any 128-bit block cipher in GCM;
        // rustls uses 2^24 records for AES-GCM too.
        confidentiality_limit: 1 << 24,
    },
    hkdf_provider: &HKDF_SM3,
    aead_alg: &SM4_GCM,
    // No QUIC header protection for SM4 here: the suite is not offered over QUIC.
    quic: None,
};

/// [`TLS13_SM4_GCM_SM3`] as rustls' suite enum, for `CryptoProvider::cipher_suites`.
pub const TLS_SM4_GCM_SM3: SupportedCipherSuite = SupportedCipherSuite::Tls13(&TLS13_SM4_GCM_SM3);

//! SM2-with-SM3 signature verification for webpki: certificate chains and the TLS 1.3
//! CertificateVerify.
//!
//! The two differ only in the SM2 distinguishing identifier that goes into Z
//! (GB/T 32918.2 §5.5), which RFC 8998 §3.2.1 fixes:
//!
//! * certificate signatures (a peer's chain in the Certificate message): `1234567812345678`,
//!   the GM/T 0009-2012 default ([`CERT_SM2_ID`]);
//! * every other SM2 signature of the handshake, i.e. CertificateVerify:
//!   `TLSv1.3+GM+Cipher+Suite` ([`TLS13_SM2_ID`]).
//!
//! webpki picks a verifier by algorithm identifiers alone, so there are two verifier values:
//! [`SM2_SM3_CERT`] in `all` (chains) and [`SM2_SM3_TLS13`] in `mapping` (CertificateVerify).

use rustls::SignatureScheme;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{AlgorithmIdentifier, InvalidSignature, SignatureVerificationAlgorithm};
use sm2::dsa::signature::Verifier;
use sm2::dsa::{DerSignature, Signature, VerifyingKey};

/// SM2 ID of the TLS 1.3 handshake signature (CertificateVerify), RFC 8998 §3.2.1.
pub const TLS13_SM2_ID: &str = "TLSv1.3+GM+Cipher+Suite";

/// SM2 ID of certificate signatures, RFC 8998 §3.2.1 citing GM/T 0009-2012 (the default
/// ID of GB/T 32918 / GM/T 0009). What a CA really used is its choice; this is the ID every
/// SM2 CA we know of, Tongsuo included, uses by default.
pub const CERT_SM2_ID: &str = "1234567812345678";

/// `sm2sig_sm3` (RFC 8998 §2, 0x0708); rustls 0.23 has no named variant.
pub const SM2SIG_SM3: SignatureScheme = SignatureScheme::Unknown(0x0708);

/// DER of the OIDs below, as webpki compares them (AlgorithmIdentifier contents, no outer
/// SEQUENCE). A unit test checks them against `const-oid`.
pub mod alg_id {
    use rustls::pki_types::AlgorithmIdentifier;

    /// id-ecPublicKey (1.2.840.10045.2.1) with the named curve sm2p256v1
    /// (1.2.156.10197.1.301): an SM2 subjectPublicKeyInfo.
    pub const SM2_PUBLIC_KEY: AlgorithmIdentifier = AlgorithmIdentifier::from_slice(&[
        0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, // id-ecPublicKey
        0x06, 0x08, 0x2a, 0x81, 0x1c, 0xcf, 0x55, 0x01, 0x82, 0x2d, // sm2p256v1
    ]);

    /// SM2-with-SM3 (1.2.156.10197.1.501) without parameters, as Tongsuo, GmSSL and
    /// RustCrypto write it.
    pub const SM2_WITH_SM3: AlgorithmIdentifier = AlgorithmIdentifier::from_slice(&[
        0x06, 0x08, 0x2a, 0x81, 0x1c, 0xcf, 0x55, 0x01, 0x83, 0x75,
    ]);
}

/// OID of curveSM2 / sm2p256v1, for key loading.
pub const SM2_CURVE_OID: const_oid::ObjectIdentifier =
    const_oid::ObjectIdentifier::new_unwrap("1.2.156.10197.1.301");
/// OID of id-ecPublicKey.
pub const EC_PUBLIC_KEY_OID: const_oid::ObjectIdentifier =
    const_oid::ObjectIdentifier::new_unwrap("1.2.840.10045.2.1");
/// OID of SM2-with-SM3 signatures.
pub const SM2_WITH_SM3_OID: const_oid::ObjectIdentifier =
    const_oid::ObjectIdentifier::new_unwrap("1.2.156.10197.1.501");

/// SM2 signature verification with SM3 and a fixed distinguishing ID.
#[derive(Debug)]
pub struct Sm2Sm3Verify {
    distid: &'static str,
}

/// Verifies SM2-with-SM3 certificate signatures (ID `1234567812345678`).
pub static SM2_SM3_CERT: Sm2Sm3Verify = Sm2Sm3Verify {
    distid: CERT_SM2_ID,
};

/// Verifies TLS 1.3 CertificateVerify signatures of `sm2sig_sm3` (ID
/// `TLSv1.3+GM+Cipher+Suite`).
pub static SM2_SM3_TLS13: Sm2Sm3Verify = Sm2Sm3Verify {
    distid: TLS13_SM2_ID,
};

impl Sm2Sm3Verify {
    /// The distinguishing ID this verifier hashes into Z.
    pub fn distid(&self) -> &'static str {
        self.distid
    }
}

impl SignatureVerificationAlgorithm for Sm2Sm3Verify {
    /// `public_key` is the subjectPublicKey bit string (a SEC1 point); `signature` the DER
    /// `SEQUENCE { r, s }` both certificates and CertificateVerify carry.
    fn verify_signature(
        &self,
        public_key: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), InvalidSignature> {
        let key =
            VerifyingKey::from_sec1_bytes(self.distid, public_key).map_err(|_| InvalidSignature)?;
        let der = DerSignature::from_bytes(signature).map_err(|_| InvalidSignature)?;
        let signature = Signature::try_from(der).map_err(|_| InvalidSignature)?;
        key.verify(message, &signature)
            .map_err(|_| InvalidSignature)
    }

    fn public_key_alg_id(&self) -> AlgorithmIdentifier {
        alg_id::SM2_PUBLIC_KEY
    }

    fn signature_alg_id(&self) -> AlgorithmIdentifier {
        alg_id::SM2_WITH_SM3
    }
}

/// Chains: SM2-with-SM3 only.
pub(crate) static SM2_ALL: &[&dyn SignatureVerificationAlgorithm] = &[&SM2_SM3_CERT];

/// CertificateVerify: `sm2sig_sm3` only.
pub(crate) static SM2_MAPPING: &[(SignatureScheme, &[&dyn SignatureVerificationAlgorithm])] =
    &[(SM2SIG_SM3, &[&SM2_SM3_TLS13])];

/// What `gm_provider()` verifies: SM2 chains and `sm2sig_sm3` handshake signatures.
pub static SM2_ALGORITHMS: WebPkiSupportedAlgorithms = WebPkiSupportedAlgorithms {
    all: SM2_ALL,
    mapping: SM2_MAPPING,
};

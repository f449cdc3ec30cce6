//! `sm2sig_sm3` signing (RFC 8998 §3.2.1) and loading SM2 private keys for rustls.
//!
//! Handshake signatures (CertificateVerify) use the SM2 ID `TLSv1.3+GM+Cipher+Suite`
//! ([`crate::TLS13_SM2_ID`]); the signature is the DER `SEQUENCE { r, s }`, as for ECDSA.

use std::fmt;
use std::sync::Arc;

use rustls::crypto::KeyProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{PrivateKeyDer, SubjectPublicKeyInfoDer};
use rustls::sign::{Signer, SigningKey};
use rustls::{SignatureAlgorithm, SignatureScheme};
use sm2::dsa::DerSignature;
use sm2::dsa::signature::Signer as _;
use sm2::pkcs8::EncodePublicKey;

use crate::error::Error;
use crate::verify::{EC_PUBLIC_KEY_OID, SM2_CURVE_OID, SM2SIG_SM3, TLS13_SM2_ID};

/// TLS 1.2 has no SM2 `SignatureAlgorithm`; rustls consults this value only to match
/// TLS 1.2 suites, and no TLS 1.2 suite matches an unknown one (RFC 8998 §3.1: TLS 1.3 only).
const SM2_TLS12_ALGORITHM: SignatureAlgorithm = SignatureAlgorithm::Unknown(0x08);

/// An SM2 private key as rustls' `SigningKey`: offers `sm2sig_sm3` when the peer does.
pub struct Sm2SigningKey {
    key: Arc<sm2::dsa::SigningKey>,
    spki: Vec<u8>,
}

impl fmt::Debug for Sm2SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sm2SigningKey").finish_non_exhaustive()
    }
}

impl Sm2SigningKey {
    /// The handshake signing key for `secret`.
    pub fn new(secret: &sm2::SecretKey) -> Result<Self, Error> {
        let key = sm2::dsa::SigningKey::new(TLS13_SM2_ID, secret)
            .map_err(|_| Error::MalformedKey("SM2 signing key".into()))?;
        let spki = secret
            .public_key()
            .to_public_key_der()
            .map_err(|e| Error::MalformedKey(e.to_string()))?
            .into_vec();
        Ok(Self {
            key: Arc::new(key),
            spki,
        })
    }

    /// From PKCS#8 or SEC1 DER (what rustls' PEM readers return).
    pub fn from_der(key: &PrivateKeyDer<'_>) -> Result<Self, Error> {
        Self::new(&sm2_secret_key(key)?)
    }

    /// From PEM: the first `PRIVATE KEY` (PKCS#8) or `EC PRIVATE KEY` (SEC1, as Tongsuo's
    /// `ecparam -genkey` writes it, `EC PARAMETERS` block and all) in `pem`.
    pub fn from_pem(pem: &str) -> Result<Self, Error> {
        let key =
            PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| Error::Pem(e.to_string()))?;
        Self::from_der(&key)
    }
}

impl SigningKey for Sm2SigningKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        offered.contains(&SM2SIG_SM3).then(|| {
            Box::new(Sm2Signer {
                key: Arc::clone(&self.key),
            }) as Box<dyn Signer>
        })
    }

    fn public_key(&self) -> Option<SubjectPublicKeyInfoDer<'_>> {
        Some(SubjectPublicKeyInfoDer::from(self.spki.as_slice()))
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        SM2_TLS12_ALGORITHM
    }
}

struct Sm2Signer {
    key: Arc<sm2::dsa::SigningKey>,
}

impl fmt::Debug for Sm2Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sm2Signer").finish_non_exhaustive()
    }
}

impl Signer for Sm2Signer {
    /// Deterministic k (RFC 6979 with SM3, as the `sm2` crate does): no RNG needed and no
    /// nonce reuse across messages.
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        let signature: sm2::dsa::Signature = self
            .key
            .try_sign(message)
            .map_err(|_| rustls::Error::General("SM2 signing failed".into()))?;
        Ok(DerSignature::from(signature).to_vec())
    }

    fn scheme(&self) -> SignatureScheme {
        SM2SIG_SM3
    }
}

/// Whether `key` names curveSM2: a PKCS#8 key whose algorithm is id-ecPublicKey with the
/// sm2p256v1 parameter (or, as some older tools write it, the sm2p256v1 OID itself), or a
/// SEC1 key with the sm2p256v1 parameter. A SEC1 key without parameters is not claimed.
pub fn is_sm2_key(key: &PrivateKeyDer<'_>) -> bool {
    match key {
        PrivateKeyDer::Pkcs8(der) => pkcs8_sm2_inner(der.secret_pkcs8_der()).is_ok(),
        PrivateKeyDer::Sec1(der) => {
            sec1::EcPrivateKey::try_from(der.secret_sec1_der())
                .ok()
                .and_then(|k| k.parameters)
                .and_then(|p| p.named_curve())
                == Some(SM2_CURVE_OID)
        }
        _ => false,
    }
}

/// The SM2 secret in a PKCS#8 or SEC1 DER key; anything else is refused.
pub fn sm2_secret_key(key: &PrivateKeyDer<'_>) -> Result<sm2::SecretKey, Error> {
    let sec1_der = match key {
        PrivateKeyDer::Pkcs8(der) => pkcs8_sm2_inner(der.secret_pkcs8_der())?,
        PrivateKeyDer::Sec1(der) => der.secret_sec1_der(),
        PrivateKeyDer::Pkcs1(_) => return Err(Error::NotSm2Key("an RSA (PKCS#1) key")),
        _ => return Err(Error::NotSm2Key("an unknown key format")),
    };
    // Checks the curve parameter when present, the scalar's range and, when present, that
    // the embedded public key is this scalar's.
    sm2::SecretKey::from_sec1_der(sec1_der).map_err(|e| Error::MalformedKey(e.to_string()))
}

/// The SEC1 `ECPrivateKey` inside a PKCS#8 key, if the key is an SM2 one.
fn pkcs8_sm2_inner(der: &[u8]) -> Result<&[u8], Error> {
    let info = sm2::pkcs8::PrivateKeyInfoRef::try_from(der)
        .map_err(|e| Error::MalformedKey(e.to_string()))?;
    let algorithm = &info.algorithm;
    let is_sm2 = if algorithm.oid == EC_PUBLIC_KEY_OID {
        algorithm.parameters_oid().ok() == Some(SM2_CURVE_OID)
    } else {
        algorithm.oid == SM2_CURVE_OID
    };
    if !is_sm2 {
        return Err(Error::NotSm2Key("PKCS#8 algorithm is not SM2"));
    }
    Ok(info.private_key.as_bytes())
}

/// Loads SM2 keys only: `gm_provider()`'s key provider.
#[derive(Debug)]
pub struct Sm2KeyProvider;

/// The one instance `gm_provider()` points at.
pub static SM2_KEY_PROVIDER: Sm2KeyProvider = Sm2KeyProvider;

impl KeyProvider for Sm2KeyProvider {
    fn load_private_key(
        &self,
        key_der: PrivateKeyDer<'static>,
    ) -> Result<Arc<dyn SigningKey>, rustls::Error> {
        Sm2SigningKey::from_der(&key_der)
            .map(|key| Arc::new(key) as Arc<dyn SigningKey>)
            .map_err(|e| rustls::Error::General(e.to_string()))
    }
}

/// SM2 keys here, everything else to the base provider's key provider.
#[derive(Debug)]
pub(crate) struct CombinedKeyProvider {
    pub(crate) base: &'static dyn KeyProvider,
}

impl KeyProvider for CombinedKeyProvider {
    fn load_private_key(
        &self,
        key_der: PrivateKeyDer<'static>,
    ) -> Result<Arc<dyn SigningKey>, rustls::Error> {
        if is_sm2_key(&key_der) {
            SM2_KEY_PROVIDER.load_private_key(key_der)
        } else {
            self.base.load_private_key(key_der)
        }
    }
}

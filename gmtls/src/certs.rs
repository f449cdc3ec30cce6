//! Development SM2 PKI: a CA and the leaf certificates Aether needs, as PEM strings (the
//! caller writes the files).
//!
//! * CA: SM2 key, self-signed SM2-with-SM3, basicConstraints CA (critical), keyUsage
//!   keyCertSign/cRLSign/digitalSignature, 10 years.
//! * Server: SANs from DNS names and IP addresses, EKU serverAuth, 825 days.
//! * Client: a SAN URI (Aether's `aether://member/<id>` or `aether://worker/<id>`) and a CN,
//!   EKU clientAuth, 825 days.
//! * Every leaf: basicConstraints CA=false, keyUsage digitalSignature (critical; RFC 8998
//!   §3.3.3 wants a certificate "capable of signing"), subject and authority key ids.
//! * `notBefore` is back-dated one hour for peers whose clocks lag.
//!
//! Certificates are built with RustCrypto's `x509-cert` builder and signed through an SM2
//! signer that writes the DER `SEQUENCE { r, s }` X.509 expects (the `sm2` crate's own
//! signature type would put the raw 64-byte `r ‖ s` in the certificate) with the GM/T 0009
//! default ID `1234567812345678` (RFC 8998 §3.2.1). Key identifiers are the leftmost 160 bits
//! of the SM3 hash of the subjectPublicKey (RFC 5280 §4.2.1.2 method 1 with SM3 for SHA-1, as
//! RFC 7093 allows other hashes). Private keys are PKCS#8 PEM.

use std::net::IpAddr;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use const_oid::AssociatedOid;
use const_oid::db::rfc5280::{ID_KP_CLIENT_AUTH, ID_KP_SERVER_AUTH};
use der::asn1::{Ia5String, OctetString};
use der::pem::LineEnding;
use der::{Decode, DecodePem, Encode, EncodePem};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sm2::dsa::signature::{self, Keypair};
use sm2::dsa::{DerSignature, Signature};
use sm2::elliptic_curve::Generate;
use sm2::pkcs8::EncodePrivateKey;
use sm3::{Digest, Sm3};
use spki::{AlgorithmIdentifier, SignatureAlgorithmIdentifier, SubjectPublicKeyInfo};
use x509_cert::builder::profile::BuilderProfile;
use x509_cert::builder::{Builder, CertificateBuilder};
use x509_cert::certificate::{Certificate, TbsCertificate};
use x509_cert::ext::Extension;
use x509_cert::ext::pkix::name::GeneralName;
use x509_cert::ext::pkix::{
    AuthorityKeyIdentifier, BasicConstraints, ExtendedKeyUsage, KeyUsage, KeyUsages,
    SubjectAltName, SubjectKeyIdentifier,
};
use x509_cert::name::Name;
use x509_cert::serial_number::SerialNumber;
use x509_cert::time::{Time, Validity};

use crate::error::Error;
use crate::verify::CERT_SM2_ID;

/// Lifetime of the development CA.
pub const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Lifetime of leaf certificates (the CA/Browser Forum's old maximum, as the gateway uses).
pub const LEAF_VALIDITY: Duration = Duration::from_secs(825 * 24 * 3600);
/// Back-dating of `notBefore`.
pub const CLOCK_SKEW: Duration = Duration::from_secs(3600);
/// A certificate and its private key, PEM.
#[derive(Clone)]
pub struct PemPair {
    /// `CERTIFICATE` PEM.
    pub cert_pem: String,
    /// `PRIVATE KEY` PEM (PKCS#8).
    pub key_pem: String,
}

impl std::fmt::Debug for PemPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PemPair")
            .field("cert_pem", &self.cert_pem)
            .finish_non_exhaustive()
    }
}

impl PemPair {
    /// The certificate, DER.
    pub fn cert_der(&self) -> Result<CertificateDer<'static>, Error> {
        pem_to_cert_der(&self.cert_pem)
    }

    /// The private key, DER (PKCS#8).
    pub fn key_der(&self) -> Result<PrivateKeyDer<'static>, Error> {
        PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|e| Error::Pem(e.to_string()))
    }
}

/// A development CA that can issue leaves.
pub struct DevCa {
    pem: PemPair,
    cert: Certificate,
    signer: CertSigner,
}

impl std::fmt::Debug for DevCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevCa")
            .field(
                "subject",
                &self.cert.tbs_certificate().subject().to_string(),
            )
            .finish_non_exhaustive()
    }
}

impl DevCa {
    /// A new CA: fresh SM2 key, self-signed, subject `CN=<common_name>,O=Aether`.
    /// `common_name` is 1–64 characters of `[A-Za-z0-9 ._-]`.
    pub fn generate(common_name: &str) -> Result<Self, Error> {
        let secret = new_secret_key()?;
        let signer = CertSigner::new(&secret)?;
        let subject = subject_name(common_name)?;
        let spki = SubjectPublicKeyInfo::from_key(&signer.verifying_key())
            .map_err(|e| Error::MalformedKey(e.to_string()))?;
        let profile = Profile {
            issuer: subject.clone(),
            subject,
            kind: Kind::Ca,
            authority_key_id: None,
        };
        let cert = build(profile, CA_VALIDITY, spki, &signer)?;
        let pem = PemPair {
            cert_pem: cert.to_pem(LineEnding::LF)?,
            key_pem: pkcs8_pem(&secret)?,
        };
        Ok(Self { pem, cert, signer })
    }

    /// An existing CA, from its certificate and SM2 private key (PKCS#8 or SEC1 PEM), so
    /// that certificates already issued stay valid.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, Error> {
        let cert = Certificate::from_pem(cert_pem.as_bytes())?;
        let key_der = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| Error::Pem(e.to_string()))?;
        let key = crate::sign::sm2_secret_key(&key_der)?;
        let signer = CertSigner::new(&key)?;
        let own_spki = SubjectPublicKeyInfo::from_key(&signer.verifying_key())
            .map_err(|e| Error::MalformedKey(e.to_string()))?;
        if cert.tbs_certificate().subject_public_key_info() != &own_spki {
            return Err(Error::InvalidInput(
                "the CA key does not match the CA certificate".into(),
            ));
        }
        Ok(Self {
            pem: PemPair {
                cert_pem: cert_pem.to_owned(),
                key_pem: key_pem.to_owned(),
            },
            cert,
            signer,
        })
    }

    /// The CA certificate and key, PEM.
    pub fn pem(&self) -> &PemPair {
        &self.pem
    }

    /// The CA certificate, DER (a trust anchor for rustls' `RootCertStore`).
    pub fn cert_der(&self) -> Result<CertificateDer<'static>, Error> {
        Ok(CertificateDer::from(self.cert.to_der()?))
    }

    /// A server certificate, subject `CN=<common_name>,O=Aether`, with one SAN per entry of
    /// `names`: an IP address when it parses as one, else a DNS name (`[A-Za-z0-9.*-]`).
    pub fn issue_server(&self, common_name: &str, names: &[&str]) -> Result<PemPair, Error> {
        let mut sans = Vec::with_capacity(names.len());
        for name in names {
            sans.push(match name.parse::<IpAddr>() {
                Ok(ip) => GeneralName::from(ip),
                Err(_) => GeneralName::DnsName(dns_name(name)?),
            });
        }
        if sans.is_empty() {
            return Err(Error::InvalidInput(
                "a server certificate needs at least one name".into(),
            ));
        }
        self.issue_leaf(common_name, sans, ID_KP_SERVER_AUTH)
    }

    /// A client certificate naming `uri` (Aether's identities are `aether://member/<id>` and
    /// `aether://worker/<id>`, checked and built by the gateway's `identity` module) in its
    /// SAN, with CN `common_name`.
    pub fn issue_client(&self, common_name: &str, uri: &str) -> Result<PemPair, Error> {
        let uri = Ia5String::new(uri)?;
        self.issue_leaf(
            common_name,
            vec![GeneralName::UniformResourceIdentifier(uri)],
            ID_KP_CLIENT_AUTH,
        )
    }

    fn issue_leaf(
        &self,
        common_name: &str,
        sans: Vec<GeneralName>,
        eku: const_oid::ObjectIdentifier,
    ) -> Result<PemPair, Error> {
        let secret = new_secret_key()?;
        let spki = SubjectPublicKeyInfo::from_key(&secret.public_key())
            .map_err(|e| Error::MalformedKey(e.to_string()))?;
        let profile = Profile {
            issuer: self.cert.tbs_certificate().subject().clone(),
            subject: subject_name(common_name)?,
            kind: Kind::Leaf { eku, sans },
            authority_key_id: self
                .cert
                .tbs_certificate()
                .get_extension::<SubjectKeyIdentifier>()?
                .map(|(_, ski)| ski.0),
        };
        let cert = build(profile, LEAF_VALIDITY, spki, &self.signer)?;
        Ok(PemPair {
            cert_pem: cert.to_pem(LineEnding::LF)?,
            key_pem: pkcs8_pem(&secret)?,
        })
    }
}

/// The `aether://` (and any other) SAN URIs of a certificate, in order.
pub fn san_uris(cert_der: &[u8]) -> Result<Vec<String>, Error> {
    let cert = Certificate::from_der(cert_der)?;
    let Some((_, san)) = cert.tbs_certificate().get_extension::<SubjectAltName>()? else {
        return Ok(Vec::new());
    };
    Ok(san
        .0
        .iter()
        .filter_map(|name| match name {
            GeneralName::UniformResourceIdentifier(uri) => Some(uri.to_string()),
            _ => None,
        })
        .collect())
}

/// The first `CERTIFICATE` block of `pem`, DER.
pub fn pem_to_cert_der(pem: &str) -> Result<CertificateDer<'static>, Error> {
    CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| Error::Pem(e.to_string()))
}

/// Every `CERTIFICATE` block of `pem`, DER, in order (a chain file).
pub fn pem_to_cert_chain(pem: &str) -> Result<Vec<CertificateDer<'static>>, Error> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Pem(e.to_string()))
}

fn new_secret_key() -> Result<sm2::SecretKey, Error> {
    sm2::SecretKey::try_generate().map_err(|e| Error::Random(e.to_string()))
}

fn pkcs8_pem(secret: &sm2::SecretKey) -> Result<String, Error> {
    let pem = secret
        .to_pkcs8_pem(LineEnding::LF)
        .map_err(|e| Error::MalformedKey(e.to_string()))?;
    Ok(pem.as_str().to_owned())
}

fn subject_name(common_name: &str) -> Result<Name, Error> {
    let ok = !common_name.is_empty()
        && common_name.len() <= 64
        && common_name.trim() == common_name
        && common_name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b' ' | b'.' | b'_' | b'-'));
    if !ok {
        return Err(Error::InvalidInput(format!(
            "common name {common_name:?} must be 1-64 characters of [A-Za-z0-9 ._-]"
        )));
    }
    // The character set needs no RFC 4514 escaping.
    Ok(Name::from_str(&format!("CN={common_name},O=Aether"))?)
}

fn dns_name(name: &str) -> Result<Ia5String, Error> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'*'));
    if !ok {
        return Err(Error::InvalidInput(format!(
            "{name:?} is neither an IP address nor a DNS name"
        )));
    }
    Ok(Ia5String::new(name)?)
}

enum Kind {
    Ca,
    Leaf {
        eku: const_oid::ObjectIdentifier,
        sans: Vec<GeneralName>,
    },
}

struct Profile {
    issuer: Name,
    subject: Name,
    kind: Kind,
    /// The issuer's subject key id, for leaves (RFC 5280 §4.2.1.1: the authority key id is
    /// the issuer's SKI, whatever method made it, so that a CA from elsewhere works).
    authority_key_id: Option<OctetString>,
}

impl BuilderProfile for Profile {
    fn get_issuer(&self, _subject: &Name) -> Name {
        self.issuer.clone()
    }

    fn get_subject(&self) -> Name {
        self.subject.clone()
    }

    fn build_extensions(
        &self,
        spk: spki::SubjectPublicKeyInfoRef<'_>,
        issuer_spk: spki::SubjectPublicKeyInfoRef<'_>,
        _tbs: &TbsCertificate,
    ) -> x509_cert::builder::Result<Vec<Extension>> {
        let ski = key_id(spk.subject_public_key.raw_bytes())?;
        let aki = AuthorityKeyIdentifier {
            key_identifier: Some(match &self.authority_key_id {
                Some(id) => id.clone(),
                None => key_id(issuer_spk.subject_public_key.raw_bytes())?,
            }),
            authority_cert_issuer: None,
            authority_cert_serial_number: None,
        };
        let mut extensions = vec![extension(false, &SubjectKeyIdentifier(ski))?];
        match &self.kind {
            Kind::Ca => {
                extensions.push(extension(
                    true,
                    &BasicConstraints {
                        ca: true,
                        path_len_constraint: None,
                    },
                )?);
                extensions.push(extension(
                    true,
                    &KeyUsage(
                        KeyUsages::KeyCertSign | KeyUsages::CRLSign | KeyUsages::DigitalSignature,
                    ),
                )?);
            }
            Kind::Leaf { eku, sans } => {
                extensions.push(extension(false, &aki)?);
                extensions.push(extension(
                    true,
                    &BasicConstraints {
                        ca: false,
                        path_len_constraint: None,
                    },
                )?);
                extensions.push(extension(
                    true,
                    &KeyUsage(KeyUsages::DigitalSignature.into()),
                )?);
                extensions.push(extension(false, &ExtendedKeyUsage(vec![*eku]))?);
                extensions.push(extension(false, &SubjectAltName(sans.clone()))?);
            }
        }
        Ok(extensions)
    }
}

fn extension<T: AssociatedOid + Encode>(
    critical: bool,
    value: &T,
) -> Result<Extension, der::Error> {
    Ok(Extension {
        extn_id: T::OID,
        critical,
        extn_value: OctetString::new(value.to_der()?)?,
    })
}

fn key_id(subject_public_key: &[u8]) -> Result<OctetString, der::Error> {
    OctetString::new(&Sm3::digest(subject_public_key)[..20])
}

fn build(
    profile: Profile,
    lifetime: Duration,
    spki: spki::SubjectPublicKeyInfoOwned,
    signer: &CertSigner,
) -> Result<Certificate, Error> {
    let now = SystemTime::now();
    let not_before = now.checked_sub(CLOCK_SKEW).unwrap_or(now);
    let not_after = now
        .checked_add(lifetime)
        .ok_or_else(|| Error::InvalidInput("validity overflows".into()))?;
    let validity = Validity::new(Time::try_from(not_before)?, Time::try_from(not_after)?);
    let serial = random_serial()?;
    let builder = CertificateBuilder::new(profile, serial, validity, spki)?;
    Ok(builder.build::<CertSigner, DerSignature>(signer)?)
}

/// 16 random bytes, positive (RFC 5280 §4.1.2.2: at most 20 octets, non-negative).
fn random_serial() -> Result<SerialNumber, Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| Error::Random(e.to_string()))?;
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01; // no leading zero octet, so the encoding is exactly 16 bytes
    Ok(SerialNumber::new(&bytes)?)
}

/// Signs certificates: SM2-with-SM3, GM/T 0009 default ID, DER signature.
struct CertSigner {
    key: sm2::dsa::SigningKey,
}

impl CertSigner {
    fn new(secret: &sm2::SecretKey) -> Result<Self, Error> {
        let key = sm2::dsa::SigningKey::new(CERT_SM2_ID, secret)
            .map_err(|_| Error::MalformedKey("SM2 signing key".into()))?;
        Ok(Self { key })
    }
}

impl Keypair for CertSigner {
    type VerifyingKey = sm2::dsa::VerifyingKey;

    fn verifying_key(&self) -> Self::VerifyingKey {
        self.key.verifying_key().clone()
    }
}

impl signature::Signer<DerSignature> for CertSigner {
    fn try_sign(&self, msg: &[u8]) -> Result<DerSignature, signature::Error> {
        let signature: Signature = self.key.try_sign(msg)?;
        Ok(DerSignature::from(signature))
    }
}

impl SignatureAlgorithmIdentifier for CertSigner {
    type Params = der::asn1::AnyRef<'static>;

    const SIGNATURE_ALGORITHM_IDENTIFIER: AlgorithmIdentifier<Self::Params> =
        <Signature as spki::AssociatedAlgorithmIdentifier>::ALGORITHM_IDENTIFIER;
}

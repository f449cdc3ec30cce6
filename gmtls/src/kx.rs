//! `curveSM2` (RFC 8998 §2, NamedGroup 41 = 0x0029): ephemeral ECDH on the SM2 curve.
//!
//! RFC 8998 §3.4 rules out the SM2 key exchange protocol: this is plain ECDHE as for the NIST
//! curves (RFC 8446 §4.2.8.2 and §7.4.2): key shares are uncompressed points
//! (`0x04 ‖ x ‖ y`, 65 bytes) and the shared secret is the x-coordinate of the product.

use rustls::crypto::{ActiveKeyExchange, SharedSecret, SupportedKxGroup};
use rustls::{Error, NamedGroup, PeerMisbehaved, ProtocolVersion};
use sm2::Sm2;
use sm2::elliptic_curve::Generate;
use sm2::elliptic_curve::ecdh::EphemeralSecret;
use sm2::elliptic_curve::sec1::ToSec1Point;

/// The group's code point; rustls 0.23 has no named variant for it.
pub const CURVE_SM2_ID: NamedGroup = NamedGroup::Unknown(0x0029);

/// Length of an uncompressed curveSM2 point.
const POINT_LEN: usize = 65;

/// curveSM2 for rustls' `CryptoProvider::kx_groups`.
#[derive(Debug)]
pub struct CurveSm2;

/// The one instance providers point at.
pub static CURVE_SM2: CurveSm2 = CurveSm2;

impl SupportedKxGroup for CurveSm2 {
    fn start(&self) -> Result<Box<dyn ActiveKeyExchange>, Error> {
        let secret =
            EphemeralSecret::<Sm2>::try_generate().map_err(|_| Error::FailedToGetRandomBytes)?;
        let pub_key = secret.public_key().to_sec1_point(false).as_bytes().to_vec();
        Ok(Box::new(ActiveCurveSm2 { secret, pub_key }))
    }

    fn name(&self) -> NamedGroup {
        CURVE_SM2_ID
    }

    /// RFC 8998 §3.1: these algorithms are for TLS 1.3 only.
    fn usable_for_version(&self, version: ProtocolVersion) -> bool {
        version == ProtocolVersion::TLSv1_3
    }
}

struct ActiveCurveSm2 {
    secret: EphemeralSecret<Sm2>,
    pub_key: Vec<u8>,
}

impl ActiveKeyExchange for ActiveCurveSm2 {
    fn complete(self: Box<Self>, peer_pub_key: &[u8]) -> Result<SharedSecret, Error> {
        let peer = parse_key_share(peer_pub_key)?;
        let shared = self.secret.diffie_hellman(&peer);
        Ok(SharedSecret::from(shared.raw_secret_bytes().as_slice()))
    }

    fn pub_key(&self) -> &[u8] {
        &self.pub_key
    }

    fn group(&self) -> NamedGroup {
        CURVE_SM2_ID
    }
}

/// A peer's key share: exactly an uncompressed point that lies on the curve and is not the
/// identity (`PublicKey::from_sec1_bytes` checks both; the length and prefix checks refuse
/// the compressed and hybrid forms RFC 8446 §4.2.8.2 forbids).
pub fn parse_key_share(bytes: &[u8]) -> Result<sm2::PublicKey, Error> {
    if bytes.len() != POINT_LEN || bytes.first() != Some(&0x04) {
        return Err(PeerMisbehaved::InvalidKeyShare.into());
    }
    sm2::PublicKey::from_sec1_bytes(bytes).map_err(|_| PeerMisbehaved::InvalidKeyShare.into())
}

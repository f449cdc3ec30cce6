//! Who is calling: the member or worker identity carried by the verified client
//! certificate of an mTLS connection.
//!
//! # Identity encoding in client certificates
//!
//! A client certificate names exactly one Aether identity in a SAN URI:
//!
//! * `aether://member/<id>` — a clearing member (may call `ClearingService`);
//! * `aether://worker/<id>` — a worker (may call `WorkerService`).
//!
//! `<id>` matches `[a-z0-9][a-z0-9._-]{0,62}`. The subject CN is set to the id too, for
//! people and log tools, but only the SAN URI is authoritative: a CN can be anything a
//! CA was willing to sign, whereas the URI scheme is ours. The certificate itself has
//! already been verified against the CA by rustls before any of this code runs; this
//! module only reads the identity out of it.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock, PoisonError};

use tonic::{Request, Status};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::FromDer;

/// URI scheme prefix of the identity SAN.
pub const IDENTITY_URI_PREFIX: &str = "aether://";

/// Longest id allowed (keeps ids usable as file names and stream ids).
pub const MAX_ID_LEN: usize = 63;

/// What kind of party holds a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A clearing member (bank, broker): submits trades.
    Member,
    /// A worker process: executes the clearing model.
    Worker,
}

impl Role {
    /// The path segment used in the SAN URI (`member` / `worker`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Member => "member",
            Role::Worker => "worker",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "member" => Some(Role::Member),
            "worker" => Some(Role::Worker),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An authenticated caller: role and id from its verified client certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Peer {
    /// Member or worker.
    pub role: Role,
    /// The member or worker id, `[a-z0-9][a-z0-9._-]{0,62}`.
    pub id: String,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.role, self.id)
    }
}

/// Why no identity could be read from a certificate.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    /// The connection carries no client certificate (plain TCP, or TLS without mTLS).
    #[error("no verified client certificate on this connection; connect with mutual TLS")]
    NoCertificate,
    /// The DER could not be parsed as X.509.
    #[error("client certificate is not valid X.509: {0}")]
    Unparsable(String),
    /// No `aether://` SAN URI in the certificate.
    #[error("client certificate carries no aether:// identity SAN URI")]
    NoIdentity,
    /// More than one `aether://` SAN URI: ambiguous, so refused.
    #[error("client certificate carries {0} aether:// identity SAN URIs; exactly one is allowed")]
    AmbiguousIdentity(usize),
    /// The `aether://` URI does not have the form `aether://<member|worker>/<id>`.
    #[error("malformed identity SAN URI {uri:?}: {reason}")]
    Malformed {
        /// The URI as found in the certificate.
        uri: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Why an id is not acceptable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdError {
    /// Empty id.
    #[error("id is empty")]
    Empty,
    /// Longer than [`MAX_ID_LEN`].
    #[error("id {0:?} is longer than 63 characters")]
    TooLong(String),
    /// Character outside the allowed set, or a first character other than `[a-z0-9]`.
    #[error("id {0:?} must match [a-z0-9][a-z0-9._-]{{0,62}}")]
    BadCharacter(String),
}

/// Checks an id against `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn validate_id(id: &str) -> Result<(), IdError> {
    let bytes = id.as_bytes();
    let Some(&first) = bytes.first() else {
        return Err(IdError::Empty);
    };
    if bytes.len() > MAX_ID_LEN {
        return Err(IdError::TooLong(id.to_owned()));
    }
    let lower_alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if !lower_alnum(first)
        || !bytes[1..]
            .iter()
            .all(|&b| lower_alnum(b) || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(IdError::BadCharacter(id.to_owned()));
    }
    Ok(())
}

/// The SAN URI that encodes `role`/`id` in a client certificate.
pub fn identity_uri(role: Role, id: &str) -> String {
    format!("{IDENTITY_URI_PREFIX}{}/{id}", role.as_str())
}

/// Identities of the client certificates seen lately, by their DER bytes. A connection
/// shows the same (already verified) certificate on every request, and parsing its X.509 each
/// time was 2 % of the gateway's CPU under load; the identity is a pure function of the
/// bytes. Only identities are kept, never refusals, and the map is emptied when full.
static KNOWN_PEERS: OnceLock<Mutex<HashMap<Vec<u8>, Peer>>> = OnceLock::new();
const KNOWN_PEERS_AT_MOST: usize = 4_096;

impl Peer {
    /// Reads the identity from a DER-encoded (already verified) client certificate.
    pub fn from_certificate_der(der: &[u8]) -> Result<Peer, IdentityError> {
        let (_, cert) = x509_parser::certificate::X509Certificate::from_der(der)
            .map_err(|e| IdentityError::Unparsable(e.to_string()))?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| IdentityError::Unparsable(e.to_string()))?;
        let uris: Vec<&str> = san
            .iter()
            .flat_map(|ext| ext.value.general_names.iter())
            .filter_map(|name| match name {
                GeneralName::URI(uri) if uri.starts_with(IDENTITY_URI_PREFIX) => Some(*uri),
                _ => None,
            })
            .collect();
        match uris.as_slice() {
            [] => Err(IdentityError::NoIdentity),
            [uri] => Self::from_identity_uri(uri),
            many => Err(IdentityError::AmbiguousIdentity(many.len())),
        }
    }

    /// Parses `aether://<member|worker>/<id>`.
    pub fn from_identity_uri(uri: &str) -> Result<Peer, IdentityError> {
        let malformed = |reason: String| IdentityError::Malformed {
            uri: uri.to_owned(),
            reason,
        };
        let rest = uri
            .strip_prefix(IDENTITY_URI_PREFIX)
            .ok_or_else(|| malformed("does not start with aether://".into()))?;
        let (role, id) = rest
            .split_once('/')
            .ok_or_else(|| malformed("expected aether://<member|worker>/<id>".into()))?;
        let role = Role::parse(role)
            .ok_or_else(|| malformed(format!("unknown role {role:?} (member or worker)")))?;
        validate_id(id).map_err(|e| malformed(e.to_string()))?;
        Ok(Peer {
            role,
            id: id.to_owned(),
        })
    }

    /// The caller of a tonic request, from the leaf of its verified client certificate
    /// chain. Missing or unusable identity is UNAUTHENTICATED.
    pub fn from_request<T>(request: &Request<T>) -> Result<Peer, Status> {
        let certs = request
            .peer_certs()
            .ok_or_else(|| Status::unauthenticated(IdentityError::NoCertificate.to_string()))?;
        let leaf = certs
            .first()
            .ok_or_else(|| Status::unauthenticated(IdentityError::NoCertificate.to_string()))?;
        let der = leaf.as_ref();
        let lock = || {
            KNOWN_PEERS
                .get_or_init(Mutex::default)
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
        };
        if let Some(peer) = lock().get(der) {
            return Ok(peer.clone());
        }
        let peer =
            Peer::from_certificate_der(der).map_err(|e| Status::unauthenticated(e.to_string()))?;
        let mut known = lock();
        if known.len() >= KNOWN_PEERS_AT_MOST {
            known.clear();
        }
        known.insert(der.to_vec(), peer.clone());
        Ok(peer)
    }

    /// Allows a member to act as `claimed_member_id` only if that is its own id.
    /// Per-message check for streaming calls, where each message names its member.
    pub fn authorize_member(&self, claimed_member_id: &str) -> Result<(), Status> {
        match self.role {
            Role::Worker => Err(Status::permission_denied(format!(
                "worker certificate ({self}) may not call the clearing service; use a member certificate"
            ))),
            Role::Member if self.id != claimed_member_id => {
                Err(Status::permission_denied(format!(
                    "member certificate is for {:?} but the request claims member_id {:?}",
                    self.id, claimed_member_id
                )))
            }
            Role::Member => Ok(()),
        }
    }

    /// Allows only worker certificates.
    pub fn authorize_worker(&self) -> Result<(), Status> {
        match self.role {
            Role::Worker => Ok(()),
            Role::Member => Err(Status::permission_denied(format!(
                "member certificate ({self}) may not call the worker service; use a worker certificate"
            ))),
        }
    }
}

/// The calling member, if its certificate is a member certificate for
/// `claimed_member_id`. No certificate / no identity: UNAUTHENTICATED; worker
/// certificate or another member's id: PERMISSION_DENIED.
pub fn require_member<T>(request: &Request<T>, claimed_member_id: &str) -> Result<Peer, Status> {
    let peer = Peer::from_request(request)?;
    peer.authorize_member(claimed_member_id)?;
    Ok(peer)
}

/// The calling worker, if its certificate is a worker certificate. No certificate /
/// no identity: UNAUTHENTICATED; member certificate: PERMISSION_DENIED.
pub fn require_worker<T>(request: &Request<T>) -> Result<Peer, Status> {
    let peer = Peer::from_request(request)?;
    peer.authorize_worker()?;
    Ok(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_the_documented_pattern() {
        for ok in ["a", "bank-a", "0", "b.r_o-k3r", &"x".repeat(63)] {
            assert_eq!(validate_id(ok), Ok(()), "{ok}");
        }
        assert_eq!(validate_id(""), Err(IdError::Empty));
        assert!(matches!(
            validate_id(&"x".repeat(64)),
            Err(IdError::TooLong(_))
        ));
        for bad in ["-a", ".a", "A", "bank a", "bank/a", "bänk"] {
            assert!(
                matches!(validate_id(bad), Err(IdError::BadCharacter(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn identity_uris_round_trip_and_reject_garbage() {
        let uri = identity_uri(Role::Worker, "gpu-1");
        assert_eq!(uri, "aether://worker/gpu-1");
        assert_eq!(
            Peer::from_identity_uri(&uri),
            Ok(Peer {
                role: Role::Worker,
                id: "gpu-1".into()
            })
        );
        for bad in [
            "aether://admin/x",
            "aether://member",
            "aether://member/",
            "aether://member/a/b",
        ] {
            assert!(
                matches!(
                    Peer::from_identity_uri(bad),
                    Err(IdentityError::Malformed { .. })
                ),
                "{bad}"
            );
        }
    }
}

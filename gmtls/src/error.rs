//! The crate's error type: key loading and certificate issuing. Handshake-time failures are
//! `rustls::Error`s, as rustls requires.

/// Why a key could not be loaded or a certificate could not be issued.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The key is well-formed but is not on curveSM2 (or says nothing about its curve).
    #[error("not an SM2 private key: {0}")]
    NotSm2Key(&'static str),
    /// The key's encoding could not be read.
    #[error("malformed private key: {0}")]
    MalformedKey(String),
    /// A PEM text held no block of the expected kind, or a block could not be decoded.
    #[error("PEM: {0}")]
    Pem(String),
    /// DER encoding or decoding of a certificate, name or key failed.
    #[error("DER: {0}")]
    Der(#[from] der::Error),
    /// The X.509 builder refused the certificate.
    #[error("certificate builder: {0}")]
    Builder(#[from] x509_cert::builder::Error),
    /// A name, identity or SAN that the development PKI does not accept.
    #[error("invalid certificate input: {0}")]
    InvalidInput(String),
    /// The operating system's random source failed.
    #[error("random source: {0}")]
    Random(String),
    /// SM2 signing failed (practically unreachable: a zero-probability scalar).
    #[error("SM2 signing failed")]
    Signing,
}

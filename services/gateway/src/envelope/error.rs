//! Why an envelope was refused. Each message is precise enough for the member to fix its
//! client, and none carries key material.

/// Every way the envelope refuses input or fails.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("x-sm4-key is not standard base64 with padding")]
    BadBase64,
    #[error(
        "wrapped SM4 key is {0} bytes; it must be 113 (SM2 C1C3C2: 65-byte uncompressed C1, 32-byte C3, 16-byte C2)"
    )]
    WrappedKeyLength(usize),
    #[error(
        "SM2 decryption of the wrapped SM4 key failed: it was encrypted to another server key, or corrupted"
    )]
    KeyUnwrap,
    #[error("nonce is {0} bytes; it must be 12")]
    NonceLength(usize),
    #[error("ciphertext is {0} bytes, shorter than the 16-byte SM4-GCM tag")]
    Truncated(usize),
    #[error(
        "SM4-GCM authentication failed: wrong key, altered nonce or ciphertext, or different AAD fields (method, request id, member id, key id, issued_at)"
    )]
    Authentication,
    #[error("payload is {len} bytes, over the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("AAD field {field} is {len} bytes, over the {max}-byte limit")]
    AadFieldTooLong {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("unknown envelope key id; send a new KeyExchange")]
    UnknownKeyId,
    #[error("envelope key expired at {expired_at} (unix seconds); send a new KeyExchange")]
    KeyExpired { expired_at: u64 },
    #[error("envelope key has been used {max_uses} times, its limit; send a new KeyExchange")]
    KeyExhausted { max_uses: u64 },
    #[error("nonce was already used with this key: replay refused")]
    Replayed,
    #[error(
        "issued_at {issued_at} is more than {max_age} s from server time {now} (unix seconds); check the client clock"
    )]
    Stale {
        issued_at: u64,
        now: u64,
        max_age: u64,
    },
    #[error("per-request replay cache is full; retry shortly or use a session key")]
    ReplayCacheFull,
    #[error(
        "the gateway's session key table is full ({sessions} keys of other members); retry shortly or use per-request keys"
    )]
    SessionTableFull { sessions: usize },
    #[error("server envelope key: {0}")]
    ServerKey(String),
    #[error("the operating system's random generator failed")]
    Random,
}

/// How the gateway should answer an error; keeps this module free of gRPC types.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The envelope does not authenticate the caller's payload: gRPC `UNAUTHENTICATED`.
    Unauthenticated,
    /// Malformed request fields outside the cryptography: gRPC `INVALID_ARGUMENT`.
    InvalidArgument,
    /// A limit was reached; retrying later may succeed: gRPC `RESOURCE_EXHAUSTED`.
    ResourceExhausted,
    /// The server's own fault: gRPC `INTERNAL`; do not show the message to members.
    Internal,
}

impl EnvelopeError {
    pub fn kind(&self) -> ErrorKind {
        use EnvelopeError::*;
        match self {
            BadBase64
            | WrappedKeyLength(_)
            | KeyUnwrap
            | NonceLength(_)
            | Truncated(_)
            | Authentication
            | UnknownKeyId
            | KeyExpired { .. }
            | KeyExhausted { .. }
            | Replayed
            | Stale { .. } => ErrorKind::Unauthenticated,
            AadFieldTooLong { .. } => ErrorKind::InvalidArgument,
            TooLarge { .. } | ReplayCacheFull | SessionTableFull { .. } => {
                ErrorKind::ResourceExhausted
            }
            ServerKey(_) | Random => ErrorKind::Internal,
        }
    }
}

//! Errors the ledger reports. Input errors name the offending value; nothing is written.

use uuid::Uuid;

use crate::expected_version::ExpectedVersion;

/// The SQLSTATE the database raises for an event whose fence is stale (a lease holder
/// that lost its lease; see `cluster`).
pub const FENCED_SQLSTATE: &str = "AE001";

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("invalid stream id {stream_id:?}: {reason}")]
    InvalidStreamId { stream_id: String, reason: String },

    #[error(
        "invalid event type {event_type:?}: expected 1-128 ASCII letters, digits, '.', '_' or '-', starting with a letter"
    )]
    InvalidEventType { event_type: String },

    #[error("{field} must be a JSON object, got {found}")]
    NotAnObject {
        field: &'static str,
        found: &'static str,
    },

    #[error("{field} is {size} bytes in canonical form, over the limit of {limit} bytes")]
    TooLarge {
        field: &'static str,
        size: usize,
        limit: usize,
    },

    #[error(
        "{field} number {number} at {path} cannot be represented exactly in RFC 8785 (|n| > 2^53 - 1); send it as a string"
    )]
    InexactNumber {
        field: &'static str,
        path: String,
        number: String,
    },

    #[error("{field} text at {path} contains U+0000, which the ledger's databases cannot store")]
    UnstorableText { field: &'static str, path: String },

    #[error("schema_version {schema_version} is out of range: the ledger stores 0 to 2147483647")]
    SchemaVersionOutOfRange { schema_version: u32 },

    #[error(
        "payload object at {path} has a \"$personal\" member: that name is reserved for the ledger's commitments to personal values; send personal values in \"personal\""
    )]
    ImitatedPlaceholder { path: String },

    #[error("payload member {member:?} is given both as a public and as a personal field")]
    PersonalConflict { member: String },

    #[error("personal member {member:?} is not a name or a dotted path of non-empty names")]
    InvalidPersonalPath { member: String },

    #[error("event {event_id} has no personal field {member:?}")]
    NoSuchPersonalField { event_id: Uuid, member: String },

    #[error("invalid filter: {0}")]
    InvalidFilter(String),

    #[error("an append must carry at least one event")]
    EmptyAppend,

    #[error("an append carries {count} events, more than the limit of {limit} per call; split it")]
    TooManyEvents { count: usize, limit: usize },

    #[error("stream {stream_id:?} appears twice in one atomic append; merge its events")]
    DuplicateStream { stream_id: String },

    #[error(
        "wrong expected version for stream {stream_id:?}: expected {expected}, actual {actual}"
    )]
    WrongExpectedVersion {
        stream_id: String,
        expected: ExpectedVersion,
        actual: u64,
    },

    #[error("event id {event_id} is already in the ledger")]
    DuplicateEventId { event_id: Uuid },

    #[error("cannot canonicalize JSON: {0}")]
    Canonicalization(String),

    #[error("the database failed the commit: {0}")]
    CommitFailed(String),

    #[error("the ledger writer has shut down; the append was not recorded")]
    WriterClosed,

    #[error("the ledger writer's queue is full; retry later")]
    Overloaded,

    #[error("stored event at seq {seq} is unreadable: {reason}")]
    CorruptRow { seq: i64, reason: String },

    #[error(
        "the ledger ends at seq {head}, but {witness} has already seen seq {seen}: its newest events were deleted, or it was restored from an older backup; nothing was written. Run `aether verify --since-checkpoint` with a checkpoint you trust, and restore the missing events, or (if the restore was intended) move that witness aside"
    )]
    Truncated {
        head: u64,
        witness: String,
        seen: u64,
    },

    #[error("{0}")]
    Fenced(String),

    #[error("the database refused the event: {0}")]
    RowRefused(String),

    #[error("a decision for this request id is already recorded ({detail}); one per request id")]
    RequestIdTaken { detail: String },

    #[error("leases need the PostgreSQL ledger; SQLite is a single node")]
    LeasesNeedPostgres,

    #[error("the Merkle log's file: {0}")]
    MerkleFile(String),

    #[error("checkpoint key: {0}")]
    CheckpointKey(String),

    #[error(
        "the ledger's checkpoints are now signed by the key with fingerprint {in_force}, not by this node's (fingerprint {own}): the key was rotated; restart this node with the cluster's key (--checkpoint-key)"
    )]
    CheckpointKeyRetired { in_force: String, own: String },

    #[error("database: {0}")]
    Database(#[from] sqlx::Error),

    #[error("migrations: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),

    #[error("unsupported database URL {0:?}: use postgres://... or sqlite:...")]
    UnsupportedUrl(String),

    #[error(
        "none of the PostgreSQL hosts {0} is a reachable primary (each is down or in recovery)"
    )]
    NoPrimary(String),
}

impl LedgerError {
    /// True for errors caused by the caller's input (as opposed to the ledger's state).
    pub fn is_input_error(&self) -> bool {
        matches!(
            self,
            LedgerError::InvalidStreamId { .. }
                | LedgerError::InvalidEventType { .. }
                | LedgerError::NotAnObject { .. }
                | LedgerError::TooLarge { .. }
                | LedgerError::InexactNumber { .. }
                | LedgerError::UnstorableText { .. }
                | LedgerError::SchemaVersionOutOfRange { .. }
                | LedgerError::ImitatedPlaceholder { .. }
                | LedgerError::RowRefused(_)
                | LedgerError::EmptyAppend
                | LedgerError::TooManyEvents { .. }
                | LedgerError::DuplicateStream { .. }
                | LedgerError::InvalidFilter(_)
                | LedgerError::PersonalConflict { .. }
                | LedgerError::InvalidPersonalPath { .. }
        )
    }

    /// True when the database could not be reached or did not answer in time: the call
    /// may succeed if made again shortly, and nothing was written.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            LedgerError::Database(
                sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed
            ) | LedgerError::CommitFailed(_)
        )
    }

    /// True when the append lost an optimistic-concurrency or uniqueness race.
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            LedgerError::WrongExpectedVersion { .. }
                | LedgerError::DuplicateEventId { .. }
                | LedgerError::RequestIdTaken { .. }
        )
    }
}

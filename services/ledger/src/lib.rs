//! Aether's event ledger.
//!
//! Every change to the clearing engine and every clearing decision is an [`event`] with a
//! global, gapless `seq`, chained by SM3 ([`hashing`]), logged in an RFC 6962-style Merkle
//! tree ([`merkle`]) whose heads are signed with SM2 ([`checkpoint`]). [`EventStore`] is the
//! only writer of the event tables, on PostgreSQL or SQLite, through one group-commit
//! writer per store. This crate knows nothing of HTTP, gRPC, lineage or the domain.

pub mod checkpoint;
pub mod checkpointer;
pub mod cluster;
pub mod error;
pub mod event;
mod expected_version;
pub mod hashing;
mod jcs;
pub mod key_rotation;
pub mod merkle;
mod merkle_file;
pub mod merkle_log;
pub mod personal;
pub mod pg_binary;
mod retrying;
pub mod sm3_lanes;
mod store;
pub mod subscription;
mod tail;
#[cfg(feature = "testing")]
pub mod testing;
pub mod verify;
mod writer;

pub use checkpoint::{CheckpointSigner, CheckpointVerifier, SignedCheckpoint};
pub use checkpointer::{CheckpointPolicy, run_checkpointer};
pub use error::LedgerError;
pub use event::{
    Committed, ExpectedVersion, MAX_EVENT_TYPE_BYTES, MAX_SCHEMA_VERSION, NewEvent, RecordedEvent,
};
pub use hashing::Hash;
pub use merkle_log::MerkleLog;
pub use store::{
    AppendToStream, Direction, EventFilter, EventStore, FILTERABLE_METADATA, MAX_LOOKUP_VALUES,
    MetadataLookup, PreparedAppend, PreparedEvent, SQLITE_WAL_AUTOCHECKPOINT, StoreConfig,
    redact_url, sqlite_options,
};
pub use subscription::Subscription;
pub use verify::{
    ChainVerifier, Problem, TrustedAnchor, VerifyFailure, VerifyReport, verify_store,
    verify_store_anchored,
};

//! Aether's regulator side.
//!
//! - [`bundle`] — evidence bundles: ledger events with their hashed fields, inclusion
//!   proofs, signed checkpoints and consistency proofs, as one JSON document (`BUNDLE.md`).
//! - [`offline`] — the verifier of a bundle, which needs no service, database or network.
//! - [`redaction`] — how personal fields appear in audit answers (`REDACTION.md`).
//!
//! All are pure apart from reading and writing a bundle from or to bytes or a file.

pub mod bundle;
pub mod offline;
pub mod redaction;

pub use bundle::{
    Bundle, BundleError, BundleEvent, ConsistencyProof, EventWriter, FORMAT, ReadLimits,
};
pub use offline::{
    Problem, ProblemKind, Verdict, key_fingerprint, verify_bundle, verify_bundle_file,
    verify_bundle_with_progress,
};
pub use redaction::{Erasure, FieldStatus, PersonalStatus, Presented, RedactionPolicy, present};

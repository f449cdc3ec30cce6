//! What a stream is expected to be at when an append is checked: the ledger's optimistic
//! concurrency, named in appends and in the error a stale expectation gets.

use serde::{Deserialize, Serialize};

/// What a stream is expected to be at when an append is checked (optimistic concurrency).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "version")]
pub enum ExpectedVersion {
    /// Append whatever the stream's version.
    Any,
    /// The stream must not exist yet (its version is 0).
    NoStream,
    /// The stream must already have at least one event.
    StreamExists,
    /// The stream's last event must have exactly this version.
    Exact(u64),
}

impl ExpectedVersion {
    /// Whether a stream currently at `actual` (0 = no stream) satisfies this expectation.
    pub fn admits(self, actual: u64) -> bool {
        match self {
            ExpectedVersion::Any => true,
            ExpectedVersion::NoStream => actual == 0,
            ExpectedVersion::StreamExists => actual > 0,
            ExpectedVersion::Exact(v) => actual == v,
        }
    }
}

impl std::fmt::Display for ExpectedVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpectedVersion::Any => f.write_str("any"),
            ExpectedVersion::NoStream => f.write_str("no stream"),
            ExpectedVersion::StreamExists => f.write_str("stream exists"),
            ExpectedVersion::Exact(v) => write!(f, "{v}"),
        }
    }
}

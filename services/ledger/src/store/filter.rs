//! Filtered reads for auditors: by time, type, stream prefix and metadata members.

use chrono::{DateTime, Utc};

use crate::error::LedgerError;

/// Metadata members that a filter may test (what Aether writes into event metadata).
pub const FILTERABLE_METADATA: &[&str] = &[
    "actor",
    "trace_id",
    "member",
    "snapshot_id",
    "request_id",
    "model_stage",
    "tenant",
    "correlation_id",
    "causation_id",
];

/// Which events to return; every given condition must hold. Results come in seq order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// Recorded at or after.
    pub from: Option<DateTime<Utc>>,
    /// Recorded before.
    pub to: Option<DateTime<Utc>>,
    pub event_type: Option<String>,
    /// Stream ids starting with this (e.g. `clearing/`).
    pub stream_prefix: Option<String>,
    /// `(member, value)`: metadata member equals the string value.
    pub metadata: Vec<(String, String)>,
}

impl EventFilter {
    /// Checks the metadata member names against [`FILTERABLE_METADATA`].
    pub fn validate(&self) -> Result<(), LedgerError> {
        for (key, _) in &self.metadata {
            if !FILTERABLE_METADATA.contains(&key.as_str()) {
                return Err(LedgerError::InvalidFilter(format!(
                    "metadata member {key:?} cannot be filtered on; use one of {}",
                    FILTERABLE_METADATA.join(", ")
                )));
            }
        }
        if let (Some(from), Some(to)) = (self.from, self.to)
            && from > to
        {
            return Err(LedgerError::InvalidFilter(format!(
                "time range is empty: from {from} is after to {to}"
            )));
        }
        Ok(())
    }
}

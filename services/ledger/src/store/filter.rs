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
    /// Stream ids starting with this (e.g. `clearing/`). A prefix naming a whole category
    /// (`engine/`: no other `/`) is read from the category index, so its cost follows the
    /// matching events rather than the ledger's size.
    pub stream_prefix: Option<String>,
    /// `(member, value)`: metadata member equals the string value.
    pub metadata: Vec<(String, String)>,
    /// Seq at most: the ledger as it stood after this event (time travel).
    pub max_seq: Option<u64>,
}

impl EventFilter {
    /// The category (`engine` for `engine/`) when the prefix names a whole one. A stream's
    /// category is its id up to the first `/` (all of it when there is none).
    pub(crate) fn category(&self) -> Option<&str> {
        let category = self.stream_prefix.as_deref()?.strip_suffix('/')?;
        (!category.is_empty() && !category.contains('/')).then_some(category)
    }

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

/// Whether `value` appears verbatim in the canonical (RFC 8785) metadata text of an event
/// whose metadata member equals it: true unless it holds a character that RFC 8785 escapes
/// (`"`, `\\`, a control character). Then a plain substring search may go first, cheaply
/// ruling out most rows before the JSON member is read (a rare actor among a million events:
/// the JSON alone is read from every row).
pub(crate) fn verbatim_in_metadata(value: &str) -> bool {
    !value.is_empty() && !value.chars().any(|c| c == '"' || c == '\\' || c < ' ')
}

#[cfg(test)]
mod verbatim_tests {
    use super::verbatim_in_metadata;
    use proptest::prelude::*;

    proptest! {
        /// The substring search never rules out a row that matches: a value it is used for
        /// appears as it is in the canonical text of any metadata holding it.
        #[test]
        fn a_verbatim_value_is_in_the_canonical_text(value in any::<String>(), other in any::<String>()) {
            let metadata = serde_json::json!({ "actor": value, "trace_id": other });
            if verbatim_in_metadata(&value) {
                prop_assert!(crate::jcs::to_string(&metadata).contains(value.as_str()));
            }
        }
    }

    #[test]
    fn escaped_characters_are_not_searched_verbatim() {
        assert!(verbatim_in_metadata("aether:rollout-controller"));
        assert!(verbatim_in_metadata("café ✓ / <>"));
        for value in ["", "a\"b", "a\\b", "a\nb", "\u{1}"] {
            assert!(!verbatim_in_metadata(value), "{value:?}");
        }
    }
}

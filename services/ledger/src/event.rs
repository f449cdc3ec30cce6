//! The ledger's event: what callers hand in ([`NewEvent`]) and what the ledger hands back
//! ([`RecordedEvent`]), with the input rules that keep every stored event hashable and readable.

use chrono::{DateTime, SubsecRound, Utc};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

use crate::error::LedgerError;
pub use crate::expected_version::ExpectedVersion;
use crate::hashing::{self, Hash};

/// Longest stream id accepted, in bytes. Stream ids are keys in indexes and URLs.
pub const MAX_STREAM_ID_BYTES: usize = 256;
/// Longest event type accepted, in bytes.
pub const MAX_EVENT_TYPE_BYTES: usize = 128;
/// Default largest canonical payload, in bytes (1 MiB).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;
/// Largest canonical metadata object, in bytes. Metadata is for ids and tags, not data.
pub const MAX_METADATA_BYTES: usize = 64 * 1024;
/// Largest integer magnitude that RFC 8785 (IEEE-754 doubles) can carry exactly.
const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;
/// Largest schema version: both databases store it as a 32-bit signed integer, and a value
/// the database would change could never re-hash to what was answered.
pub const MAX_SCHEMA_VERSION: u32 = i32::MAX as u32;

/// An event as a caller proposes it. The ledger assigns position, time and hashes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NewEvent {
    /// Caller-chosen id (UUIDv7 generated when absent); unique across the ledger.
    #[serde(default)]
    pub event_id: Option<Uuid>,
    pub event_type: String,
    #[serde(default = "default_schema_version")]
    pub schema_version: u32,
    pub payload: serde_json::Value,
    /// Actor, trace id, causation / correlation ids, snapshot id, request id, tenant tag.
    #[serde(default = "empty_object")]
    pub metadata: serde_json::Value,
    /// Payload members that are personal data: hashed only as salted commitments and kept
    /// beside the chain so that they can be erased (see [`crate::personal`]).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub personal: serde_json::Map<String, serde_json::Value>,
}

fn default_schema_version() -> u32 {
    1
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

impl NewEvent {
    /// An event of `event_type` (schema version 1) with this payload and no metadata.
    pub fn new(event_type: impl Into<String>, payload: serde_json::Value) -> Self {
        NewEvent {
            event_id: None,
            event_type: event_type.into(),
            schema_version: 1,
            payload,
            metadata: empty_object(),
            personal: serde_json::Map::new(),
        }
    }

    /// Adds payload members that are personal data (erasable; see [`crate::personal`]).
    pub fn with_personal(mut self, personal: serde_json::Map<String, serde_json::Value>) -> Self {
        self.personal = personal;
        self
    }

    pub fn with_metadata(mut self, metadata: serde_json::Value) -> Self {
        self.metadata = metadata;
        self
    }

    pub fn with_event_id(mut self, event_id: Uuid) -> Self {
        self.event_id = Some(event_id);
        self
    }

    pub fn with_schema_version(mut self, schema_version: u32) -> Self {
        self.schema_version = schema_version;
        self
    }
}

/// An event after validation: canonical JSON text fixed, id assigned. Ready for the writer.
#[derive(Clone, Debug)]
pub(crate) struct ValidEvent {
    pub event_id: Uuid,
    pub event_type: String,
    pub schema_version: u32,
    pub payload: String,
    pub metadata: String,
    pub personal: Vec<crate::personal::PersonalField>,
}

/// Checks a stream id: 1..=256 bytes, no control characters, no surrounding whitespace.
pub fn validate_stream_id(stream_id: &str) -> Result<(), LedgerError> {
    let reason = if stream_id.is_empty() {
        Some("must not be empty".to_string())
    } else if stream_id.len() > MAX_STREAM_ID_BYTES {
        Some(format!(
            "is {} bytes, longer than the limit of {MAX_STREAM_ID_BYTES}",
            stream_id.len()
        ))
    } else if let Some((at, c)) = stream_id.char_indices().find(|(_, c)| c.is_control()) {
        Some(format!(
            "contains control character U+{:04X} at byte {at}",
            c as u32
        ))
    } else if stream_id.trim() != stream_id {
        Some("must not start or end with whitespace".to_string())
    } else {
        None
    };
    match reason {
        Some(reason) => Err(LedgerError::InvalidStreamId {
            stream_id: printable(stream_id),
            reason,
        }),
        None => Ok(()),
    }
}

/// Checks an event type: 1..=128 ASCII letters, digits, `.`, `_` or `-`, starting with a letter.
pub fn validate_event_type(event_type: &str) -> Result<(), LedgerError> {
    let ok = !event_type.is_empty()
        && event_type.len() <= MAX_EVENT_TYPE_BYTES
        && event_type.starts_with(|c: char| c.is_ascii_alphabetic())
        && event_type
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(LedgerError::InvalidEventType {
            event_type: printable(event_type),
        })
    }
}

/// A short, escaped rendering of caller input for error messages.
fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(80).flat_map(char::escape_debug).collect();
    if s.chars().count() > 80 {
        out.push('…');
    }
    out
}

impl NewEvent {
    /// Runs the checks an append makes of this event before the ledger takes it (type,
    /// schema version, payload and metadata storable, sizes), without appending: for the
    /// fuzz targets (`fuzz/`), which run them on arbitrary request bodies.
    pub fn check(&self, max_payload_bytes: usize) -> Result<(), LedgerError> {
        self.clone().validate(max_payload_bytes).map(|_| ())
    }

    pub(crate) fn validate(mut self, max_payload_bytes: usize) -> Result<ValidEvent, LedgerError> {
        validate_event_type(&self.event_type)?;
        if self.schema_version > MAX_SCHEMA_VERSION {
            return Err(LedgerError::SchemaVersionOutOfRange {
                schema_version: self.schema_version,
            });
        }
        if !self.personal.values().all(storable) {
            check_values(
                "personal",
                &serde_json::Value::Object(self.personal.clone()),
                &mut String::from("$"),
            )?;
        }
        if let Some(path) = placeholder_path(&self.payload, &mut String::from("$")) {
            return Err(LedgerError::ImitatedPlaceholder { path });
        }
        let personal =
            crate::personal::seal(&mut self.payload, std::mem::take(&mut self.personal))?;
        let payload = canonical_object("payload", &self.payload, max_payload_bytes)?;
        let metadata = canonical_object("metadata", &self.metadata, MAX_METADATA_BYTES)?;
        Ok(ValidEvent {
            event_id: self.event_id.unwrap_or_else(Uuid::now_v7),
            event_type: self.event_type,
            schema_version: self.schema_version,
            payload,
            metadata,
            personal,
        })
    }
}

/// The path of the first object in a caller's payload that has a `$personal` member: only the
/// ledger writes such placeholders (for the members it seals), so one from outside would pass
/// for a redactable value that no commitment backs.
fn placeholder_path(value: &serde_json::Value, path: &mut String) -> Option<String> {
    match value {
        serde_json::Value::Object(map) => {
            if map.contains_key(crate::personal::PLACEHOLDER_KEY) {
                return Some(path.clone());
            }
            map.iter().find_map(|(k, item)| {
                let len = path.len();
                path.push('.');
                path.push_str(k);
                let found = placeholder_path(item, path);
                path.truncate(len);
                found
            })
        }
        serde_json::Value::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            let len = path.len();
            path.push_str(&format!("[{i}]"));
            let found = placeholder_path(item, path);
            path.truncate(len);
            found
        }),
        _ => None,
    }
}

/// RFC 8785 text of a JSON object, after checking it is an object, its numbers are exact
/// in IEEE-754 and it fits the limit.
fn canonical_object(
    field: &'static str,
    value: &serde_json::Value,
    limit: usize,
) -> Result<String, LedgerError> {
    if !value.is_object() {
        return Err(LedgerError::NotAnObject {
            field,
            found: json_kind(value),
        });
    }
    if !storable(value) {
        check_values(field, value, &mut String::from("$"))?;
    }
    let text = hashing::canonical_json(value)?;
    if text.len() > limit {
        return Err(LedgerError::TooLarge {
            field,
            size: text.len(),
            limit,
        });
    }
    Ok(text)
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Whether every number in `value` is one RFC 8785 keeps exact and every string (member
/// names too) is one both databases store unchanged. The common case, checked without
/// building the paths that only an error needs (they were an allocation per array element
/// on every append).
fn storable(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Number(n) => !inexact(n),
        serde_json::Value::String(s) => !s.contains('\0'),
        serde_json::Value::Array(items) => items.iter().all(storable),
        serde_json::Value::Object(map) => map
            .iter()
            .all(|(k, item)| !k.contains('\0') && storable(item)),
        _ => true,
    }
}

/// A number whose magnitude passes 2^53 − 1, whatever its form: an integer (`2^64` too, which
/// JSON parsers hold as a double) or a double such as `1e16` (every double that large is an
/// integer, and RFC 8785 would write it as digits that a verifier must refuse).
fn inexact(n: &serde_json::Number) -> bool {
    match (n.as_u64(), n.as_i64(), n.as_f64()) {
        (Some(u), _, _) => u > MAX_SAFE_INTEGER,
        (None, Some(i), _) => i.unsigned_abs() > MAX_SAFE_INTEGER,
        (None, None, Some(f)) => f.abs() > MAX_SAFE_INTEGER as f64,
        (None, None, None) => false,
    }
}

/// Rejects numbers that RFC 8785 would silently round (|n| > 2^53 − 1: send them as strings)
/// and text the databases cannot store (U+0000: PostgreSQL's JSON refuses it, and one such
/// value would fail every other append committed with it). The error names the first one's
/// path.
fn check_values(
    field: &'static str,
    value: &serde_json::Value,
    path: &mut String,
) -> Result<(), LedgerError> {
    match value {
        serde_json::Value::Number(n) if inexact(n) => {
            return Err(LedgerError::InexactNumber {
                field,
                path: path.clone(),
                number: n.to_string(),
            });
        }
        serde_json::Value::String(s) if s.contains('\0') => {
            return Err(LedgerError::UnstorableText {
                field,
                path: path.clone(),
            });
        }
        serde_json::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                check_values(field, item, path)?;
                path.truncate(len);
            }
        }
        serde_json::Value::Object(map) => {
            for (k, item) in map {
                let len = path.len();
                path.push('.');
                path.push_str(&k.replace('\0', "\\u0000"));
                if k.contains('\0') {
                    return Err(LedgerError::UnstorableText {
                        field,
                        path: path.clone(),
                    });
                }
                check_values(field, item, path)?;
                path.truncate(len);
            }
        }
        _ => {}
    }
    Ok(())
}

/// An event as committed: position, time and chain hashes fixed forever.
#[derive(Clone, Debug, Serialize)]
pub struct RecordedEvent {
    pub seq: u64,
    pub stream_id: String,
    pub stream_version: u64,
    pub event_id: Uuid,
    pub event_type: String,
    pub schema_version: u32,
    /// RFC 8785 canonical JSON text, exactly the bytes that were hashed.
    pub payload: Box<RawValue>,
    /// RFC 8785 canonical JSON text, exactly the bytes that were hashed.
    pub metadata: Box<RawValue>,
    #[serde(serialize_with = "hashing::serialize_timestamp")]
    pub recorded_at: DateTime<Utc>,
    #[serde(with = "hashing::hex_hash")]
    pub prev_hash: Hash,
    #[serde(with = "hashing::hex_hash")]
    pub hash: Hash,
}

impl RecordedEvent {
    /// The payload parsed as a JSON value.
    pub fn payload_value(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(self.payload.get())
    }

    /// The metadata parsed as a JSON value.
    pub fn metadata_value(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(self.metadata.get())
    }

    /// Recomputes this event's hash from its fields and `prev_hash` (HASHING.md).
    pub fn computed_hash(&self) -> Hash {
        hashing::event_hash(&self.prev_hash, &self.hashed_fields())
    }

    pub fn hashed_fields(&self) -> hashing::HashedFields<'_> {
        hashing::HashedFields {
            seq: self.seq,
            stream_id: &self.stream_id,
            stream_version: self.stream_version,
            event_id: self.event_id,
            event_type: &self.event_type,
            schema_version: self.schema_version,
            payload: self.payload.get(),
            metadata: self.metadata.get(),
            recorded_at: self.recorded_at,
        }
    }
}

/// Where one appended event landed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Committed {
    pub seq: u64,
    pub stream_id: String,
    pub stream_version: u64,
    pub event_id: Uuid,
    #[serde(with = "hashing::hex_hash")]
    pub hash: Hash,
    #[serde(serialize_with = "hashing::serialize_timestamp")]
    pub recorded_at: DateTime<Utc>,
}

/// Ledger time has microsecond resolution in both databases.
pub(crate) fn ledger_now() -> DateTime<Utc> {
    Utc::now().trunc_subsecs(6)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn json_value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i64>().prop_map(|n| serde_json::json!(n)),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| serde_json::json!(f)),
            "\\PC{0,12}".prop_map(serde_json::Value::String),
            any::<String>().prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                prop::collection::btree_map("\\PC{0,8}", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Any JSON value is either refused with an input error or stored as canonical text
        /// that is a fixed point: parsing and re-canonicalizing gives the same bytes, so a
        /// verifier that re-parses computes the same hash.
        #[test]
        fn validation_never_panics_and_canonical_text_is_stable(payload in json_value(), metadata in json_value()) {
            let event = NewEvent { event_id: None, event_type: "E".into(), schema_version: 1, payload: payload.clone(), metadata, personal: Default::default() };
            match event.validate(DEFAULT_MAX_PAYLOAD_BYTES) {
                Ok(valid) => {
                    prop_assert!(payload.is_object());
                    for text in [&valid.payload, &valid.metadata] {
                        let reparsed: serde_json::Value = serde_json::from_str(text).unwrap();
                        prop_assert_eq!(&hashing::canonical_json(&reparsed).unwrap(), text);
                    }
                }
                Err(e) => prop_assert!(e.is_input_error(), "{e}"),
            }
        }

        /// Stream ids are accepted exactly when they are 1..=256 bytes without control
        /// characters or surrounding whitespace.
        #[test]
        fn stream_id_rules(id in any::<String>()) {
            let ok = !id.is_empty() && id.len() <= MAX_STREAM_ID_BYTES
                && !id.chars().any(char::is_control) && id.trim() == id;
            prop_assert_eq!(validate_stream_id(&id).is_ok(), ok);
        }
    }

    #[test]
    fn expected_version_admits() {
        assert!(ExpectedVersion::Any.admits(0) && ExpectedVersion::Any.admits(9));
        assert!(ExpectedVersion::NoStream.admits(0) && !ExpectedVersion::NoStream.admits(1));
        assert!(
            !ExpectedVersion::StreamExists.admits(0) && ExpectedVersion::StreamExists.admits(1)
        );
        assert!(ExpectedVersion::Exact(3).admits(3) && !ExpectedVersion::Exact(3).admits(2));
    }
}

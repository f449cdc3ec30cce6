//! Canonical bytes and SM3 hashes of events, exactly as written down in `HASHING.md`.
//!
//! Pure functions, no I/O: the offline verifier and independent tools rely on them.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serializer;
use sm3::{Digest, Sm3};
use uuid::Uuid;

use crate::error::LedgerError;

/// A 32-byte SM3 digest.
pub type Hash = [u8; 32];

/// Domain-separation tag prefixed to every event hash input.
pub const EVENT_HASH_TAG: &[u8] = b"aether.event.v1";

/// `prev_hash` of the first event (seq 1).
pub const GENESIS_PREV_HASH: Hash = [0u8; 32];

/// SM3 over a single byte string.
pub fn sm3(data: &[u8]) -> Hash {
    Sm3::digest(data).into()
}

/// RFC 8785 (JCS) text of a JSON value.
pub fn canonical_json(value: &serde_json::Value) -> Result<String, LedgerError> {
    serde_jcs::to_string(value).map_err(|e| LedgerError::Canonicalization(e.to_string()))
}

/// The fields an event hash covers, borrowed from wherever they live.
#[derive(Clone, Copy, Debug)]
pub struct HashedFields<'a> {
    pub seq: u64,
    pub stream_id: &'a str,
    pub stream_version: u64,
    pub event_id: Uuid,
    pub event_type: &'a str,
    pub schema_version: u32,
    /// RFC 8785 text of the payload object.
    pub payload: &'a str,
    /// RFC 8785 text of the metadata object.
    pub metadata: &'a str,
    pub recorded_at: DateTime<Utc>,
}

/// `recorded_at` as hashed: RFC 3339, UTC, `Z`, exactly six fractional digits.
pub fn format_timestamp(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Serde helper writing a timestamp the way it is hashed.
pub fn serialize_timestamp<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_timestamp(t))
}

/// The RFC 8785 text of the event object `{event_id, event_type, metadata, payload,
/// recorded_at, schema_version, seq, stream_id, stream_version}`.
///
/// The members are written in JCS order directly; `payload` and `metadata` are already
/// canonical, so nothing is parsed again (this is the verifier's hot path).
pub fn canonical_event_bytes(f: &HashedFields<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(f.payload.len() + f.metadata.len() + 256);
    out.extend_from_slice(b"{\"event_id\":\"");
    out.extend_from_slice(f.event_id.hyphenated().to_string().as_bytes());
    out.extend_from_slice(b"\",\"event_type\":");
    push_json_string(&mut out, f.event_type);
    out.extend_from_slice(b",\"metadata\":");
    out.extend_from_slice(f.metadata.as_bytes());
    out.extend_from_slice(b",\"payload\":");
    out.extend_from_slice(f.payload.as_bytes());
    out.extend_from_slice(b",\"recorded_at\":\"");
    out.extend_from_slice(format_timestamp(&f.recorded_at).as_bytes());
    out.extend_from_slice(b"\",\"schema_version\":");
    out.extend_from_slice(f.schema_version.to_string().as_bytes());
    out.extend_from_slice(b",\"seq\":");
    out.extend_from_slice(f.seq.to_string().as_bytes());
    out.extend_from_slice(b",\"stream_id\":");
    push_json_string(&mut out, f.stream_id);
    out.extend_from_slice(b",\"stream_version\":");
    out.extend_from_slice(f.stream_version.to_string().as_bytes());
    out.push(b'}');
    out
}

/// Writes a JSON string with RFC 8785 escaping (that of ECMAScript `JSON.stringify`).
fn push_json_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                out.extend_from_slice(format!("\\u{:04x}", c as u32).as_bytes())
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// `SM3("aether.event.v1" ‖ prev_hash ‖ canonical_event_bytes)`.
pub fn event_hash(prev_hash: &Hash, fields: &HashedFields<'_>) -> Hash {
    let mut h = Sm3::new();
    h.update(EVENT_HASH_TAG);
    h.update(prev_hash);
    h.update(canonical_event_bytes(fields));
    h.finalize().into()
}

/// Serde helpers for hashes as lowercase hex.
pub mod hex_hash {
    use super::Hash;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(h: &Hash, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(h))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Hash, D::Error> {
        let s = String::deserialize(d)?;
        parse(&s).map_err(D::Error::custom)
    }

    /// Parses 64 hex digits into a hash.
    pub fn parse(s: &str) -> Result<Hash, String> {
        let bytes = hex::decode(s).map_err(|e| format!("not hex: {e}"))?;
        bytes
            .try_into()
            .map_err(|b: Vec<u8>| format!("expected 32 bytes, got {}", b.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use serde_json::json;

    /// The worked examples in HASHING.md, checked against the document's own text.
    struct Example {
        prev_hash: Hash,
        seq: u64,
        stream_id: &'static str,
        stream_version: u64,
        event_id: &'static str,
        event_type: &'static str,
        payload: serde_json::Value,
        metadata: serde_json::Value,
        recorded_at: DateTime<Utc>,
    }

    fn examples() -> Vec<Example> {
        vec![
            Example {
                prev_hash: GENESIS_PREV_HASH,
                seq: 1,
                stream_id: "engine/sgp-region",
                stream_version: 1,
                event_id: "01938a5c-7b2e-7c3d-8e4f-5a6b7c8d9e0f",
                event_type: "EngineActivationRequested",
                payload: json!({"traffic_weight": 0.1, "model_ref": "finmoe-7b-v3@sgp-region", "policy_hooks": ["aml_v2", "basel3_delta"]}),
                metadata: json!({"actor": "operator:alice", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"}),
                recorded_at: Utc.with_ymd_and_hms(2026, 11, 30, 9, 30, 0).unwrap()
                    + chrono::Duration::microseconds(123_456),
            },
            Example {
                prev_hash: hex_hash::parse(
                    "a0d1f63b2a2d1c6b1f2b3b8c9d0e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a",
                )
                .unwrap(),
                seq: 2,
                stream_id: "clearing/member-\u{00e9}\"x\"",
                stream_version: 7,
                event_id: "01938a5c-7b2f-7000-8000-000000000002",
                event_type: "ClearingDecided",
                payload: json!({"amount_minor": 125000000, "currency": "SGD", "note": "line\nbreak \u{1f}", "score": 1.0e-7, "z": null}),
                metadata: json!({}),
                recorded_at: Utc.with_ymd_and_hms(2026, 11, 30, 9, 30, 1).unwrap(),
            },
        ]
    }

    fn fields(e: &Example, payload: &str, metadata: &str) -> Hash {
        event_hash(
            &e.prev_hash,
            &HashedFields {
                seq: e.seq,
                stream_id: e.stream_id,
                stream_version: e.stream_version,
                event_id: Uuid::parse_str(e.event_id).unwrap(),
                event_type: e.event_type,
                schema_version: 1,
                payload,
                metadata,
                recorded_at: e.recorded_at,
            },
        )
    }

    #[test]
    fn worked_examples_in_hashing_md_match() {
        let doc = include_str!("../HASHING.md");
        for e in examples() {
            let payload = canonical_json(&e.payload).unwrap();
            let metadata = canonical_json(&e.metadata).unwrap();
            let hash = hex::encode(fields(&e, &payload, &metadata));
            assert!(
                doc.contains(&format!("hash = {hash}")),
                "HASHING.md lacks the hash of example seq {}: {hash}",
                e.seq
            );
            let canonical = String::from_utf8(canonical_event_bytes(&HashedFields {
                seq: e.seq,
                stream_id: e.stream_id,
                stream_version: e.stream_version,
                event_id: Uuid::parse_str(e.event_id).unwrap(),
                event_type: e.event_type,
                schema_version: 1,
                payload: &payload,
                metadata: &metadata,
                recorded_at: e.recorded_at,
            }))
            .unwrap();
            assert!(
                doc.contains(&canonical),
                "HASHING.md lacks the canonical bytes of example seq {}: {canonical}",
                e.seq
            );
        }
    }

    #[test]
    fn canonical_event_bytes_equal_jcs_of_the_whole_object() {
        for e in examples() {
            let payload = canonical_json(&e.payload).unwrap();
            let metadata = canonical_json(&e.metadata).unwrap();
            let whole = json!({
                "seq": e.seq, "stream_id": e.stream_id, "stream_version": e.stream_version,
                "event_id": e.event_id, "event_type": e.event_type, "schema_version": 1,
                "payload": e.payload, "metadata": e.metadata,
                "recorded_at": format_timestamp(&e.recorded_at),
            });
            let fields = HashedFields {
                seq: e.seq,
                stream_id: e.stream_id,
                stream_version: e.stream_version,
                event_id: Uuid::parse_str(e.event_id).unwrap(),
                event_type: e.event_type,
                schema_version: 1,
                payload: &payload,
                metadata: &metadata,
                recorded_at: e.recorded_at,
            };
            assert_eq!(
                String::from_utf8(canonical_event_bytes(&fields)).unwrap(),
                canonical_json(&whole).unwrap()
            );
        }
    }

    #[test]
    fn any_field_change_changes_the_hash() {
        let e = &examples()[0];
        let payload = canonical_json(&e.payload).unwrap();
        let base = fields(e, &payload, "{}");
        assert_ne!(base, fields(e, &payload, "{\"a\":1}"));
        assert_ne!(base, fields(e, "{}", "{}"));
        let mut other = examples().remove(0);
        other.seq = 2;
        assert_ne!(base, fields(&other, &payload, "{}"));
        other = examples().remove(0);
        other.prev_hash[31] ^= 1;
        assert_ne!(base, fields(&other, &payload, "{}"));
    }

    #[test]
    fn sm3_matches_the_standard_vector() {
        assert_eq!(
            hex::encode(sm3(b"abc")),
            "66c7f0f462eeedd9d1f2d46bdc10e4e24167c4875cf2f7a2297da02b8f4ba8e0"
        );
    }
}

//! Canonical bytes and SM3 hashes of events, exactly as written down in `HASHING.md`.
//!
//! Pure functions, no I/O: the offline verifier and independent tools rely on them.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serializer;
use sm3::{Digest, Sm3};
use uuid::Uuid;

use crate::error::LedgerError;
use crate::sm3_lanes::sm3_many;

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

/// Lowercase hex of `bytes`. `hex::encode` goes through a `char` iterator and was ~1 % of
/// the gateway's CPU on the hashes and commitments of every decision; this is a table.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = Vec::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(DIGITS[usize::from(byte >> 4)]);
        out.push(DIGITS[usize::from(byte & 0x0f)]);
    }
    // Only ASCII digits and letters were written.
    String::from_utf8(out).unwrap_or_default()
}

/// RFC 8785 (JCS) text of a JSON value.
/// Kept fallible for callers: no `serde_json::Value` fails today.
pub fn canonical_json(value: &serde_json::Value) -> Result<String, LedgerError> {
    Ok(crate::jcs::to_string(value))
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

/// Whether `text` is a time written exactly as [`format_timestamp`] writes one: RFC 3339 in
/// UTC with six fractional digits and `Z` (`2026-11-30T09:30:00.123456Z`), no leap second
/// (the ledger's clock never records one). Anything else (no fraction, three digits, an
/// offset, a line break) is not the form that is hashed and signed.
pub fn is_canonical_timestamp(text: &str) -> bool {
    DateTime::parse_from_rfc3339(text).is_ok_and(|t| {
        let t = t.with_timezone(&Utc);
        chrono::Timelike::nanosecond(&t) < 1_000_000_000 && format_timestamp(&t) == text
    })
}

/// Serde helper writing a timestamp the way it is hashed.
pub fn serialize_timestamp<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_timestamp(t))
}

/// The RFC 8785 text of the event object `{event_id, event_type, metadata, payload,
/// recorded_at, schema_version, seq, stream_id, stream_version}`.
pub fn canonical_event_bytes(f: &HashedFields<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(f.payload.len() + f.metadata.len() + 256);
    write_canonical_event(f, &mut |bytes| out.extend_from_slice(bytes));
    out
}

/// Emits the canonical event text piece by piece, members in JCS order; `payload` and
/// `metadata` are already canonical, so nothing is parsed again. The hasher consumes the
/// pieces directly (no buffer), which is the writer's and the verifier's hot path.
fn write_canonical_event(f: &HashedFields<'_>, out: &mut dyn FnMut(&[u8])) {
    let mut uuid = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let mut number = [0u8; 20];
    out(b"{\"event_id\":\"");
    out(f.event_id.hyphenated().encode_lower(&mut uuid).as_bytes());
    out(b"\",\"event_type\":");
    push_json_string(out, f.event_type);
    out(b",\"metadata\":");
    out(f.metadata.as_bytes());
    out(b",\"payload\":");
    out(f.payload.as_bytes());
    out(b",\"recorded_at\":\"");
    out(format_timestamp(&f.recorded_at).as_bytes());
    out(b"\",\"schema_version\":");
    out(decimal(&mut number, u64::from(f.schema_version)));
    out(b",\"seq\":");
    out(decimal(&mut number, f.seq));
    out(b",\"stream_id\":");
    push_json_string(out, f.stream_id);
    out(b",\"stream_version\":");
    out(decimal(&mut number, f.stream_version));
    out(b"}");
}

/// `n` in decimal, written into `buf` (u64 has at most 20 digits).
fn decimal(buf: &mut [u8; 20], mut n: u64) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Writes a JSON string with RFC 8785 escaping (that of ECMAScript `JSON.stringify`): for
/// callers that write a small canonical document of known members directly rather than
/// through a `serde_json::Value`.
pub fn push_json_string(out: &mut dyn FnMut(&[u8]), s: &str) {
    out(b"\"");
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            b if b < 0x20 => {
                out(&bytes[start..i]);
                out(format!("\\u{b:04x}").as_bytes());
                start = i + 1;
                continue;
            }
            _ => continue,
        };
        out(&bytes[start..i]);
        out(escape);
        start = i + 1;
    }
    out(&bytes[start..]);
    out(b"\"");
}

/// `SM3("aether.event.v1" ‖ prev_hash ‖ canonical_event_bytes)`.
pub fn event_hash(prev_hash: &Hash, fields: &HashedFields<'_>) -> Hash {
    let mut h = Sm3::new();
    h.update(EVENT_HASH_TAG);
    h.update(prev_hash);
    write_canonical_event(fields, &mut |bytes| h.update(bytes));
    h.finalize().into()
}

/// The [`event_hash`] of many events at once: each event's input is written out once and
/// all are hashed together on SIMD lanes ([`sm3_many`]). `verify`'s hot path.
pub fn event_hashes<'a>(
    events: impl Iterator<Item = (&'a Hash, HashedFields<'a>)> + Clone,
) -> Vec<Hash> {
    // Sized up front: growing a multi-megabyte buffer by doubling cost more (copies and
    // fresh pages) than the hashing itself.
    let estimate: usize = events
        .clone()
        .map(|(_, f)| {
            f.payload.len() + f.metadata.len() + f.stream_id.len() + f.event_type.len() + 256
        })
        .sum();
    let mut input = Vec::with_capacity(estimate);
    let mut ends = Vec::new();
    for (prev_hash, fields) in events {
        input.extend_from_slice(EVENT_HASH_TAG);
        input.extend_from_slice(prev_hash);
        write_canonical_event(&fields, &mut |bytes| input.extend_from_slice(bytes));
        ends.push(input.len());
    }
    let mut start = 0;
    let messages: Vec<&[u8]> = ends
        .iter()
        .map(|&end| {
            let message = &input[start..end];
            start = end;
            message
        })
        .collect();
    sm3_many(&messages)
}

/// Serde helpers for hashes as lowercase hex.
pub mod hex_hash {
    use super::Hash;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(h: &Hash, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::to_hex(h))
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

    proptest::proptest! {
        /// The table-driven hex is the `hex` crate's encoding, byte for byte.
        #[test]
        fn to_hex_is_lowercase_hex(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..80)) {
            proptest::prop_assert_eq!(to_hex(&bytes), hex::encode(&bytes));
        }
    }

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

    proptest::proptest! {
        /// The hand-written canonical writer agrees with a JCS library on any strings and
        /// numbers, escapes and non-ASCII included.
        #[test]
        fn canonical_writer_matches_jcs(
            stream_id in proptest::prelude::any::<String>(),
            event_type in proptest::prelude::any::<String>(),
            seq in 0u64..(1 << 53),
            version in 0u64..(1 << 53),
            schema in proptest::prelude::any::<u32>(),
            micros in 0i64..4_102_444_800_000_000,
        ) {
            let recorded_at = DateTime::from_timestamp_micros(micros).unwrap();
            let id = Uuid::now_v7();
            let fields = HashedFields {
                seq, stream_id: &stream_id, stream_version: version, event_id: id,
                event_type: &event_type, schema_version: schema,
                payload: "{\"a\":1}", metadata: "{}", recorded_at,
            };
            let whole = json!({
                "seq": seq, "stream_id": stream_id, "stream_version": version,
                "event_id": id.to_string(), "event_type": event_type, "schema_version": schema,
                "payload": {"a": 1}, "metadata": {}, "recorded_at": format_timestamp(&recorded_at),
            });
            proptest::prop_assert_eq!(
                String::from_utf8(canonical_event_bytes(&fields)).unwrap(),
                canonical_json(&whole).unwrap()
            );
        }
    }

    #[test]
    fn hashing_many_at_once_equals_hashing_each() {
        // Events of growing payloads, so that inputs end in different blocks.
        let ids: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
        let payloads: Vec<String> = (0..40)
            .map(|i| format!("{{\"memo\":\"{}\"}}", "x".repeat(i * 13)))
            .collect();
        let prevs: Vec<Hash> = (0..40u8).map(|i| [i; 32]).collect();
        let fields = |i: usize| HashedFields {
            seq: i as u64 + 1,
            stream_id: "clearing/bank-a",
            stream_version: i as u64 + 1,
            event_id: ids[i],
            event_type: "ClearingDecided",
            schema_version: 1,
            payload: &payloads[i],
            metadata: "{}",
            recorded_at: DateTime::from_timestamp_micros(1_764_000_000_000_000 + i as i64).unwrap(),
        };
        let each: Vec<Hash> = (0..40).map(|i| event_hash(&prevs[i], &fields(i))).collect();
        let many = event_hashes((0..40).map(|i| (&prevs[i], fields(i))));
        assert_eq!(many, each);
        assert!(event_hashes(std::iter::empty()).is_empty());
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

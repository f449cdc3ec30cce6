//! RFC 8785 (JCS) text of a `serde_json::Value`, written in one pass.
//!
//! Why not a crate: `serde_jcs` and `serde_json_canonicalizer` both serialise through
//! serde with a buffering formatter that allocates per member, and took 6–10 µs for a
//! ~500-byte clearing payload against ~1 µs for plain `serde_json` (measured on the
//! project's benchmark machine, 2026-12-01). Every event is canonicalised once on append,
//! so that cost sat on the ledger's hot path. What is subtle in JCS is delegated to
//! well-kept crates: number formatting to `ryu-js` (ECMAScript `Number.prototype.toString`)
//! and string escaping to `serde_json`, whose escapes (`\b \t \n \f \r \" \\`, otherwise
//! `\u00xx` in lowercase hex below U+0020, nothing else) are exactly those of RFC 8785
//! §3.2.2.2. A property test holds this module to `serde_jcs` on arbitrary values.

use std::cmp::Ordering;

use serde_json::{Map, Number, Value};

/// Largest integer magnitude an IEEE-754 double holds exactly; integers beyond it are
/// written as the double they round to, as JCS requires.
const MAX_EXACT_INTEGER: u64 = 1 << 53;

/// The RFC 8785 text of `value`.
pub fn to_string(value: &Value) -> String {
    // Room for a clearing decision's payload (~1.1 KB) without growing several times.
    let mut out = Vec::with_capacity(1536);
    write_value(value, &mut out);
    // Only UTF-8 was written: `str` pieces and ASCII.
    String::from_utf8(out).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn write_value(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(item, out);
            }
            out.push(b']');
        }
        Value::Object(map) => write_object(map, out),
    }
}

fn write_object(map: &Map<String, Value>, out: &mut Vec<u8>) {
    let mut members: Vec<(&String, &Value)> = map.iter().collect();
    // serde_json keeps members in UTF-8 byte order (or insertion order with its
    // `preserve_order` feature); JCS orders by UTF-16 code units.
    if !members
        .windows(2)
        .all(|w| utf16_order(w[0].0, w[1].0) == Ordering::Less)
    {
        members.sort_by(|a, b| utf16_order(a.0, b.0));
    }
    out.push(b'{');
    for (i, (key, item)) in members.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(key, out);
        out.push(b':');
        write_value(item, out);
    }
    out.push(b'}');
}

/// RFC 8785 §3.2.3: member names compared as arrays of UTF-16 code units. Byte order of
/// UTF-8 agrees with it except where a character above U+FFFF meets one in
/// U+E000..=U+FFFF, so only non-ASCII names take the slow comparison.
fn utf16_order(a: &str, b: &str) -> Ordering {
    let (x, y) = (a.as_bytes(), b.as_bytes());
    match x.iter().zip(y).position(|(p, q)| p != q) {
        // One is a prefix of the other: the shorter comes first in either order.
        None => x.len().cmp(&y.len()),
        // Two ASCII bytes that differ begin two different characters there.
        Some(i) if x[i].is_ascii() && y[i].is_ascii() => x[i].cmp(&y[i]),
        Some(_) => a.encode_utf16().cmp(b.encode_utf16()),
    }
}

fn write_number(n: &Number, out: &mut Vec<u8>) {
    if let Some(u) = n.as_u64() {
        if u <= MAX_EXACT_INTEGER {
            out.extend_from_slice(itoa::Buffer::new().format(u).as_bytes());
        } else {
            write_double(u as f64, out);
        }
    } else if let Some(i) = n.as_i64() {
        if i.unsigned_abs() <= MAX_EXACT_INTEGER {
            out.extend_from_slice(itoa::Buffer::new().format(i).as_bytes());
        } else {
            write_double(i as f64, out);
        }
    } else if let Some(f) = n.as_f64() {
        write_double(f, out);
    }
}

/// A double as ECMAScript prints it. `serde_json::Value` never holds NaN or infinities.
fn write_double(f: f64, out: &mut Vec<u8>) {
    if f.is_finite() {
        out.extend_from_slice(ryu_js::Buffer::new().format_finite(f).as_bytes());
    } else {
        out.extend_from_slice(b"null");
    }
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    // Most strings need no escape (no quote, backslash or control character below
    // U+0020): copied as they are, without serde_json's writer machinery per string.
    // A fold without early exit, which the compiler vectorises; names and values are short.
    let needs_escape = s.bytes().fold(false, |any, b| {
        any | (b < 0x20) | (b == b'"') | (b == b'\\')
    });
    if !needs_escape {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Writing into a `Vec` cannot fail; serde_json escapes as JCS does.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn the_rfc_8785_examples() {
        // The input of RFC 8785 §3.2.2, as text, so that its numbers are parsed as written.
        let v: Value = serde_json::from_str(
            r#"{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
                "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
                "literals": [null, true, false]}"#,
        )
        .unwrap();
        assert_eq!(
            to_string(&v),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
        // §3.2.3's sorting example: UTF-16 order puts U+1F600 before U+FB33, UTF-8
        // order the other way round.
        let sorted = json!({"\u{20ac}": "Euro", "\r": "CR", "\u{fb33}": "Dalet", "1": "One",
                            "\u{1f600}": "Grin", "\u{0080}": "Control", "\u{00f6}": "o"});
        assert_eq!(
            to_string(&sorted),
            "{\"\\r\":\"CR\",\"1\":\"One\",\"\u{80}\":\"Control\",\"ö\":\"o\",\"€\":\"Euro\",\"😀\":\"Grin\",\"\u{fb33}\":\"Dalet\"}"
        );
    }

    #[test]
    fn integers_beyond_two_to_the_53_print_as_the_double_they_round_to() {
        assert_eq!(
            to_string(&json!(9_007_199_254_740_993u64)),
            "9007199254740992"
        );
        assert_eq!(
            to_string(&json!(-9_007_199_254_740_993i64)),
            "-9007199254740992"
        );
        assert_eq!(to_string(&json!(u64::MAX)), "18446744073709552000");
        assert_eq!(to_string(&json!(-0.0)), "0");
    }

    fn arb_key() -> impl Strategy<Value = String> {
        // ASCII, Latin-1, the U+E000..U+FFFF block and astral characters: where UTF-8 and
        // UTF-16 orders disagree.
        prop::collection::vec(
            prop_oneof![
                prop::char::range('a', 'e'),
                prop::char::range('\u{0}', '\u{7f}'),
                prop::char::range('\u{e000}', '\u{e002}'),
                prop::char::range('\u{fff0}', '\u{fffd}'),
                prop::char::range('\u{10000}', '\u{10002}'),
                prop::char::range('\u{1f600}', '\u{1f602}'),
            ],
            0..4,
        )
        .prop_map(|cs| cs.into_iter().collect())
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1_000_000i64..1_000_000).prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            any::<String>().prop_map(Value::String),
            arb_key().prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(arb_key(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// The fast comparison is the UTF-16 one on any names, ASCII or not.
        #[test]
        fn member_order_is_utf16_order(
            prefix in "\\PC{0,3}",
            x in "[a-z\u{7f}-\u{80}\u{e000}\u{fb33}\u{ffff}\u{10000}\u{1f600}]{0,3}",
            y in "[a-z\u{7f}-\u{80}\u{e000}\u{fb33}\u{ffff}\u{10000}\u{1f600}]{0,3}",
        ) {
            let (a, b) = (format!("{prefix}{x}"), format!("{prefix}{y}"));
            prop_assert_eq!(utf16_order(&a, &b), a.encode_utf16().cmp(b.encode_utf16()));
            prop_assert_eq!(utf16_order(&b, &a), b.encode_utf16().cmp(a.encode_utf16()));
        }

        /// The reference: `serde_jcs`, an independent implementation of RFC 8785.
        #[test]
        fn agrees_with_serde_jcs(value in arb_json()) {
            prop_assert_eq!(to_string(&value), serde_jcs::to_string(&value).unwrap());
        }
    }
}

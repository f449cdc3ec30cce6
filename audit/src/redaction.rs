//! What a regulator sees of personal data in an audit answer (`REDACTION.md`).
//!
//! Personal payload members are hashed only as salted commitments (`{"$personal": …}`, see
//! `aether_ledger::personal`); their values sit beside the chain until erased. An answer
//! shows each one either revealed (the value in place) or as a redaction marker holding
//! its commitment, by a [`RedactionPolicy`]: the operator's list of field paths revealed to
//! regulators. A field erased by a `RedactionApplied` event is never revealed, whatever the
//! policy says. Pure: the caller reads the held values and the erasures.

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use aether_ledger::personal::{PATH_SEPARATOR, PLACEHOLDER_KEY, PersonalField};
use serde::Serialize;
use serde_json::{Map, Value, json};

/// Key of the marker object that stands for a personal value not shown.
pub const MARKER_KEY: &str = "redacted";

/// Which personal field paths are revealed to regulators.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RedactionPolicy {
    /// Every value still held.
    RevealAll,
    /// Only these paths (empty: none).
    Reveal(BTreeSet<String>),
}

impl Default for RedactionPolicy {
    /// Regulators are entitled to the values still held; erased ones stay hidden.
    fn default() -> Self {
        RedactionPolicy::RevealAll
    }
}

/// A policy text that is not `*`, `none` or a comma-separated list of dotted paths.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid redaction policy entry {entry:?}: expected `*`, `none`, or field paths such as `trade.buyer`"
)]
pub struct PolicyError {
    pub entry: String,
}

impl FromStr for RedactionPolicy {
    type Err = PolicyError;

    /// `*` (or `all`): reveal every held value; `none` or empty: reveal nothing; otherwise
    /// comma-separated paths such as `trade.buyer,trade.seller`.
    fn from_str(text: &str) -> Result<Self, PolicyError> {
        match text.trim() {
            "*" | "all" => return Ok(RedactionPolicy::RevealAll),
            "" | "none" => return Ok(RedactionPolicy::Reveal(BTreeSet::new())),
            _ => {}
        }
        text.split(',')
            .map(str::trim)
            .map(|entry| {
                let valid = entry.split(PATH_SEPARATOR).all(|segment| {
                    !segment.is_empty()
                        && segment
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                });
                if valid {
                    Ok(entry.to_owned())
                } else {
                    Err(PolicyError {
                        entry: entry.to_owned(),
                    })
                }
            })
            .collect::<Result<BTreeSet<_>, _>>()
            .map(RedactionPolicy::Reveal)
    }
}

impl fmt::Display for RedactionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RedactionPolicy::RevealAll => f.write_str("*"),
            RedactionPolicy::Reveal(paths) if paths.is_empty() => f.write_str("none"),
            RedactionPolicy::Reveal(paths) => {
                f.write_str(&paths.iter().cloned().collect::<Vec<_>>().join(","))
            }
        }
    }
}

impl RedactionPolicy {
    /// Whether the policy lets regulators see the value at `path`.
    pub fn reveals(&self, path: &str) -> bool {
        match self {
            RedactionPolicy::RevealAll => true,
            RedactionPolicy::Reveal(paths) => paths.contains(path),
        }
    }
}

/// One erasure of a field, as its `RedactionApplied` event recorded it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Erasure {
    /// The field's path (the event's `member`).
    pub member: String,
    /// Seq of the `RedactionApplied` event.
    pub seq: u64,
    pub reason: String,
    pub recorded_at: String,
}

/// How one personal field is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldStatus {
    /// The value is shown in place.
    Revealed,
    /// Held, but the policy does not reveal it.
    Withheld,
    /// Erased by a `RedactionApplied` event.
    Erased,
    /// Neither held nor erased by a recorded redaction (the side row is missing).
    Unavailable,
}

/// A personal field of an answer: where it is, what it commits to, how it is shown.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PersonalStatus {
    pub path: String,
    /// The commitment in the hashed payload, hex.
    pub commitment: String,
    pub status: FieldStatus,
    /// The erasure, for an erased field.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redaction: Option<Erasure>,
}

/// A payload as a regulator sees it, and what was done to each personal field.
#[derive(Clone, Debug, PartialEq)]
pub struct Presented {
    pub payload: Value,
    pub fields: Vec<PersonalStatus>,
}

impl Presented {
    /// The held values the policy reveals (value and salt, so that a regulator can check
    /// each against its commitment).
    pub fn revealed<'a>(&self, held: &'a [PersonalField]) -> Vec<&'a PersonalField> {
        held.iter()
            .filter(|f| {
                self.fields
                    .iter()
                    .any(|s| s.path == f.member && s.status == FieldStatus::Revealed)
            })
            .collect()
    }
}

/// Replaces every personal placeholder in `payload` by its value or a marker
/// `{"redacted": <status>, "commitment": <hex>}`, by `policy`; `held` are the values still
/// kept, `erasures` the recorded redactions of this event.
pub fn present(
    payload: &Value,
    held: &[PersonalField],
    erasures: &[Erasure],
    policy: &RedactionPolicy,
) -> Presented {
    let mut payload = payload.clone();
    let mut fields = Vec::new();
    walk(&mut payload, &mut String::new(), &mut |path, commitment| {
        let erasure = erasures.iter().find(|e| e.member == path).cloned();
        let value = held.iter().find(|f| f.member == path);
        let (status, shown) = match (&erasure, value) {
            (Some(_), _) => (FieldStatus::Erased, None),
            (None, Some(field)) if policy.reveals(path) => match field.value_json() {
                Ok(v) => (FieldStatus::Revealed, Some(v)),
                Err(_) => (FieldStatus::Unavailable, None),
            },
            (None, Some(_)) => (FieldStatus::Withheld, None),
            (None, None) => (FieldStatus::Unavailable, None),
        };
        fields.push(PersonalStatus {
            path: path.to_owned(),
            commitment: commitment.to_owned(),
            status,
            redaction: erasure,
        });
        shown.unwrap_or_else(|| marker(status, commitment))
    });
    Presented { payload, fields }
}

fn marker(status: FieldStatus, commitment: &str) -> Value {
    let why = match status {
        FieldStatus::Withheld => "withheld by policy",
        FieldStatus::Erased => "erased",
        _ => "unavailable",
    };
    json!({ MARKER_KEY: why, "commitment": commitment })
}

/// Calls `replace(path, commitment)` for every placeholder object under `value` (members
/// of objects, depth first) and puts its answer in the placeholder's place.
fn walk(value: &mut Value, path: &mut String, replace: &mut dyn FnMut(&str, &str) -> Value) {
    let Some(object) = value.as_object_mut() else {
        return;
    };
    for (key, member) in object.iter_mut() {
        let len = path.len();
        if !path.is_empty() {
            path.push(PATH_SEPARATOR);
        }
        path.push_str(key);
        match commitment_of(member) {
            Some(commitment) => *member = replace(path, &commitment),
            None => walk(member, path, replace),
        }
        path.truncate(len);
    }
}

/// The commitment of a placeholder object (`{"$personal": "<hex>"}` and nothing else).
fn commitment_of(value: &Value) -> Option<String> {
    let object: &Map<String, Value> = value.as_object()?;
    if object.len() != 1 {
        return None;
    }
    object.get(PLACEHOLDER_KEY)?.as_str().map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(member: &str, value: &str, salt: u8) -> PersonalField {
        PersonalField {
            member: member.into(),
            value: value.into(),
            salt: [salt; 16],
        }
    }

    /// A payload with `trade.buyer` and `trade.seller` sealed as the ledger seals them.
    fn sealed() -> (Value, Vec<PersonalField>) {
        let held = vec![
            field("trade.buyer", "\"acct-1\"", 1),
            field("trade.seller", "\"acct-2\"", 2),
        ];
        let placeholder =
            |f: &PersonalField| json!({ PLACEHOLDER_KEY: hex::encode(f.commitment()) });
        let payload = json!({"request_id": "r-1", "trade": {
            "buyer": placeholder(&held[0]), "seller": placeholder(&held[1]), "currency": "SGD"}});
        (payload, held)
    }

    #[test]
    fn the_policy_reveals_its_paths_and_marks_the_rest_with_their_commitment() {
        let (payload, held) = sealed();
        let policy: RedactionPolicy = "trade.buyer".parse().unwrap();
        let shown = present(&payload, &held, &[], &policy);
        assert_eq!(shown.payload["trade"]["buyer"], "acct-1");
        assert_eq!(shown.payload["trade"]["currency"], "SGD");
        assert_eq!(
            shown.payload["trade"]["seller"],
            json!({"redacted": "withheld by policy", "commitment": hex::encode(held[1].commitment())})
        );
        let statuses: Vec<_> = shown
            .fields
            .iter()
            .map(|f| (f.path.as_str(), f.status))
            .collect();
        assert_eq!(
            statuses,
            [
                ("trade.buyer", FieldStatus::Revealed),
                ("trade.seller", FieldStatus::Withheld)
            ]
        );
        assert_eq!(shown.revealed(&held), [&held[0]]);
        assert!(!shown.payload.to_string().contains("acct-2"));
    }

    #[test]
    fn an_erased_field_is_never_revealed_even_if_its_value_is_still_held() {
        let (payload, held) = sealed();
        let erasure = Erasure {
            member: "trade.buyer".into(),
            seq: 9,
            reason: "erasure request".into(),
            recorded_at: "2026-12-01T00:00:00Z".into(),
        };
        let shown = present(
            &payload,
            &held,
            std::slice::from_ref(&erasure),
            &RedactionPolicy::RevealAll,
        );
        assert_eq!(shown.payload["trade"]["buyer"]["redacted"], "erased");
        assert_eq!(shown.fields[0].redaction, Some(erasure));
        assert_eq!(shown.payload["trade"]["seller"], "acct-2");
        // A value neither held nor erased by a recorded redaction is marked unavailable.
        let shown = present(&payload, &held[1..], &[], &RedactionPolicy::RevealAll);
        assert_eq!(shown.fields[0].status, FieldStatus::Unavailable);
        assert!(!shown.payload.to_string().contains("acct-1"));
    }

    #[test]
    fn policies_parse_and_print() {
        for (text, printed) in [
            ("*", "*"),
            ("all", "*"),
            ("none", "none"),
            ("", "none"),
            ("trade.seller, trade.buyer", "trade.buyer,trade.seller"),
        ] {
            let policy: RedactionPolicy = text.parse().unwrap();
            assert_eq!(policy.to_string(), printed);
        }
        for bad in ["trade..buyer", "trade.buyer,", "a b", ".x"] {
            assert!(bad.parse::<RedactionPolicy>().is_err(), "{bad}");
        }
        assert!(!RedactionPolicy::Reveal(BTreeSet::new()).reveals("trade.buyer"));
    }
}

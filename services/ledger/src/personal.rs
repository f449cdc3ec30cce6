//! Personal data that can be erased without breaking the chain.
//!
//! A member given as personal is never hashed in the clear: the event's payload carries
//! `{"$personal": "<commitment>"}` where commitment = SM3("aether.personal.v1" ‖ salt ‖
//! RFC 8785 text of the value), with a random 16-byte salt. The value and salt live in a
//! side table (`personal_data`) that allows DELETE but not UPDATE. Redaction appends a
//! `RedactionApplied` event and deletes the side row: the chain, checkpoints and proofs
//! still verify, and while the row exists anyone holding value and salt can prove the
//! value is the one committed to. The salt keeps a guessable value (a name, an account
//! number) from being confirmed by brute force against the commitment.
//!
//! A member name may be a dotted path (`trade.buyer`): the placeholder then stands where
//! the value would be inside the payload, so a nested request keeps its shape. Missing
//! parent objects are created; a parent that is not an object is a conflict.

use serde::Serialize;
use sm3::{Digest, Sm3};

use crate::error::LedgerError;
use crate::hashing::{self, Hash};

/// Domain-separation tag of a personal-data commitment.
pub const COMMITMENT_TAG: &[u8] = b"aether.personal.v1";
/// Key of the placeholder object that stands in the payload for a personal value.
pub const PLACEHOLDER_KEY: &str = "$personal";
/// Stream of redaction events.
pub const REDACTION_STREAM: &str = "ledger/redactions";
/// Event type of a redaction.
pub const REDACTION_EVENT_TYPE: &str = "RedactionApplied";

/// Separates the segments of a nested member's path (`trade.buyer`).
pub const PATH_SEPARATOR: char = '.';

/// A personal value kept beside the chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PersonalField {
    /// Payload member it belongs to: a top-level name or a dotted path.
    pub member: String,
    /// RFC 8785 text of the value.
    pub value: String,
    /// The commitment's salt, hex.
    #[serde(serialize_with = "salt_hex")]
    pub salt: [u8; 16],
}

fn salt_hex<S: serde::Serializer>(salt: &[u8; 16], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&hashing::to_hex(salt))
}

/// `SM3("aether.personal.v1" ‖ salt ‖ value_jcs)`.
pub fn commitment(salt: &[u8; 16], value_jcs: &str) -> Hash {
    let mut h = Sm3::new();
    h.update(COMMITMENT_TAG);
    h.update(salt);
    h.update(value_jcs.as_bytes());
    h.finalize().into()
}

impl PersonalField {
    pub fn commitment(&self) -> Hash {
        commitment(&self.salt, &self.value)
    }

    /// The value as JSON.
    pub fn value_json(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(&self.value)
    }
}

/// Moves `personal` members into `payload` as placeholders; returns the side rows.
pub(crate) fn seal(
    payload: &mut serde_json::Value,
    personal: serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<PersonalField>, LedgerError> {
    let Some(object) = payload.as_object_mut() else {
        return Ok(Vec::new()); // validation reports the non-object payload
    };
    let mut fields = Vec::with_capacity(personal.len());
    for (member, value) in personal {
        let (parent, leaf) = parent_of(object, &member)?;
        if parent.contains_key(leaf) {
            return Err(LedgerError::PersonalConflict { member });
        }
        let value = hashing::canonical_json(&value)?;
        let salt: [u8; 16] = rand::random();
        let placeholder =
            serde_json::json!({ PLACEHOLDER_KEY: hashing::to_hex(&commitment(&salt, &value)) });
        parent.insert(leaf.to_owned(), placeholder);
        fields.push(PersonalField {
            member,
            value,
            salt,
        });
    }
    Ok(fields)
}

/// The object that holds `member`'s last segment, created where missing, and that segment.
fn parent_of<'a, 'm>(
    mut object: &'a mut serde_json::Map<String, serde_json::Value>,
    member: &'m str,
) -> Result<(&'a mut serde_json::Map<String, serde_json::Value>, &'m str), LedgerError> {
    if member.split(PATH_SEPARATOR).any(str::is_empty) {
        return Err(LedgerError::InvalidPersonalPath {
            member: member.to_owned(),
        });
    }
    let mut segments: Vec<&str> = member.split(PATH_SEPARATOR).collect();
    let leaf = segments.pop().unwrap_or(member);
    for segment in segments {
        object = object
            .entry(segment)
            .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()))
            .as_object_mut()
            .ok_or_else(|| LedgerError::PersonalConflict {
                member: member.to_owned(),
            })?;
    }
    Ok((object, leaf))
}

/// The value at `member` (a top-level name or a dotted path) in `payload`. A top-level
/// member of that exact name comes first, as it did before paths existed.
pub fn member_value<'a>(
    payload: &'a serde_json::Value,
    member: &str,
) -> Option<&'a serde_json::Value> {
    payload.get(member).or_else(|| {
        member
            .split(PATH_SEPARATOR)
            .try_fold(payload, |value, segment| value.get(segment))
    })
}

/// The commitment a payload holds for `member`, if the member is a personal placeholder.
pub fn placeholder(payload: &serde_json::Value, member: &str) -> Option<Hash> {
    let text = member_value(payload, member)?
        .get(PLACEHOLDER_KEY)?
        .as_str()?;
    hashing::hex_hash::parse(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sealing_replaces_members_with_salted_commitments() {
        let mut payload = json!({"amount_minor": 5});
        let personal = json!({"name": "Ada Lovelace", "account": {"iban": "GB00"}});
        let fields = seal(&mut payload, personal.as_object().unwrap().clone()).unwrap();
        assert_eq!(fields.len(), 2);
        for f in &fields {
            assert_eq!(placeholder(&payload, &f.member), Some(f.commitment()));
            assert!(!payload.to_string().contains("Lovelace"));
        }
        // The same value sealed twice gets different commitments (fresh salt).
        let mut again = json!({});
        let other = seal(
            &mut again,
            json!({"name": "Ada Lovelace"}).as_object().unwrap().clone(),
        )
        .unwrap();
        let name = fields.iter().find(|f| f.member == "name").unwrap();
        assert_ne!(other[0].commitment(), name.commitment());
        assert_eq!(other[0].value, name.value);
        // A member cannot be both public and personal.
        let mut clash = json!({"name": "x"});
        assert!(
            seal(
                &mut clash,
                json!({"name": "y"}).as_object().unwrap().clone()
            )
            .is_err()
        );
    }

    #[test]
    fn a_dotted_member_is_sealed_in_place_inside_its_parent() {
        let mut payload = json!({"trade": {"currency": "SGD"}});
        let personal = json!({"trade.buyer": "acct-17", "party.name": "Ada"});
        let fields = seal(&mut payload, personal.as_object().unwrap().clone()).unwrap();
        assert_eq!(payload["trade"]["currency"], "SGD");
        for f in &fields {
            assert_eq!(placeholder(&payload, &f.member), Some(f.commitment()));
        }
        assert!(payload["trade"]["buyer"][PLACEHOLDER_KEY].is_string());
        assert!(payload["party"]["name"][PLACEHOLDER_KEY].is_string());
        assert!(!payload.to_string().contains("acct-17"));
        // A public value on the path, an existing member or an empty segment is refused.
        for (payload, member) in [
            (json!({"trade": "x"}), "trade.buyer"),
            (json!({"trade": {"buyer": "b"}}), "trade.buyer"),
            (json!({}), "trade..buyer"),
            (json!({}), ".buyer"),
        ] {
            let mut payload = payload;
            let personal = json!({ member: "v" }).as_object().unwrap().clone();
            assert!(seal(&mut payload, personal).is_err(), "{member}");
        }
    }
}

//! The decoders an attacker reaches, one function per fuzz target. Each takes arbitrary
//! bytes, runs the very code the service runs on them, and panics only where the service
//! would misbehave: a decoder that panics, or one that accepts what it must not (an id
//! the ledger must not store, a refusal that is not a 4xx, a sealed payload that does not
//! open to itself).
//!
//! Run coverage-guided by libFuzzer through `cargo fuzz` (`fuzz/cargo-fuzz`, see
//! `fuzz/README.md`); replayed from the committed corpora (`fuzz/corpus/<target>`) by
//! `cargo test -p aether-fuzz` in every test run.

use std::sync::OnceLock;

use aether_gateway::envelope::{
    Aad, Direction, EnvelopeKey, SessionKeys, Sm4Key, decode_wrapped_key, open, seal,
};

/// What a target made of its input: read as valid, or refused with a reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    Refused,
}

impl<T, E> From<&Result<T, E>> for Outcome {
    fn from(r: &Result<T, E>) -> Outcome {
        if r.is_ok() {
            Outcome::Accepted
        } else {
            Outcome::Refused
        }
    }
}

/// A fuzz target: its name (the corpus directory) and its function.
pub type Target = (&'static str, fn(&[u8]) -> Outcome);

/// Every target, by the name `cargo fuzz run` knows it by.
pub const TARGETS: [Target; 6] = [
    ("clearing_request", clearing_request),
    ("envelope", envelope),
    ("policy", policy),
    ("bundle", bundle),
    ("openlineage", openlineage),
    ("append_body", append_body),
];

/// The plaintext of an opened clearing envelope, decoded and checked as the gateway does
/// before anything is looked up (`aether_gateway::request::check`). An accepted trade's
/// ids must be ones the ledger stores as they are.
pub fn clearing_request(data: &[u8]) -> Outcome {
    let checked = aether_gateway::request::check("bank-a", "r-1", data);
    if let Ok((trade, digest)) = &checked {
        for id in [&trade.buyer, &trade.seller, &trade.instrument] {
            assert!(
                !id.is_empty() && !id.chars().any(|c| c.is_control() || c.is_whitespace()),
                "accepted id {id:?}"
            );
        }
        assert!(trade.amount_minor > 0 && (1..=5).contains(&trade.counterparty_tier));
        assert_eq!(digest.len(), 64);
    }
    Outcome::from(&checked)
}

fn server_key() -> &'static EnvelopeKey {
    static KEY: OnceLock<EnvelopeKey> = OnceLock::new();
    KEY.get_or_init(EnvelopeKey::generate)
}

/// The envelope as a member's bytes reach it: the first byte picks the part. A key
/// header (text), a wrapped key (SM2), a session request (nonce and ciphertext under a
/// registered key: refused, as a forged tag must be), or a payload sealed and opened
/// again (it must open to itself).
pub fn envelope(data: &[u8]) -> Outcome {
    let Some((&part, rest)) = data.split_first() else {
        return Outcome::Refused;
    };
    let aad = Aad {
        direction: Direction::Request,
        method: "/aether.v1.ClearingService/Submit",
        request_id: "r-1",
        member_id: "bank-a",
        key_id: "",
        issued_at: 1_767_225_600,
    };
    match part % 4 {
        0 => Outcome::from(&decode_wrapped_key(&String::from_utf8_lossy(rest))),
        1 => Outcome::from(&server_key().unwrap_key(rest)),
        2 => {
            let sessions = SessionKeys::default();
            let Ok(grant) = sessions.register(Sm4Key::from_bytes([7; 16]), aad.issued_at) else {
                return Outcome::Refused;
            };
            let aad = Aad {
                key_id: &grant.key_id,
                ..aad
            };
            let split = rest.first().map_or(0, |&n| usize::from(n) % 16);
            let body = rest.get(1..).unwrap_or_default();
            let (nonce, ciphertext) = body.split_at(split.min(body.len()));
            let opened = sessions.open(&aad, nonce, ciphertext, aad.issued_at);
            assert!(opened.is_err(), "a forged session request was opened");
            Outcome::Refused
        }
        _ => {
            let key = Sm4Key::from_bytes([9; 16]);
            let Ok(sealed) = seal(&key, &aad, rest) else {
                return Outcome::Refused;
            };
            let opened = open(&key, &aad, &sealed.nonce, &sealed.ciphertext);
            assert_eq!(opened.as_deref().ok(), Some(rest), "sealed, then opened");
            Outcome::Accepted
        }
    }
}

/// A policy document, YAML or JSON (the first byte picks), parsed and compiled as
/// `POST /v1/policies` does.
pub fn policy(data: &[u8]) -> Outcome {
    let Some((&format, rest)) = data.split_first() else {
        return Outcome::Refused;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return Outcome::Refused;
    };
    let format = if format % 2 == 0 {
        aether_rules::PolicyFormat::Yaml
    } else {
        aether_rules::PolicyFormat::Json
    };
    Outcome::from(&aether_rules::CompiledPolicy::parse(text, format))
}

/// An evidence bundle read and verified offline, as `aether audit verify` does (within
/// small read limits: the limits themselves are tested elsewhere).
pub fn bundle(data: &[u8]) -> Outcome {
    let limits = aether_audit::ReadLimits {
        max_bytes: 1 << 20,
        max_events: 1_000,
        max_checkpoints: 100,
    };
    match aether_audit::Bundle::from_slice_with_limits(data, &limits) {
        Ok(bundle) => {
            let verdict = aether_audit::verify_bundle(&bundle, None);
            if verdict.ok {
                Outcome::Accepted
            } else {
                Outcome::Refused
            }
        }
        Err(_) => Outcome::Refused,
    }
}

/// A `POST /api/v1/lineage` body: OpenLineage run events from outside.
pub fn openlineage(data: &[u8]) -> Outcome {
    Outcome::from(&aether_lineage::external::parse_request(data))
}

/// A `POST /v1/events` body, through every check the append makes before it reaches the
/// database: the body decoder (whose refusal must be a 4xx problem), the reserved
/// namespaces, the stream id, and each event's type, schema version and values.
pub fn append_body(data: &[u8]) -> Outcome {
    let appends = match aether_api::parse_append(data) {
        Ok(appends) => appends,
        Err(problem) => {
            assert!(problem.status().is_client_error(), "{problem:?}");
            return Outcome::Refused;
        }
    };
    let accepted = appends.iter().all(|append| {
        aether_ledger::event::validate_stream_id(&append.stream_id).is_ok()
            && append.events.iter().all(|event| {
                aether_api::reserved::refusal(&append.stream_id, &event.event_type).is_none()
                    && event
                        .check(aether_ledger::event::DEFAULT_MAX_PAYLOAD_BYTES)
                        .is_ok()
            })
    });
    if accepted {
        Outcome::Accepted
    } else {
        Outcome::Refused
    }
}

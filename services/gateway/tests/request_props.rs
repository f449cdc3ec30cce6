//! Properties of the clearing request's decoding and checks over arbitrary input: the
//! bytes an envelope opens to never panic the gateway; whatever it accepts is a trade the
//! ledger can store as sent (nothing silently changed); every valid trade is accepted.

use aether_gateway::clearing::ClearError;
use aether_gateway::pb::v1::{ClearingRequest, Trade};
use aether_gateway::request::{self, CheckError, RequestError};
use aether_gpu_worker::trade::{ISO_3166_ALPHA2, MAX_ID_LEN};
use proptest::prelude::*;
use prost::Message;

/// Text of the kinds that break decoders and databases, and arbitrary Unicode.
fn hostile_text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("a\u{0}b".to_owned()),
        Just("x".repeat(MAX_ID_LEN + 1)),
        Just("x".repeat(MAX_ID_LEN)),
        Just("bank a".to_owned()),
        Just("é\u{202e}\u{feff}".to_owned()),
        Just("SGD".to_owned()),
        Just("SG".to_owned()),
        Just("2026-12-02".to_owned()),
        Just("2026-02-30".to_owned()),
        Just("+2026-12-02".to_owned()),
        Just("2026-1-2".to_owned()),
        Just(" 2026-12-02".to_owned()),
        Just("2026-12-02T00:00:00Z".to_owned()),
        Just("4bf92f3577b34da6a3ce929d0e0e4736".to_owned()),
        Just("00000000000000000000000000000000".to_owned()),
        Just("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned()),
        "(?s).{0,40}",
        "[A-Za-z0-9._-]{1,12}",
    ]
}

/// A valid request with one field replaced by hostile text or an arbitrary number, so
/// that the checks past the first are reached and the accepting branch is taken often.
fn nearly_valid_request() -> impl Strategy<Value = ClearingRequest> {
    (
        valid_request(),
        0usize..12,
        hostile_text(),
        any::<i64>(),
        any::<u32>(),
    )
        .prop_map(|(mut request, field, text, number, tier)| {
            let t = request
                .trade
                .as_mut()
                .expect("valid requests carry a trade");
            match field {
                0 => t.buyer = text,
                1 => t.seller = text,
                2 => t.instrument = text,
                3 => t.currency = text,
                4 => t.amount_minor = number,
                5 => t.value_date = text,
                6 => t.jurisdiction = text,
                7 => t.counterparty_tier = tier,
                8 => request.trace_id = text,
                9 => request.model_stage = text,
                10 => request.semantic_tag = text,
                _ => request.traceparent = text,
            }
            request
        })
}

fn any_request() -> impl Strategy<Value = ClearingRequest> {
    prop_oneof![nearly_valid_request(), wholly_arbitrary_request()]
}

fn wholly_arbitrary_request() -> impl Strategy<Value = ClearingRequest> {
    let trade = (
        (
            hostile_text(),
            hostile_text(),
            hostile_text(),
            hostile_text(),
        ),
        prop_oneof![any::<i64>(), Just(0i64), Just(1), Just(i64::MAX), Just(-1)],
        (hostile_text(), hostile_text()),
        prop_oneof![any::<u32>(), 0u32..7],
    )
        .prop_map(
            |(
                (buyer, seller, instrument, currency),
                amount_minor,
                (value_date, jurisdiction),
                tier,
            )| {
                Trade {
                    buyer,
                    seller,
                    instrument,
                    currency,
                    amount_minor,
                    value_date,
                    jurisdiction,
                    counterparty_tier: tier,
                }
            },
        );
    (
        proptest::option::weighted(0.95, trade),
        (
            hostile_text(),
            hostile_text(),
            hostile_text(),
            hostile_text(),
        ),
    )
        .prop_map(
            |(trade, (trace_id, model_stage, semantic_tag, traceparent))| ClearingRequest {
                trade,
                trace_id,
                model_stage,
                semantic_tag,
                traceparent,
            },
        )
}

fn party() -> impl Strategy<Value = String> {
    "[A-Za-z0-9._:-]{1,40}"
}

fn valid_request() -> impl Strategy<Value = ClearingRequest> {
    (
        (party(), party(), party(), "[A-Z]{3}"),
        1i64..=i64::MAX,
        (
            0i32..=364,
            2000i32..2100,
            0usize..ISO_3166_ALPHA2.len(),
            1u32..=5,
        ),
    )
        .prop_filter("two parties", |((buyer, seller, _, _), _, _)| {
            buyer != seller
        })
        .prop_map(
            |((buyer, seller, instrument, currency), amount_minor, (day, year, j, tier))| {
                let date = chrono::NaiveDate::from_yo_opt(year, day as u32 + 1)
                    .expect("day 1..=365 of any year exists");
                ClearingRequest {
                    trade: Some(Trade {
                        buyer,
                        seller,
                        instrument,
                        currency,
                        amount_minor,
                        value_date: date.format("%Y-%m-%d").to_string(),
                        jurisdiction: ISO_3166_ALPHA2[j].to_owned(),
                        counterparty_tier: tier,
                    }),
                    ..ClearingRequest::default()
                }
            },
        )
}

/// Storable as an id: what the ledger, logs and file names take.
fn is_storable_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_ID_LEN
        && !s.chars().any(|c| c.is_control() || c.is_whitespace())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    /// Any bytes: decoded or refused with a reason, never a panic; what decodes
    /// re-encodes to a message that decodes to the same request.
    #[test]
    fn arbitrary_bytes_decode_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        match request::decode(&bytes) {
            Ok(opened) => {
                let mut whole = opened.request.clone();
                whole.trade = Some(opened.trade.clone());
                let again = ClearingRequest::decode(whole.encode_to_vec().as_slice()).unwrap();
                prop_assert_eq!(again, whole);
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        let _ = request::check("bank-a", "r-1", &bytes);
    }

    /// Arbitrary requests: an accepted one is exactly the trade that was sent, with every
    /// field in the range the ledger stores; a refused one names why.
    #[test]
    fn accepted_requests_are_stored_as_sent(
        sent in any_request(),
        member in prop_oneof![Just("bank-a".to_owned()), hostile_text()],
        request_id in prop_oneof![Just("r-1".to_owned()), hostile_text()],
    ) {
        let bytes = sent.encode_to_vec();
        match request::check(&member, &request_id, &bytes) {
            Ok((trade, digest)) => {
                let t = sent.trade.as_ref().expect("accepted requests carry a trade");
                prop_assert_eq!(&trade.member_id, &member);
                prop_assert_eq!(&trade.request_id, &request_id);
                for id in [&trade.member_id, &trade.request_id, &trade.buyer, &trade.seller, &trade.instrument] {
                    prop_assert!(is_storable_id(id), "accepted an id the ledger must not store: {id:?}");
                }
                prop_assert_eq!(&trade.buyer, &t.buyer);
                prop_assert_eq!(&trade.seller, &t.seller);
                prop_assert!(trade.buyer != trade.seller);
                prop_assert_eq!(&trade.instrument, &t.instrument);
                prop_assert_eq!(&trade.currency, &t.currency);
                prop_assert_eq!(trade.amount_minor, t.amount_minor);
                prop_assert!(trade.amount_minor > 0);
                // The date is the one sent, written back the same way.
                prop_assert_eq!(trade.value_date.format("%Y-%m-%d").to_string(), t.value_date.clone());
                prop_assert_eq!(&trade.jurisdiction, &t.jurisdiction);
                prop_assert_eq!(u32::from(trade.counterparty_tier), t.counterparty_tier);
                prop_assert!(sent.trace_id.is_empty()
                    || (sent.trace_id.len() == 32 && sent.trace_id.bytes().all(|b| b.is_ascii_hexdigit())));
                prop_assert_eq!(digest.len(), 64);
                // The digest is a function of the trade: the same bytes, the same digest.
                let (_, again) = request::check(&member, &request_id, &bytes).unwrap();
                prop_assert_eq!(digest, again);
            }
            Err(CheckError::Request(RequestError::NoTrade)) => prop_assert!(sent.trade.is_none()),
            Err(CheckError::Request(e)) => prop_assert!(false, "an encoded message failed to decode: {e}"),
            Err(CheckError::Clear(ClearError::InvalidTrade(m) | ClearError::InvalidColouring(m))) => {
                prop_assert!(!m.is_empty());
            }
            Err(CheckError::Clear(other)) => prop_assert!(false, "checking is not deciding: {other}"),
        }
    }

    /// Every valid trade is accepted, whatever its (valid) values.
    #[test]
    fn valid_trades_are_accepted(sent in valid_request()) {
        let bytes = sent.encode_to_vec();
        let accepted = request::check("bank-a", "r-1", &bytes);
        prop_assert!(accepted.is_ok(), "{:?} refused: {:?}", sent, accepted.err());
    }
}

/// A payload that is not a protobuf message, and one without a trade, are named as such.
#[test]
fn refusals_say_what_is_wrong() {
    let err = request::decode(&[0xff, 0xff, 0xff]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("the opened payload is not a ClearingRequest"),
        "{err}"
    );
    let err = request::decode(&ClearingRequest::default().encode_to_vec()).unwrap_err();
    assert_eq!(err.to_string(), "the ClearingRequest has no trade");
}

//! Any payload and metadata objects map, without panicking, to a spec-valid run event.

mod support;

use aether_lineage::{MappingContext, job_name, to_run_event};
use chrono::{TimeZone, Utc};
use proptest::prelude::*;
use serde_json::{Map, Value};
use support::{BASE, Chain, Spec, hex_of};
use uuid::Uuid;

use aether_lineage::job::EVENT_TYPES;

/// The payload and metadata members the mapping reads, so that they are hit often.
const KEYS: &[&str] = &[
    "target_snapshot",
    "restored",
    "rules_digest",
    "model_ref",
    "ref",
    "model_digest",
    "digest",
    "policy_digest",
    "policy_hooks",
    "hooks",
    "uri",
    "name",
    "corpus",
    "corpus_version",
    "artifact_uri",
    "baseline",
    "candidate",
    "rollout_event_id",
    "reason",
    "error",
    "message",
    "snapshot_id",
    "trace_id",
    "traceparent",
    "correlation_id",
    "causation_id",
];

fn event_type() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(EVENT_TYPES).prop_map(str::to_owned),
        1 => "[A-Za-z][A-Za-z0-9._-]{0,30}",
    ]
}

fn stream_id() -> impl Strategy<Value = String> {
    let prefix = proptest::sample::select(
        &[
            "engine/",
            "model/",
            "policy/",
            "corpus/",
            "rollout/",
            "clearing/",
            "snapshot",
            "ledger/",
            "x",
        ][..],
    );
    (prefix, "[A-Za-z0-9@._-]{0,16}").prop_map(|(p, rest)| format!("{p}{rest}"))
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-(1i64 << 53) + 1..(1i64 << 53)).prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        any::<u128>().prop_map(|n| Value::String(Uuid::from_u128(n).to_string())),
        any::<u128>().prop_map(|n| Value::String(Uuid::from_u128(n).to_string().to_uppercase())),
        proptest::sample::select(
            &[
                "",
                " ",
                "s3://bucket/key",
                "s3://bucket",
                "file:///models/m.bin",
                "https://h.test/p",
                "::",
                "aml_v2",
                "finmoe-7b-v3@sgp-region",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-xyz-1-1",
            ][..]
        )
        .prop_map(|s| Value::String(s.to_owned())),
        "\\PC{0,12}".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(KEYS).prop_map(str::to_owned),
        1 => "\\PC{0,8}",
    ]
}

fn value() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// An object: mostly members the mapping reads (scalars more often than not), plus others.
fn object() -> impl Strategy<Value = Value> {
    let read = prop_oneof![3 => leaf(), 1 => value()];
    (
        prop::collection::btree_map(
            proptest::sample::select(KEYS).prop_map(str::to_owned),
            read,
            0..8,
        ),
        prop::collection::btree_map(key(), value(), 0..4),
    )
        .prop_map(|(read, other)| {
            let mut object: Map<String, Value> = other.into_iter().collect();
            object.extend(read);
            Value::Object(object)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_events_map_to_spec_valid_run_events(
        event_type in event_type(),
        stream_id in stream_id(),
        event_id in any::<u128>(),
        payload in object(),
        metadata in object(),
        delta_version in any::<Option<i64>>(),
        clearing_decisions_version in any::<Option<i64>>(),
        seconds in 0i64..400_000_000,
    ) {
        let mut chain = Chain::default();
        // A genesis event first, so that prev_hash is a real hash too.
        chain.append("ledger/checkpoints", "CheckpointSigned", serde_json::json!({}), serde_json::json!({}));
        let recorded_at = Utc.with_ymd_and_hms(2020, 1, 1, 0, 0, 0).unwrap()
            + chrono::Duration::seconds(seconds);
        let event = chain.append_with_id(
            &stream_id, &event_type, Uuid::from_u128(event_id), recorded_at, payload, metadata,
        );
        let ctx = MappingContext { delta_version, clearing_decisions_version, ..MappingContext::new(BASE) };

        let run_event = to_run_event(&event, &ctx).expect("any objects map");
        let v = serde_json::to_value(&run_event).unwrap();
        if let Err(e) = Spec::get().check(&v) {
            return Err(TestCaseError::fail(format!("{e}\n{v:#}")));
        }
        prop_assert_eq!(&v["job"]["name"], job_name(&event_type));
        prop_assert_eq!(&v["run"]["facets"]["aether_ledger"]["hash"], &hex_of(&event.hash));
        let again = serde_json::to_value(to_run_event(&event, &ctx).unwrap()).unwrap();
        prop_assert_eq!(v, again);
    }
}

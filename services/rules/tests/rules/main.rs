//! Integration tests of `aether-rules`, in one binary (one link on a small machine).

mod digest;
mod evaluation;
mod examples;
mod hot_swap;
mod ingest;
mod lazy;
mod never_panics;

use std::path::PathBuf;
use std::sync::Arc;

use aether_rules::{Action, CompiledPolicy, PolicyDocument, RuleSpec, Severity};
use serde_json::{Value, json};

/// `services/rules/policies/NAME`.
pub fn policy_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("policies")
        .join(name)
}

/// The shipped `aml_v2` and `basel3_delta`, loaded from their files.
pub fn shipped_policies() -> (Arc<CompiledPolicy>, Arc<CompiledPolicy>) {
    let aml = CompiledPolicy::load(&policy_file("aml_v2.yaml")).expect("aml_v2.yaml compiles");
    let basel = CompiledPolicy::load(&policy_file("basel3_delta.yaml"))
        .expect("basel3_delta.yaml compiles");
    (Arc::new(aml), Arc::new(basel))
}

/// A trade that no shipped rule should stop: small, low-risk jurisdiction, well within
/// the counterparty's limit.
pub fn clean_request() -> Value {
    json!({
        "request_id": "req-42",
        "member": "member-a",
        "buyer": "member-a",
        "seller": "bank-b",
        "counterparty": "bank-b",
        "instrument": "XS0000000001",
        "currency": "EUR",
        "amount_minor": 50_000,
        "value_date": "2026-12-02",
        "jurisdiction": "SG",
        "counterparty_jurisdiction": "GB",
    })
}

pub fn clean_context() -> Value {
    json!({
        "limits": { "bank-b": 100_000_000, "bank-c": 5_000_000 },
        "exposure": { "bank-b": 20_000_000 },
        "recent": [
            { "amount_minor": 12_000, "age_seconds": 60 },
            { "amount_minor": 940_000, "age_seconds": 3_600 },
        ],
        "high_risk_jurisdictions": ["XX", "YY"],
        "reporting_threshold_minor": 1_000_000,
    })
}

/// `base` with `changes` merged in at the top level.
pub fn with(base: Value, changes: Value) -> Value {
    let mut out = base;
    if let (Some(out_map), Some(changes)) = (out.as_object_mut(), changes.as_object()) {
        for (k, v) in changes {
            out_map.insert(k.clone(), v.clone());
        }
    }
    out
}

/// A rule with the given id and expression (action hold, severity low, cites `c-1`).
pub fn rule(id: &str, expression: &str) -> RuleSpec {
    RuleSpec {
        id: id.to_string(),
        expression: expression.to_string(),
        action: Action::Hold,
        severity: Severity::Low,
        cites: vec!["c-1".to_string()],
    }
}

/// A policy named `name`, version 1.0.0, with `rules`.
pub fn document(name: &str, rules: Vec<RuleSpec>) -> PolicyDocument {
    PolicyDocument {
        name: name.to_string(),
        version: "1.0.0".to_string(),
        description: None,
        rules,
    }
}

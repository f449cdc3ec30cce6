//! The built-in sample `request` and `context` every rule is tried on at ingest.
//!
//! They hold every documented field (see the crate README), so a rule that reads a field
//! the schema lacks, or that returns something other than a bool, is rejected on ingest
//! rather than failing on live trades. Optional fields a rule guards with `has(...)` may be
//! absent here.

use serde_json::{Value, json};

/// A trade with every documented `request` field.
pub fn sample_request() -> Value {
    json!({
        "request_id": "req-0001",
        "member": "member-a",
        "buyer": "member-a",
        "seller": "bank-b",
        "counterparty": "bank-b",
        "instrument": "XS0000000001",
        "asset_class": "bond",
        "side": "buy",
        "currency": "EUR",
        "amount_minor": 1_250_000_i64,
        "quantity": 100,
        "price_minor": 12_500,
        "trade_date": "2026-11-30",
        "value_date": "2026-12-02",
        "jurisdiction": "SG",
        "counterparty_jurisdiction": "GB",
    })
}

/// A context with every documented `context` field; maps are keyed by the sample
/// request's counterparty.
pub fn sample_context() -> Value {
    json!({
        "limits": { "bank-b": 100_000_000_i64 },
        "exposure": { "bank-b": 20_000_000_i64 },
        "recent": [
            { "request_id": "req-0000", "amount_minor": 950_000, "age_seconds": 600, "counterparty": "bank-b", "currency": "EUR" },
            { "request_id": "req-ffff", "amount_minor": 10_000, "age_seconds": 7_200, "counterparty": "bank-c", "currency": "EUR" }
        ],
        "high_risk_jurisdictions": ["XX", "YY"],
        "reporting_threshold_minor": 1_000_000_i64,
        "now": "2026-11-30T12:00:00Z",
    })
}

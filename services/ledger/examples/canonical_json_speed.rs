//! RFC 8785 canonicalisation speed on clearing-like payloads: the ledger's one-pass
//! canonicaliser against `serde_jcs` and plain (non-canonical) `serde_json`.
//!
//! `cargo run --release -p aether-ledger --example canonical_json_speed`

use std::time::Instant;

fn payload(n: u64) -> serde_json::Value {
    let mut v = serde_json::json!({
        "request_id": format!("req-{n:012}"),
        "member": "member-0042",
        "decision": "cleared",
        "amount_minor": 125_000_000 + n,
        "currency": "SGD",
        "score": 0.1234,
        "nested": {"b": [1, 2.5, "x\u{1}y"], "a": null, "é": true},
    });
    v["pad"] = serde_json::Value::String("x".repeat(380));
    v
}

fn time(
    name: &str,
    values: &[serde_json::Value],
    rounds: usize,
    f: impl Fn(&serde_json::Value) -> usize,
) {
    let started = Instant::now();
    let mut bytes = 0;
    for _ in 0..rounds {
        bytes += values.iter().map(&f).sum::<usize>();
    }
    let per = started.elapsed().as_secs_f64() * 1e6 / (rounds * values.len()) as f64;
    println!("{name:<28} {per:>6.2} µs per payload ({bytes} bytes written)");
}

fn main() {
    let values: Vec<_> = (0..1_000).map(payload).collect();
    for v in &values {
        assert_eq!(
            aether_ledger::hashing::canonical_json(v).ok(),
            serde_jcs::to_string(v).ok()
        );
    }
    for _ in 0..2 {
        time("aether_ledger canonical_json", &values, 200, |v| {
            aether_ledger::hashing::canonical_json(v).map_or(0, |s| s.len())
        });
        time("serde_jcs", &values, 200, |v| {
            serde_jcs::to_string(v).map_or(0, |s| s.len())
        });
        time("serde_json (not canonical)", &values, 200, |v| {
            serde_json::to_string(v).map_or(0, |s| s.len())
        });
    }
}

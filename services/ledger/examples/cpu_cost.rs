use aether_ledger::hashing::{HashedFields, canonical_json, event_hash};
use std::time::Instant;
fn main() {
    let payload = serde_json::json!({"request_id": "req-000000000001", "member": "member-0042", "decision": "cleared", "amount_minor": 125000001, "currency": "SGD", "score": 0.1234, "pad": "x".repeat(380)});
    let n = 100_000;
    let t = Instant::now();
    let mut total = 0;
    for _ in 0..n {
        total += canonical_json(&payload).unwrap().len();
    }
    println!(
        "jcs: {:.2} us/event ({total})",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    let text = canonical_json(&payload).unwrap();
    let t = Instant::now();
    let mut h = [0u8; 32];
    for i in 0..n {
        h = event_hash(
            &h,
            &HashedFields {
                seq: i,
                stream_id: "clearing/member-0001",
                stream_version: i,
                event_id: uuid::Uuid::nil(),
                event_type: "ClearingDecided",
                schema_version: 1,
                payload: &text,
                metadata: "{}",
                recorded_at: chrono::Utc::now(),
            },
        );
    }
    println!(
        "hash: {:.2} us/event",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    let t = Instant::now();
    for _ in 0..n {
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        std::hint::black_box(v);
    }
    println!(
        "parse: {:.2} us/event",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
}

//! What every bench report shares: event payloads of a given size, percentiles, units.

use std::time::Duration;

/// Serialised size of [`payload`] without its padding (the `"pad"` member included).
const PAYLOAD_BASE_BYTES: usize = 134 + 10;

pub fn payload(bytes: usize, n: u64) -> serde_json::Value {
    // A clearing-decision-like object padded to about `bytes` canonical bytes. The size is
    // a constant rather than measured per event: serialising each payload an extra time
    // would be the bench's cost, not the ledger's.
    let mut obj = serde_json::json!({
        "request_id": format!("req-{n:012}"),
        "member": "member-0042",
        "decision": "cleared",
        "amount_minor": 125_000_000 + n,
        "currency": "SGD",
        "score": 0.1234,
    });
    obj["pad"] = serde_json::Value::String("x".repeat(bytes.saturating_sub(PAYLOAD_BASE_BYTES)));
    obj
}

pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Bytes in MiB, for printing.
pub fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_payloads_have_the_size_asked_for() {
        for bytes in [500, 2_000] {
            let text = payload(bytes, 42).to_string();
            assert!(text.len().abs_diff(bytes) <= 1, "{bytes}: {}", text.len());
        }
    }
}

//! A clearing worker scoring on an NVIDIA GPU decides as a CPU worker does. Runs only with
//! the `cuda` feature, against an `aether` built with `--features cuda`, on a machine with
//! a GPU: `cargo build -p aether --features cuda && cargo test -p aether-e2e --features cuda
//! --test clearing_cuda_e2e`.

use std::collections::BTreeMap;

use aether_e2e::Server;
use aether_e2e::clearing::{WorkerProcess, activate, client, decisions, trade};
use aether_gateway::pb::v1::ClearingRequest;
use serde_json::Value;

/// Ordinary trades and ones the reference model or the policy flags: several currencies,
/// jurisdictions and counterparty tiers, amounts from 1.00 to 2,000,000,000.00.
fn trades() -> Vec<ClearingRequest> {
    let mut all = Vec::new();
    let amounts = [
        100,
        9_500_000,
        50_000,
        99_999_900,
        12_345_678,
        200_000_000_000,
    ];
    let places = [("SGD", "SG"), ("USD", "US"), ("JPY", "JP"), ("EUR", "DE")];
    for (i, amount) in amounts.iter().enumerate() {
        for (j, (currency, jurisdiction)) in places.iter().enumerate() {
            let mut request = trade(*amount);
            if let Some(t) = request.trade.as_mut() {
                t.currency = (*currency).into();
                t.jurisdiction = (*jurisdiction).into();
                t.counterparty_tier = u32::try_from((i + j) % 5 + 1).unwrap_or(1);
            }
            all.push(request);
        }
    }
    all
}

fn by_request(decisions: Vec<Value>) -> BTreeMap<String, Value> {
    decisions
        .into_iter()
        .map(|d| (d["payload"]["request_id"].as_str().unwrap().to_owned(), d))
        .collect()
}

fn number(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the `cuda` feature, an aether built with it, and an NVIDIA GPU"
)]
async fn a_cuda_worker_decides_each_trade_as_a_cpu_worker_does() {
    let dir = tempfile::tempdir().unwrap();
    let cpu_data = dir.path().join("cpu");
    let cuda_data = dir.path().join("cuda");
    let no_local = [("AETHER_NO_LOCAL_WORKERS", "true")];
    let on_cpu = Server::start(&cpu_data, &no_local);
    let on_cuda = Server::start(&cuda_data, &no_local);
    activate(&on_cpu).await;
    activate(&on_cuda).await;
    let _cpu_worker = WorkerProcess::start_on(&on_cpu, &cpu_data, "worker-1", "cpu");
    let _cuda_worker = WorkerProcess::start_on(&on_cuda, &cuda_data, "worker-1", "cuda");
    let mut to_cpu = client(&on_cpu, &cpu_data, "bank-a").await;
    let mut to_cuda = client(&on_cuda, &cuda_data, "bank-a").await;

    // Each trade goes to both gateways in turn, so each scores it with the same context
    // (the member's trades in the last minute, the hour).
    let trades = trades();
    for (i, request) in trades.iter().enumerate() {
        let id = format!("req-{i}");
        let a = to_cpu.submit(&id, request).await.unwrap();
        let b = to_cuda.submit(&id, request).await.unwrap();
        assert_eq!(a.decision, b.decision, "{id}: cpu {a:?}, cuda {b:?}");
    }

    let cpu = by_request(decisions(&on_cpu).await);
    let cuda = by_request(decisions(&on_cuda).await);
    assert_eq!(cpu.len(), trades.len());
    assert_eq!(cuda.len(), trades.len());
    let mut outcomes = std::collections::BTreeSet::new();
    for (id, a) in &cpu {
        let (a, b) = (&a["payload"], &cuda[id]["payload"]);
        assert_eq!(a["device"], "cpu", "{a}");
        assert_eq!(b["device"], "cuda:0", "{b}");
        assert_eq!(a["decision"], b["decision"], "{id}: {a} / {b}");
        for field in ["score", "confidence"] {
            let gap = (number(&a[field]) - number(&b[field])).abs();
            assert!(
                gap <= 1e-4,
                "{id}: {field} cpu {} cuda {}",
                a[field],
                b[field]
            );
        }
        outcomes.insert(a["decision"].as_str().unwrap().to_owned());
    }
    // Not only the easy case: the set holds trades the model or the policy stops.
    assert!(
        outcomes.len() >= 2,
        "every trade had one outcome: {outcomes:?}"
    );
}

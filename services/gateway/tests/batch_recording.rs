//! How a scored batch reaches the ledger: its `NettingComputed` and the decisions of its
//! trades in one atomic append, on a real SQLite ledger with the reference model in process.

use std::sync::Arc;
use std::time::Duration;

use aether_gateway::batcher::{
    Batcher, BatcherConfig, Job, ModelHandle, NETTING_COMPUTED, NETTING_STREAM,
};
use aether_gateway::workers::WorkerPool;
use aether_gpu_worker::reference;
use aether_gpu_worker::{ClearingModel, DeviceChoice, Trade, TradeContext};
use aether_ledger::{EventStore, NewEvent, StoreConfig};
use chrono::NaiveDate;
use serde_json::json;
use tokio::sync::oneshot;

fn trade(request_id: &str) -> Trade {
    Trade {
        request_id: request_id.into(),
        member_id: "bank-a".into(),
        buyer: "bank-a".into(),
        seller: "bank-b".into(),
        instrument: "SGX:D05".into(),
        currency: "SGD".into(),
        amount_minor: 125_000,
        value_date: NaiveDate::from_ymd_opt(2026, 12, 3).unwrap(),
        jurisdiction: "SG".into(),
        counterparty_tier: 2,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_records_its_netting_with_the_decisions_of_the_trades_still_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let store = EventStore::connect(&url, StoreConfig::default())
        .await
        .unwrap();
    let saved = reference::install(&dir.path().join("model")).unwrap();
    let model = ClearingModel::load(&saved.weights_path, &saved.digest, DeviceChoice::Cpu).unwrap();
    let batcher = Batcher::start(
        BatcherConfig {
            // Long enough that the three trades below share one batch.
            max_delay: Duration::from_millis(200),
            ..BatcherConfig::default()
        },
        store.clone(),
        WorkerPool::default(),
    );
    let handle = ModelHandle::loaded(Arc::new(model));
    let context = TradeContext {
        hour_utc: 10,
        velocity: 1,
    };
    let mut scored = Vec::new();
    for id in ["r-1", "r-2", "r-3"] {
        let (reply, answer) = oneshot::channel();
        batcher
            .submit(Job {
                model: handle.clone(),
                trade: trade(id),
                context,
                reply,
                observed: None,
                explain: false,
                explain_at_or_above: None,
                traceparent: String::new(),
                baggage: String::new(),
                queued_at: None,
            })
            .unwrap();
        scored.push(answer);
    }
    let mut scored: Vec<_> = futures::future::join_all(scored)
        .await
        .into_iter()
        .map(|s| s.unwrap().unwrap())
        .collect();
    assert!(scored.iter().all(|s| s.batch_size == 3), "one batch");

    // r-3's caller gave up after scoring; r-1 and r-2 decide, to two streams.
    let third = scored.pop().unwrap();
    drop(third);
    let second = scored.pop().unwrap();
    let first = scored.pop().unwrap();
    let decision = |id: &str| NewEvent::new("ClearingDecided", json!({"request_id": id}));
    let (a, b) = tokio::join!(
        first
            .recorder
            .record("clearing/bank-a".into(), decision("r-1")),
        second
            .recorder
            .record("clearing/bank-b".into(), decision("r-2")),
    );
    let (a, b) = (a.unwrap(), b.unwrap());

    // One append: the netting first, then the decisions, consecutive and at one time.
    let events = store.read_all(0, 100).await.unwrap();
    let kinds: Vec<(&str, &str)> = events
        .iter()
        .map(|e| (e.stream_id.as_str(), e.event_type.as_str()))
        .collect();
    assert_eq!(
        kinds,
        [
            (NETTING_STREAM, NETTING_COMPUTED),
            ("clearing/bank-a", "ClearingDecided"),
            ("clearing/bank-b", "ClearingDecided"),
        ]
    );
    assert_eq!((a.seq, b.seq), (events[1].seq, events[2].seq));
    assert!(events.iter().all(|e| e.recorded_at == a.recorded_at));
    // The netting covers the whole batch, the trade given up included.
    let netting = events[0].payload_value().unwrap();
    assert_eq!(netting["trades"], 3);
    assert_eq!(
        netting["request_ids"],
        json!(["bank-a/r-1", "bank-a/r-2", "bank-a/r-3"])
    );
    assert_eq!(netting["batch_id"], first.batch_id.to_string());
    store.shutdown().await;
}

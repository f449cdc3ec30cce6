//! A scoring batch (its `NettingComputed` event and the `ClearingDecided` events appended
//! with it) is one OpenLineage record, on SQLite and on PostgreSQL: one `clearing.batch` run
//! naming every decision, found from any of its seqs, even when the relay's page of 500
//! events ends inside the batch; and lineage reconciliation counts each seq as covered.

use aether_ledger::testing::TestDatabase;
use aether_ledger::{AppendToStream, EventStore, ExpectedVersion, NewEvent, StoreConfig};
use aether_lineage::relay::{reconcile, record};
use serde_json::{Value, json};

mod support;
use support::{Spec, TempData, append_policies, open_sqlite_ledger, write_records};

/// Appends a scoring batch as the gateway does: its netting and `decisions` decisions (over
/// two members' streams) in one atomic append. Returns the netting's seq.
async fn append_batch(store: &EventStore, batch_id: &str, decisions: usize) -> u64 {
    let mut appends = vec![AppendToStream {
        stream_id: "clearing/netting".into(),
        expected: ExpectedVersion::Any,
        events: vec![NewEvent::new(
            "NettingComputed",
            json!({"batch_id": batch_id, "trades": decisions, "model_ref": "finmoe-7b-v3@sgp-region",
                   "model_digest": "a1b2"}),
        )],
    }];
    for member in ["bank-a", "bank-b"] {
        let events = (0..decisions)
            .filter(|i| (i % 2 == 0) == (member == "bank-a"))
            .map(|i| {
                NewEvent::new(
                    "ClearingDecided",
                    json!({"batch_id": batch_id, "request_id": format!("{batch_id}-{i}"),
                           "member": member, "decision": "cleared",
                           "model_ref": "finmoe-7b-v3@sgp-region", "model_digest": "a1b2"}),
                )
                .with_metadata(
                    json!({"request_id": format!("{batch_id}-{i}"), "member": member,
                                      "trace_id": format!("trace-{batch_id}-{i}")}),
                )
            })
            .collect::<Vec<_>>();
        if !events.is_empty() {
            appends.push(AppendToStream {
                stream_id: format!("clearing/{member}"),
                expected: ExpectedVersion::Any,
                events,
            });
        }
    }
    let committed = store.append_multi(appends).await.expect("append the batch");
    committed[0].seq
}

/// The ledger: 480 policies, a batch of 40 decisions across the relay's page end at 500,
/// a policy, a netting whose decisions all failed, a decision that names another batch right
/// after it, and a batch of 3 at the head.
async fn scenario(store: &EventStore) {
    append_policies(store, 0, 480).await;
    assert_eq!(append_batch(store, "b-40", 40).await, 481);
    append_policies(store, 480, 1).await;
    assert_eq!(append_batch(store, "b-none", 0).await, 523);
    store
        .append(
            "clearing/bank-c",
            ExpectedVersion::Any,
            vec![
                NewEvent::new(
                    "ClearingDecided",
                    json!({"batch_id": "b-other", "request_id": "lone", "decision": "held"}),
                )
                .with_metadata(json!({"request_id": "lone"})),
            ],
        )
        .await
        .expect("append");
    assert_eq!(append_batch(store, "b-3", 3).await, 525);
    write_records(store).await;

    // The batch across the page end: one record, found from each of its seqs.
    let batch = record(store, 481)
        .await
        .expect("read")
        .expect("the batch's record");
    assert_eq!((batch.seq, batch.last_seq), (481, 521));
    let run = &batch.openlineage_event;
    assert_eq!(run["job"]["name"], "clearing.batch");
    assert_eq!(run["eventType"], "COMPLETE");
    assert_eq!(run["run"]["facets"]["aether_ledger"]["seq"], 481);
    assert_eq!(
        run["run"]["facets"]["aether_ledger"]["event_type"],
        "NettingComputed"
    );
    let facet = &run["run"]["facets"]["aether_clearing_batch"];
    assert_eq!(facet["batch_id"], "b-40");
    let listed = facet["decisions"].as_array().expect("decisions");
    let events = store.read_all(482, 40).await.expect("read the decisions");
    assert_eq!(listed.len(), 40);
    for (entry, event) in listed.iter().zip(&events) {
        assert_eq!(entry["seq"], event.seq);
        assert_eq!(entry["event_id"], event.event_id.to_string());
        assert_eq!(entry["stream_id"], event.stream_id);
        assert_eq!(entry["hash"], aether_ledger::hashing::to_hex(&event.hash));
        let request: Value = serde_json::from_str(event.metadata.get()).expect("metadata");
        assert_eq!(entry["request_id"], request["request_id"]);
        assert_eq!(
            entry["trace_id"],
            json!(format!(
                "trace-{}",
                request["request_id"].as_str().expect("id")
            ))
        );
    }
    for seq in [482, 500, 501, 521] {
        let r = record(store, seq).await.expect("read").expect("covered");
        assert_eq!((r.seq, r.last_seq, &r.run_id), (481, 521, &batch.run_id));
    }
    // The decisions table is an output (no Delta sink here: unversioned), the model an input.
    let names = |side: &str| -> Vec<String> {
        run[side]
            .as_array()
            .expect("datasets")
            .iter()
            .map(|d| format!("{}/{}", d["namespace"], d["name"]).replace('"', ""))
            .collect()
    };
    assert_eq!(names("inputs"), ["aether://model/finmoe-7b-v3@sgp-region"]);
    assert_eq!(
        names("outputs"),
        ["delta/clearing_decisions", "delta/events"]
    );
    Spec::get().check(run).expect("a valid run event");

    // Events outside a batch keep a record of their own.
    let policy = record(store, 522).await.expect("read").expect("record");
    assert_eq!((policy.seq, policy.last_seq), (522, 522));
    let empty = record(store, 523).await.expect("read").expect("record");
    assert_eq!((empty.seq, empty.last_seq), (523, 523));
    assert_eq!(
        empty.openlineage_event["run"]["facets"]["aether_clearing_batch"]["decisions"],
        json!([])
    );
    let lone = record(store, 524).await.expect("read").expect("record");
    assert_eq!((lone.seq, lone.last_seq), (524, 524));
    assert_eq!(
        lone.openlineage_event["run"]["facets"]["aether_ledger"]["seq"],
        524
    );
    let head = record(store, 528)
        .await
        .expect("read")
        .expect("the head batch");
    assert_eq!((head.seq, head.last_seq), (525, 528));
    assert!(record(store, 529).await.expect("read").is_none());

    let report = reconcile(store).await.expect("reconcile");
    assert_eq!(report.events, 528);
    assert!(report.missing_openlineage.is_empty(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoring_batch_is_one_record_on_sqlite() {
    let dir = TempData::new("batch-records");
    let store = open_sqlite_ledger(&dir.0).await;
    scenario(&store).await;
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scoring_batch_is_one_record_on_postgres() {
    let db = TestDatabase::create().await;
    let store = EventStore::connect(&db.url, StoreConfig::default())
        .await
        .expect("open the ledger");
    scenario(&store).await;
    let pool = store.postgres_pool().expect("PostgreSQL").clone();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM lineage_records")
        .fetch_one(&pool)
        .await
        .expect("count");
    // 481 policies, the batch of 40, the empty netting, the lone decision, the batch of 3.
    assert_eq!(rows, 481 + 1 + 1 + 1 + 1);
    store.shutdown().await;
    pool.close().await;
    db.drop_database().await;
}

//! The policy registry on a real ledger (SQLite file and PostgreSQL): ingest, refusals
//! recorded, hot swap, and the same state after a restart.

use aether_control::{IngestError, Origin, PolicyRegistry, policies::REJECTIONS_STREAM};
use aether_ledger::testing::TestDatabase;
use aether_ledger::{Direction, EventStore, StoreConfig};
use aether_rules::PolicyFormat;
use serde_json::json;

fn example(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rules/policies")
        .join(format!("{name}.yaml"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn trade(amount_minor: i64) -> serde_json::Value {
    json!({"member": "m-1", "buyer": "b", "seller": "s", "instrument": "SGD-IRS-5Y",
           "currency": "SGD", "amount_minor": amount_minor, "value_date": "2026-12-02",
           "jurisdiction": "SG", "counterparty": "cp-1"})
}

async fn scenario(url: &str) {
    let store = EventStore::connect(url, StoreConfig::default())
        .await
        .unwrap();
    let registry = PolicyRegistry::load(store.clone()).await.unwrap();
    let (record, committed) = registry
        .ingest(
            &example("aml_v2"),
            PolicyFormat::Yaml,
            &Origin::from("operator:alice"),
        )
        .await
        .unwrap();
    assert_eq!(
        (record.name.as_str(), record.version.as_str()),
        ("aml_v2", "2.0.0")
    );
    let committed = committed.expect("a new version is an event");
    assert_eq!(committed.stream_id, "policy/aml_v2");
    let event = store.read_all(committed.seq, 1).await.unwrap().remove(0);
    assert_eq!(event.payload_value().unwrap()["digest"], record.digest);
    assert_eq!(event.metadata_value().unwrap()["actor"], "operator:alice");

    // The hot-swapped engine evaluates the policy.
    let context = aether_rules::sample_context();
    let eval = registry
        .engine()
        .evaluate(&trade(2_000_000_000), &context, &["aml_v2"])
        .unwrap();
    assert_eq!(eval.decision, aether_rules::Action::Hold, "{eval:?}");

    // Identical re-ingest: nothing new on the ledger.
    let head = store.head().await.unwrap();
    let (again, none) = registry
        .ingest(
            &example("aml_v2"),
            PolicyFormat::Yaml,
            &Origin::from("operator:alice"),
        )
        .await
        .unwrap();
    assert!(none.is_none());
    assert_eq!(again, record);
    assert_eq!(store.head().await.unwrap(), head);

    // Same version, different rules: refused and recorded; nothing else changes.
    let changed = example("aml_v2").replace("severity: medium", "severity: low");
    let err = registry
        .ingest(&changed, PolicyFormat::Yaml, &Origin::from("operator:bob"))
        .await
        .unwrap_err();
    assert!(matches!(err, IngestError::VersionExists { .. }), "{err}");
    // Invalid CEL: refused with its position and recorded.
    let broken = example("aml_v2")
        .replace("version: 2.0.0", "version: 2.1.0")
        .replace(
            "request.amount_minor >= context.reporting_threshold_minor",
            "request.amount_minor >= (",
        );
    let err = registry
        .ingest(&broken, PolicyFormat::Yaml, &Origin::from("operator:bob"))
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("rule \"reporting-threshold\": syntax error at line 1, column"),
        "{message}"
    );
    let rejections = store
        .read_stream(REJECTIONS_STREAM, 1, Direction::Forward, 10)
        .await
        .unwrap();
    assert_eq!(rejections.len(), 2);
    let last = rejections[1].payload_value().unwrap();
    assert!(
        last["reason"].as_str().unwrap().contains("syntax error"),
        "{last}"
    );
    assert_eq!(
        rejections[1].metadata_value().unwrap()["actor"],
        "operator:bob"
    );
    assert_eq!(store.stream_version("policy/aml_v2").await.unwrap(), 1);
    assert_eq!(registry.versions("aml_v2").unwrap().len(), 1);

    // A new version and a second policy.
    let v21 = example("aml_v2").replace("version: 2.0.0", "version: 2.1.0");
    registry
        .ingest(&v21, PolicyFormat::Yaml, &Origin::from("operator:alice"))
        .await
        .unwrap();
    registry
        .ingest(
            &example("basel3_delta"),
            PolicyFormat::Yaml,
            &Origin::from("operator:alice"),
        )
        .await
        .unwrap();
    let digest_before = registry.engine().snapshot().digest();

    // After a restart the projection and the engine are the same, from the ledger alone.
    store.shutdown().await;
    let store = EventStore::connect(url, StoreConfig::default())
        .await
        .unwrap();
    let reloaded = PolicyRegistry::load(store.clone()).await.unwrap();
    assert_eq!(reloaded.policies(), registry.policies());
    assert_eq!(reloaded.engine().snapshot().digest(), digest_before);
    let versions: Vec<String> = reloaded
        .versions("aml_v2")
        .unwrap()
        .into_iter()
        .map(|r| r.version)
        .collect();
    assert_eq!(versions, vec!["2.0.0", "2.1.0"]);
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    scenario(&format!("sqlite:{}", dir.path().join("l.db").display())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_on_postgres() {
    let db = TestDatabase::create().await;
    scenario(&db.url).await;
    db.drop_database().await;
}

//! Time travel on a real ledger (SQLite file and PostgreSQL): the state rebuilt up to a seq
//! equals the live state at that moment, writes nothing, and names the snapshot in force.

use aether_control::{
    ActivationRequest, Command, ControlState, CorpusIngest, ModelSpec, Origin, RolloutRequest,
    SNAPSHOT_COMMITTED, SNAPSHOT_STREAM,
};
use aether_ledger::testing::TestDatabase;
use aether_ledger::{EventStore, ExpectedVersion, NewEvent, StoreConfig};
use aether_rules::PolicyFormat;
use serde_json::json;

async fn head(store: &EventStore) -> u64 {
    store.head().await.unwrap().map_or(0, |(s, _)| s)
}

/// Clearing and access traffic between control changes, as in a real ledger.
async fn noise(store: &EventStore, n: u64) {
    for i in 0..n {
        let stream = if i % 2 == 0 {
            "clearing/m-1"
        } else {
            "access/audit"
        };
        store
            .append(
                stream,
                ExpectedVersion::Any,
                vec![NewEvent::new("ClearingDecided", json!({ "n": i }))],
            )
            .await
            .unwrap();
    }
}

fn model(dir: &std::path::Path, name: &str) -> ModelSpec {
    let path = dir.join(format!("{name}.bin"));
    std::fs::write(&path, name.as_bytes()).unwrap();
    ModelSpec {
        model_ref: format!("finmoe-7b-{name}@sgp-region"),
        uri: path.display().to_string(),
        digest: hex::encode(aether_ledger::hashing::sm3(name.as_bytes())),
        feature_schema: json!({"amount_minor": "int"}).as_object().unwrap().clone(),
    }
}

async fn scenario(url: &str, dir: &std::path::Path) {
    let op = Origin::from("operator:a");
    let store = EventStore::connect(url, StoreConfig::default())
        .await
        .unwrap();
    let live = ControlState::replay(&store).await.unwrap();
    // (seq, live digest) after each change.
    let mut moments = vec![(0, live.digest())];
    noise(&store, 3).await;
    let mark = async |live: &ControlState, moments: &mut Vec<(u64, String)>| {
        moments.push((head(&store).await, live.digest()));
        noise(&store, 3).await;
    };

    let aml = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules/policies/aml_v2.yaml"),
    )
    .unwrap();
    live.policies
        .ingest(&aml, PolicyFormat::Yaml, &op)
        .await
        .unwrap();
    mark(&live, &mut moments).await;
    let v2 = aml.replace("version: 2.0.0", "version: 2.1.0");
    live.policies
        .ingest(&v2, PolicyFormat::Yaml, &op)
        .await
        .unwrap();
    // A refused ingest is recorded but changes nothing.
    assert!(
        live.policies
            .ingest("name: [", PolicyFormat::Yaml, &op)
            .await
            .is_err()
    );
    mark(&live, &mut moments).await;
    live.models.register(model(dir, "v3"), &op).await.unwrap();
    live.models.register(model(dir, "v4"), &op).await.unwrap();
    mark(&live, &mut moments).await;
    let (_, task) = live
        .engines
        .request_activation(
            ActivationRequest {
                model_ref: "finmoe-7b-v3@sgp-region".into(),
                traffic_weight: 0.5,
                policy_hooks: vec!["aml_v2".into()],
            },
            &op,
        )
        .await
        .unwrap();
    task.await.unwrap();
    mark(&live, &mut moments).await;
    let (rollout, _) = live
        .rollouts
        .start(
            RolloutRequest {
                baseline: "finmoe-7b-v3@sgp-region".into(),
                candidate: "finmoe-7b-v4@sgp-region".into(),
                steps: vec![10, 50, 100],
                analysis: Default::default(),
                automated: false,
            },
            &op,
        )
        .await
        .unwrap();
    live.rollouts
        .command(&rollout.id, Command::Step, None, None, &op)
        .await
        .unwrap();
    mark(&live, &mut moments).await;
    let snapshot = store
        .append(
            SNAPSHOT_STREAM,
            ExpectedVersion::Any,
            vec![NewEvent::new(
                SNAPSHOT_COMMITTED,
                json!({"id": "snap-1", "rules_digest": "00"}),
            )],
        )
        .await
        .unwrap()
        .remove(0);
    live.rollouts
        .command(&rollout.id, Command::Step, None, None, &op)
        .await
        .unwrap();
    mark(&live, &mut moments).await;
    live.corpora
        .ingest(
            CorpusIngest {
                name: "mas-notices".into(),
                documents: serde_json::from_value(json!([{"id": "notice-626",
                    "text": "# Notice 626\n\n## Reporting\n\nReport suspicious trades.\n"}]))
                .unwrap(),
                replace: false,
            },
            &op,
        )
        .await
        .unwrap();
    mark(&live, &mut moments).await;
    // An activation that a crash cut short: requested, never finished.
    store
        .append(
            "engine/apac-region",
            ExpectedVersion::NoStream,
            vec![NewEvent::new(
                "EngineActivationRequested",
                json!({"model_ref": "finmoe-7b-v3@apac-region", "traffic_weight": 0.5, "policy_hooks": []}),
            )],
        )
        .await
        .unwrap();
    let interrupted = head(&store).await;

    let before = head(&store).await;
    for (seq, digest) in &moments {
        let past = ControlState::replay_until(&store, *seq).await.unwrap();
        assert_eq!(past.seq(), *seq);
        assert_eq!(&past.digest(), digest, "state at seq {seq}");
        // Events other than control ones after it change nothing.
        let later = ControlState::replay_until(&store, seq + 2).await.unwrap();
        assert_eq!(&later.digest(), digest, "state at seq {}", seq + 2);
        let expected_snapshot = (*seq >= snapshot.seq).then_some(snapshot.seq);
        assert_eq!(past.snapshot().map(|e| e.seq), expected_snapshot);
    }
    // Seq 0 is the empty state; v1 of the policy alone at the first moment.
    let empty = ControlState::replay_until(&store, 0)
        .await
        .unwrap()
        .document();
    assert_eq!(empty["policies"], json!({}));
    assert_eq!(empty["engines"], json!([]));
    let first = ControlState::replay_until(&store, moments[1].0)
        .await
        .unwrap()
        .document();
    assert_eq!(first["policies"]["aml_v2"][0]["version"], "2.0.0");
    assert_eq!(first["policies"]["aml_v2"].as_array().unwrap().len(), 1);
    let stepped = ControlState::replay_until(&store, moments[6].0)
        .await
        .unwrap()
        .document();
    assert_eq!(stepped["rollouts"][0]["candidate_weight"], 50);

    // The interrupted activation is shown as it was, and nothing closes it.
    let at_crash = ControlState::replay_until(&store, interrupted)
        .await
        .unwrap()
        .document();
    let apac = at_crash["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["region"] == "apac-region")
        .unwrap();
    assert_eq!(apac["status"], "activating");
    assert_eq!(
        head(&store).await,
        before,
        "time travel wrote to the ledger"
    );

    // At the head it is the replay of everything.
    let now = ControlState::replay(&store).await.unwrap();
    let at_head = ControlState::replay_until(&store, before).await.unwrap();
    assert_eq!(at_head.digest(), now.digest());
    assert_eq!(
        ControlState::replay_until(&store, u64::MAX)
            .await
            .unwrap()
            .digest(),
        now.digest()
    );
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_travel_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    scenario(
        &format!("sqlite:{}", dir.path().join("l.db").display()),
        dir.path(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_travel_on_postgres() {
    let dir = tempfile::tempdir().unwrap();
    let db = TestDatabase::create().await;
    scenario(&db.url, dir.path()).await;
    db.drop_database().await;
}

/// Time travel runs inside HTTP handlers, so its future must be `Send` (checked when this
/// file compiles).
#[allow(dead_code)]
fn replay_until_is_send(store: &EventStore) {
    fn send<T: Send>(_: T) {}
    send(ControlState::replay_until(store, 0));
}

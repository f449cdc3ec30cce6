//! Models and engine activation on a real ledger (SQLite file and PostgreSQL).

use aether_control::{
    ActivationRequest, EngineError, EngineRegistry, EngineStatus, ModelError, ModelRegistry,
    ModelSpec, Origin, PolicyRegistry,
};
use aether_ledger::testing::TestDatabase;
use aether_ledger::{EventStore, ExpectedVersion, NewEvent, StoreConfig};
use aether_rules::PolicyFormat;
use serde_json::json;

fn spec(model_ref: &str, path: &std::path::Path, bytes: &[u8]) -> ModelSpec {
    std::fs::write(path, bytes).unwrap();
    ModelSpec {
        model_ref: model_ref.into(),
        uri: format!("file://{}", path.display()),
        digest: hex::encode(aether_ledger::hashing::sm3(bytes)),
        feature_schema: json!({"amount_minor": "int", "jurisdiction": "string"})
            .as_object()
            .unwrap()
            .clone(),
    }
}

fn request(model_ref: &str, weight: f64, hooks: &[&str]) -> ActivationRequest {
    ActivationRequest {
        model_ref: model_ref.into(),
        traffic_weight: weight,
        policy_hooks: hooks.iter().map(|s| s.to_string()).collect(),
    }
}

async fn scenario(url: &str, dir: &std::path::Path) {
    let store = EventStore::connect(url, StoreConfig::default())
        .await
        .unwrap();
    let models = ModelRegistry::load(store.clone()).await.unwrap();
    let policies = PolicyRegistry::load(store.clone()).await.unwrap();
    let engines = EngineRegistry::load(store.clone(), models.clone(), policies.clone())
        .await
        .unwrap();
    let aml = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules/policies/aml_v2.yaml"),
    )
    .unwrap();
    policies
        .ingest(&aml, PolicyFormat::Yaml, &Origin::from("operator:a"))
        .await
        .unwrap();

    // Registration checks.
    let good = spec(
        "finmoe-7b-v3@sgp-region",
        &dir.join("model.bin"),
        b"weights v3",
    );
    assert!(
        models
            .register(good.clone(), &Origin::from("operator:a"))
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        models
            .register(good.clone(), &Origin::from("operator:a"))
            .await
            .unwrap()
            .is_none(),
        "identical repeat"
    );
    let mut other = good.clone();
    other.digest = "00".repeat(32);
    assert!(matches!(
        models.register(other, &Origin::from("operator:a")).await,
        Err(ModelError::AlreadyRegistered(_))
    ));
    let mut wrong = spec(
        "finmoe-7b-v4@sgp-region",
        &dir.join("v4.bin"),
        b"weights v4",
    );
    wrong.digest = "11".repeat(32);
    assert!(matches!(
        models.register(wrong, &Origin::from("operator:a")).await,
        Err(ModelError::DigestMismatch { .. })
    ));
    let bad_ref = spec("no-region", &dir.join("x.bin"), b"x");
    assert!(matches!(
        models.register(bad_ref, &Origin::from("operator:a")).await,
        Err(ModelError::BadRef(_))
    ));

    // Bad requests change nothing.
    for (req, what) in [
        (
            request("finmoe-7b-v3@sgp-region", 0.0, &["aml_v2"]),
            "zero weight",
        ),
        (
            request("finmoe-7b-v3@sgp-region", 1.5, &["aml_v2"]),
            "weight over 1",
        ),
        (
            request("finmoe-7b-v3@sgp-region", f64::NAN, &["aml_v2"]),
            "NaN weight",
        ),
        (request("finmoe-7b-v3", 0.5, &["aml_v2"]), "no region"),
        (
            request("finmoe-7b-v3@sgp-region", 0.5, &["aml_v2", "aml_v2"]),
            "repeated hook",
        ),
    ] {
        assert!(
            engines
                .request_activation(req, &Origin::from("operator:a"))
                .await
                .is_err(),
            "{what}"
        );
    }
    assert_eq!(store.stream_version("engine/sgp-region").await.unwrap(), 0);

    // The happy path: 202-style answer first, the steps after.
    let (requested, task) = engines
        .request_activation(
            request("finmoe-7b-v3@sgp-region", 0.1, &["aml_v2"]),
            &Origin::from("operator:a"),
        )
        .await
        .unwrap();
    assert_eq!(requested.stream_id, "engine/sgp-region");
    task.await.unwrap();
    let engine = engines.engine("sgp-region").unwrap();
    assert_eq!(engine.status, EngineStatus::Active, "{engine:?}");
    assert_eq!(
        engine.steps,
        vec![
            "EngineActivationRequested",
            "EngineModelVerified",
            "EnginePoliciesBound",
            "CircuitBreakerRegistered",
            "EngineActivated"
        ]
    );
    let steps = store
        .read_stream(
            "engine/sgp-region",
            2,
            aether_ledger::Direction::Forward,
            10,
        )
        .await
        .unwrap();
    for s in &steps {
        assert_eq!(
            s.metadata_value().unwrap()["correlation_id"],
            requested.event_id.to_string()
        );
    }

    // Failures are events naming the step and reason.
    let (_, task) = engines
        .request_activation(
            request("ghost-1@eu-region", 0.5, &[]),
            &Origin::from("operator:a"),
        )
        .await
        .unwrap();
    task.await.unwrap();
    let eu = engines.engine("eu-region").unwrap();
    assert_eq!(eu.status, EngineStatus::Failed);
    assert!(
        eu.failure.as_deref().unwrap().contains("not registered"),
        "{eu:?}"
    );
    let (_, task) = engines
        .request_activation(
            request("finmoe-7b-v3@sgp-region", 0.2, &["basel3_delta"]),
            &Origin::from("operator:a"),
        )
        .await
        .unwrap();
    task.await.unwrap();
    let sgp = engines.engine("sgp-region").unwrap();
    assert_eq!(sgp.status, EngineStatus::Failed);
    assert!(
        sgp.failure
            .as_deref()
            .unwrap()
            .contains("\"basel3_delta\" is not bound"),
        "{sgp:?}"
    );
    // The artifact changed on disk after registration: refused at the model step.
    std::fs::write(dir.join("model.bin"), b"tampered weights").unwrap();
    let (_, task) = engines
        .request_activation(
            request("finmoe-7b-v3@sgp-region", 0.2, &["aml_v2"]),
            &Origin::from("operator:a"),
        )
        .await
        .unwrap();
    task.await.unwrap();
    let sgp = engines.engine("sgp-region").unwrap();
    assert!(
        sgp.failure.as_deref().unwrap().contains("has SM3 digest"),
        "{sgp:?}"
    );

    // An activation a restart interrupted is closed as failed on the next start.
    store
        .append(
            "engine/apac-region",
            ExpectedVersion::NoStream,
            vec![NewEvent::new("EngineActivationRequested", json!({"model_ref": "finmoe-7b-v3@apac-region", "traffic_weight": 0.5, "policy_hooks": []}))],
        )
        .await
        .unwrap();
    let reloaded_models = ModelRegistry::load(store.clone()).await.unwrap();
    let reloaded = EngineRegistry::load(store.clone(), reloaded_models.clone(), policies.clone())
        .await
        .unwrap();
    assert_eq!(reloaded.engine("sgp-region"), engines.engine("sgp-region"));
    assert_eq!(reloaded_models.all(), models.all());
    assert!(matches!(
        reloaded
            .request_activation(
                request("finmoe-7b-v3@apac-region", 0.5, &[]),
                &Origin::from("operator:a")
            )
            .await,
        Err(EngineError::Busy { .. })
    ));
    assert_eq!(
        reloaded
            .fail_interrupted(None, &Default::default())
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        reloaded.engine("apac-region").unwrap().status,
        EngineStatus::Failed
    );
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    scenario(
        &format!("sqlite:{}", dir.path().join("l.db").display()),
        dir.path(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_on_postgres() {
    let dir = tempfile::tempdir().unwrap();
    let db = TestDatabase::create().await;
    scenario(&db.url, dir.path()).await;
    db.drop_database().await;
}

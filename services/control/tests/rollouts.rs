//! Rollouts on a real ledger: the state machine, expected versions and restarts.

use aether_control::{
    Command, EngineRegistry, ModelRegistry, ModelSpec, Origin, PolicyRegistry, RolloutError,
    RolloutPhase, RolloutRegistry, RolloutRequest,
};
use aether_ledger::testing::TestDatabase;
use aether_ledger::{EventStore, StoreConfig};
use serde_json::json;

async fn models(store: &EventStore, dir: &std::path::Path) -> ModelRegistry {
    let registry = ModelRegistry::load(store.clone()).await.unwrap();
    for (name, bytes) in [("v3", b"three".as_slice()), ("v4", b"four".as_slice())] {
        let path = dir.join(format!("{name}.bin"));
        std::fs::write(&path, bytes).unwrap();
        let spec = ModelSpec {
            model_ref: format!("finmoe-7b-{name}@sgp-region"),
            uri: path.display().to_string(),
            digest: hex::encode(aether_ledger::hashing::sm3(bytes)),
            feature_schema: json!({"amount_minor": "int"}).as_object().unwrap().clone(),
        };
        registry
            .register(spec, &Origin::from("operator:a"))
            .await
            .unwrap();
    }
    registry
}

fn request(steps: Vec<u32>) -> RolloutRequest {
    RolloutRequest {
        baseline: "finmoe-7b-v3@sgp-region".into(),
        candidate: "finmoe-7b-v4@sgp-region".into(),
        steps,
        analysis: Default::default(),
        automated: false,
    }
}

async fn scenario(url: &str, dir: &std::path::Path) {
    let op = Origin::from("operator:a");
    let store = EventStore::connect(url, StoreConfig::default())
        .await
        .unwrap();
    let models = models(&store, dir).await;
    let policies = PolicyRegistry::load(store.clone()).await.unwrap();
    let engines = EngineRegistry::load(store.clone(), models.clone(), policies)
        .await
        .unwrap();
    let rollouts = RolloutRegistry::load(store.clone(), models.clone(), engines.clone())
        .await
        .unwrap();

    for (req, what) in [
        (request(vec![]), "no steps"),
        (request(vec![5, 2, 100]), "falling steps"),
        (request(vec![1, 50]), "not ending at 100"),
        (request(vec![0, 100]), "zero step"),
        (
            RolloutRequest {
                candidate: "finmoe-7b-v3@sgp-region".into(),
                ..request(vec![100])
            },
            "same model",
        ),
        (
            RolloutRequest {
                candidate: "finmoe-7b-v9@sgp-region".into(),
                ..request(vec![100])
            },
            "unknown model",
        ),
        (
            RolloutRequest {
                candidate: "finmoe-7b-v4@eu-region".into(),
                ..request(vec![100])
            },
            "other region",
        ),
        (
            RolloutRequest {
                analysis: json!({"window": {"length_ms": 10}})
                    .as_object()
                    .unwrap()
                    .clone(),
                ..request(vec![100])
            },
            "analysis window under 1 s",
        ),
        (
            RolloutRequest {
                analysis: json!({"windwo": {}}).as_object().unwrap().clone(),
                ..request(vec![100])
            },
            "unknown analysis setting",
        ),
    ] {
        assert!(rollouts.start(req, &op).await.is_err(), "{what}");
    }

    let (r, _) = rollouts
        .start(request(vec![10, 50, 100]), &op)
        .await
        .unwrap();
    assert_eq!(
        (r.phase, r.candidate_weight),
        (RolloutPhase::Progressing, 0)
    );
    assert!(matches!(
        rollouts.start(request(vec![100]), &op).await,
        Err(RolloutError::RegionBusy { .. })
    ));
    let id = r.id.clone();
    let (r, _) = rollouts
        .command(&id, Command::Step, None, None, &op)
        .await
        .unwrap();
    assert_eq!(r.candidate_weight, 10);
    let (r, _) = rollouts
        .command(
            &id,
            Command::Pause,
            Some(r.version),
            Some("manual gate"),
            &op,
        )
        .await
        .unwrap();
    assert_eq!(r.phase, RolloutPhase::Paused);
    let err = rollouts
        .command(&id, Command::Step, None, None, &op)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("cannot step rollout {id}: it is paused")
    );
    let err = rollouts
        .command(&id, Command::Resume, Some(1), None, &op)
        .await
        .unwrap_err();
    assert!(
        matches!(err, RolloutError::Stale { expected: 1, .. }),
        "{err}"
    );
    rollouts
        .command(&id, Command::Resume, None, None, &op)
        .await
        .unwrap();

    // Two operators step from the same version at once: exactly one lands, the other is
    // told the rollout moved on.
    let seen = rollouts.get(&id).unwrap().version;
    let a = rollouts.clone();
    let b = rollouts.clone();
    let (id_a, id_b) = (id.clone(), id.clone());
    let (oa, ob) = (op.clone(), op.clone());
    let (ra, rb) = tokio::join!(
        tokio::spawn(async move { a.command(&id_a, Command::Step, Some(seen), None, &oa).await }),
        tokio::spawn(async move { b.command(&id_b, Command::Step, Some(seen), None, &ob).await })
    );
    let results = [ra.unwrap(), rb.unwrap()];
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(RolloutError::Stale { .. })))
    );
    assert_eq!(rollouts.get(&id).unwrap().candidate_weight, 50);

    let (r, _) = rollouts
        .command(&id, Command::Step, None, None, &op)
        .await
        .unwrap();
    assert_eq!(r.candidate_weight, 100);
    let err = rollouts
        .command(&id, Command::Step, None, None, &op)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("last step"), "{err}");
    let (r, _) = rollouts
        .command(&id, Command::Promote, None, None, &op)
        .await
        .unwrap();
    assert_eq!(r.phase, RolloutPhase::Promoted);
    for c in [
        Command::Step,
        Command::Pause,
        Command::Resume,
        Command::Abort,
        Command::Promote,
    ] {
        assert!(matches!(
            rollouts.command(&id, c, None, None, &op).await,
            Err(RolloutError::InvalidTransition { .. })
        ));
    }

    // A second rollout, aborted; then a restart sees both exactly as they were.
    let (r2, _) = rollouts.start(request(vec![1, 100]), &op).await.unwrap();
    rollouts
        .command(&r2.id, Command::Step, None, None, &op)
        .await
        .unwrap();
    let (r2, _) = rollouts
        .command(&r2.id, Command::Abort, None, Some("p99 regression"), &op)
        .await
        .unwrap();
    assert_eq!((r2.phase, r2.candidate_weight), (RolloutPhase::Aborted, 0));
    let reloaded = RolloutRegistry::load(store.clone(), models, engines)
        .await
        .unwrap();
    assert_eq!(reloaded.all(), rollouts.all());
    assert!(matches!(
        rollouts
            .command("nope", Command::Step, None, None, &op)
            .await,
        Err(RolloutError::NotFound(_))
    ));
    store.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollouts_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    scenario(
        &format!("sqlite:{}", dir.path().join("l.db").display()),
        dir.path(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollouts_on_postgres() {
    let dir = tempfile::tempdir().unwrap();
    let db = TestDatabase::create().await;
    scenario(&db.url, dir.path()).await;
    db.drop_database().await;
}

//! The rollout controller on a real SQLite ledger, fed deterministic synthetic traffic
//! one 1 s window at a time: promotion, fuse, drift pause with a retrain request, semantic
//! rollback to the right snapshot, and a restart mid-rollout.

use std::collections::BTreeMap;

use aether_control::analysis::{BatchReport, RequestObservation, Stage};
use aether_control::rollout_controller::{self, CHECKED, RETRAIN_REQUESTED, ROLLBACK_DECIDED};
use aether_control::{
    ActivationRequest, ControlState, ModelSpec, Origin, RolloutController, RolloutPhase,
    RolloutRequest, RolloutState, RoutingTable,
};
use aether_ledger::{Direction, EventStore, RecordedEvent, StoreConfig};
use aether_rules::PolicyFormat;
use chrono::{DateTime, TimeDelta, Utc};
use serde_json::{Value, json};

const BASELINE: &str = "finmoe-7b-v3@sgp-region";
const CANDIDATE: &str = "finmoe-7b-v4@sgp-region";

/// One window of traffic: both stages score the same `n` requests.
#[derive(Clone, Copy)]
struct Traffic {
    n: usize,
    candidate_ms: u64,
    candidate_errors: usize,
    confidence: f64,
    score_shift: f64,
    /// Candidate batch fill, in tenths.
    fill: u32,
}

const HEALTHY: Traffic = Traffic {
    n: 100,
    candidate_ms: 100,
    candidate_errors: 0,
    confidence: 0.95,
    score_shift: 0.0,
    fill: 2,
};

struct Harness {
    _dir: tempfile::TempDir,
    url: String,
    store: EventStore,
    state: ControlState,
    rollout: RolloutState,
}

async fn harness(steps: Vec<u32>) -> Harness {
    harness_on(None, steps).await
}

/// The harness on `url` (a PostgreSQL database), or on SQLite in a temporary directory.
async fn harness_on(url: Option<String>, steps: Vec<u32>) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let url = url.unwrap_or_else(|| format!("sqlite:{}", dir.path().join("l.db").display()));
    let store = EventStore::connect(&url, StoreConfig::default())
        .await
        .unwrap();
    let state = ControlState::replay(&store).await.unwrap();
    let op = Origin::from("operator:a");
    for (model, bytes) in [
        (BASELINE, b"three".as_slice()),
        (CANDIDATE, b"four".as_slice()),
    ] {
        let path = dir.path().join(format!("{model}.bin"));
        std::fs::write(&path, bytes).unwrap();
        let spec = ModelSpec {
            model_ref: model.into(),
            uri: path.display().to_string(),
            digest: hex::encode(aether_ledger::hashing::sm3(bytes)),
            feature_schema: json!({"amount": "float"}).as_object().unwrap().clone(),
        };
        state.models.register(spec, &op).await.unwrap();
    }
    let policy = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules/policies/aml_v2.yaml"),
    )
    .unwrap();
    state
        .policies
        .ingest(&policy, PolicyFormat::Yaml, &op)
        .await
        .unwrap();
    let activation = ActivationRequest {
        model_ref: BASELINE.into(),
        traffic_weight: 1.0,
        policy_hooks: vec!["aml_v2".into()],
    };
    let (_, task) = state
        .engines
        .request_activation(activation, &op)
        .await
        .unwrap();
    task.await.unwrap();
    let request = RolloutRequest {
        baseline: BASELINE.into(),
        candidate: CANDIDATE.into(),
        steps,
        analysis: json!({"window": {"length_ms": 1000}})
            .as_object()
            .unwrap()
            .clone(),
        automated: true,
    };
    let (rollout, _) = state.rollouts.start(request, &op).await.unwrap();
    Harness {
        _dir: dir,
        url,
        store,
        state,
        rollout,
    }
}

impl Harness {
    fn at(&self, window: i64, ms: i64) -> DateTime<Utc> {
        self.rollout.started_at + TimeDelta::milliseconds(window * 1000 + ms)
    }

    /// Feeds window `index` and closes it.
    async fn window(&self, c: &mut RolloutController, index: i64, t: Traffic) {
        let at = self.at(index, 100);
        for k in 0..t.n {
            let id = format!("w{index}-r{k}");
            let rules = k % 10 == 0;
            let score = k as f64 / t.n as f64 * 0.5;
            let features = BTreeMap::from([("amount".to_owned(), k as f64)]);
            let observation =
                |stage, latency_ms: u64, score: f64, confidence: f64, error| RequestObservation {
                    request_id: id.clone(),
                    stage,
                    latency_us: latency_ms * 1000,
                    error,
                    score,
                    confidence,
                    flagged: rules,
                    rules_flagged: rules,
                    features: features.clone(),
                    shadow: false,
                    at,
                };
            c.observe(observation(Stage::Baseline, 100, score, 0.95, false))
                .unwrap();
            c.observe(observation(
                Stage::Candidate,
                t.candidate_ms,
                score + t.score_shift,
                t.confidence,
                k < t.candidate_errors,
            ))
            .unwrap();
        }
        c.report(BatchReport {
            stage: Stage::Candidate,
            batch_size: t.fill,
            max_batch: 10,
            queue_depth: 0,
            elapsed_us: 5_000,
            at,
        })
        .unwrap();
        c.tick(self.at(index + 1, 1)).await.unwrap();
    }

    fn rollout(&self) -> RolloutState {
        self.state.rollouts.get(&self.rollout.id).unwrap()
    }

    async fn events(&self, stream: &str) -> Vec<RecordedEvent> {
        self.store
            .read_stream(stream, 0, Direction::Forward, 10_000)
            .await
            .unwrap()
    }

    async fn analysis(&self) -> Vec<RecordedEvent> {
        self.events(&rollout_controller::stream(&self.rollout.id))
            .await
    }

    /// The weights the controller set on the rollout, in order.
    async fn weights(&self) -> Vec<(u64, String)> {
        self.events(&format!("rollout/{}", self.rollout.id))
            .await
            .iter()
            .filter(|e| e.event_type == "RolloutWeightSet")
            .map(|e| {
                let p = e.payload_value().unwrap();
                (
                    p["to_weight"].as_u64().unwrap(),
                    p["reason"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }
}

fn of_type<'a>(events: &'a [RecordedEvent], kind: &str) -> Vec<&'a RecordedEvent> {
    events.iter().filter(|e| e.event_type == kind).collect()
}

fn increases(weights: &[u64]) -> Vec<(u64, String)> {
    weights
        .iter()
        .map(|w| (*w, "increase".to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_candidate_is_widened_step_by_step_and_promoted() {
    let h = harness(vec![10, 50, 100]).await;
    let mut c = RolloutController::start(&h.store, &h.state, &h.rollout.id)
        .await
        .unwrap();
    let mut windows = 0;
    while c.finished().is_none() {
        assert!(windows < 20, "never promoted");
        h.window(&mut c, windows, HEALTHY).await;
        windows += 1;
    }
    assert_eq!(
        h.weights().await,
        increases(&[10, 15, 23, 35, 50, 75, 100]),
        "x1.5 per healthy window, capped at each next step"
    );
    let rollout = h.rollout();
    assert_eq!(
        (rollout.phase, rollout.candidate_weight),
        (RolloutPhase::Promoted, 100)
    );
    assert_eq!(
        h.state.engines.engine("sgp-region").unwrap().model_ref,
        CANDIDATE
    );
    let analysis = h.analysis().await;
    assert_eq!(of_type(&analysis, CHECKED).len(), windows as usize);
    // A snapshot before the first step and one after each, for a later rollback.
    let snapshots = of_type(&analysis, rollout_controller::STEP_SNAPSHOT);
    assert_eq!(snapshots.len(), 8);
    // Each weight change names the decision behind it.
    let decided: Vec<String> = of_type(&analysis, rollout_controller::WEIGHT_DECIDED)
        .iter()
        .map(|e| e.event_id.to_string())
        .collect();
    let causes: Vec<String> = h
        .events(&format!("rollout/{}", h.rollout.id))
        .await
        .iter()
        .filter(|e| e.event_type == "RolloutWeightSet")
        .map(|e| {
            e.metadata_value().unwrap()["causation_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(causes, decided);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_regression_fuses_the_candidate_to_zero() {
    let h = harness(vec![10, 50, 100]).await;
    let mut c = RolloutController::start(&h.store, &h.state, &h.rollout.id)
        .await
        .unwrap();
    h.window(&mut c, 0, HEALTHY).await;
    h.window(&mut c, 1, HEALTHY).await;
    let regression = Traffic {
        candidate_ms: 300,
        candidate_errors: 10,
        fill: 10,
        ..HEALTHY
    };
    h.window(&mut c, 2, regression).await;
    let mut expected = increases(&[10, 15]);
    expected.push((0, "fuse".into()));
    assert_eq!(h.weights().await, expected);
    let analysis = h.analysis().await;
    let transition = of_type(&analysis, rollout_controller::TRANSITIONED);
    assert_eq!(transition.len(), 1);
    let p = transition[0].payload_value().unwrap();
    assert_eq!(
        (p["from"].as_str(), p["to"].as_str()),
        (Some("normal"), Some("fused"))
    );
    assert!(p["risk"]["risk"].as_f64().unwrap() > 0.85, "{p}");
    assert!(
        p["metrics"]["candidate"]["latency_p99_us"]
            .as_u64()
            .unwrap()
            >= 300_000,
        "{p}"
    );
    let table = RoutingTable::of(&h.state.engines, &h.state.rollouts);
    assert_eq!(table.rollouts[&h.rollout.id].candidate_weight, 0);
    // Fused: the candidate's fallback path is on (the baseline decides what it fails).
    assert!(h.rollout().fallback);
    let fallback = h
        .events(&format!("rollout/{}", h.rollout.id))
        .await
        .into_iter()
        .find(|e| e.event_type == "RolloutFallbackSet")
        .unwrap();
    assert_eq!(
        fallback.metadata_value().unwrap()["causation_id"],
        transition[0].event_id.to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_l2_pauses_the_rollout_and_requests_a_retrain() {
    let h = harness(vec![10, 50, 100]).await;
    let mut c = RolloutController::start(&h.store, &h.state, &h.rollout.id)
        .await
        .unwrap();
    h.window(&mut c, 0, HEALTHY).await;
    let shifted = Traffic {
        score_shift: 0.2,
        ..HEALTHY
    };
    h.window(&mut c, 1, shifted).await;
    h.window(&mut c, 2, shifted).await;
    let analysis = h.analysis().await;
    let retrain = of_type(&analysis, RETRAIN_REQUESTED);
    assert_eq!(retrain.len(), 1, "requested once");
    let p = retrain[0].payload_value().unwrap();
    assert_eq!(p["candidate"], CANDIDATE);
    assert_eq!(p["tier"], "l2");
    // What a retraining needs: the window, the data range (the rollout so far), and the
    // features that moved (none here: only the scores were shifted).
    assert!(
        p["window"]["start"].is_string() && p["window"]["end"].is_string(),
        "{p}"
    );
    assert_eq!(p["data_range"]["to"], p["window"]["end"]);
    assert!(p["data_range"]["from"].is_string(), "{p}");
    assert!(p["features"].is_array(), "{p}");
    // The healthy first window archived the candidate's feature health (L1).
    let health = of_type(&analysis, "FeatureHealthSnapshot");
    assert_eq!(health.len(), 1, "only the L1 window");
    let health = health[0].payload_value().unwrap();
    assert!(health["scores"]["n"].as_u64() > Some(0), "{health}");
    assert_eq!(h.rollout().phase, RolloutPhase::Paused);
    assert_eq!(
        h.weights().await,
        increases(&[10]),
        "no widening while paused"
    );
    let paused = h
        .events(&format!("rollout/{}", h.rollout.id))
        .await
        .into_iter()
        .find(|e| e.event_type == "RolloutPaused")
        .unwrap();
    assert_eq!(
        paused.payload_value().unwrap()["reason"],
        "analysis: drift_l2"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_breaching_windows_roll_back_to_the_snapshot_before_the_offending_step() {
    let h = harness(vec![10, 50, 100]).await;
    let mut c = RolloutController::start(&h.store, &h.state, &h.rollout.id)
        .await
        .unwrap();
    h.window(&mut c, 0, HEALTHY).await; // step 1: 10 %
    h.window(&mut c, 1, HEALTHY).await; // step 2: 15 %
    let low_confidence = Traffic {
        confidence: 0.70,
        ..HEALTHY
    };
    for index in 2..5 {
        h.window(&mut c, index, low_confidence).await;
    }
    let analysis = h.analysis().await;
    let decided = of_type(&analysis, ROLLBACK_DECIDED);
    assert_eq!(decided.len(), 1);
    let decision = decided[0].payload_value().unwrap();
    assert_eq!(decision["offending_step"], 2);
    // The snapshot taken after step 1 (10 %), the last one before the offending step.
    let step_one: Value = of_type(&analysis, rollout_controller::STEP_SNAPSHOT)
        .iter()
        .map(|e| e.payload_value().unwrap())
        .find(|p| p["step"] == 1)
        .unwrap();
    assert_eq!(decision["target"]["snapshot_id"], step_one["snapshot_id"]);
    let rolled = h.events("snapshot").await;
    let rolled = of_type(&rolled, "RolledBack");
    assert_eq!(
        rolled.len(),
        1,
        "one event restores routing, rules and corpus"
    );
    assert_eq!(
        rolled[0].payload_value().unwrap()["target_snapshot"],
        step_one["snapshot_id"]
    );
    let rollout = h.rollout();
    assert_eq!(rollout.candidate_weight, 10);
    assert_eq!(rollout.phase, RolloutPhase::Paused, "held for an operator");
    assert!(c.finished().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_restarted_mid_rollout_neither_repeats_nor_skips_a_step() {
    let h = harness(vec![10, 50, 100]).await;
    {
        let mut c = RolloutController::start(&h.store, &h.state, &h.rollout.id)
            .await
            .unwrap();
        for index in 0..3 {
            h.window(&mut c, index, HEALTHY).await;
        }
    }
    // A restart of the whole process: the state is rebuilt from the ledger alone.
    h.store.shutdown().await;
    let store = EventStore::connect(&h.url, StoreConfig::default())
        .await
        .unwrap();
    let state = ControlState::replay(&store).await.unwrap();
    let h = Harness { store, state, ..h };
    let mut c = RolloutController::start(&h.store, &h.state, &h.rollout.id)
        .await
        .unwrap();
    assert_eq!(c.state().weight, 23);
    let mut index = 3;
    while c.finished().is_none() {
        assert!(index < 20, "never promoted");
        h.window(&mut c, index, HEALTHY).await;
        index += 1;
    }
    assert_eq!(h.weights().await, increases(&[10, 15, 23, 35, 50, 75, 100]));
    // Windows follow each other without a gap or an overlap across the restart.
    let analysis = h.analysis().await;
    let spans: Vec<(String, String)> = of_type(&analysis, CHECKED)
        .iter()
        .map(|e| {
            let p = e.payload_value().unwrap();
            (
                p["window_start"].as_str().unwrap().to_owned(),
                p["window_end"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(spans.len(), index as usize);
    assert!(spans.windows(2).all(|w| w[0].1 == w[1].0), "{spans:?}");
    assert_eq!(h.rollout().phase, RolloutPhase::Promoted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_with_a_duration_ends_by_itself_and_only_then() {
    let h = harness(vec![10, 50, 100]).await;
    let op = Origin::from("operator:a");
    let until = Utc::now() + TimeDelta::minutes(5);
    let (paused, _) = h
        .state
        .rollouts
        .pause_until(&h.rollout.id, until, None, Some("change freeze"), &op)
        .await
        .unwrap();
    assert_eq!(
        (paused.phase, paused.resume_at),
        (RolloutPhase::Paused, Some(until))
    );
    let controller = Origin::from("aether:rollout-controller");
    let early = h
        .state
        .rollouts
        .resume_due(until - TimeDelta::seconds(1), &controller);
    assert!(early.await.unwrap().is_empty());
    assert_eq!(h.rollout().phase, RolloutPhase::Paused);
    let due = h
        .state
        .rollouts
        .resume_due(until, &controller)
        .await
        .unwrap();
    assert_eq!(due, std::slice::from_ref(&h.rollout.id));
    let resumed = h.rollout();
    assert_eq!(
        (resumed.phase, resumed.resume_at),
        (RolloutPhase::Progressing, None)
    );
    // An indefinite pause is never resumed by the clock.
    h.state
        .rollouts
        .command(
            &h.rollout.id,
            aether_control::Command::Pause,
            None,
            None,
            &op,
        )
        .await
        .unwrap();
    let later = until + TimeDelta::days(30);
    assert!(
        h.state
            .rollouts
            .resume_due(later, &controller)
            .await
            .unwrap()
            .is_empty()
    );
    // The pause and its end survive a restart.
    let replayed = ControlState::replay(&h.store).await.unwrap();
    assert_eq!(replayed.rollouts.get(&h.rollout.id), Some(h.rollout()));
}

/// In a cluster the controller acts under the `rollout-controller` lease: once another node
/// has taken the lease, the database refuses whatever the old holder still tries to record
/// or carry out (a paused process that wakes), and the new holder's controller resumes from
/// the ledger, its records fenced with the new token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_whose_lease_moved_records_and_changes_nothing() {
    use aether_ledger::cluster::Fence;
    let db = aether_ledger::testing::TestDatabase::create().await;
    let h = harness_on(Some(db.url.clone()), vec![10, 50, 100]).await;
    let ttl = std::time::Duration::from_millis(300);
    let lease = "rollout-controller";
    let token_a = h
        .store
        .acquire_lease(lease, "node-a", ttl)
        .await
        .unwrap()
        .unwrap();
    let fence_a = Fence {
        lease: lease.into(),
        token: token_a,
    };
    let mut a = RolloutController::start_fenced(&h.store, &h.state, &h.rollout.id, Some(fence_a))
        .await
        .unwrap();
    h.window(&mut a, 0, HEALTHY).await;
    assert_eq!(h.weights().await, increases(&[10]));

    // node-a stalls past its lease; node-b takes it.
    tokio::time::sleep(ttl + std::time::Duration::from_millis(100)).await;
    let token_b = h
        .store
        .acquire_lease(lease, "node-b", ttl * 20)
        .await
        .unwrap()
        .unwrap();
    assert!(token_b > token_a);
    let analysis_before = h.analysis().await.len();
    let head_before = h.store.head().await.unwrap().unwrap().0;

    // node-a wakes and closes the next window: refused by the database, nothing written.
    let at = h.at(1, 100);
    a.observe(RequestObservation {
        request_id: "late".into(),
        stage: Stage::Candidate,
        latency_us: 1000,
        error: false,
        score: 0.1,
        confidence: 0.9,
        flagged: false,
        rules_flagged: false,
        features: BTreeMap::new(),
        shadow: false,
        at,
    })
    .unwrap();
    let refused = a
        .tick(h.at(2, 1))
        .await
        .expect_err("a stale holder's record");
    assert!(refused.is_fenced(), "{refused}");
    assert_eq!(h.store.head().await.unwrap().unwrap().0, head_before);
    assert_eq!(h.analysis().await.len(), analysis_before);
    assert_eq!(h.weights().await, increases(&[10]));

    // node-b's controller resumes from the ledger and widens under its own token.
    let fence_b = Fence {
        lease: lease.into(),
        token: token_b,
    };
    let mut b = RolloutController::start_fenced(&h.store, &h.state, &h.rollout.id, Some(fence_b))
        .await
        .unwrap();
    h.window(&mut b, 1, HEALTHY).await;
    assert_eq!(h.weights().await, increases(&[10, 15]));
    let fences: Vec<(u64, u64)> = h
        .analysis()
        .await
        .iter()
        .chain(h.events(&format!("rollout/{}", h.rollout.id)).await.iter())
        .filter_map(|e| {
            let m = e.metadata_value().unwrap();
            m["fence"]["token"].as_u64().map(|t| (e.seq, t))
        })
        .collect();
    assert!(
        fences.iter().any(|(_, t)| *t == token_a) && fences.iter().any(|(_, t)| *t == token_b),
        "the records of both holders carry their fence: {fences:?}"
    );
    let last_a = fences
        .iter()
        .filter(|(_, t)| *t == token_a)
        .map(|(s, _)| *s)
        .max();
    let first_b = fences
        .iter()
        .filter(|(_, t)| *t == token_b)
        .map(|(s, _)| *s)
        .min();
    assert!(last_a < first_b, "nothing of node-a's after node-b's first");
    drop(h);
    db.drop_database().await;
}

/// A node's windows that the ledger refused (a trigger stands in for an unreachable
/// database) are kept and recorded, in order and once each, when it takes them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_the_ledger_refused_are_recorded_at_the_next_flush() {
    use aether_control::rollout_controller::RolloutObservation;
    use aether_control::rollout_windows::{WindowRecorder, windows_stream};
    use sqlx::Connection;
    let h = harness(vec![10, 50, 100]).await;
    let mut recorder = WindowRecorder::new(h.store.clone(), "node-a");
    let observation = RequestObservation {
        request_id: "r-1".into(),
        stage: Stage::Candidate,
        latency_us: 1_000,
        error: false,
        score: 0.2,
        confidence: 0.9,
        flagged: false,
        rules_flagged: false,
        features: BTreeMap::new(),
        shadow: false,
        at: h.at(0, 100),
    };
    let filed = recorder
        .observe(
            &h.state,
            RolloutObservation::Request {
                rollout_id: h.rollout.id.clone(),
                observation,
            },
            h.at(0, 200),
        )
        .unwrap();
    assert!(filed);
    let mut admin = sqlx::SqliteConnection::connect(&h.url).await.unwrap();
    sqlx::raw_sql(
        "CREATE TRIGGER refuse_windows BEFORE INSERT ON events \
         WHEN NEW.stream_id LIKE 'analysis/%/windows' \
         BEGIN SELECT RAISE(ABORT, 'refused'); END",
    )
    .execute(&mut admin)
    .await
    .unwrap();
    let stream = windows_stream(&h.rollout.id);
    assert!(recorder.flush(&h.state, h.at(1, 1)).await.is_err());
    assert!(recorder.flush(&h.state, h.at(2, 1)).await.is_err());
    assert!(h.events(&stream).await.is_empty());

    sqlx::raw_sql("DROP TRIGGER refuse_windows")
        .execute(&mut admin)
        .await
        .unwrap();
    assert_eq!(recorder.flush(&h.state, h.at(3, 1)).await.unwrap(), 3);
    let recorded = h.events(&stream).await;
    let starts: Vec<String> = recorded
        .iter()
        .map(|e| e.payload_value().unwrap()["samples"]["start"].to_string())
        .collect();
    let mut unique = starts.clone();
    unique.dedup();
    assert_eq!(unique.len(), 3, "three windows, once each: {starts:?}");
    let first = recorded[0].payload_value().unwrap();
    assert_eq!(first["samples"]["candidate"]["requests"], 1, "{first}");
    assert_eq!(recorder.flush(&h.state, h.at(3, 500)).await.unwrap(), 0);
}

//! The gateway's reports to the rollout supervisor, through the real pipeline on a real
//! ledger (PostgreSQL): rules, routing, batches, decisions, with two registered models.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use aether_control::analysis::Stage;
use aether_control::rollout_controller::RolloutObservation;
use aether_control::{ActivationRequest, Command, ControlState, ModelSpec, Origin, RolloutRequest};
use aether_gateway::batcher::NETTING_STREAM;
use aether_gateway::clearing::{
    Answer, ClearError, ClearingGateway, Colouring, GatewayConfig, Submission, TradeInput,
};
use aether_gateway::workers::WorkerPool;
use aether_gpu_worker::artifact;
use aether_gpu_worker::reference::{self, REFERENCE_MODEL_REF};
use aether_ledger::testing::TestDatabase;
use aether_ledger::{EventStore, StoreConfig};
use aether_rules::PolicyFormat;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde_json::json;
use tokio::sync::mpsc;

const CANDIDATE_REF: &str = "aether-anomaly-mlp-v2@reference";

/// One process-wide recorder, so counters can be read back.
fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder in this test binary")
    })
}

/// Sum of a counter over its labels, from the Prometheus text.
fn counter(name: &str) -> f64 {
    recorder()
        .render()
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn model_spec(model_ref: &str, weights: &Path, digest: &str) -> ModelSpec {
    ModelSpec {
        model_ref: model_ref.into(),
        uri: weights.display().to_string(),
        digest: digest.into(),
        feature_schema: json!({"schema": "aether.features.v1"})
            .as_object()
            .cloned()
            .unwrap_or_default(),
    }
}

/// The reference model as baseline, a perturbed copy as candidate, aml_v2, an active
/// engine; the control state the gateway reads.
async fn control(store: &EventStore, dir: &Path) -> ControlState {
    let op = Origin::from("operator:test");
    let control = ControlState::replay(store).await.unwrap();
    let base = reference::install(&dir.join("base")).unwrap();
    let verified = artifact::load_verified(&base.weights_path, &base.digest).unwrap();
    let mut spec = verified.spec.clone();
    spec.model_ref = CANDIDATE_REF.into();
    spec.version = "2".into();
    let mut weights = verified.weights.clone();
    if let Some(last) = weights.layers.last_mut() {
        for b in &mut last.bias {
            *b += 0.75;
        }
    }
    let cand = artifact::save(&dir.join("cand"), &spec, &weights).unwrap();
    for (r, saved) in [(REFERENCE_MODEL_REF, &base), (CANDIDATE_REF, &cand)] {
        control
            .models
            .register(model_spec(r, &saved.weights_path, &saved.digest), &op)
            .await
            .unwrap();
    }
    let aml = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules/policies/aml_v2.yaml"),
    )
    .unwrap();
    control
        .policies
        .ingest(&aml, PolicyFormat::Yaml, &op)
        .await
        .unwrap();
    let (_, task) = control
        .engines
        .request_activation(
            ActivationRequest {
                model_ref: REFERENCE_MODEL_REF.into(),
                traffic_weight: 1.0,
                policy_hooks: vec!["aml_v2".into()],
            },
            &op,
        )
        .await
        .unwrap();
    task.await.unwrap();
    control
}

/// Starts a rollout and steps it to its first weight; returns its id.
async fn roll_out(control: &ControlState, weight: u32) -> String {
    let op = Origin::from("operator:test");
    let (r, _) = control
        .rollouts
        .start(
            RolloutRequest {
                baseline: REFERENCE_MODEL_REF.into(),
                candidate: CANDIDATE_REF.into(),
                steps: vec![weight, 100],
                analysis: Default::default(),
                automated: false,
            },
            &op,
        )
        .await
        .unwrap();
    let (r, _) = control
        .rollouts
        .command(&r.id, Command::Step, None, None, &op)
        .await
        .unwrap();
    assert_eq!(r.candidate_weight, weight);
    r.id
}

fn gateway(
    store: &EventStore,
    control: &ControlState,
    capacity: usize,
    local_workers: bool,
) -> (ClearingGateway, mpsc::Receiver<RolloutObservation>) {
    let (tx, rx) = mpsc::channel(capacity);
    let mut config = GatewayConfig::default().with_observations(tx);
    config.batcher.max_batch = 8;
    config.batcher.workers = 1;
    config.batcher.local_workers = local_workers;
    config.batcher.worker_attempts = 1;
    let gateway = ClearingGateway::new(
        store.clone(),
        control.clone(),
        config,
        WorkerPool::default(),
    );
    (gateway, rx)
}

/// `n` trades at once; some large enough for the rules to hold them.
async fn submit(gateway: &ClearingGateway, prefix: &str, n: usize) -> Vec<Answer> {
    submit_all(gateway, prefix, n)
        .await
        .into_iter()
        .map(|r| r.expect("decided"))
        .collect()
}

async fn submit_all(
    gateway: &ClearingGateway,
    prefix: &str,
    n: usize,
) -> Vec<Result<Answer, ClearError>> {
    let jobs = (0..n).map(|i| {
        let amount_minor = if i % 5 == 0 {
            50_000_000
        } else {
            1_000 + i as i64 * 37
        };
        gateway.clear(Submission {
            member_id: "bank-a".into(),
            request_id: format!("{prefix}-{i}"),
            trade: TradeInput {
                buyer: format!("client-{i}"),
                seller: "bank-b".into(),
                instrument: "SG0000000001".into(),
                currency: "SGD".into(),
                amount_minor,
                value_date: "2026-12-02".into(),
                jurisdiction: "SG".into(),
                counterparty_tier: 2,
            },
            colouring: Colouring::default(),
        })
    });
    futures::future::join_all(jobs).await
}

/// Everything received until `done` says enough, or until nothing comes for a while.
async fn drain(
    rx: &mut mpsc::Receiver<RolloutObservation>,
    done: impl Fn(&[RolloutObservation]) -> bool,
) -> Vec<RolloutObservation> {
    let mut got = Vec::new();
    while !done(&got) {
        match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
            Ok(Some(o)) => got.push(o),
            _ => break,
        }
    }
    // Anything more would be a duplicate.
    tokio::time::sleep(Duration::from_millis(200)).await;
    while let Ok(o) = rx.try_recv() {
        got.push(o);
    }
    got
}

#[tokio::test]
async fn the_gateway_reports_rollout_traffic() {
    recorder();
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let store = EventStore::connect(&db.url, StoreConfig::default())
        .await
        .unwrap();
    let control = control(&store, dir.path()).await;
    let (gw, mut rx) = gateway(&store, &control, 10_000, true);

    // No rollout: nothing is sent.
    submit(&gw, "before", 12).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rx.try_recv().is_err(),
        "nothing is observed without a rollout"
    );

    // A rollout at 50 %: one live observation per decision for its stage, a shadow by the
    // other stage with the same request id, a report per batch.
    let rollout = roll_out(&control, 50).await;
    let batches_before = store.stream_version(NETTING_STREAM).await.unwrap();
    let n = 60;
    let answers = submit(&gw, "during", n).await;
    let batches = (store.stream_version(NETTING_STREAM).await.unwrap() - batches_before) as usize;
    let got = drain(&mut rx, |got| got.len() >= 2 * n + batches).await;

    let mut by_request: BTreeMap<String, Vec<Stage>> = BTreeMap::new();
    let (mut reported, mut reported_trades) = (0, 0);
    for o in &got {
        match o {
            RolloutObservation::Request {
                rollout_id,
                observation,
            } => {
                assert_eq!(rollout_id, &rollout);
                assert!(!observation.error);
                assert_eq!(observation.features.len(), aether_gpu_worker::FEATURE_COUNT);
                by_request
                    .entry(observation.request_id.clone())
                    .or_default()
                    .push(observation.stage);
            }
            RolloutObservation::Batch { rollout_id, report } => {
                assert_eq!(rollout_id, &rollout);
                assert_eq!(report.max_batch, 8);
                assert!(report.batch_size >= 1 && report.batch_size <= 8);
                reported += 1;
                reported_trades += report.batch_size as usize;
            }
        }
    }
    assert_eq!(reported, batches, "one report per executed batch");
    assert_eq!(reported_trades, n);
    assert_eq!(by_request.len(), n);
    let rules_flagged = got.iter().any(|o| {
        matches!(o, RolloutObservation::Request { observation, .. } if observation.rules_flagged)
    });
    assert!(rules_flagged, "aml_v2 holds the large trades");
    let mut live_stages = BTreeSet::new();
    for answer in &answers {
        let stages = &by_request[&answer.request_id];
        let live = if answer.model_stage.starts_with("green") {
            Stage::Candidate
        } else {
            Stage::Baseline
        };
        live_stages.insert(live);
        // The live one comes first: the shadow is queued with it and scored after.
        assert_eq!(stages.len(), 2, "{}: {stages:?}", answer.request_id);
        let set: BTreeSet<_> = stages.iter().copied().collect();
        assert_eq!(set.len(), 2, "one observation per stage");
        assert!(stages.contains(&live));
    }
    assert_eq!(live_stages.len(), 2, "both stages served at 50 %");
    // The live observation agrees with the recorded decision.
    for o in &got {
        if let RolloutObservation::Request { observation, .. } = o
            && let Some(a) = answers
                .iter()
                .find(|a| a.request_id == observation.request_id)
            && a.model_stage.starts_with("green") == (observation.stage == Stage::Candidate)
        {
            assert!((observation.score - a.score).abs() < 1e-5);
            assert_eq!(observation.flagged, observation.score >= 0.8);
        }
    }

    // A full channel: every request is still decided and the drops are counted.
    let dropped = counter("aether_rollout_observations_dropped_total");
    let (full, _rx) = gateway(&store, &control, 1, true);
    let answers = submit(&full, "full", 20).await;
    assert_eq!(answers.len(), 20);
    assert!(counter("aether_rollout_observations_dropped_total") > dropped);

    // A stage that cannot answer (no worker holds its model): reported as an error.
    let (broken, mut rx) = gateway(&store, &control, 100, false);
    let results = submit_all(&broken, "broken", 6).await;
    assert!(
        results
            .iter()
            .all(|r| matches!(r, Err(ClearError::Worker(_))))
    );
    let got = drain(&mut rx, |got| got.len() >= 6).await;
    assert_eq!(got.len(), 6, "one error per request, no batch ran");
    for o in got {
        let RolloutObservation::Request { observation, .. } = o else {
            panic!("no batch ran")
        };
        assert!(observation.error);
        assert_eq!((observation.score, observation.confidence), (0.0, 0.5));
    }

    db.drop_database().await;
}

/// While the candidate's fallback path is on, the baseline decides what the candidate
/// fails (recorded as such, and reported as the candidate's failure); off, it fails.
#[tokio::test]
async fn the_fallback_path_lets_the_baseline_decide_what_the_candidate_fails() {
    recorder();
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let store = EventStore::connect(&db.url, StoreConfig::default())
        .await
        .unwrap();
    let control = control(&store, dir.path()).await;
    // The candidate's artifact is gone: every candidate request fails to score.
    std::fs::remove_dir_all(dir.path().join("cand")).unwrap();
    let (gw, mut rx) = gateway(&store, &control, 10_000, true);
    let rollout = roll_out(&control, 50).await;
    let results = submit_all(&gw, "off", 20).await;
    let failed = results.iter().filter(|r| r.is_err()).count();
    assert!(
        failed > 0 && failed < 20,
        "half the traffic is the candidate's: {failed}"
    );

    let op = Origin::from("aether:rollout-controller");
    control
        .rollouts
        .set_fallback(&rollout, true, "test", &op)
        .await
        .unwrap();
    let answers = submit(&gw, "on", 20).await;
    assert!(answers.iter().all(|a| a.model_ref == REFERENCE_MODEL_REF));
    let decided = store
        .query(
            &aether_ledger::EventFilter {
                event_type: Some("ClearingDecided".into()),
                ..Default::default()
            },
            0,
            1_000,
        )
        .await
        .unwrap();
    let fallbacks: Vec<serde_json::Value> = decided
        .iter()
        .filter_map(|e| {
            let p = e.payload_value().unwrap();
            (!p["fallback"].is_null()).then(|| p["fallback"].clone())
        })
        .collect();
    assert!(!fallbacks.is_empty(), "some requests were the candidate's");
    assert!(fallbacks.iter().all(|f| f["from"] == CANDIDATE_REF
        && f["to"] == REFERENCE_MODEL_REF
        && f["reason"].as_str().is_some_and(|r| !r.is_empty())));
    // Each fallback is the candidate's failure to the analysis, not its answer.
    let candidate_errors = |got: &[RolloutObservation]| {
        got.iter()
            .filter(|o| {
                matches!(o, RolloutObservation::Request { observation, .. }
                if observation.stage == Stage::Candidate && observation.error
                    && observation.request_id.starts_with("on-"))
            })
            .count()
    };
    let got = drain(&mut rx, |got| candidate_errors(got) >= fallbacks.len()).await;
    assert_eq!(candidate_errors(&got), fallbacks.len());

    db.drop_database().await;
}

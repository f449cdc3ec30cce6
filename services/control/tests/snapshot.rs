//! The consistent-snapshot coordinator on a real SQLite ledger: commit, abort on a
//! failing or slow participant (nothing changes), rollback, and a restart.

use std::sync::Arc;
use std::time::Duration;

use aether_control::corpora::{DocumentInput, DocumentKind};
use aether_control::snapshot::{
    GatewayParticipant, RagParticipant, RulesParticipant, SNAPSHOT_ABORTED,
};
use aether_control::{
    ControlState, CorpusIngest, CorpusRecord, Origin, ParticipantError, Pinned, SNAPSHOT_COMMITTED,
    SNAPSHOT_STREAM, SnapshotError, SnapshotParticipant,
};
use aether_ledger::{Direction, EventStore, StoreConfig};
use aether_rules::PolicyFormat;
use uuid::Uuid;

fn policy(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../rules/policies")
        .join(format!("{name}.yaml"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn corpus(text: &str) -> CorpusIngest {
    CorpusIngest {
        name: "mas".into(),
        documents: vec![DocumentInput {
            id: "notice-626".into(),
            format: DocumentKind::Markdown,
            text: text.into(),
        }],
        replace: true,
    }
}

/// Ingests policy `name` and makes `text` the corpus's one document; the new corpus version.
async fn change_rules_and_corpus(state: &ControlState, name: &str, text: &str) -> CorpusRecord {
    let origin = operator();
    state
        .policies
        .ingest(&policy(name), PolicyFormat::Yaml, &origin)
        .await
        .unwrap();
    state.corpora.ingest(corpus(text), &origin).await.unwrap().0
}

/// A participant that refuses, or answers only after `delay`.
struct Faulty {
    delay: Duration,
    fail: bool,
}

#[async_trait::async_trait]
impl SnapshotParticipant for Faulty {
    fn name(&self) -> &str {
        "faulty"
    }
    async fn prepare(&self, _: Uuid, _: Duration) -> Result<Pinned, ParticipantError> {
        tokio::time::sleep(self.delay).await;
        if self.fail {
            return Err(ParticipantError::Failed("disk full".into()));
        }
        Ok(Pinned {
            version: "v".into(),
            digest: "d".into(),
        })
    }
    async fn commit(&self, _: Uuid) -> Result<(), ParticipantError> {
        Ok(())
    }
    async fn abort(&self, _: Uuid) -> Result<(), ParticipantError> {
        Ok(())
    }
    async fn restore(&self, _: &str) -> Result<String, ParticipantError> {
        Ok("d".into())
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    url: String,
    store: EventStore,
    state: ControlState,
    participants: Vec<Arc<dyn SnapshotParticipant>>,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("l.db").display());
    let store = EventStore::connect(&url, StoreConfig::default())
        .await
        .unwrap();
    let state = ControlState::replay(&store).await.unwrap();
    let participants = participants(&state);
    Setup {
        _dir: dir,
        url,
        store,
        state,
        participants,
    }
}

fn participants(state: &ControlState) -> Vec<Arc<dyn SnapshotParticipant>> {
    vec![
        Arc::new(GatewayParticipant::new(
            state.engines.clone(),
            state.rollouts.clone(),
        )),
        Arc::new(RulesParticipant::new(state.policies.clone())),
        Arc::new(RagParticipant::new(state.corpora.clone())),
    ]
}

fn operator() -> Origin {
    Origin::from("operator:alice")
}

async fn snapshot_events(store: &EventStore) -> Vec<(String, serde_json::Value)> {
    store
        .read_stream(SNAPSHOT_STREAM, 0, Direction::Forward, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.event_type.clone(), e.payload_value().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_abort_timeout_and_rollback() {
    let s = setup().await;
    let origin = operator();
    let v1 = change_rules_and_corpus(
        &s.state,
        "aml_v2",
        "# Reporting\n\nReport trades above 1m.\n",
    )
    .await;
    let rules_v1 = s.state.policies.engine().snapshot().digest_hex();

    // Commit: one event with every participant's pin and the three digests.
    let snap = s
        .state
        .snapshots
        .take(&s.participants, Duration::from_secs(30), &origin)
        .await
        .unwrap();
    assert_eq!(snap.rules_digest.as_deref(), Some(rules_v1.as_str()));
    assert_eq!(snap.participants.len(), 3);
    assert!(snap.gateway_digest.is_some() && snap.rag_digest.is_some());
    let events = snapshot_events(&s.store).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, SNAPSHOT_COMMITTED);
    assert_eq!(events[0].1["id"], snap.id);
    assert_eq!(events[0].1["rules_digest"], rules_v1);

    // One participant refuses: SnapshotAborted naming it, nothing else changes.
    let before = s.state.digest();
    let mut with_faulty = s.participants.clone();
    with_faulty.push(Arc::new(Faulty {
        delay: Duration::ZERO,
        fail: true,
    }));
    let err = s
        .state
        .snapshots
        .take(&with_faulty, Duration::from_secs(30), &origin)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, SnapshotError::Aborted { participant, timed_out: false, .. } if participant == "faulty"),
        "{err}"
    );
    let events = snapshot_events(&s.store).await;
    assert_eq!(events.len(), 2);
    assert_eq!(events[1].0, SNAPSHOT_ABORTED);
    assert_eq!(events[1].1["participant"], "faulty");
    assert_eq!(events[1].1["reason"], "disk full");
    assert_eq!(s.state.snapshots.snapshots().len(), 1);
    assert_eq!(s.state.digest(), before);

    // One participant sleeps past the ttl: aborted as timed out, promptly.
    let mut with_slow = s.participants.clone();
    with_slow.push(Arc::new(Faulty {
        delay: Duration::from_secs(60),
        fail: false,
    }));
    let started = std::time::Instant::now();
    let err = s
        .state
        .snapshots
        .take(&with_slow, Duration::from_millis(300), &origin)
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(&err, SnapshotError::Aborted { participant, timed_out: true, .. } if participant == "faulty"),
        "{err}"
    );
    assert_eq!(snapshot_events(&s.store).await[2].0, SNAPSHOT_ABORTED);
    assert_eq!(s.state.snapshots.snapshots().len(), 1);

    // Change rules and corpus, snapshot again, then roll back to the first snapshot.
    let v2 = change_rules_and_corpus(
        &s.state,
        "basel3_delta",
        "# Reporting\n\nReport trades above 2m.\n",
    )
    .await;
    assert_ne!(v1.version, v2.version);
    let rules_v2 = s.state.policies.engine().snapshot().digest_hex();
    assert_ne!(rules_v1, rules_v2);
    s.state
        .snapshots
        .take(&s.participants, Duration::from_secs(30), &origin)
        .await
        .unwrap();

    let unknown = s
        .state
        .snapshots
        .rollback(&s.participants, "no-such-snapshot", "test", &origin)
        .await
        .unwrap_err();
    assert!(matches!(unknown, SnapshotError::UnknownSnapshot(_)));

    let rolled = s
        .state
        .snapshots
        .rollback(&s.participants, "previous", "bad limits", &origin)
        .await
        .unwrap();
    assert_eq!(rolled.target_snapshot, snap.id);
    assert_eq!(s.state.policies.engine().snapshot().digest_hex(), rules_v1);
    assert_eq!(s.state.corpora.current_versions()["mas"], v1.version);
    let events = snapshot_events(&s.store).await;
    let last = &events.last().unwrap();
    assert_eq!(last.0, "RolledBack");
    assert_eq!(last.1["target_snapshot"], snap.id);
    assert_eq!(last.1["reason"], "bad limits");
    assert_eq!(last.1["restored"]["rules_digest"], rules_v1);
    assert_eq!(
        last.1["restored"]["rag_digest"],
        snap.rag_digest.clone().unwrap()
    );
    assert_eq!(events.len(), 5, "one event for the rollback");

    // A restart keeps the snapshots, the rollback, the restored corpus version and the
    // restored rule set (rebuilt from the recorded policy versions).
    s.store.shutdown().await;
    let store = EventStore::connect(&s.url, StoreConfig::default())
        .await
        .unwrap();
    let again = ControlState::replay(&store).await.unwrap();
    assert_eq!(again.snapshots.snapshots().len(), 2);
    assert_eq!(again.snapshots.rollbacks().len(), 1);
    assert_eq!(again.corpora.current_versions()["mas"], v1.version);
    assert_eq!(again.policies.engine().snapshot().digest_hex(), rules_v1);
    // A rollback in the restarted process to a snapshot taken before the restart.
    let again_participants = again.participants();
    again
        .snapshots
        .rollback(&again_participants, &snap.id, "again", &origin)
        .await
        .unwrap();
    assert_eq!(again.policies.engine().snapshot().digest_hex(), rules_v1);

    // An ingest after the rollback builds on the restored version, and replays so.
    let (v3, _) = again
        .corpora
        .ingest(
            CorpusIngest {
                replace: false,
                ..corpus("# Records\n\nKeep records 5 years.\n")
            },
            &origin,
        )
        .await
        .unwrap();
    assert_eq!(v3.previous.as_deref(), Some(v1.version.as_str()));
    store.shutdown().await;
    let store = EventStore::connect(&s.url, StoreConfig::default())
        .await
        .unwrap();
    let third = ControlState::replay(&store).await.unwrap();
    assert_eq!(third.corpora.current_versions()["mas"], v3.version);
    store.shutdown().await;
}

/// Registers `finmoe-7b-{v3,v4}@sgp-region` with artifacts in `dir`.
async fn two_models(state: &ControlState, dir: &std::path::Path) {
    for (name, bytes) in [("v3", b"three".as_slice()), ("v4", b"four".as_slice())] {
        let path = dir.join(format!("{name}.bin"));
        std::fs::write(&path, bytes).unwrap();
        let spec = aether_control::ModelSpec {
            model_ref: format!("finmoe-7b-{name}@sgp-region"),
            uri: path.display().to_string(),
            digest: hex::encode(aether_ledger::hashing::sm3(bytes)),
            feature_schema: serde_json::json!({"amount_minor": "int"})
                .as_object()
                .unwrap()
                .clone(),
        };
        state.models.register(spec, &operator()).await.unwrap();
    }
}

fn rollout_request() -> aether_control::RolloutRequest {
    aether_control::RolloutRequest {
        baseline: "finmoe-7b-v3@sgp-region".into(),
        candidate: "finmoe-7b-v4@sgp-region".into(),
        steps: vec![1, 2, 5, 100],
        analysis: Default::default(),
        automated: false,
    }
}

/// Both models registered, aml_v2 and a corpus, the engine active on v3, and a rollout of
/// v4 stepped twice (2 %).
async fn rollout_at_two_percent(s: &Setup, origin: &Origin) -> aether_control::RolloutState {
    use aether_control::{ActivationRequest, Command};
    two_models(&s.state, s._dir.path()).await;
    change_rules_and_corpus(
        &s.state,
        "aml_v2",
        "# Reporting\n\nReport trades above 1m.\n",
    )
    .await;
    let (_, task) = s
        .state
        .engines
        .request_activation(
            ActivationRequest {
                model_ref: "finmoe-7b-v3@sgp-region".into(),
                traffic_weight: 1.0,
                policy_hooks: vec!["aml_v2".into()],
            },
            origin,
        )
        .await
        .unwrap();
    task.await.unwrap();
    let (rollout, _) = s
        .state
        .rollouts
        .start(rollout_request(), origin)
        .await
        .unwrap();
    for _ in 0..2 {
        s.state
            .rollouts
            .command(&rollout.id, Command::Step, None, None, origin)
            .await
            .unwrap();
    }
    rollout
}

/// A rollback restores all three parts in one event: the rule set, the corpus, and the
/// gateway's routing table (the engine's model, undoing a promotion; a rollout's step and
/// weight); it ends a rollout started after the snapshot; a restart replays the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_restores_rules_corpus_and_routing() {
    use aether_control::{Command, EngineStatus, RolloutPhase, RoutingTable};
    let s = setup().await;
    let origin = operator();
    let rollout = rollout_at_two_percent(&s, &origin).await;
    let routing = |state: &ControlState| RoutingTable::of(&state.engines, &state.rollouts);
    let at_snapshot = routing(&s.state);
    assert_eq!(at_snapshot.rollouts[&rollout.id].candidate_weight, 2);
    let snap = s
        .state
        .snapshots
        .take(&s.participants, Duration::from_secs(30), &origin)
        .await
        .unwrap();
    assert_eq!(snap.gateway_digest, Some(at_snapshot.digest()));
    assert_eq!(snap.participants["gateway"].version, at_snapshot.version());
    let corpus_at_snapshot = s.state.corpora.current_versions();

    // Change all three parts: the rule set, the corpus, and (below) the routing.
    change_rules_and_corpus(
        &s.state,
        "basel3_delta",
        "# Reporting\n\nReport trades above 3m.\n",
    )
    .await;
    assert_ne!(s.state.corpora.current_versions(), corpus_at_snapshot);

    // Widen, then promote: the region now routes everything to the candidate.
    s.state
        .rollouts
        .command(&rollout.id, Command::Step, None, None, &origin)
        .await
        .unwrap();
    s.state
        .rollouts
        .command(&rollout.id, Command::Promote, None, None, &origin)
        .await
        .unwrap();
    let engine = s.state.engines.engine("sgp-region").unwrap();
    assert_eq!(engine.model_ref, "finmoe-7b-v4@sgp-region");
    assert!(routing(&s.state).rollouts.is_empty());

    let rolled = s
        .state
        .snapshots
        .rollback(&s.participants, &snap.id, "candidate breached", &origin)
        .await
        .unwrap();
    assert_eq!(
        rolled.restored["gateway_digest"].as_deref(),
        Some(at_snapshot.digest().as_str())
    );
    assert_eq!(routing(&s.state), at_snapshot);
    assert_eq!(
        Some(s.state.policies.engine().snapshot().digest_hex()),
        snap.rules_digest
    );
    assert_eq!(s.state.corpora.current_versions(), corpus_at_snapshot);
    let back = s.state.rollouts.get(&rollout.id).unwrap();
    assert_eq!(
        (back.phase, back.candidate_weight, back.step_index),
        (RolloutPhase::Progressing, 2, Some(1))
    );
    assert_eq!(
        s.state.engines.engine("sgp-region").unwrap().model_ref,
        "finmoe-7b-v3@sgp-region"
    );
    // The rollout goes on from the restored step.
    let (next, _) = s
        .state
        .rollouts
        .command(&rollout.id, Command::Step, None, None, &origin)
        .await
        .unwrap();
    assert_eq!(next.candidate_weight, 5);
    assert_eq!(s.state.snapshots.in_force(), Some(snap.id.clone()));

    // A restart replays the rollback into the same routing and the same state.
    let live = (routing(&s.state), s.state.digest());
    s.store.shutdown().await;
    let store = EventStore::connect(&s.url, StoreConfig::default())
        .await
        .unwrap();
    let again = ControlState::replay(&store).await.unwrap();
    assert_eq!((routing(&again), again.digest()), live);

    // A rollout started after a snapshot ends when the routing before it is restored.
    let participants = again.participants();
    again
        .rollouts
        .command(&rollout.id, Command::Abort, None, Some("restart"), &origin)
        .await
        .unwrap();
    let before = again
        .snapshots
        .take(&participants, Duration::from_secs(30), &origin)
        .await
        .unwrap();
    let (late, _) = again
        .rollouts
        .start(rollout_request(), &origin)
        .await
        .unwrap();
    again
        .rollouts
        .command(&late.id, Command::Step, None, None, &origin)
        .await
        .unwrap();
    again
        .snapshots
        .rollback(&participants, &before.id, "not approved", &origin)
        .await
        .unwrap();
    let late = again.rollouts.get(&late.id).unwrap();
    assert_eq!(
        (late.phase, late.candidate_weight),
        (RolloutPhase::RolledBack, 0)
    );
    assert!(routing(&again).rollouts.is_empty());
    assert_eq!(
        again.engines.engine("sgp-region").unwrap().status,
        EngineStatus::Active
    );
    store.shutdown().await;
}

/// The demo's scenario in small: a snapshot taken while the candidate had 2 %, widened to
/// 5 %, then frozen at 0 % (the controller's reaction to drift), then the rollback to that
/// snapshot. The rollback restores the step but never the candidate's exposure: it stays at
/// 0 %, live and after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_never_raises_the_candidates_weight() {
    use aether_control::{Command, RoutingTable};
    let s = setup().await;
    let origin = operator();
    let rollout = rollout_at_two_percent(&s, &origin).await;
    let snap = s
        .state
        .snapshots
        .take(&s.participants, Duration::from_secs(30), &origin)
        .await
        .unwrap();
    s.state
        .rollouts
        .command(&rollout.id, Command::Step, None, None, &origin)
        .await
        .unwrap();
    assert_eq!(
        s.state.rollouts.get(&rollout.id).unwrap().candidate_weight,
        5
    );
    s.state
        .rollouts
        .set_weight(&rollout.id, 0, "drift", "analysis", &origin)
        .await
        .unwrap();
    let rolled = s
        .state
        .snapshots
        .rollback(&s.participants, &snap.id, "drift after widening", &origin)
        .await
        .unwrap();
    let back = s.state.rollouts.get(&rollout.id).unwrap();
    assert_eq!((back.candidate_weight, back.step_index), (0, Some(1)));
    let routing = |state: &ControlState| RoutingTable::of(&state.engines, &state.rollouts);
    assert_eq!(routing(&s.state).rollouts[&rollout.id].candidate_weight, 0);
    // The event names the routing actually in force, not the snapshot's wider one.
    assert_eq!(
        rolled.restored["gateway_digest"].as_deref(),
        Some(routing(&s.state).digest().as_str())
    );
    assert_ne!(snap.gateway_digest, Some(routing(&s.state).digest()));
    let live = routing(&s.state);
    s.store.shutdown().await;
    let store = EventStore::connect(&s.url, StoreConfig::default())
        .await
        .unwrap();
    let again = ControlState::replay(&store).await.unwrap();
    assert_eq!(routing(&again), live);
    store.shutdown().await;
}

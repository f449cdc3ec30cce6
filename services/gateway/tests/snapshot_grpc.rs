//! Snapshot participants in separate tonic servers over real mTLS: the coordinator
//! commits through them, and one that does not answer within the ttl aborts the
//! snapshot with nothing changed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_control::snapshot::{RagParticipant, RulesParticipant, SNAPSHOT_ABORTED};
use aether_control::{
    ControlState, Origin, ParticipantError, Pinned, SNAPSHOT_COMMITTED, SNAPSHOT_STREAM,
    SnapshotError, SnapshotParticipant,
};
use aether_gateway::certs::{DevPkiSpec, PkiLayout, init_dev_pki};
use aether_gateway::identity::Role;
use aether_gateway::snapshot_grpc::{GrpcParticipant, ParticipantServer};
use aether_gateway::tls::{
    ServerTls, TlsPaths, client_tls_config, install_default_crypto_provider,
};
use aether_ledger::{Direction, EventStore, StoreConfig};
use aether_rules::PolicyFormat;
use tokio::net::TcpListener;
use tonic::transport::Server;
use uuid::Uuid;

/// A participant whose prepare hangs: a stuck remote process.
struct Stuck;

#[tonic::async_trait]
impl SnapshotParticipant for Stuck {
    fn name(&self) -> &str {
        "gateway"
    }
    async fn prepare(&self, _: Uuid, _: Duration) -> Result<Pinned, ParticipantError> {
        tokio::time::sleep(Duration::from_secs(600)).await;
        Err(ParticipantError::Failed("unreachable".into()))
    }
    async fn commit(&self, _: Uuid) -> Result<(), ParticipantError> {
        Ok(())
    }
    async fn abort(&self, _: Uuid) -> Result<(), ParticipantError> {
        Ok(())
    }
    async fn restore(&self, _: &str) -> Result<String, ParticipantError> {
        Err(ParticipantError::Failed("stuck".into()))
    }
}

async fn serve(layout: &PkiLayout, participant: Arc<dyn SnapshotParticipant>) -> SocketAddr {
    let tls = ServerTls::load(&TlsPaths::server(layout)).expect("server tls");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(
        Server::builder()
            .add_service(ParticipantServer::new(participant).into_service())
            .serve_with_incoming(tls.incoming(listener)),
    );
    addr
}

fn remote(layout: &PkiLayout, name: &str, addr: SocketAddr) -> Arc<dyn SnapshotParticipant> {
    let tls = client_tls_config(&TlsPaths::client(layout, Role::Worker, "coordinator"))
        .expect("client tls");
    Arc::new(
        GrpcParticipant::connect_lazy(name, &format!("https://{addr}"), tls).expect("endpoint"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_participants_commit_and_a_stuck_one_aborts() {
    install_default_crypto_provider();
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = DevPkiSpec {
        workers: vec!["coordinator".into()],
        ..DevPkiSpec::default()
    };
    let layout = init_dev_pki(dir.path().join("pki"), &spec)
        .expect("dev pki")
        .layout;
    let url = format!("sqlite:{}", dir.path().join("l.db").display());
    let store = EventStore::connect(&url, StoreConfig::default())
        .await
        .expect("store");
    let state = ControlState::replay(&store).await.expect("replay");
    let origin = Origin::from("operator:alice");
    let aml = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../rules/policies/aml_v2.yaml"),
    )
    .expect("policy");
    state
        .policies
        .ingest(&aml, PolicyFormat::Yaml, &origin)
        .await
        .expect("ingest");

    let rules = serve(
        &layout,
        Arc::new(RulesParticipant::new(state.policies.clone())),
    )
    .await;
    let rag = serve(
        &layout,
        Arc::new(RagParticipant::new(state.corpora.clone())),
    )
    .await;
    let stuck = serve(&layout, Arc::new(Stuck)).await;
    let healthy = vec![remote(&layout, "rules", rules), remote(&layout, "rag", rag)];

    // Commit through two processes' worth of servers: digests come over the wire.
    let snap = state
        .snapshots
        .take(&healthy, Duration::from_secs(10), &origin)
        .await
        .expect("commit");
    assert_eq!(
        snap.rules_digest,
        Some(state.policies.engine().snapshot().digest_hex())
    );
    assert!(snap.rag_digest.is_some());

    // One remote participant never answers: aborted at the ttl, nothing changed.
    let before = state.digest();
    let mut with_stuck = healthy.clone();
    with_stuck.push(remote(&layout, "gateway", stuck));
    let started = std::time::Instant::now();
    let err = state
        .snapshots
        .take(&with_stuck, Duration::from_millis(500), &origin)
        .await
        .expect_err("must abort");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(&err, SnapshotError::Aborted { participant, .. } if participant == "gateway"),
        "{err}"
    );
    let events = store
        .read_stream(SNAPSHOT_STREAM, 0, Direction::Forward, 10)
        .await
        .expect("read");
    let types: Vec<_> = events.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types, [SNAPSHOT_COMMITTED, SNAPSHOT_ABORTED]);
    assert_eq!(
        events[1].payload_value().expect("payload")["participant"],
        "gateway"
    );
    assert_eq!(state.snapshots.snapshots().len(), 1);
    assert_eq!(state.digest(), before);

    // Restore goes over the wire too.
    let restored = healthy[0]
        .restore(snap.rules_digest.as_deref().unwrap_or_default())
        .await
        .expect("restore");
    assert_eq!(Some(restored), snap.rules_digest);
    store.shutdown().await;
}

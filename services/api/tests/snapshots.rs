//! Snapshots and rollback through the real router on a real SQLite ledger: roles, 404s,
//! and a rollback restoring the snapshot's digests.

use std::sync::Arc;

use aether_ledger::{EventStore, MerkleLog, StoreConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use aether_api::auth::Tokens;
use aether_api::{AppState, router};

const OPERATOR: &str = "aaaaaaaaaaaaaaaa";
const REGULATOR: &str = "bbbbbbbbbbbbbbbb";

/// One HTTP/1.1 request over a fresh connection; (status, body).
async fn call(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    token: &str,
    body: &str,
) -> (u16, serde_json::Value) {
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.expect("write");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await.expect("read");
    let status = answer[9..12].parse().expect("status");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    (status, serde_json::from_str(body).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_list_rollback_and_roles() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite:{}", dir.path().join("l.db").display());
    let store = EventStore::connect(&url, StoreConfig::default())
        .await
        .expect("store");
    let control = aether_control::ControlState::replay(&store)
        .await
        .expect("replay");
    let state = AppState {
        store: store.clone(),
        tokens: Arc::new(
            Tokens::parse(&format!("operator:{OPERATOR},regulator:{REGULATOR}")).expect("tokens"),
        ),
        metrics: metrics_exporter_prometheus::PrometheusBuilder::new()
            .build_recorder()
            .handle(),
        merkle: MerkleLog::default(),
        control,
        node_id: "test-node".into(),
        reads: store.clone(),
        sessions: Default::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router(state)).await });

    let (status, first) = call(addr, "POST", "/v1/snapshots", OPERATOR, "").await;
    assert_eq!(status, 201, "{first}");
    let (status, _) = call(addr, "POST", "/v1/snapshots", REGULATOR, "").await;
    assert_eq!(status, 403);
    let (status, list) = call(addr, "GET", "/v1/snapshots", REGULATOR, "").await;
    assert_eq!(status, 200);
    assert_eq!(list["snapshots"][0]["id"], first["id"]);

    let rollback = |id: &str| format!(r#"{{"snapshot_id":"{id}","reason":"test"}}"#);
    let (status, _) = call(
        addr,
        "POST",
        "/v1/rollback",
        REGULATOR,
        &rollback("previous"),
    )
    .await;
    assert_eq!(status, 403);
    let (status, _) = call(addr, "POST", "/v1/rollback", OPERATOR, &rollback("nope")).await;
    assert_eq!(status, 404);
    let id = first["id"].as_str().unwrap_or_default();
    let (status, done) = call(addr, "POST", "/v1/rollback", OPERATOR, &rollback(id)).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["target_snapshot"], first["id"]);
    assert_eq!(done["restored"]["rules_digest"], first["rules_digest"]);
}

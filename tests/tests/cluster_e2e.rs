//! Several `aether serve` nodes on one PostgreSQL ledger, as real processes: one checkpoint
//! signer for the cluster, membership at `GET /v1/cluster`, and the checkpointer's lease
//! failing over when its holder is killed or paused, with the database refusing what a
//! paused holder writes under its old lease.

use std::path::Path;
use std::time::{Duration, Instant};

use aether_e2e::{OPERATOR_TOKEN, Server, all_events, http, run_aether};
use aether_ledger::checkpoint::{PRIVATE_KEY_FILE, PUBLIC_KEY_FILE};
use aether_ledger::testing::TestDatabase;
use aether_lineage::testing::S3Server;
use serde_json::{Value, json};

const TTL_MS: &str = "1500";

/// A node with its own data directory and, beside the nodes' directories, the Delta
/// directory every node of the cluster shares.
fn node(data: &Path, db: &TestDatabase, id: &str, key: Option<&Path>) -> Server {
    let shared = data.parent().unwrap().join("delta");
    node_with(
        data,
        db,
        id,
        key,
        &[("AETHER_DELTA_URI", shared.to_str().unwrap())],
    )
}

/// node-a, which makes the cluster's keys, and node-b with node-a's checkpoint key, each
/// with a data directory of its own under `dir`.
fn two_nodes(dir: &Path, db: &TestDatabase) -> (Server, Server) {
    let node_a = node(&dir.join("a"), db, "node-a", None);
    let key = dir.join("a").join("keys").join(PRIVATE_KEY_FILE);
    let node_b = node(&dir.join("b"), db, "node-b", Some(&key));
    (node_a, node_b)
}

fn node_with(
    data: &Path,
    db: &TestDatabase,
    id: &str,
    key: Option<&Path>,
    more: &[(&str, &str)],
) -> Server {
    let mut env = vec![
        ("DATABASE_URL", db.url.as_str()),
        ("AETHER_NODE_ID", id),
        ("AETHER_LEASE_TTL_MS", TTL_MS),
        ("AETHER_CHECKPOINT_EVERY_SECS", "1"),
    ];
    let key = key.map(|k| k.to_str().unwrap().to_owned());
    if let Some(k) = &key {
        env.push(("AETHER_CHECKPOINT_KEY", k.as_str()));
    }
    env.extend_from_slice(more);
    Server::start(data, &env)
}

async fn cluster(server: &Server) -> Value {
    aether_e2e::clearing::get(server, "/v1/cluster").await
}

/// The node holding the checkpointer's live lease, and its token.
fn checkpointer(cluster: &Value) -> Option<(String, u64)> {
    holder_of(cluster, "checkpointer")
}

/// The node holding the live lease `name`, and its token.
fn holder_of(cluster: &Value, name: &str) -> Option<(String, u64)> {
    cluster["leases"].as_array()?.iter().find_map(|l| {
        (l["name"] == name && l["live"] == true).then(|| {
            (
                l["holder"].as_str().unwrap().to_owned(),
                l["token"].as_u64().unwrap(),
            )
        })
    })
}

/// Polls `server`'s view until `holder` holds the checkpointer; the time it took.
async fn wait_for_holder(server: &Server, holder: &str) -> (Duration, u64) {
    let started = Instant::now();
    loop {
        if let Some((h, token)) = checkpointer(&cluster(server).await)
            && h == holder
        {
            return (started.elapsed(), token);
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{holder} never took the checkpointer"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn append(server: &Server, n: u64) {
    let resp = http()
        .post(server.url("/v1/events"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&json!({"stream_id": format!("notes/{n}"), "events": [{"event_type": "Note", "payload": {"n": n}}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
}

/// Every checkpoint's fence token, in seq order, once one covers `seq`.
async fn checkpoint_tokens_covering(server: &Server, seq: u64) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let events = all_events(server).await;
        let checkpoints: Vec<&Value> = events
            .iter()
            .filter(|e| e["event_type"] == "CheckpointSigned")
            .collect();
        if checkpoints
            .iter()
            .any(|c| c["payload"]["tree_size"].as_u64() >= Some(seq))
        {
            return checkpoints
                .iter()
                .map(|c| {
                    c["metadata"]["fence"]["token"]
                        .as_u64()
                        .expect("a fenced checkpoint")
                })
                .collect();
        }
        assert!(Instant::now() < deadline, "no checkpoint covers seq {seq}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn head(server: &Server) -> u64 {
    let ready: Value = http()
        .get(server.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    ready["head_seq"].as_u64().unwrap()
}

/// Starts `aether serve` on `data` as node `id`, expecting it to refuse to start; its stderr.
fn refused_start(data: &Path, db: &TestDatabase, id: &str) -> String {
    let out = run_aether(
        &[
            "serve",
            "--data-dir",
            data.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
            "--node-id",
            id,
        ],
        &[("DATABASE_URL", db.url.as_str())],
    );
    assert!(!out.status.success(), "node {id} started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn signal(server: &Server, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_share_one_signer_and_the_checkpointer_fails_over() {
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let node_a = node(&dir.path().join("a"), &db, "node-a", None);
    let key = dir.path().join("a").join("keys").join(PRIVATE_KEY_FILE);

    // A node with a key of its own is refused, naming both fingerprints.
    let stderr = refused_start(&dir.path().join("stranger"), &db, "stranger");
    assert!(
        stderr.contains("is not the cluster's (fingerprint"),
        "{stderr}"
    );

    // With the cluster's key a second node joins; both are listed, node-a signs.
    let node_b = node(&dir.path().join("b"), &db, "node-b", Some(&key));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let view = cluster(&node_b).await;
        let ids: Vec<&str> = view["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["node_id"].as_str().unwrap())
            .collect();
        if ids.contains(&"node-a") && ids.contains(&"node-b") && checkpointer(&view).is_some() {
            assert_eq!(view["node_id"], "node-b");
            assert_eq!(view["ledger"], "postgres");
            let a = view["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|n| n["node_id"] == "node-a")
                .unwrap();
            assert!(
                a["duties"]
                    .as_array()
                    .unwrap()
                    .contains(&json!("checkpointer")),
                "{view}"
            );
            assert!(
                a["http_address"]
                    .as_str()
                    .unwrap()
                    .starts_with("http://127.0.0.1:")
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the cluster never showed both nodes: {view}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every singleton duty gets exactly one live holder.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let view = cluster(&node_b).await;
        let duties: Vec<Value> = view["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|n| n["duties"].as_array().unwrap().clone())
            .collect();
        let held = |duty: &str| duties.iter().filter(|d| *d == duty).count();
        let all = [
            "checkpointer",
            "rollout-controller",
            "lineage-openlineage",
            "lineage-delta",
        ];
        assert!(
            all.iter().all(|d| held(d) <= 1),
            "a duty held twice: {view}"
        );
        if all.iter().all(|d| held(d) == 1) {
            break;
        }
        assert!(Instant::now() < deadline, "a duty without a holder: {view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, first_token) = wait_for_holder(&node_b, "node-a").await;
    for n in 0..10 {
        append(if n % 2 == 0 { &node_a } else { &node_b }, n).await;
    }
    checkpoint_tokens_covering(&node_b, head(&node_b).await - 1).await;

    // SIGKILL the holder: node-b takes the duty and signs under a higher token.
    node_a.kill();
    let (took, token) = wait_for_holder(&node_b, "node-b").await;
    println!(
        "checkpointer failover after SIGKILL: {} ms",
        took.as_millis()
    );
    assert!(token > first_token);
    for n in 10..20 {
        append(&node_b, n).await;
    }
    let tokens = checkpoint_tokens_covering(&node_b, head(&node_b).await - 1).await;
    assert_eq!(tokens.last(), Some(&token), "{tokens:?}");

    // node-a comes back; node-b is paused past its lease, node-a takes over, node-b wakes.
    let node_a = node(&dir.path().join("a"), &db, "node-a", None);
    signal(&node_b, "STOP");
    let (took, paused_token) = wait_for_holder(&node_a, "node-a").await;
    println!(
        "checkpointer failover after SIGSTOP: {} ms",
        took.as_millis()
    );
    for n in 20..30 {
        append(&node_a, n).await;
    }
    signal(&node_b, "CONT");
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    for n in 30..35 {
        append(&node_b, n).await;
    }
    let tokens = checkpoint_tokens_covering(&node_a, head(&node_a).await - 1).await;
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "a checkpoint under an old token: {tokens:?}"
    );
    assert!(tokens.contains(&paused_token), "{tokens:?}");

    // One chain, every checkpoint signed by the one cluster key.
    assert!(node_a.terminate().success());
    assert!(node_b.terminate().success());
    let public = dir.path().join("a").join("keys").join(PUBLIC_KEY_FILE);
    let out = run_aether(
        &[
            "verify",
            "--public-key",
            public.to_str().unwrap(),
            "--data-dir",
            dir.path().join("a").to_str().unwrap(),
        ],
        &[("DATABASE_URL", db.url.as_str())],
    );
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    db.drop_database().await;
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// node-a with an engine active, and node-b with node-a's PKI, envelope key and checkpoint
/// key (one set for the cluster's members and nodes), each with a data directory of its own
/// under `dir` (`a`, `b`).
async fn two_clearing_nodes(dir: &Path, db: &TestDatabase) -> (Server, Server) {
    let (a_dir, b_dir) = (dir.join("a"), dir.join("b"));
    let node_a = node(&a_dir, db, "node-a", None);
    aether_e2e::clearing::activate(&node_a).await;
    copy_dir(&a_dir.join("certs"), &b_dir.join("certs"));
    copy_dir(&a_dir.join("keys"), &b_dir.join("keys"));
    let node_b = node(&b_dir, db, "node-b", None);
    (node_a, node_b)
}

/// How many `ClearingDecided` events the ledger holds, and for how many request ids.
async fn decisions_and_request_ids(server: &Server) -> (usize, usize) {
    let recorded = aether_e2e::clearing::decisions(server).await;
    let mut ids: Vec<&str> = recorded
        .iter()
        .map(|e| e["metadata"]["request_id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    (recorded.len(), ids.len())
}

/// The same member and request id submitted at the same moment to two nodes: the database
/// keeps one decision, and both callers get it (one of them as a replay), every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_decision_for_a_request_id_raced_to_two_nodes() {
    use aether_e2e::clearing::{client, trade};
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
    let (node_a, node_b) = two_clearing_nodes(dir.path(), &db).await;
    for round in 0..20i64 {
        let request_id = format!("race-{round}");
        let mut at_a = client(&node_a, &a_dir, "bank-a").await;
        let mut at_b = client(&node_b, &b_dir, "bank-a").await;
        let (ra, rb) = (request_id.clone(), request_id.clone());
        let t = trade(100_000 + round);
        let (ta, tb) = (t.clone(), t.clone());
        let (a, b) = tokio::join!(
            tokio::spawn(async move { at_a.submit(&ra, &ta).await }),
            tokio::spawn(async move { at_b.submit(&rb, &tb).await }),
        );
        let (a, b) = (a.unwrap().unwrap(), b.unwrap().unwrap());
        assert_eq!(
            a.receipt, b.receipt,
            "{request_id}: two different decisions answered"
        );
        assert_ne!(
            a.replayed, b.replayed,
            "{request_id}: one decides, the other replays"
        );
    }
    assert_eq!(
        decisions_and_request_ids(&node_b).await,
        (20, 20),
        "one decision per request id"
    );
    assert!(node_a.terminate().success());
    assert!(node_b.terminate().success());
    db.drop_database().await;
}

/// A TCP relay standing in for a member's load balancer: it forwards every connection to
/// the node it points at, and moving it to another node cuts the open connections, as a
/// balancer that takes a node out does.
struct Relay {
    port: u16,
    target: std::sync::Arc<std::sync::Mutex<String>>,
    connections: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Relay {
    async fn start(target: &Server) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = std::sync::Arc::new(std::sync::Mutex::new(grpc_addr(target)));
        let connections = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (to, open) = (target.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let addr = to.lock().unwrap().clone();
                open.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&addr).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                }));
            }
        });
        Relay {
            port,
            target,
            connections,
        }
    }

    /// The gRPC URL of the relay, with the host name the nodes' certificate names.
    fn url(&self, node: &Server) -> String {
        let (base, _) = node.grpc_url.rsplit_once(':').unwrap();
        format!("{base}:{}", self.port)
    }

    async fn move_to(&self, node: &Server) {
        *self.target.lock().unwrap() = grpc_addr(node);
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
        // Let the client's connection see its end before the next call.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn grpc_addr(node: &Server) -> String {
    let port = node.grpc_url.rsplit_once(':').unwrap().1;
    format!("127.0.0.1:{port}")
}

/// A member in session mode behind a balancer that moves it from node to node: the node it
/// lands on does not know its session key, the client re-keys there by itself, and every
/// trade is decided once — single calls, streams and batches alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_member_moved_to_another_node_rekeys_and_loses_nothing() {
    use aether_e2e::clearing::trade;
    use aether_gateway::certs::PkiLayout;
    use aether_gateway::client::ClearingClient;
    use aether_gateway::identity::Role;
    use aether_gateway::tls::TlsPaths;
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let a_dir = dir.path().join("a");
    let (node_a, node_b) = two_clearing_nodes(dir.path(), &db).await;
    let relay = Relay::start(&node_a).await;
    let mut member = ClearingClient::connect(
        &relay.url(&node_a),
        &TlsPaths::client(&PkiLayout::new(&a_dir), Role::Member, "bank-a"),
        &a_dir.join("keys/envelope.pub.pem"),
        "bank-a",
    )
    .await
    .unwrap();
    member.key_exchange().await.unwrap();
    let mut keys = vec![member.session_key_id().unwrap().to_owned()];
    let answer = member.submit("moved-0", &trade(100_001)).await.unwrap();
    assert!(!answer.replayed);

    // One call, after the balancer moved the member to node-b.
    relay.move_to(&node_b).await;
    let answer = member.submit("moved-1", &trade(100_002)).await.unwrap();
    assert!(!answer.replayed, "decided at node-b, not a replay");
    keys.push(member.session_key_id().unwrap().to_owned());

    // A stream back at node-a (which never granted node-b's key).
    relay.move_to(&node_a).await;
    let ids: Vec<String> = (0..6).map(|k| format!("moved-stream-{k}")).collect();
    let trades: Vec<_> = (0..6).map(|k| trade(200_000 + k)).collect();
    let items: Vec<(&str, &_)> = ids.iter().map(String::as_str).zip(&trades).collect();
    let outcomes = member.submit_stream(&items).await.unwrap();
    assert_eq!(outcomes.len(), 6);
    for outcome in &outcomes {
        let answer = outcome.answer.as_ref().unwrap();
        assert!(!answer.replayed, "{}", outcome.request_id);
    }
    keys.push(member.session_key_id().unwrap().to_owned());

    // A batch at node-b again.
    relay.move_to(&node_b).await;
    let ids: Vec<String> = (0..6).map(|k| format!("moved-batch-{k}")).collect();
    let items: Vec<(&str, &_)> = ids.iter().map(String::as_str).zip(&trades).collect();
    let outcomes = member.submit_batch(&items).await.unwrap();
    for (outcome, id) in outcomes.iter().zip(&ids) {
        assert_eq!(&outcome.request_id, id, "a batch's outcomes keep its order");
        assert!(!outcome.answer.as_ref().unwrap().replayed);
    }
    keys.push(member.session_key_id().unwrap().to_owned());
    keys.dedup();
    assert_eq!(keys.len(), 4, "a new session key at every move: {keys:?}");

    assert_eq!(
        decisions_and_request_ids(&node_a).await,
        (14, 14),
        "each trade decided once"
    );
    assert!(node_a.terminate().success());
    assert!(node_b.terminate().success());
    db.drop_database().await;
}

/// A policy ingested through one node is enforced by the other: it follows the shared
/// ledger, so within a moment both serve the same rule set, and the same corpus version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_ingested_through_one_node_is_in_force_on_the_other() {
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let (node_a, node_b) = two_nodes(dir.path(), &db);
    let before = aether_e2e::clearing::get(&node_b, "/v1/policies").await;
    let ingested = Instant::now();
    aether_e2e::clearing::ingest_aml_v2(&node_a).await;
    let on_a = aether_e2e::clearing::get(&node_a, "/v1/policies").await;
    assert_ne!(on_a["rule_set_digest"], before["rule_set_digest"]);
    loop {
        let on_b = aether_e2e::clearing::get(&node_b, "/v1/policies").await;
        if on_b["rule_set_digest"] == on_a["rule_set_digest"] {
            assert_eq!(
                on_b["policies"], on_a["policies"],
                "the same versions on both nodes"
            );
            break;
        }
        assert!(
            ingested.elapsed() < Duration::from_secs(20),
            "node-b never applied the policy: {on_b}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "policy in force on the other node after {} ms",
        ingested.elapsed().as_millis()
    );

    // A corpus version too: the other node serves the same current version.
    aether_e2e::clearing::ingest_example_corpus(&node_a).await;
    let on_a = aether_e2e::clearing::get(&node_a, "/v1/corpora").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while aether_e2e::clearing::get(&node_b, "/v1/corpora").await != on_a {
        assert!(
            Instant::now() < deadline,
            "node-b never applied the corpus version: {on_a}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(node_a.terminate().success());
    assert!(node_b.terminate().success());
    db.drop_database().await;
}

/// Polls `server`'s view until the live lease `name` is held by one of `holders`.
async fn wait_for_lease(server: &Server, name: &str, holders: &[&str]) -> String {
    let started = Instant::now();
    loop {
        if let Some((holder, _)) = holder_of(&cluster(server).await, name)
            && holders.contains(&holder.as_str())
        {
            return holder;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "none of {holders:?} took {name}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the `events` table on the store holds every seq up to `seq`.
async fn wait_for_table(s3: &S3Server, events: &str, seq: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let at = aether_lineage::delta::events_table_last_seq(events, &s3.options())
            .await
            .expect("read the table")
            .unwrap_or(0);
        if at >= seq {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the Delta table stayed at seq {at}, not {seq}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delta_tables_on_the_object_store_are_written_by_one_node_at_a_time() {
    let s3 = S3Server::start();
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let uri = s3.uri("cluster");
    let events = format!("{uri}/events");
    let aws = s3.env();
    let mut env: Vec<(&str, &str)> = aws.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    env.push(("AETHER_DELTA_URI", uri.as_str()));
    let data = |name: &str| dir.path().join(name);
    let node_a = node_with(&data("a"), &db, "node-a", None, &env);
    let key = data("a").join("keys").join(PRIVATE_KEY_FILE);

    // A node whose tables would be elsewhere (its own data directory) is refused, naming both.
    let out = run_aether(
        &[
            "serve",
            "--data-dir",
            data("elsewhere").to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
            "--node-id",
            "elsewhere",
            "--checkpoint-key",
            key.to_str().unwrap(),
        ],
        &[("DATABASE_URL", db.url.as_str())],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("but the cluster's are at {uri}")),
        "{stderr}"
    );

    let node_b = node_with(&data("b"), &db, "node-b", Some(&key), &env);
    let mut nodes = vec![("node-a", node_a), ("node-b", node_b)];
    for n in 0..20 {
        append(&nodes[(n % 2) as usize].1, n).await;
    }
    let first = wait_for_lease(&nodes[1].1, "lineage-delta", &["node-a", "node-b"]).await;
    wait_for_table(&s3, &events, head(&nodes[1].1).await).await;

    // The writer is paused past its lease: the other node takes the relay over; when the
    // paused one wakes, whatever it still tries to commit is refused by the store.
    let paused = nodes.iter().position(|(id, _)| *id == first).unwrap();
    let other = 1 - paused;
    signal(&nodes[paused].1, "STOP");
    wait_for_lease(&nodes[other].1, "lineage-delta", &[nodes[other].0]).await;
    for n in 20..30 {
        append(&nodes[other].1, n).await;
    }
    wait_for_table(&s3, &events, head(&nodes[other].1).await).await;
    signal(&nodes[paused].1, "CONT");
    for n in 30..40 {
        append(&nodes[(n % 2) as usize].1, n).await;
    }
    wait_for_table(&s3, &events, head(&nodes[other].1).await).await;

    // The writer now is SIGKILLed: the survivor takes the relays over.
    let holder = wait_for_lease(&nodes[0].1, "lineage-delta", &["node-a", "node-b"]).await;
    let killed = nodes.iter().position(|(id, _)| *id == holder).unwrap();
    let (_, victim) = nodes.remove(killed);
    victim.kill();
    let (survivor_id, survivor) = nodes.remove(0);
    wait_for_lease(&survivor, "lineage-delta", &[survivor_id]).await;
    wait_for_lease(&survivor, "lineage-openlineage", &[survivor_id]).await;
    for n in 40..50 {
        append(&survivor, n).await;
    }
    assert!(survivor.terminate().success());

    // Every event of the ledger is in the table exactly once, and has its OpenLineage record.
    let store = aether_ledger::EventStore::connect(&db.url, Default::default())
        .await
        .unwrap();
    let ledger_head = store.head().await.unwrap().unwrap().0;
    let seqs = s3.table_seqs(&events).await;
    assert_eq!(
        seqs,
        (1..=ledger_head as i64).collect::<Vec<_>>(),
        "the table is not the ledger"
    );
    let report = aether_lineage::relay::reconcile(&store).await.unwrap();
    assert!(report.missing_openlineage.is_empty(), "{report:?}");
    assert!(report.missing_delta.is_empty(), "{report:?}");
    store.shutdown().await;
    db.drop_database().await;
}

/// The short chaos run (the long one: `scripts/test.sh --long`): three nodes, the Delta
/// tables on a real S3 server, clearing, event and policy load through all of them, a node
/// SIGKILLed every 5 s; every check of the run must pass.
#[test]
fn a_short_chaos_run_loses_and_doubles_nothing() {
    let report = aether_e2e::chaos_run(&[
        "--nodes",
        "3",
        "--duration-secs",
        "22",
        "--kill-every-secs",
        "5",
        "--down-ms",
        "2500",
    ]);
    for line in ["chaos: 3 nodes, 22 s, a SIGKILL every 5 s", "kill 4: node-"] {
        assert!(report.contains(line), "no {line:?} in:\n{report}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_activated_through_one_node_clears_on_the_other() {
    use aether_e2e::clearing::{activate, client, get, trade};
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
    let node_a = node(&a_dir, &db, "node-a", None);
    copy_dir(&a_dir.join("certs"), &b_dir.join("certs"));
    copy_dir(&a_dir.join("keys"), &b_dir.join("keys"));
    // node-b is running before the engine exists: it learns of it from the ledger.
    let node_b = node(&b_dir, &db, "node-b", None);
    assert_eq!(get(&node_b, "/v1/engines").await["engines"], json!([]));
    activate(&node_a).await;
    let started = Instant::now();
    loop {
        let engines = get(&node_b, "/v1/engines").await;
        if engines["engines"][0]["status"] == "active" {
            assert_eq!(
                engines["engines"],
                get(&node_a, "/v1/engines").await["engines"],
                "the two nodes disagree on the engines"
            );
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "node-b never saw the engine: {engines}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "engine in force on the other node after {} ms",
        started.elapsed().as_millis()
    );
    let mut at_b = client(&node_b, &b_dir, "bank-a").await;
    let answer = at_b
        .submit("engine-followed-1", &trade(250_000))
        .await
        .unwrap();
    assert!(!answer.model_ref.is_empty(), "{answer:?}");
    assert!(answer.receipt.is_some());
    // Both nodes still agree after node-b decided through the engine it followed.
    assert_eq!(
        get(&node_a, "/v1/state").await["digest"],
        get(&node_b, "/v1/state").await["digest"]
    );
    db.drop_database().await;
}

/// Polls `server`'s `path` until `member` of its answer is `wanted`; the time it took.
async fn wait_for_value(server: &Server, path: &str, member: &str, wanted: &Value) -> Duration {
    let started = Instant::now();
    loop {
        let answer = aether_e2e::clearing::get(server, path).await;
        if &answer[member] == wanted {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{path} never showed {member} = {wanted}: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A rollback made through one node is in force on the other: the rule set of the snapshot
/// comes back there too, and both nodes end in the same state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_through_one_node_is_in_force_on_the_other() {
    use aether_e2e::clearing::{get, ingest_aml_v2, post};
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let (node_a, node_b) = two_nodes(dir.path(), &db);
    ingest_aml_v2(&node_a).await;
    let snapshot_rules = get(&node_a, "/v1/policies").await["rule_set_digest"].clone();
    wait_for_value(&node_b, "/v1/policies", "rule_set_digest", &snapshot_rules).await;
    let (status, snapshot) = post(&node_a, "/v1/snapshots", json!({})).await;
    assert_eq!(status, 201, "{snapshot}");
    assert_eq!(snapshot["rules_digest"], snapshot_rules);

    // A second policy through node-a changes the rule set on both nodes.
    let policy = "name: cluster_extra\nversion: 1.0.0\nrules:\n  - id: huge\n    \
                  expression: request.amount_minor >= 900000000\n    action: hold\n    \
                  severity: low\n";
    aether_e2e::clearing::ingest_policy(&node_a, policy).await;
    let changed = get(&node_a, "/v1/policies").await["rule_set_digest"].clone();
    assert_ne!(changed, snapshot_rules);
    wait_for_value(&node_b, "/v1/policies", "rule_set_digest", &changed).await;

    // The rollback through node-a: node-b puts the snapshot's rule set back too.
    let (status, rollback) = post(
        &node_a,
        "/v1/rollback",
        json!({"snapshot_id": snapshot["id"], "reason": "the extra rule was a mistake"}),
    )
    .await;
    assert_eq!(status, 200, "{rollback}");
    // Acknowledged once in force on both nodes: node-b already serves the snapshot's rules.
    assert_eq!(
        rollback["in_force_on"],
        json!(["node-a", "node-b"]),
        "{rollback}"
    );
    assert_eq!(rollback["lagging"], json!([]), "{rollback}");
    assert_eq!(
        get(&node_a, "/v1/policies").await["rule_set_digest"],
        snapshot_rules
    );
    assert_eq!(
        get(&node_b, "/v1/policies").await["rule_set_digest"],
        snapshot_rules
    );
    let state_a = get(&node_a, "/v1/state").await;
    wait_for_value(&node_b, "/v1/state", "digest", &state_a["digest"]).await;

    // A node that cannot apply it in time (paused) is named in the answer, and applies it
    // once it runs again.
    signal(&node_b, "STOP");
    let (status, again) = post(
        &node_a,
        "/v1/rollback",
        json!({"snapshot_id": snapshot["id"], "reason": "once more, node-b paused"}),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["in_force_on"], json!(["node-a"]), "{again}");
    assert_eq!(again["lagging"], json!(["node-b"]), "{again}");
    signal(&node_b, "CONT");
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(&node_b, "/v1/snapshots").await != get(&node_a, "/v1/snapshots").await {
        assert!(
            Instant::now() < deadline,
            "node-b never applied the second rollback"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(node_a.terminate().success());
    assert!(node_b.terminate().success());
    db.drop_database().await;
}

/// An engine activation that another live node is running is its business: a node that
/// starts meanwhile leaves it alone. Once that node is down, the next node to start closes
/// it as interrupted, as a single node does after its own restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_node_leaves_another_live_nodes_activation_alone() {
    use aether_e2e::clearing::get;
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let node_a = node(&dir.path().join("a"), &db, "node-a", None);
    let key = dir.path().join("a").join("keys").join(PRIVATE_KEY_FILE);
    // node-a is in the middle of an activation (its request recorded, no outcome yet).
    let store = aether_ledger::EventStore::connect(&db.url, Default::default())
        .await
        .unwrap();
    store
        .append(
            "engine/zz",
            aether_ledger::ExpectedVersion::NoStream,
            vec![
                aether_ledger::NewEvent::new(
                    "EngineActivationRequested",
                    json!({"model_ref": "slow@zz", "traffic_weight": 1.0, "policy_hooks": []}),
                )
                .with_metadata(json!({"actor": "test", "node": "node-a"})),
            ],
        )
        .await
        .unwrap();
    store.shutdown().await;
    let status = |engines: &Value| {
        engines["engines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["region"] == "zz")
            .map(|e| e["status"].clone())
    };

    let node_b = node(&dir.path().join("b"), &db, "node-b", Some(&key));
    assert_eq!(
        status(&get(&node_b, "/v1/engines").await),
        Some(json!("activating"))
    );
    assert!(node_b.terminate().success());

    // node-a goes away; past the time a silent node is presumed down, node-b starts again
    // and closes the activation nobody runs any more.
    assert!(node_a.terminate().success());
    tokio::time::sleep(Duration::from_secs(6)).await;
    let node_b = node(&dir.path().join("b"), &db, "node-b", Some(&key));
    let engines = get(&node_b, "/v1/engines").await;
    assert_eq!(status(&engines), Some(json!("failed")), "{engines}");
    assert!(node_b.terminate().success());
    db.drop_database().await;
}

/// The newest event of `event_type` whose payload's `member` is `value`, once there is one.
async fn wait_for_event(server: &Server, event_type: &str, member: &str, value: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let events = all_events(server).await;
        if let Some(e) = events
            .iter()
            .rev()
            .find(|e| e["event_type"] == event_type && e["payload"][member] == value)
        {
            return e.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no {event_type} with {member} {value}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The cluster's checkpoint key is rotated by the node that holds the new key and the
/// previous one, once it holds the checkpointer lease; `aether verify` follows the rotation
/// from the first key; a node started with the retired key is refused, and a running node
/// that has only the retired key stops when the lease comes to it rather than sign.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpoint_key_is_rotated_once_and_verify_follows_it() {
    use aether_ledger::checkpoint::{CheckpointSigner, key_fingerprint};
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let node_a = node(&dir.path().join("a"), &db, "node-a", None);
    let old_key = dir.path().join("a").join("keys").join(PRIVATE_KEY_FILE);
    let old = CheckpointSigner::from_pem_file(&old_key).unwrap();
    let (new, _) = CheckpointSigner::load_or_create(&dir.path().join("new-key")).unwrap();
    let new_key = dir.path().join("new-key").join(PRIVATE_KEY_FILE);
    wait_for_holder(&node_a, "node-a").await;
    for n in 0..5 {
        append(&node_a, n).await;
    }
    checkpoint_tokens_covering(&node_a, head(&node_a).await - 1).await;

    // node-c has the old key only; node-b the new one and the old one.
    let node_c = node(&dir.path().join("c"), &db, "node-c", Some(&old_key));
    let shared = dir.path().join("delta");
    let node_b = node_with(
        &dir.path().join("b"),
        &db,
        "node-b",
        Some(&new_key),
        &[
            ("AETHER_DELTA_URI", shared.to_str().unwrap()),
            ("AETHER_PREVIOUS_CHECKPOINT_KEY", old_key.to_str().unwrap()),
        ],
    );
    // The lease goes to node-b (node-c is paused meanwhile), which rotates, then signs.
    signal(&node_c, "STOP");
    node_a.kill();
    wait_for_holder(&node_b, "node-b").await;
    for n in 5..10 {
        append(&node_b, n).await;
    }
    let rotation = wait_for_event(
        &node_b,
        "CheckpointKeyRotated",
        "new_key",
        &new.public_key_hex(),
    )
    .await;
    assert_eq!(rotation["payload"]["previous_key"], old.public_key_hex());
    assert_eq!(rotation["stream_id"], "ledger/checkpoint-keys");
    assert!(rotation["metadata"]["fence"]["token"].is_u64(), "fenced");
    wait_for_event(
        &node_b,
        "CheckpointSigned",
        "public_key",
        &new.public_key_hex(),
    )
    .await;
    let view = cluster(&node_b).await;
    assert_eq!(
        view["checkpoint_key"],
        json!({"fingerprint": key_fingerprint(&new.public_key_hex()), "rotations": 1}),
        "{view}"
    );

    // A node started with the retired key alone is refused, naming both fingerprints.
    let stderr = refused_start(&dir.path().join("a"), &db, "node-a");
    assert!(
        stderr.contains(&key_fingerprint(&old.public_key_hex()))
            && stderr.contains(&key_fingerprint(&new.public_key_hex())),
        "{stderr}"
    );

    // node-c wakes with the retired key; when the lease comes to it, it stops, signing
    // nothing.
    signal(&node_c, "CONT");
    let mut node_c = node_c;
    node_b.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for n in 10..13 {
        let _ = http()
            .post(node_c.url("/v1/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&json!({"stream_id": format!("notes/{n}"), "events": [{"event_type": "Note", "payload": {"n": n}}]}))
            .send()
            .await;
    }
    let status = node_c
        .wait_exit(Duration::from_secs(30))
        .expect("node-c stops once it would have to sign with a retired key");
    assert!(!status.success());
    let log = std::fs::read_to_string(&node_c.log_path).unwrap();
    assert!(log.contains("the key was rotated"), "{log}");

    // A regulator's evidence bundle carries the rotation, and verifies offline from the
    // first key.
    let node_b = node(&dir.path().join("b"), &db, "node-b", Some(&new_key));
    checkpoint_tokens_covering(&node_b, head(&node_b).await - 1).await;
    let bundle: Value = http()
        .post(node_b.url("/v1/audit/exports"))
        .bearer_auth(aether_e2e::REGULATOR_TOKEN)
        .json(&json!({"stream_prefix": "notes/"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(bundle["public_key"], old.public_key_hex(), "{bundle}");
    assert_eq!(bundle["key_rotations"][0]["new_key"], new.public_key_hex());
    let path = dir.path().join("evidence.json");
    std::fs::write(&path, serde_json::to_vec(&bundle).unwrap()).unwrap();
    let public = dir.path().join("a").join("keys").join(PUBLIC_KEY_FILE);
    let out = aether_e2e::audit_verify(&path, &public);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("1 checkpoint key rotation(s) followed"),
        "{stdout}"
    );
    assert!(node_b.terminate().success());

    // One chain, verified from the first key through the rotation.
    let out = run_aether(
        &[
            "verify",
            "--public-key",
            public.to_str().unwrap(),
            "--data-dir",
            dir.path().join("a").to_str().unwrap(),
        ],
        &[("DATABASE_URL", db.url.as_str())],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 key rotation(s)"), "{stdout}");
    db.drop_database().await;
}

/// The rollout controller, on node-a, decides on the traffic node-b clears: node-b routes
/// by the rollout started through node-a (it follows the ledger), every node records its
/// windows of the rollout on the ledger, and node-a's checks merge them, naming whose
/// windows they had. Without either, node-a would see no evidence and never widen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rollout_controller_decides_on_every_nodes_traffic() {
    use aether_e2e::clearing::{activate, client, events_of_type, get, post, trade};
    use aether_gpu_worker::reference::REFERENCE_MODEL_DIGEST;
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
    let node_a = node(&a_dir, &db, "node-a", None);
    wait_for_lease(&node_a, "rollout-controller", &["node-a"]).await;
    copy_dir(&a_dir.join("certs"), &b_dir.join("certs"));
    copy_dir(&a_dir.join("keys"), &b_dir.join("keys"));
    let node_b = node(&b_dir, &db, "node-b", None);
    activate(&node_a).await;
    wait_for_value(
        &node_b,
        "/v1/engines",
        "engines",
        &get(&node_a, "/v1/engines").await["engines"],
    )
    .await;
    let (status, body) = post(
        &node_a,
        "/v1/models",
        json!({"ref": "aether-anomaly-mlp-v2@reference", "uri": aether_e2e::clearing::reference_weights(),
               "digest": REFERENCE_MODEL_DIGEST, "feature_schema": {"schema": "aether.features.v1"}}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = post(
        &node_a,
        "/v1/rollouts",
        json!({
            "baseline": "aether-anomaly-mlp@reference",
            "candidate": "aether-anomaly-mlp-v2@reference",
            "steps": [10, 50, 100],
            "automated": true,
            "analysis": {
                "window": {"length_ms": 1000},
                "evidence": {"min_requests": 5, "min_shadow_sample": 2, "min_drift_samples": 5},
                "drift": {"ks_alpha": 0.0},
                "sla": {"max_compliance_miss_rate": 1.0},
            },
        }),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let id = body["rollout"]["id"].as_str().unwrap().to_owned();

    // Traffic through node-b only, until the controller on node-a widens the candidate.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut traffic = Vec::new();
    for member in ["bank-a", "bank-b"] {
        let mut at_b = client(&node_b, &b_dir, member).await;
        let stop = stop.clone();
        traffic.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                let _ = at_b
                    .submit(&format!("{member}-{n}"), &trade(10_000 + n * 7))
                    .await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let widened = loop {
        let widened: Vec<Value> = events_of_type(&node_a, "RolloutWeightSet")
            .await
            .into_iter()
            .filter(|e| e["payload"]["reason"] == "increase")
            .collect();
        if !widened.is_empty() {
            break widened;
        }
        assert!(
            Instant::now() < deadline,
            "the controller never widened the candidate: {}",
            json!(events_of_type(&node_a, "RolloutChecked").await)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in traffic {
        let _ = task.await;
    }
    assert_eq!(
        widened[0]["metadata"]["fence"]["lease"],
        "rollout-controller"
    );

    // The decision rests on windows of both nodes, node-b's with the traffic.
    let windows = events_of_type(&node_a, "RolloutWindowObserved").await;
    let traffic_of = |node: &str| -> u64 {
        windows
            .iter()
            .filter(|w| w["payload"]["node"] == node)
            .map(|w| {
                w["payload"]["samples"]["candidate"]["requests"]
                    .as_u64()
                    .unwrap()
            })
            .sum()
    };
    assert!(traffic_of("node-b") > 0, "{}", json!(windows));
    assert_eq!(traffic_of("node-a"), 0);
    assert!(windows.iter().any(|w| w["payload"]["node"] == "node-a"));
    let checks = events_of_type(&node_a, "RolloutChecked").await;
    assert!(
        checks
            .iter()
            .any(|c| c["stream_id"] == format!("analysis/{id}")
                && c["payload"]["evidence"]["nodes"] == json!(["node-a", "node-b"])),
        "{}",
        json!(checks)
    );
    // Every conclusive check carries the A/B comparison, and the analysis API shows it
    // on either node, newest check first.
    let analysis = get(&node_b, &format!("/v1/rollouts/{id}/analysis?limit=5")).await;
    let listed = analysis["checks"].as_array().unwrap();
    assert!(!listed.is_empty() && listed.len() <= 5, "{analysis}");
    assert!(
        listed
            .windows(2)
            .all(|w| w[0]["seq"].as_u64() > w[1]["seq"].as_u64())
    );
    let metrics: Vec<&Value> = analysis["significance"]["comparisons"]
        .as_array()
        .unwrap_or_else(|| panic!("no significance in {analysis}"))
        .iter()
        .map(|c| &c["metric"])
        .collect();
    assert_eq!(
        metrics,
        [
            &json!("latency_p99_us"),
            &json!("error_rate"),
            &json!("mean_confidence"),
            &json!("compliance_miss_rate")
        ]
    );
    assert_eq!(analysis["significance"]["alpha"], 0.05);
    // Each check carries the golden metrics and risk its outcomes recorded (the rollout
    // board reads them from here, operators included).
    let conclusive: Vec<&Value> = listed
        .iter()
        .filter(|c| c.get("significance").is_some())
        .collect();
    assert!(!conclusive.is_empty(), "{analysis}");
    for check in conclusive {
        assert!(check["metrics"].is_object(), "no metrics in {check}");
        assert!(check["risk"].is_object(), "no risk in {check}");
    }
    assert!(
        checks
            .iter()
            .any(|c| c["payload"]["significance"]["windows"].as_u64() >= Some(1)),
        "{}",
        json!(checks)
    );
    for (query, status) in [("?limit=0", 400), ("?limit=101", 400), ("?page=2", 400)] {
        let resp = http()
            .get(node_b.url(&format!("/v1/rollouts/{id}/analysis{query}")))
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), status, "{query}");
    }

    // node-b follows the weight the controller on node-a set.
    let weight = widened.last().unwrap()["payload"]["to_weight"].clone();
    wait_for_value(
        &node_b,
        &format!("/v1/rollouts/{id}"),
        "candidate_weight",
        &weight,
    )
    .await;
    db.drop_database().await;
}

/// A consistent snapshot prepares on every live node: taken through node-a it names node-b
/// with the same state digest; while node-b is paused (still presumed alive) a snapshot is
/// aborted naming it; once node-b has been silent past 5 s, snapshots go on without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_prepares_on_every_live_node() {
    use aether_e2e::clearing::{get, ingest_aml_v2, post};
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let (node_a, node_b) = two_nodes(dir.path(), &db);
    ingest_aml_v2(&node_a).await;
    let rules = get(&node_a, "/v1/policies").await["rule_set_digest"].clone();
    wait_for_value(&node_b, "/v1/policies", "rule_set_digest", &rules).await;
    // node-b is listed as live.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cluster(&node_a).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n["node_id"] == "node-b")
    {
        assert!(Instant::now() < deadline, "node-b never beat");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let (status, snapshot) = post(&node_a, "/v1/snapshots", json!({})).await;
    assert_eq!(status, 201, "{snapshot}");
    assert!(
        snapshot["nodes"]["node-b"].is_string(),
        "node-b prepared it: {snapshot}"
    );

    signal(&node_b, "STOP");
    let (status, refused) = post(&node_a, "/v1/snapshots", json!({"ttl_ms": 1000})).await;
    assert_eq!(status, 503, "{refused}");
    assert_eq!(refused["participant"], "node node-b", "{refused}");
    assert!(
        refused["reason"].as_str().unwrap().contains("no answer"),
        "{refused}"
    );
    let aborted = aether_e2e::clearing::events_of_type(&node_a, "SnapshotAborted").await;
    assert_eq!(aborted.len(), 1, "the abort is on the ledger");

    tokio::time::sleep(Duration::from_millis(5_500)).await;
    let (status, snapshot) = post(&node_a, "/v1/snapshots", json!({"ttl_ms": 2000})).await;
    assert_eq!(status, 201, "{snapshot}");
    assert!(
        snapshot["nodes"].is_null(),
        "node-b is presumed down: {snapshot}"
    );
    signal(&node_b, "CONT");
    db.drop_database().await;
}

/// A console session belongs to the cluster, not to a node: signed in through one node, the
/// cookie reads through the other; signed out through the other, it is refused by both at
/// once; and a restarted node still knows a live session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_session_is_the_clusters() {
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let (node_a, node_b) = two_nodes(dir.path(), &db);
    let session = |server: &Server, cookie: &str| {
        let request = http()
            .get(server.url("/v1/session"))
            .header("cookie", cookie.to_owned());
        async move { request.send().await.unwrap().status().as_u16() }
    };
    let sign_in = |server: &Server| {
        let request = http()
            .post(server.url("/v1/session"))
            .bearer_auth(aether_e2e::REGULATOR_TOKEN);
        async move {
            let resp = request.send().await.unwrap();
            assert_eq!(resp.status(), 201);
            let cookie = resp.headers()["set-cookie"]
                .to_str()
                .unwrap()
                .split(';')
                .next()
                .unwrap()
                .to_owned();
            let body: Value = resp.json().await.unwrap();
            (cookie, body["csrf_token"].as_str().unwrap().to_owned())
        }
    };
    let (cookie, csrf) = sign_in(&node_a).await;
    assert_eq!(
        session(&node_b, &cookie).await,
        200,
        "opened on a, read on b"
    );
    let resp = http()
        .get(node_b.url("/v1/audit/checkpoints"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // Signed out through b: refused by a at once.
    let resp = http()
        .delete(node_b.url("/v1/session"))
        .header("cookie", &cookie)
        .header("x-csrf-token", &csrf)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    assert_eq!(
        session(&node_a, &cookie).await,
        401,
        "signed out on b, refused by a"
    );
    assert_eq!(session(&node_b, &cookie).await, 401);
    // A session outlives a node's restart.
    let (cookie, _) = sign_in(&node_b).await;
    assert!(node_b.terminate().success());
    let key = dir.path().join("a").join("keys").join(PRIVATE_KEY_FILE);
    let node_b = node(&dir.path().join("b"), &db, "node-b", Some(&key));
    assert_eq!(
        session(&node_b, &cookie).await,
        200,
        "still signed in after b restarted"
    );
    assert!(node_a.terminate().success());
    assert!(node_b.terminate().success());
    db.drop_database().await;
}

/// The snapshot coordinator is a singleton of the cluster: while another node holds the
/// coordinator lease, a snapshot or rollback asked of this node is refused (409, naming
/// the holder, nothing recorded); snapshots asked of both nodes at once commit one at a
/// time, each fenced with the coordinator lease's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_snapshot_coordinator_is_one_node_at_a_time() {
    use aether_e2e::clearing::{events_of_type, ingest_aml_v2};
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let (node_a, node_b) = two_nodes(dir.path(), &db);
    ingest_aml_v2(&node_a).await;
    let store = aether_ledger::EventStore::connect(&db.url, Default::default())
        .await
        .unwrap();

    // node-b coordinating (its lease taken here in its name): node-a refuses.
    let lease = "snapshot-coordinator";
    let held = store
        .acquire_lease(lease, "node-b", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(held.is_some());
    for (path, body) in [
        ("/v1/snapshots", json!({})),
        (
            "/v1/rollback",
            json!({"snapshot_id": "previous", "reason": "test"}),
        ),
    ] {
        let resp = http()
            .post(node_a.url(path))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 409, "{path}");
        assert_eq!(
            resp.headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()),
            Some("1")
        );
        let problem: Value = resp.json().await.unwrap();
        assert_eq!(problem["holder"], "node-b", "{problem}");
    }
    assert!(
        events_of_type(&node_a, "SnapshotCommitted")
            .await
            .is_empty()
    );
    assert!(events_of_type(&node_a, "SnapshotAborted").await.is_empty());
    store.release_lease(lease, "node-b").await.unwrap();

    // Asked of both nodes at once: each answer a commit or a refusal naming the other.
    let mut asked = Vec::new();
    for round in 0..6 {
        let server = if round % 2 == 0 { &node_a } else { &node_b };
        asked.push(
            http()
                .post(server.url("/v1/snapshots"))
                .bearer_auth(OPERATOR_TOKEN)
                .json(&json!({"ttl_ms": 5000}))
                .send(),
        );
    }
    let mut committed = 0;
    for answer in futures::future::join_all(asked).await {
        let answer = answer.unwrap();
        let status = answer.status().as_u16();
        let body: Value = answer.json().await.unwrap();
        match status {
            201 => committed += 1,
            409 => assert!(
                body["holder"].is_string() || body["participant"].is_string(),
                "{body}"
            ),
            other => panic!("{other}: {body}"),
        }
    }
    assert!(committed >= 1);
    let snapshots = events_of_type(&node_a, "SnapshotCommitted").await;
    assert_eq!(snapshots.len(), committed);
    let tokens: Vec<u64> = snapshots
        .iter()
        .map(|e| {
            assert_eq!(e["metadata"]["fence"]["lease"], lease, "{e}");
            e["metadata"]["fence"]["token"].as_u64().unwrap()
        })
        .collect();
    // Never decreasing: a token is raised each time the lease changes hands (a node that
    // takes it again at once, before its release lands, keeps its token).
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "one coordinator at a time: {tokens:?}"
    );
    drop(node_b);
    db.drop_database().await;
}

//! End-to-end: no single API call can break the ledger's proof. The system's own streams
//! and event types are refused on the generic append, every data file is private to the
//! service's user, and a ledger whose newest events were deleted is caught.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use aether_e2e::clearing::{activate, client, trade};
use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, all_events, http, run_aether};
use serde_json::{Value, json};

async fn append(server: &Server, stream: &str, event_type: &str) -> (u16, Value) {
    let resp = http()
        .post(server.url("/v1/events"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&json!({"stream_id": stream, "events": [{"event_type": event_type, "payload": {"n": 1}}]}))
        .send()
        .await
        .unwrap();
    (
        resp.status().as_u16(),
        resp.json().await.unwrap_or(Value::Null),
    )
}

/// Every stream and event type that the service itself wrote while it cleared, snapshotted,
/// signed and answered a regulator is refused when an operator sends it to `POST /v1/events`:
/// a list of reserved names that missed one would fail here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_systems_own_streams_and_types_are_refused_on_the_generic_append() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[("AETHER_CHECKPOINT_EVERY_EVENTS", "2")]);
    activate(&server).await;
    let mut bank_a = client(&server, &data, "bank-a").await;
    bank_a.submit("integrity-1", &trade(125_000)).await.unwrap();
    let resp = http()
        .post(server.url("/v1/snapshots"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let resp = http()
        .get(server.url("/v1/audit/events?limit=5"))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    let events = loop {
        let events = all_events(&server).await;
        if events.iter().any(|e| e["event_type"] == "CheckpointSigned") {
            break events;
        }
        assert!(Instant::now() < deadline, "no checkpoint was signed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let written: BTreeSet<(String, String)> = events
        .iter()
        .map(|e| {
            (
                e["stream_id"].as_str().unwrap().to_owned(),
                e["event_type"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    for wanted in [
        "ClearingDecided",
        "SnapshotCommitted",
        "AuditQueried",
        "EngineActivated",
        "PolicyIngested",
    ] {
        assert!(
            written.iter().any(|(_, t)| t == wanted),
            "no {wanted} in {written:?}"
        );
    }
    let head = events.len();
    for (stream, event_type) in &written {
        for (s, t) in [
            (stream.as_str(), event_type.as_str()),
            (stream, "Note"),
            ("notes/a", event_type),
        ] {
            let (status, problem) = append(&server, s, t).await;
            assert_eq!(status, 403, "{s} {t}: {problem}");
            assert_eq!(problem["title"], "Reserved namespace", "{problem}");
            assert!(
                problem["detail"].as_str().unwrap().contains("reserved"),
                "{problem}"
            );
        }
    }
    // Neighbouring names are the operator's, and none of the refusals wrote anything.
    for stream in ["notes/a", "engineering/x", "ledgers"] {
        assert_eq!(append(&server, stream, "Note").await.0, 201, "{stream}");
    }
    let after = all_events(&server).await;
    let appended: Vec<&str> = after[head..]
        .iter()
        .filter(|e| e["stream_id"] != "ledger/checkpoints" && e["stream_id"] != "access/audit")
        .map(|e| e["stream_id"].as_str().unwrap())
        .collect();
    assert_eq!(appended, ["notes/a", "engineering/x", "ledgers"]);
    assert!(server.terminate().success());
    let out = run_aether(&["verify", "--data-dir", data.to_str().unwrap()], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The embedded deployment's files hold personal data in clear (the SQLite ledger, its WAL,
/// the personal values beside the chain) and the trail itself: every file the service
/// creates under its data directory is 0600 and every directory 0700, even under a umask
/// that would leave them world-readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_data_file_is_private_to_the_service() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let jsonl = data.join("lineage-out").join("openlineage.jsonl");
    let server = Server::start(
        &data,
        &[
            ("AETHER_OPENLINEAGE_FILE", jsonl.to_str().unwrap()),
            ("AETHER_CHECKPOINT_EVERY_EVENTS", "1"),
        ],
    );
    let resp = http()
        .post(server.url("/v1/events"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(
            &json!({"stream_id": "notes/a", "events": [{"event_type": "Note", "payload": {"n": 1},
                      "personal": {"name": "Ada Lovelace"}}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    // Wait until lineage has written its files (Delta tables, the JSON-lines file).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(jsonl.is_file()
        && data
            .join("delta")
            .join("events")
            .join("_delta_log")
            .is_dir())
    {
        assert!(Instant::now() < deadline, "lineage wrote no files");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut seen = Vec::new();
    let mut wider = Vec::new();
    let mut stack = vec![data.clone()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let mode = meta.permissions().mode() & 0o777;
        let want = if meta.is_dir() { 0o700 } else { 0o600 };
        if meta.is_dir() {
            stack.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        }
        // Keys and tokens may be stricter (0400); nothing may be looser, but for public
        // certificates (0644, meant to be handed out; behind the 0700 data directory).
        let certificate = meta.is_file()
            && std::fs::read(&path)
                .unwrap()
                .starts_with(b"-----BEGIN CERTIFICATE-----");
        if mode & !want != 0 && !(certificate && mode == 0o644) {
            wider.push(format!("{} {:o}", path.display(), mode));
        }
        seen.push(path.strip_prefix(&data).unwrap().display().to_string());
    }
    for expected in [
        "ledger.db",
        "ledger.db-wal",
        "merkle",
        "delta",
        "keys",
        "lineage-out/openlineage.jsonl",
    ] {
        assert!(
            seen.iter().any(|s| s.starts_with(expected)),
            "no {expected} in {seen:?}"
        );
    }
    assert!(wider.is_empty(), "readable by others: {wider:?}");
    let data_mode = std::fs::metadata(&data).unwrap().permissions().mode() & 0o777;
    assert_eq!(data_mode, 0o700);
    assert!(server.terminate().success());
}

/// The newest events deleted by someone who could switch the append-only trigger off (a
/// database superuser): `aether verify` without an anchor cannot tell (the rest is a valid
/// shorter ledger), but with the checkpoint a regulator kept (`--since-checkpoint`) it fails,
/// and `aether serve` refuses to start over the gap, writing nothing, because this node's
/// Merkle file, Delta table and relay positions have seen further.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_whose_newest_events_were_deleted_is_caught() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[("AETHER_CHECKPOINT_EVERY_EVENTS", "10")]);
    let mut last = 0;
    for n in 0..40u64 {
        let (status, body) = append(&server, &format!("notes/{}", n % 3), "Note").await;
        assert_eq!(status, 201, "{body}");
        last = body["committed"][0]["seq"].as_u64().unwrap();
    }
    // Lineage has relayed everything: the Delta table and the relays' positions saw `last`.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let resp = http()
            .get(server.url(&format!("/v1/lineage/events/{last}")))
            .bearer_auth(REGULATOR_TOKEN)
            .send()
            .await
            .unwrap();
        if resp.status() == 200 {
            let record: Value = resp.json().await.unwrap();
            if record["delta_version"].is_i64() {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "lineage did not reach seq {last}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(server.terminate().success());
    let data_arg = data.to_str().unwrap();
    let verify = |anchor: Option<String>| {
        let mut args = vec!["verify".to_owned(), "--data-dir".into(), data_arg.into()];
        args.extend(
            anchor
                .map(|a| vec!["--since-checkpoint".into(), a])
                .unwrap_or_default(),
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_aether(&args, &[])
    };
    let report: Value = {
        let out = run_aether(&["verify", "--data-dir", data_arg, "--json"], &[]);
        assert!(out.status.success());
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let kept = &report["latest_checkpoint"];
    let anchor = format!(
        "{}:{}",
        kept["tree_size"],
        kept["root_hash"].as_str().unwrap()
    );
    let head = report["events_checked"].as_u64().unwrap();
    assert!(verify(Some(anchor.clone())).status.success());

    // A superuser deletes the newest 23 events.
    let url = format!("sqlite:{}", data.join("ledger.db").display());
    let db = sqlx::SqlitePool::connect(&url).await.unwrap();
    let delete = format!(
        "PRAGMA foreign_keys = OFF; DROP TRIGGER events_no_delete; DELETE FROM events WHERE seq > {};",
        head - 23
    );
    sqlx::raw_sql(&delete).execute(&db).await.unwrap();
    db.close().await;

    let out = verify(None);
    assert!(
        out.status.success(),
        "without an anchor the shorter ledger verifies"
    );
    let out = verify(Some(anchor));
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(&format!(
            "the ledger has {} events, fewer than the {}",
            head - 23,
            kept["tree_size"]
        )),
        "{said}"
    );
    let out = verify(Some("abc".into()));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected TREE_SIZE:ROOT_HASH"));

    let out = aether_e2e::run_serve(&data, &["--grpc-listen", "127.0.0.1:0"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("the ledger ends at seq {}, but ", head - 23))
            && stderr.contains(&format!("has already seen seq {head}")),
        "{stderr}"
    );
    // Nothing was written: no checkpoint over the gap, no event at a reused seq.
    let db = sqlx::SqlitePool::connect(&url).await.unwrap();
    let max: i64 = sqlx::query_scalar("SELECT MAX(seq) FROM events")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(max as u64, head - 23);
    db.close().await;
}

/// Malformed input never gets a server error: a NUL in a path or query, a seq past what
/// the ledger can hold, a NUL inside an OpenLineage event: each a 4xx problem, and nothing
/// is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_paths_queries_and_bodies_get_a_4xx_problem() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    append(&server, "notes/a", "Note").await;
    let before = all_events(&server).await.len();
    for (path, status) in [
        ("/v1/audit/events?member=%00", 400),
        ("/v1/audit/events?stream_prefix=a%00b", 400),
        ("/v1/audit/decisions/%00", 400),
        ("/api/v1/jobs/runs/%00", 400),
        ("/api/v1/namespaces/aether/jobs/a%00b", 400),
        ("/v1/audit/events/9223372036854775808", 400),
        ("/v1/events/9223372036854775808", 400),
        ("/v1/events/9007199254740991", 404),
        ("/v1/audit/proofs/inclusion?seq=9223372036854775808", 400),
    ] {
        let resp = http()
            .get(server.url(path))
            .bearer_auth(REGULATOR_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), status, "{path}");
        assert_eq!(
            resp.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
    }
    let event = json!({
        "eventType": "COMPLETE", "eventTime": "2026-12-06T10:00:00Z",
        "producer": "https://example.com/p",
        "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
        "run": {"runId": "0193a3f5-7b2e-7c3d-8e4f-5a6b7c8d9e0f"},
        "job": {"namespace": "ml", "name": "train\u{0}"}
    });
    let resp = http()
        .post(server.url("/api/v1/lineage"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&event)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    assert!(
        (400..500).contains(&status),
        "{status}: {}",
        resp.text().await.unwrap()
    );
    // Only the audit API's own access records were added.
    let after = all_events(&server).await;
    assert!(
        after[before..]
            .iter()
            .all(|e| e["stream_id"] == "access/audit"),
        "{:?}",
        &after[before..]
    );
    assert!(server.terminate().success());
}

/// A TCP proxy in front of PostgreSQL that the test can cut: an outage as the service sees
/// one (connections reset, new ones refused), of a real database.
struct Outage {
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cut: tokio::sync::watch::Sender<u64>,
    port: u16,
}

impl Outage {
    async fn start(upstream: String) -> Outage {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (cut, cuts) = tokio::sync::watch::channel(0u64);
        let accepting = open.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !accepting.load(Ordering::SeqCst) {
                    continue; // dropped: the connection is reset
                }
                let upstream = upstream.clone();
                let mut cuts = cuts.clone();
                // Only a cut after this connection opened ends it.
                cuts.borrow_and_update();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cuts.changed() => {}
                    }
                });
            }
        });
        Outage { open, cut, port }
    }

    fn set(&self, up: bool) {
        self.open.store(up, std::sync::atomic::Ordering::SeqCst);
        if !up {
            self.cut.send_modify(|n| *n += 1);
        }
    }
}

/// While the ledger database is unreachable the HTTP API answers at once, 503 with
/// `Retry-After`, reads and writes alike (and readyz), instead of hanging on the pool; once
/// the database is back the next append succeeds, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_is_answered_503_with_retry_after_at_once() {
    let db = aether_ledger::testing::TestDatabase::create().await;
    let Some((authority, rest)) = db
        .url
        .strip_prefix("postgres://")
        .and_then(|u| u.split_once('@'))
        .and_then(|(_, hostpart)| hostpart.split_once('/'))
        .filter(|(authority, _)| authority.contains(':'))
    else {
        eprintln!(
            "skipped: the test database is not reached over TCP ({})",
            db.url
        );
        return;
    };
    let outage = Outage::start(authority.to_owned()).await;
    let user = db
        .url
        .strip_prefix("postgres://")
        .unwrap()
        .split('@')
        .next()
        .unwrap();
    let proxied = format!("postgres://{user}@127.0.0.1:{}/{rest}", outage.port);
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &[("DATABASE_URL", proxied.as_str())],
    );
    assert_eq!(append(&server, "notes/a", "Note").await.0, 201);

    outage.set(false);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    for (method, path) in [
        ("POST", "/v1/events"),
        ("GET", "/v1/events?limit=5"),
        ("GET", "/readyz"),
    ] {
        let request = match method {
            "POST" => client.post(server.url(path)).json(
                &json!({"stream_id": "notes/a", "events": [{"event_type": "Note", "payload": {}}]}),
            ),
            _ => client.get(server.url(path)),
        };
        let resp = request
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await
            .unwrap_or_else(|e| {
                panic!("{method} {path} did not answer within 5 s during the outage: {e}")
            });
        assert_eq!(resp.status().as_u16(), 503, "{method} {path}");
        assert_eq!(resp.headers()["retry-after"], "1", "{method} {path}");
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
    }
    // Past 5 s without applying the ledger's control events, the node says it is catching
    // up (a load balancer takes it out), and it is ready again once it has followed.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let resp = client.get(server.url("/readyz")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    let problem: Value = resp.json().await.unwrap();
    assert_eq!(problem["title"], "Catching up", "{problem}");

    outage.set(true);
    let deadline = Instant::now() + Duration::from_secs(20);
    while append(&server, "notes/a", "Note").await.0 != 201 {
        assert!(
            Instant::now() < deadline,
            "appends did not recover after the outage"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    while client
        .get(server.url("/readyz"))
        .send()
        .await
        .unwrap()
        .status()
        != 200
    {
        assert!(
            Instant::now() < deadline,
            "never ready again after the outage"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(server.terminate().success());
    db.drop_database().await;
}

/// `POST /v1/models` reads only regular files inside the model directories, at most the
/// configured size: not `/etc/hostname` (whose digest it would have answered), not
/// `/dev/zero` (read for ever), not a link out of the directory; nothing is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_artifacts_are_read_only_from_the_model_directories() {
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    std::fs::write(models.join("big.bin"), vec![7u8; 4096]).unwrap();
    std::fs::write(models.join("small.bin"), b"weights").unwrap();
    std::os::unix::fs::symlink("/etc/hostname", models.join("link.bin")).unwrap();
    let dirs = format!("{}:/dev", models.display());
    let server = Server::start(
        &dir.path().join("data"),
        &[
            ("AETHER_MODEL_DIRS", dirs.as_str()),
            ("AETHER_MAX_MODEL_BYTES", "1024"),
        ],
    );
    let register = |uri: String, digest: String| {
        let server = &server;
        async move {
            let resp = http()
                .post(server.url("/v1/models"))
                .bearer_auth(OPERATOR_TOKEN)
                .json(&json!({"ref": "m-1@sgp", "uri": uri, "digest": digest,
                              "feature_schema": {"amount_minor": "i64"}}))
                .send()
                .await
                .unwrap();
            (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
        }
    };
    let any = "0".repeat(64);
    for (uri, says) in [
        ("/etc/hostname".to_owned(), "outside the model directories"),
        (
            models.join("link.bin").display().to_string(),
            "outside the model directories",
        ),
        ("/dev/zero".to_owned(), "not a regular file"),
        (
            models.join("big.bin").display().to_string(),
            "over the limit of 1024",
        ),
    ] {
        let (status, problem) = register(uri.clone(), any.clone()).await;
        assert_eq!(status, 422, "{uri}: {problem}");
        assert!(
            problem["detail"].as_str().unwrap().contains(says),
            "{uri}: {problem}"
        );
    }
    let digest = hex::encode(aether_ledger::hashing::sm3(b"weights"));
    let (status, problem) = register(models.join("small.bin").display().to_string(), digest).await;
    assert_eq!(status, 201, "{problem}");
    let models_registered = all_events(&server)
        .await
        .iter()
        .filter(|e| e["event_type"] == "ModelRegistered")
        .count();
    assert_eq!(models_registered, 1);
    assert!(server.terminate().success());
}

/// Idle and slow connections cannot hold the HTTP service: a connection that sends no
/// request, or stalls inside its headers, is closed after the header timeout, and a flood
/// of them past the connection cap is cut at once, so other callers are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_slow_http_connections_are_closed_and_capped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(
        &dir.path().join("data"),
        &[
            ("AETHER_HTTP_HEADER_TIMEOUT_MS", "500"),
            ("AETHER_MAX_HTTP_CONNECTIONS", "16"),
        ],
    );
    let address = server.base_url.strip_prefix("http://").unwrap().to_owned();
    // Closed by the server: reading gives end-of-file (or a reset) well before 10 s.
    async fn closed_by_server(stream: &mut tokio::net::TcpStream) -> bool {
        let mut buf = [0u8; 256];
        loop {
            match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return true,
                Ok(Ok(_)) => continue, // a 408 or similar before the close
                Err(_) => return false,
            }
        }
    }
    let mut idle = tokio::net::TcpStream::connect(&address).await.unwrap();
    let mut slow = tokio::net::TcpStream::connect(&address).await.unwrap();
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    assert!(
        closed_by_server(&mut idle).await,
        "an idle connection was kept open"
    );
    assert!(
        closed_by_server(&mut slow).await,
        "a slow-loris connection was kept open"
    );

    // A flood of idle connections past the cap: every one is closed, and the service
    // answers a normal caller meanwhile or right after.
    let mut flood = Vec::new();
    for _ in 0..64 {
        flood.push(tokio::net::TcpStream::connect(&address).await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(resp) = http().get(server.url("/healthz")).send().await
            && resp.status() == 200
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the service did not answer during the flood"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for stream in &mut flood {
        assert!(
            closed_by_server(stream).await,
            "a flooding connection was kept open"
        );
    }
    assert!(server.terminate().success());
}

/// The Merkle file is derived data: deleted, it is rebuilt from the ledger at the next
/// start, and the log says so as a warning, as docs/operations.md promises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_merkle_file_is_rebuilt_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    for _ in 0..3 {
        assert_eq!(append(&server, "notes/a", "Note").await.0, 201);
    }
    assert!(server.terminate().success());
    std::fs::remove_file(data.join("merkle").join("event-hashes")).unwrap();
    let server = Server::start(&data, &[]);
    let log = std::fs::read_to_string(&server.log_path).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("Merkle log file was missing or empty; rebuilt from the ledger"))
        .unwrap_or_else(|| panic!("no rebuild warning in:\n{log}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(server.terminate().success());
}

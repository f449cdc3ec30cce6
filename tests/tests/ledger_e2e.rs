//! End-to-end: real `aether serve` processes on a real SQLite file or PostgreSQL database,
//! driven over HTTP, killed, restarted and verified with `aether verify`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_e2e::{
    OPERATOR_TOKEN, REGULATOR_TOKEN, Server, aether_bin, all_events, http, run_aether,
};
use aether_ledger::testing::TestDatabase;
use serde_json::{Value, json};

/// What the server acknowledged: event id → (seq, hash).
type Acked = Arc<Mutex<HashMap<String, (u64, String)>>>;

async fn append(client: &reqwest::Client, server_url: &str, stream: &str, n: u64) -> Option<Value> {
    let body = json!({
        "stream_id": stream,
        "events": [{
            "event_type": "TradeBooked",
            "payload": {"request_id": format!("req-{n}"), "amount_minor": n, "decision": "cleared", "pad": "x".repeat(400)},
            "metadata": {"actor": "e2e", "trace_id": format!("trace-{n}")}
        }]
    });
    let resp = client
        .post(format!("{server_url}/v1/events"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&body)
        .send()
        .await
        .ok()?;
    if resp.status() != 201 {
        return None;
    }
    resp.json().await.ok()
}

/// Starts `clients` loops appending until the server goes away; returns their handles.
fn load(server_url: String, clients: u64, acked: Acked) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|c| {
            let url = server_url.clone();
            let acked = acked.clone();
            tokio::spawn(async move {
                let client = http();
                let mut failures = 0;
                for i in 0.. {
                    let n = c * 1_000_000 + i;
                    match append(&client, &url, &format!("trades/member-{}", c % 5), n).await {
                        Some(v) => {
                            for e in v["committed"].as_array().into_iter().flatten() {
                                acked.lock().unwrap().insert(
                                    e["event_id"].as_str().unwrap().to_string(),
                                    (
                                        e["seq"].as_u64().unwrap(),
                                        e["hash"].as_str().unwrap().to_string(),
                                    ),
                                );
                            }
                        }
                        None => {
                            failures += 1;
                            if failures > 3 {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            })
        })
        .collect()
}

async fn wait_for_acks(acked: &Acked, at_least: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.lock().unwrap().len() < at_least {
        assert!(
            Instant::now() < deadline,
            "the server acknowledged too few appends"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Kill -9 under load, restart, verify, and find every acknowledged append.
async fn crash_and_recover(env: &[(&str, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, env);
    let acked: Acked = Arc::default();
    let clients = load(server.base_url.clone(), 8, acked.clone());
    wait_for_acks(&acked, 300).await;
    server.kill();
    for c in clients {
        c.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();

    // The ledger left by the killed process verifies with the offline CLI...
    let data_arg = data.to_str().unwrap();
    let out = run_aether(&["verify", "--data-dir", data_arg], env);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "verify after SIGKILL: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("OK: "), "{stdout}");

    // ...and a restarted server serves every append acknowledged before the kill.
    let server = Server::start(&data, env);
    let stored: HashMap<String, (u64, String)> = all_events(&server)
        .await
        .into_iter()
        .map(|e| {
            (
                e["event_id"].as_str().unwrap().to_string(),
                (
                    e["seq"].as_u64().unwrap(),
                    e["hash"].as_str().unwrap().to_string(),
                ),
            )
        })
        .collect();
    let missing: Vec<_> = acked
        .keys()
        .filter(|id| stored.get(*id) != acked.get(*id))
        .collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged appends lost or changed",
        missing.len()
    );
    assert!(acked.len() >= 300);

    // It keeps appending on the same chain after the restart (the restarted checkpointer
    // may sign the uncovered tail first, so the new seq is at least the next one).
    let client = http();
    let v = append(&client, &server.base_url, "trades/member-9", 42)
        .await
        .unwrap();
    let seq = v["committed"][0]["seq"].as_u64().unwrap();
    assert!(
        seq as usize > stored.len(),
        "seq {seq} after {} events",
        stored.len()
    );
    let status = server.terminate();
    assert!(status.success(), "graceful stop: {status:?}");
    let out = run_aether(&["verify", "--data-dir", data_arg], env);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_ledger_survives_sigkill_under_load() {
    crash_and_recover(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_ledger_survives_sigkill_under_load() {
    let db = TestDatabase::create().await;
    crash_and_recover(&[("DATABASE_URL", db.url.as_str())]).await;
    db.drop_database().await;
}

/// Runs `aether serve` on `data` expecting it to refuse to start: its exit status and
/// stderr (a server that keeps running fails the test after 30 s instead of hanging it).
fn serve_that_should_exit(data: &std::path::Path) -> (std::process::ExitStatus, String) {
    let mut serve = std::process::Command::new(aether_bin())
        .args(["serve", "--data-dir", data.to_str().unwrap()])
        .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"])
        .env_remove("DATABASE_URL")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = serve.kill();
            panic!(
                "aether serve on {} was still running after 30 s",
                data.display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut serve.stderr.take().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}

/// A Merkle log that cannot be opened stops the start with an error naming its path.
#[test]
fn an_unusable_merkle_log_location_is_named_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    // A file where the Merkle log's directory belongs.
    std::fs::write(data.join("merkle"), b"not a directory").unwrap();
    let (status, stderr) = serve_that_should_exit(&data);
    assert!(!status.success(), "{stderr}");
    let expected = format!(
        "cannot open the Merkle log at {}",
        data.join("merkle").join("event-hashes").display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
}

/// One data directory, one `aether serve`: a second is refused with the first's pid and
/// changes nothing, and the directory is free again once the first dies, even by SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_serve_on_the_same_data_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let first = Server::start(&data, &[]);
    let client = http();
    let before = append(&client, &first.base_url, "lock-a", 1).await.unwrap();
    let (status, stderr) = serve_that_should_exit(&data);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "is in use by another `aether serve` (pid {})",
            first.pid()
        )),
        "{stderr}"
    );
    // The first is untouched: it still appends.
    let after = append(&client, &first.base_url, "lock-a", 2).await.unwrap();
    first.kill();

    let second = Server::start(&data, &[]);
    let acked: Vec<&Value> = [&before, &after]
        .iter()
        .map(|v| &v["committed"][0]["seq"])
        .collect();
    let stored: Vec<Value> = all_events(&second)
        .await
        .into_iter()
        .filter(|e| e["stream_id"] == "lock-a")
        .map(|e| e["seq"].clone())
        .collect();
    assert_eq!(stored.iter().collect::<Vec<_>>(), acked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_writer_and_signs_a_final_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[("AETHER_CHECKPOINT_EVERY_SECS", "3600")]);
    let acked: Acked = Arc::default();
    let clients = load(server.base_url.clone(), 4, acked.clone());
    wait_for_acks(&acked, 100).await;
    let status = server.terminate();
    assert!(status.success(), "{status:?}");
    for c in clients {
        c.await.unwrap();
    }
    let acked_count = acked.lock().unwrap().len() as u64;
    let out = run_aether(
        &["verify", "--data-dir", data.to_str().unwrap(), "--json"],
        &[],
    );
    assert!(out.status.success());
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Every acknowledged append is there, plus the checkpoint signed on the way out,
    // which covers everything before it.
    assert!(
        report["checkpoints_checked"].as_u64().unwrap() >= 1,
        "{report}"
    );
    let events = report["events_checked"].as_u64().unwrap();
    assert!(events > acked_count, "{events} events, {acked_count} acked");
    assert_eq!(
        report["latest_checkpoint"]["tree_size"].as_u64().unwrap(),
        events - 1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_the_seq_an_offline_edit_changed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let client = http();
    for n in 0..12 {
        append(&client, &server.base_url, "notes/sgp-region", n)
            .await
            .unwrap();
    }
    assert!(server.terminate().success());

    // Someone with file access removes the guard and rewrites one decision.
    let url = format!("sqlite:{}", data.join("ledger.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "DROP TRIGGER events_no_update; \
         UPDATE events SET payload = replace(payload, '\"decision\":\"cleared\"', '\"decision\":\"rejected\"') WHERE seq = 5;",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;

    let out = run_aether(&["verify", "--data-dir", data.to_str().unwrap()], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(
        stdout.starts_with("FAILED at seq 5: hash mismatch"),
        "{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_api_refuses_bad_requests_precisely_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let client = http();
    let post = |body: String, token: Option<&'static str>| {
        let mut req = client
            .post(server.url("/v1/events"))
            .header("content-type", "application/json")
            .body(body);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        req.send()
    };
    let good =
        json!({"stream_id": "a", "events": [{"event_type": "E", "payload": {}}]}).to_string();
    let cases: Vec<(String, Option<&'static str>, u16, &str)> = vec![
        (good.clone(), None, 401, "missing Authorization"),
        (good.clone(), Some("not-a-real-token-at-all"), 401, "unknown token"),
        (good.clone(), Some(REGULATOR_TOKEN), 403, "role regulator may not do this"),
        ("{\"stream_id\": ".into(), Some(OPERATOR_TOKEN), 400, "not JSON (line 1, column 14)"),
        (json!({"stream_id": "a"}).to_string(), Some(OPERATOR_TOKEN), 422, "missing field `events`"),
        (json!({"stream_id": "a", "events": [], "extra": 1}).to_string(), Some(OPERATOR_TOKEN), 422, "unknown field `extra`"),
        (json!({"stream_id": "", "events": [{"event_type": "E", "payload": {}}]}).to_string(), Some(OPERATOR_TOKEN), 422, "must not be empty"),
        (json!({"stream_id": "a\u{1}", "events": [{"event_type": "E", "payload": {}}]}).to_string(), Some(OPERATOR_TOKEN), 422, "control character U+0001"),
        (json!({"stream_id": "a", "events": [{"event_type": "E", "payload": 5}]}).to_string(), Some(OPERATOR_TOKEN), 422, "payload must be a JSON object, got a number"),
        (json!({"stream_id": "a", "events": [{"event_type": "E", "payload": {"b": "x".repeat(1_100_000)}}]}).to_string(), Some(OPERATOR_TOKEN), 413, "over the limit of 1048576 bytes"),
        (json!({"stream_id": "a", "expected_version": 3, "events": [{"event_type": "E", "payload": {}}]}).to_string(), Some(OPERATOR_TOKEN), 409, "expected 3, actual 0"),
        (json!({"stream_id": "a", "expected_version": "soon", "events": [{"event_type": "E", "payload": {}}]}).to_string(), Some(OPERATOR_TOKEN), 422, "expected_version must be"),
        (json!({"appends": [
            {"stream_id": "a", "events": [{"event_type": "E", "payload": {}}]},
            {"stream_id": "b", "expected_version": "stream_exists", "events": [{"event_type": "E", "payload": {}}]}
        ]}).to_string(), Some(OPERATOR_TOKEN), 409, "expected stream exists, actual 0"),
        // Values the database would store changed are refused before they are hashed.
        (r#"{"stream_id": "a", "events": [{"event_type": "E", "schema_version": 2147483648, "payload": {}}]}"#.into(), Some(OPERATOR_TOKEN), 422, "schema_version 2147483648 is out of range"),
        (r#"{"stream_id": "a", "events": [{"event_type": "E", "payload": {"n": 18446744073709551616}}]}"#.into(), Some(OPERATOR_TOKEN), 422, "at $.n cannot be represented exactly"),
        (r#"{"stream_id": "a", "events": [{"event_type": "E", "payload": {"n": 1e16}}]}"#.into(), Some(OPERATOR_TOKEN), 422, "at $.n cannot be represented exactly"),
        (r#"{"stream_id": "a", "events": [{"event_type": "E", "payload": {}, "metadata": {"request_id": "a\u0000"}}]}"#.into(), Some(OPERATOR_TOKEN), 422, "metadata text at $.request_id contains U+0000"),
        (r#"{"stream_id": "a", "events": [{"event_type": "E", "payload": {"x": {"$personal": "NOT-HEX"}}}]}"#.into(), Some(OPERATOR_TOKEN), 422, "\"$personal\" member"),
    ];
    for (body, token, status, detail) in cases {
        let resp = post(body.clone(), token).await.unwrap();
        assert_eq!(resp.status().as_u16(), status, "{detail}");
        assert_eq!(
            resp.headers()["content-type"],
            "application/problem+json",
            "{detail}"
        );
        let problem: Value = resp.json().await.unwrap();
        assert_eq!(problem["status"], status);
        assert!(
            problem["detail"].as_str().unwrap().contains(detail),
            "want {detail:?} in {problem}"
        );
    }
    for (path, status) in [
        ("/v1/events?limit=0", 400),
        ("/v1/events?from_seq=abc", 400),
        ("/v1/events?color=red", 400),
        ("/v1/events/0", 400),
        ("/v1/events/99", 404),
        ("/v1/nothing", 404),
    ] {
        let resp = client
            .get(server.url(path))
            .bearer_auth(REGULATOR_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), status, "{path}");
        assert_eq!(resp.headers()["content-type"], "application/problem+json");
    }
    // None of that wrote anything.
    let ready: Value = client
        .get(server.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["head_seq"], 0, "{ready}");

    // A valid multi-stream append lands atomically and is readable by a regulator.
    let resp = post(
        json!({"appends": [
            {"stream_id": "a", "expected_version": "no_stream", "events": [{"event_type": "E", "payload": {"k": 1}}]},
            {"stream_id": "b", "expected_version": 0, "events": [{"event_type": "E", "payload": {"k": 2}}]}
        ]})
        .to_string(),
        Some(OPERATOR_TOKEN),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 201);
    let event: Value = client
        .get(server.url("/v1/events/2"))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(event["stream_id"], "b");
    assert_eq!(event["payload"], json!({"k": 2}));
    let metrics = aether_e2e::metrics(&server).await;
    assert!(
        metrics.contains("aether_ledger_events_appended_total 2"),
        "{metrics}"
    );
    // The background tasks that retry rather than end say whether they are retrying.
    for gauge in [
        "aether_ledger_checkpointer_failing 0",
        "aether_ledger_merkle_follower_failing 0",
    ] {
        assert!(metrics.contains(gauge), "{gauge} in:\n{metrics}");
    }
}

/// A PostgreSQL ledger that cannot be reached stops `serve` at once with the reason, not
/// after a pool's timeout with "pool timed out".
#[test]
fn an_unreachable_database_is_refused_at_once_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let out = aether_e2e::run_serve(
        &dir.path().join("data"),
        &["--database-url", "postgres://aether@127.0.0.1:1/ledger"],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .contains("cannot open the ledger at PostgreSQL postgres://aether@127.0.0.1:1/ledger")
            && stderr.contains("Connection refused"),
        "{stderr}"
    );
    assert!(!stderr.contains("timed out"), "{stderr}");
}

//! End-to-end: a regulator queries a running `aether serve` under `/v1/audit` and checks
//! the proofs it gets with nothing but the public key and the hashing rules.

use std::time::{Duration, Instant};

use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http};
use aether_ledger::checkpoint::{CheckpointVerifier, PUBLIC_KEY_FILE, SignedCheckpoint};
use aether_ledger::hashing::hex_hash;
use aether_ledger::merkle::{verify_consistency, verify_inclusion};
use serde_json::{Value, json};

fn hashes(v: &Value) -> Vec<[u8; 32]> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|h| hex_hash::parse(h.as_str().unwrap()).unwrap())
        .collect()
}

/// `POST /v1/audit/exports` with `token`.
async fn post_export(
    server: &Server,
    token: &str,
    body: Value,
) -> Result<reqwest::Response, reqwest::Error> {
    http()
        .post(server.url("/v1/audit/exports"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
}

async fn get(server: &Server, path: &str, token: &str) -> (u16, Value) {
    let resp = http()
        .get(server.url(path))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regulator_queries_are_proven_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[("AETHER_CHECKPOINT_EVERY_EVENTS", "5")]);
    let client = http();
    for n in 0..12u64 {
        let member = if n % 3 == 0 { "m-1" } else { "m-2" };
        let resp = client
            .post(server.url("/v1/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&json!({
                "stream_id": format!("trades/{member}"),
                "events": [{"event_type": "TradeBooked", "payload": {"n": n},
                            "metadata": {"member": member, "trace_id": format!("t-{n}")}}]
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
    }
    // Wait for checkpoints covering the appends.
    let deadline = Instant::now() + Duration::from_secs(20);
    let checkpoints = loop {
        let (status, body) = get(&server, "/v1/audit/checkpoints", REGULATOR_TOKEN).await;
        assert_eq!(status, 200, "{body}");
        let list = body["checkpoints"].as_array().unwrap().clone();
        if list.len() >= 2
            && list.last().unwrap()["checkpoint"]["tree_size"]
                .as_u64()
                .unwrap()
                >= 12
        {
            break list;
        }
        assert!(Instant::now() < deadline, "no checkpoints: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let trusted =
        CheckpointVerifier::from_pem_file(&data.join("keys").join(PUBLIC_KEY_FILE)).unwrap();
    let heads: Vec<SignedCheckpoint> = checkpoints
        .iter()
        .map(|c| serde_json::from_value(c["checkpoint"].clone()).unwrap())
        .collect();
    for head in &heads {
        trusted.verify(head).unwrap();
    }

    // Filtered, paged events: the same as filtering the whole ledger by hand.
    let (_, everything) = get(&server, "/v1/events?limit=1000", OPERATOR_TOKEN).await;
    let expected: Vec<u64> = everything["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["metadata"]["member"] == "m-1")
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(expected.len(), 4);
    let (status, page) = get(
        &server,
        "/v1/audit/events?member=m-1&limit=2",
        REGULATOR_TOKEN,
    )
    .await;
    assert_eq!(status, 200, "{page}");
    let first: Vec<u64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(first, expected[..2]);
    let cursor = page["next_cursor"].as_str().unwrap().to_string();
    let (_, page) = get(
        &server,
        &format!("/v1/audit/events?member=m-1&limit=2&cursor={cursor}"),
        REGULATOR_TOKEN,
    )
    .await;
    let second: Vec<u64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(second, expected[2..]);

    // One event with its inclusion proof, checked against the signed checkpoint.
    let seq = expected[1];
    let (event_hash, cp, path) = assert_proven(&server, &trusted, seq).await;
    let mut forged = event_hash;
    forged[0] ^= 1;
    assert!(verify_inclusion(&forged, seq - 1, cp.tree_size, &path, &cp.root_hash).is_err());

    // The two first checkpoints are consistent: the log only grew.
    let (a, b) = (&heads[0], &heads[1]);
    let (status, body) = get(
        &server,
        &format!(
            "/v1/audit/proofs/consistency?from={}&to={}",
            a.tree_size, b.tree_size
        ),
        REGULATOR_TOKEN,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    verify_consistency(
        a.tree_size,
        b.tree_size,
        &a.root_hash,
        &b.root_hash,
        &hashes(&body["hashes"]),
    )
    .unwrap();
    let (status, body) = get(
        &server,
        &format!("/v1/audit/proofs/inclusion?seq=2&tree_size={}", b.tree_size),
        REGULATOR_TOKEN,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["root_hash"], hex::encode(b.root_hash));

    // Refusals: wrong role, no token, bad parameters, impossible proofs.
    assert_eq!(
        get(&server, "/v1/audit/events", OPERATOR_TOKEN).await.0,
        403
    );
    assert_eq!(
        http()
            .get(server.url("/v1/audit/events"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    for (path, status) in [
        ("/v1/audit/events?colour=red", 400),
        ("/v1/audit/events?from=yesterday", 400),
        ("/v1/audit/events?limit=0", 400),
        ("/v1/audit/proofs/inclusion", 400),
        ("/v1/audit/proofs/inclusion?seq=5&tree_size=100000", 422),
        ("/v1/audit/proofs/consistency?from=3", 400),
        ("/v1/audit/proofs/consistency?from=9&to=3", 422),
        ("/v1/audit/events/0", 400),
        ("/v1/audit/events/100000", 404),
    ] {
        let (got, body) = get(&server, path, REGULATOR_TOKEN).await;
        assert_eq!(got, status, "{path}: {body}");
        assert!(body["detail"].is_string(), "{path}: {body}");
    }

    // Every regulator query above is on the ledger, attributed to the token's fingerprint.
    let (_, all) = get(&server, "/v1/events?limit=1000", OPERATOR_TOKEN).await;
    let access: Vec<&Value> = all["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["stream_id"] == "access/audit")
        .collect();
    assert!(access.len() >= 8, "{} access records", access.len());
    assert!(access.iter().all(|e| {
        e["metadata"]["actor"]
            .as_str()
            .unwrap()
            .starts_with("regulator:")
    }));
    assert!(
        access
            .iter()
            .any(|e| e["payload"]["query"] == "event" && e["payload"]["details"]["seq"] == seq)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn personal_data_is_shown_to_regulators_and_erased_on_redaction() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let client = http();
    let resp: Value = client
        .post(server.url("/v1/events"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&json!({
            "stream_id": "trades/m-7",
            "events": [{"event_type": "TradeBooked", "payload": {"amount_minor": 10},
                        "personal": {"beneficiary": "Ada Lovelace"}}]
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let seq = resp["committed"][0]["seq"].as_u64().unwrap();

    let (_, body) = get(&server, &format!("/v1/audit/events/{seq}"), REGULATOR_TOKEN).await;
    assert!(
        !body["event"]["payload"].to_string().contains("Lovelace"),
        "{body}"
    );
    assert_eq!(body["personal"][0]["member"], "beneficiary");
    assert_eq!(body["personal"][0]["value"], "\"Ada Lovelace\"");

    let redact = |token: &'static str, reason: &str| {
        client
            .post(server.url("/v1/redactions"))
            .bearer_auth(token)
            .json(&json!({"seq": seq, "member": "beneficiary", "reason": reason}))
            .send()
    };
    assert_eq!(
        redact(REGULATOR_TOKEN, "erasure").await.unwrap().status(),
        403
    );
    assert_eq!(redact(OPERATOR_TOKEN, " ").await.unwrap().status(), 422);
    assert_eq!(
        redact(OPERATOR_TOKEN, "erasure request 17")
            .await
            .unwrap()
            .status(),
        201
    );
    assert_eq!(redact(OPERATOR_TOKEN, "again").await.unwrap().status(), 404);

    let (_, body) = get(&server, &format!("/v1/audit/events/{seq}"), REGULATOR_TOKEN).await;
    assert_eq!(body["personal"], json!([]), "{body}");
    assert!(server.terminate().success());
    let out = aether_e2e::run_aether(&["verify", "--data-dir", data.to_str().unwrap()], &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exported_bundle_verifies_offline_and_a_changed_byte_fails() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[("AETHER_CHECKPOINT_EVERY_EVENTS", "4")]);
    let client = http();
    for n in 0..9u64 {
        let resp = client
            .post(server.url("/v1/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(
                &json!({"stream_id": "trades/m-3", "events": [{"event_type": "TradeBooked",
                   "payload": {"n": n, "decision": "cleared"}, "metadata": {"member": "m-3"}}]}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
    }
    let export = |body: Value| post_export(&server, REGULATOR_TOKEN, body);
    // Wait until a checkpoint covers the appends, then export them.
    let deadline = Instant::now() + Duration::from_secs(20);
    let bundle: Value = loop {
        let resp = export(json!({"member": "m-3"})).await.unwrap();
        if resp.status() == 200 {
            let b: Value = resp.json().await.unwrap();
            if b["events"].as_array().unwrap().len() >= 8 {
                break b;
            }
        }
        assert!(Instant::now() < deadline, "no bundle with the appends");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(bundle["format"], "aether.evidence-bundle.v1");
    let path = dir.path().join("evidence.json");
    std::fs::write(&path, serde_json::to_vec(&bundle).unwrap()).unwrap();
    let public = data.join("keys").join(PUBLIC_KEY_FILE);
    let run = |args: &[&str]| aether_e2e::run_aether(args, &[]);

    let out = run(&[
        "audit",
        "verify",
        path.to_str().unwrap(),
        "--public-key",
        public.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("evidence bundle OK"), "{stdout}");
    // Without a trusted key it is consistent but says it cannot vouch for the signer.
    let out = run(&["audit", "verify", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stdout).contains("WARNING"));

    // One decision rewritten in the file: the offline verifier names it.
    let text = std::fs::read_to_string(&path).unwrap();
    let tampered = text.replacen(
        "\\\"decision\\\":\\\"cleared\\\"",
        "\\\"decision\\\":\\\"rejected\\\"",
        1,
    );
    assert_ne!(tampered, text, "the bundle holds the payload text");
    std::fs::write(&path, tampered).unwrap();
    let out = run(&[
        "audit",
        "verify",
        path.to_str().unwrap(),
        "--public-key",
        public.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let verdict: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(verdict["ok"], false);
    assert!(!verdict["problems"].as_array().unwrap().is_empty());

    // Bad export requests.
    assert_eq!(
        export(json!({"colour": "red"})).await.unwrap().status(),
        400
    );
    assert_eq!(export(json!({"limit": 0})).await.unwrap().status(), 400);
    assert_eq!(
        export(json!({"member": ["a"]})).await.unwrap().status(),
        400
    );
    let as_operator = post_export(&server, OPERATOR_TOKEN, json!({}))
        .await
        .unwrap();
    assert_eq!(as_operator.status(), 403);
}

/// The live control-plane state and the head seq, read one after the other while nothing
/// else changes the control plane, and a time just after both.
async fn live_moment(server: &Server) -> (u64, String, chrono::DateTime<chrono::Utc>) {
    let (status, live) = get(server, "/v1/state", OPERATOR_TOKEN).await;
    assert_eq!(status, 200, "{live}");
    let mut head = 0;
    loop {
        let (_, page) = get(
            server,
            &format!("/v1/events?from_seq={}&limit=1000", head + 1),
            OPERATOR_TOKEN,
        )
        .await;
        match page["events"].as_array().unwrap().last() {
            Some(e) => head = e["seq"].as_u64().unwrap(),
            None => break,
        }
    }
    let now = chrono::Utc::now();
    // Whatever comes next is recorded strictly later than `now`.
    tokio::time::sleep(Duration::from_millis(5)).await;
    (head, live["digest"].as_str().unwrap().to_string(), now)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_as_of_any_moment_is_what_the_live_service_showed_then() {
    state_as_of_scenario(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_state_as_of_any_moment_on_postgres() {
    let db = aether_ledger::testing::TestDatabase::create().await;
    state_as_of_scenario(Some(&db.url)).await;
    db.drop_database().await;
}

/// Records the live state after each control change, then asks for the state as of each
/// of those moments by seq and by time; `database_url`: PostgreSQL, else SQLite.
async fn state_as_of_scenario(database_url: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut env = vec![("AETHER_CHECKPOINT_EVERY_EVENTS", "5")];
    env.extend(database_url.map(|url| ("DATABASE_URL", url)));
    let server = Server::start(&data, &env);
    let client = http();
    let post = |path: String, body: Value| {
        client
            .post(server.url(&path))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&body)
            .send()
    };
    let policy = |version: &str| {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../services/rules/policies/aml_v2.yaml");
        std::fs::read_to_string(path)
            .unwrap()
            .replace("version: 2.0.0", &format!("version: {version}"))
    };
    let ingest = |version: &str| {
        client
            .post(server.url("/v1/policy/ingest"))
            .bearer_auth(OPERATOR_TOKEN)
            .header("content-type", "application/yaml")
            .body(policy(version))
            .send()
    };
    let before_anything = chrono::Utc::now() - chrono::Duration::hours(1);
    let mut moments = vec![live_moment(&server).await];

    assert_eq!(ingest("2.0.0").await.unwrap().status(), 201);
    moments.push(live_moment(&server).await);
    assert_eq!(ingest("2.1.0").await.unwrap().status(), 201);
    moments.push(live_moment(&server).await);
    for (name, bytes) in [("v3", b"three".as_slice()), ("v4", b"four".as_slice())] {
        let path = dir.path().join(format!("{name}.bin"));
        std::fs::write(&path, bytes).unwrap();
        let model = json!({"ref": format!("finmoe-7b-{name}@sgp-region"), "uri": path.to_str().unwrap(),
            "digest": hex::encode(aether_ledger::hashing::sm3(bytes)), "feature_schema": {"amount_minor": "int"}});
        assert_eq!(
            post("/v1/models".into(), model).await.unwrap().status(),
            201
        );
    }
    moments.push(live_moment(&server).await);
    let resp = post(
        "/v1/engine/activate".into(),
        json!({"model_ref": "finmoe-7b-v3@sgp-region", "traffic_weight": 0.5, "policy_hooks": ["aml_v2"]}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 202);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, engine) = get(&server, "/v1/engines/sgp-region", OPERATOR_TOKEN).await;
        if engine["status"] == "active" {
            break;
        }
        assert!(Instant::now() < deadline, "{engine}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    moments.push(live_moment(&server).await);
    let started: Value = post(
        "/v1/rollouts".into(),
        json!({"baseline": "finmoe-7b-v3@sgp-region", "candidate": "finmoe-7b-v4@sgp-region", "steps": [10, 50, 100]}),
    )
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    let id = started["rollout"]["id"].as_str().unwrap().to_string();
    moments.push(live_moment(&server).await);
    let resp = post(format!("/v1/rollouts/{id}/step"), json!({}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    // A committed snapshot (the coordinator's) is in force from then on.
    let resp: Value = post("/v1/snapshots".into(), json!({}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let snapshot_seq = resp["seq"].as_u64().unwrap();
    moments.push(live_moment(&server).await);
    let distinct: std::collections::HashSet<&String> = moments.iter().map(|m| &m.1).collect();
    assert_eq!(
        distinct.len(),
        moments.len(),
        "every moment has a state of its own"
    );

    // Wait for a checkpoint covering the last moment, so that every answer carries a proof.
    let last_seq = moments.last().unwrap().0;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = get(&server, "/v1/audit/checkpoints?limit=1000", REGULATOR_TOKEN).await;
        let covered = body["checkpoints"]
            .as_array()
            .unwrap()
            .last()
            .and_then(|c| c["checkpoint"]["tree_size"].as_u64())
            .unwrap_or(0);
        if covered >= last_seq {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no checkpoint covers seq {last_seq}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let trusted =
        CheckpointVerifier::from_pem_file(&data.join("keys").join(PUBLIC_KEY_FILE)).unwrap();

    for (seq, digest, time) in &moments {
        // As a seq: exactly that event, proven against a signed checkpoint.
        let (status, body) = get(
            &server,
            &format!("/v1/audit/state?at={seq}"),
            REGULATOR_TOKEN,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["resolved_seq"], *seq);
        assert_eq!(&body["digest"], digest, "state at seq {seq}: {body}");
        assert_eq!(body["clamped"], false);
        assert!(body["head"].as_u64().unwrap() > *seq);
        assert_eq!(body["recorded_at"], body["event"]["recorded_at"]);
        if *seq == 0 {
            // Before the first event: nothing to prove.
            assert_eq!(body["event"], Value::Null);
            assert_eq!(body["inclusion_proof"], Value::Null);
        } else {
            assert_eq!(body["event"]["seq"], *seq);
            let proof = &body["inclusion_proof"];
            let cp: SignedCheckpoint = serde_json::from_value(proof["checkpoint"].clone()).unwrap();
            trusted.verify(&cp).unwrap();
            verify_inclusion(
                &hex_hash::parse(body["event"]["hash"].as_str().unwrap()).unwrap(),
                seq - 1,
                cp.tree_size,
                &hashes(&proof["hashes"]),
                &cp.root_hash,
            )
            .unwrap();
        }
        let expected_snapshot = (*seq >= snapshot_seq).then_some(snapshot_seq);
        assert_eq!(
            body["snapshot"]["seq"].as_u64(),
            expected_snapshot,
            "{body}"
        );

        // As an RFC 3339 time: the last event by then, the same state.
        let at = time.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
        let (status, body) = get(
            &server,
            &format!("/v1/audit/state?at={}", at.replace('+', "%2B")),
            REGULATOR_TOKEN,
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(&body["digest"], digest, "state at {at}: {body}");
        assert!(body["resolved_seq"].as_u64().unwrap() >= *seq);
        if let Some(recorded) = body["recorded_at"].as_str() {
            let recorded = chrono::DateTime::parse_from_rfc3339(recorded).unwrap();
            assert!(recorded <= *time, "{recorded} after {at}");
        }
    }
    // The same instant with an offset is the same point.
    let (seq, digest, time) = &moments[2];
    let shanghai = time
        .with_timezone(&chrono::FixedOffset::east_opt(8 * 3600).unwrap())
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, false)
        .replace('+', "%2B");
    let (_, body) = get(
        &server,
        &format!("/v1/audit/state?at={shanghai}"),
        REGULATOR_TOKEN,
    )
    .await;
    assert_eq!(&body["digest"], digest, "{body}");
    assert!(body["resolved_seq"].as_u64().unwrap() >= *seq);

    // Before the first event: the empty state.
    let at = before_anything.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let (status, body) = get(
        &server,
        &format!("/v1/audit/state?at={at}"),
        REGULATOR_TOKEN,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["resolved_seq"], 0);
    assert_eq!(body["digest"], moments[0].1);
    assert_eq!(body["state"]["policies"], json!({}));
    assert_eq!(body["state"]["engines"], json!([]));
    assert_eq!(body["snapshot"], Value::Null);
    assert_eq!(body["inclusion_proof"], Value::Null);
    let (_, zero) = get(&server, "/v1/audit/state?at=0", REGULATOR_TOKEN).await;
    assert_eq!(zero["digest"], moments[0].1);

    // Past the head: the head's state, and the answer says so.
    let (status, body) = get(&server, "/v1/audit/state?at=99999999999", REGULATOR_TOKEN).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["clamped"], true);
    assert_eq!(body["resolved_seq"], body["head"]);
    assert_eq!(body["digest"], moments.last().unwrap().1);
    assert!(
        body["note"]
            .as_str()
            .unwrap()
            .contains("past the newest event"),
        "{body}"
    );
    let tomorrow = (chrono::Utc::now() + chrono::Duration::days(1))
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let (_, body) = get(
        &server,
        &format!("/v1/audit/state?at={tomorrow}"),
        REGULATOR_TOKEN,
    )
    .await;
    assert_eq!(body["clamped"], true, "{body}");
    assert_eq!(body["digest"], moments.last().unwrap().1);

    // Refusals: precise problems, and the wrong role is turned away.
    for path in [
        "/v1/audit/state",
        "/v1/audit/state?at=",
        "/v1/audit/state?at=yesterday",
        "/v1/audit/state?at=-1",
        "/v1/audit/state?at=2026-13-01T00:00:00Z",
        "/v1/audit/state?at=5&colour=red",
    ] {
        let resp = client
            .get(server.url(path))
            .bearer_auth(REGULATOR_TOKEN)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400, "{path}");
        assert_eq!(
            resp.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
        let problem: Value = resp.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        if path.contains("at=") && !path.contains("colour") {
            assert!(
                detail.contains("RFC 3339") && detail.contains("seq"),
                "{path}: {detail}"
            );
        }
    }
    let (status, _) = get(&server, "/v1/audit/state?at=1", OPERATOR_TOKEN).await;
    assert_eq!(status, 403);

    // Each time-travel query is on the ledger, as a regulator's.
    let (_, body) = get(
        &server,
        "/v1/audit/events?stream_prefix=access/&limit=1000",
        REGULATOR_TOKEN,
    )
    .await;
    let asked: Vec<&Value> = body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["payload"]["query"] == "state")
        .collect();
    assert!(
        asked.len() >= 2 * moments.len() + 4,
        "{} recorded",
        asked.len()
    );
    assert!(asked.iter().all(|e| {
        e["metadata"]["actor"]
            .as_str()
            .unwrap()
            .starts_with("regulator:")
    }));
    assert!(
        asked
            .iter()
            .any(|e| e["payload"]["details"]["at"] == "99999999999")
    );
}

/// Appends events `from..to` to one stream, fifty per request.
async fn append_events(server: &Server, from: u64, to: u64) {
    for start in (from..to).step_by(50) {
        let events: Vec<Value> = (start..to.min(start + 50))
            .map(|n| json!({"event_type": "TradeBooked", "payload": {"n": n}}))
            .collect();
        let resp = http()
            .post(server.url("/v1/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&json!({"stream_id": "trades/m-1", "events": events}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
    }
}

/// Waits for a signed checkpoint covering at least `size` events.
async fn checkpoint_covering(server: &Server, size: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = get(server, "/v1/audit/checkpoints", REGULATOR_TOKEN).await;
        assert_eq!(status, 200, "{body}");
        let latest = body["checkpoints"]
            .as_array()
            .and_then(|l| l.last())
            .and_then(|c| c["checkpoint"]["tree_size"].as_u64());
        if latest.is_some_and(|s| s >= size) {
            return;
        }
        assert!(Instant::now() < deadline, "no checkpoint of {size}: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `GET /v1/audit/events/{seq}` and its inclusion proof checked against the signed
/// checkpoint it names, with the service's public key only; returns the event hash, the
/// checkpoint and the proof's path.
async fn assert_proven(
    server: &Server,
    trusted: &CheckpointVerifier,
    seq: u64,
) -> ([u8; 32], SignedCheckpoint, Vec<[u8; 32]>) {
    let (status, body) = get(server, &format!("/v1/audit/events/{seq}"), REGULATOR_TOKEN).await;
    assert_eq!(status, 200, "{body}");
    let proof = &body["inclusion_proof"];
    let cp: SignedCheckpoint = serde_json::from_value(proof["checkpoint"].clone()).unwrap();
    trusted.verify(&cp).unwrap();
    let event_hash = hex_hash::parse(body["event"]["hash"].as_str().unwrap()).unwrap();
    let path = hashes(&proof["hashes"]);
    verify_inclusion(&event_hash, seq - 1, cp.tree_size, &path, &cp.root_hash)
        .unwrap_or_else(|e| panic!("seq {seq}: {e}"));
    (event_hash, cp, path)
}

/// The audit API's proofs come from a Merkle log whose event hashes live in
/// `<data>/merkle/event-hashes` (memory keeps only the tree above 128-event blocks): after
/// a SIGKILL the service takes up where the file ends, and a file changed while the
/// service was down is rebuilt from the ledger rather than served from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proofs_survive_a_crash_and_a_changed_merkle_file() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let env = [("AETHER_CHECKPOINT_EVERY_EVENTS", "50")];
    let server = Server::start(&data, &env);
    let trusted =
        CheckpointVerifier::from_pem_file(&data.join("keys").join(PUBLIC_KEY_FILE)).unwrap();
    append_events(&server, 0, 300).await;
    checkpoint_covering(&server, 300).await;
    for seq in [7, 129, 300] {
        assert_proven(&server, &trusted, seq).await;
    }
    let file = data.join("merkle").join("event-hashes");
    let bytes = std::fs::read(&file).unwrap();
    assert!(
        bytes.len() >= 300 * 32 && bytes.len().is_multiple_of(32),
        "{} bytes",
        bytes.len()
    );
    server.kill();

    // Seq 7's hash changed on disk while the service was down.
    let mut changed = bytes;
    changed[6 * 32] ^= 1;
    std::fs::write(&file, &changed).unwrap();
    let server = Server::start(&data, &env);
    // And seq 130's while it runs, before any proof has read its block (129..256).
    let flip_on_disk = |at: usize| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&file)
            .unwrap();
        let mut byte = [0u8];
        f.read_exact_at(&mut byte, at as u64).unwrap();
        f.write_all_at(&[byte[0] ^ 1], at as u64).unwrap();
    };
    flip_on_disk(129 * 32);
    for seq in [7, 129, 300] {
        assert_proven(&server, &trusted, seq).await;
    }
    append_events(&server, 300, 560).await;
    checkpoint_covering(&server, 560).await;
    for seq in [7, 350, 380, 560] {
        assert_proven(&server, &trusted, seq).await;
    }
    // An export whose events span a block no proof has read (385..512) changed on disk.
    flip_on_disk(450 * 32);
    let resp = post_export(&server, REGULATOR_TOKEN, json!({}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let bundle: Value = resp.json().await.unwrap();
    assert!(bundle["events"].as_array().unwrap().len() >= 512);
    let path = dir.path().join("evidence.json");
    std::fs::write(&path, serde_json::to_vec(&bundle).unwrap()).unwrap();
    let public = data.join("keys").join(PUBLIC_KEY_FILE);
    let out = aether_e2e::run_aether(
        &[
            "audit",
            "verify",
            path.to_str().unwrap(),
            "--public-key",
            public.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");

    let log = std::fs::read_to_string(&server.log_path).unwrap();
    assert!(
        log.contains("Merkle log file rebuilt from the ledger"),
        "no rebuild in the log:\n{log}"
    );
    assert_eq!(
        log.matches("Merkle log block rewritten from the ledger")
            .count(),
        2,
        "{log}"
    );
    let now = std::fs::read(&file).unwrap();
    assert_eq!(now[6 * 32], changed[6 * 32] ^ 1);
    assert_eq!(
        &now[..560 * 32],
        &bytes_at_the_end(&server).await[..560 * 32]
    );
}

/// Every event hash of the ledger, as the service gives them, laid end to end.
async fn bytes_at_the_end(server: &Server) -> Vec<u8> {
    aether_e2e::all_events(server)
        .await
        .iter()
        .flat_map(|e| hex_hash::parse(e["hash"].as_str().unwrap()).unwrap())
        .collect()
}

/// Two exports taken at different times prove the ledger only grew: the second, asked with
/// `since_tree_size` = the first's anchor, carries that same signed checkpoint and a
/// consistency proof to its own anchor, and verifies offline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_export_proves_it_extends_an_earlier_one() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[("AETHER_CHECKPOINT_EVERY_EVENTS", "3")]);
    let append = |n: u64| {
        http()
            .post(server.url("/v1/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(
                &json!({"stream_id": "trades/m-9", "events": [{"event_type": "TradeBooked",
                "payload": {"n": n}, "metadata": {"member": "m-9"}}]}),
            )
            .send()
    };
    // An export once a checkpoint covers some events ...
    let export_covering = |at_least: u64, body: Value| {
        let server = &server;
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let resp = post_export(server, REGULATOR_TOKEN, body.clone())
                    .await
                    .unwrap();
                if resp.status() == 200 {
                    let bundle: Value = resp.json().await.unwrap();
                    let anchor =
                        bundle["checkpoints"].as_array().unwrap().last().unwrap()["tree_size"]
                            .as_u64()
                            .unwrap();
                    if anchor >= at_least {
                        return bundle;
                    }
                }
                assert!(
                    Instant::now() < deadline,
                    "no checkpoint covers {at_least} events"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    for n in 0..4 {
        assert_eq!(append(n).await.unwrap().status(), 201);
    }
    let first = export_covering(4, json!({"member": "m-9"})).await;
    let held = first["checkpoints"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    let held_size = held["tree_size"].as_u64().unwrap();
    // ... and a later one, months on, asked to extend the checkpoint the regulator kept.
    for n in 4..10 {
        assert_eq!(append(n).await.unwrap().status(), 201);
    }
    let later = export_covering(
        held_size + 6,
        json!({"member": "m-9", "since_tree_size": held_size}),
    )
    .await;
    let checkpoints = later["checkpoints"].as_array().unwrap();
    assert_eq!(checkpoints.len(), 2, "{later}");
    assert_eq!(
        checkpoints[0], held,
        "the regulator's checkpoint, as it was signed"
    );
    assert_eq!(later["consistency"].as_array().unwrap().len(), 1);
    let file = dir.path().join("later.json");
    std::fs::write(&file, serde_json::to_vec(&later).unwrap()).unwrap();
    let public = data.join("keys").join(PUBLIC_KEY_FILE);
    let out = aether_e2e::run_aether(
        &[
            "audit",
            "verify",
            file.to_str().unwrap(),
            "--public-key",
            public.to_str().unwrap(),
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // A size no checkpoint has is refused, naming it.
    let resp = post_export(
        &server,
        REGULATOR_TOKEN,
        json!({"since_tree_size": held_size + 1}),
    )
    .await
    .unwrap();
    assert!(
        matches!(resp.status().as_u16(), 404 | 422),
        "{}",
        resp.status()
    );
    assert!(server.terminate().success());
}

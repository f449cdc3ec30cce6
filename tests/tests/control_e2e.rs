//! End-to-end: an operator hot-loads compliance policies into a running `aether serve`;
//! refusals are precise and recorded; a restart rebuilds the same rule set from the ledger.

use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http};
use serde_json::Value;

fn example(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../services/rules/policies")
        .join(format!("{name}.yaml"));
    std::fs::read_to_string(path).unwrap()
}

async fn ingest(server: &Server, token: &str, content_type: &str, body: String) -> (u16, Value) {
    let resp = http()
        .post(server.url("/v1/policy/ingest"))
        .bearer_auth(token)
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn policies(server: &Server) -> Value {
    http()
        .get(server.url("/v1/policies"))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_are_hot_loaded_refused_precisely_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);

    let (status, body) = ingest(
        &server,
        OPERATOR_TOKEN,
        "application/yaml",
        example("aml_v2"),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["policy"]["version"], "2.0.0");
    assert_eq!(body["event"]["stream_id"], "policy/aml_v2");
    let (status, body) = ingest(
        &server,
        OPERATOR_TOKEN,
        "application/yaml",
        example("aml_v2"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["event"].is_null());
    let (status, _) = ingest(
        &server,
        OPERATOR_TOKEN,
        "application/yaml",
        example("basel3_delta"),
    )
    .await;
    assert_eq!(status, 201);

    // Refusals.
    let broken = example("aml_v2")
        .replace("version: 2.0.0", "version: 2.0.1")
        .replace(
            "request.amount_minor >= context.reporting_threshold_minor",
            "request.amount_minor >=",
        );
    let (status, problem) = ingest(&server, OPERATOR_TOKEN, "application/yaml", broken).await;
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["rule_id"], "reporting-threshold");
    assert_eq!(problem["line"], 1);
    assert!(problem["column"].as_u64().unwrap() > 20, "{problem}");
    let unknown_var = example("aml_v2")
        .replace("version: 2.0.0", "version: 2.0.2")
        .replace("context.reporting_threshold_minor\n", "secrets.threshold\n");
    let (status, problem) = ingest(&server, OPERATOR_TOKEN, "application/yaml", unknown_var).await;
    assert_eq!(status, 422, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("unknown identifier"),
        "{problem}"
    );
    let changed = example("aml_v2").replace("severity: medium", "severity: low");
    assert_eq!(
        ingest(&server, OPERATOR_TOKEN, "application/yaml", changed)
            .await
            .0,
        409
    );
    assert_eq!(
        ingest(
            &server,
            REGULATOR_TOKEN,
            "application/yaml",
            example("aml_v2")
        )
        .await
        .0,
        403
    );
    assert_eq!(
        ingest(&server, OPERATOR_TOKEN, "text/plain", example("aml_v2"))
            .await
            .0,
        415
    );
    assert_eq!(
        ingest(
            &server,
            OPERATOR_TOKEN,
            "application/json",
            "{\"name\":".into()
        )
        .await
        .0,
        422
    );

    let listed = policies(&server).await;
    let names: Vec<&str> = listed["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["aml_v2", "basel3_delta"]);
    let digest = listed["rule_set_digest"].clone();
    let versions: Value = http()
        .get(server.url("/v1/policies/aml_v2/versions"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(versions["versions"].as_array().unwrap().len(), 1);
    let missing = http()
        .get(server.url("/v1/policies/nope/versions"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);

    // Every refusal is on the ledger.
    let all: Value = http()
        .get(server.url("/v1/events?limit=1000"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let rejected = all["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["event_type"] == "PolicyIngestRejected")
        .count();
    assert_eq!(rejected, 4);

    assert!(server.terminate().success());
    let server = Server::start(&data, &[]);
    let again = policies(&server).await;
    assert_eq!(again["rule_set_digest"], digest);
    assert_eq!(again["policies"].as_array().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_is_activated_step_by_step_and_bad_requests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let client = http();
    let post = |path: &str, token: &str, body: Value| {
        client
            .post(server.url(path))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    assert_eq!(
        ingest(
            &server,
            OPERATOR_TOKEN,
            "application/yaml",
            example("aml_v2")
        )
        .await
        .0,
        201
    );
    let artifact = dir.path().join("finmoe.bin");
    std::fs::write(&artifact, b"model weights").unwrap();
    let digest = hex::encode(aether_ledger::hashing::sm3(b"model weights"));
    let model = serde_json::json!({"ref": "finmoe-7b-v3@sgp-region", "uri": artifact.to_str().unwrap(),
                                   "digest": digest, "feature_schema": {"amount_minor": "int"}});
    assert_eq!(
        post("/v1/models", OPERATOR_TOKEN, model.clone())
            .await
            .unwrap()
            .status(),
        201
    );
    assert_eq!(
        post("/v1/models", OPERATOR_TOKEN, model.clone())
            .await
            .unwrap()
            .status(),
        200
    );
    let mut wrong = model.clone();
    wrong["ref"] = "finmoe-7b-v4@sgp-region".into();
    wrong["digest"] = "ab".repeat(32).into();
    let resp = post("/v1/models", OPERATOR_TOKEN, wrong).await.unwrap();
    assert_eq!(resp.status(), 422);
    let problem: Value = resp.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("has SM3 digest"),
        "{problem}"
    );

    for (body, status) in [
        (
            serde_json::json!({"model_ref": "finmoe-7b-v3@sgp-region", "traffic_weight": 1.5, "policy_hooks": ["aml_v2"]}),
            422,
        ),
        (
            serde_json::json!({"model_ref": "finmoe-7b-v3", "traffic_weight": 0.5, "policy_hooks": []}),
            422,
        ),
        (
            serde_json::json!({"model_ref": "finmoe-7b-v3@sgp-region", "traffic_weight": "half"}),
            422,
        ),
    ] {
        assert_eq!(
            post("/v1/engine/activate", OPERATOR_TOKEN, body)
                .await
                .unwrap()
                .status(),
            status
        );
    }
    assert_eq!(
        post(
            "/v1/engine/activate",
            REGULATOR_TOKEN,
            serde_json::json!({})
        )
        .await
        .unwrap()
        .status(),
        403
    );

    let resp = post(
        "/v1/engine/activate",
        OPERATOR_TOKEN,
        serde_json::json!({"model_ref": "finmoe-7b-v3@sgp-region", "traffic_weight": 0.1, "policy_hooks": ["aml_v2"]}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 202);
    let accepted: Value = resp.json().await.unwrap();
    let status_url = accepted["status_url"].as_str().unwrap().to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let engine = loop {
        let e: Value = client
            .get(server.url(&status_url))
            .bearer_auth(REGULATOR_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if e["status"] != "activating" {
            break e;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still activating: {e}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(engine["status"], "active", "{engine}");
    assert_eq!(engine["steps"].as_array().unwrap().len(), 5);
    assert_eq!(engine["activation_id"], accepted["event"]["event_id"]);

    // An unknown hook fails at its step, recorded with the reason.
    let resp = post(
        "/v1/engine/activate",
        OPERATOR_TOKEN,
        serde_json::json!({"model_ref": "finmoe-7b-v3@sgp-region", "traffic_weight": 0.2, "policy_hooks": ["no_such_policy"]}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 202);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let e: Value = client
            .get(server.url(&status_url))
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if e["status"] == "failed" {
            assert!(
                e["failure"].as_str().unwrap().contains("no_such_policy"),
                "{e}"
            );
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{e}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let missing = client
        .get(server.url("/v1/engines/mars"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_colouring_is_validated_returned_and_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let send = |headers: &[(&str, &str)]| {
        let mut req = http()
            .post(server.url("/v1/policy/ingest"))
            .bearer_auth(OPERATOR_TOKEN)
            .header("content-type", "application/yaml")
            .body(example("aml_v2"));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send()
    };
    for (name, value) in [
        ("x-model-stage", "purple-v3"),
        ("x-semantic-tag", "q-unknown"),
        ("traceparent", "00-zz-00f067aa0ba902b7-01"),
        ("x-trace-id", "has space"),
    ] {
        let resp = send(&[(name, value)]).await.unwrap();
        assert_eq!(resp.status(), 400, "{name}: {value}");
        let problem: Value = resp.json().await.unwrap();
        assert!(
            problem["detail"]
                .as_str()
                .unwrap()
                .to_lowercase()
                .contains(&name.replace("x-", "")[..5]),
            "{problem}"
        );
    }
    let resp = send(&[
        ("x-trace-id", "trace-abc-1"),
        ("x-model-stage", "Green-FinMoE-v3"),
        ("x-semantic-tag", "c-policy.aml"),
    ])
    .await
    .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(resp.headers()["x-trace-id"], "trace-abc-1");
    let body: Value = resp.json().await.unwrap();
    let seq = body["event"]["seq"].as_u64().unwrap();
    let event: Value = http()
        .get(server.url(&format!("/v1/events/{seq}")))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let meta = &event["metadata"];
    assert_eq!(meta["trace_id"], "trace-abc-1");
    assert_eq!(meta["model_stage"], "green-finmoe-v3");
    assert_eq!(meta["semantic_tag"], "c-policy.aml");
    assert!(meta["actor"].as_str().unwrap().starts_with("operator:"));

    // Without a trace id one is made, returned, and taken from traceparent when given.
    let resp = http()
        .get(server.url("/v1/policies"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-trace-id"].len(), 32);
    let resp = http()
        .get(server.url("/v1/policies"))
        .bearer_auth(OPERATOR_TOKEN)
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["x-trace-id"],
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_follows_its_state_machine_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let client = http();
    let post = |path: String, body: Value| {
        client
            .post(server.url(&path))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&body)
            .send()
    };
    aether_e2e::register_two_models(&server, dir.path()).await;
    let bad = serde_json::json!({"baseline": "finmoe-7b-v3@sgp-region", "candidate": "finmoe-7b-v4@sgp-region", "steps": [50, 10]});
    assert_eq!(
        post("/v1/rollouts".into(), bad).await.unwrap().status(),
        422
    );
    let resp = post(
        "/v1/rollouts".into(),
        serde_json::json!({"baseline": "finmoe-7b-v3@sgp-region", "candidate": "finmoe-7b-v4@sgp-region"}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 201);
    let started: Value = resp.json().await.unwrap();
    let id = started["rollout"]["id"].as_str().unwrap().to_string();
    assert_eq!(
        started["rollout"]["steps"],
        serde_json::json!([1, 2, 5, 10, 25, 50, 100])
    );

    let step: Value = post(format!("/v1/rollouts/{id}/step"), serde_json::json!({}))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(step["rollout"]["candidate_weight"], 1);
    let version = step["rollout"]["version"].as_u64().unwrap();
    let stale = post(
        format!("/v1/rollouts/{id}/step"),
        serde_json::json!({"expected_version": version - 1}),
    )
    .await
    .unwrap();
    assert_eq!(stale.status(), 409);
    let resp = post(
        format!("/v1/rollouts/{id}/abort"),
        serde_json::json!({"reason": "latency"}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    let resp = post(format!("/v1/rollouts/{id}/step"), serde_json::json!({}))
        .await
        .unwrap();
    assert_eq!(resp.status(), 409);
    let problem: Value = resp.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .ends_with("it is aborted"),
        "{problem}"
    );
    assert_eq!(
        post(format!("/v1/rollouts/{id}/teleport"), serde_json::json!({}))
            .await
            .unwrap()
            .status(),
        404
    );
    assert_eq!(
        post("/v1/rollouts/nope/step".into(), serde_json::json!({}))
            .await
            .unwrap()
            .status(),
        404
    );
    let got: Value = client
        .get(server.url(&format!("/v1/rollouts/{id}")))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got["phase"], "aborted");
    assert_eq!(got["candidate_weight"], 0);

    // Replaying the ledger from seq 1 gives exactly the live state.
    let live: Value = client
        .get(server.url("/v1/state"))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(live["state"]["rollouts"].as_array().unwrap().len(), 1);
    let out = aether_e2e::run_aether(
        &[
            "replay",
            "--data-dir",
            dir.path().join("data").to_str().unwrap(),
            "--json",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let replayed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(replayed["state"], live["state"]);
    assert_eq!(replayed["digest"], live["digest"]);
}

fn corpus_document(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../services/rag/corpus")
        .join(format!("{name}.md"));
    serde_json::json!({
        "id": name,
        "format": "markdown",
        "text": std::fs::read_to_string(path).unwrap(),
    })
}

async fn post_corpus(server: &Server, token: &str, body: Value) -> (u16, Value) {
    let resp = http()
        .post(server.url("/v1/corpus/ingest"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn get_json(server: &Server, path: &str) -> (u16, Value) {
    let resp = http()
        .get(server.url(path))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corpus_versions_are_ingested_searched_refused_precisely_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);

    // Version 1: two documents.
    let (status, v1) = post_corpus(
        &server,
        OPERATOR_TOKEN,
        serde_json::json!({
            "name": "sg-clearing",
            "documents": [corpus_document("threshold-reporting"), corpus_document("record-keeping")],
        }),
    )
    .await;
    assert_eq!(status, 201, "{v1}");
    assert_eq!(v1["event"]["stream_id"], "corpus/sg-clearing");
    assert_eq!(v1["corpus"]["previous"], Value::Null);
    let version1 = v1["corpus"]["version"].as_str().unwrap().to_owned();
    assert_eq!(version1.len(), 64);

    // Version 2 adds a document on top of version 1.
    let (status, v2) = post_corpus(
        &server,
        OPERATOR_TOKEN,
        serde_json::json!({ "name": "sg-clearing", "documents": [corpus_document("large-exposures")] }),
    )
    .await;
    assert_eq!(status, 201, "{v2}");
    assert_eq!(v2["corpus"]["previous"], version1.as_str());
    assert_eq!(v2["corpus"]["documents"].as_array().unwrap().len(), 3);
    let version2 = v2["corpus"]["version"].as_str().unwrap().to_owned();
    assert_ne!(version1, version2);

    // The same documents again change nothing and write nothing.
    let (status, same) = post_corpus(
        &server,
        OPERATOR_TOKEN,
        serde_json::json!({ "name": "sg-clearing", "documents": [corpus_document("large-exposures")] }),
    )
    .await;
    assert_eq!(status, 200, "{same}");
    assert_eq!(same["event"], Value::Null);
    assert_eq!(same["corpus"]["version"], version2.as_str());

    // Retrieval and lookup by clause id on the current version.
    let (status, hits) = get_json(
        &server,
        "/v1/corpora/sg-clearing/search?q=just%20under%20the%20reporting%20threshold&limit=3",
    )
    .await;
    assert_eq!(status, 200, "{hits}");
    assert_eq!(hits["version"], version2.as_str());
    assert_eq!(hits["hits"][0]["clause_id"], "structuring-1", "{hits}");
    let (status, clause) =
        get_json(&server, "/v1/corpora/sg-clearing/clauses/rep-threshold-1").await;
    assert_eq!(status, 200, "{clause}");
    assert_eq!(clause["clause"]["document_id"], "threshold-reporting");
    let (status, _) = get_json(&server, "/v1/corpora/sg-clearing/clauses/no-such-clause").await;
    assert_eq!(status, 404);
    let (status, _) = get_json(&server, "/v1/corpora/nope/search?q=x").await;
    assert_eq!(status, 404);
    let (status, problem) = get_json(&server, "/v1/corpora/sg-clearing/search").await;
    assert_eq!(status, 400, "{problem}");

    // Refusals: a malformed anchor (named with its line), no documents, a bad name, a
    // regulator, a body that is not JSON. None changes the corpus.
    let (status, problem) = post_corpus(
        &server,
        OPERATOR_TOKEN,
        serde_json::json!({ "name": "sg-clearing", "documents": [
            { "id": "broken", "text": "# Broken\n\n## Section {#Upper}\n\nText.\n" }
        ]}),
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("line 3"),
        "{problem}"
    );
    let (status, problem) = post_corpus(
        &server,
        OPERATOR_TOKEN,
        serde_json::json!({ "name": "sg-clearing", "documents": [] }),
    )
    .await;
    assert_eq!(status, 422, "{problem}");
    let (status, _) = post_corpus(
        &server,
        OPERATOR_TOKEN,
        serde_json::json!({ "name": "Bad Name!", "documents": [corpus_document("record-keeping")] }),
    )
    .await;
    assert_eq!(status, 422);
    let (status, _) = post_corpus(
        &server,
        REGULATOR_TOKEN,
        serde_json::json!({ "name": "sg-clearing", "documents": [corpus_document("record-keeping")] }),
    )
    .await;
    assert_eq!(status, 403);
    let resp = http()
        .post(server.url("/v1/corpus/ingest"))
        .bearer_auth(OPERATOR_TOKEN)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 422);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    let (_, list) = get_json(&server, "/v1/corpora").await;
    assert_eq!(list["corpora"][0]["current"]["version"], version2.as_str());
    assert_eq!(list["corpora"][0]["versions"], 2);
    let (_, events) = get_json(&server, "/v1/audit/events?event_type=CorpusIngestRejected").await;
    assert_eq!(events["events"].as_array().unwrap().len(), 3, "{events}");

    // A restart rebuilds both versions from the ledger, with the same digests.
    assert!(server.terminate().success());
    let server = Server::start(&data, &[]);
    let (_, versions) = get_json(&server, "/v1/corpora/sg-clearing/versions").await;
    let digests: Vec<&str> = versions["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["version"].as_str().unwrap())
        .collect();
    assert_eq!(digests, [version1.as_str(), version2.as_str()]);
    assert!(server.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_restores_a_snapshot_in_one_event_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let post = |server: &Server, path: &str, token: &str, body: Value| {
        http()
            .post(server.url(path))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    let (status, _) = ingest(
        &server,
        OPERATOR_TOKEN,
        "application/yaml",
        example("aml_v2"),
    )
    .await;
    assert_eq!(status, 201);
    let digest_v1 = policies(&server).await["rule_set_digest"].clone();

    let resp = post(
        &server,
        "/v1/snapshots",
        REGULATOR_TOKEN,
        serde_json::json!({}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 403);
    let resp = post(
        &server,
        "/v1/snapshots",
        OPERATOR_TOKEN,
        serde_json::json!({}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 201);
    let snapshot: Value = resp.json().await.unwrap();
    assert_eq!(snapshot["rules_digest"], digest_v1, "{snapshot}");
    let id = snapshot["id"].as_str().unwrap().to_owned();

    // A second policy changes the rule set; the rollback brings back the snapshot's.
    let (status, _) = ingest(
        &server,
        OPERATOR_TOKEN,
        "application/yaml",
        example("basel3_delta"),
    )
    .await;
    assert_eq!(status, 201);
    assert_ne!(policies(&server).await["rule_set_digest"], digest_v1);
    let resp = post(
        &server,
        "/v1/rollback",
        OPERATOR_TOKEN,
        serde_json::json!({"snapshot_id": "no-such-snapshot", "reason": "x"}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 404);
    let resp = post(
        &server,
        "/v1/rollback",
        OPERATOR_TOKEN,
        serde_json::json!({"snapshot_id": id, "reason": "basel limits misconfigured"}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(policies(&server).await["rule_set_digest"], digest_v1);
    let (_, rolled) = get_json(&server, "/v1/audit/events?event_type=RolledBack").await;
    let events = rolled["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "one event for the rollback: {rolled}");
    assert_eq!(events[0]["payload"]["target_snapshot"], id.as_str());

    // Every control event names the snapshot in force when it was asked for: none before
    // the first snapshot, then that one.
    let (_, ingested) = get_json(&server, "/v1/audit/events?event_type=PolicyIngested").await;
    let in_force: Vec<&Value> = ingested["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["metadata"]["snapshot_id"])
        .collect();
    assert_eq!(
        in_force,
        [&Value::Null, &Value::from(id.as_str())],
        "{ingested}"
    );

    // A restart rebuilds the rolled-back rule set, not the latest policies.
    assert!(server.terminate().success());
    let server = Server::start(&data, &[]);
    assert_eq!(policies(&server).await["rule_set_digest"], digest_v1);
    assert!(server.terminate().success());
}

/// The OpenAPI document names every control-plane and audit operation, and every operation
/// it names exists on the running service and refuses a caller without a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_matches_the_routes() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let resp = http()
        .get(server.url("/v1/openapi.json"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let doc: Value = resp.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"), "{doc}");
    let paths = doc["paths"].as_object().unwrap();
    for (path, method) in [
        ("/v1/policy/ingest", "post"),
        ("/v1/policies", "get"),
        ("/v1/policies/{name}/versions", "get"),
        ("/v1/models", "post"),
        ("/v1/models", "get"),
        ("/v1/engine/activate", "post"),
        ("/v1/engines", "get"),
        ("/v1/engines/{region}", "get"),
        ("/v1/rollouts", "post"),
        ("/v1/rollouts/{id}/{command}", "post"),
        ("/v1/corpus/ingest", "post"),
        ("/v1/corpora/{name}/search", "get"),
        ("/v1/snapshots", "post"),
        ("/v1/rollback", "post"),
        ("/v1/state", "get"),
        // The Marquez-compatible lineage API is documented too.
        ("/api/v1/lineage", "post"),
        ("/api/v1/lineage", "get"),
        ("/api/v1/search", "get"),
        ("/api/v1/namespaces/{namespace}/jobs/{job}/runs", "get"),
        ("/api/v1/column-lineage", "get"),
        ("/v1/session", "post"),
    ] {
        assert!(
            paths.get(path).is_some_and(|p| p[method].is_object()),
            "{method} {path} missing from {:?}",
            paths.keys().collect::<Vec<_>>()
        );
    }
    assert_eq!(
        paths["/v1/engine/activate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
            ["$ref"],
        "#/components/schemas/ActivationRequest"
    );
    let mut checked = 0;
    for (path, item) in paths {
        // Every path parameter as `1`: a valid seq, and a name like any other.
        let concrete: String = path
            .split('/')
            .map(|part| if part.starts_with('{') { "1" } else { part })
            .collect::<Vec<_>>()
            .join("/");
        let url = server.url(&concrete);
        for method in item.as_object().unwrap().keys() {
            let request = match method.as_str() {
                "get" => http().get(&url),
                "post" => http().post(&url).json(&serde_json::json!({})),
                "delete" => http().delete(&url),
                other => panic!("unexpected method {other} on {path}"),
            };
            let resp = request.send().await.unwrap();
            assert_eq!(resp.status(), 401, "{method} {path} without a token");
            assert_eq!(
                resp.headers()["content-type"],
                "application/problem+json",
                "{method} {path}"
            );
            checked += 1;
        }
    }
    assert!(checked >= 33, "{checked} operations");
    for audit in [
        "/v1/audit/events",
        "/v1/audit/decisions/{request_id}",
        "/v1/audit/exports",
    ] {
        assert!(paths.contains_key(audit), "{audit} missing");
    }
    // Page sizes carry the handlers' real range, and the documented refusal is there.
    for path in ["/v1/events", "/v1/audit/events", "/v1/audit/checkpoints"] {
        let get = &paths[path]["get"];
        let limit = get["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "limit")
            .unwrap_or_else(|| panic!("{path} has no limit parameter"));
        assert_eq!(limit["schema"]["minimum"], 1, "{path}: {limit}");
        assert_eq!(limit["schema"]["maximum"], 1000, "{path}: {limit}");
        assert!(
            get["responses"].get("400").is_some(),
            "{path} documents no 400"
        );
    }
    assert!(server.terminate().success());
}

/// The role matrix, from the OpenAPI document itself: every operation names its roles
/// ("Role: operator", "Role: regulator", "Role: operator or regulator"), each named role is
/// let through, every other role is refused with 403, and no token or an unknown one with 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_admits_exactly_the_roles_it_documents() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    let doc: Value = aether_e2e::openapi_document(&server).await;
    let callers = [
        ("operator", Some(OPERATOR_TOKEN)),
        ("regulator", Some(REGULATOR_TOKEN)),
        ("unknown token", Some("not-a-token-of-this-service-at-all")),
        ("no token", None),
    ];
    let mut undocumented = Vec::new();
    let mut checked = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        let concrete: String = path
            .split('/')
            .map(|part| if part.starts_with('{') { "1" } else { part })
            .collect::<Vec<_>>()
            .join("/");
        for (method, operation) in item.as_object().unwrap() {
            let description = operation["description"].as_str().unwrap_or_default();
            let Some(roles) = description
                .split("Role: ")
                .nth(1)
                .and_then(|rest| rest.split(['.', ';', ',']).next())
            else {
                undocumented.push(format!("{method} {path}"));
                continue;
            };
            let allowed: Vec<&str> = roles.split(" or ").collect();
            for (caller, token) in callers {
                let mut request = match method.as_str() {
                    "get" => http().get(server.url(&concrete)),
                    "delete" => http().delete(server.url(&concrete)),
                    _ => http()
                        .post(server.url(&concrete))
                        .json(&serde_json::json!({})),
                };
                if let Some(token) = token {
                    request = request.bearer_auth(token);
                }
                let status = request.send().await.unwrap().status().as_u16();
                let expected = match caller {
                    "no token" | "unknown token" => Some(401),
                    role if allowed.contains(&role) => None,
                    _ => Some(403),
                };
                match expected {
                    Some(code) => assert_eq!(status, code, "{caller} on {method} {path}"),
                    None => assert!(
                        status != 401 && status != 403,
                        "{caller} on {method} {path} was refused ({status}) though it is a documented role"
                    ),
                }
                checked += 1;
            }
        }
    }
    assert!(
        undocumented.is_empty(),
        "operations that name no role: {undocumented:?}"
    );
    assert!(checked >= 4 * 33, "{checked} calls");
    assert!(server.terminate().success());
}

//! End-to-end: the Marquez-compatible lineage API of a running `aether serve`, on SQLite and
//! PostgreSQL. External OpenLineage events (a feature pipeline and the training job behind a
//! model) are validated (malformed ones refused with nothing stored), joined with Aether's
//! own records into one graph, listed by namespace, job, dataset, version, run and event,
//! and seen as of a point in time.

use std::time::{Duration, Instant};

use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

const MODEL: &str = "finmoe-7b-v3@sgp-region";
const ARTIFACT_NS: &str = "s3://aether-models";
const ARTIFACT: &str = "finmoe-7b-v3/model.safetensors";
/// The artifact's SM3 digest, as the training job and the registration both name it.
const DIGEST: &str = "a1f3c5e7a1f3c5e7a1f3c5e7a1f3c5e7a1f3c5e7a1f3c5e7a1f3c5e7a1f3c5e7";
const FEATURES_RUN: &str = "0192f0c4-7a35-7b8e-9c1d-2e3f4a5b6c01";
const TRAIN_RUN: &str = "0192f0c4-7a35-7b8e-9c1d-2e3f4a5b6c02";
const PRODUCER: &str = "https://bank.test/feature-platform";

fn dataset(ns: &str, name: &str, version: Option<&str>) -> Value {
    let mut d = json!({ "namespace": ns, "name": name });
    if let Some(v) = version {
        d["facets"] = json!({ "version": {
            "_producer": PRODUCER,
            "_schemaURL": "https://openlineage.io/spec/facets/1-0-1/DatasetVersionDatasetFacet.json#/$defs/DatasetVersionDatasetFacet",
            "datasetVersion": v,
        }});
    }
    d
}

fn run_event(
    kind: &str,
    at: DateTime<Utc>,
    run: &str,
    job: (&str, &str),
    inputs: Vec<Value>,
    outputs: Vec<Value>,
) -> Value {
    json!({
        "eventType": kind,
        "eventTime": at.to_rfc3339(),
        "producer": PRODUCER,
        "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
        "run": { "runId": run },
        "job": { "namespace": job.0, "name": job.1 },
        "inputs": inputs,
        "outputs": outputs,
    })
}

/// The feature pipeline (START, COMPLETE) and the training job that wrote the artifact
/// Aether registers as the model.
fn pipeline(features_at: DateTime<Utc>, train_at: DateTime<Utc>) -> Value {
    let raw = dataset("s3://raw", "trades", None);
    let features = dataset("s3://features", "trades_v1", Some("f-2026-12-01"));
    json!([
        run_event(
            "START",
            features_at,
            FEATURES_RUN,
            ("features", "build_trade_features"),
            vec![raw.clone()],
            vec![]
        ),
        run_event(
            "COMPLETE",
            features_at + chrono::Duration::seconds(90),
            FEATURES_RUN,
            ("features", "build_trade_features"),
            vec![raw],
            vec![features.clone()]
        ),
        run_event(
            "COMPLETE",
            train_at,
            TRAIN_RUN,
            ("ml", "train_finmoe"),
            vec![dataset("s3://features", "trades_v1", None)],
            vec![dataset(ARTIFACT_NS, ARTIFACT, Some(DIGEST))]
        ),
    ])
}

struct Api<'a> {
    server: &'a Server,
}

impl Api<'_> {
    async fn get(&self, path: &str, query: &[(&str, &str)], token: Option<&str>) -> (u16, Value) {
        let mut req = http().get(self.server.url(path)).query(query);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    async fn read(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let (status, body) = self.get(path, query, Some(REGULATOR_TOKEN)).await;
        assert_eq!(status, 200, "GET {path} {query:?}: {body}");
        body
    }

    async fn post(&self, body: &Value, token: &str) -> (u16, String, Value) {
        let resp = http()
            .post(self.server.url("/api/v1/lineage"))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let content_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (
            status,
            content_type,
            resp.json().await.unwrap_or(Value::Null),
        )
    }
}

fn ids(graph: &Value) -> Vec<String> {
    graph["graph"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap().to_owned())
        .collect()
}

fn node<'a>(graph: &'a Value, id: &str) -> &'a Value {
    graph["graph"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("{id} not in {graph}"))
}

async fn scenario(env: &[(&str, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), env);
    let api = Api { server: &server };

    // Roles: reads need a token, writes the operator's.
    let (status, _) = api.get("/api/v1/namespaces", &[], None).await;
    assert_eq!(status, 401);
    let (status, _, body) = api.post(&json!([]), REGULATOR_TOKEN).await;
    assert_eq!(status, 403, "{body}");

    // Aether registers the model whose artifact the training job wrote.
    let registered: Value = http()
        .post(server.url("/v1/models"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(
            &json!({"ref": MODEL, "uri": format!("{ARTIFACT_NS}/{ARTIFACT}"),
                      "digest": DIGEST, "feature_schema": {"amount_minor": "i64"}}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let seq = registered["event"]["seq"].as_u64().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let own_run = loop {
        let (status, record) = api
            .get(
                &format!("/v1/lineage/events/{seq}"),
                &[],
                Some(REGULATOR_TOKEN),
            )
            .await;
        if status == 200 {
            // The record names the Delta table version that holds the event.
            let delta = record["openlineage_event"]["outputs"]
                .as_array()
                .unwrap()
                .iter()
                .find(|d| d["namespace"] == "delta" && d["name"] == "events")
                .unwrap()
                .clone();
            let version = record["delta_version"].as_i64().expect("a Delta version");
            assert_eq!(
                delta["facets"]["version"]["datasetVersion"],
                json!(version.to_string())
            );
            break record["run_id"].as_str().unwrap().to_owned();
        }
        assert!(Instant::now() < deadline, "no lineage record for seq {seq}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // Malformed: refused with the schema error named, nothing stored (single and batch).
    let now = Utc::now();
    let (features_at, train_at) = (
        now - chrono::Duration::hours(2),
        now - chrono::Duration::hours(1),
    );
    let mut bad = pipeline(features_at, train_at);
    bad[2]["eventType"] = json!("FINISHED");
    let (status, content_type, problem) = api.post(&bad, OPERATOR_TOKEN).await;
    assert_eq!(status, 400, "{problem}");
    assert_eq!(content_type, "application/problem+json");
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("event 2") && detail.contains("/eventType"),
        "{problem}"
    );
    assert_eq!(problem["event_index"], 2);
    let (status, _, problem) = api.post(&bad[2], OPERATOR_TOKEN).await;
    assert_eq!(status, 400);
    assert!(
        problem["detail"].as_str().unwrap().contains("FINISHED"),
        "{problem}"
    );
    let mut no_run_id = pipeline(features_at, train_at)[0].clone();
    no_run_id["run"] = json!({});
    let (status, _, problem) = api.post(&no_run_id, OPERATOR_TOKEN).await;
    assert_eq!(status, 400);
    assert!(
        problem["detail"].as_str().unwrap().contains("runId"),
        "{problem}"
    );
    let (status, _, _) = api.post(&json!("not an event"), OPERATOR_TOKEN).await;
    assert_eq!(status, 400);
    let events = api
        .read("/api/v1/events/lineage", &[("limit", "1000")])
        .await;
    assert!(
        events["events"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["producer"] != PRODUCER),
        "a refused event was stored: {events}"
    );
    let namespaces = api.read("/api/v1/namespaces", &[]).await;
    assert!(
        !namespaces.to_string().contains("\"features\""),
        "{namespaces}"
    );

    // Valid: stored once, even when sent again.
    let good = pipeline(features_at, train_at);
    let (status, _, body) = api.post(&good, OPERATOR_TOKEN).await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body, json!({ "received": 3, "stored": 3 }));
    let (_, _, body) = api.post(&good, OPERATOR_TOKEN).await;
    assert_eq!(body["stored"], 0);

    // The graph joins the pipeline to Aether's own model registration.
    let model_node = format!("dataset:aether://model:{MODEL}");
    let artifact_node = format!("dataset:{ARTIFACT_NS}:{ARTIFACT}");
    let graph = api
        .read(
            "/api/v1/lineage",
            &[("nodeId", &model_node), ("depth", "20")],
        )
        .await;
    let found = ids(&graph);
    for id in [
        model_node.as_str(),
        "job:aether:model.register",
        artifact_node.as_str(),
        "job:ml:train_finmoe",
        "dataset:s3://features:trades_v1",
        "job:features:build_trade_features",
        "dataset:s3://raw:trades",
    ] {
        assert!(
            found.contains(&id.to_owned()),
            "{id} missing from {found:?}"
        );
    }
    let register = node(&graph, "job:aether:model.register");
    assert_eq!(register["type"], "JOB");
    assert!(
        register["inEdges"].as_array().unwrap().contains(
            &json!({ "origin": artifact_node, "destination": "job:aether:model.register" })
        )
    );
    let train = node(&graph, "job:ml:train_finmoe");
    assert_eq!(
        train["outEdges"],
        json!([{ "origin": "job:ml:train_finmoe", "destination": artifact_node }])
    );
    assert_eq!(node(&graph, &model_node)["type"], "DATASET");
    assert_eq!(node(&graph, &model_node)["data"]["currentVersion"], DIGEST);

    // Namespaces, jobs, datasets, versions, runs and events say what was recorded.
    let namespaces = api.read("/api/v1/namespaces", &[]).await;
    let names: Vec<&str> = namespaces["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    for ns in [
        "aether",
        "aether://model",
        "features",
        "ml",
        "s3://features",
        ARTIFACT_NS,
    ] {
        assert!(names.contains(&ns), "{ns} missing from {names:?}");
    }
    let jobs = api.read("/api/v1/namespaces/features/jobs", &[]).await;
    assert_eq!(jobs["totalCount"], 1);
    let job = &jobs["jobs"][0];
    assert_eq!(job["name"], "build_trade_features");
    assert_eq!(job["latestRun"]["id"], FEATURES_RUN);
    assert_eq!(job["latestRun"]["state"], "COMPLETED");
    assert_eq!(job["latestRun"]["durationMs"], 90_000);
    assert_eq!(
        job["outputs"],
        json!([{ "namespace": "s3://features", "name": "trades_v1" }])
    );
    let aether_jobs = api.read("/api/v1/namespaces/aether/jobs", &[]).await;
    assert!(
        aether_jobs.to_string().contains("model.register"),
        "{aether_jobs}"
    );
    let datasets = api
        .read(
            &format!("/api/v1/namespaces/{}/datasets", enc(ARTIFACT_NS)),
            &[],
        )
        .await;
    assert_eq!(datasets["datasets"][0]["name"], ARTIFACT);
    let versions = api
        .read(
            &format!(
                "/api/v1/namespaces/{}/datasets/{}/versions",
                enc(ARTIFACT_NS),
                enc(ARTIFACT)
            ),
            &[],
        )
        .await;
    assert_eq!(
        versions["versions"].as_array().unwrap().len(),
        1,
        "{versions}"
    );
    assert_eq!(versions["versions"][0]["version"], DIGEST);
    assert_eq!(versions["versions"][0]["createdByRun"]["id"], TRAIN_RUN);
    let (status, _) = api
        .get(
            "/api/v1/namespaces/nowhere/datasets/none/versions",
            &[],
            Some(REGULATOR_TOKEN),
        )
        .await;
    assert_eq!(status, 404);
    let run = api
        .read(&format!("/api/v1/jobs/runs/{FEATURES_RUN}"), &[])
        .await;
    assert_eq!(run["state"], "COMPLETED");
    assert_eq!(run["jobVersion"]["name"], "build_trade_features");
    assert_eq!(run["outputVersions"][0]["version"], "f-2026-12-01");
    let run = api.read(&format!("/api/v1/jobs/runs/{own_run}"), &[]).await;
    assert_eq!(run["jobVersion"]["name"], "model.register");
    let (status, _) = api
        .get(
            "/api/v1/jobs/runs/00000000-0000-0000-0000-000000000000",
            &[],
            Some(REGULATOR_TOKEN),
        )
        .await;
    assert_eq!(status, 404);
    let events = api
        .read("/api/v1/events/lineage", &[("limit", "1000")])
        .await;
    let events = events["events"].as_array().unwrap();
    let external = events.iter().filter(|e| e["producer"] == PRODUCER).count();
    assert_eq!(external, 3);
    assert!(events.iter().any(|e| e["run"]["runId"] == own_run.as_str()));
    let times: Vec<DateTime<Utc>> = events
        .iter()
        .map(|e| e["eventTime"].as_str().unwrap().parse().unwrap())
        .collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "not oldest first: {times:?}"
    );
    // Paging one event at a time with offset gives exactly the same sequence, even where
    // many events share one time (a group commit records its batch at one instant).
    let mut paged = Vec::new();
    for offset in 0..events.len() + 1 {
        let page = api
            .read(
                "/api/v1/events/lineage",
                &[("limit", "1"), ("offset", &offset.to_string())],
            )
            .await;
        paged.extend(page["events"].as_array().unwrap().iter().cloned());
    }
    assert_eq!(&paged, events, "offset paging skips or repeats nothing");
    let after = (train_at - chrono::Duration::seconds(1)).to_rfc3339();
    let later = api
        .read(
            "/api/v1/events/lineage",
            &[("limit", "1000"), ("after", &after)],
        )
        .await;
    assert!(
        later["events"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["run"]["runId"] != FEATURES_RUN)
    );
    assert!(
        later["events"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["run"]["runId"] == TRAIN_RUN)
    );

    // As of a time between the feature pipeline and the training job: neither the training
    // job nor Aether's later registration exists yet.
    let as_of = (train_at - chrono::Duration::minutes(5)).to_rfc3339();
    let past = api
        .read(
            "/api/v1/lineage",
            &[
                ("nodeId", "dataset:s3://features:trades_v1"),
                ("asOf", &as_of),
            ],
        )
        .await;
    let past_ids = ids(&past);
    assert!(
        past_ids.contains(&"job:features:build_trade_features".to_owned()),
        "{past_ids:?}"
    );
    assert!(
        !past_ids.contains(&"job:ml:train_finmoe".to_owned()),
        "{past_ids:?}"
    );
    let (status, _) = api
        .get(
            "/api/v1/lineage",
            &[("nodeId", &model_node), ("asOf", &as_of)],
            Some(REGULATOR_TOKEN),
        )
        .await;
    assert_eq!(status, 404);
    let (status, _) = api
        .get(
            "/api/v1/lineage",
            &[("nodeId", &model_node), ("asOf", "yesterday")],
            Some(REGULATOR_TOKEN),
        )
        .await;
    assert_eq!(status, 400);

    assert!(server.terminate().success());
}

/// Percent-encodes a path segment (`:` and `/` included).
fn enc(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lineage_api_on_sqlite() {
    scenario(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lineage_api_on_postgres() {
    let db = aether_ledger::testing::TestDatabase::create().await;
    scenario(&[("DATABASE_URL", db.url.as_str())]).await;
    db.drop_database().await;
}

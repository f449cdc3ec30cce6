//! Ledger events as OpenLineage run events, checked against the OpenLineage 2-0-2 spec files
//! vendored in `schemas/openlineage/` and the `aether_ledger` facet's own schema, with no network.

mod support;

use std::collections::{BTreeSet, HashMap};

use aether_ledger::RecordedEvent;
use aether_lineage::{
    AETHER_LEDGER_FACET_SCHEMA, LineageError, MappingContext, batch_run_event, job_name, run_id,
    to_run_event,
};
use serde_json::{Value, json};
use support::{BASE, Chain, Spec, digest, hex_of};

const MODEL: &str = "finmoe-7b-v3@sgp-region";
const BASELINE: &str = "finmoe-7b-v2@sgp-region";

/// What a lineage user should see for each event type: job and OpenLineage event type.
const EXPECTED: &[(&str, &str, &str)] = &[
    ("EngineActivationRequested", "engine.activate", "START"),
    ("EngineModelVerified", "engine.activate", "RUNNING"),
    ("EnginePoliciesBound", "engine.activate", "RUNNING"),
    ("CircuitBreakerRegistered", "engine.activate", "RUNNING"),
    ("EngineActivated", "engine.activate", "COMPLETE"),
    ("EngineActivationFailed", "engine.activate", "FAIL"),
    ("EngineDeactivated", "engine.deactivate", "COMPLETE"),
    ("ModelRegistered", "model.register", "COMPLETE"),
    ("PolicyIngested", "policy.ingest", "COMPLETE"),
    ("PolicyIngestRejected", "policy.ingest", "FAIL"),
    ("CorpusIngested", "corpus.ingest", "COMPLETE"),
    ("RolloutStarted", "rollout.step", "COMPLETE"),
    ("RolloutStepped", "rollout.step", "COMPLETE"),
    ("RolloutPaused", "rollout.step", "COMPLETE"),
    ("RolloutPromoted", "rollout.step", "COMPLETE"),
    ("RolloutResumed", "rollout.step", "COMPLETE"),
    ("RolloutAborted", "rollout.step", "COMPLETE"),
    ("RolloutWeightSet", "rollout.step", "COMPLETE"),
    ("RolloutFallbackSet", "rollout.step", "COMPLETE"),
    ("RolloutChecked", "rollout.analysis", "COMPLETE"),
    ("ControllerTransitioned", "rollout.analysis", "COMPLETE"),
    ("RetrainRequested", "rollout.analysis", "COMPLETE"),
    ("RetrainStarted", "model.retrain", "START"),
    ("RetrainFinished", "model.retrain", "COMPLETE"),
    ("HandoffDelivered", "drift.handoff", "COMPLETE"),
    ("RolledBack", "rollout.rollback", "COMPLETE"),
    ("SnapshotCommitted", "snapshot.commit", "COMPLETE"),
    ("SnapshotAborted", "snapshot.commit", "ABORT"),
    ("ClearingDecided", "clearing.batch", "COMPLETE"),
    ("NettingComputed", "clearing.batch", "COMPLETE"),
    ("CheckpointSigned", "ledger.checkpoint", "COMPLETE"),
    ("RedactionApplied", "ledger.redaction", "COMPLETE"),
    ("AuditQueried", "audit.access", "COMPLETE"),
    ("WorkerRegistered", "ledger.event", "COMPLETE"),
];

/// A day of Aether: every event type, with payloads and metadata as the services write them.
struct Day {
    chain: Chain,
    /// Correlation id of the sgp-region activation: its request's event id.
    activation: String,
}

impl Day {
    fn new() -> Day {
        let mut c = Chain::default();
        let operator =
            json!({ "actor": "role:7f3a19c2", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736" });
        c.append(
            "model/finmoe-7b-v3@sgp-region",
            "ModelRegistered",
            json!({
                "model_ref": MODEL,
                "artifact_uri": "s3://aether-models/finmoe-7b-v3/model.safetensors",
                "digest": digest("model v3"),
                "feature_schema": { "amount_minor": "i64", "currency": "str", "counterparty_risk": "f32" },
            }),
            operator.clone(),
        );
        for (name, version) in [("aml_v2", "2.1.0"), ("basel3_delta", "1.4.2")] {
            c.append(
                &format!("policy/{name}"),
                "PolicyIngested",
                json!({
                    "name": name,
                    "version": version,
                    "digest": digest(name),
                    "rules": ["threshold", "sanctions"],
                    "source": "{\"name\":\"...\"}",
                }),
                operator.clone(),
            );
        }
        c.append(
            "policy-rejections",
            "PolicyIngestRejected",
            json!({
                "name": "aml_v3",
                "version": "3.0.0",
                "reason": "rule `threshold` at 4:12: undeclared reference to `request.amount`",
                "source": "name: aml_v3\n...",
                "source_truncated": false,
            }),
            operator.clone(),
        );
        c.append(
            "corpus/mas-notices",
            "CorpusIngested",
            json!({ "name": "mas-notices", "corpus_version": digest("mas-notices 2026-11"), "documents": 42 }),
            operator.clone(),
        );
        c.append(
            "snapshot",
            "SnapshotCommitted",
            json!({
                "id": "snap-0007",
                "gateway_digest": digest("routes"),
                "rules_digest": digest("rules"),
                "rag_digest": digest("mas-notices 2026-11"),
            }),
            json!({ "actor": "role:7f3a19c2", "snapshot_id": "snap-0007" }),
        );
        c.append(
            "snapshot",
            "SnapshotAborted",
            json!({ "id": "snap-0008", "reason": "participant rag did not prepare within 30 s" }),
            json!({ "actor": "role:7f3a19c2" }),
        );

        // As the control plane writes an activation: the request without a correlation id,
        // every later step with the request's id as correlation and the last step as cause.
        let requested = c.append(
            "engine/sgp-region",
            "EngineActivationRequested",
            json!({ "model_ref": MODEL, "traffic_weight": 0.1, "policy_hooks": ["aml_v2", "basel3_delta"] }),
            operator.clone(),
        );
        let activation = requested.event_id.to_string();
        let steps = [
            (
                "EngineModelVerified",
                json!({ "model_ref": MODEL, "digest": digest("model v3"), "uri": "s3://aether-models/finmoe-7b-v3/model.safetensors" }),
            ),
            (
                "EnginePoliciesBound",
                json!({
                    "hooks": [
                        { "name": "aml_v2", "version": "2.1.0", "digest": digest("aml_v2") },
                        { "name": "basel3_delta", "version": "1.4.2", "digest": digest("basel3_delta") },
                    ],
                    "rules_digest": digest("rules"),
                }),
            ),
            (
                "CircuitBreakerRegistered",
                json!({ "region": "sgp-region", "max_error_rate": 0.05, "max_p99_ms": 420 }),
            ),
            (
                "EngineActivated",
                json!({
                    "model_ref": MODEL,
                    "traffic_weight": 0.1,
                    "policy_hooks": ["aml_v2", "basel3_delta"],
                    "rules_digest": digest("rules"),
                }),
            ),
        ];
        let mut last = requested.event_id;
        for (event_type, payload) in steps {
            let mut metadata = operator.clone();
            metadata["correlation_id"] = json!(activation);
            metadata["causation_id"] = json!(last);
            metadata["snapshot_id"] = json!("snap-0007");
            last = c
                .append("engine/sgp-region", event_type, payload, metadata)
                .event_id;
        }
        c.append(
            "clearing/member-dbs",
            "ClearingDecided",
            json!({
                "request_id": "req-20261130-000042",
                "trace_id": "0af7651916cd43dd8448eb211c80319c",
                "model_ref": MODEL,
                "model_stage": "canary",
                "decision": "accept",
                "score": 0.93,
                "rules_fired": ["aml_v2/threshold"],
                "cited_clauses": [{ "corpus": "mas-notices", "clause": "626/4.2" }],
                "worker": "gpu-0",
                "latency_us": 812,
                "snapshot_id": "snap-0007",
            }),
            json!({
                "causation_id": activation,
                "request_id": "req-20261130-000042",
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "tenant": "dbs",
            }),
        );
        c.append(
            "clearing/member-dbs",
            "NettingComputed",
            json!({ "batch_id": "batch-7781", "members": 3, "net_positions": { "dbs": -1200, "ocbc": 800, "uob": 400 } }),
            json!({ "causation_id": activation }),
        );

        // An activation without correlation ids: the outcome names its request as cause.
        let requested = c.append(
            "engine/hkg-region",
            "EngineActivationRequested",
            json!({ "model_ref": MODEL, "traffic_weight": 1.0, "policy_hooks": ["aml_v2"] }),
            json!({ "actor": "role:7f3a19c2" }),
        );
        c.append(
            "engine/hkg-region",
            "EngineActivationFailed",
            json!({ "model_ref": MODEL, "reason": "artifact digest differs from the registered model" }),
            json!({ "actor": "role:7f3a19c2", "causation_id": requested.event_id }),
        );

        let started = c.append(
            "rollout/r-2026-11-30",
            "RolloutStarted",
            json!({
                "baseline": BASELINE,
                "candidate": { "model_ref": MODEL, "model_digest": digest("model v3") },
                "steps": [1, 5, 25, 100],
                "analysis": { "max_p99_latency_ms": 5, "max_error_rate": 0.01 },
            }),
            json!({ "actor": "role:7f3a19c2" }),
        );
        let by_payload =
            json!({ "rollout_event_id": started.event_id, "step": 1, "traffic_weight": 0.01 });
        c.append(
            "rollout/r-2026-11-30",
            "RolloutStepped",
            by_payload,
            json!({ "actor": "role:7f3a19c2" }),
        );
        c.append(
            "rollout/r-2026-11-30",
            "RolloutPaused",
            json!({ "reason": "p99 latency 6.1 ms above 5 ms" }),
            json!({ "actor": "role:7f3a19c2", "causation_id": started.event_id.to_string().to_uppercase() }),
        );
        c.append(
            "rollout/r-2026-11-30",
            "RolloutStepped",
            json!({ "rollout_event_id": started.event_id, "step": 2, "traffic_weight": 0.05 }),
            json!({ "actor": "role:7f3a19c2" }),
        );
        let controller =
            json!({ "actor": "aether:rollout-controller", "snapshot_id": "snap-0006" });
        let transition = c.append(
            "analysis/r-2026-11-30",
            "ControllerTransitioned",
            json!({ "kind": "transition", "from": "normal", "to": "degraded",
                    "reason": "risk 0.700 > degrade threshold 0.65" }),
            controller.clone(),
        );
        c.append(
            "analysis/r-2026-11-30",
            "RolloutChecked",
            json!({ "window_start": "2026-11-30T10:00:00Z", "window_end": "2026-11-30T10:01:00Z",
                    "step": 2, "state": { "weight": 5 } }),
            controller.clone(),
        );
        let retrain = c.append(
            "analysis/r-2026-11-30",
            "RetrainRequested",
            json!({ "candidate": MODEL, "tier": "l2", "drift_score": 0.2,
                    "data_range": { "from": "2026-11-30T09:00:00Z", "to": "2026-11-30T10:01:00Z" },
                    "features": ["amount"] }),
            controller.clone(),
        );
        let handoff = json!({ "actor": "aether-handoffs",
                              "causation_id": retrain.event_id, "correlation_id": retrain.event_id });
        c.append(
            "handoff/retrain",
            "RetrainStarted",
            json!({ "request": { "seq": retrain.seq, "event_id": retrain.event_id } }),
            handoff.clone(),
        );
        c.append(
            "handoff/retrain",
            "RetrainFinished",
            json!({ "elapsed_ms": 1200, "request": { "seq": retrain.seq, "event_id": retrain.event_id } }),
            handoff.clone(),
        );
        c.append(
            "handoff/webhook",
            "HandoffDelivered",
            json!({ "attempts": 2, "status": 200, "request": { "seq": retrain.seq, "event_id": retrain.event_id } }),
            handoff,
        );
        let mut caused = controller.clone();
        caused["causation_id"] = json!(transition.event_id);
        c.append(
            "rollout/r-2026-11-30",
            "RolloutFallbackSet",
            json!({ "on": true, "rollout_event_id": started.event_id }),
            caused.clone(),
        );
        c.append(
            "rollout/r-2026-11-30",
            "RolloutWeightSet",
            json!({ "from_weight": 5, "to_weight": 8, "reason": "increase",
                    "rollout_event_id": started.event_id }),
            caused.clone(),
        );
        c.append(
            "rollout/r-2026-11-30",
            "RolloutResumed",
            json!({ "weight": 8, "rollout_event_id": started.event_id, "reason": null }),
            json!({ "actor": "role:7f3a19c2" }),
        );
        c.append(
            "rollout/r-2026-11-30",
            "RolloutPromoted",
            json!({ "rollout_event_id": started.event_id, "baseline": BASELINE, "candidate": MODEL }),
            json!({ "actor": "role:7f3a19c2" }),
        );
        c.append(
            "rollout/r-2026-11-30",
            "RolledBack",
            json!({
                "rollout_event_id": started.event_id,
                "reason": "error rate 0.03 above 0.01",
                "metrics": { "error_rate": 0.03 },
                "target_snapshot": "snap-0007",
                "restored": { "gateway_digest": digest("routes"), "rules_digest": digest("rules"), "rag_digest": null },
            }),
            json!({ "actor": "role:7f3a19c2", "snapshot_id": "snap-0007" }),
        );
        c.append(
            "rollout/r-2026-11-30",
            "RolloutAborted",
            json!({ "rollout_event_id": started.event_id, "reason": "superseded",
                    "from_weight": 0, "to_weight": 0 }),
            json!({ "actor": "role:7f3a19c2" }),
        );
        c.append(
            "engine/hkg-region",
            "EngineDeactivated",
            json!({ "model_ref": MODEL, "reason": "region drained" }),
            json!({ "actor": "role:7f3a19c2" }),
        );
        c.append(
            "ledger/checkpoints",
            "CheckpointSigned",
            json!({
                "tree_size": 22,
                "root_hash": digest("root"),
                "signed_at": "2026-11-30T09:00:28.000000Z",
                "signature": hex_of(&[7u8; 64]),
                "public_key": format!("04{}", hex_of(&[9u8; 64])),
            }),
            json!({}),
        );
        let decided = c
            .events
            .iter()
            .find(|e| e.event_type == "ClearingDecided")
            .unwrap()
            .clone();
        c.append(
            "ledger/redactions",
            "RedactionApplied",
            json!({
                "event_id": decided.event_id,
                "seq": decided.seq,
                "member": "counterparty_name",
                "commitment": digest("salt+name"),
                "reason": "erasure request 2026-0042",
            }),
            json!({ "actor": "role:7f3a19c2" }),
        );
        c.append(
            "access/audit",
            "AuditQueried",
            json!({ "query": "events", "details": { "event_type": "ClearingDecided", "from": "2026-11-30T00:00:00Z" } }),
            json!({ "actor": "role:1a2b3c4d" }),
        );
        c.append(
            "worker/gpu-0",
            "WorkerRegistered",
            json!({ "worker": "gpu-0", "device": "H200", "capacity": 512 }),
            json!({}),
        );
        Day {
            chain: c,
            activation,
        }
    }

    fn events(&self) -> &[RecordedEvent] {
        &self.chain.events
    }

    fn first(&self, event_type: &str) -> &RecordedEvent {
        self.all(event_type)[0]
    }

    fn all(&self, event_type: &str) -> Vec<&RecordedEvent> {
        let found: Vec<_> = self
            .events()
            .iter()
            .filter(|e| e.event_type == event_type)
            .collect();
        assert!(!found.is_empty(), "the day has no {event_type}");
        found
    }
}

fn ctx() -> MappingContext {
    MappingContext::new(BASE)
}

fn json_of(event: &RecordedEvent, ctx: &MappingContext) -> Value {
    let run_event =
        to_run_event(event, ctx).unwrap_or_else(|e| panic!("{}: {e}", event.event_type));
    serde_json::to_value(run_event).expect("a run event serializes")
}

fn run_id_of(event: &RecordedEvent) -> String {
    json_of(event, &ctx())["run"]["runId"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn parent_of(event: &RecordedEvent) -> Option<(String, String)> {
    let v = json_of(event, &ctx());
    let parent = v["run"]["facets"].get("parent")?;
    Some((
        parent["job"]["name"].as_str().unwrap().to_owned(),
        parent["run"]["runId"].as_str().unwrap().to_owned(),
    ))
}

fn dataset<'a>(v: &'a Value, side: &str, namespace: &str, name: &str) -> &'a Value {
    v[side]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["namespace"] == namespace && d["name"] == name)
        .unwrap_or_else(|| panic!("no {side} {namespace}/{name} in {v:#}"))
}

fn version_of(dataset: &Value) -> Option<&str> {
    dataset["facets"]
        .get("version")
        .map(|v| v["datasetVersion"].as_str().unwrap())
}

#[test]
fn every_event_type_maps_to_a_spec_valid_run_event() {
    let day = Day::new();
    let spec = Spec::get();
    let covered: BTreeSet<&str> = day.events().iter().map(|e| e.event_type.as_str()).collect();
    let expected: BTreeSet<&str> = EXPECTED.iter().map(|(t, _, _)| *t).collect();
    assert_eq!(
        covered, expected,
        "the day covers exactly the listed event types"
    );

    for (i, event) in day.events().iter().enumerate() {
        let ctx = ctx().with_delta_version(i as i64 / 4);
        let v = json_of(event, &ctx);
        let checked = spec
            .check(&v)
            .unwrap_or_else(|e| panic!("{} does not validate: {e}\n{v:#}", event.event_type));
        let (_, job, state) = EXPECTED
            .iter()
            .find(|(t, _, _)| *t == event.event_type)
            .unwrap();
        assert_eq!(v["job"]["namespace"], "aether");
        assert_eq!(v["job"]["name"], *job, "{}", event.event_type);
        assert_eq!(job_name(&event.event_type), *job);
        assert_eq!(v["eventType"], *state, "{}", event.event_type);
        assert_eq!(
            v["eventTime"],
            aether_ledger::hashing::format_timestamp(&event.recorded_at)
        );
        assert_eq!(v["producer"], "https://aether.example/lineage");
        assert_eq!(
            v["schemaURL"],
            "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
        );

        // The facets every run carries were validated against their own schemas.
        assert!(
            checked.used("/openlineage/facets/aether_ledger/1-0-0.json"),
            "{checked:?}"
        );
        assert!(checked.used("JobTypeJobFacet.json"), "{checked:?}");
        assert!(
            checked.used("DatasetVersionDatasetFacet.json"),
            "{checked:?}"
        );
        let job_type = &v["job"]["facets"]["jobType"];
        assert_eq!(
            (
                &job_type["processingType"],
                &job_type["integration"],
                &job_type["jobType"]
            ),
            (&json!("BATCH"), &json!("AETHER"), &json!("LEDGER_EVENT"))
        );
        let failed = matches!(*state, "FAIL" | "ABORT");
        assert_eq!(
            checked.used("ErrorMessageRunFacet.json"),
            failed,
            "{}",
            event.event_type
        );

        // The ledger facet says where the event sits in the chain.
        let ledger = &v["run"]["facets"]["aether_ledger"];
        assert_eq!(
            ledger["_schemaURL"],
            format!("{BASE}/openlineage/facets/aether_ledger/1-0-0.json")
        );
        assert_eq!(ledger["seq"], event.seq);
        assert_eq!(ledger["hash"], hex_of(&event.hash));
        assert_eq!(ledger["prev_hash"], hex_of(&event.prev_hash));
        assert_eq!(ledger["stream_id"], event.stream_id);
        assert_eq!(ledger["stream_version"], event.stream_version);
        assert_eq!(ledger["event_type"], event.event_type);
        assert_eq!(ledger["event_id"], event.event_id.to_string());
        if i > 0 {
            assert_eq!(ledger["prev_hash"], hex_of(&day.events()[i - 1].hash));
        }

        // Every event is a row of the Delta events table, at the version the sink reports.
        let events = dataset(&v, "outputs", "delta", "events");
        assert_eq!(
            version_of(events),
            Some((i as i64 / 4).to_string().as_str())
        );
    }
}

#[test]
fn the_spec_check_can_fail() {
    let day = Day::new();
    let spec = Spec::get();
    let good = json_of(day.first("RolloutStepped"), &ctx().with_delta_version(3));
    spec.check(&good).expect("the unbroken event is valid");

    // Each break, and a fragment of the error it must be refused with.
    type Break = Box<dyn Fn(&mut Value)>;
    fn remove(v: &mut Value, key: &str) {
        v.as_object_mut().unwrap().remove(key);
    }
    let broken: Vec<(&str, &str, Break)> = vec![
        (
            "no runId",
            "\"runId\" is a required property",
            Box::new(|v| remove(&mut v["run"], "runId")),
        ),
        (
            "runId not a UUID",
            "is not a \"uuid\"",
            Box::new(|v| v["run"]["runId"] = json!("run-1")),
        ),
        (
            "unknown eventType",
            "/eventType",
            Box::new(|v| v["eventType"] = json!("DONE")),
        ),
        (
            "no job name",
            "\"name\" is a required property",
            Box::new(|v| remove(&mut v["job"], "name")),
        ),
        (
            "eventTime not a time",
            "is not a \"date-time\"",
            Box::new(|v| v["eventTime"] = json!("yesterday")),
        ),
        (
            "producer not a URI",
            "is not a \"uri\"",
            Box::new(|v| v["producer"] = json!("aether lineage")),
        ),
        (
            "parent without run",
            "ParentRunFacet",
            Box::new(|v| remove(&mut v["run"]["facets"]["parent"], "run")),
        ),
        (
            "jobType without integration",
            "\"integration\" is a required",
            Box::new(|v| remove(&mut v["job"]["facets"]["jobType"], "integration")),
        ),
        (
            "version without datasetVersion",
            "\"datasetVersion\" is a required",
            Box::new(|v| remove(&mut v["outputs"][0]["facets"]["version"], "datasetVersion")),
        ),
        (
            "ledger hash not hex",
            "/aether_ledger/hash",
            Box::new(|v| v["run"]["facets"]["aether_ledger"]["hash"] = json!("XYZ")),
        ),
        (
            "ledger seq missing",
            "\"seq\" is a required property",
            Box::new(|v| remove(&mut v["run"]["facets"]["aether_ledger"], "seq")),
        ),
        (
            "ledger facet with an unknown member",
            "'height' was unexpected",
            Box::new(|v| v["run"]["facets"]["aether_ledger"]["height"] = json!(3)),
        ),
        (
            "facet without _producer",
            "/run/facets",
            Box::new(|v| remove(&mut v["run"]["facets"]["aether_ledger"], "_producer")),
        ),
        (
            "facet schema not served anywhere",
            "schema https://aether.bank.test/nowhere.json cannot be used",
            Box::new(|v| {
                v["run"]["facets"]["aether_ledger"]["_schemaURL"] =
                    json!("https://aether.bank.test/nowhere.json")
            }),
        ),
    ];
    for (what, reason, breaks) in broken {
        let mut v = good.clone();
        breaks(&mut v);
        match spec.check(&v) {
            Ok(_) => panic!("accepted an event with {what}"),
            Err(e) => assert!(
                e.contains(reason),
                "{what}: refused for another reason: {e}"
            ),
        }
    }
}

#[test]
fn the_facet_schema_is_a_valid_2020_12_schema() {
    let stored: Value = serde_json::from_str(AETHER_LEDGER_FACET_SCHEMA).unwrap();
    jsonschema::meta::validate(&stored).expect("a valid draft 2020-12 schema");
    assert_eq!(
        stored["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    assert_eq!(
        stored["$defs"]["AetherLedgerRunFacet"]["allOf"][0]["$ref"],
        "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunFacet"
    );
    // The stored document validates a facet as well as the served one does.
    let spec = Spec::get();
    let day = Day::new();
    let facet = &json_of(day.first("SnapshotCommitted"), &ctx())["run"]["facets"]["aether_ledger"];
    spec.validate(stored["$id"].as_str().unwrap(), facet, "")
        .unwrap();
}

#[test]
fn mapping_is_deterministic() {
    let day = Day::new();
    let again = Day::new();
    for (a, b) in day.events().iter().zip(again.events()) {
        let ctx = ctx().with_delta_version(7);
        let first = serde_json::to_string(&to_run_event(a, &ctx).unwrap()).unwrap();
        let second = serde_json::to_string(&to_run_event(a, &ctx).unwrap()).unwrap();
        let rebuilt = serde_json::to_string(&to_run_event(b, &ctx).unwrap()).unwrap();
        assert_eq!(first, second, "{}", a.event_type);
        assert_eq!(first, rebuilt, "{}", a.event_type);
    }
}

#[test]
fn an_activation_is_one_run_from_request_to_outcome() {
    let day = Day::new();
    let [sgp_requested, hkg_requested] = day.all("EngineActivationRequested")[..] else {
        panic!("two activation requests");
    };
    let failed = day.first("EngineActivationFailed");

    // As the control plane writes it: every step after the request correlated to it.
    let activation = run_id("engine.activate", &day.activation).to_string();
    assert_eq!(day.activation, sgp_requested.event_id.to_string());
    assert_eq!(run_id_of(sgp_requested), activation);
    for t in [
        "EngineModelVerified",
        "EnginePoliciesBound",
        "CircuitBreakerRegistered",
        "EngineActivated",
    ] {
        assert_eq!(run_id_of(day.first(t)), activation, "{t}");
    }
    // No correlation id: the outcome's causation id names the request.
    assert_eq!(run_id_of(hkg_requested), run_id_of(failed));
    assert_eq!(
        run_id_of(failed),
        run_id("engine.activate", &hkg_requested.event_id.to_string()).to_string()
    );
    assert_ne!(run_id_of(sgp_requested), run_id_of(hkg_requested));
}

#[test]
fn other_events_each_have_a_run_of_their_own() {
    let day = Day::new();
    let mut runs: HashMap<String, Vec<&str>> = HashMap::new();
    for event in day.events() {
        runs.entry(run_id_of(event))
            .or_default()
            .push(&event.event_type);
    }
    for (run, types) in &runs {
        let shared_by_activation = types.iter().all(|t| job_name(t) == "engine.activate");
        let shared_by_retraining = types.iter().all(|t| job_name(t) == "model.retrain");
        assert!(
            types.len() == 1 || shared_by_activation || shared_by_retraining,
            "run {run} is shared by {types:?}"
        );
    }
    assert_eq!(
        runs.len(),
        day.events().len() - 6,
        "one run for the five events of one activation, one for the two of the other, \
         one for a retraining's start and finish"
    );
}

#[test]
fn a_retraining_is_one_run_under_the_request_that_asked_for_it() {
    let day = Day::new();
    let request = day.first("RetrainRequested");
    let asked = ("rollout.analysis".to_owned(), run_id_of(request));
    let started = day.first("RetrainStarted");
    let finished = day.first("RetrainFinished");
    assert_eq!(
        run_id_of(started),
        run_id_of(finished),
        "one run, started and finished"
    );
    assert_eq!(
        run_id_of(started),
        run_id("model.retrain", &request.event_id.to_string()).to_string()
    );
    assert_eq!(parent_of(started).as_ref(), Some(&asked));
    assert_eq!(parent_of(finished).as_ref(), Some(&asked));
    let delivered = day.first("HandoffDelivered");
    assert_eq!(parent_of(delivered).as_ref(), Some(&asked));
    assert_ne!(run_id_of(delivered), run_id_of(started));
}

#[test]
fn rollout_steps_run_under_their_rollout() {
    let day = Day::new();
    let started = day.first("RolloutStarted");
    let rollout = ("rollout.step".to_owned(), run_id_of(started));
    assert_eq!(
        parent_of(started),
        None,
        "the rollout's own run has no parent"
    );
    // By payload rollout_event_id (both steps and the promotion) and by causation id (pause).
    for t in [
        "RolloutStepped",
        "RolloutPaused",
        "RolloutResumed",
        "RolloutWeightSet",
        "RolloutFallbackSet",
        "RolloutPromoted",
        "RolloutAborted",
        "RolledBack",
    ] {
        for event in day.all(t) {
            assert_eq!(parent_of(event).as_ref(), Some(&rollout), "{t}");
            assert_ne!(run_id_of(event), rollout.1, "{t} is a run of its own");
        }
    }
    // Rollouts read their baseline and candidate models, with the candidate's digest.
    let v = json_of(started, &ctx());
    assert_eq!(
        version_of(dataset(&v, "inputs", "aether://model", BASELINE)),
        None
    );
    let candidate = dataset(&v, "inputs", "aether://model", MODEL);
    assert_eq!(version_of(candidate), Some(digest("model v3").as_str()));
}

#[test]
fn clearing_runs_under_their_engine_activation() {
    let day = Day::new();
    let activation = (
        "engine.activate".to_owned(),
        run_id_of(day.first("EngineActivated")),
    );
    for t in ["ClearingDecided", "NettingComputed"] {
        assert_eq!(parent_of(day.first(t)), Some(activation.clone()), "{t}");
    }
    let ctx = MappingContext {
        clearing_decisions_version: Some(12),
        ..ctx()
    };
    let v = json_of(day.first("ClearingDecided"), &ctx);
    assert_eq!(
        version_of(dataset(&v, "outputs", "delta", "clearing_decisions")),
        Some("12")
    );
    assert_eq!(
        version_of(dataset(&v, "outputs", "delta", "events")),
        None,
        "unknown events version"
    );
    dataset(&v, "inputs", "aether://model", MODEL);
    let ledger = &v["run"]["facets"]["aether_ledger"];
    assert_eq!(
        ledger["snapshot_id"], "snap-0007",
        "from the payload when metadata has none"
    );
    assert_eq!(
        ledger["trace_id"], "0af7651916cd43dd8448eb211c80319c",
        "from traceparent"
    );
    // Events outside clearing have no parent unless they name one.
    for t in [
        "EngineActivated",
        "PolicyIngested",
        "SnapshotCommitted",
        "CheckpointSigned",
    ] {
        assert_eq!(parent_of(day.first(t)), None, "{t}");
    }
}

/// A scoring batch's run is its netting's run (same id, parent, ledger facet), with every
/// decision named in the `aether_clearing_batch` facet, their model as an input, and both
/// Delta tables as outputs at the versions the context names.
#[test]
fn a_scoring_batch_maps_to_its_nettings_run_naming_each_decision() {
    let day = Day::new();
    let netting = day.first("NettingComputed");
    let decision = day.first("ClearingDecided");
    let ctx = MappingContext {
        clearing_decisions_version: Some(12),
        delta_version: Some(40),
        ..ctx()
    };
    let run = serde_json::to_value(batch_run_event(netting, &[decision], &ctx).expect("maps"))
        .expect("serializes");
    Spec::get()
        .check(&run)
        .expect("valid against the spec and both custom facets");
    let alone = json_of(netting, &ctx);
    assert_eq!(run["run"]["runId"], alone["run"]["runId"]);
    assert_eq!(
        run["run"]["facets"]["parent"],
        alone["run"]["facets"]["parent"]
    );
    assert_eq!(
        run["run"]["facets"]["aether_ledger"],
        alone["run"]["facets"]["aether_ledger"]
    );
    assert_eq!(run["job"]["name"], "clearing.batch");
    let batch = &run["run"]["facets"]["aether_clearing_batch"];
    assert_eq!(batch["batch_id"], "batch-7781");
    assert_eq!(
        batch["_schemaURL"],
        format!("{BASE}/openlineage/facets/aether_clearing_batch/1-0-0.json")
    );
    assert_eq!(
        batch["decisions"],
        json!([{
            "seq": decision.seq,
            "hash": hex_of(&decision.hash),
            "stream_id": "clearing/member-dbs",
            "stream_version": decision.stream_version,
            "event_id": decision.event_id.to_string(),
            "request_id": "req-20261130-000042",
            "snapshot_id": "snap-0007",
            "trace_id": "0af7651916cd43dd8448eb211c80319c",
        }])
    );
    dataset(&run, "inputs", "aether://model", MODEL);
    assert_eq!(
        version_of(dataset(&run, "outputs", "delta", "clearing_decisions")),
        Some("12")
    );
    assert_eq!(
        version_of(dataset(&run, "outputs", "delta", "events")),
        Some("40")
    );
    // A netting whose decisions all failed is a batch of none: no decisions table output.
    let empty = serde_json::to_value(batch_run_event(netting, &[], &ctx).expect("maps"))
        .expect("serializes");
    assert_eq!(
        empty["run"]["facets"]["aether_clearing_batch"]["decisions"],
        json!([])
    );
    assert!(
        empty["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["name"] != "clearing_decisions")
    );
}

#[test]
fn datasets_carry_digests_as_versions() {
    let day = Day::new();
    let v = json_of(day.first("ModelRegistered"), &ctx());
    let model = dataset(&v, "outputs", "aether://model", MODEL);
    assert_eq!(version_of(model), Some(digest("model v3").as_str()));
    let artifact = dataset(
        &v,
        "inputs",
        "s3://aether-models",
        "finmoe-7b-v3/model.safetensors",
    );
    assert_eq!(version_of(artifact), Some(digest("model v3").as_str()));
    let ledger = &v["run"]["facets"]["aether_ledger"];
    assert_eq!(ledger["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert!(ledger.get("snapshot_id").is_none());

    for (event, name) in day
        .all("PolicyIngested")
        .into_iter()
        .zip(["aml_v2", "basel3_delta"])
    {
        let v = json_of(event, &ctx());
        assert_eq!(
            version_of(dataset(&v, "outputs", "aether://policy", name)),
            Some(digest(name).as_str())
        );
    }
    let v = json_of(day.first("PolicyIngestRejected"), &ctx());
    assert_eq!(
        version_of(dataset(&v, "outputs", "aether://policy", "aml_v3")),
        None
    );
    assert!(
        v["run"]["facets"]["errorMessage"]["message"]
            .as_str()
            .unwrap()
            .contains("undeclared reference")
    );

    // A snapshot pins its participants' versions; a rollback reads the snapshot it went
    // back to and writes the participants it restored, at their digests.
    let v = json_of(day.first("SnapshotCommitted"), &ctx());
    assert_eq!(
        version_of(dataset(&v, "outputs", "aether://snapshot", "snapshots")),
        Some("snap-0007")
    );
    for (name, of) in [
        ("gateway-routing", "routes"),
        ("rule-engine", "rules"),
        ("rag-index", "mas-notices 2026-11"),
    ] {
        assert_eq!(
            version_of(dataset(&v, "inputs", "aether://snapshot", name)),
            Some(digest(of).as_str())
        );
    }
    let v = json_of(day.first("RolledBack"), &ctx());
    assert_eq!(
        version_of(dataset(&v, "inputs", "aether://snapshot", "snapshots")),
        Some("snap-0007")
    );
    assert_eq!(
        version_of(dataset(&v, "outputs", "aether://snapshot", "rule-engine")),
        Some(digest("rules").as_str())
    );
    assert!(
        v["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["name"] != "rag-index"),
        "a participant the rollback did not restore is not written: {v}"
    );

    let v = json_of(day.first("CorpusIngested"), &ctx());
    let corpus = dataset(&v, "outputs", "aether://corpus", "mas-notices");
    assert_eq!(
        version_of(corpus),
        Some(digest("mas-notices 2026-11").as_str())
    );

    // The activation's steps name the model and policy versions they verified and bound.
    let v = json_of(day.first("EngineModelVerified"), &ctx());
    assert_eq!(
        version_of(dataset(&v, "inputs", "aether://model", MODEL)),
        Some(digest("model v3").as_str())
    );
    let v = json_of(day.first("EnginePoliciesBound"), &ctx());
    for name in ["aml_v2", "basel3_delta"] {
        assert_eq!(
            version_of(dataset(&v, "inputs", "aether://policy", name)),
            Some(digest(name).as_str())
        );
    }
    let v = json_of(day.first("EngineActivated"), &ctx());
    assert_eq!(
        v["inputs"].as_array().unwrap().len(),
        3,
        "model and two policies"
    );
    assert_eq!(
        v["run"]["facets"]["aether_ledger"]["snapshot_id"],
        "snap-0007"
    );
    let v = json_of(day.first("EngineActivationRequested"), &ctx());
    assert_eq!(
        version_of(dataset(&v, "inputs", "aether://policy", "aml_v2")),
        None
    );
    assert_eq!(
        v["inputs"].as_array().unwrap().len(),
        3,
        "model and two policies"
    );
}

#[test]
fn unknown_event_types_map_to_the_generic_job() {
    let mut chain = Chain::default();
    let event = chain.append(
        "worker/cpu-3",
        "WorkerDrained",
        json!({ "worker": "cpu-3", "reason": "scale-in" }),
        json!({ "correlation_id": "op-9" }),
    );
    let v = json_of(&event, &ctx());
    Spec::get().check(&v).unwrap();
    assert_eq!(v["job"]["name"], "ledger.event");
    assert_eq!(v["eventType"], "COMPLETE");
    assert_eq!(
        v["run"]["runId"],
        run_id("ledger.event", &event.event_id.to_string()).to_string()
    );
    assert_eq!(
        v["run"]["facets"]["aether_ledger"]["event_type"],
        "WorkerDrained"
    );
    assert_eq!(
        v["outputs"].as_array().unwrap().len(),
        1,
        "its row in the events table"
    );
}

#[test]
fn a_bad_schema_base_url_is_refused() {
    let day = Day::new();
    for base in [
        "",
        "not a url",
        "ftp://aether.bank.test/schemas",
        "https://aether.bank.test/?v=1",
    ] {
        let err = to_run_event(day.first("AuditQueried"), &MappingContext::new(base)).unwrap_err();
        assert!(
            matches!(err, LineageError::SchemaBaseUrl { .. }),
            "{base:?}: {err}"
        );
    }
    // A trailing slash does not double the separator.
    let v = json_of(
        day.first("AuditQueried"),
        &MappingContext::new(format!("{BASE}/")),
    );
    assert_eq!(
        v["run"]["facets"]["aether_ledger"]["_schemaURL"],
        format!("{BASE}/openlineage/facets/aether_ledger/1-0-0.json")
    );
}

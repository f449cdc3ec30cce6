//! [`to_run_event`]: one ledger event as one OpenLineage 2-0-2 run event; [`batch_run_event`]:
//! one scoring batch (its `NettingComputed` event and the `ClearingDecided` events appended
//! with it) as one, the netting's run with each decision in the `aether_clearing_batch`
//! facet (see `lineage/DELTA.md`, "What a lineage consumer sees of clearing").
//!
//! # The record
//!
//! - `eventType`, `job.name`: from the event type ([`crate::job`]); jobs in namespace
//!   `aether`, each with a `jobType` facet (BATCH, integration AETHER, type LEDGER_EVENT).
//! - `eventTime`: `recorded_at`, as the ledger hashes it (RFC 3339, UTC, microseconds).
//! - `producer`: [`PRODUCER`]; every facet's `_producer` is the same.
//! - `schemaURL`: the 2-0-2 `RunEvent` definition.
//! - `run.facets.aether_ledger`: seq, hashes, stream, event id and type, snapshot id and trace
//!   id ([`crate::ledger_facet`]); `errorMessage` on FAIL and ABORT (payload `reason`, `error`
//!   or `message`); `parent` as below.
//!
//! # Run ids
//!
//! `runId = UUIDv5(RUN_ID_NAMESPACE, "{job}\n{operation}")` ([`run_id`]), where the operation
//! is the event's own id, except for an engine activation, whose START, RUNNING steps and
//! COMPLETE or FAIL are one run: there the operation is the metadata `correlation_id`, else
//! (for the later events) the metadata `causation_id`, else the event id. The control plane
//! writes no correlation id on `EngineActivationRequested` and the request's event id as the
//! `correlation_id` of every later event, so all of them land on the run of the request's id;
//! the `causation_id` fallback covers an outcome written straight after its request by a
//! writer that sets causation only. Ids that parse as UUIDs are taken in their lowercase hyphenated form, so the
//! spelling does not matter.
//!
//! Why UUIDv5 and not the event's own UUIDv7: a run is an operation, not an event. Two events
//! (requested, activated) must give one run id, and a child must compute its parent's run id
//! from what it carries (a correlation or event id) without reading the ledger; a name-based
//! UUID does both, deterministically, on any machine. Putting the job in the name keeps runs of
//! different jobs apart when a correlation id spans a whole workflow. Other events never share
//! a run, even when they share a correlation id: each is a finished operation with its own
//! terminal event, and OpenLineage allows one terminal event per run. The price is that run
//! ids are not time-ordered; `eventTime` and the facet's `seq` give the order.
//!
//! # Parents
//!
//! - `RolloutStepped`, `RolloutPaused`, `RolloutPromoted`: the rollout's run, that is the run of
//!   its `RolloutStarted` event (`rollout.step`, operation = that event's id), named by payload
//!   `rollout_event_id`, else metadata `causation_id`.
//! - `RolledBack`: the same, when the payload names `rollout_event_id` (a rollback to a
//!   snapshot outside any rollout has no parent).
//! - `RetrainStarted`, `RetrainFinished`, `RetrainFailed` (one `model.retrain` run, operation
//!   = metadata `correlation_id`, the request's event id) and `HandoffDelivered`,
//!   `HandoffFailed`: the `rollout.analysis` run of the request (`RetrainRequested`,
//!   `ReviewTicketOpened`, …) named by metadata `causation_id`.
//! - `ClearingDecided`, `NettingComputed`: the engine activation they ran under
//!   (`engine.activate`, operation = metadata `causation_id`, which names the activation as
//!   its run id is derived: its correlation id, or its `EngineActivationRequested` event id).
//!
//! # Datasets
//!
//! | dataset | namespace / name | `version` facet |
//! |---|---|---|
//! | policy | `aether://policy` / name | `digest` or `policy_digest` |
//! | model | `aether://model` / ref (e.g. `finmoe-7b-v3@sgp-region`) | `model_digest` (engine and registration events: or `digest`) |
//! | corpus | `aether://corpus` / name | `corpus_version` or `digest` |
//! | snapshots | `aether://snapshot` / `snapshots` | the snapshot id |
//! | snapshot participants | `aether://snapshot` / `gateway-routing`, `rule-engine`, `rag-index` | the participant's digest |
//! | ledger events | `delta` / `events` | [`MappingContext::delta_version`] |
//! | clearing decisions | `delta` / `clearing_decisions` | [`MappingContext::clearing_decisions_version`] |
//! | model artifact | from its URI, by OpenLineage's naming rules | the model's `digest` |
//!
//! Every event is an output to `delta/events` (each event is a row there). Besides:
//! engine events read the model (`model_ref`) and policies (`policy_hooks` or `hooks`: names
//! or `{name, digest}` objects); `ModelRegistered` reads its artifact (`uri` or
//! `artifact_uri`) and
//! writes the model (`model_ref`, else the stream `model/{ref}`); `PolicyIngested` writes the
//! policy (`name`, else the stream `policy/{name}`), `PolicyIngestRejected` names the policy
//! it tried without a version; `CorpusIngested` writes the corpus (`name`, else the stream
//! `corpus/{name}`); rollout events read their `baseline` and `candidate` models;
//! `ClearingDecided` reads its model and writes `delta/clearing_decisions`; `NettingComputed`
//! reads its model;
//! `SnapshotCommitted` reads the three participants it pins (`aether://snapshot` /
//! `gateway-routing`, `rule-engine`, `rag-index`, each versioned by its digest) and writes
//! `aether://snapshot` / `snapshots` (versioned by the snapshot id); `RolledBack` reads the
//! snapshot it restored (`target_snapshot`) and writes the participants at the digests it
//! restored, so a rollback is drawn with what it went back to. A payload field
//! that is missing or not a string (numbers are taken as their text) leaves its dataset or
//! version out; it never fails the mapping.

use aether_ledger::RecordedEvent;
use aether_ledger::hashing::format_timestamp;
use chrono::Datelike;
use openlineage_client::event::RUN_EVENT_SCHEMA_URL;
use openlineage_client::facets::{
    BaseFacet, DatasetFacets, ErrorMessageRunFacet, JobFacets, JobTypeJobFacet, ParentJob,
    ParentRun, ParentRunFacet, RunFacets,
};
use openlineage_client::{Dataset, DatasetName, Job, Run, RunEvent, RunEventType};
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::decisions::{CLEARING_DECIDED, NETTING_COMPUTED};
use crate::error::LineageError;
use crate::job::{
    CLEARING_BATCH, Change, ENGINE_ACTIVATE, INTEGRATION, JOB_NAMESPACE, JOB_TYPE, MODEL_RETRAIN,
    PROCESSING_TYPE, ROLLOUT_ANALYSIS, ROLLOUT_STEP,
};
use crate::ledger_facet::{
    AETHER_CLEARING_BATCH_FACET, AETHER_LEDGER_FACET, AetherClearingBatchRunFacet,
    AetherLedgerRunFacet, BatchDecision,
};

/// `producer` of every run event and `_producer` of every facet: names Aether's lineage
/// mapping. A fixed identifier (the `.example` domain never resolves), so that the same
/// event maps to the same bytes in every release; what changes between releases is
/// versioned in the facets' schema URLs.
pub const PRODUCER: &str = "https://aether.example/lineage";

/// Namespace of the name-based (v5) run ids; fixed forever, as run ids must not change.
pub const RUN_ID_NAMESPACE: Uuid = Uuid::from_u128(0x9020958a_140d_427c_84e8_55bd609f2ce4);

/// Namespace of the Delta tables.
pub const DELTA_NAMESPACE: &str = "delta";
/// The Delta table with one row per ledger event.
pub const EVENTS_TABLE: &str = "events";
/// The Delta table with one row per clearing decision.
pub const CLEARING_DECISIONS_TABLE: &str = "clearing_decisions";
/// Namespace of policy datasets (`aether://policy/{name}`).
pub const POLICY_NAMESPACE: &str = "aether://policy";
/// Namespace of model datasets (`aether://model/{ref}`).
pub const MODEL_NAMESPACE: &str = "aether://model";
/// Namespace of corpus datasets (`aether://corpus/{name}`).
pub const CORPUS_NAMESPACE: &str = "aether://corpus";
/// Namespace of the consistent snapshots and of the three participants they pin.
pub const SNAPSHOT_NAMESPACE: &str = "aether://snapshot";
/// The snapshots, one version per committed snapshot (its id).
pub const SNAPSHOTS: &str = "snapshots";
/// The participants of a snapshot: dataset name and the payload member holding its digest.
const PARTICIPANTS: [(&str, &str); 3] = [
    ("gateway-routing", "gateway_digest"),
    ("rule-engine", "rules_digest"),
    ("rag-index", "rag_digest"),
];

/// Standard facets used, as paths under `https://openlineage.io/spec/facets/`.
const PARENT_FACET: &str = "1-2-0/ParentRunFacet.json#/$defs/ParentRunFacet";
const ERROR_MESSAGE_FACET: &str = "1-0-1/ErrorMessageRunFacet.json#/$defs/ErrorMessageRunFacet";
const JOB_TYPE_FACET: &str = "2-0-4/JobTypeJobFacet.json#/$defs/JobTypeJobFacet";
const DATASET_VERSION_FACET: &str =
    "1-0-1/DatasetVersionDatasetFacet.json#/$defs/DatasetVersionDatasetFacet";

/// What the mapping needs besides the event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappingContext {
    /// Absolute http(s) URL under which Aether serves its facet schemas; the `aether_ledger`
    /// facet's `_schemaURL` is `{schema_base_url}/openlineage/facets/aether_ledger/1-0-0.json`.
    pub schema_base_url: String,
    /// Version of the Delta `events` table whose commit holds this event's row, when known.
    pub delta_version: Option<i64>,
    /// Version of the Delta `clearing_decisions` table whose commit holds this decision's
    /// row, when known (used by `ClearingDecided` only).
    pub clearing_decisions_version: Option<i64>,
}

impl MappingContext {
    /// A context with no Delta versions known.
    pub fn new(schema_base_url: impl Into<String>) -> Self {
        MappingContext {
            schema_base_url: schema_base_url.into(),
            delta_version: None,
            clearing_decisions_version: None,
        }
    }

    /// The same context with the Delta `events` table version known.
    pub fn with_delta_version(mut self, version: i64) -> Self {
        self.delta_version = Some(version);
        self
    }
}

/// The run id of `operation` of `job`: `UUIDv5(RUN_ID_NAMESPACE, "{job}\n{operation}")`.
///
/// For an event's own run the operation is its event id (lowercase, hyphenated), or for an
/// engine activation its correlation id; see the module documentation.
pub fn run_id(job: &str, operation: &str) -> Uuid {
    let mut name = Vec::with_capacity(job.len() + 1 + operation.len());
    name.extend_from_slice(job.as_bytes());
    name.push(b'\n');
    name.extend_from_slice(operation.as_bytes());
    Uuid::new_v5(&RUN_ID_NAMESPACE, &name)
}

/// The OpenLineage run event of one ledger event. Pure and deterministic; any payload and
/// metadata objects map (fields the mapping reads are optional).
pub fn to_run_event(event: &RecordedEvent, ctx: &MappingContext) -> Result<RunEvent, LineageError> {
    to_run_event_under(event, ctx, &schema_base_url(&ctx.schema_base_url)?)
}

/// [`to_run_event`] under a schema base URL already checked by [`schema_base_url`]: the
/// relay checks it once per page rather than parsing the same URL for every event.
pub(crate) fn to_run_event_under(
    event: &RecordedEvent,
    ctx: &MappingContext,
    schema_base_url: &str,
) -> Result<RunEvent, LineageError> {
    let event_id = event.event_id;
    let year = event.recorded_at.year();
    if !(0..=9999).contains(&year) {
        return Err(LineageError::EventTime {
            event_id,
            recorded_at: event.recorded_at.to_string(),
        });
    }
    let payload =
        object(event.payload.get()).map_err(|source| LineageError::Payload { event_id, source })?;
    let metadata = object(event.metadata.get())
        .map_err(|source| LineageError::Metadata { event_id, source })?;
    let change = Change::of(&event.event_type);

    let run_id = run_id(change.job, &operation(event, change, &metadata));
    let ledger = AetherLedgerRunFacet::new(
        event,
        PRODUCER,
        schema_base_url,
        text_at(&metadata, "snapshot_id").or_else(|| text_at(&payload, "snapshot_id")),
        text_at(&metadata, "trace_id").or_else(|| traceparent_trace_id(&metadata)),
    );
    let ledger = serde_json::to_value(ledger).map_err(|source| LineageError::Facet {
        facet: AETHER_LEDGER_FACET,
        source,
    })?;
    let run_facets = RunFacets {
        parent: parent(event, change, &payload, &metadata)
            .filter(|p| p.run.run_id != run_id.to_string()),
        error_message: matches!(change.state, RunEventType::Fail | RunEventType::Abort)
            .then(|| error_message(event, &payload)),
        extra: Map::from_iter([(AETHER_LEDGER_FACET.to_owned(), ledger)]),
        ..RunFacets::default()
    };
    let (inputs, outputs) = datasets(event, &payload, ctx);
    Ok(RunEvent {
        event_type: change.state,
        event_time: format_timestamp(&event.recorded_at),
        run: Run {
            run_id,
            facets: run_facets,
        },
        job: Job {
            namespace: JOB_NAMESPACE.to_owned(),
            name: change.job.to_owned(),
            facets: JobFacets {
                job_type: Some(JobTypeJobFacet {
                    base: BaseFacet::new(PRODUCER, JOB_TYPE_FACET),
                    processing_type: PROCESSING_TYPE.to_owned(),
                    integration: INTEGRATION.to_owned(),
                    job_type: JOB_TYPE.to_owned(),
                }),
                ..JobFacets::default()
            },
        },
        inputs,
        outputs,
        producer: PRODUCER.to_owned(),
        schema_url: RUN_EVENT_SCHEMA_URL.to_owned(),
    })
}

/// The scoring batch an event belongs to: the payload `batch_id` of a `NettingComputed` or
/// `ClearingDecided` event; `None` for any other event or one that names no batch.
pub(crate) fn batch_of(event: &RecordedEvent) -> Option<String> {
    if event.event_type != NETTING_COMPUTED && event.event_type != CLEARING_DECIDED {
        return None;
    }
    let json = event.payload.get();
    // The ledger stores payloads as canonical JSON (members sorted by name), where a batch
    // event's `batch_id` comes first: read it there rather than scan the whole payload (a
    // decision's is ~1.5 KB, and the relay groups every page it reads). An escape in it,
    // or any other layout, takes the full parse.
    if let Some(rest) = json.strip_prefix(r#"{"batch_id":""#)
        && let Some((id, _)) = rest.split_once('"')
        && !id.is_empty()
        && !id.contains('\\')
    {
        return Some(id.to_owned());
    }
    text_at(&object(json).ok()?, "batch_id")
}

/// The OpenLineage run event of a scoring batch: its `NettingComputed` event and the
/// `ClearingDecided` events appended with it (the seqs right after it, with its `batch_id`;
/// a netting that names no batch id is a batch of none, with an empty id).
///
/// One `clearing.batch` run, as the netting alone would map (its run id, parent, `aether_ledger`
/// facet and the model it ran), plus: each decision in the [`AETHER_CLEARING_BATCH_FACET`]
/// facet, the models the decisions name as inputs, and `delta/clearing_decisions` as an
/// output. The context's Delta versions are those of the tables' first versions holding
/// every row of the batch (the commits covering its last seq).
pub fn batch_run_event(
    netting: &RecordedEvent,
    decisions: &[&RecordedEvent],
    ctx: &MappingContext,
) -> Result<RunEvent, LineageError> {
    batch_run_event_under(
        netting,
        decisions,
        ctx,
        &schema_base_url(&ctx.schema_base_url)?,
    )
}

/// [`batch_run_event`] under a checked schema base URL.
pub(crate) fn batch_run_event_under(
    netting: &RecordedEvent,
    decisions: &[&RecordedEvent],
    ctx: &MappingContext,
    schema_base_url: &str,
) -> Result<RunEvent, LineageError> {
    let mut run_event = to_run_event_under(netting, ctx, schema_base_url)?;
    let batch_id = batch_of(netting).unwrap_or_default();
    let mut batch =
        AetherClearingBatchRunFacet::new(PRODUCER, schema_base_url, batch_id, decisions.len());
    // Each model once, by name and version: a batch runs one model, but a decision the
    // fallback took names the fallback's.
    let version = |d: &Dataset| d.facets.extra.get("version").cloned();
    for &decision in decisions {
        let event_id = decision.event_id;
        let payload = object(decision.payload.get())
            .map_err(|source| LineageError::Payload { event_id, source })?;
        let metadata = object(decision.metadata.get())
            .map_err(|source| LineageError::Metadata { event_id, source })?;
        if let Some(model) = model_at(&payload, "model_ref", &["model_digest"]) {
            let known = run_event
                .inputs
                .iter()
                .any(|d| d.name == model.name && version(d) == version(&model));
            if !known {
                run_event.inputs.push(model);
            }
        }
        batch.decisions.push(BatchDecision {
            seq: decision.seq,
            hash: decision.hash,
            stream_id: decision.stream_id.clone(),
            stream_version: decision.stream_version,
            event_id,
            request_id: text_at(&payload, "request_id")
                .or_else(|| text_at(&metadata, "request_id")),
            snapshot_id: text_at(&metadata, "snapshot_id")
                .or_else(|| text_at(&payload, "snapshot_id")),
            trace_id: text_at(&metadata, "trace_id").or_else(|| traceparent_trace_id(&metadata)),
        });
    }
    if !decisions.is_empty() {
        // Before `delta/events`, as on a decision's own run.
        let at = run_event.outputs.len().saturating_sub(1);
        run_event.outputs.insert(
            at,
            dataset(
                DELTA_NAMESPACE,
                CLEARING_DECISIONS_TABLE.to_owned(),
                ctx.clearing_decisions_version.map(|v| v.to_string()),
            ),
        );
    }
    let batch = serde_json::to_value(batch).map_err(|source| LineageError::Facet {
        facet: AETHER_CLEARING_BATCH_FACET,
        source,
    })?;
    run_event
        .run
        .facets
        .extra
        .insert(AETHER_CLEARING_BATCH_FACET.to_owned(), batch);
    Ok(run_event)
}

/// The base URL checked (absolute http(s), a host, no query or fragment) and normalized
/// (as `url` writes it, no trailing `/`), so that the schema URL built on it is a valid URI.
pub(crate) fn schema_base_url(url: &str) -> Result<String, LineageError> {
    let refuse = |reason: String| LineageError::SchemaBaseUrl {
        url: url.to_owned(),
        reason,
    };
    let parsed = url::Url::parse(url).map_err(|e| refuse(format!("is not a URL: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(refuse("must be an http or https URL".to_owned()));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(refuse("has no host".to_owned()));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(refuse("must not have a query or fragment".to_owned()));
    }
    Ok(parsed.as_str().trim_end_matches('/').to_owned())
}

/// Top-level payload and metadata members the mapping reads. Only these are parsed: a
/// clearing decision's payload is mostly members lineage does not name (its trade, rules,
/// clauses), and parsing them all into a `Value` tree was a third of the mapping's cost.
/// Every read goes through [`member`], which checks (in debug builds, so in the tests)
/// that its key is listed here.
const READ_MEMBERS: &[&str] = &[
    "artifact_uri",
    "baseline",
    "batch_id",
    "candidate",
    "causation_id",
    "corpus",
    "corpus_version",
    "correlation_id",
    "digest",
    "error",
    "gateway_digest",
    "hooks",
    "id",
    "message",
    "model_digest",
    "model_ref",
    "name",
    "policy_digest",
    "policy_hooks",
    "rag_digest",
    "reason",
    "ref",
    "request_id",
    "restored",
    "rollout_event_id",
    "rules_digest",
    "snapshot_id",
    "target_snapshot",
    "trace_id",
    "traceparent",
    "uri",
];

/// The [`READ_MEMBERS`] of a payload or metadata object's JSON text; anything but an object
/// (the ledger stores objects only) reads as empty. Invalid JSON is an error.
fn object(json: &str) -> Result<Map<String, Value>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(json);
    let kept = serde::de::DeserializeSeed::deserialize(ReadMembers, &mut de)?;
    de.end()?;
    Ok(kept)
}

/// Deserializes an object keeping only [`READ_MEMBERS`]; other members are skipped
/// unparsed ([`serde::de::IgnoredAny`]).
struct ReadMembers;

impl<'de> serde::de::DeserializeSeed<'de> for ReadMembers {
    type Value = Map<String, Value>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for ReadMembers {
    type Value = Map<String, Value>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kept = Map::new();
        while let Some(key) = map.next_key::<MemberName<'de>>()? {
            if READ_MEMBERS.contains(&key.0.as_ref()) {
                kept.insert(key.0.into_owned(), map.next_value()?);
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(kept)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(Map::new())
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Map::new())
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Map::new())
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Map::new())
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Map::new())
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Map::new())
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Map::new())
    }
}

/// A member name, borrowed from the JSON text unless it has escapes.
struct MemberName<'de>(std::borrow::Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for MemberName<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Name;
        impl<'de> serde::de::Visitor<'de> for Name {
            type Value = MemberName<'de>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a member name")
            }

            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
                Ok(MemberName(std::borrow::Cow::Borrowed(s)))
            }

            fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
                Ok(MemberName(std::borrow::Cow::Owned(s.to_owned())))
            }
        }
        d.deserialize_str(Name)
    }
}

/// `object[key]`, for a key in [`READ_MEMBERS`] (an unlisted key would never be found in a
/// payload or metadata object, so the tests catch one).
fn member<'v>(object: &'v Map<String, Value>, key: &str) -> Option<&'v Value> {
    debug_assert!(
        READ_MEMBERS.contains(&key),
        "{key:?} is read by the mapping but not listed in READ_MEMBERS"
    );
    object.get(key)
}

/// The operation whose run this event reports (see "Run ids" above).
fn operation(event: &RecordedEvent, change: Change, metadata: &Map<String, Value>) -> String {
    if change.job == MODEL_RETRAIN {
        // Started and finished are one run: the retrain request's.
        if let Some(request) = id_at(metadata, "correlation_id") {
            return request;
        }
    }
    if change.job == ENGINE_ACTIVATE {
        let shared = id_at(metadata, "correlation_id").or_else(|| {
            (change.state != RunEventType::Start)
                .then(|| id_at(metadata, "causation_id"))
                .flatten()
        });
        if let Some(operation) = shared {
            return operation;
        }
    }
    event.event_id.to_string()
}

/// The run this event's run belongs to (see "Parents" above).
fn parent(
    event: &RecordedEvent,
    change: Change,
    payload: &Map<String, Value>,
    metadata: &Map<String, Value>,
) -> Option<ParentRunFacet> {
    let (job, operation) = match event.event_type.as_str() {
        "RolloutStepped" | "RolloutPaused" | "RolloutResumed" | "RolloutPromoted"
        | "RolloutAborted" | "RolloutWeightSet" | "RolloutFallbackSet" | "ReviewTicketClosed" => (
            ROLLOUT_STEP,
            id_at(payload, "rollout_event_id").or_else(|| id_at(metadata, "causation_id"))?,
        ),
        "RolledBack" => (ROLLOUT_STEP, id_at(payload, "rollout_event_id")?),
        _ if change.job == CLEARING_BATCH => (ENGINE_ACTIVATE, id_at(metadata, "causation_id")?),
        // A retraining run and a webhook delivery belong to the analysis event that asked
        // for them (its run's operation is its own event id).
        _ if change.job == MODEL_RETRAIN || change.job == crate::job::DRIFT_HANDOFF => {
            (ROLLOUT_ANALYSIS, id_at(metadata, "causation_id")?)
        }
        _ => return None,
    };
    Some(ParentRunFacet {
        base: BaseFacet::new(PRODUCER, PARENT_FACET),
        run: ParentRun {
            run_id: run_id(job, &operation).to_string(),
        },
        job: ParentJob {
            namespace: JOB_NAMESPACE.to_owned(),
            name: job.to_owned(),
        },
        root: None,
    })
}

fn error_message(event: &RecordedEvent, payload: &Map<String, Value>) -> ErrorMessageRunFacet {
    ErrorMessageRunFacet {
        base: BaseFacet::new(PRODUCER, ERROR_MESSAGE_FACET),
        message: first_text(payload, &["reason", "error", "message"])
            .unwrap_or_else(|| format!("{} recorded no reason", event.event_type)),
        programming_language: "RUST".to_owned(),
        stack_trace: None,
    }
}

/// Inputs and outputs (see "Datasets" above).
fn datasets(
    event: &RecordedEvent,
    payload: &Map<String, Value>,
    ctx: &MappingContext,
) -> (Vec<Dataset>, Vec<Dataset>) {
    let mut inputs = Vec::new();
    let mut outputs = Vec::new();
    let stream = event.stream_id.as_str();
    match event.event_type.as_str() {
        "EngineActivationRequested"
        | "EngineModelVerified"
        | "EnginePoliciesBound"
        | "CircuitBreakerRegistered"
        | "EngineActivated"
        | "EngineActivationFailed"
        | "EngineDeactivated" => {
            inputs.extend(model_at(payload, "model_ref", &["model_digest", "digest"]));
            for key in ["policy_hooks", "hooks"] {
                if let Some(Value::Array(hooks)) = member(payload, key) {
                    inputs.extend(hooks.iter().filter_map(policy));
                }
            }
        }
        "ModelRegistered" => {
            let digest = first_text(payload, &["digest", "model_digest"]);
            inputs.extend(artifact(payload, digest.clone()));
            let reference = first_text(payload, &["model_ref", "ref"])
                .or_else(|| stream_suffix(stream, "model/"));
            outputs.extend(reference.map(|r| dataset(MODEL_NAMESPACE, r, digest)));
        }
        "PolicyIngested" => {
            let name = text_at(payload, "name").or_else(|| stream_suffix(stream, "policy/"));
            let digest = first_text(payload, &["digest", "policy_digest"]);
            outputs.extend(name.map(|n| dataset(POLICY_NAMESPACE, n, digest)));
        }
        "PolicyIngestRejected" => {
            outputs.extend(text_at(payload, "name").map(|n| dataset(POLICY_NAMESPACE, n, None)));
        }
        "CorpusIngested" => {
            let name = first_text(payload, &["name", "corpus"])
                .or_else(|| stream_suffix(stream, "corpus/"));
            let version = first_text(payload, &["corpus_version", "digest"]);
            outputs.extend(name.map(|n| dataset(CORPUS_NAMESPACE, n, version)));
        }
        "RolloutStarted" | "RolloutStepped" | "RolloutPaused" | "RolloutResumed"
        | "RolloutPromoted" | "RolloutAborted" | "RolloutWeightSet" | "RolloutFallbackSet" => {
            inputs.extend(model_at(payload, "baseline", &[]));
            inputs.extend(model_at(payload, "candidate", &[]));
        }
        "SnapshotCommitted" => {
            inputs.extend(participants(payload));
            let id = first_text(payload, &["id", "snapshot_id"]);
            outputs.push(dataset(SNAPSHOT_NAMESPACE, SNAPSHOTS.to_owned(), id));
        }
        "RolledBack" => {
            let target = first_text(payload, &["target_snapshot", "snapshot_id"]);
            inputs.push(dataset(SNAPSHOT_NAMESPACE, SNAPSHOTS.to_owned(), target));
            if let Some(Value::Object(restored)) = member(payload, "restored") {
                outputs.extend(participants(restored));
            }
        }
        "NettingComputed" => {
            inputs.extend(model_at(payload, "model_ref", &["model_digest"]));
        }
        "ClearingDecided" => {
            inputs.extend(model_at(payload, "model_ref", &["model_digest"]));
            outputs.push(dataset(
                DELTA_NAMESPACE,
                CLEARING_DECISIONS_TABLE.to_owned(),
                ctx.clearing_decisions_version.map(|v| v.to_string()),
            ));
        }
        _ => {}
    }
    outputs.push(dataset(
        DELTA_NAMESPACE,
        EVENTS_TABLE.to_owned(),
        ctx.delta_version.map(|v| v.to_string()),
    ));
    (inputs, outputs)
}

/// A dataset, with a `version` facet when its version is known.
fn dataset(namespace: &str, name: String, version: Option<String>) -> Dataset {
    let mut facets = DatasetFacets::default();
    if let Some(version) = version {
        let base = BaseFacet::new(PRODUCER, DATASET_VERSION_FACET);
        facets.extra.insert(
            "version".to_owned(),
            serde_json::json!({
                "_producer": base.producer,
                "_schemaURL": base.schema_url,
                "datasetVersion": version,
            }),
        );
    }
    Dataset {
        namespace: namespace.to_owned(),
        name,
        facets,
        input_facets: None,
        output_facets: None,
    }
}

/// The model named by `payload[key]`: a ref, versioned by the first of the payload's
/// `digest_keys` present, or an object `{model_ref | ref, model_digest | digest}`.
fn model_at(payload: &Map<String, Value>, key: &str, digest_keys: &[&str]) -> Option<Dataset> {
    match member(payload, key)? {
        Value::Object(model) => {
            let reference = first_text(model, &["model_ref", "ref"])?;
            let digest = first_text(model, &["model_digest", "digest"]);
            Some(dataset(MODEL_NAMESPACE, reference, digest))
        }
        value => {
            let digest = first_text(payload, digest_keys);
            Some(dataset(MODEL_NAMESPACE, text(value)?, digest))
        }
    }
}

/// The snapshot participants whose digests `members` names, each versioned by its digest.
fn participants(members: &Map<String, Value>) -> impl Iterator<Item = Dataset> + '_ {
    PARTICIPANTS.iter().filter_map(|(name, key)| {
        text_at(members, key).map(|d| dataset(SNAPSHOT_NAMESPACE, (*name).to_owned(), Some(d)))
    })
}

/// A policy hook: a policy name, or an object `{name, digest | policy_digest}`.
fn policy(hook: &Value) -> Option<Dataset> {
    match hook {
        Value::Object(hook) => Some(dataset(
            POLICY_NAMESPACE,
            text_at(hook, "name")?,
            first_text(hook, &["digest", "policy_digest"]),
        )),
        name => Some(dataset(POLICY_NAMESPACE, text(name)?, None)),
    }
}

/// The artifact a model was registered from, named by OpenLineage's naming rules for its URI.
fn artifact(payload: &Map<String, Value>, digest: Option<String>) -> Option<Dataset> {
    let uri = url::Url::parse(&first_text(payload, &["uri", "artifact_uri"])?).ok()?;
    let name = DatasetName::from_location(&uri);
    (!name.name.is_empty()).then(|| dataset(&name.namespace, name.name, digest))
}

/// `{rest}` of a stream id `{prefix}{rest}`.
fn stream_suffix(stream_id: &str, prefix: &str) -> Option<String> {
    stream_id
        .strip_prefix(prefix)
        .filter(|rest| !rest.is_empty())
        .map(str::to_owned)
}

/// A non-empty string as it is, a number as its JSON text; nothing for other values.
fn text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn text_at(object: &Map<String, Value>, key: &str) -> Option<String> {
    member(object, key).and_then(text)
}

fn first_text(object: &Map<String, Value>, keys: &[&str]) -> Option<String> {
    keys.iter().find_map(|key| text_at(object, key))
}

/// An id at `key`: UUIDs in lowercase hyphenated form (however written), other ids as given.
fn id_at(object: &Map<String, Value>, key: &str) -> Option<String> {
    let id = text_at(object, key)?;
    Some(Uuid::parse_str(&id).map_or(id, |uuid| uuid.to_string()))
}

/// The trace id of a W3C `traceparent` in the metadata (`00-{trace id}-{span id}-{flags}`).
fn traceparent_trace_id(metadata: &Map<String, Value>) -> Option<String> {
    let traceparent = member(metadata, "traceparent")?.as_str()?;
    let trace_id = traceparent.split('-').nth(1)?;
    let valid = trace_id.len() == 32
        && trace_id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        && trace_id.bytes().any(|b| b != b'0');
    valid.then(|| trace_id.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_base_url_is_checked_and_normalized() {
        assert_eq!(
            schema_base_url("https://Aether.Bank.test/lineage/").unwrap(),
            "https://aether.bank.test/lineage"
        );
        assert_eq!(
            schema_base_url("http://localhost:8080").unwrap(),
            "http://localhost:8080"
        );
        for bad in [
            "",
            "aether.example",
            "ftp://x/y",
            "https://x/?a=1",
            "https://x/#f",
            "file:///tmp",
        ] {
            assert!(schema_base_url(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn only_the_members_the_mapping_reads_are_parsed() {
        let json = r#"{"cited_clauses":[{"clause":"4.2","text":"x"}],"model_ref":"m@r","n":1.5,"name":"p\u00e9","policy_hooks":[{"digest":"d","name":"h"}],"trade":{"buyer":"a","model_ref":"inner"},"w\"x":true}"#;
        let full: Map<String, Value> = serde_json::from_str(json).unwrap();
        let kept = object(json).unwrap();
        let expected: Map<String, Value> = full
            .into_iter()
            .filter(|(k, _)| READ_MEMBERS.contains(&k.as_str()))
            .collect();
        assert_eq!(kept, expected);
        assert_eq!(kept.len(), 3);
        for not_an_object in ["[1,{\"model_ref\":\"x\"}]", "\"s\"", "7", "true", "null"] {
            assert_eq!(
                object(not_an_object).unwrap(),
                Map::new(),
                "{not_an_object}"
            );
        }
        for invalid in ["{\"model_ref\":", "{} {}", "{\"trade\":[1,}"] {
            assert!(object(invalid).is_err(), "{invalid}");
        }
    }

    #[test]
    fn run_ids_separate_job_and_operation() {
        let a = run_id("engine.activate", "x");
        assert_eq!(a, run_id("engine.activate", "x"));
        assert_ne!(a, run_id("engine.deactivate", "x"));
        assert_ne!(a, run_id("engine.activate", "y"));
        assert_eq!(a.get_version_num(), 5);
    }

    #[test]
    fn ids_are_normalized_when_they_are_uuids() {
        let upper = serde_json::json!({"correlation_id": "0191A2B3-C4D5-7E6F-8091-A2B3C4D5E6F7", "causation_id": "req-42", "rollout_event_id": 7});
        let map = upper.as_object().unwrap();
        assert_eq!(
            id_at(map, "correlation_id").unwrap(),
            "0191a2b3-c4d5-7e6f-8091-a2b3c4d5e6f7"
        );
        assert_eq!(id_at(map, "causation_id").unwrap(), "req-42");
        assert_eq!(id_at(map, "rollout_event_id").unwrap(), "7");
        assert_eq!(id_at(map, "snapshot_id"), None);
    }

    #[test]
    fn traceparent_gives_its_trace_id() {
        let meta = serde_json::json!({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"});
        assert_eq!(
            traceparent_trace_id(meta.as_object().unwrap()).unwrap(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "garbage",
            "00-XYZ-1-1",
        ] {
            let meta = serde_json::json!({ "traceparent": bad });
            assert_eq!(
                traceparent_trace_id(meta.as_object().unwrap()),
                None,
                "{bad}"
            );
        }
    }
}

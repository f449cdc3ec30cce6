//! Validation of OpenLineage events from outside Aether (`POST /api/v1/lineage`) against
//! the OpenLineage 2-0-2 spec and the standard facet schemas, offline.
//!
//! The spec files are vendored in `schemas/openlineage/` (copies of the OpenLineage 2-0-2
//! spec and its facets, every one embedded, checked by a test) and embedded in the binary, so
//! validation needs no network and no files at run time. An event is checked against the
//! definition of its kind (a `RunEvent` when it has `run`, else a `DatasetEvent` when it has
//! `dataset`, else a `JobEvent`), whose errors name the member at fault, then against the
//! spec's root. Each facet whose `_schemaURL` names a vendored schema is checked against it;
//! a custom facet (any other `_schemaURL`) only has to be a valid base facet, as the spec
//! allows.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use jsonschema::{Registry, Validator};
use serde_json::{Value, json};

/// Largest integer magnitude JSON numbers carry exactly (IEEE-754 doubles).
const MAX_SAFE_INTEGER: f64 = 9_007_199_254_740_991.0;

/// What an event holds that cannot be stored and read back unchanged: U+0000 in any text
/// (PostgreSQL's JSON refuses it) and numbers past ±(2^53 − 1) (they would come back
/// rounded), each named by its JSON pointer.
fn unstorable(value: &Value, at: &mut String, violations: &mut Vec<String>) {
    let here = |at: &str| {
        if at.is_empty() {
            "/".to_owned()
        } else {
            at.to_owned()
        }
    };
    match value {
        Value::String(text) if text.contains('\0') => {
            violations.push(format!(
                "at {}: text contains U+0000, which cannot be stored",
                here(at)
            ));
        }
        Value::Number(n) => {
            let exact = n
                .as_u64()
                .map(|u| u as f64)
                .or_else(|| n.as_i64().map(|i| i as f64));
            let magnitude = exact.or_else(|| n.as_f64()).unwrap_or(0.0).abs();
            if magnitude > MAX_SAFE_INTEGER {
                violations.push(format!(
                    "at {}: number {n} cannot be stored exactly (|n| > 2^53 - 1); send it as a string",
                    here(at)
                ));
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let len = at.len();
                at.push_str(&format!("/{i}"));
                unstorable(item, at, violations);
                at.truncate(len);
            }
        }
        Value::Object(map) => {
            for (key, item) in map {
                let len = at.len();
                at.push('/');
                at.push_str(
                    &key.replace('~', "~0")
                        .replace('/', "~1")
                        .replace('\0', "\\u0000"),
                );
                if key.contains('\0') {
                    violations.push(format!(
                        "at {at}: a member name contains U+0000, which cannot be stored"
                    ));
                } else {
                    unstorable(item, at, violations);
                }
                at.truncate(len);
            }
        }
        _ => {}
    }
}

/// `$id` of the OpenLineage spec the events are checked against.
pub const OPENLINEAGE_SPEC_ID: &str = "https://openlineage.io/spec/2-0-2/OpenLineage.json";

/// The vendored spec: the root document, then every standard facet schema.
const SPEC: &str = include_str!("../schemas/openlineage/OpenLineage.json");
const FACETS: &[&str] = &[
    include_str!("../schemas/openlineage/facets/BaseSubsetDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/CatalogDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/ColumnLineageDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/DataQualityAssertionsDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/DataQualityMetricsDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/DataQualityMetricsInputDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/DatasetTypeDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/DatasetVersionDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/DatasourceDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/DocumentationDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/DocumentationJobFacet.json"),
    include_str!("../schemas/openlineage/facets/EnvironmentVariablesRunFacet.json"),
    include_str!("../schemas/openlineage/facets/ErrorMessageRunFacet.json"),
    include_str!("../schemas/openlineage/facets/ExecutionParametersRunFacet.json"),
    include_str!("../schemas/openlineage/facets/ExternalQueryRunFacet.json"),
    include_str!("../schemas/openlineage/facets/ExtractionErrorRunFacet.json"),
    include_str!("../schemas/openlineage/facets/HierarchyDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/InputStatisticsInputDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/JobDependenciesRunFacet.json"),
    include_str!("../schemas/openlineage/facets/JobTypeJobFacet.json"),
    include_str!("../schemas/openlineage/facets/LifecycleStateChangeDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/LineageFacet.json"),
    include_str!("../schemas/openlineage/facets/NominalTimeRunFacet.json"),
    include_str!("../schemas/openlineage/facets/OutputStatisticsOutputDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/OwnershipDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/OwnershipJobFacet.json"),
    include_str!("../schemas/openlineage/facets/ParentRunFacet.json"),
    include_str!("../schemas/openlineage/facets/ProcessingEngineRunFacet.json"),
    include_str!("../schemas/openlineage/facets/SQLJobFacet.json"),
    include_str!("../schemas/openlineage/facets/SchemaDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/SourceCodeJobFacet.json"),
    include_str!("../schemas/openlineage/facets/SourceCodeLocationJobFacet.json"),
    include_str!("../schemas/openlineage/facets/StorageDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/SymlinksDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/TagsDatasetFacet.json"),
    include_str!("../schemas/openlineage/facets/TagsJobFacet.json"),
    include_str!("../schemas/openlineage/facets/TagsRunFacet.json"),
    include_str!("../schemas/openlineage/facets/TestRunFacet.json"),
];

/// Validators kept per schema URL; beyond this many, validators are built per call.
const MAX_CACHED_VALIDATORS: usize = 256;
/// Schema errors reported per event (the rest are counted).
const MAX_ERRORS: usize = 10;

/// Which of the three OpenLineage event kinds an event is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Run,
    Dataset,
    Job,
}

impl EventKind {
    /// The kind an event claims by its members (see the module documentation).
    pub fn of(event: &Value) -> EventKind {
        if event.get("run").is_some() {
            EventKind::Run
        } else if event.get("dataset").is_some() {
            EventKind::Dataset
        } else if event.get("job").is_some() {
            EventKind::Job
        } else {
            // Most producers send run events; its errors say what is missing.
            EventKind::Run
        }
    }

    fn definition(self) -> &'static str {
        match self {
            EventKind::Run => "RunEvent",
            EventKind::Dataset => "DatasetEvent",
            EventKind::Job => "JobEvent",
        }
    }
}

/// Why an event is not valid OpenLineage: each violation with the JSON pointer of the
/// member at fault and the schema it broke.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", .violations.join("; "))]
pub struct SchemaViolation {
    pub violations: Vec<String>,
}

/// The vendored OpenLineage schemas as an offline registry, with validators cached by URL.
pub struct OpenLineageSchemas {
    registry: Registry<'static>,
    /// `$id` of every vendored document, to tell standard facets from custom ones.
    documents: HashSet<String>,
    validators: Mutex<HashMap<String, Arc<Validator>>>,
}

impl std::fmt::Debug for OpenLineageSchemas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OpenLineageSchemas({} documents)", self.documents.len())
    }
}

impl OpenLineageSchemas {
    /// The process-wide registry, built once from the embedded files.
    ///
    /// # Panics
    /// Never on input: only if the embedded spec files were not a valid registry, which
    /// the crate's tests rule out.
    pub fn get() -> &'static OpenLineageSchemas {
        static SCHEMAS: OnceLock<OpenLineageSchemas> = OnceLock::new();
        SCHEMAS.get_or_init(|| {
            OpenLineageSchemas::with_documents([])
                .expect("the embedded OpenLineage spec files are valid")
        })
    }

    /// The embedded spec files and `extra` schema documents (each with an `$id`), e.g. a
    /// custom facet's schema, as one offline registry.
    pub fn with_documents(
        extra: impl IntoIterator<Item = Value>,
    ) -> Result<OpenLineageSchemas, String> {
        let mut docs = Vec::with_capacity(FACETS.len() + 1);
        for text in std::iter::once(SPEC).chain(FACETS.iter().copied()) {
            docs.push(serde_json::from_str::<Value>(text).map_err(|e| e.to_string())?);
        }
        let mut pairs = Vec::with_capacity(docs.len());
        for doc in docs.into_iter().chain(extra) {
            let id = doc["$id"]
                .as_str()
                .ok_or("a spec document has no $id")?
                .to_owned();
            pairs.push((id, doc));
        }
        let documents = pairs.iter().map(|(id, _)| id.clone()).collect();
        let registry = Registry::new()
            .extend(pairs)
            .map_err(|e| e.to_string())?
            .prepare()
            .map_err(|e| e.to_string())?;
        Ok(OpenLineageSchemas {
            registry,
            documents,
            validators: Mutex::new(HashMap::new()),
        })
    }

    fn validator(&'static self, url: &str) -> Result<Arc<Validator>, String> {
        let mut cache = self.validators.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = cache.get(url) {
            return Ok(v.clone());
        }
        let validator = jsonschema::options()
            .offline()
            .should_validate_formats(true)
            .with_registry(&self.registry)
            .build(&json!({ "$ref": url }))
            .map(Arc::new)
            .map_err(|e| format!("schema {url} cannot be used: {e}"))?;
        if cache.len() < MAX_CACHED_VALIDATORS {
            cache.insert(url.to_owned(), validator.clone());
        }
        Ok(validator)
    }

    /// Appends to `out` each way `instance` breaks the schema at `url` (with fragment),
    /// prefixed with `at`.
    pub fn check(&'static self, url: &str, instance: &Value, at: &str, out: &mut Vec<String>) {
        match self.validator(url) {
            Ok(v) => out.extend(
                v.iter_errors(instance)
                    .map(|e| format!("{at}{}: {e} (schema {url})", e.instance_path())),
            ),
            Err(e) => out.push(format!("{at}: {e}")),
        }
    }

    /// Checks one event; on success, says which kind it is.
    pub fn validate(&'static self, event: &Value) -> Result<EventKind, SchemaViolation> {
        let kind = EventKind::of(event);
        let mut violations = Vec::new();
        unstorable(event, &mut String::new(), &mut violations);
        if !violations.is_empty() {
            violations.truncate(MAX_ERRORS);
            return Err(SchemaViolation { violations });
        }
        let own = format!("{OPENLINEAGE_SPEC_ID}#/$defs/{}", kind.definition());
        self.check(&own, event, "", &mut violations);
        if violations.is_empty() {
            self.check(OPENLINEAGE_SPEC_ID, event, "", &mut violations);
        }
        if violations.is_empty() {
            for (at, facet) in facets(event) {
                let Some(url) = facet.get("_schemaURL").and_then(Value::as_str) else {
                    continue;
                };
                let document = url.split('#').next().unwrap_or_default();
                if self.documents.contains(document) {
                    self.check(url, facet, &at, &mut violations);
                }
            }
        }
        if violations.is_empty() {
            return Ok(kind);
        }
        let more = violations.len().saturating_sub(MAX_ERRORS);
        violations.truncate(MAX_ERRORS);
        if more > 0 {
            violations.push(format!("... and {more} more"));
        }
        Err(SchemaViolation { violations })
    }
}

/// Every facet of an event, with the JSON pointer of where it sits.
fn facets(event: &Value) -> Vec<(String, &Value)> {
    let mut bags: Vec<(String, &Value)> = vec![
        ("/run/facets".into(), &event["run"]["facets"]),
        ("/job/facets".into(), &event["job"]["facets"]),
        ("/dataset/facets".into(), &event["dataset"]["facets"]),
    ];
    for side in ["inputs", "outputs"] {
        for (i, dataset) in event[side].as_array().into_iter().flatten().enumerate() {
            for bag in ["facets", "inputFacets", "outputFacets"] {
                bags.push((format!("/{side}/{i}/{bag}"), &dataset[bag]));
            }
        }
    }
    let mut out = Vec::new();
    for (at, bag) in bags {
        if let Some(bag) = bag.as_object() {
            out.extend(bag.iter().map(|(name, f)| (format!("{at}/{name}"), f)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_event() -> Value {
        json!({
            "eventType": "COMPLETE",
            "eventTime": "2026-12-01T10:00:00.000Z",
            "producer": "https://example.com/feature-pipeline",
            "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
            "run": { "runId": "0192f0c4-7a35-7b8e-9c1d-2e3f4a5b6c7d" },
            "job": { "namespace": "features", "name": "build_trade_features" },
            "inputs": [],
            "outputs": [{
                "namespace": "s3://features", "name": "trades",
                "facets": { "version": {
                    "_producer": "https://example.com/feature-pipeline",
                    "_schemaURL": "https://openlineage.io/spec/facets/1-0-1/DatasetVersionDatasetFacet.json#/$defs/DatasetVersionDatasetFacet",
                    "datasetVersion": "7"
                }}
            }]
        })
    }

    #[test]
    fn a_valid_run_event_passes() {
        assert_eq!(
            OpenLineageSchemas::get().validate(&run_event()),
            Ok(EventKind::Run)
        );
    }

    #[test]
    fn errors_name_the_member_and_the_schema() {
        let mut e = run_event();
        e["eventType"] = json!("BEGIN");
        let err = OpenLineageSchemas::get().validate(&e).unwrap_err();
        assert!(err.to_string().contains("/eventType"), "{err}");
        let mut e = run_event();
        e["run"]["runId"] = json!("not-a-uuid");
        let err = OpenLineageSchemas::get().validate(&e).unwrap_err();
        assert!(err.to_string().contains("/run/runId"), "{err}");
        let mut e = run_event();
        e.as_object_mut().unwrap().remove("eventTime");
        let err = OpenLineageSchemas::get().validate(&e).unwrap_err();
        assert!(err.to_string().contains("eventTime"), "{err}");
    }

    #[test]
    fn standard_facets_are_checked_and_custom_ones_only_as_base_facets() {
        let mut e = run_event();
        e["outputs"][0]["facets"]["version"]
            .as_object_mut()
            .unwrap()
            .remove("datasetVersion");
        let err = OpenLineageSchemas::get().validate(&e).unwrap_err();
        assert!(
            err.to_string().contains("/outputs/0/facets/version"),
            "{err}"
        );
        let mut e = run_event();
        e["run"]["facets"] = json!({ "mine": {
            "_producer": "https://example.com/p", "_schemaURL": "https://example.com/mine.json", "x": 1
        }});
        assert_eq!(OpenLineageSchemas::get().validate(&e), Ok(EventKind::Run));
        e["run"]["facets"]["mine"]
            .as_object_mut()
            .unwrap()
            .remove("_producer");
        assert!(OpenLineageSchemas::get().validate(&e).is_err());
    }

    #[test]
    fn dataset_and_job_events_are_recognised() {
        let dataset = json!({
            "eventTime": "2026-12-01T10:00:00Z",
            "producer": "https://example.com/p",
            "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/DatasetEvent",
            "dataset": { "namespace": "s3://features", "name": "trades" }
        });
        assert_eq!(
            OpenLineageSchemas::get().validate(&dataset),
            Ok(EventKind::Dataset)
        );
        assert!(OpenLineageSchemas::get().validate(&json!([])).is_err());
        assert!(OpenLineageSchemas::get().validate(&json!({})).is_err());
    }

    /// Text and numbers a database would change are refused with their JSON pointer, before
    /// any schema check: U+0000 anywhere, numbers past ±(2^53 − 1) in any form.
    #[test]
    fn unstorable_values_are_named_by_their_pointer() {
        let event: Value = serde_json::from_str(
            r#"{"job": {"namespace": "ml", "name": "a\u0000b"},
                "run": {"facets": {"x/y": {"n": 18446744073709551616, "m": [1, 1e16, 9007199254740991]}}}}"#,
        )
        .unwrap();
        let violations = OpenLineageSchemas::get()
            .validate(&event)
            .unwrap_err()
            .violations;
        assert_eq!(violations.len(), 3, "{violations:?}");
        assert!(
            violations[0].starts_with("at /job/name: text contains U+0000"),
            "{violations:?}"
        );
        assert!(
            violations
                .iter()
                .any(|v| v.starts_with("at /run/facets/x~1y/n: number")),
            "{violations:?}"
        );
        assert!(
            violations
                .iter()
                .any(|v| v.starts_with("at /run/facets/x~1y/m/1: number ")),
            "{violations:?}"
        );
    }

    /// Every vendored facet file is embedded: a file added to `schemas/openlineage/facets`
    /// without a line in `FACETS` would be silently left out of validation.
    #[test]
    fn every_vendored_facet_file_is_embedded() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas/openlineage/facets");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
            .collect();
        let mut embedded: Vec<String> = FACETS.iter().map(|s| s.to_string()).collect();
        files.sort();
        embedded.sort();
        assert_eq!(files, embedded);
    }
}

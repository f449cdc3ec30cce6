//! Test support: the OpenLineage spec files as an offline JSON-schema registry, and a
//! small hash-chained ledger to draw realistic events from.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use std::time::Duration;

use aether_ledger::hashing::{GENESIS_PREV_HASH, HashedFields, canonical_json, event_hash};
use aether_ledger::{EventStore, RecordedEvent};
use aether_lineage::MappingContext;
use aether_lineage::relay::{DeltaVersions, reconcile, run_openlineage_relay_with};
use aether_lineage::schema::OpenLineageSchemas;
use aether_lineage::{
    AETHER_CLEARING_BATCH_FACET_SCHEMA, AETHER_LEDGER_FACET_SCHEMA,
    aether_clearing_batch_facet_schema, aether_ledger_facet_schema,
};
use chrono::{DateTime, TimeZone, Utc};
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use uuid::Uuid;

/// The schema base URL the tests map with.
pub const BASE: &str = "https://aether.bank.test/lineage-schemas";

/// The root of the OpenLineage spec and its `$id`.
pub const OPENLINEAGE_ID: &str = "https://openlineage.io/spec/2-0-2/OpenLineage.json";

/// The OpenLineage spec files vendored in the repository (`lineage/schemas/openlineage`):
/// no test reads outside the repository, so a clone anywhere passes on its own.
pub fn spec_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schemas/openlineage");
    assert!(
        dir.join("OpenLineage.json").is_file(),
        "the vendored OpenLineage spec is missing: expected {}/OpenLineage.json",
        dir.display()
    );
    dir
}

/// The OpenLineage spec (as the crate embeds it from the vendored files)
/// and the custom facet's schema, resolved offline.
pub struct Spec {
    schemas: OpenLineageSchemas,
}

/// What a check validated an event against.
#[derive(Debug, Default)]
pub struct Checked {
    /// Every schema URL used, the event's own and each facet's `_schemaURL`.
    pub schemas: Vec<String>,
}

impl Checked {
    pub fn used(&self, fragment: &str) -> bool {
        self.schemas.iter().any(|s| s.contains(fragment))
    }
}

impl Spec {
    pub fn get() -> &'static Spec {
        static SPEC: OnceLock<Spec> = OnceLock::new();
        SPEC.get_or_init(|| {
            assert!(spec_dir().join("OpenLineage.json").is_file());
            // The custom facets as served under the tests' base, and as stored in the crate.
            let schemas = OpenLineageSchemas::with_documents([
                aether_ledger_facet_schema(BASE),
                serde_json::from_str(AETHER_LEDGER_FACET_SCHEMA).expect("stored schema"),
                aether_clearing_batch_facet_schema(BASE),
                serde_json::from_str(AETHER_CLEARING_BATCH_FACET_SCHEMA).expect("stored schema"),
            ])
            .expect("the spec files form a registry");
            Spec { schemas }
        })
    }

    pub fn validate(&'static self, url: &str, instance: &Value, at: &str) -> Result<(), String> {
        let mut errors = Vec::new();
        self.schemas.check(url, instance, at, &mut errors);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!("invalid against {url}:\n  {}", errors.join("\n  ")))
        }
    }

    /// Validates a run event against the OpenLineage spec (its root and its own `schemaURL`)
    /// and every facet in it against the schema its `_schemaURL` names.
    pub fn check(&'static self, event: &Value) -> Result<Checked, String> {
        let mut checked = Checked::default();
        // The event's own definition first: its errors name the member at fault, where the
        // root's `oneOf` only says that no branch matched.
        let own = event["schemaURL"]
            .as_str()
            .ok_or("the event has no schemaURL")?;
        self.validate(own, event, "")?;
        checked.schemas.push(own.to_owned());
        self.validate(OPENLINEAGE_ID, event, "")?;
        checked.schemas.push(OPENLINEAGE_ID.to_owned());

        let mut bags: Vec<(String, &Value)> = vec![
            ("/run/facets".into(), &event["run"]["facets"]),
            ("/job/facets".into(), &event["job"]["facets"]),
        ];
        for side in ["inputs", "outputs"] {
            for (i, dataset) in event[side].as_array().into_iter().flatten().enumerate() {
                for bag in ["facets", "inputFacets", "outputFacets"] {
                    bags.push((format!("/{side}/{i}/{bag}"), &dataset[bag]));
                }
            }
        }
        for (at, bag) in bags {
            let Some(facets) = bag.as_object() else {
                continue;
            };
            for (name, facet) in facets {
                let at = format!("{at}/{name}");
                let url = facet["_schemaURL"]
                    .as_str()
                    .ok_or_else(|| format!("{at} has no _schemaURL"))?;
                self.validate(url, facet, &at)?;
                checked.schemas.push(url.to_owned());
            }
        }
        Ok(checked)
    }
}

/// A ledger in memory: seqs, stream versions, times and hashes as the real one assigns them.
pub struct Chain {
    pub events: Vec<RecordedEvent>,
    streams: HashMap<String, u64>,
    start: DateTime<Utc>,
}

impl Default for Chain {
    fn default() -> Self {
        Chain {
            events: Vec::new(),
            streams: HashMap::new(),
            start: Utc.with_ymd_and_hms(2026, 11, 30, 9, 0, 0).unwrap(),
        }
    }
}

impl Chain {
    /// Appends an event with a deterministic UUIDv7 id.
    pub fn append(
        &mut self,
        stream_id: &str,
        event_type: &str,
        payload: Value,
        metadata: Value,
    ) -> RecordedEvent {
        let seq = self.events.len() as u64 + 1;
        let recorded_at = self.start + chrono::Duration::microseconds(1_250_017 * seq as i64);
        let mut random = [0u8; 10];
        random[2..].copy_from_slice(&seq.to_be_bytes());
        let event_id = uuid::Builder::from_unix_timestamp_millis(
            recorded_at.timestamp_millis() as u64,
            &random,
        )
        .into_uuid();
        self.append_with_id(
            stream_id,
            event_type,
            event_id,
            recorded_at,
            payload,
            metadata,
        )
    }

    pub fn append_with_id(
        &mut self,
        stream_id: &str,
        event_type: &str,
        event_id: Uuid,
        recorded_at: DateTime<Utc>,
        payload: Value,
        metadata: Value,
    ) -> RecordedEvent {
        let seq = self.events.len() as u64 + 1;
        let version = self.streams.entry(stream_id.to_owned()).or_default();
        *version += 1;
        let payload = canonical_json(&payload).expect("canonical payload");
        let metadata = canonical_json(&metadata).expect("canonical metadata");
        let prev_hash = self.events.last().map_or(GENESIS_PREV_HASH, |e| e.hash);
        let hash = event_hash(
            &prev_hash,
            &HashedFields {
                seq,
                stream_id,
                stream_version: *version,
                event_id,
                event_type,
                schema_version: 1,
                payload: &payload,
                metadata: &metadata,
                recorded_at,
            },
        );
        let event = RecordedEvent {
            seq,
            stream_id: stream_id.to_owned(),
            stream_version: *version,
            event_id,
            event_type: event_type.to_owned(),
            schema_version: 1,
            payload: RawValue::from_string(payload).expect("raw payload"),
            metadata: RawValue::from_string(metadata).expect("raw metadata"),
            recorded_at,
            prev_hash,
            hash,
        };
        assert_eq!(event.computed_hash(), event.hash);
        self.events.push(event.clone());
        event
    }
}

/// An SM3-sized digest in hex, distinct per label (test data, not a real digest).
pub fn digest(label: &str) -> String {
    hex_of(&aether_ledger::hashing::sm3(label.as_bytes()))
}

pub fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh data directory under the system temp dir, removed when dropped.
pub struct TempData(pub PathBuf);

impl TempData {
    pub fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock after 1970")
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "aether-lineage-{name}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempData(dir)
    }

    /// Where the `events` Delta table of this data directory lives.
    pub fn events_table(&self) -> PathBuf {
        self.0.join("delta").join("events")
    }
}

impl Drop for TempData {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A SQLite ledger file in `dir`.
pub async fn open_sqlite_ledger(dir: &std::path::Path) -> aether_ledger::EventStore {
    let url = format!("sqlite:{}", dir.join("ledger.db").display());
    aether_ledger::EventStore::connect(&url, aether_ledger::StoreConfig::default())
        .await
        .expect("open the ledger")
}

/// Appends `n` small `PolicyIngested` events numbered from `from`, over three streams.
pub async fn append_policies(store: &aether_ledger::EventStore, from: u64, n: u64) {
    for i in from..from + n {
        store
            .append(
                &format!("policy/p{}", i % 3),
                aether_ledger::ExpectedVersion::Any,
                vec![aether_ledger::NewEvent::new(
                    "PolicyIngested",
                    json!({ "n": i }),
                )],
            )
            .await
            .expect("append");
    }
}

/// Polls `done` every 20 ms for up to 30 s.
pub async fn wait_until<F, Fut>(what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A running relay task and its stop switch.
pub struct Running {
    pub stop: watch::Sender<bool>,
    pub task: JoinHandle<Result<(), aether_lineage::relay::RelayError>>,
}

impl Running {
    pub async fn stop(self) {
        self.stop.send(true).expect("relay running");
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the relay stops promptly")
            .expect("relay task")
            .expect("relay result");
    }
}

pub fn start_openlineage(store: &EventStore) -> Running {
    let (stop, rx) = watch::channel(false);
    // No Delta sink here: records without Delta versions.
    let task = tokio::spawn(run_openlineage_relay_with(
        store.clone(),
        MappingContext::new(BASE),
        None,
        DeltaVersions::None,
        rx,
    ));
    Running { stop, task }
}

/// Writes the OpenLineage record of every event up to the head, as `aether serve` does.
pub async fn write_records(store: &EventStore) {
    let relay = start_openlineage(store);
    wait_until("every event has its OpenLineage record", || async {
        reconcile(store)
            .await
            .expect("reconcile")
            .missing_openlineage
            .is_empty()
    })
    .await;
    relay.stop().await;
}

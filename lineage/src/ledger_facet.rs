//! The custom `aether_ledger` run facet: where a run's event sits in the ledger.
//!
//! Its JSON schema ([`AETHER_LEDGER_FACET_SCHEMA`]) is part of this crate and Aether serves
//! it at [`aether_ledger_schema_url`]`(base)`, the facet's `_schemaURL`. A published version
//! never changes; a changed facet gets a new version (and a new schema file).

use aether_ledger::hashing::hex_hash;
use aether_ledger::{Hash, RecordedEvent};
use openlineage_client::facets::BaseFacet;
use serde::{Deserialize, Serialize};

/// Key of the facet in a run's facets.
pub const AETHER_LEDGER_FACET: &str = "aether_ledger";

/// Version of the facet's schema, in OpenLineage's `MAJOR-MINOR-PATCH` form.
pub const AETHER_LEDGER_FACET_VERSION: &str = "1-0-0";

/// The facet's JSON schema (draft 2020-12), as written in `schemas/aether_ledger-1-0-0.json`.
///
/// Its `$id` uses [`SCHEMA_ID_BASE_URL`]; serve [`aether_ledger_facet_schema`] instead, whose
/// `$id` is the URL it is served at.
pub const AETHER_LEDGER_FACET_SCHEMA: &str = include_str!("../schemas/aether_ledger-1-0-0.json");

/// The base URL in the `$id` of [`AETHER_LEDGER_FACET_SCHEMA`] as stored.
pub const SCHEMA_ID_BASE_URL: &str = "https://aether.example";

/// Key of the scoring-batch facet in a `clearing.batch` run's facets.
pub const AETHER_CLEARING_BATCH_FACET: &str = "aether_clearing_batch";

/// Version of the scoring-batch facet's schema.
pub const AETHER_CLEARING_BATCH_FACET_VERSION: &str = "1-0-0";

/// The scoring-batch facet's JSON schema, as written in
/// `schemas/aether_clearing_batch-1-0-0.json` (its `$id` uses [`SCHEMA_ID_BASE_URL`]).
pub const AETHER_CLEARING_BATCH_FACET_SCHEMA: &str =
    include_str!("../schemas/aether_clearing_batch-1-0-0.json");

/// `{base}/openlineage/facets/{facet}/{version}.json`: a custom facet's `_schemaURL` when
/// Aether serves its schemas under `base` (a trailing `/` on `base` is ignored).
fn facet_schema_url(base: &str, facet: &str, version: &str) -> String {
    format!(
        "{}/openlineage/facets/{facet}/{version}.json",
        base.trim_end_matches('/')
    )
}

/// `{base}/openlineage/facets/aether_ledger/1-0-0.json`: the facet's `_schemaURL` when Aether
/// serves its schemas under `base` (a trailing `/` on `base` is ignored).
pub fn aether_ledger_schema_url(base: &str) -> String {
    facet_schema_url(base, AETHER_LEDGER_FACET, AETHER_LEDGER_FACET_VERSION)
}

/// `{base}/openlineage/facets/aether_clearing_batch/1-0-0.json`.
pub fn aether_clearing_batch_schema_url(base: &str) -> String {
    facet_schema_url(
        base,
        AETHER_CLEARING_BATCH_FACET,
        AETHER_CLEARING_BATCH_FACET_VERSION,
    )
}

/// A stored schema document with its `$id` set to `url`, so that a validator resolves it at
/// the URL the facets name.
fn served(stored: &str, url: String) -> serde_json::Value {
    let mut schema: serde_json::Value = serde_json::from_str(stored)
        .expect("the facet schemas shipped in this crate are JSON (checked by the tests)");
    schema["$id"] = serde_json::Value::String(url);
    schema
}

/// The facet's schema document as served under `base`: [`AETHER_LEDGER_FACET_SCHEMA`] with
/// its `$id` set to [`aether_ledger_schema_url`]`(base)`.
pub fn aether_ledger_facet_schema(base: &str) -> serde_json::Value {
    served(AETHER_LEDGER_FACET_SCHEMA, aether_ledger_schema_url(base))
}

/// The scoring-batch facet's schema document as served under `base`.
pub fn aether_clearing_batch_facet_schema(base: &str) -> serde_json::Value {
    served(
        AETHER_CLEARING_BATCH_FACET_SCHEMA,
        aether_clearing_batch_schema_url(base),
    )
}

/// Where a run's ledger event sits in Aether's hash-chained ledger.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AetherLedgerRunFacet {
    #[serde(flatten)]
    pub base: BaseFacet,
    /// Global position, gapless, from 1.
    pub seq: u64,
    /// The event's SM3 hash (lowercase hex in JSON).
    #[serde(with = "hex_hash")]
    pub hash: Hash,
    /// The previous event's hash (lowercase hex in JSON).
    #[serde(with = "hex_hash")]
    pub prev_hash: Hash,
    pub stream_id: String,
    pub stream_version: u64,
    pub event_id: uuid::Uuid,
    pub event_type: String,
    pub schema_version: u32,
    /// The consistent snapshot the event was made under, when it names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// The trace the event was recorded under, when it carries one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

impl AetherLedgerRunFacet {
    /// The facet of `event`, produced by `producer`, whose schema Aether serves under
    /// `schema_base_url`.
    pub fn new(
        event: &RecordedEvent,
        producer: &str,
        schema_base_url: &str,
        snapshot_id: Option<String>,
        trace_id: Option<String>,
    ) -> Self {
        AetherLedgerRunFacet {
            base: BaseFacet {
                producer: producer.to_owned(),
                schema_url: aether_ledger_schema_url(schema_base_url),
            },
            seq: event.seq,
            hash: event.hash,
            prev_hash: event.prev_hash,
            stream_id: event.stream_id.clone(),
            stream_version: event.stream_version,
            event_id: event.event_id,
            event_type: event.event_type.clone(),
            schema_version: event.schema_version,
            snapshot_id,
            trace_id,
        }
    }
}

/// The decisions of one scoring batch, on the batch's `clearing.batch` run: the batch is one
/// run (its `NettingComputed` event is the `aether_ledger` facet), and this names each
/// decision recorded with it, so that every decision is in the lineage exactly.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AetherClearingBatchRunFacet {
    #[serde(flatten)]
    pub base: BaseFacet,
    /// The scoring batch's id (the `batch_id` of its netting and of each decision).
    pub batch_id: String,
    /// The decisions, in ledger order. They follow the netting event without a gap, so each
    /// one's `prev_hash` is the `hash` before it (the netting's, for the first).
    pub decisions: Vec<BatchDecision>,
}

/// Where one decision of a batch sits in the ledger.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BatchDecision {
    pub seq: u64,
    /// The `ClearingDecided` event's SM3 hash (lowercase hex in JSON).
    #[serde(with = "hex_hash")]
    pub hash: Hash,
    pub stream_id: String,
    pub stream_version: u64,
    pub event_id: uuid::Uuid,
    /// The member's request id, when the decision names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

impl AetherClearingBatchRunFacet {
    /// An empty facet for `batch_id`, whose schema Aether serves under `schema_base_url`.
    pub fn new(producer: &str, schema_base_url: &str, batch_id: String, capacity: usize) -> Self {
        AetherClearingBatchRunFacet {
            base: BaseFacet {
                producer: producer.to_owned(),
                schema_url: aether_clearing_batch_schema_url(schema_base_url),
            },
            batch_id,
            decisions: Vec::with_capacity(capacity),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_schema_id_is_the_url_form_at_the_stored_base() {
        let stored: serde_json::Value = serde_json::from_str(AETHER_LEDGER_FACET_SCHEMA).unwrap();
        assert_eq!(
            stored["$id"],
            serde_json::json!(aether_ledger_schema_url(SCHEMA_ID_BASE_URL))
        );
        let served = aether_ledger_facet_schema("https://ledger.bank.test/aether/");
        assert_eq!(
            served["$id"],
            "https://ledger.bank.test/aether/openlineage/facets/aether_ledger/1-0-0.json"
        );
        assert_eq!(served["$defs"], stored["$defs"]);
        let stored: serde_json::Value =
            serde_json::from_str(AETHER_CLEARING_BATCH_FACET_SCHEMA).unwrap();
        assert_eq!(
            stored["$id"],
            serde_json::json!(aether_clearing_batch_schema_url(SCHEMA_ID_BASE_URL))
        );
        let served = aether_clearing_batch_facet_schema("https://ledger.bank.test/aether");
        assert_eq!(
            served["$id"],
            "https://ledger.bank.test/aether/openlineage/facets/aether_clearing_batch/1-0-0.json"
        );
        assert_eq!(served["$defs"], stored["$defs"]);
    }
}

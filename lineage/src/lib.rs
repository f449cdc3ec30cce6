//! Aether's lineage: every ledger event as an OpenLineage run event and as a row of a Delta
//! Lake table version, both linked back to the ledger by seq.
//!
//! The mapping is pure: no I/O, no clock, no randomness. The same
//! [`RecordedEvent`](aether_ledger::RecordedEvent) and [`MappingContext`] always give the
//! same [`RunEvent`](openlineage_client::RunEvent), so the relay that follows the ledger
//! can map an event again after a crash and emit an identical record (at-least-once
//! delivery, idempotent by run id and event id).
//!
//! - [`job`]: one OpenLineage job per kind of change (`engine.activate`, `policy.ingest`,
//!   `rollout.step`, ...), the run state each event type reports, and the generic
//!   `ledger.event` job for event types the mapping does not know.
//! - [`run_event`]: [`to_run_event`], run ids, datasets, `version` and `parent` facets.
//! - [`relay`]: follows the ledger by a named subscription and writes each event's record to
//!   `lineage_records` and a JSON-lines file; `reconcile` lists events missing either record.
//! - [`delta`]: the `events` Delta table (exactly once by seq through Delta application
//!   transactions); [`delta_relay`] follows the ledger into it, many events per commit, and
//!   links each commit's seq range in `delta_commits`; [`decisions`] flattens each
//!   `ClearingDecided` event into the `clearing_decisions` table in the same pass;
//!   [`compaction`] merges each table's small files after an append, so that the file list
//!   and the checkpoints stay small however long the service runs.
//! - [`object_storage`]: the tables on S3-compatible object storage (`s3://bucket/prefix`),
//!   each commit a conditional put, so a second writer's commit is refused by the store.
//! - [`http_transport`]: POSTs the stored records to an OpenLineage backend at
//!   `OPENLINEAGE_URL` from its own cursor, at-least-once and in seq order; a slow or absent
//!   endpoint delays only it, and an event the endpoint rejects is recorded, never dropped.
//! - [`schema`]: OpenLineage events from other producers checked against the 2-0-2 spec
//!   and the standard facet schemas (vendored in `schemas/openlineage/`), offline.
//! - [`external`]: those events stored (`external_lineage_events`), and the reads that
//!   join them with Aether's own records; [`graph`] folds both into the Marquez-shaped
//!   lineage graph (pure), and [`index`] keeps that graph caught up for a running service,
//!   or folds it as of a point in time.
//! - [`ledger_facet`]: the custom `aether_ledger` run facet (seq, hashes, stream, snapshot,
//!   trace) and its JSON schema, which Aether serves.
//!
//! The event and facet types are those of `openlineage-client` (its delivery client is not
//! used: its `emit` drops events when its queue is full, which a compliance record may never
//! do). Every event produced validates against the OpenLineage 2-0-2 spec and the facet
//! schemas it names; the tests check that against the vendored spec files in `schemas/openlineage/`.

/// `$body` with `$pool` bound to the store's PostgreSQL or SQLite pool (each a type of its
/// own, so the body is compiled for both), `$time` to how that database stores a time
/// (TIMESTAMPTZ, or microseconds since the epoch) and `$postgres` to which it is. One
/// statement serves both when its placeholders are `$n`, which SQLite binds by number too.
macro_rules! either_pool {
    ($store:expr, |$pool:ident, $time:ident, $postgres:ident| $body:expr) => {
        if let Some($pool) = $store.postgres_pool() {
            let $time = |t: chrono::DateTime<chrono::Utc>| t;
            let $postgres = true;
            $body
        } else if let Some($pool) = $store.sqlite_pool() {
            let $time = |t: chrono::DateTime<chrono::Utc>| t.timestamp_micros();
            let $postgres = false;
            $body
        } else {
            Default::default()
        }
    };
}

pub mod compaction;
pub mod decisions;
pub mod delta;
pub mod delta_relay;
pub mod error;
pub mod external;
pub mod graph;
pub mod http_transport;
pub mod index;
pub mod job;
pub mod ledger_facet;
pub mod object_storage;
pub mod relay;
mod retry;
pub mod run_event;
pub mod schema;
mod table;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::LineageError;
pub use job::{JOB_NAMESPACE, job_name};
pub use ledger_facet::{
    AETHER_CLEARING_BATCH_FACET, AETHER_CLEARING_BATCH_FACET_SCHEMA, AETHER_LEDGER_FACET,
    AETHER_LEDGER_FACET_SCHEMA, AetherClearingBatchRunFacet, AetherLedgerRunFacet, BatchDecision,
    aether_clearing_batch_facet_schema, aether_clearing_batch_schema_url,
    aether_ledger_facet_schema, aether_ledger_schema_url,
};
pub use run_event::{MappingContext, PRODUCER, batch_run_event, run_id, to_run_event};

//! The `clearing_decisions` Delta table: each `ClearingDecided` event flattened into one
//! row for analytics (Spark, DuckDB, Polars), partitioned by date.
//!
//! Exactly once like the `events` table: each commit carries an application transaction
//! (app id [`DECISIONS_APP_ID`], version = the last ledger seq the commit covers), and on
//! reopen every event with a seq at or below it is skipped. The decisions of a batch are
//! a subset of the ledger, so seqs increase but are not contiguous.

use std::path::Path;
use std::sync::Arc;

use aether_ledger::RecordedEvent;
use deltalake::DeltaTable;
use deltalake::arrow::array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use deltalake::arrow::datatypes::{DataType as ArrowDataType, TimeUnit};
use deltalake::arrow::error::ArrowError;
use deltalake::kernel::transaction::CommitProperties;
use deltalake::kernel::{PrimitiveType, Transaction};
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use serde_json::Value;

use crate::delta::{
    DeltaError, META_FIRST_SEQ, META_LAST_SEQ, open_table, to_hex, transaction_version,
};

/// Application id of the decisions table's transactions.
pub const DECISIONS_APP_ID: &str = "aether-clearing-decisions";
/// Name of the table.
pub const DECISIONS_TABLE: &str = "clearing_decisions";
/// The ledger event type that makes a row.
pub const CLEARING_DECIDED: &str = "ClearingDecided";

/// Columns, in order. Amounts are decimal strings (they may exceed 64 bits once summed
/// downstream; a reader casts to DECIMAL(38,0)); lists are JSON text.
const COLUMNS: [(&str, PrimitiveType); 22] = [
    ("seq", PrimitiveType::Long),
    ("event_id", PrimitiveType::String),
    ("hash", PrimitiveType::String),
    ("recorded_at", PrimitiveType::Timestamp),
    ("member", PrimitiveType::String),
    ("request_id", PrimitiveType::String),
    ("decision", PrimitiveType::String),
    ("score", PrimitiveType::Double),
    ("confidence", PrimitiveType::Double),
    ("buyer", PrimitiveType::String),
    ("seller", PrimitiveType::String),
    ("currency", PrimitiveType::String),
    ("amount_minor", PrimitiveType::String),
    ("jurisdiction", PrimitiveType::String),
    ("model_ref", PrimitiveType::String),
    ("model_digest", PrimitiveType::String),
    ("model_stage", PrimitiveType::String),
    ("rules_fired", PrimitiveType::String),
    ("cited_clauses", PrimitiveType::String),
    ("snapshot_id", PrimitiveType::String),
    ("trace_id", PrimitiveType::String),
    ("date", PrimitiveType::String),
];

/// Appends `ClearingDecided` events to the `clearing_decisions` table, idempotently.
pub struct DecisionsSink {
    table: DeltaTable,
    last_seq: u64,
}

impl std::fmt::Debug for DecisionsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionsSink")
            .field("last_seq", &self.last_seq)
            .finish()
    }
}

/// One event's row values, read once.
struct Row<'a> {
    event: &'a RecordedEvent,
    payload: Value,
    metadata: Value,
}

impl Row<'_> {
    /// The payload member at `path` (object keys, outermost first).
    fn member(&self, path: &[&str]) -> Option<&Value> {
        // Walked key by key: `Value::pointer` allocates two strings per path segment, and
        // that was most of this table's encoding cost.
        path.iter()
            .try_fold(&self.payload, |value, key| value.get(key))
    }

    fn text(&self, path: &[&str]) -> String {
        match self.member(path) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(other) => other.to_string(),
        }
    }
}

impl DecisionsSink {
    /// Opens (or creates) the table at `location`.
    pub async fn open_or_create(location: impl AsRef<Path>) -> Result<Self, DeltaError> {
        let (table, location) = open_table(
            location.as_ref(),
            DECISIONS_TABLE,
            "Aether clearing decisions, one row per ClearingDecided event",
            &COLUMNS,
        )
        .await?;
        let last_seq = transaction_version(&table, &location, DECISIONS_APP_ID).await?;
        Ok(DecisionsSink { table, last_seq })
    }

    /// The last ledger seq the table covers.
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The underlying table, for reading.
    pub fn table(&self) -> &DeltaTable {
        &self.table
    }

    /// Writes the decisions among `events` (in seq order) not yet in the table as one
    /// commit that covers up to the last of `events`. Returns the table version, or `None`
    /// when there was nothing new to write.
    pub async fn append(&mut self, events: &[RecordedEvent]) -> Result<Option<i64>, DeltaError> {
        let Some(last) = events.last().filter(|e| e.seq > self.last_seq) else {
            return Ok(None);
        };
        let rows: Vec<Row<'_>> = events
            .iter()
            .filter(|e| e.seq > self.last_seq && e.event_type == CLEARING_DECIDED)
            .map(|e| Row {
                event: e,
                payload: e.payload_value().unwrap_or_default(),
                metadata: e.metadata_value().unwrap_or_default(),
            })
            .collect();
        let Some(first) = rows.first() else {
            // No decision in this stretch of the ledger: nothing to commit. The next commit's
            // transaction moves the cursor past it.
            return Ok(None);
        };
        let covered = i64::try_from(last.seq).map_err(|_| DeltaError::OutOfRange {
            seq: last.seq,
            field: "seq",
            value: last.seq,
        })?;
        let properties = CommitProperties::default()
            .with_application_transaction(Transaction::new(DECISIONS_APP_ID, covered))
            .with_metadata([
                (
                    META_FIRST_SEQ.to_string(),
                    serde_json::json!(first.event.seq),
                ),
                (META_LAST_SEQ.to_string(), serde_json::json!(last.seq)),
            ]);
        let mut writer =
            RecordBatchWriter::for_table(&self.table)?.with_commit_properties(properties);
        let batch = to_record_batch(&writer, &rows)?;
        writer.write(batch).await?;
        let version = writer.flush_and_commit(&mut self.table).await?;
        self.last_seq = last.seq;
        Ok(Some(i64::try_from(version).unwrap_or(i64::MAX)))
    }
}

fn to_record_batch(
    writer: &RecordBatchWriter,
    rows: &[Row<'_>],
) -> Result<RecordBatch, DeltaError> {
    let schema = writer.arrow_schema();
    let tz = match schema.field_with_name("recorded_at")?.data_type() {
        ArrowDataType::Timestamp(TimeUnit::Microsecond, tz) => tz.clone(),
        other => {
            return Err(ArrowError::SchemaError(format!(
                "recorded_at is {other}, expected a microsecond timestamp"
            ))
            .into());
        }
    };
    let strings = |f: &dyn Fn(&Row<'_>) -> String| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let floats = |key: &str| -> ArrayRef {
        Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| {
            r.member(&[key]).and_then(Value::as_f64).unwrap_or(f64::NAN)
        })))
    };
    let columns: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .map(|field| -> Result<ArrayRef, DeltaError> {
            Ok(match field.name().as_str() {
                "seq" => Arc::new(Int64Array::from_iter_values(
                    rows.iter()
                        .map(|r| i64::try_from(r.event.seq).unwrap_or(i64::MAX)),
                )),
                "event_id" => strings(&|r| r.event.event_id.to_string()),
                "hash" => strings(&|r| to_hex(&r.event.hash)),
                "recorded_at" => Arc::new(
                    TimestampMicrosecondArray::from_iter_values(
                        rows.iter().map(|r| r.event.recorded_at.timestamp_micros()),
                    )
                    .with_timezone_opt(tz.clone()),
                ),
                "member" => strings(&|r| r.text(&["member"])),
                "request_id" => strings(&|r| r.text(&["request_id"])),
                "decision" => strings(&|r| r.text(&["decision"])),
                "score" => floats("score"),
                "confidence" => floats("confidence"),
                "buyer" => strings(&|r| r.text(&["trade", "buyer"])),
                "seller" => strings(&|r| r.text(&["trade", "seller"])),
                "currency" => strings(&|r| r.text(&["trade", "currency"])),
                "amount_minor" => strings(&|r| r.text(&["trade", "amount_minor"])),
                "jurisdiction" => strings(&|r| r.text(&["trade", "jurisdiction"])),
                "model_ref" => strings(&|r| r.text(&["model_ref"])),
                "model_digest" => strings(&|r| r.text(&["model_digest"])),
                "model_stage" => strings(&|r| r.text(&["model_stage"])),
                "rules_fired" => strings(&|r| r.payload["rules_fired"].to_string()),
                "cited_clauses" => strings(&|r| r.payload["cited_clauses"].to_string()),
                "snapshot_id" => strings(&|r| r.text(&["snapshot_id"])),
                "trace_id" => strings(&|r| {
                    r.metadata["trace_id"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned()
                }),
                "date" => strings(&|r| r.event.recorded_at.format("%Y-%m-%d").to_string()),
                other => {
                    return Err(ArrowError::SchemaError(format!(
                        "the decisions table has an unknown column {other:?}"
                    ))
                    .into());
                }
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(RecordBatch::try_new(schema, columns)?)
}

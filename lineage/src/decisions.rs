//! The `clearing_decisions` Delta table: each `ClearingDecided` event flattened into one
//! row for analytics (Spark, DuckDB, Polars), partitioned by date.
//!
//! Exactly once like the `events` table: each commit carries an application transaction
//! (app id [`DECISIONS_APP_ID`], version = the last ledger seq the commit covers), and on
//! reopen every event with a seq at or below it is skipped. The decisions of a batch are
//! a subset of the ledger, so seqs increase but are not contiguous.

use std::borrow::{Borrow, Cow};
use std::path::Path;
use std::sync::Arc;

use aether_ledger::RecordedEvent;
use aether_ledger::hashing::to_hex;
use deltalake::DeltaTable;
use deltalake::arrow::array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use deltalake::arrow::datatypes::{DataType as ArrowDataType, TimeUnit};
use deltalake::arrow::error::ArrowError;
use deltalake::kernel::transaction::CommitProperties;
use deltalake::kernel::{PrimitiveType, Transaction};
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use serde_json::value::RawValue;

use crate::compaction::Compactor;
use crate::delta::{
    DeltaError, META_FIRST_SEQ, META_LAST_HASH, META_LAST_SEQ, StorageOptions, open_table,
    transaction_version,
};
use crate::table::writer_properties;

/// Application id of the decisions table's transactions.
pub const DECISIONS_APP_ID: &str = "aether-clearing-decisions";
/// Name of the table.
pub const DECISIONS_TABLE: &str = "clearing_decisions";
/// The ledger event type that makes a row.
pub const CLEARING_DECIDED: &str = "ClearingDecided";
/// The ledger event type of a scoring batch's netting, appended with its decisions.
pub const NETTING_COMPUTED: &str = "NettingComputed";

/// Columns, in order. Amounts are decimal strings (they may exceed 64 bits once summed
/// downstream; a reader casts to DECIMAL(38,0)); lists are JSON text.
/// Columns whose values are (nearly) all distinct: no Parquet dictionary for them.
const UNIQUE_COLUMNS: [&str; 7] = [
    "event_id",
    "hash",
    "request_id",
    "buyer",
    "seller",
    "amount_minor",
    "trace_id",
];

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
    compactor: Compactor,
}

impl std::fmt::Debug for DecisionsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecisionsSink")
            .field("last_seq", &self.last_seq)
            .finish()
    }
}

/// The members of a decision's payload that make its row, borrowed from the event's
/// canonical text. Read straight from the text rather than through a `serde_json::Value`
/// tree: building that tree (a map and a string per member) was most of this table's
/// encoding cost. Each member is kept as its raw JSON, so that a member of an unexpected
/// type still fills its column (as its JSON text) rather than failing the row.
#[derive(Default, serde::Deserialize)]
#[serde(default)]
struct DecisionPayload<'a> {
    #[serde(borrow)]
    member: Option<&'a RawValue>,
    #[serde(borrow)]
    request_id: Option<&'a RawValue>,
    #[serde(borrow)]
    decision: Option<&'a RawValue>,
    #[serde(borrow)]
    score: Option<&'a RawValue>,
    #[serde(borrow)]
    confidence: Option<&'a RawValue>,
    #[serde(borrow)]
    trade: Option<&'a RawValue>,
    #[serde(borrow)]
    model_ref: Option<&'a RawValue>,
    #[serde(borrow)]
    model_digest: Option<&'a RawValue>,
    #[serde(borrow)]
    model_stage: Option<&'a RawValue>,
    #[serde(borrow)]
    rules_fired: Option<&'a RawValue>,
    #[serde(borrow)]
    cited_clauses: Option<&'a RawValue>,
    #[serde(borrow)]
    snapshot_id: Option<&'a RawValue>,
}

/// The trade inside a decision's payload.
#[derive(Default, serde::Deserialize)]
#[serde(default)]
struct TradeMembers<'a> {
    #[serde(borrow)]
    buyer: Option<&'a RawValue>,
    #[serde(borrow)]
    seller: Option<&'a RawValue>,
    #[serde(borrow)]
    currency: Option<&'a RawValue>,
    #[serde(borrow)]
    amount_minor: Option<&'a RawValue>,
    #[serde(borrow)]
    jurisdiction: Option<&'a RawValue>,
}

/// The metadata member the table reads.
#[derive(Default, serde::Deserialize)]
#[serde(default)]
struct DecisionMetadata<'a> {
    #[serde(borrow)]
    trace_id: Option<&'a RawValue>,
}

/// One event's row values, read once.
struct Row<'a> {
    event: &'a RecordedEvent,
    payload: DecisionPayload<'a>,
    trade: TradeMembers<'a>,
    metadata: DecisionMetadata<'a>,
}

impl<'a> Row<'a> {
    fn of(event: &'a RecordedEvent) -> Self {
        // A payload the ledger accepted is a JSON object; anything unreadable leaves the
        // row's members empty rather than stopping the table.
        let payload: DecisionPayload<'a> =
            serde_json::from_str(event.payload.get()).unwrap_or_default();
        let trade = payload
            .trade
            .and_then(|t| serde_json::from_str(t.get()).ok())
            .unwrap_or_default();
        let metadata = serde_json::from_str(event.metadata.get()).unwrap_or_default();
        Row {
            event,
            payload,
            trade,
            metadata,
        }
    }
}

/// A member as column text: a string as itself, null or absent as empty, anything else as
/// its JSON text.
fn text<'a>(member: Option<&'a RawValue>) -> Cow<'a, str> {
    let Some(raw) = member else {
        return Cow::Borrowed("");
    };
    match raw.get() {
        "null" => Cow::Borrowed(""),
        // Borrowed unless it has escapes to undo.
        json if json.starts_with('"') => match serde_json::from_str::<&'a str>(json) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) => serde_json::from_str::<String>(json).map_or(Cow::Borrowed(json), Cow::Owned),
        },
        json => Cow::Borrowed(json),
    }
}

/// A member as a column number: NaN unless it is a JSON number.
fn number(member: Option<&RawValue>) -> f64 {
    member
        .and_then(|raw| serde_json::from_str::<f64>(raw.get()).ok())
        .unwrap_or(f64::NAN)
}

/// A member as its JSON text (`null` when absent).
fn json_text(member: Option<&RawValue>) -> &str {
    member.map_or("null", RawValue::get)
}

/// A member as a string, empty unless it is a JSON string.
fn string_only<'a>(member: Option<&'a RawValue>) -> Cow<'a, str> {
    match member.map(RawValue::get) {
        Some(json) if json.starts_with('"') => text(member),
        _ => Cow::Borrowed(""),
    }
}

impl DecisionsSink {
    /// Opens (or creates) the table at `location`.
    pub async fn open_or_create(location: impl AsRef<Path>) -> Result<Self, DeltaError> {
        Self::open_or_create_with(location, &StorageOptions::new()).await
    }

    /// [`open_or_create`](Self::open_or_create) with the object store's settings.
    pub async fn open_or_create_with(
        location: impl AsRef<Path>,
        options: &StorageOptions,
    ) -> Result<Self, DeltaError> {
        let (table, location) = open_table(
            location.as_ref(),
            options,
            DECISIONS_TABLE,
            "Aether clearing decisions, one row per ClearingDecided event",
            &COLUMNS,
        )
        .await?;
        let last_seq = transaction_version(&table, &location, DECISIONS_APP_ID).await?;
        Ok(DecisionsSink {
            table,
            last_seq,
            compactor: Compactor::default(),
        })
    }

    /// The last ledger seq the table covers.
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// The underlying table, for reading.
    pub fn table(&self) -> &DeltaTable {
        &self.table
    }

    /// Waits for the compaction merge in flight, if any, and commits it (see
    /// [`crate::delta::DeltaSink::finish_compaction`]).
    pub async fn finish_compaction(&mut self) {
        self.compactor.finish(&mut self.table).await;
    }

    /// Whether a compaction merge is being written or waits for its commit.
    pub fn merge_in_flight(&self) -> bool {
        self.compactor.in_flight()
    }

    /// Commits the compaction merge in flight if it is done, without waiting for it.
    pub async fn commit_finished_merge(&mut self) {
        self.compactor.commit_if_done(&mut self.table).await;
    }

    /// Writes the decisions among `events` (in seq order) not yet in the table as one
    /// commit that covers up to the last of `events`. Returns the table version, or `None`
    /// when there was nothing new to write.
    pub async fn append<E: Borrow<RecordedEvent> + Sync>(
        &mut self,
        events: &[E],
    ) -> Result<Option<i64>, DeltaError> {
        let Some(last) = events
            .last()
            .map(Borrow::borrow)
            .filter(|e| e.seq > self.last_seq)
        else {
            return Ok(None);
        };
        let rows: Vec<Row<'_>> = events
            .iter()
            .map(Borrow::borrow)
            .filter(|e| e.seq > self.last_seq && e.event_type == CLEARING_DECIDED)
            .map(Row::of)
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
                (
                    META_LAST_HASH.to_string(),
                    serde_json::json!(to_hex(&last.hash)),
                ),
            ]);
        let mut writer = RecordBatchWriter::for_table(&self.table)?
            .with_commit_properties(properties)
            .with_writer_properties(writer_properties(&UNIQUE_COLUMNS));
        let dates = crate::delta::write_by_date(
            &mut writer,
            &rows,
            |r| r.event.recorded_at,
            to_record_batch,
        )
        .await?;
        let version = writer.flush_and_commit(&mut self.table).await?;
        self.last_seq = last.seq;
        self.compactor
            .after_append(&mut self.table, &dates, &UNIQUE_COLUMNS)
            .await;
        Ok(Some(i64::try_from(version).unwrap_or(i64::MAX)))
    }
}

fn to_record_batch<'a>(
    writer: &RecordBatchWriter,
    rows: &[Row<'a>],
) -> Result<RecordBatch, DeltaError> {
    let schema = crate::delta::file_schema(writer)?;
    let tz = match schema.field_with_name("recorded_at")?.data_type() {
        ArrowDataType::Timestamp(TimeUnit::Microsecond, tz) => tz.clone(),
        other => {
            return Err(ArrowError::SchemaError(format!(
                "recorded_at is {other}, expected a microsecond timestamp"
            ))
            .into());
        }
    };
    let strings = |f: &dyn Fn(&Row<'a>) -> Cow<'a, str>| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let owned = |f: &dyn Fn(&Row<'_>) -> String| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let floats = |f: &dyn Fn(&Row<'a>) -> Option<&'a RawValue>| -> ArrayRef {
        Arc::new(Float64Array::from_iter_values(
            rows.iter().map(|r| number(f(r))),
        ))
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
                "event_id" => owned(&|r| r.event.event_id.to_string()),
                "hash" => owned(&|r| to_hex(&r.event.hash)),
                "recorded_at" => Arc::new(
                    TimestampMicrosecondArray::from_iter_values(
                        rows.iter().map(|r| r.event.recorded_at.timestamp_micros()),
                    )
                    .with_timezone_opt(tz.clone()),
                ),
                "member" => strings(&|r| text(r.payload.member)),
                "request_id" => strings(&|r| text(r.payload.request_id)),
                "decision" => strings(&|r| text(r.payload.decision)),
                "score" => floats(&|r| r.payload.score),
                "confidence" => floats(&|r| r.payload.confidence),
                "buyer" => strings(&|r| text(r.trade.buyer)),
                "seller" => strings(&|r| text(r.trade.seller)),
                "currency" => strings(&|r| text(r.trade.currency)),
                "amount_minor" => strings(&|r| text(r.trade.amount_minor)),
                "jurisdiction" => strings(&|r| text(r.trade.jurisdiction)),
                "model_ref" => strings(&|r| text(r.payload.model_ref)),
                "model_digest" => strings(&|r| text(r.payload.model_digest)),
                "model_stage" => strings(&|r| text(r.payload.model_stage)),
                "rules_fired" => strings(&|r| Cow::Borrowed(json_text(r.payload.rules_fired))),
                "cited_clauses" => strings(&|r| Cow::Borrowed(json_text(r.payload.cited_clauses))),
                "snapshot_id" => strings(&|r| text(r.payload.snapshot_id)),
                "trace_id" => strings(&|r| string_only(r.metadata.trace_id)),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(json: &str) -> Box<RawValue> {
        RawValue::from_string(json.to_owned()).unwrap()
    }

    #[test]
    fn members_become_column_text_whatever_their_type() {
        assert_eq!(text(None), "");
        assert_eq!(text(Some(&raw("null"))), "");
        assert_eq!(text(Some(&raw(r#""bank-a""#))), "bank-a");
        assert!(matches!(text(Some(&raw(r#""bank-a""#))), Cow::Borrowed(_)));
        assert_eq!(text(Some(&raw(r#""a\"b\u00e9""#))), "a\"bé");
        assert_eq!(text(Some(&raw("125000"))), "125000");
        assert_eq!(text(Some(&raw("true"))), "true");
        assert_eq!(text(Some(&raw(r#"{"a":1}"#))), r#"{"a":1}"#);
        assert_eq!(string_only(Some(&raw("7"))), "");
        assert_eq!(string_only(Some(&raw(r#""t-1""#))), "t-1");
        assert_eq!(json_text(None), "null");
        assert_eq!(json_text(Some(&raw(r#"["r1","r2"]"#))), r#"["r1","r2"]"#);
        assert_eq!(number(Some(&raw("0.25"))), 0.25);
        assert_eq!(number(Some(&raw("3"))), 3.0);
        assert!(number(Some(&raw(r#""0.25""#))).is_nan());
        assert!(number(None).is_nan());
    }

    #[test]
    fn a_row_reads_nested_trade_members_and_tolerates_odd_payloads() {
        let event = |payload: &str, metadata: &str| RecordedEvent {
            seq: 7,
            stream_id: "clearing/bank-a".into(),
            stream_version: 1,
            event_id: uuid::Uuid::nil(),
            event_type: CLEARING_DECIDED.into(),
            schema_version: 1,
            payload: raw(payload),
            metadata: raw(metadata),
            recorded_at: chrono::DateTime::UNIX_EPOCH,
            prev_hash: [0; 32],
            hash: [1; 32],
        };
        let decided = event(
            r#"{"decision":"cleared","score":0.125,"trade":{"amount_minor":"125000","buyer":"bank-a","currency":"CNY"}}"#,
            r#"{"trace_id":"t-9"}"#,
        );
        let row = Row::of(&decided);
        assert_eq!(text(row.trade.buyer), "bank-a");
        assert_eq!(text(row.trade.amount_minor), "125000");
        assert_eq!(text(row.trade.seller), "");
        assert_eq!(text(row.payload.decision), "cleared");
        assert_eq!(number(row.payload.score), 0.125);
        assert_eq!(string_only(row.metadata.trace_id), "t-9");

        // A trade that is not an object, and metadata with a numeric trace id: empty
        // members, not a failed table.
        let odd = event(r#"{"decision":"held","trade":"n/a"}"#, r#"{"trace_id":5}"#);
        let row = Row::of(&odd);
        assert_eq!(text(row.payload.decision), "held");
        assert_eq!(text(row.payload.trade), "n/a");
        assert_eq!(text(row.trade.buyer), "");
        assert_eq!(string_only(row.metadata.trace_id), "");
    }
}

//! The Delta Lake sink: ledger events as rows of the `events` Delta table.
//!
//! One call to [`DeltaSink::append`] is one Delta commit holding many events, written with
//! delta-rs' [`RecordBatchWriter`] (no datafusion). Each commit carries:
//!
//! - a Delta application transaction (`txn` action) with app id [`APP_ID`] and version = the
//!   last seq written, which is how the sink knows, after a restart, where it stopped: events
//!   with `seq <= last_seq` are skipped, so replaying after a crash writes no duplicates;
//! - commit metadata (in the commit's `commitInfo`) naming the seq range
//!   ([`META_FIRST_SEQ`], [`META_LAST_SEQ`]) and the last event's hash ([`META_LAST_HASH`]).
//!
//! The table is partitioned by `date` (`YYYY-MM-DD` of `recorded_at`, UTC) and created with
//! `delta.checkpointInterval` = [`CHECKPOINT_INTERVAL`]; the writer's post-commit hook writes
//! a checkpoint whenever `(version + 1)` is a multiple of it. After each append the
//! partition written is compacted ([`crate::compaction`]), in commits of its own.
//!
//! One sink per table: the sink reads the application transaction once, on open.

use std::borrow::Borrow;
use std::path::Path;
use std::sync::Arc;

use aether_ledger::RecordedEvent;
use aether_ledger::hashing::to_hex;
use delta_kernel::expressions::Scalar;
use deltalake::arrow::array::{
    ArrayRef, Int32Array, Int64Array, RecordBatch, StringBuilder, TimestampMicrosecondArray,
};
use deltalake::arrow::datatypes::{DataType as ArrowDataType, SchemaRef, TimeUnit};
use deltalake::arrow::error::ArrowError;
use deltalake::kernel::transaction::CommitProperties;
use deltalake::kernel::{DataType, PrimitiveType, Transaction};
use deltalake::writer::{DeltaWriter, RecordBatchWriter, WriteMode};
use deltalake::{DeltaTable, DeltaTableBuilder, DeltaTableError};
use indexmap::IndexMap;

use crate::compaction::Compactor;
use crate::table::writer_properties;
pub use crate::table::{CHECKPOINT_INTERVAL, DeltaError, PARTITION_COLUMN};

/// Application id of the sink's Delta application transactions.
pub const APP_ID: &str = "aether-ledger";
/// Commit metadata key: seq of the first event in the commit.
pub const META_FIRST_SEQ: &str = "aether.first_seq";
/// Commit metadata key: seq of the last event in the commit.
pub const META_LAST_SEQ: &str = "aether.last_seq";
/// Commit metadata key: hash (lowercase hex) of the last event in the commit.
pub const META_LAST_HASH: &str = "aether.last_hash";
/// Name of the table the sink creates.
pub const TABLE_NAME: &str = "events";

/// How many commits back from the head `open_or_create` looks for the last append's
/// metadata (the commits a compaction and its vacuum make after it, with room to spare).
const LAST_APPEND_LOOK_BACK: i64 = 32;

/// Columns whose values are (nearly) all distinct: no Parquet dictionary for them.
const UNIQUE_COLUMNS: [&str; 5] = ["event_id", "payload", "metadata", "prev_hash", "hash"];

/// The table's columns, in order: name and Delta type. All are non-nullable.
const COLUMNS: [(&str, PrimitiveType); 12] = [
    ("seq", PrimitiveType::Long),
    ("stream_id", PrimitiveType::String),
    ("stream_version", PrimitiveType::Long),
    ("event_id", PrimitiveType::String),
    ("event_type", PrimitiveType::String),
    ("schema_version", PrimitiveType::Integer),
    ("payload", PrimitiveType::String),
    ("metadata", PrimitiveType::String),
    ("recorded_at", PrimitiveType::Timestamp),
    ("prev_hash", PrimitiveType::String),
    ("hash", PrimitiveType::String),
    ("date", PrimitiveType::String),
];

/// Settings for a table's object store, by `object_store` key (`aws_endpoint`, ...), on top
/// of the environment's `AWS_*` variables; empty for a local table.
pub type StorageOptions = std::collections::HashMap<String, String>;

/// Appends ledger events to the `events` Delta table, idempotently by seq.
pub struct DeltaSink {
    table: DeltaTable,
    location: String,
    last_seq: u64,
    /// Hash of the event at `last_seq` when known (from the last commit's metadata, or
    /// from this sink's own appends); used to check the chain across commits.
    last_hash: Option<String>,
    /// What follows each append ([`crate::compaction`]); `None` only for a benchmark's
    /// baseline.
    compactor: Option<Compactor>,
}

impl std::fmt::Debug for DeltaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeltaSink")
            .field("location", &self.location)
            .field("version", &self.version())
            .field("last_seq", &self.last_seq)
            .finish()
    }
}

impl DeltaSink {
    /// Opens the `events` table at `location` (a local directory, created if absent, or a
    /// URL), creating the table if there is none there yet.
    pub async fn open_or_create(location: impl AsRef<Path>) -> Result<Self, DeltaError> {
        Self::open_or_create_with(location, &StorageOptions::new()).await
    }

    /// [`open_or_create`](Self::open_or_create) with settings for the object store
    /// (`AWS_*` keys, in addition to the environment's).
    pub async fn open_or_create_with(
        location: impl AsRef<Path>,
        options: &StorageOptions,
    ) -> Result<Self, DeltaError> {
        let (table, location) = open_table(
            location.as_ref(),
            options,
            TABLE_NAME,
            "Aether ledger events, one row per event (seq), hash-chained",
            &COLUMNS,
        )
        .await?;
        let last_seq = transaction_version(&table, &location, APP_ID).await?;
        let mut sink = DeltaSink {
            table,
            location,
            last_seq,
            last_hash: None,
            compactor: Some(Compactor::default()),
        };
        if last_seq > 0 {
            // The newest commit naming a seq range is normally the append that set
            // `last_seq`, and names its hash; compactions, vacuums and property changes
            // made after it name no range.
            let oldest = (sink.version() - LAST_APPEND_LOOK_BACK).max(0);
            for version in (oldest..=sink.version()).rev() {
                let Some(meta) = sink.commit_metadata(version).await? else {
                    continue;
                };
                let Some(seq) = meta.get(META_LAST_SEQ).and_then(|v| v.as_u64()) else {
                    continue;
                };
                if seq == last_seq {
                    sink.last_hash = meta
                        .get(META_LAST_HASH)
                        .and_then(|v| v.as_str())
                        .map(str::to_owned);
                }
                break;
            }
        }
        Ok(sink)
    }

    /// This sink without compaction: the table's files then grow by one per commit. Only
    /// for measuring what compaction saves (`aether bench lineage --commits`).
    pub fn without_compaction(mut self) -> Self {
        self.compactor = None;
        self
    }

    /// Seq of the last event committed to the table (0 when none).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Waits for the compaction merge in flight, if any, and commits it. Call before
    /// dropping a sink: a merge left running writes a file no commit names.
    pub async fn finish_compaction(&mut self) {
        if let Some(compactor) = &mut self.compactor {
            compactor.finish(&mut self.table).await;
        }
    }

    /// Whether a compaction merge is being written or waits for its commit.
    pub fn merge_in_flight(&self) -> bool {
        self.compactor.as_ref().is_some_and(Compactor::in_flight)
    }

    /// Commits the compaction merge in flight if it is done, without waiting for it.
    pub async fn commit_finished_merge(&mut self) {
        if let Some(compactor) = &mut self.compactor {
            compactor.commit_if_done(&mut self.table).await;
        }
    }

    /// The table version the sink is at (0 right after creation).
    pub fn version(&self) -> i64 {
        self.table
            .version()
            .map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX))
    }

    /// The underlying table, for reading (file list, snapshot).
    pub fn table(&self) -> &DeltaTable {
        &self.table
    }

    /// The commit metadata of `version` (the `commitInfo` members other than the standard
    /// ones included): `None` when that version's log entry is gone or has no commit info.
    pub async fn commit_metadata(
        &self,
        version: i64,
    ) -> Result<Option<serde_json::Map<String, serde_json::Value>>, DeltaError> {
        commit_info(&self.table, version).await
    }

    /// Appends the events not yet in the table as one Delta commit and returns its version,
    /// or `None` when every event is already there (seq ≤ [`last_seq`](Self::last_seq)).
    ///
    /// The new events must continue the table: seqs `last_seq + 1, last_seq + 2, ...` in
    /// order, each `prev_hash` the previous event's hash. Anything else is refused and
    /// nothing is written.
    pub async fn append<E: Borrow<RecordedEvent> + Sync>(
        &mut self,
        events: &[E],
    ) -> Result<Option<i64>, DeltaError> {
        let new: Vec<&RecordedEvent> = events
            .iter()
            .map(Borrow::borrow)
            .filter(|e| e.seq > self.last_seq)
            .collect();
        let (Some(first), Some(last)) = (new.first(), new.last()) else {
            return Ok(None);
        };
        let mut expected_prev = self.last_hash.clone();
        for (expected_seq, e) in (self.last_seq + 1..).zip(&new) {
            if e.seq != expected_seq {
                return Err(DeltaError::Gap {
                    expected: expected_seq,
                    found: e.seq,
                });
            }
            let prev_hash = to_hex(&e.prev_hash);
            if let Some(expected) = expected_prev
                && expected != prev_hash
            {
                return Err(DeltaError::ChainBroken {
                    seq: e.seq,
                    prev_hash,
                    expected,
                });
            }
            for (field, value) in [("seq", e.seq), ("stream_version", e.stream_version)] {
                if i64::try_from(value).is_err() {
                    return Err(DeltaError::OutOfRange {
                        seq: e.seq,
                        field,
                        value,
                    });
                }
            }
            if i32::try_from(e.schema_version).is_err() {
                return Err(DeltaError::OutOfRange {
                    seq: e.seq,
                    field: "schema_version",
                    value: u64::from(e.schema_version),
                });
            }
            expected_prev = Some(to_hex(&e.hash));
        }
        let last_hash = to_hex(&last.hash);
        let last_seq = i64::try_from(last.seq).map_err(|_| DeltaError::OutOfRange {
            seq: last.seq,
            field: "seq",
            value: last.seq,
        })?;

        let properties = CommitProperties::default()
            .with_application_transaction(Transaction::new(APP_ID, last_seq))
            .with_metadata([
                (META_FIRST_SEQ.to_string(), serde_json::json!(first.seq)),
                (META_LAST_SEQ.to_string(), serde_json::json!(last.seq)),
                (META_LAST_HASH.to_string(), serde_json::json!(last_hash)),
            ]);
        let mut writer = RecordBatchWriter::for_table(&self.table)?
            .with_commit_properties(properties)
            .with_writer_properties(writer_properties(&UNIQUE_COLUMNS));
        let dates = write_by_date(&mut writer, &new, |e| e.recorded_at, to_record_batch).await?;
        let version = writer.flush_and_commit(&mut self.table).await?;

        self.last_seq = last.seq;
        self.last_hash = Some(last_hash);
        if let Some(compactor) = &mut self.compactor {
            compactor
                .after_append(&mut self.table, &dates, &UNIQUE_COLUMNS)
                .await;
        }
        Ok(Some(i64::try_from(version).unwrap_or(i64::MAX)))
    }
}

/// Writes `rows` (in seq order) through `writer`, one run of rows with the same
/// [`PARTITION_COLUMN`] value (`recorded_at`'s UTC date) at a time, each batch built by
/// `batch_of`. Why not `DeltaWriter::write` with the whole page: it groups rows by
/// partition by copying every column (`take`), about 2 % of the gateway's CPU under
/// clearing load, for a page that nearly always falls on one date. A page that spans
/// midnight is written as two runs. Returns the partitions written.
pub(crate) async fn write_by_date<T>(
    writer: &mut RecordBatchWriter,
    rows: &[T],
    recorded_at: impl Fn(&T) -> chrono::DateTime<chrono::Utc>,
    batch_of: impl Fn(&RecordBatchWriter, &[T]) -> Result<RecordBatch, DeltaError>,
) -> Result<Vec<String>, DeltaError> {
    let mut dates = Vec::new();
    let mut rest = rows;
    while let Some(first) = rest.first() {
        let date = recorded_at(first).date_naive();
        let run = rest
            .iter()
            .position(|r| recorded_at(r).date_naive() != date)
            .unwrap_or(rest.len());
        let (these, after) = rest.split_at(run);
        let batch = batch_of(writer, these)?;
        let date = date.format("%Y-%m-%d").to_string();
        let partition =
            IndexMap::from([(PARTITION_COLUMN.to_owned(), Scalar::String(date.clone()))]);
        writer
            .write_partition(batch, &partition, WriteMode::Default)
            .await?;
        dates.push(date);
        rest = after;
    }
    Ok(dates)
}

/// The writer's schema without [`PARTITION_COLUMN`]: what a data file holds. Batches for
/// [`write_by_date`] are built in it, since the partition's value travels beside the batch
/// and a date column would be built per row only to be dropped.
pub(crate) fn file_schema(writer: &RecordBatchWriter) -> Result<SchemaRef, DeltaError> {
    let schema = writer.arrow_schema();
    let kept: Vec<usize> = (0..schema.fields().len())
        .filter(|&i| schema.field(i).name() != PARTITION_COLUMN)
        .collect();
    Ok(Arc::new(schema.project(&kept)?))
}

/// The `commitInfo` of `table`'s commit `version`: `None` when that version's log entry is
/// gone or has no commit info. How a relay links a commit it made but did not record.
pub(crate) async fn commit_info(
    table: &DeltaTable,
    version: i64,
) -> Result<Option<serde_json::Map<String, serde_json::Value>>, DeltaError> {
    let Ok(version) = u64::try_from(version) else {
        return Ok(None);
    };
    let Some(bytes) = table.log_store().read_commit_entry(version).await? else {
        return Ok(None);
    };
    for line in bytes.split(|b| *b == b'\n') {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let action: serde_json::Value = serde_json::from_slice(line).map_err(|e| {
            DeltaTableError::Generic(format!("commit {version} has an unreadable line: {e}"))
        })?;
        if let Some(serde_json::Value::Object(info)) = action.get("commitInfo") {
            return Ok(Some(info.clone()));
        }
    }
    Ok(None)
}

/// Opens the table at `location` (a local directory, created if absent, or a URL),
/// creating it with `columns` (all non-nullable) partitioned by [`PARTITION_COLUMN`] and
/// checkpoints every [`CHECKPOINT_INTERVAL`] versions if there is none yet; refuses a table
/// with other columns or partitioning. Returns the table and its location as text.
pub(crate) async fn open_table(
    path: &Path,
    options: &StorageOptions,
    name: &str,
    comment: &str,
    columns: &[(&str, PrimitiveType)],
) -> Result<(DeltaTable, String), DeltaError> {
    let location = path.to_string_lossy().into_owned();
    let text = path.to_str().ok_or_else(|| DeltaError::InvalidLocation {
        location: location.clone(),
        reason: "not valid UTF-8".into(),
    })?;
    let mut table = unloaded_table(text, options)?;
    // Loaded only when the log has commits: loading an empty location is refused (and
    // the Delta kernel logs that refusal as an ERROR, alarming on every first start).
    if table.log_store().is_delta_table_location().await? {
        table.load().await?;
    } else {
        let mut create = table
            .create()
            .with_table_name(name)
            .with_comment(comment)
            .with_partition_columns([PARTITION_COLUMN])
            .with_configuration(
                crate::table::table_properties()
                    .into_iter()
                    .map(|(key, value)| (key, Some(value))),
            );
        for (column, ty) in columns {
            create = create.with_column(*column, DataType::Primitive(ty.clone()), false, None);
        }
        table = create.await?;
    }
    check_schema(&table, &location, columns)?;
    crate::table::set_missing_properties(&mut table).await?;
    Ok((table, location))
}

/// The table at `location` (a local directory, created if absent, or a URL), not yet read.
fn unloaded_table(location: &str, options: &StorageOptions) -> Result<DeltaTable, DeltaError> {
    crate::object_storage::register();
    let url = deltalake::ensure_table_uri(location).map_err(|e| DeltaError::InvalidLocation {
        location: location.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(DeltaTableBuilder::from_url(url)?
        .with_storage_options(options.clone())
        .build()?)
}

/// The last seq in the `events` table at `location`, or `None` when there is no table there
/// yet. Reads only: a node that does not write the table (another holds the Delta relay's
/// lease) must not race the writer to create it.
pub async fn events_table_last_seq(
    location: &str,
    options: &StorageOptions,
) -> Result<Option<u64>, DeltaError> {
    if !crate::object_storage::is_object_store(location)
        && !Path::new(location).join("_delta_log").is_dir()
    {
        return Ok(None);
    }
    let mut table = unloaded_table(location, options)?;
    if !table.log_store().is_delta_table_location().await? {
        return Ok(None);
    }
    table.load().await?;
    transaction_version(&table, location, APP_ID)
        .await
        .map(Some)
}

/// Every `seq` in the active files of the `events` table at `location`, sorted, duplicates
/// kept: what a reader of the table sees, for checking it against the ledger (exactly once,
/// no gaps). Reads each data file's `seq` column through the table's own object store.
pub async fn events_table_seqs(
    location: &str,
    options: &StorageOptions,
) -> Result<Vec<u64>, DeltaError> {
    use deltalake::arrow::array::{Array, Int64Array};
    use deltalake::parquet::arrow::ProjectionMask;
    use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use object_store::ObjectStoreExt;

    let mut table = unloaded_table(location, options)?;
    table.load().await?;
    let store = table.object_store();
    let paths: Vec<_> = table
        .snapshot()?
        .log_data()
        .into_iter()
        .map(|file| file.object_store_path())
        .collect();
    let unreadable = |reason: String| DeltaError::NotAnEventsTable {
        location: location.to_owned(),
        reason,
    };
    let mut seqs = Vec::new();
    for path in paths {
        let bytes = store
            .get(&path)
            .await
            .map_err(|e| unreadable(format!("{path}: {e}")))?
            .bytes()
            .await
            .map_err(|e| unreadable(format!("{path}: {e}")))?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .map_err(|e| unreadable(format!("{path}: {e}")))?;
        let mask = ProjectionMask::columns(builder.parquet_schema(), ["seq"]);
        let reader = builder
            .with_projection(mask)
            .build()
            .map_err(|e| unreadable(format!("{path}: {e}")))?;
        for batch in reader {
            let batch = batch?;
            let column = batch
                .column_by_name("seq")
                .and_then(|c| c.as_any().downcast_ref::<Int64Array>().cloned())
                .ok_or_else(|| unreadable(format!("{path}: no Int64 seq column")))?;
            seqs.extend((0..column.len()).filter_map(|i| u64::try_from(column.value(i)).ok()));
        }
    }
    seqs.sort_unstable();
    Ok(seqs)
}

/// The version of `app_id`'s last application transaction in the table (0 when none):
/// the last seq the writer committed.
pub(crate) async fn transaction_version(
    table: &DeltaTable,
    location: &str,
    app_id: &str,
) -> Result<u64, DeltaError> {
    match table
        .snapshot()?
        .transaction_version(table.log_store().as_ref(), app_id)
        .await?
    {
        None => Ok(0),
        Some(v) => u64::try_from(v).map_err(|_| DeltaError::NotAnEventsTable {
            location: location.to_owned(),
            reason: format!("negative application transaction version {v} for {app_id}"),
        }),
    }
}

/// Refuses a table whose columns or partitioning are not `columns` and [`PARTITION_COLUMN`].
fn check_schema(
    table: &DeltaTable,
    location: &str,
    columns: &[(&str, PrimitiveType)],
) -> Result<(), DeltaError> {
    let snapshot = table.snapshot()?;
    let metadata = snapshot.metadata();
    let schema = snapshot.schema();
    let found: Vec<(String, String)> = schema
        .fields()
        .map(|f| (f.name().to_string(), f.data_type().to_string()))
        .collect();
    let wanted: Vec<(String, String)> = columns
        .iter()
        .map(|(n, t)| (n.to_string(), DataType::Primitive(t.clone()).to_string()))
        .collect();
    if found != wanted {
        return Err(DeltaError::NotAnEventsTable {
            location: location.to_string(),
            reason: format!("columns are {found:?}, expected {wanted:?}"),
        });
    }
    let partitions: Vec<String> = metadata.partition_columns().to_vec();
    if partitions != [PARTITION_COLUMN] {
        return Err(DeltaError::NotAnEventsTable {
            location: location.to_string(),
            reason: format!("partitioned by {partitions:?}, expected [\"{PARTITION_COLUMN}\"]"),
        });
    }
    Ok(())
}

/// The events as one Arrow batch in the data files' schema ([`file_schema`]).
fn to_record_batch(
    writer: &RecordBatchWriter,
    events: &[&RecordedEvent],
) -> Result<RecordBatch, DeltaError> {
    let schema = file_schema(writer)?;
    let tz = match schema.field_with_name("recorded_at")?.data_type() {
        ArrowDataType::Timestamp(TimeUnit::Microsecond, tz) => tz.clone(),
        other => {
            return Err(ArrowError::SchemaError(format!(
                "recorded_at is {other}, expected a microsecond timestamp"
            ))
            .into());
        }
    };
    // Each text column is built in one buffer sized up front: a commit holds a few
    // thousand events, and a buffer grown by doubling re-faulted megabytes of fresh pages
    // for every commit (7.7 % of the gateway's samples under clearing load were page
    // faults, these buffers among them).
    let texts = |f: fn(&RecordedEvent) -> &str| -> ArrayRef {
        let bytes = events.iter().map(|e| f(e).len()).sum();
        let mut column = StringBuilder::with_capacity(events.len(), bytes);
        for e in events {
            column.append_value(f(e));
        }
        Arc::new(column.finish())
    };
    let strings = |len: usize, f: fn(&RecordedEvent) -> String| -> ArrayRef {
        let mut column = StringBuilder::with_capacity(events.len(), events.len() * len);
        for e in events {
            column.append_value(f(e));
        }
        Arc::new(column.finish())
    };
    // Ranges were checked by the caller; saturate rather than panic regardless.
    let longs = |f: fn(&RecordedEvent) -> u64| -> ArrayRef {
        Arc::new(Int64Array::from_iter_values(
            events
                .iter()
                .map(|e| i64::try_from(f(e)).unwrap_or(i64::MAX)),
        ))
    };
    let columns: Vec<ArrayRef> = schema
        .fields()
        .iter()
        .map(|field| -> Result<ArrayRef, DeltaError> {
            Ok(match field.name().as_str() {
                "seq" => longs(|e| e.seq),
                "stream_id" => texts(|e| &e.stream_id),
                "stream_version" => longs(|e| e.stream_version),
                "event_id" => strings(36, |e| e.event_id.to_string()),
                "event_type" => texts(|e| &e.event_type),
                "schema_version" => Arc::new(Int32Array::from_iter_values(
                    events
                        .iter()
                        .map(|e| i32::try_from(e.schema_version).unwrap_or(i32::MAX)),
                )),
                "payload" => texts(|e| e.payload.get()),
                "metadata" => texts(|e| e.metadata.get()),
                "recorded_at" => Arc::new(
                    TimestampMicrosecondArray::from_iter_values(
                        events.iter().map(|e| e.recorded_at.timestamp_micros()),
                    )
                    .with_timezone_opt(tz.clone()),
                ),
                "prev_hash" => strings(64, |e| to_hex(&e.prev_hash)),
                "hash" => strings(64, |e| to_hex(&e.hash)),
                other => {
                    return Err(ArrowError::SchemaError(format!(
                        "the events table has an unknown column {other:?}"
                    ))
                    .into());
                }
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(RecordBatch::try_new(schema, columns)?)
}

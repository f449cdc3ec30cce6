//! What every Delta table Aether writes shares: its error, its partition column, its
//! Parquet writer settings and its table properties. The sink (`delta`), the decisions
//! table and the compactor all build on these.

use std::collections::HashMap;

use deltalake::arrow::error::ArrowError;
use deltalake::parquet::basic::Compression;
use deltalake::parquet::file::properties::WriterProperties;
use deltalake::parquet::schema::types::ColumnPath;
use deltalake::{DeltaTable, DeltaTableError};

/// `delta.checkpointInterval` of a table the sink creates.
pub const CHECKPOINT_INTERVAL: u64 = 100;
/// The partition column.
pub const PARTITION_COLUMN: &str = "date";

/// What can go wrong opening or writing the `events` table.
#[derive(Debug, thiserror::Error)]
pub enum DeltaError {
    #[error("invalid Delta table location {location:?}: {reason}")]
    InvalidLocation { location: String, reason: String },
    #[error("table at {location} is not the Aether table expected there: {reason}")]
    NotAnEventsTable { location: String, reason: String },
    #[error("events are not contiguous: expected seq {expected}, found seq {found}")]
    Gap { expected: u64, found: u64 },
    #[error("hash chain broken at seq {seq}: prev_hash {prev_hash} is not the hash {expected} of seq {}", seq - 1)]
    ChainBroken {
        seq: u64,
        prev_hash: String,
        expected: String,
    },
    #[error("{field} {value} of seq {seq} does not fit its Delta column")]
    OutOfRange {
        seq: u64,
        field: &'static str,
        value: u64,
    },
    #[error("Delta Lake: {0}")]
    Delta(#[from] DeltaTableError),
    #[error("Arrow: {0}")]
    Arrow(#[from] ArrowError),
}

/// Parquet settings for a table's data files: Snappy, as delta-rs writes by default, and
/// plain encoding for `unique_columns`. A dictionary only pays for repeated values; for
/// hashes, ids and event text the writer would intern every value (hashing and copying
/// it) until the dictionary page overflows, then fall back to plain encoding anyway.
pub(crate) fn writer_properties(unique_columns: &[&str]) -> WriterProperties {
    unique_columns
        .iter()
        .fold(
            WriterProperties::builder()
                .set_created_by(format!("aether-lineage {}", env!("CARGO_PKG_VERSION")))
                .set_compression(Compression::SNAPPY),
            |b, column| b.set_column_dictionary_enabled(ColumnPath::from(*column), false),
        )
        .build()
}

/// The table properties a relay's table is created with (and given on open when unset):
/// checkpoints every [`CHECKPOINT_INTERVAL`] commits (a checkpoint holds the whole file
/// list and the removed files still retained, so one every 10 commits was most of the
/// log's bytes), merged-away files kept one hour for readers of older versions, and log
/// entries one day.
pub fn table_properties() -> [(&'static str, String); 3] {
    [
        ("delta.checkpointInterval", CHECKPOINT_INTERVAL.to_string()),
        (
            "delta.deletedFileRetentionDuration",
            "interval 1 hours".to_owned(),
        ),
        ("delta.logRetentionDuration", "interval 1 days".to_owned()),
    ]
}

/// Sets each of [`table_properties`] the table does not have yet (tables made by an
/// earlier release): a property already set, by us or by an operator, is left alone.
pub(crate) async fn set_missing_properties(table: &mut DeltaTable) -> Result<(), DeltaError> {
    let configuration = table.snapshot()?.metadata().configuration().clone();
    let missing: HashMap<String, String> = table_properties()
        .into_iter()
        .filter(|(key, _)| !configuration.contains_key(*key))
        .map(|(key, value)| (key.to_owned(), value))
        .collect();
    if !missing.is_empty() {
        *table = table
            .clone()
            .set_tbl_properties()
            .with_properties(missing)
            .await?;
    }
    Ok(())
}

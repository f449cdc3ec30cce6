//! Keeps the relays' Delta tables at a bounded number of data files.
//!
//! Why: the relays commit about once a second while events arrive (86,400 commits a day,
//! at any load), each adding a data file. Without compaction the live file list grows
//! without end, and every Delta checkpoint holds all of it: at a checkpoint every ten
//! commits the log alone grew to hundreds of GB in a day and each commit got slower (see
//! `BENCHMARKS.md`). After each append a sink merges files of the partition it wrote:
//! whenever [`FAN_IN`] live files of one size class (powers of [`FAN_IN`] above
//! [`BASE_BYTES`]) are in one partition, they become one file, in one commit that removes
//! them and adds it, both with `dataChange = false` (readers of changes see nothing new).
//! A partition therefore holds at most `FAN_IN - 1` files per class. Each row is rewritten
//! once per class it climbs (a handful of times), never once per commit. A merge reads at
//! most [`MAX_MERGE_BYTES`]: it runs in the relay's task, and the OpenLineage records wait
//! for the relay's next commit (under clearing load `FAN_IN` commits of the `events` table
//! are ~36 MB; their merge result is not merged again).
//!
//! The merged-away files stay on disk for the table's `delta.deletedFileRetentionDuration`
//! (a reader of an older version may still be reading them) and are then deleted by a
//! vacuum that follows a merge, at most every ten minutes ([`table_properties`] sets the
//! retentions).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use delta_kernel::expressions::Scalar;
use deltalake::DeltaTable;
use deltalake::kernel::transaction::CommitBuilder;
use deltalake::kernel::{Action, Remove};
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use deltalake::protocol::DeltaOperation;
use deltalake::writer::{DeltaWriter, RecordBatchWriter, WriteMode};
use indexmap::IndexMap;

use crate::delta::{CHECKPOINT_INTERVAL, DeltaError, PARTITION_COLUMN, writer_properties};

/// Files of one size class merged at once.
pub const FAN_IN: usize = 8;
/// Files below this size are all of the smallest class.
pub const BASE_BYTES: i64 = 64 * 1024;
/// The most bytes one merge reads: files that would need more stay as they are.
pub const MAX_MERGE_BYTES: i64 = 64 * 1024 * 1024;

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

/// The size class of a data file: 0 below `BASE_BYTES * FAN_IN`, then one more per factor
/// of [`FAN_IN`].
fn size_class(bytes: i64) -> u32 {
    let fan_in = FAN_IN as i64;
    let mut class = 0;
    let mut limit = BASE_BYTES.saturating_mul(fan_in);
    while bytes >= limit && limit < i64::MAX {
        class += 1;
        limit = limit.saturating_mul(fan_in);
    }
    class
}

/// A live data file of the partition being compacted.
struct DataFile {
    path: deltalake::Path,
    size: i64,
    modified: i64,
    remove: Remove,
}

/// A vacuum reads every removed file the table still lists and every file in its
/// directory: after a merge, at most this often (the retention is an hour).
const VACUUM_EVERY: Duration = Duration::from_secs(600);

/// What a sink runs after each append; one per table.
#[derive(Debug, Default)]
pub(crate) struct Compactor {
    /// When this process last vacuumed the table (`None`: not yet, so the first merge
    /// vacuums).
    last_vacuum: Option<Instant>,
}

impl Compactor {
    /// Compacts the partitions an append just wrote. A failure is logged, not returned:
    /// the append is committed, and the next append compacts again.
    pub(crate) async fn after_append(
        &mut self,
        table: &mut DeltaTable,
        dates: &[String],
        unique_columns: &[&str],
    ) {
        for date in dates {
            if let Err(e) = self.compact(table, date, unique_columns).await {
                tracing::warn!(
                    table = %table.table_url(),
                    partition = %date,
                    error = %e,
                    "compacting the Delta table's small files failed; the next append tries again"
                );
            }
        }
    }

    /// Merges the files of `date`'s partition while some size class holds [`FAN_IN`] of
    /// them, then vacuums what the table's retention lets go (see [`VACUUM_EVERY`]).
    /// `unique_columns` are the table's columns written without a dictionary.
    async fn compact(
        &mut self,
        table: &mut DeltaTable,
        date: &str,
        unique_columns: &[&str],
    ) -> Result<(), DeltaError> {
        let mut merged = false;
        while let Some(files) = files_to_merge(table, date)? {
            merge(table, date, files, unique_columns).await?;
            merged = true;
        }
        if merged
            && self
                .last_vacuum
                .is_none_or(|at| at.elapsed() >= VACUUM_EVERY)
        {
            vacuum(table).await?;
            self.last_vacuum = Some(Instant::now());
        }
        Ok(())
    }
}

/// The oldest [`FAN_IN`] files of the smallest class that has that many within
/// [`MAX_MERGE_BYTES`], oldest first.
fn files_to_merge(table: &DeltaTable, date: &str) -> Result<Option<Vec<DataFile>>, DeltaError> {
    let mut classes: BTreeMap<u32, Vec<DataFile>> = BTreeMap::new();
    for file in table.snapshot()?.log_data().iter() {
        let in_partition = file
            .partition_values_map()
            .get(PARTITION_COLUMN)
            .is_some_and(|v| v.as_deref() == Some(date));
        if !in_partition || file.size() > MAX_MERGE_BYTES {
            continue;
        }
        classes
            .entry(size_class(file.size()))
            .or_default()
            .push(DataFile {
                path: file.object_store_path(),
                size: file.size(),
                modified: file.modification_time(),
                remove: file.remove_action(false),
            });
    }
    Ok(classes.into_values().find_map(|mut files| {
        files.sort_by(|a, b| (a.modified, &a.path).cmp(&(b.modified, &b.path)));
        files.truncate(FAN_IN);
        let bytes: i64 = files.iter().map(|f| f.size).sum();
        (files.len() == FAN_IN && bytes <= MAX_MERGE_BYTES).then_some(files)
    }))
}

/// Rewrites `files` as one and commits the swap.
async fn merge(
    table: &mut DeltaTable,
    date: &str,
    files: Vec<DataFile>,
    unique_columns: &[&str],
) -> Result<(), DeltaError> {
    let store = table.object_store();
    let mut writer = RecordBatchWriter::for_table(table)?
        .with_writer_properties(writer_properties(unique_columns));
    let partition =
        IndexMap::from([(PARTITION_COLUMN.to_owned(), Scalar::String(date.to_owned()))]);
    for file in &files {
        let bytes = store
            .get(&file.path)
            .await
            .map_err(deltalake::DeltaTableError::from)?
            .bytes()
            .await
            .map_err(deltalake::DeltaTableError::from)?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .and_then(|b| b.build())
            .map_err(deltalake::DeltaTableError::from)?;
        for batch in reader {
            writer
                .write_partition(batch?, &partition, WriteMode::Default)
                .await?;
        }
    }
    let mut actions: Vec<Action> = writer
        .flush()
        .await?
        .into_iter()
        .map(|mut add| {
            add.data_change = false;
            Action::Add(add)
        })
        .collect();
    actions.extend(files.into_iter().map(|f| Action::Remove(f.remove)));
    let operation = DeltaOperation::Optimize {
        predicate: Some(format!("{PARTITION_COLUMN} = '{date}'")),
        target_size: MAX_MERGE_BYTES,
    };
    let committed = CommitBuilder::default()
        .with_actions(actions)
        .build(Some(table.snapshot()?), table.log_store(), operation)
        .await?;
    table.state = Some(committed.snapshot());
    Ok(())
}

/// Deletes the merged-away files older than the table's retention.
async fn vacuum(table: &mut DeltaTable) -> Result<(), DeltaError> {
    let (vacuumed, _) = table.clone().vacuum().await?;
    *table = vacuumed;
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_grow_by_the_fan_in() {
        assert_eq!(size_class(0), 0);
        assert_eq!(size_class(BASE_BYTES * FAN_IN as i64 - 1), 0);
        assert_eq!(size_class(BASE_BYTES * FAN_IN as i64), 1);
        assert_eq!(size_class(BASE_BYTES * (FAN_IN * FAN_IN) as i64 - 1), 1);
        assert_eq!(size_class(BASE_BYTES * (FAN_IN * FAN_IN) as i64), 2);
        assert_eq!(size_class(i64::MAX), size_class(i64::MAX - 1));
    }
}

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
//! most [`MAX_MERGE_BYTES`] (under clearing load `FAN_IN` commits of the `events` table are
//! ~36 MB; their merge result is not merged again). It is written on a blocking thread while
//! the relay goes on appending, and committed by the first append after it is done: a
//! relay's commit never waits for a merge (it did, when merges ran in the relay's task,
//! adding 0.3 s to the OpenLineage lag's p99 under load). One merge per table is in flight
//! at a time, so the files it merges stay live until its commit.
//!
//! The merged-away files stay on disk for the table's `delta.deletedFileRetentionDuration`
//! (a reader of an older version may still be reading them) and are then deleted by a
//! vacuum that follows a merge, at most every ten minutes ([`table_properties`] sets the
//! retentions).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delta_kernel::expressions::Scalar;
use deltalake::kernel::transaction::CommitBuilder;
use deltalake::kernel::{Action, Add, Remove};
use deltalake::logstore::object_store::ObjectStoreExt;
use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use deltalake::parquet::column::writer::ColumnCloseResult;
use deltalake::parquet::errors::ParquetError;
use deltalake::parquet::file::metadata::{PageIndexPolicy, ParquetMetaDataReader};
use deltalake::parquet::file::properties::WriterProperties;
use deltalake::parquet::file::reader::ChunkReader;
use deltalake::parquet::file::writer::SerializedFileWriter;
use deltalake::protocol::DeltaOperation;
use deltalake::writer::{DeltaWriter, RecordBatchWriter, WriteMode};
use deltalake::{DeltaTable, DeltaTableError};
use indexmap::IndexMap;
use tokio::task::JoinHandle;

use crate::table::{DeltaError, PARTITION_COLUMN, writer_properties};

/// Files of one size class merged at once.
pub const FAN_IN: usize = 8;
/// Files below this size are all of the smallest class.
pub const BASE_BYTES: i64 = 64 * 1024;
/// The most bytes one merge reads: files that would need more stay as they are.
pub const MAX_MERGE_BYTES: i64 = 64 * 1024 * 1024;

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
    /// Its statistics as the log holds them (JSON), if it has any.
    stats: Option<String>,
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
    /// The partition being merged and the merge, written on a blocking thread; committed
    /// by the first append after it is done, by an idle relay's
    /// [`Compactor::commit_if_done`], or by [`Compactor::finish`].
    in_flight: Option<(String, Merge)>,
}

/// A merge being written: the actions that swap its files, when done.
type Merge = JoinHandle<Result<Vec<Action>, DeltaError>>;

impl Compactor {
    /// Commits the merge in flight if it is done, then starts the next one the partitions
    /// just written need. Never waits for a merge. A failure is logged, not returned: the
    /// append is committed, and the next append compacts again.
    pub(crate) async fn after_append(
        &mut self,
        table: &mut DeltaTable,
        dates: &[String],
        unique_columns: &'static [&'static str],
    ) {
        self.commit_if_done(table).await;
        if self.in_flight.is_none() {
            self.start(table, dates, unique_columns);
        }
    }

    /// Whether a merge is being written or waits for its commit.
    pub(crate) fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Commits the merge in flight if it is done; never waits for one. A relay with no
    /// events to append calls it, so that a finished merge does not wait for traffic.
    pub(crate) async fn commit_if_done(&mut self, table: &mut DeltaTable) {
        if self
            .in_flight
            .as_ref()
            .is_some_and(|(_, merge)| merge.is_finished())
        {
            self.finish(table).await;
        }
    }

    /// Starts merging the first of `dates`' partitions that holds [`FAN_IN`] files of one
    /// size class.
    fn start(
        &mut self,
        table: &DeltaTable,
        dates: &[String],
        unique_columns: &'static [&'static str],
    ) {
        for date in dates {
            match files_to_merge(table, date) {
                Ok(Some(files)) => {
                    let (table, partition) = (table.clone(), date.clone());
                    // Parquet decoding and encoding of up to MAX_MERGE_BYTES: on a thread
                    // of its own, off the runtime's workers and the relay's commits.
                    let merge = tokio::task::spawn_blocking(move || {
                        tokio::runtime::Builder::new_current_thread()
                            .build()
                            .map_err(|e| DeltaTableError::Generic(e.to_string()))?
                            .block_on(rewrite(&table, &partition, files, unique_columns))
                    });
                    self.in_flight = Some((date.clone(), merge));
                    return;
                }
                Ok(None) => {}
                Err(e) => warn_failed(table, date, &e),
            }
        }
    }

    /// Waits for the merge in flight, if any, commits it, then vacuums what the table's
    /// retention lets go (at most every [`VACUUM_EVERY`]). A sink that stops calls this, so
    /// that no merged file is left on disk without a commit naming it.
    pub(crate) async fn finish(&mut self, table: &mut DeltaTable) {
        let Some((date, merge)) = self.in_flight.take() else {
            return;
        };
        let committed = match merge.await {
            Ok(Ok(actions)) => commit(table, &date, actions).await,
            Ok(Err(e)) => Err(e),
            Err(e) => {
                Err(DeltaTableError::Generic(format!("the merge's thread failed: {e}")).into())
            }
        };
        if let Err(e) = committed {
            return warn_failed(table, &date, &e);
        }
        if self
            .last_vacuum
            .is_none_or(|at| at.elapsed() >= VACUUM_EVERY)
        {
            match vacuum(table).await {
                Ok(()) => self.last_vacuum = Some(Instant::now()),
                Err(e) => warn_failed(table, &date, &e),
            }
        }
    }
}

fn warn_failed(table: &DeltaTable, partition: &str, error: &DeltaError) {
    tracing::warn!(
        table = %table.table_url(),
        partition,
        error = %error,
        "compacting the Delta table's small files failed; the next append tries again"
    );
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
                stats: file.stats(),
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

/// Rewrites `files` as one file of `date`'s partition: the actions that swap them.
///
/// Files of one schema (all of them but across a schema change) are concatenated: their
/// row groups' column chunks are copied as they are, byte for byte, under one footer, and
/// the merged file's statistics are the files' own combined. Decoding and encoding them
/// again, as files of different schemas still are, cost a node under clearing load more
/// than writing them had (8.9 % of its CPU against ~3 %).
async fn rewrite(
    table: &DeltaTable,
    date: &str,
    files: Vec<DataFile>,
    unique_columns: &[&str],
) -> Result<Vec<Action>, DeltaError> {
    let store = table.object_store();
    let mut sources = Vec::with_capacity(files.len());
    for file in &files {
        let bytes = store
            .get(&file.path)
            .await
            .map_err(deltalake::DeltaTableError::from)?
            .bytes()
            .await
            .map_err(deltalake::DeltaTableError::from)?;
        sources.push(bytes);
    }
    let stats: Vec<Option<&str>> = files.iter().map(|f| f.stats.as_deref()).collect();
    let add = match concatenate(&sources).map_err(deltalake::DeltaTableError::from)? {
        Some(merged) => {
            let path = format!(
                "{PARTITION_COLUMN}={date}/part-00000-{}-c000.snappy.parquet",
                uuid::Uuid::now_v7()
            );
            let size = merged.len() as i64;
            store
                .put(&deltalake::Path::from(path.as_str()), merged.into())
                .await
                .map_err(deltalake::DeltaTableError::from)?;
            vec![Add {
                path,
                partition_values: HashMap::from([(
                    PARTITION_COLUMN.to_owned(),
                    Some(date.to_owned()),
                )]),
                size,
                modification_time: chrono::Utc::now().timestamp_millis(),
                data_change: false,
                stats: combined_stats(&stats),
                ..Add::default()
            }]
        }
        None => reencode(table, date, sources, unique_columns).await?,
    };
    let mut actions: Vec<Action> = add
        .into_iter()
        .map(|mut add| {
            add.data_change = false;
            Action::Add(add)
        })
        .collect();
    actions.extend(files.into_iter().map(|f| Action::Remove(f.remove)));
    Ok(actions)
}

/// The files as one, their row groups copied in order; `None` if their schemas differ.
fn concatenate<R: ChunkReader>(sources: &[R]) -> Result<Option<Vec<u8>>, ParquetError> {
    let metadata = sources
        .iter()
        .map(|bytes| {
            ParquetMetaDataReader::new()
                .with_page_index_policy(PageIndexPolicy::Optional)
                .parse_and_finish(bytes)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let Some(first) = metadata.first() else {
        return Ok(None);
    };
    let schema = first.file_metadata().schema();
    let key_value = first.file_metadata().key_value_metadata();
    if metadata.iter().any(|m| {
        m.file_metadata().schema() != schema || m.file_metadata().key_value_metadata() != key_value
    }) {
        return Ok(None);
    }
    let properties = WriterProperties::builder()
        .set_created_by(format!("aether-lineage {}", env!("CARGO_PKG_VERSION")))
        .set_key_value_metadata(key_value.cloned())
        .build();
    let mut writer = SerializedFileWriter::new(
        Vec::new(),
        first.file_metadata().schema_descr().root_schema_ptr(),
        Arc::new(properties),
    )?;
    for (bytes, metadata) in sources.iter().zip(&metadata) {
        for (g, group) in metadata.row_groups().iter().enumerate() {
            let mut out = writer.next_row_group()?;
            for (c, column) in group.columns().iter().enumerate() {
                out.append_column(
                    bytes,
                    ColumnCloseResult {
                        bytes_written: column.compressed_size() as u64,
                        rows_written: group.num_rows() as u64,
                        metadata: column.clone(),
                        bloom_filter: None,
                        column_index: metadata
                            .column_index()
                            .and_then(|i| i.get(g)?.get(c).cloned()),
                        offset_index: metadata
                            .offset_index()
                            .and_then(|i| i.get(g)?.get(c).cloned()),
                    },
                )?;
            }
            out.close()?;
        }
    }
    writer.into_inner().map(Some)
}

/// The files decoded and written again as one (files of different schemas).
async fn reencode<R: ChunkReader + 'static>(
    table: &DeltaTable,
    date: &str,
    sources: Vec<R>,
    unique_columns: &[&str],
) -> Result<Vec<Add>, DeltaError> {
    let mut writer = RecordBatchWriter::for_table(table)?
        .with_writer_properties(writer_properties(unique_columns));
    let partition =
        IndexMap::from([(PARTITION_COLUMN.to_owned(), Scalar::String(date.to_owned()))]);
    for bytes in sources {
        let reader = ParquetRecordBatchReaderBuilder::try_new(bytes)
            .and_then(|b| b.build())
            .map_err(deltalake::DeltaTableError::from)?;
        for batch in reader {
            writer
                .write_partition(batch?, &partition, WriteMode::Default)
                .await?;
        }
    }
    Ok(writer.flush().await?)
}

/// The statistics of files merged into one, from theirs (Delta's per-file JSON: the row
/// count, and per column the least and greatest value and the null count): counts added,
/// the least of the least values, the greatest of the greatest. A column some file has no
/// value for, or values that do not compare, gets none (a reader then does not skip the
/// file on it); no statistics if a file has none.
fn combined_stats(stats: &[Option<&str>]) -> Option<String> {
    use serde_json::Value;
    let parsed = stats
        .iter()
        .map(|s| serde_json::from_str::<Value>((*s)?).ok())
        .collect::<Option<Vec<Value>>>()?;
    let field = |name: &str| -> Vec<&Value> { parsed.iter().filter_map(|s| s.get(name)).collect() };
    let records: u64 = parsed
        .iter()
        .map(|s| s.get("numRecords")?.as_u64())
        .sum::<Option<u64>>()?;
    let mut out = serde_json::Map::from_iter([("numRecords".to_owned(), Value::from(records))]);
    for (name, combine) in [
        ("minValues", Combine::Least),
        ("maxValues", Combine::Greatest),
        ("nullCount", Combine::Sum),
    ] {
        let values = field(name);
        if values.len() == parsed.len()
            && let Some(v) = combine.all(&values)
        {
            out.insert(name.to_owned(), v);
        }
    }
    Some(Value::Object(out).to_string())
}

#[derive(Clone, Copy)]
enum Combine {
    Least,
    Greatest,
    Sum,
}

impl Combine {
    /// The values combined, objects member by member (those every one has); `None` if they
    /// do not combine.
    fn all(self, values: &[&serde_json::Value]) -> Option<serde_json::Value> {
        use serde_json::Value;
        let (first, rest) = values.split_first()?;
        if let Value::Object(first) = first {
            let members = first.iter().filter_map(|(key, value)| {
                let mut column = vec![value];
                for v in rest {
                    column.push(v.as_object()?.get(key)?);
                }
                Some((key.clone(), self.all(&column)?))
            });
            return Some(Value::Object(members.collect()));
        }
        rest.iter()
            .try_fold((*first).clone(), |acc, v| self.two(&acc, v))
    }

    fn two(self, a: &serde_json::Value, b: &serde_json::Value) -> Option<serde_json::Value> {
        use serde_json::Value;
        use std::cmp::Ordering;
        let order = match (a, b) {
            (Value::String(x), Value::String(y)) => x.cmp(y),
            (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
                (Some(x), Some(y)) if matches!(self, Combine::Sum) => {
                    return x.checked_add(y).map(Value::from);
                }
                (Some(x), Some(y)) => x.cmp(&y),
                _ if matches!(self, Combine::Sum) => return None,
                _ => x.as_f64()?.partial_cmp(&y.as_f64()?)?,
            },
            _ => return None,
        };
        let keep_a = match self {
            Combine::Least => order != Ordering::Greater,
            Combine::Greatest => order != Ordering::Less,
            Combine::Sum => return None,
        };
        Some(if keep_a { a.clone() } else { b.clone() })
    }
}

/// Commits a rewrite of `date`'s partition. The files it removes are still live: only
/// this compactor removes files, one merge at a time.
async fn commit(
    table: &mut DeltaTable,
    date: &str,
    actions: Vec<Action>,
) -> Result<(), DeltaError> {
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

    #[test]
    fn merged_statistics_bound_every_file_and_drop_what_does_not_combine() {
        let a = r#"{"numRecords":3,"minValues":{"seq":4,"t":"2026-12-07T10:00:00.000Z","x":1.5,"s":{"k":"b"}},"maxValues":{"seq":6,"t":"2026-12-07T10:00:02.000Z","x":2,"s":{"k":"c"}},"nullCount":{"seq":0,"x":1,"s":{"k":0}}}"#;
        let b = r#"{"numRecords":2,"minValues":{"seq":1,"t":"2026-12-07T09:59:59.000Z","x":-1,"s":{"k":"a"},"only_b":1},"maxValues":{"seq":2,"t":"2026-12-07T10:00:05.000Z","x":"z","s":{"k":"d"}},"nullCount":{"seq":0,"x":2,"s":{"k":1}}}"#;
        let merged: serde_json::Value =
            serde_json::from_str(&combined_stats(&[Some(a), Some(b)]).unwrap()).unwrap();
        assert_eq!(
            merged,
            serde_json::json!({
                "numRecords": 5,
                "minValues": {"seq": 1, "t": "2026-12-07T09:59:59.000Z", "x": -1, "s": {"k": "a"}},
                // "x": a number and a string do not compare, so no bound.
                "maxValues": {"seq": 6, "t": "2026-12-07T10:00:05.000Z", "s": {"k": "d"}},
                "nullCount": {"seq": 0, "x": 3, "s": {"k": 1}},
            })
        );
        // A file without statistics: the merged file has none.
        assert_eq!(combined_stats(&[Some(a), None]), None);
        assert_eq!(combined_stats(&[Some(a), Some("not json")]), None);
    }
}

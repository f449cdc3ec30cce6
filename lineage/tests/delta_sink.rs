//! The Delta sink against real tables in a temporary directory: versions and last seq survive
//! a reopen, replays write nothing, gaps and broken chains are refused, the parquet files hold
//! exactly the appended rows partitioned by date, commits carry the seq range, last hash and
//! an application transaction, and checkpoints are written.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use aether_ledger::RecordedEvent;
use aether_ledger::hashing::{GENESIS_PREV_HASH, HashedFields, event_hash};
use aether_lineage::compaction::FAN_IN;
use aether_lineage::delta::{CHECKPOINT_INTERVAL, DeltaError, DeltaSink};
use chrono::{DateTime, Duration, TimeZone, Utc};
use deltalake::arrow::array::{Array, Int64Array, StringArray, TimestampMicrosecondArray};
use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use deltalake::parquet::file::reader::{FileReader, SerializedFileReader};
use serde_json::value::RawValue;
use uuid::Uuid;

mod support;
use support::TempData;

/// `n` chained events from seq 1, five hours apart (so they span several dates).
fn chain(n: u64) -> Vec<RecordedEvent> {
    chain_every(n, Duration::hours(5))
}

/// `n` chained events from seq 1, `step` apart from 2026-03-01 20:00 UTC.
fn chain_every(n: u64, step: Duration) -> Vec<RecordedEvent> {
    let start: DateTime<Utc> = Utc.with_ymd_and_hms(2026, 3, 1, 20, 0, 0).unwrap();
    let mut prev = GENESIS_PREV_HASH;
    (1..=n)
        .map(|seq| {
            let event = make(seq, prev, start + step * seq as i32);
            prev = event.hash;
            event
        })
        .collect()
}

fn make(seq: u64, prev_hash: aether_ledger::Hash, recorded_at: DateTime<Utc>) -> RecordedEvent {
    let stream_id = format!("policy-{}", seq % 2);
    let payload = format!(r#"{{"n":{seq}}}"#);
    let metadata = r#"{"actor":"test"}"#.to_string();
    let event_id = Uuid::from_u128(0xae7e_0000_0000_7000_8000_0000_0000_0000 | u128::from(seq));
    let hash = event_hash(
        &prev_hash,
        &HashedFields {
            seq,
            stream_id: &stream_id,
            stream_version: seq.div_ceil(2),
            event_id,
            event_type: "policy.ingest",
            schema_version: 1,
            payload: &payload,
            metadata: &metadata,
            recorded_at,
        },
    );
    RecordedEvent {
        seq,
        stream_id,
        stream_version: seq.div_ceil(2),
        event_id,
        event_type: "policy.ingest".into(),
        schema_version: 1,
        payload: RawValue::from_string(payload).unwrap(),
        metadata: RawValue::from_string(metadata).unwrap(),
        recorded_at,
        prev_hash,
        hash,
    }
}

fn hex(h: &[u8]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

/// One row as read back from a parquet file, with its file's `date=` partition.
#[derive(Debug)]
struct Row {
    seq: i64,
    hash: String,
    prev_hash: String,
    recorded_at_micros: i64,
    partition_date: String,
}

/// Every row of every active file of the table, read with `deltalake::parquet`.
fn read_rows(sink: &DeltaSink) -> Vec<Row> {
    let uris: Vec<String> = sink.table().get_file_uris().unwrap().collect();
    assert!(!uris.is_empty());
    let mut rows = Vec::new();
    for uri in uris {
        let path = uri.strip_prefix("file://").unwrap_or(&uri).to_string();
        let partition_date = Path::new(&path)
            .parent()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("date="))
            .unwrap_or_else(|| panic!("{path} is not under a date= partition"))
            .to_string();
        let file = std::fs::File::open(&path).unwrap();
        let reader = ParquetRecordBatchReaderBuilder::try_new(file)
            .unwrap()
            .build()
            .unwrap();
        for batch in reader {
            let batch = batch.unwrap();
            assert!(
                batch.column_by_name("date").is_none(),
                "partition column stored in the file"
            );
            let col = |name: &str| batch.column_by_name(name).unwrap().clone();
            let seq = col("seq");
            let seq = seq.as_any().downcast_ref::<Int64Array>().unwrap();
            let hash = col("hash");
            let hash = hash.as_any().downcast_ref::<StringArray>().unwrap();
            let prev = col("prev_hash");
            let prev = prev.as_any().downcast_ref::<StringArray>().unwrap();
            let at = col("recorded_at");
            let at = at
                .as_any()
                .downcast_ref::<TimestampMicrosecondArray>()
                .unwrap();
            for i in 0..batch.num_rows() {
                rows.push(Row {
                    seq: seq.value(i),
                    hash: hash.value(i).to_string(),
                    prev_hash: prev.value(i).to_string(),
                    recorded_at_micros: at.value(i),
                    partition_date: partition_date.clone(),
                });
            }
        }
    }
    rows
}

/// The actions of one commit, read straight from `_delta_log`.
fn log_actions(table_dir: &Path, version: i64) -> Vec<serde_json::Value> {
    let path = table_dir
        .join("_delta_log")
        .join(format!("{version:020}.json"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn appends_survive_reopen_replays_write_nothing_and_gaps_are_refused() {
    let data = TempData::new("reopen");
    let location = data.events_table();
    let events = chain(12);

    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    assert_eq!((sink.version(), sink.last_seq()), (0, 0));
    assert_eq!(sink.append(&events[0..4]).await.unwrap(), Some(1));
    assert_eq!(sink.append(&events[4..7]).await.unwrap(), Some(2));
    assert_eq!(sink.append(&events[7..10]).await.unwrap(), Some(3));
    assert_eq!(sink.append::<RecordedEvent>(&[]).await.unwrap(), None);
    drop(sink);

    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    assert_eq!((sink.version(), sink.last_seq()), (3, 10));

    // Replays after a crash: nothing new, no commit.
    assert_eq!(sink.append(&events[4..7]).await.unwrap(), None);
    assert_eq!(sink.append(&events[0..10]).await.unwrap(), None);
    assert_eq!(sink.version(), 3);

    // A gap (seq 11 missing) is refused and writes nothing.
    let err = sink.append(&events[11..12]).await.unwrap_err();
    assert!(
        matches!(
            err,
            DeltaError::Gap {
                expected: 11,
                found: 12
            }
        ),
        "{err}"
    );
    // So is a batch that is contiguous in seq but not in hash.
    let forged = make(11, [7u8; 32], events[10].recorded_at);
    let err = sink.append(&[forged]).await.unwrap_err();
    assert!(
        matches!(err, DeltaError::ChainBroken { seq: 11, .. }),
        "{err}"
    );
    // And a gap inside a batch.
    let err = sink
        .append(&[events[10].clone(), events[11].clone(), events[11].clone()])
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            DeltaError::Gap {
                expected: 13,
                found: 12
            }
        ),
        "{err}"
    );
    assert_eq!((sink.version(), sink.last_seq()), (3, 10));

    // A replay that overlaps the end of the table writes only the new events.
    assert_eq!(sink.append(&events[8..12]).await.unwrap(), Some(4));
    assert_eq!(sink.last_seq(), 12);
    drop(sink);
    let sink = DeltaSink::open_or_create(&location).await.unwrap();
    assert_eq!((sink.version(), sink.last_seq()), (4, 12));

    // The files hold exactly the appended rows, each seq once, partitioned by date.
    let rows = read_rows(&sink);
    let mut by_seq: BTreeMap<i64, &Row> = BTreeMap::new();
    for row in &rows {
        assert!(
            by_seq.insert(row.seq, row).is_none(),
            "seq {} twice",
            row.seq
        );
    }
    assert_eq!(rows.len(), events.len());
    let mut dates = std::collections::BTreeSet::new();
    for e in &events {
        let row = by_seq
            .get(&(e.seq as i64))
            .unwrap_or_else(|| panic!("seq {} missing", e.seq));
        assert_eq!(row.hash, hex(&e.hash));
        assert_eq!(row.prev_hash, hex(&e.prev_hash));
        assert_eq!(row.recorded_at_micros, e.recorded_at.timestamp_micros());
        let date = e.recorded_at.format("%Y-%m-%d").to_string();
        assert_eq!(row.partition_date, date, "seq {}", e.seq);
        dates.insert(date);
    }
    assert!(dates.len() >= 3, "events should span several dates");
}

#[tokio::test]
async fn commits_carry_seq_range_last_hash_and_an_application_transaction() {
    let data = TempData::new("meta");
    let location = data.events_table();
    let events = chain(7);
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    sink.append(&events[0..3]).await.unwrap();
    assert_eq!(sink.append(&events[3..7]).await.unwrap(), Some(2));

    // Through the sink.
    let meta = sink.commit_metadata(2).await.unwrap().unwrap();
    assert_eq!(meta["aether.first_seq"], 4);
    assert_eq!(meta["aether.last_seq"], 7);
    assert_eq!(meta["aether.last_hash"], hex(&events[6].hash));

    // Straight from the log: commit info and the `txn` action of the last version.
    let actions = log_actions(&location, sink.version());
    let info = actions
        .iter()
        .find_map(|a| a.get("commitInfo"))
        .expect("commitInfo");
    assert_eq!(info["aether.first_seq"], 4);
    assert_eq!(info["aether.last_seq"], 7);
    assert_eq!(info["aether.last_hash"], hex(&events[6].hash));
    let txn = actions
        .iter()
        .find_map(|a| a.get("txn"))
        .expect("txn action");
    assert_eq!(txn["appId"], "aether-ledger");
    assert_eq!(txn["version"], 7);
    let first = log_actions(&location, 1);
    let info = first.iter().find_map(|a| a.get("commitInfo")).unwrap();
    assert_eq!(
        (&info["aether.first_seq"], &info["aether.last_seq"]),
        (&serde_json::json!(1), &serde_json::json!(3))
    );

    // The table's configuration asks for checkpoints.
    let created = log_actions(&location, 0);
    let config = created
        .iter()
        .find_map(|a| a.get("metaData"))
        .map(|m| &m["configuration"])
        .unwrap();
    assert_eq!(
        config["delta.checkpointInterval"],
        CHECKPOINT_INTERVAL.to_string()
    );
    assert_eq!(
        config["delta.deletedFileRetentionDuration"],
        "interval 1 hours"
    );
    assert_eq!(config["delta.logRetentionDuration"], "interval 1 days");
}

#[tokio::test]
async fn checkpoints_are_written_and_state_is_recovered_from_them() {
    let data = TempData::new("checkpoint");
    let location = data.events_table();
    let interval = CHECKPOINT_INTERVAL as i64;
    // Five hours apart: no partition gets enough files to be compacted, so every commit
    // is an append.
    let events = chain(CHECKPOINT_INTERVAL + 2);
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(
            sink.append(std::slice::from_ref(e)).await.unwrap(),
            Some(i as i64 + 1)
        );
    }
    let log = location.join("_delta_log");
    let checkpoint = interval - 1;
    assert!(
        log.join(format!("{checkpoint:020}.checkpoint.parquet"))
            .exists(),
        "no checkpoint at version {checkpoint}"
    );
    assert!(log.join("_last_checkpoint").exists());
    // The commits the checkpoint covers could now be cleaned up; state must come from the
    // checkpoint plus the later commits. Hide them to prove it.
    for v in 0..=checkpoint {
        std::fs::remove_file(log.join(format!("{v:020}.json"))).unwrap();
    }
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    assert_eq!(
        (sink.version(), sink.last_seq()),
        (interval + 2, events.len() as u64)
    );
    assert_eq!(sink.append(&events).await.unwrap(), None);
    assert_eq!(read_rows(&sink).len(), events.len());
}

#[tokio::test]
async fn data_files_are_snappy_and_keep_dictionaries_for_repeated_values_only() {
    use deltalake::parquet::basic::Compression;
    use deltalake::parquet::file::reader::{FileReader, SerializedFileReader};

    let data = TempData::new("encodings");
    let location = data.events_table();
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    sink.append(&chain(40)).await.unwrap();
    let uris: Vec<String> = sink.table().get_file_uris().unwrap().collect();
    assert!(!uris.is_empty());
    for uri in uris {
        let path = uri.strip_prefix("file://").unwrap_or(&uri).to_string();
        let reader = SerializedFileReader::new(std::fs::File::open(&path).unwrap()).unwrap();
        for group in reader.metadata().row_groups() {
            let chunk = |name: &str| {
                group
                    .columns()
                    .iter()
                    .find(|c| c.column_path().string() == name)
                    .unwrap_or_else(|| panic!("{path} has no column {name}"))
                    .clone()
            };
            for name in ["event_id", "payload", "metadata", "prev_hash", "hash"] {
                let c = chunk(name);
                assert!(
                    c.dictionary_page_offset().is_none(),
                    "{name} has a dictionary in {path}"
                );
                assert!(matches!(c.compression(), Compression::SNAPPY), "{name}");
            }
            // One event type and one stream in the whole chain: a dictionary pays.
            for name in ["event_type", "stream_id"] {
                assert!(
                    chunk(name).dictionary_page_offset().is_some(),
                    "{name} has no dictionary in {path}"
                );
            }
        }
    }
}

/// The data files under the table's directory, live or not, relative to it.
fn parquet_files_on_disk(table_dir: &Path) -> BTreeSet<String> {
    fn walk(dir: &Path, table_dir: &Path, found: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if !path.ends_with("_delta_log") {
                    walk(&path, table_dir, found);
                }
            } else if path.extension().is_some_and(|e| e == "parquet") {
                let relative = path.strip_prefix(table_dir).unwrap();
                found.insert(relative.to_string_lossy().into_owned());
            }
        }
    }
    let mut found = BTreeSet::new();
    walk(table_dir, table_dir, &mut found);
    found
}

#[tokio::test]
async fn many_small_appends_are_merged_with_every_row_kept_once() {
    let data = TempData::new("compaction");
    let location = data.events_table();
    // A minute apart: all on one date, one file per append.
    let events = chain_every(100, Duration::minutes(1));
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    let live = |sink: &DeltaSink| sink.table().get_file_uris().unwrap().count();
    let (mut most_after_append, mut most_after_merge) = (0, 0);
    for e in &events {
        sink.append(std::slice::from_ref(e)).await.unwrap();
        most_after_append = most_after_append.max(live(&sink));
        // The merge an append starts is written off the append's path; wait for it here.
        sink.finish_compaction().await;
        most_after_merge = most_after_merge.max(live(&sink));
    }
    // Without compaction the table would hold 100 files; it holds FAN_IN only until the
    // append that made them FAN_IN has its merge committed.
    assert_eq!(most_after_append, FAN_IN);
    assert!(most_after_merge < FAN_IN, "{most_after_merge} live files");

    // Every row exactly once, in a chain, in the one partition.
    let rows = read_rows(&sink);
    let mut seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=100).collect::<Vec<i64>>());
    let by_seq: BTreeMap<i64, &Row> = rows.iter().map(|r| (r.seq, r)).collect();
    for (seq, row) in &by_seq {
        assert_eq!(row.hash, hex(&events[*seq as usize - 1].hash));
        if let Some(prev) = by_seq.get(&(seq - 1)) {
            assert_eq!(row.prev_hash, prev.hash);
        }
        assert_eq!(row.partition_date, "2026-03-01");
    }

    // The merges are commits of their own that change no data.
    let merges: Vec<Vec<serde_json::Value>> = (0..=sink.version())
        .map(|v| log_actions(&location, v))
        .filter(|actions| {
            actions
                .iter()
                .any(|a| a["commitInfo"]["operation"] == "OPTIMIZE")
        })
        .collect();
    assert!(!merges.is_empty(), "no compaction commit");
    for actions in &merges {
        let changes: Vec<&serde_json::Value> = actions
            .iter()
            .filter_map(|a| a.get("add").or_else(|| a.get("remove")))
            .collect();
        assert_eq!(changes.len(), FAN_IN + 1, "{actions:?}");
        assert!(
            changes.iter().all(|c| c["dataChange"] == false),
            "{actions:?}"
        );
        // The merged file's statistics are its rows': the oldest files are merged, so
        // its seqs are consecutive, and a reader skipping files by seq finds them.
        let add = actions.iter().find_map(|a| a.get("add")).unwrap();
        let stats: serde_json::Value =
            serde_json::from_str(add["stats"].as_str().expect("stats")).unwrap();
        let records = stats["numRecords"].as_i64().unwrap();
        let (least, greatest) = (
            stats["minValues"]["seq"].as_i64().unwrap(),
            stats["maxValues"]["seq"].as_i64().unwrap(),
        );
        assert_eq!(greatest - least + 1, records, "{stats}");
        assert!(records >= FAN_IN as i64, "{stats}");
        assert_eq!(stats["nullCount"]["seq"], 0, "{stats}");
        assert!(
            stats["minValues"]["hash"].as_str() <= stats["maxValues"]["hash"].as_str(),
            "{stats}"
        );
        // Concatenated, not decoded and encoded again: the merged file holds its sources'
        // row groups as they were, one row each (one event an append).
        let merged = std::fs::File::open(location.join(add["path"].as_str().unwrap())).unwrap();
        let reader = SerializedFileReader::new(merged).unwrap();
        assert_eq!(
            reader.metadata().num_row_groups() as i64,
            records,
            "{stats}"
        );
        assert_eq!(reader.metadata().file_metadata().num_rows(), records);
    }

    // After a reopen the sink still knows the last hash, though the newest commits are
    // compactions and vacuums: a broken chain is refused, the right event taken.
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    assert_eq!(sink.last_seq(), 100);
    let next = make(101, events[99].hash, events[99].recorded_at);
    let broken = make(101, events[98].hash, events[99].recorded_at);
    assert!(matches!(
        sink.append(&[broken]).await,
        Err(DeltaError::ChainBroken { seq: 101, .. })
    ));
    assert!(sink.append(&[next]).await.unwrap().is_some());
    assert_eq!(read_rows(&sink).len(), 101);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_go_on_while_merges_are_written_and_lose_or_double_no_row() {
    let data = TempData::new("overlap");
    let location = data.events_table();
    let events = chain_every(204, Duration::minutes(1));
    // 204 = FAN_IN + 28 × (FAN_IN - 1): when each merge is done by the next append, the
    // last append starts one, which finishing must commit.
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    // As a relay appends: merges run beside the appends, each committed by a later one.
    for e in &events {
        sink.append(std::slice::from_ref(e)).await.unwrap();
    }
    sink.finish_compaction().await;

    let rows = read_rows(&sink);
    let mut seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=204).collect::<Vec<i64>>());
    let versions: Vec<Vec<serde_json::Value>> = (0..=sink.version())
        .map(|v| log_actions(&location, v))
        .collect();
    let merges = versions
        .iter()
        .filter(|actions| {
            actions
                .iter()
                .any(|a| a["commitInfo"]["operation"] == "OPTIMIZE")
        })
        .count();
    assert!(merges >= 1, "no compaction commit");
    // Each merge swapped FAN_IN files for one, once.
    assert_eq!(
        sink.table().get_file_uris().unwrap().count(),
        204 - merges * (FAN_IN - 1)
    );
    // Every data file on disk was added by a commit: finishing left no merge's file behind
    // (a merge still running once the sink is gone would land its file in this pause).
    drop(sink);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let added: BTreeSet<String> = versions
        .iter()
        .flatten()
        .filter_map(|a| a["add"]["path"].as_str().map(str::to_owned))
        .collect();
    let on_disk = parquet_files_on_disk(&location);
    let orphans: Vec<&String> = on_disk.difference(&added).collect();
    assert!(
        orphans.is_empty(),
        "data files no commit added: {orphans:?}"
    );

    // A reopened sink takes the next event in the chain.
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    let next = make(205, events[203].hash, events[203].recorded_at);
    assert!(sink.append(&[next]).await.unwrap().is_some());
}

#[tokio::test]
async fn merged_away_files_are_deleted_once_the_tables_retention_has_passed() {
    let data = TempData::new("vacuum");
    let location = data.events_table();
    let sink = DeltaSink::open_or_create(&location).await.unwrap();
    // An operator's setting is kept: retain merged-away files for no time at all.
    sink.table()
        .clone()
        .set_tbl_properties()
        .with_properties(std::collections::HashMap::from([(
            "delta.deletedFileRetentionDuration".to_owned(),
            "interval 0 seconds".to_owned(),
        )]))
        .await
        .unwrap();
    let mut sink = DeltaSink::open_or_create(&location).await.unwrap();
    let events = chain_every(FAN_IN as u64, Duration::minutes(1));
    for e in &events[..FAN_IN - 1] {
        sink.append(std::slice::from_ref(e)).await.unwrap();
    }
    assert_eq!(parquet_files_on_disk(&location).len(), FAN_IN - 1);
    // The FAN_IN-th file is merged with the others, and they are deleted from disk.
    sink.append(&events[FAN_IN - 1..]).await.unwrap();
    sink.finish_compaction().await;
    assert_eq!(sink.table().get_file_uris().unwrap().count(), 1);
    assert_eq!(parquet_files_on_disk(&location).len(), 1);
    assert_eq!(read_rows(&sink).len(), FAN_IN);
}

#[tokio::test]
async fn a_table_from_before_compaction_gets_the_retentions_and_keeps_its_checkpoints() {
    let data = TempData::new("upgrade");
    let location = data.events_table();
    DeltaSink::open_or_create(&location).await.unwrap();
    // What an earlier release created: a checkpoint every 10 commits, no retentions.
    let creation = location.join("_delta_log").join(format!("{:020}.json", 0));
    let text = std::fs::read_to_string(&creation).unwrap();
    let lines: Vec<String> = text
        .lines()
        .map(|line| {
            let mut action: serde_json::Value = serde_json::from_str(line).unwrap();
            if let Some(metadata) = action.get_mut("metaData") {
                metadata["configuration"] = serde_json::json!({"delta.checkpointInterval": "10"});
            }
            action.to_string()
        })
        .collect();
    std::fs::write(&creation, lines.join("\n")).unwrap();

    let sink = DeltaSink::open_or_create(&location).await.unwrap();
    let configuration = sink
        .table()
        .snapshot()
        .unwrap()
        .metadata()
        .configuration()
        .clone();
    assert_eq!(configuration["delta.checkpointInterval"], "10");
    assert_eq!(
        configuration["delta.deletedFileRetentionDuration"],
        "interval 1 hours"
    );
    assert_eq!(
        configuration["delta.logRetentionDuration"],
        "interval 1 days"
    );
    // Set once: a second open commits nothing.
    let version = sink.version();
    let sink = DeltaSink::open_or_create(&location).await.unwrap();
    assert_eq!(sink.version(), version);
}

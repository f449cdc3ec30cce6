//! The Delta relay against a real SQLite ledger file and a real Delta table: every event
//! lands in exactly one commit, each commit is linked in `delta_commits`, a crash between
//! the Delta commit and its link is repaired on restart, and reconcile sees no gap.

use std::path::Path;
use std::time::Duration;

use aether_ledger::{EventStore, ExpectedVersion, NewEvent};
use aether_lineage::delta::{DeltaSink, META_FIRST_SEQ, META_LAST_SEQ};
use aether_lineage::delta_relay::{DeltaRelayConfig, commit_of, commits, run_delta_relay};
use aether_lineage::relay::reconcile;
use serde_json::json;

mod support;
use support::{TempData, append_policies as append, open_sqlite_ledger as open};

fn config(dir: &Path) -> DeltaRelayConfig {
    DeltaRelayConfig {
        location: dir.join("delta").join("events"),
        decisions: Some(dir.join("delta").join("clearing_decisions")),
        max_events: 7,
        max_wait: Duration::from_millis(20),
        storage_options: Default::default(),
    }
}

/// Runs the relay until every event up to the head is linked to a Delta commit.
async fn relay_until_caught_up(store: &EventStore, dir: &Path) {
    relay_with_until_caught_up(store, config(dir)).await;
}

/// [`relay_until_caught_up`] with the relay configured as `config`.
async fn relay_with_until_caught_up(store: &EventStore, config: DeltaRelayConfig) {
    let (stop_tx, task) = relay_caught_up(store, config).await;
    stop_tx.send(true).expect("relay running");
    task.await.expect("relay task").expect("relay result");
}

/// Starts the relay and returns, still running, once every event up to the head is linked.
async fn relay_caught_up(
    store: &EventStore,
    config: DeltaRelayConfig,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<Result<(), aether_lineage::relay::RelayError>>,
) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(run_delta_relay(store.clone(), config, stop_rx));
    let head = store.head().await.expect("head").map_or(0, |(s, _)| s);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let report = reconcile(store).await.expect("reconcile");
        if report.missing_delta.is_empty() && report.events >= head {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "relay did not catch up: {report:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (stop_tx, task)
}

/// An OpenLineage relay running on the ledger, waiting for the Delta relay's versions.
struct OpenLineageRelay {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), aether_lineage::relay::RelayError>>,
}

impl OpenLineageRelay {
    fn start(store: &EventStore) -> Self {
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(aether_lineage::relay::run_openlineage_relay(
            store.clone(),
            aether_lineage::MappingContext::new(support::BASE),
            None,
            stop_rx,
        ));
        OpenLineageRelay { stop, task }
    }

    /// Waits until every event has its record, then stops the relay.
    async fn finish_when_caught_up(self, store: &EventStore) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !reconcile(store)
            .await
            .expect("reconcile")
            .missing_openlineage
            .is_empty()
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "records never written"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop.send(true).expect("relay running");
        self.task.await.expect("task").expect("relay");
    }
}

/// The seq ranges named by the commit metadata of every table version, in order.
async fn ranges_in_log(dir: &Path) -> Vec<(u64, u64)> {
    let sink = DeltaSink::open_or_create(dir.join("delta").join("events"))
        .await
        .expect("open table");
    let mut out = Vec::new();
    for v in 0..=sink.version() {
        if let Some(meta) = sink.commit_metadata(v).await.expect("commit info")
            && let (Some(a), Some(b)) = (
                meta.get(META_FIRST_SEQ).and_then(|x| x.as_u64()),
                meta.get(META_LAST_SEQ).and_then(|x| x.as_u64()),
            )
        {
            out.push((a, b));
        }
    }
    out
}

fn assert_contiguous(ranges: &[(u64, u64)], head: u64) {
    let mut next = 1;
    for &(a, b) in ranges {
        assert_eq!(a, next, "commit ranges {ranges:?} are not contiguous");
        assert!(b >= a);
        next = b + 1;
    }
    assert_eq!(
        next,
        head + 1,
        "commit ranges {ranges:?} do not reach {head}"
    );
}

#[tokio::test]
async fn every_event_lands_in_exactly_one_linked_commit_and_a_lost_link_is_repaired() {
    let dir = TempData::new("relay");
    let store = open(&dir.0).await;
    append(&store, 1, 30).await;
    relay_until_caught_up(&store, &dir.0).await;

    let linked = commits(&store).await.expect("commits");
    assert!(
        linked.len() >= 30 / 7,
        "at most 7 events per commit: {linked:?}"
    );
    let ranges: Vec<(u64, u64)> = linked.iter().map(|c| (c.first_seq, c.last_seq)).collect();
    assert_eq!(ranges, ranges_in_log(&dir.0).await);
    assert_contiguous(&ranges, 30);
    // Each event's link names the commit that holds it.
    let c = commit_of(&store, 12)
        .await
        .expect("lookup")
        .expect("linked");
    assert!(c.first_seq <= 12 && 12 <= c.last_seq);
    assert!(commit_of(&store, 31).await.expect("lookup").is_none());

    // A crash after a Delta commit but before its link: write the commit directly.
    append(&store, 31, 5).await;
    let events = store.read_all(31, 100).await.expect("read");
    {
        let mut sink = DeltaSink::open_or_create(dir.0.join("delta").join("events"))
            .await
            .expect("open table");
        sink.append(&events)
            .await
            .expect("append")
            .expect("a commit");
    }
    let report = reconcile(&store).await.expect("reconcile");
    assert_eq!(report.missing_delta, (31..=35).collect::<Vec<u64>>());

    // The restarted relay links it from the Delta log and writes nothing twice.
    append(&store, 36, 4).await;
    relay_until_caught_up(&store, &dir.0).await;
    let ranges = ranges_in_log(&dir.0).await;
    assert_contiguous(&ranges, 39);
    let linked: Vec<(u64, u64)> = commits(&store)
        .await
        .expect("commits")
        .iter()
        .map(|c| (c.first_seq, c.last_seq))
        .collect();
    assert_eq!(linked, ranges);
    let report = reconcile(&store).await.expect("reconcile");
    assert_eq!(report.events, 39);
    assert!(report.missing_delta.is_empty(), "{report:?}");
    store.shutdown().await;
}

#[tokio::test]
async fn a_table_that_is_not_an_events_table_stops_the_relay_with_a_logged_error_not_a_panic() {
    let dir = TempData::new("foreign");
    let store = open(&dir.0).await;
    append(&store, 1, 3).await;
    // Something else at the table's location: not a Delta table but a plain file.
    std::fs::create_dir_all(dir.0.join("delta")).expect("mkdir");
    std::fs::write(dir.0.join("delta").join("events"), b"not a table").expect("write");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(run_delta_relay(store.clone(), config(&dir.0), stop_rx));
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Nothing was linked, the relay keeps retrying, and stops cleanly when asked.
    assert_eq!(
        reconcile(&store).await.expect("reconcile").missing_delta,
        vec![1, 2, 3]
    );
    assert!(!task.is_finished());
    stop_tx.send(true).expect("relay running");
    task.await.expect("relay task").expect("relay result");
    store.shutdown().await;
}

async fn decide(store: &EventStore, member: &str, request_id: &str, amount: &str) {
    store
        .append(
            &format!("clearing/{member}"),
            ExpectedVersion::Any,
            vec![
                NewEvent::new(
                    "ClearingDecided",
                    json!({
                        "request_id": request_id, "member": member, "decision": "cleared",
                        "score": 0.25, "confidence": 0.5, "model_ref": "m@r",
                        "trade": {"buyer": member, "seller": "bank-b", "currency": "SGD",
                                  "amount_minor": amount, "jurisdiction": "SG"},
                        "rules_fired": [], "cited_clauses": [], "snapshot_id": "s1",
                    }),
                )
                .with_metadata(json!({"request_id": request_id, "trace_id": "t-1"})),
            ],
        )
        .await
        .expect("append");
}

/// `(seq, request_id, amount_minor, score)` of every row of the decisions table.
fn decision_rows(dir: &Path) -> Vec<(i64, String, String, f64)> {
    use deltalake::arrow::array::{Array, Float64Array, Int64Array, StringArray};
    use deltalake::parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let mut rows = Vec::new();
    let root = dir.join("delta").join("clearing_decisions");
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).expect("read dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() && !path.ends_with("_delta_log") {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "parquet") {
                let file = std::fs::File::open(&path).expect("open");
                let reader = ParquetRecordBatchReaderBuilder::try_new(file)
                    .expect("parquet")
                    .build()
                    .expect("reader");
                for batch in reader {
                    let batch = batch.expect("batch");
                    let col = |n: &str| batch.column_by_name(n).expect(n).clone();
                    let seq = col("seq");
                    let seq = seq.as_any().downcast_ref::<Int64Array>().expect("i64");
                    let rid = col("request_id");
                    let rid = rid.as_any().downcast_ref::<StringArray>().expect("str");
                    let amount = col("amount_minor");
                    let amount = amount.as_any().downcast_ref::<StringArray>().expect("str");
                    let score = col("score");
                    let score = score.as_any().downcast_ref::<Float64Array>().expect("f64");
                    for i in 0..batch.num_rows() {
                        rows.push((
                            seq.value(i),
                            rid.value(i).to_owned(),
                            amount.value(i).to_owned(),
                            score.value(i),
                        ));
                    }
                }
            }
        }
    }
    rows.sort_by_key(|r| r.0);
    rows
}

/// The request ids of the decisions table's rows, by seq.
fn decision_ids(dir: &Path) -> Vec<String> {
    decision_rows(dir).into_iter().map(|r| r.1).collect()
}

#[tokio::test]
async fn clearing_decisions_are_flattened_once_each_across_a_restart() {
    let dir = TempData::new("decisions");
    let store = open(&dir.0).await;
    append(&store, 1, 3).await;
    decide(&store, "bank-a", "req-1", "125000").await;
    append(&store, 10, 4).await;
    decide(&store, "bank-a", "req-2", "99999999999999999999").await;
    relay_until_caught_up(&store, &dir.0).await;
    let rows = decision_rows(&dir.0);
    assert_eq!(
        rows,
        vec![
            (4, "req-1".to_owned(), "125000".to_owned(), 0.25),
            (
                9,
                "req-2".to_owned(),
                "99999999999999999999".to_owned(),
                0.25
            ),
        ]
    );
    // More events, a decision among them, and a restarted relay: each row once.
    append(&store, 20, 2).await;
    decide(&store, "bank-b", "req-3", "5").await;
    relay_until_caught_up(&store, &dir.0).await;
    relay_until_caught_up(&store, &dir.0).await;
    assert_eq!(decision_ids(&dir.0), ["req-1", "req-2", "req-3"]);
    store.shutdown().await;
}

/// Events that are waiting when a commit's deadline comes all go into that commit, not
/// one read's page of them: a relay less than a commit's worth behind catches up at once
/// rather than a page per deadline.
#[tokio::test]
async fn a_commit_at_its_deadline_takes_every_waiting_event() {
    let dir = TempData::new("deadline-takes-all");
    let store = open(&dir.0).await;
    for batch in 0..6u64 {
        let events = (0..300)
            .map(|i| NewEvent::new("PolicyIngested", json!({ "n": batch * 300 + i })))
            .collect();
        store
            .append(
                &format!("policy/bulk-{batch}"),
                ExpectedVersion::NoStream,
                events,
            )
            .await
            .expect("append");
    }
    relay_with_until_caught_up(
        &store,
        DeltaRelayConfig {
            max_events: 10_000,
            max_wait: Duration::from_millis(200),
            ..config(&dir.0)
        },
    )
    .await;
    // The first read takes one page (500 events); the other 1,300 come at the deadline.
    assert_eq!(ranges_in_log(&dir.0).await, [(1, 1_800)]);
    store.shutdown().await;
}

/// The OpenLineage relay maps an event only once its Delta commit is linked, and its
/// record names that commit's version on the `delta/events` output; with the Delta relay
/// stopped it waits (nothing is dropped), and a restart resumes both.
#[tokio::test]
async fn openlineage_records_carry_the_delta_version_and_wait_for_it() {
    use aether_lineage::relay::record;

    let dir = TempData::new("ol-delta");
    let store = open(&dir.0).await;
    append(&store, 1, 12).await;
    let openlineage = OpenLineageRelay::start(&store);
    // No Delta relay yet: no record may be written.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = reconcile(&store).await.expect("reconcile");
    assert_eq!(report.missing_openlineage.len(), 12, "{report:?}");

    relay_until_caught_up(&store, &dir.0).await;
    openlineage.finish_when_caught_up(&store).await;

    for seq in 1..=12 {
        let r = record(&store, seq).await.expect("read").expect("record");
        let commit = commit_of(&store, seq)
            .await
            .expect("lookup")
            .expect("linked");
        let events = r.openlineage_event["outputs"]
            .as_array()
            .expect("outputs")
            .iter()
            .find(|d| d["namespace"] == "delta" && d["name"] == "events")
            .expect("the events table is an output")
            .clone();
        assert_eq!(
            events["facets"]["version"]["datasetVersion"],
            json!(commit.version.to_string()),
            "seq {seq}"
        );
        assert_eq!(r.delta_version, Some(commit.version));
    }
    store.shutdown().await;
}

/// A decision's OpenLineage record names both Delta tables that hold it: the `events`
/// version and the `clearing_decisions` version, each the commit linked for its seq; and a
/// decisions commit whose link was lost in a crash is linked again on restart.
#[tokio::test]
async fn a_decisions_record_names_its_clearing_decisions_version_and_lost_links_are_repaired() {
    use aether_lineage::decisions::{DECISIONS_TABLE, DecisionsSink};
    use aether_lineage::delta_relay::table_commits_covering;
    use aether_lineage::relay::record;

    let dir = TempData::new("ol-decisions");
    let store = open(&dir.0).await;
    append(&store, 1, 3).await;
    decide(&store, "bank-a", "req-1", "125000").await;
    append(&store, 10, 9).await;
    decide(&store, "bank-a", "req-2", "7").await;
    let openlineage = OpenLineageRelay::start(&store);
    relay_until_caught_up(&store, &dir.0).await;
    openlineage.finish_when_caught_up(&store).await;

    let output_version = |event: &serde_json::Value, name: &str| {
        event["outputs"]
            .as_array()
            .expect("outputs")
            .iter()
            .find(|d| d["namespace"] == "delta" && d["name"] == name)
            .map(|d| d["facets"]["version"]["datasetVersion"].clone())
    };
    let mut versions = Vec::new();
    for seq in [4, 14] {
        let r = record(&store, seq).await.expect("read").expect("record");
        assert_eq!(
            r.openlineage_event["run"]["facets"]["aether_ledger"]["event_type"],
            "ClearingDecided"
        );
        let linked = table_commits_covering(&store, DECISIONS_TABLE, seq, seq)
            .await
            .expect("lookup");
        assert_eq!(linked.len(), 1, "seq {seq}: {linked:?}");
        assert!(linked[0].first_seq <= seq && seq <= linked[0].last_seq);
        assert_eq!(
            output_version(&r.openlineage_event, DECISIONS_TABLE),
            Some(json!(linked[0].version.to_string())),
            "seq {seq}"
        );
        let events = commit_of(&store, seq)
            .await
            .expect("lookup")
            .expect("linked");
        assert_eq!(
            output_version(&r.openlineage_event, "events"),
            Some(json!(events.version.to_string()))
        );
        versions.push(linked[0].version);
    }
    // Two batches of at most 7 events apart: two decisions commits.
    assert!(versions[0] < versions[1], "{versions:?}");
    // Events that are not decisions write no clearing_decisions output.
    let policy = record(&store, 1).await.expect("read").expect("record");
    assert_eq!(
        output_version(&policy.openlineage_event, DECISIONS_TABLE),
        None
    );

    // A crash after a decisions commit but before its link: commit directly, unlinked.
    decide(&store, "bank-c", "req-3", "9").await;
    let events = store.read_all(15, 100).await.expect("read");
    {
        let mut sink = DecisionsSink::open_or_create(dir.0.join("delta").join(DECISIONS_TABLE))
            .await
            .expect("open table");
        sink.append(&events)
            .await
            .expect("append")
            .expect("a commit");
    }
    assert!(
        table_commits_covering(&store, DECISIONS_TABLE, 15, 15)
            .await
            .expect("lookup")
            .is_empty()
    );
    relay_until_caught_up(&store, &dir.0).await;
    let linked = table_commits_covering(&store, DECISIONS_TABLE, 15, 15)
        .await
        .expect("lookup");
    assert_eq!(linked.len(), 1, "{linked:?}");
    assert_eq!((linked[0].first_seq, linked[0].last_seq), (15, 15));
    // Each decision is in the table once: the restarted relay did not write it again.
    assert_eq!(decision_ids(&dir.0), ["req-1", "req-2", "req-3"]);
    store.shutdown().await;
}

/// A Delta relay that writes no decisions table does not hold decisions' OpenLineage
/// records back: once its cursor has passed them they are written, naming the `events`
/// version only.
#[tokio::test]
async fn without_a_decisions_table_decisions_records_name_the_events_version_only() {
    use aether_lineage::relay::record;

    let dir = TempData::new("ol-no-decisions");
    let store = open(&dir.0).await;
    append(&store, 1, 2).await;
    decide(&store, "bank-a", "req-1", "10").await;
    let openlineage = OpenLineageRelay::start(&store);
    let config = DeltaRelayConfig {
        decisions: None,
        ..config(&dir.0)
    };
    relay_with_until_caught_up(&store, config).await;
    openlineage.finish_when_caught_up(&store).await;
    let r = record(&store, 3).await.expect("read").expect("record");
    let outputs = r.openlineage_event["outputs"]
        .as_array()
        .expect("outputs")
        .clone();
    let decisions = outputs
        .iter()
        .find(|d| d["name"] == "clearing_decisions")
        .expect("the decisions table is still named");
    assert!(decisions["facets"].get("version").is_none(), "{decisions}");
    assert_eq!(
        r.delta_version,
        commit_of(&store, 3)
            .await
            .expect("lookup")
            .map(|c| c.version)
    );
    assert!(r.delta_version.is_some());
    store.shutdown().await;
}

/// A decisions table holding a commit of an older release (a seq range, no last hash)
/// under a newer commit whose link was lost: the restarted relay links the newer one,
/// leaves the older one unlinked, and goes on writing.
#[tokio::test]
async fn a_decisions_commit_without_a_hash_is_left_unlinked_and_newer_ones_are_linked() {
    use aether_lineage::decisions::{DECISIONS_TABLE, DecisionsSink};
    use aether_lineage::delta_relay::table_commits_covering;

    let dir = TempData::new("old-decisions");
    let store = open(&dir.0).await;
    decide(&store, "bank-a", "req-1", "1").await;
    relay_until_caught_up(&store, &dir.0).await;
    let table = dir.0.join("delta").join(DECISIONS_TABLE);
    let log = table.join("_delta_log");
    let next = std::fs::read_dir(&log)
        .expect("log")
        .filter(|e| {
            e.as_ref()
                .expect("entry")
                .path()
                .extension()
                .is_some_and(|x| x == "json")
        })
        .count();
    // What an older release wrote: commit metadata with a seq range and no hash.
    std::fs::write(
        log.join(format!("{next:020}.json")),
        r#"{"commitInfo":{"timestamp":1796169600000,"operation":"WRITE","aether.first_seq":1,"aether.last_seq":1}}"#,
    )
    .expect("write commit");
    // A newer decision committed to the table, its link lost in a crash.
    decide(&store, "bank-a", "req-2", "2").await;
    let events = store.read_all(2, 10).await.expect("read");
    let newest = DecisionsSink::open_or_create(&table)
        .await
        .expect("open table")
        .append(&events)
        .await
        .expect("append")
        .expect("a commit");
    assert_eq!(newest, i64::try_from(next).expect("version") + 1);

    decide(&store, "bank-a", "req-3", "3").await;
    relay_until_caught_up(&store, &dir.0).await;
    let linked: Vec<i64> = table_commits_covering(&store, DECISIONS_TABLE, 1, 3)
        .await
        .expect("lookup")
        .iter()
        .map(|c| c.version)
        .collect();
    assert_eq!(
        linked,
        [1, newest, newest + 1],
        "the forged commit stays out"
    );
    assert_eq!(decision_ids(&dir.0), ["req-1", "req-2", "req-3"]);
    store.shutdown().await;
}

/// A ledger of FAN_IN events and a relay configuration of one event per commit: its last
/// commit makes FAN_IN files and starts their merge. Returns the number of events too.
async fn events_for_one_merge(dir: &Path) -> (EventStore, DeltaRelayConfig, u64) {
    let store = open(dir).await;
    let events = aether_lineage::compaction::FAN_IN as u64;
    append(&store, 1, events).await;
    let one_per_commit = DeltaRelayConfig {
        max_events: 1,
        ..config(dir)
    };
    (store, one_per_commit, events)
}

#[tokio::test]
async fn a_stopping_relay_commits_the_merge_it_started() {
    let dir = TempData::new("relay-merge");
    let (store, one_per_commit, events) = events_for_one_merge(&dir.0).await;
    // The relay is stopped as soon as it has linked the commit that started the merge.
    relay_with_until_caught_up(&store, one_per_commit).await;
    let sink = DeltaSink::open_or_create(dir.0.join("delta").join("events"))
        .await
        .expect("open");
    assert_eq!(sink.last_seq(), events);
    assert_eq!(
        sink.table().get_file_uris().expect("files").count(),
        1,
        "the merge was not committed when the relay stopped"
    );
    store.shutdown().await;
}

#[tokio::test]
async fn an_idle_relay_commits_a_finished_merge_without_waiting_for_events() {
    let dir = TempData::new("relay-idle-merge");
    let (store, one_per_commit, events) = events_for_one_merge(&dir.0).await;
    // After the commit that started the merge, no event comes.
    let (stop, task) = relay_caught_up(&store, one_per_commit).await;
    let table = dir.0.join("delta").join("events");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let sink = DeltaSink::open_or_create(&table).await.expect("open");
        let files = sink.table().get_file_uris().expect("files").count();
        if files == 1 {
            assert_eq!(sink.last_seq(), events);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the running relay left its finished merge uncommitted ({files} live files)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.send(true).expect("relay running");
    task.await.expect("relay task").expect("relay result");
    store.shutdown().await;
}

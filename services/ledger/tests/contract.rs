//! The EventStore contract, run against both backends: SQLite (a real file) and
//! PostgreSQL (a fresh database on the server `scripts/test.sh` provides).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use aether_ledger::checkpoint::{CHECKPOINT_STREAM, CheckpointSigner, SignedCheckpoint};
use aether_ledger::testing::TestDatabase;
use aether_ledger::{
    AppendToStream, CheckpointPolicy, Direction, EventFilter, EventStore, ExpectedVersion,
    LedgerError, NewEvent, PreparedAppend, Problem, StoreConfig, run_checkpointer, verify_store,
};
use serde_json::json;

/// A store on one backend, and what is needed to clean it up and poke at it with raw SQL.
struct Harness {
    store: EventStore,
    url: String,
    pg: Option<TestDatabase>,
    _dir: Option<tempfile::TempDir>,
}

impl Harness {
    async fn sqlite(config: StoreConfig) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
        let store = EventStore::connect(&url, config).await.unwrap();
        Harness {
            store,
            url,
            pg: None,
            _dir: Some(dir),
        }
    }

    async fn postgres(config: StoreConfig) -> Harness {
        let db = TestDatabase::create().await;
        let store = EventStore::connect(&db.url, config).await.unwrap();
        Harness {
            store,
            url: db.url.clone(),
            pg: Some(db),
            _dir: None,
        }
    }

    /// Runs raw SQL as the database owner (superuser on the test server).
    async fn raw(&self, sql: &str) -> Result<u64, sqlx::Error> {
        if let Some(pool) = self.store.postgres_pool() {
            Ok(sqlx::raw_sql(sql).execute(pool).await?.rows_affected())
        } else {
            let pool = self.store.sqlite_pool().unwrap();
            Ok(sqlx::raw_sql(sql).execute(pool).await?.rows_affected())
        }
    }

    /// Runs `update` on `events` as a superuser would: with the append-only guard switched
    /// off (PostgreSQL: disabled, then enabled again; SQLite: its trigger dropped).
    async fn tamper(&self, update: &str) {
        let sql = if self.store.postgres_pool().is_some() {
            format!(
                "ALTER TABLE events DISABLE TRIGGER events_no_update_delete; {update}; \
                 ALTER TABLE events ENABLE TRIGGER events_no_update_delete;"
            )
        } else {
            format!("DROP TRIGGER events_no_update; {update};")
        };
        self.raw(&sql).await.unwrap();
    }

    /// Another store on the same database, with its own writer: a second Aether process.
    async fn second_writer(&self) -> EventStore {
        EventStore::connect(&self.url, StoreConfig::default())
            .await
            .unwrap()
    }

    async fn finish(self) {
        self.store.shutdown().await;
        if let Some(pool) = self.store.postgres_pool() {
            pool.close().await;
        }
        if let Some(db) = self.pg {
            db.drop_database().await;
        }
    }
}

fn ev(kind: &str, n: u64) -> NewEvent {
    NewEvent::new(kind, json!({"n": n, "note": "contract"}))
        .with_metadata(json!({"actor": "test", "trace_id": format!("t{n}")}))
}

/// Appends a signed checkpoint as the service's checkpointer would.
async fn append_checkpoint(store: &EventStore, checkpoint: &SignedCheckpoint) {
    store
        .append(
            CHECKPOINT_STREAM,
            ExpectedVersion::Any,
            vec![checkpoint.to_event()],
        )
        .await
        .unwrap();
}

async fn head_seq(store: &EventStore) -> u64 {
    store.head().await.unwrap().map_or(0, |(s, _)| s)
}

macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::sqlite).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Harness::postgres).await;
                }
            )*
        }
    };
}

contract!(
    appended_events_read_back_chained,
    expected_versions_are_enforced_and_name_the_actual_version,
    multi_stream_append_is_atomic,
    prepared_events_append_as_the_events_would,
    reads_by_time_range,
    subscription_catches_up_turns_live_and_resumes,
    bad_input_is_refused_precisely_and_writes_nothing,
    concurrent_appenders_leave_a_gapless_verifiable_ledger,
    concurrent_appends_are_group_committed,
    a_failed_batch_does_not_fail_the_batches_behind_it,
    the_database_refuses_updates_and_deletes,
    tampering_is_found_at_the_altered_seq,
    a_gap_wider_than_a_read_page_is_named,
    checkpoints_are_signed_and_verified,
    shutdown_commits_queued_appends_then_refuses,
    two_writers_on_one_database_keep_one_chain,
    filtered_queries_select_by_type_prefix_metadata_and_time,
    merkle_log_follows_the_ledger_and_proves_inclusion,
    the_merkle_log_file_is_kept_only_while_it_is_the_ledgers,
    personal_data_is_committed_and_redactable_without_breaking_the_chain,
    reads_as_of_a_seq_or_a_time,
    lookup_by_metadata_values_finds_every_match_in_one_query,
    followers_get_what_the_database_holds_whoever_wrote_it,
    reading_everything_streamed_equals_reading_page_by_page,
    a_checkpoint_covering_itself_or_later_events_is_refused,
    a_verify_that_stops_early_leaves_the_store_usable,
    verify_checks_roots_inside_blocks_it_keeps_on_disk,
    a_store_over_its_own_pool_serves_another_runtime,
    every_hashed_field_at_its_limits_is_stored_as_answered,
    values_the_database_would_change_are_refused_before_hashing,
    a_row_the_database_refuses_fails_only_its_own_append,
);

async fn appended_events_read_back_chained<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let committed = s
        .append(
            "engine/sgp-region",
            ExpectedVersion::NoStream,
            vec![ev("EngineActivationRequested", 1), ev("EngineActivated", 2)],
        )
        .await
        .unwrap();
    assert_eq!(committed.len(), 2);
    assert_eq!((committed[0].seq, committed[0].stream_version), (1, 1));
    assert_eq!((committed[1].seq, committed[1].stream_version), (2, 2));
    s.append(
        "engine/eu-region",
        ExpectedVersion::Any,
        vec![ev("EngineActivated", 3)],
    )
    .await
    .unwrap();
    s.append(
        "engine/sgp-region",
        ExpectedVersion::Exact(2),
        vec![ev("EngineDeactivated", 4)],
    )
    .await
    .unwrap();

    let all = s.read_all(1, 100).await.unwrap();
    assert_eq!(
        all.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    for (i, e) in all.iter().enumerate() {
        assert_eq!(e.computed_hash(), e.hash, "seq {} hash", e.seq);
        if i > 0 {
            assert_eq!(e.prev_hash, all[i - 1].hash, "seq {} link", e.seq);
        }
    }
    assert_eq!(all[0].prev_hash, [0u8; 32]);
    assert_eq!(all[0].event_id, committed[0].event_id);
    assert_eq!(all[0].hash, committed[0].hash);
    assert_eq!(
        all[0].payload_value().unwrap(),
        json!({"n": 1, "note": "contract"})
    );
    assert_eq!(all[0].metadata_value().unwrap()["trace_id"], "t1");
    assert_eq!(all[0].recorded_at, committed[0].recorded_at);

    let forward = s
        .read_stream("engine/sgp-region", 1, Direction::Forward, 10)
        .await
        .unwrap();
    assert_eq!(
        forward.iter().map(|e| e.stream_version).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    let backward = s
        .read_stream("engine/sgp-region", u64::MAX, Direction::Backward, 2)
        .await
        .unwrap();
    assert_eq!(
        backward
            .iter()
            .map(|e| e.stream_version)
            .collect::<Vec<_>>(),
        vec![3, 2]
    );
    assert_eq!(s.stream_version("engine/sgp-region").await.unwrap(), 3);
    assert_eq!(s.stream_version("engine/none").await.unwrap(), 0);
    assert_eq!(s.read_all(3, 1).await.unwrap()[0].seq, 3);
    assert_eq!(s.head().await.unwrap().unwrap(), (4, all[3].hash));
    h.finish().await;
}

async fn expected_versions_are_enforced_and_name_the_actual_version<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let err = s
        .append(
            "policy/aml_v2",
            ExpectedVersion::StreamExists,
            vec![ev("PolicyIngested", 1)],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, LedgerError::WrongExpectedVersion { actual: 0, .. }),
        "{err}"
    );
    s.append(
        "policy/aml_v2",
        ExpectedVersion::NoStream,
        vec![ev("PolicyIngested", 1)],
    )
    .await
    .unwrap();
    let err = s
        .append(
            "policy/aml_v2",
            ExpectedVersion::NoStream,
            vec![ev("PolicyIngested", 2)],
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, LedgerError::WrongExpectedVersion { actual: 1, .. }),
        "{err}"
    );
    let err = s
        .append(
            "policy/aml_v2",
            ExpectedVersion::Exact(5),
            vec![ev("PolicyIngested", 2)],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "wrong expected version for stream \"policy/aml_v2\": expected 5, actual 1"
    );
    assert!(err.is_conflict());
    s.append(
        "policy/aml_v2",
        ExpectedVersion::Exact(1),
        vec![ev("PolicyIngested", 2)],
    )
    .await
    .unwrap();
    s.append(
        "policy/aml_v2",
        ExpectedVersion::StreamExists,
        vec![ev("PolicyIngested", 3)],
    )
    .await
    .unwrap();
    assert_eq!(s.stream_version("policy/aml_v2").await.unwrap(), 3);
    assert_eq!(head_seq(s).await, 3, "failed appends wrote nothing");
    h.finish().await;
}

async fn multi_stream_append_is_atomic<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    s.append(
        "rollout/r1",
        ExpectedVersion::NoStream,
        vec![ev("RolloutStarted", 1)],
    )
    .await
    .unwrap();
    // The second stream's expectation fails, so neither stream changes.
    let err = s
        .append_multi(vec![
            AppendToStream {
                stream_id: "snapshot".into(),
                expected: ExpectedVersion::Any,
                events: vec![ev("SnapshotCommitted", 2)],
            },
            AppendToStream {
                stream_id: "rollout/r1".into(),
                expected: ExpectedVersion::Exact(7),
                events: vec![ev("RolledBack", 3)],
            },
        ])
        .await
        .unwrap_err();
    assert!(
        matches!(err, LedgerError::WrongExpectedVersion { actual: 1, .. }),
        "{err}"
    );
    assert_eq!(s.stream_version("snapshot").await.unwrap(), 0);
    assert_eq!(head_seq(s).await, 1);

    let committed = s
        .append_multi(vec![
            AppendToStream {
                stream_id: "snapshot".into(),
                expected: ExpectedVersion::NoStream,
                events: vec![ev("SnapshotCommitted", 2)],
            },
            AppendToStream {
                stream_id: "rollout/r1".into(),
                expected: ExpectedVersion::Exact(1),
                events: vec![ev("RolledBack", 3), ev("RolloutPaused", 4)],
            },
        ])
        .await
        .unwrap();
    assert_eq!(
        committed.iter().map(|c| c.seq).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    assert_eq!(s.stream_version("rollout/r1").await.unwrap(), 3);
    assert_eq!(s.stream_version("snapshot").await.unwrap(), 1);
    h.finish().await;
}

/// `prepare` refuses what an append refuses, with the same error; a prepared event appends
/// (again, after a refused append) with the same checks across streams and the hash an
/// append of the event itself gets.
async fn prepared_events_append_as_the_events_would<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let personal = || {
        NewEvent::new("ClearingDecided", json!({"n": 1}))
            .with_personal(serde_json::Map::from_iter([(
                "buyer".to_owned(),
                json!("Acme Ltd"),
            )]))
            .with_metadata(json!({"request_id": "r-1"}))
    };
    let not_an_object = NewEvent::new("X", json!([1, 2]));
    let refused = s.prepare(not_an_object.clone()).unwrap_err();
    let appended = s
        .append("x", ExpectedVersion::Any, vec![not_an_object])
        .await
        .unwrap_err();
    assert_eq!(refused.to_string(), appended.to_string());

    let prepared = s.prepare(personal()).unwrap();
    let part = |expected, events| PreparedAppend {
        stream_id: "clearing/m1".into(),
        expected,
        events,
    };
    // Refused for its expectation, then kept and appended again.
    let err = s
        .append_prepared(vec![part(
            ExpectedVersion::Exact(3),
            vec![prepared.clone()],
        )])
        .await
        .unwrap_err();
    assert!(
        matches!(err, LedgerError::WrongExpectedVersion { .. }),
        "{err}"
    );
    let err = s
        .append_prepared(vec![
            part(ExpectedVersion::Any, vec![prepared.clone()]),
            part(ExpectedVersion::Any, vec![prepared.clone()]),
        ])
        .await
        .unwrap_err();
    assert!(matches!(err, LedgerError::DuplicateStream { .. }), "{err}");
    assert!(matches!(
        s.append_prepared(vec![part(ExpectedVersion::Any, vec![])])
            .await,
        Err(LedgerError::EmptyAppend)
    ));
    assert_eq!(head_seq(s).await, 0, "refused appends wrote nothing");
    let committed = s
        .append_prepared(vec![part(ExpectedVersion::NoStream, vec![prepared])])
        .await
        .unwrap();
    let read = s.read_all(1, 10).await.unwrap();
    assert_eq!(read.len(), 1);
    assert_eq!(read[0].hash, committed[0].hash);
    assert_eq!(read[0].computed_hash(), committed[0].hash);
    // The personal member sealed as an append seals it.
    assert!(
        !read[0].payload.get().contains("Acme"),
        "{}",
        read[0].payload
    );
    let direct = s
        .append("clearing/m2", ExpectedVersion::NoStream, vec![personal()])
        .await
        .unwrap();
    let both = s.read_all(1, 10).await.unwrap();
    assert_eq!(both[1].hash, direct[0].hash);
    assert_eq!(
        both[0].payload.get().len(),
        both[1].payload.get().len(),
        "the same event, prepared or not, is stored alike (its salt aside)"
    );
    h.finish().await;
}

async fn reads_by_time_range<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let first = s
        .append("a", ExpectedVersion::Any, vec![ev("A", 1)])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let middle = s
        .append("a", ExpectedVersion::Any, vec![ev("A", 2), ev("A", 3)])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let last = s
        .append("a", ExpectedVersion::Any, vec![ev("A", 4)])
        .await
        .unwrap();

    let from = middle[0].recorded_at;
    let to = last[0].recorded_at;
    assert!(first[0].recorded_at < from && from < to);
    let got = s.read_time_range(from, to, 0, 100).await.unwrap();
    assert_eq!(got.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2, 3]);
    // Paging inside a range continues after the last seq seen.
    let page = s.read_time_range(from, to, 2, 100).await.unwrap();
    assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3]);
    let all = s
        .read_time_range(
            first[0].recorded_at,
            to + chrono::Duration::seconds(1),
            0,
            100,
        )
        .await
        .unwrap();
    assert_eq!(all.len(), 4);
    h.finish().await;
}

async fn subscription_catches_up_turns_live_and_resumes<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = h.store.clone();
    for n in 1..=3 {
        s.append("s", ExpectedVersion::Any, vec![ev("E", n)])
            .await
            .unwrap();
    }
    let mut sub = s.subscribe_named("relay").await.unwrap();
    for want in 1..=3 {
        assert_eq!(sub.next().await.unwrap().seq, want);
    }
    // Live: an event appended after catch-up arrives promptly.
    let writer = s.clone();
    let appender = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        writer
            .append("s", ExpectedVersion::Any, vec![ev("E", 4)])
            .await
            .unwrap()
    });
    let live = tokio::time::timeout(Duration::from_secs(5), sub.next())
        .await
        .expect("live event within 5 s")
        .unwrap();
    assert_eq!(live.seq, 4);
    assert_eq!(appender.await.unwrap()[0].event_id, live.event_id);
    sub.save_position(2).await.unwrap();
    drop(sub);

    // A new subscriber under the same name resumes after the stored position.
    let mut resumed = s.subscribe_named("relay").await.unwrap();
    assert_eq!(resumed.next().await.unwrap().seq, 3);
    assert_eq!(s.load_position("relay").await.unwrap(), Some(2));
    assert_eq!(s.load_position("nobody").await.unwrap(), None);
    let mut from_start = s.subscribe(1);
    let batch = from_start.next_batch(10).await.unwrap();
    assert_eq!(
        batch.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    h.finish().await;
}

async fn bad_input_is_refused_precisely_and_writes_nothing<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let good = || vec![ev("E", 1)];
    let cases: Vec<(&str, Result<_, LedgerError>)> = vec![
        (
            "empty stream",
            s.append("", ExpectedVersion::Any, good()).await,
        ),
        (
            "long stream",
            s.append(&"x".repeat(257), ExpectedVersion::Any, good())
                .await,
        ),
        (
            "control char",
            s.append("engine/\u{7}bell", ExpectedVersion::Any, good())
                .await,
        ),
        (
            "newline",
            s.append("engine/a\nb", ExpectedVersion::Any, good()).await,
        ),
        (
            "padded",
            s.append(" engine/a", ExpectedVersion::Any, good()).await,
        ),
        (
            "no events",
            s.append("engine/a", ExpectedVersion::Any, vec![]).await,
        ),
        (
            "bad type",
            s.append(
                "engine/a",
                ExpectedVersion::Any,
                vec![NewEvent::new("has space", json!({}))],
            )
            .await,
        ),
        (
            "array payload",
            s.append(
                "engine/a",
                ExpectedVersion::Any,
                vec![NewEvent::new("E", json!([1, 2]))],
            )
            .await,
        ),
        (
            "string payload",
            s.append(
                "engine/a",
                ExpectedVersion::Any,
                vec![NewEvent::new("E", json!("x"))],
            )
            .await,
        ),
        (
            "null metadata",
            s.append(
                "engine/a",
                ExpectedVersion::Any,
                vec![NewEvent::new("E", json!({})).with_metadata(json!(null))],
            )
            .await,
        ),
        (
            "huge payload",
            s.append(
                "engine/a",
                ExpectedVersion::Any,
                vec![NewEvent::new("E", json!({"blob": "x".repeat(1024 * 1024)}))],
            )
            .await,
        ),
        (
            "inexact number",
            s.append(
                "engine/a",
                ExpectedVersion::Any,
                vec![NewEvent::new(
                    "E",
                    json!({"amount": {"minor": 9007199254740993u64}}),
                )],
            )
            .await,
        ),
    ];
    let messages: HashMap<&str, String> = cases
        .into_iter()
        .map(|(name, r)| {
            let e = r.expect_err(name);
            assert!(e.is_input_error(), "{name}: {e}");
            (name, e.to_string())
        })
        .collect();
    assert_eq!(
        messages["empty stream"],
        "invalid stream id \"\": must not be empty"
    );
    assert!(messages["long stream"].contains("257 bytes, longer than the limit of 256"));
    assert!(messages["control char"].contains("control character U+0007 at byte 7"));
    assert!(messages["newline"].contains("U+000A"));
    assert!(messages["padded"].contains("whitespace"));
    assert_eq!(
        messages["no events"],
        "an append must carry at least one event"
    );
    assert!(messages["bad type"].starts_with("invalid event type \"has space\""));
    assert_eq!(
        messages["array payload"],
        "payload must be a JSON object, got an array"
    );
    assert_eq!(
        messages["string payload"],
        "payload must be a JSON object, got a string"
    );
    assert_eq!(
        messages["null metadata"],
        "metadata must be a JSON object, got null"
    );
    assert!(
        messages["huge payload"].contains("over the limit of 1048576 bytes"),
        "{}",
        messages["huge payload"]
    );
    assert!(messages["inexact number"].contains("9007199254740993 at $.amount.minor"));

    // A stale expected version is refused too, and none of it reached the ledger.
    s.append("engine/a", ExpectedVersion::Any, good())
        .await
        .unwrap();
    let stale = s
        .append("engine/a", ExpectedVersion::NoStream, good())
        .await
        .unwrap_err();
    assert!(stale.is_conflict());
    let id = uuid::Uuid::now_v7();
    s.append(
        "engine/b",
        ExpectedVersion::Any,
        vec![ev("E", 2).with_event_id(id)],
    )
    .await
    .unwrap();
    let dup = s
        .append(
            "engine/c",
            ExpectedVersion::Any,
            vec![ev("E", 3).with_event_id(id)],
        )
        .await
        .unwrap_err();
    assert_eq!(
        dup.to_string(),
        format!("event id {id} is already in the ledger")
    );
    assert_eq!(head_seq(s).await, 2);
    assert_eq!(s.stream_version("engine/c").await.unwrap(), 0);
    h.finish().await;
}

async fn concurrent_appenders_leave_a_gapless_verifiable_ledger<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = h.store.clone();
    let acked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for t in 0..32u64 {
        let s = s.clone();
        let acked = acked.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..25u64 {
                let stream = format!("clearing/member-{}", (t + i) % 6);
                // Half the appenders use optimistic concurrency with retry.
                let committed = if t % 2 == 0 {
                    s.append(
                        &stream,
                        ExpectedVersion::Any,
                        vec![ev("ClearingDecided", i)],
                    )
                    .await
                    .unwrap()
                } else {
                    loop {
                        let v = s.stream_version(&stream).await.unwrap();
                        match s
                            .append(
                                &stream,
                                ExpectedVersion::Exact(v),
                                vec![ev("ClearingDecided", i)],
                            )
                            .await
                        {
                            Ok(c) => break c,
                            Err(LedgerError::WrongExpectedVersion { .. }) => continue,
                            Err(e) => panic!("{e}"),
                        }
                    }
                };
                acked.lock().unwrap().extend(committed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    assert_eq!(acked.len(), 32 * 25);
    let all = s.read_all(1, 10_000).await.unwrap();
    assert_eq!(all.len(), acked.len());
    assert!(
        all.iter().enumerate().all(|(i, e)| e.seq == i as u64 + 1),
        "gapless seqs"
    );
    let mut versions: HashMap<&str, u64> = HashMap::new();
    for e in &all {
        let v = versions.entry(e.stream_id.as_str()).or_insert(0);
        *v += 1;
        assert_eq!(e.stream_version, *v, "gapless versions in {}", e.stream_id);
    }
    let stored: HashMap<uuid::Uuid, (u64, [u8; 32])> =
        all.iter().map(|e| (e.event_id, (e.seq, e.hash))).collect();
    for c in &acked {
        assert_eq!(
            stored.get(&c.event_id),
            Some(&(c.seq, c.hash)),
            "acked append present"
        );
    }
    let report = verify_store(&s, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    assert_eq!(report.events_checked, 800);
    h.finish().await;
}

async fn a_failed_batch_does_not_fail_the_batches_behind_it<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    // Small batches keep the pipeline busy; every fifth append reuses an event id already
    // in the ledger, which only the database's unique index catches, so its batch fails
    // while (at depth 2) the next one may already be inserted behind it.
    for pipeline_depth in [1, 2] {
        one_failing_batch_in_the_pipeline(
            open(StoreConfig {
                max_batch: 4,
                pipeline_depth,
                ..StoreConfig::default()
            })
            .await,
        )
        .await;
    }
}

async fn one_failing_batch_in_the_pipeline(h: Harness) {
    let taken = uuid::Uuid::now_v7();
    h.store
        .append(
            "seed",
            ExpectedVersion::Any,
            vec![ev("E", 0).with_event_id(taken)],
        )
        .await
        .unwrap();
    let tasks: Vec<_> = (0..16u64)
        .map(|t| {
            let s = h.store.clone();
            tokio::spawn(async move {
                let mut acked = Vec::new();
                let mut refused = 0;
                for i in 0..20u64 {
                    let mut e = ev("E", t * 100 + i);
                    if (t + i) % 5 == 0 {
                        e = e.with_event_id(taken);
                    }
                    match s
                        .append(&format!("s/{}", t % 4), ExpectedVersion::Any, vec![e])
                        .await
                    {
                        Ok(c) => acked.extend(c),
                        Err(LedgerError::DuplicateEventId { event_id }) if event_id == taken => {
                            refused += 1
                        }
                        Err(other) => panic!("append {t}/{i}: {other}"),
                    }
                }
                (acked, refused)
            })
        })
        .collect();
    let mut acked = Vec::new();
    let mut refused = 0;
    for t in tasks {
        let (a, r) = t.await.unwrap();
        acked.extend(a);
        refused += r;
    }
    assert_eq!(refused, 16 * 20 / 5, "exactly the reused ids are refused");
    assert_eq!(acked.len(), 16 * 20 - refused);
    let all = h.store.read_all(1, 10_000).await.unwrap();
    assert_eq!(all.len(), acked.len() + 1);
    assert!(
        all.iter().enumerate().all(|(i, e)| e.seq == i as u64 + 1),
        "gapless seqs"
    );
    let stored: HashMap<uuid::Uuid, u64> = all.iter().map(|e| (e.event_id, e.seq)).collect();
    assert!(
        acked
            .iter()
            .all(|c| stored.get(&c.event_id) == Some(&c.seq)),
        "acked appends present"
    );
    let report = verify_store(&h.store, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    h.finish().await;
}

async fn concurrent_appends_are_group_committed<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    // Each transaction stamps one recorded_at. With a generous wait, 100 concurrent
    // appends share a few transactions (the first may go alone: a lone appender is not
    // made to wait); with batches capped at 10 events they need at least 10.
    for (max_batch, most_times, least_times) in [(500, 3, 1), (10, 100, 10)] {
        let config = StoreConfig {
            max_batch,
            max_wait: Duration::from_millis(300),
            ..StoreConfig::default()
        };
        let h = open(config).await;
        let barrier = Arc::new(tokio::sync::Barrier::new(100));
        let tasks: Vec<_> = (0..100u64)
            .map(|i| {
                let s = h.store.clone();
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    s.append("g", ExpectedVersion::Any, vec![ev("E", i)])
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut times = HashSet::new();
        for t in tasks {
            times.insert(t.await.unwrap()[0].recorded_at);
        }
        assert!(
            (least_times..=most_times).contains(&times.len()),
            "max_batch {max_batch}: {} distinct commit times",
            times.len()
        );
        let report = verify_store(&h.store, None, |_| {}).await.unwrap();
        assert!(report.is_ok() && report.events_checked == 100, "{report:?}");
        h.finish().await;
    }
}

async fn the_database_refuses_updates_and_deletes<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    h.store
        .append("a", ExpectedVersion::Any, vec![ev("E", 1), ev("E", 2)])
        .await
        .unwrap();
    for sql in [
        "UPDATE events SET payload = '{\"n\":99}' WHERE seq = 1",
        "DELETE FROM events WHERE seq = 2",
        "DELETE FROM events",
    ] {
        let err = h.raw(sql).await.expect_err(sql).to_string();
        assert!(err.contains("append-only"), "{sql}: {err}");
    }
    if h.store.postgres_pool().is_some() {
        // CASCADE (onto the tables that reference events) is refused by the trigger too.
        let err = h
            .raw("TRUNCATE events CASCADE")
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("append-only"), "{err}");
        assert!(h.raw("TRUNCATE events").await.is_err());
    }
    let all = h.store.read_all(1, 10).await.unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all[0].payload_value().unwrap()["n"], 1);
    assert!(verify_store(&h.store, None, |_| {}).await.unwrap().is_ok());
    h.finish().await;
}

async fn tampering_is_found_at_the_altered_seq<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    for n in 1..=10 {
        h.store
            .append("a", ExpectedVersion::Any, vec![ev("E", n)])
            .await
            .unwrap();
    }
    assert!(verify_store(&h.store, None, |_| {}).await.unwrap().is_ok());
    // As a superuser would: edit one payload past the guard.
    h.tamper("UPDATE events SET payload = '{\"n\":700,\"note\":\"contract\"}' WHERE seq = 7")
        .await;
    let report = verify_store(&h.store, None, |_| {}).await.unwrap();
    let failure = report.failure.expect("tampering detected");
    assert_eq!(failure.seq, 7);
    assert!(
        matches!(failure.problem, Problem::HashMismatch { .. }),
        "{:?}",
        failure.problem
    );
    assert_eq!(report.events_checked, 6);
    h.finish().await;
}

/// A hole wider than the verifier's read page (here 25,000 seqs: the events after seq 3
/// moved up by a superuser) is named with the seq where the events resume.
async fn a_gap_wider_than_a_read_page_is_named<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    h.store
        .append(
            "a",
            ExpectedVersion::Any,
            (1..=6).map(|n| ev("E", n)).collect(),
        )
        .await
        .unwrap();
    h.tamper("UPDATE events SET seq = seq + 25000 WHERE seq >= 4")
        .await;
    let report = verify_store(&h.store, None, |_| {}).await.unwrap();
    let failure = report.failure.expect("the gap is found");
    assert_eq!(
        failure.problem,
        Problem::Gap {
            expected: 4,
            found: 25_004
        }
    );
    assert_eq!(report.events_checked, 3);
    h.finish().await;
}

async fn checkpoints_are_signed_and_verified<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let signer = CheckpointSigner::generate().unwrap();
    let trusted = signer.verifier();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let policy = CheckpointPolicy {
        every_events: 20,
        every: Duration::from_secs(3600),
    };
    let task = tokio::spawn(run_checkpointer(h.store.clone(), signer, policy, stop_rx));
    for n in 0..50 {
        h.store
            .append("a", ExpectedVersion::Any, vec![ev("E", n)])
            .await
            .unwrap();
    }
    // Wait for the two count-triggered checkpoints, then stop (which signs a final one).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while h.store.stream_version(CHECKPOINT_STREAM).await.unwrap() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "checkpoints not written"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(true).unwrap();
    task.await.unwrap().unwrap();
    let checkpoints = h.store.stream_version(CHECKPOINT_STREAM).await.unwrap();
    assert!(checkpoints >= 3, "{checkpoints} checkpoints");

    let report = verify_store(&h.store, Some(trusted), |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    assert_eq!(report.checkpoints_checked, checkpoints);
    let latest = report.latest_checkpoint.unwrap();
    assert!(latest.tree_size >= 50);

    // Checked against another key, the first checkpoint is named as the failure.
    let stranger = CheckpointSigner::generate().unwrap().verifier();
    let report = verify_store(&h.store, Some(stranger), |_| {})
        .await
        .unwrap();
    let failure = report.failure.unwrap();
    let first_cp = h
        .store
        .read_stream(CHECKPOINT_STREAM, 1, Direction::Forward, 1)
        .await
        .unwrap()[0]
        .seq;
    assert_eq!(failure.seq, first_cp);
    assert!(
        matches!(failure.problem, Problem::BadCheckpoint { .. }),
        "{:?}",
        failure.problem
    );
    h.finish().await;
}

async fn shutdown_commits_queued_appends_then_refuses<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let tasks: Vec<_> = (0..50u64)
        .map(|i| {
            let s = h.store.clone();
            tokio::spawn(async move { s.append("q", ExpectedVersion::Any, vec![ev("E", i)]).await })
        })
        .collect();
    tokio::task::yield_now().await;
    h.store.shutdown().await;
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(LedgerError::WriterClosed) => {}
            Err(e) => panic!("{e}"),
        }
    }
    let err = h
        .store
        .append("q", ExpectedVersion::Any, vec![ev("E", 99)])
        .await
        .unwrap_err();
    assert!(matches!(err, LedgerError::WriterClosed));
    // Everything acknowledged is there, nothing else.
    assert_eq!(head_seq(&h.store).await, ok);
    h.finish().await;
}

async fn two_writers_on_one_database_keep_one_chain<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    // As two Aether processes sharing one ledger database would: each store has its own
    // writer and its own cached view of the chain; the database arbitrates.
    let h = open(StoreConfig::default()).await;
    let other = h.second_writer().await;
    let acked = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let s = if t % 2 == 0 {
            h.store.clone()
        } else {
            other.clone()
        };
        let acked = acked.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..20u64 {
                let stream = format!("shared/{}", i % 3);
                let committed = loop {
                    let result = if t < 4 {
                        s.append(&stream, ExpectedVersion::Any, vec![ev("E", i)])
                            .await
                    } else {
                        let v = s.stream_version(&stream).await.unwrap();
                        s.append(&stream, ExpectedVersion::Exact(v), vec![ev("E", i)])
                            .await
                    };
                    match result {
                        Ok(c) => break c,
                        Err(LedgerError::WrongExpectedVersion { .. }) => continue,
                        // A batch that lost the race to the other writer may be refused
                        // as a whole; the caller retries, as any client of a shared ledger must.
                        Err(LedgerError::CommitFailed(_)) => continue,
                        Err(e) => panic!("{e}"),
                    }
                };
                acked.lock().unwrap().extend(committed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    other.shutdown().await;
    let acked = acked.lock().unwrap().clone();
    let all = h.store.read_all(1, 10_000).await.unwrap();
    assert_eq!(all.len(), 160);
    assert_eq!(acked.len(), 160);
    let stored: HashMap<uuid::Uuid, u64> = all.iter().map(|e| (e.event_id, e.seq)).collect();
    for c in &acked {
        assert_eq!(stored.get(&c.event_id), Some(&c.seq));
    }
    let report = verify_store(&h.store, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    h.finish().await;
}

async fn filtered_queries_select_by_type_prefix_metadata_and_time<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let meta =
        |actor: &str, member: &str| json!({"actor": actor, "member": member, "trace_id": "t"});
    s.append(
        "engine/sgp",
        ExpectedVersion::Any,
        vec![NewEvent::new("EngineActivated", json!({})).with_metadata(meta("alice", "-"))],
    )
    .await
    .unwrap();
    let early = s
        .append(
            "clearing/m1",
            ExpectedVersion::Any,
            vec![NewEvent::new("ClearingDecided", json!({"n": 1})).with_metadata(meta("gw", "m1"))],
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(15)).await;
    s.append(
        "clearing/m2",
        ExpectedVersion::Any,
        vec![NewEvent::new("ClearingDecided", json!({"n": 2})).with_metadata(meta("gw", "m2"))],
    )
    .await
    .unwrap();
    s.append(
        "clearing/m1",
        ExpectedVersion::Any,
        vec![NewEvent::new("ClearingDecided", json!({"n": 3})).with_metadata(meta("gw", "m1"))],
    )
    .await
    .unwrap();
    let seqs = |events: Vec<aether_ledger::RecordedEvent>| {
        events.iter().map(|e| e.seq).collect::<Vec<_>>()
    };

    let by_type = EventFilter {
        event_type: Some("ClearingDecided".into()),
        ..Default::default()
    };
    assert_eq!(seqs(s.query(&by_type, 0, 10).await.unwrap()), vec![2, 3, 4]);
    // Cursor paging: after seq 2, one at a time.
    assert_eq!(seqs(s.query(&by_type, 2, 1).await.unwrap()), vec![3]);
    let by_prefix = EventFilter {
        stream_prefix: Some("clearing/m1".into()),
        ..Default::default()
    };
    assert_eq!(seqs(s.query(&by_prefix, 0, 10).await.unwrap()), vec![2, 4]);
    let by_member = EventFilter {
        metadata: vec![("member".into(), "m2".into())],
        ..Default::default()
    };
    assert_eq!(seqs(s.query(&by_member, 0, 10).await.unwrap()), vec![3]);
    let by_actor_and_type = EventFilter {
        event_type: Some("EngineActivated".into()),
        metadata: vec![("actor".into(), "alice".into())],
        ..Default::default()
    };
    assert_eq!(
        seqs(s.query(&by_actor_and_type, 0, 10).await.unwrap()),
        vec![1]
    );
    let after_early = EventFilter {
        from: Some(early[0].recorded_at + chrono::Duration::milliseconds(5)),
        ..Default::default()
    };
    assert_eq!(
        seqs(s.query(&after_early, 0, 10).await.unwrap()),
        vec![3, 4]
    );
    // A prefix is a prefix, not a pattern.
    let pattern = EventFilter {
        stream_prefix: Some("clearing/%".into()),
        ..Default::default()
    };
    assert!(s.query(&pattern, 0, 10).await.unwrap().is_empty());

    let err = s
        .query(
            &EventFilter {
                metadata: vec![("password".into(), "x".into())],
                ..Default::default()
            },
            0,
            10,
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("cannot be filtered on"), "{err}");
    h.finish().await;
}

/// The served Merkle log keeps its event hashes in a file: it answers as the log held in
/// memory, takes up where the file ends after a restart, and rebuilds the file from the
/// ledger when the file is not the ledger's prefix (another ledger's, longer than the
/// ledger, or changed: before the latest signed checkpoint its root reveals it, after it
/// the ledger's own hashes do).
async fn the_merkle_log_file_is_kept_only_while_it_is_the_ledgers<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    use aether_ledger::MerkleLog;
    use aether_ledger::merkle::root;
    let h = open(StoreConfig::default()).await;
    let append = |from: u64, to: u64| {
        let store = h.store.clone();
        async move {
            for start in (from..to).step_by(50) {
                let batch = (start..to.min(start + 50)).map(|n| ev("E", n)).collect();
                store
                    .append("m", ExpectedVersion::Any, batch)
                    .await
                    .unwrap();
            }
        }
    };
    let all_hashes = || async {
        h.store
            .read_all(1, 1000)
            .await
            .unwrap()
            .iter()
            .map(|e| e.hash)
            .collect::<Vec<[u8; 32]>>()
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("merkle").join("event-hashes");

    // Two full 128-leaf blocks and part of a third.
    append(0, 300).await;
    let log = MerkleLog::open(&file, &h.store).await.unwrap();
    let hashes = all_hashes().await;
    assert_eq!(log.len(), 300);
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 300 * 32);
    assert_eq!(log.root_at(300).unwrap(), root(&hashes));
    let memory = MerkleLog::default();
    memory.catch_up(&h.store).await.unwrap();
    assert!(
        log.resident_hashes() * 5 < memory.resident_hashes(),
        "{} hashes in memory with the file, {} without",
        log.resident_hashes(),
        memory.resident_hashes()
    );
    for seq in [1, 77, 128, 129, 256, 257, 300] {
        for size in [seq, seq.max(200), 300] {
            assert_eq!(
                log.inclusion_proof(seq, size),
                memory.inclusion_proof(seq, size),
                "seq {seq} in {size}"
            );
        }
    }
    for (old, new) in [(100, 300), (128, 256), (257, 300), (1, 129)] {
        assert_eq!(
            log.consistency_proof(old, new),
            memory.consistency_proof(old, new)
        );
    }
    drop(log);

    // A restart takes up where the file ends; 20 events follow the checkpoint.
    append(300, 350).await;
    let signer = CheckpointSigner::generate().unwrap();
    let hashes = all_hashes().await;
    let checkpoint = signer.sign(350, root(&hashes), chrono::Utc::now());
    append_checkpoint(&h.store, &checkpoint).await;
    append(350, 370).await;
    let hashes = all_hashes().await;
    let log = MerkleLog::open(&file, &h.store).await.unwrap();
    assert_eq!(log.len(), 371);
    assert_eq!(log.root_at(371).unwrap(), root(&hashes));
    drop(log);

    let memory = MerkleLog::default();
    memory.catch_up(&h.store).await.unwrap();
    let intact = std::fs::read(&file).unwrap();
    let flip = |seq: usize| move |b: &mut Vec<u8>| b[(seq - 1) * 32] ^= 1;
    type Change = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: [(&str, Change); 4] = [
        // Its last hash still the ledger's: the checkpoint's root finds it.
        ("changed before the checkpoint", Box::new(flip(11))),
        // After the checkpoint (as a page lost in a power cut would be), last hash intact:
        // the ledger's hashes after the checkpoint find it.
        ("changed after the checkpoint", Box::new(flip(360))),
        (
            "longer than the ledger, as another ledger's file would be",
            Box::new(|b: &mut Vec<u8>| b.extend_from_slice(&[9u8; 5 * 32])),
        ),
        ("its last hash changed", Box::new(flip(371))),
    ];
    for (case, change) in cases {
        let mut bytes = intact.clone();
        change(&mut bytes);
        std::fs::write(&file, bytes).unwrap();
        let log = MerkleLog::open(&file, &h.store).await.unwrap();
        assert_eq!(log.len(), 371, "{case}");
        assert_eq!(log.root_at(371).unwrap(), root(&hashes), "{case}");
        for seq in [11, 129, 351, 360, 371] {
            assert_eq!(
                log.inclusion_proof(seq, 371),
                memory.inclusion_proof(seq, 371),
                "{case}: seq {seq}"
            );
        }
        assert_eq!(std::fs::read(&file).unwrap(), intact, "{case}");
    }

    // Changed under the running log: the proof is refused, naming the block, and the
    // block is rewritten from the ledger, after which the proof is the right one.
    let log = MerkleLog::open(&file, &h.store).await.unwrap();
    let mut bytes = intact.clone();
    bytes[10 * 32] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let err = log.inclusion_proof(11, 371).unwrap_err();
    assert!(
        matches!(
            err,
            aether_ledger::merkle::ProofError::LeafFile { block: 0, .. }
        ),
        "{err}"
    );
    assert!(log.repair(&h.store, &err).await.unwrap());
    assert_eq!(
        log.inclusion_proof(11, 371),
        memory.inclusion_proof(11, 371)
    );
    assert_eq!(std::fs::read(&file).unwrap(), intact);
    // Nothing to repair in an error about the request.
    let err = log.inclusion_proof(500, 371).unwrap_err();
    assert!(!log.repair(&h.store, &err).await.unwrap());
    h.finish().await;
}

/// `verify` keeps the event hashes in a scratch file and only the tree above 128-event
/// blocks in memory; a checkpoint whose size falls inside a block already complete (a
/// lagging signer's) is checked against that block read back, right or wrong.
async fn verify_checks_roots_inside_blocks_it_keeps_on_disk<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    use aether_ledger::merkle::root;
    let h = open(StoreConfig::default()).await;
    for start in (0..300).step_by(50) {
        let batch = (start..start + 50).map(|n| ev("E", n)).collect();
        h.store
            .append("m", ExpectedVersion::Any, batch)
            .await
            .unwrap();
    }
    let hashes: Vec<[u8; 32]> = h
        .store
        .read_all(1, 1000)
        .await
        .unwrap()
        .iter()
        .map(|e| e.hash)
        .collect();
    let signer = CheckpointSigner::generate().unwrap();
    let trusted = signer.verifier();
    // Seq 301 signs the first 200 events: 200 is inside the second block (128..256).
    let right = signer.sign(200, root(&hashes[..200]), chrono::Utc::now());
    append_checkpoint(&h.store, &right).await;
    for n in 300..400 {
        h.store
            .append("m", ExpectedVersion::Any, vec![ev("E", n)])
            .await
            .unwrap();
    }
    let report = verify_store(&h.store, Some(trusted.clone()), |_| {})
        .await
        .unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    assert_eq!(report.events_checked, 401);
    assert_eq!(report.checkpoints_checked, 1);
    assert_eq!(report.latest_checkpoint.unwrap().tree_size, 200);

    // Seq 402 signs 130 events with the root of 129: named, with both roots.
    let wrong = signer.sign(130, root(&hashes[..129]), chrono::Utc::now());
    append_checkpoint(&h.store, &wrong).await;
    let report = verify_store(&h.store, Some(trusted), |_| {}).await.unwrap();
    let failure = report.failure.unwrap();
    assert_eq!(failure.seq, 402);
    assert_eq!(
        failure.problem,
        Problem::RootMismatch {
            tree_size: 130,
            claimed: hex::encode(root(&hashes[..129])),
            computed: hex::encode(root(&hashes[..130])),
        }
    );
    h.finish().await;
}

async fn merkle_log_follows_the_ledger_and_proves_inclusion<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    use aether_ledger::MerkleLog;
    use aether_ledger::merkle::{root, verify_consistency, verify_inclusion};
    let h = open(StoreConfig::default()).await;
    for n in 0..20 {
        h.store
            .append("m", ExpectedVersion::Any, vec![ev("E", n)])
            .await
            .unwrap();
    }
    let log = MerkleLog::default();
    assert_eq!(log.catch_up(&h.store).await.unwrap(), 20);
    let hashes: Vec<[u8; 32]> = h
        .store
        .read_all(1, 100)
        .await
        .unwrap()
        .iter()
        .map(|e| e.hash)
        .collect();
    assert_eq!(log.root_at(20).unwrap(), root(&hashes));
    let proof = log.inclusion_proof(7, 20).unwrap();
    verify_inclusion(&hashes[6], 6, 20, &proof, &root(&hashes)).unwrap();
    assert!(verify_inclusion(&hashes[5], 6, 20, &proof, &root(&hashes)).is_err());

    // Following: new appends show up without another catch_up call.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let follower = tokio::spawn(log.clone().follow(h.store.clone(), stop_rx));
    for n in 20..25 {
        h.store
            .append("m", ExpectedVersion::Any, vec![ev("E", n)])
            .await
            .unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while log.len() < 25 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "follower lagging at {}",
            log.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop_tx.send(true).unwrap();
    follower.await.unwrap();
    let all: Vec<[u8; 32]> = h
        .store
        .read_all(1, 100)
        .await
        .unwrap()
        .iter()
        .map(|e| e.hash)
        .collect();
    let proof = log.consistency_proof(20, 25).unwrap();
    verify_consistency(20, 25, &root(&hashes), &root(&all), &proof).unwrap();
    assert!(log.inclusion_proof(26, 25).is_err());
    assert!(log.inclusion_proof(0, 25).is_err());
    h.finish().await;
}

async fn personal_data_is_committed_and_redactable_without_breaking_the_chain<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    use aether_ledger::personal::{REDACTION_EVENT_TYPE, REDACTION_STREAM};
    let h = open(StoreConfig::default()).await;
    let personal =
        json!({"beneficiary": "Ada Lovelace", "account": {"iban": "GB29NWBK60161331926819"}});
    let committed = h
        .store
        .append(
            "clearing/m1",
            ExpectedVersion::Any,
            vec![
                NewEvent::new("ClearingDecided", json!({"amount_minor": 100}))
                    .with_personal(personal.as_object().unwrap().clone()),
            ],
        )
        .await
        .unwrap();
    let event = h
        .store
        .read_all(committed[0].seq, 1)
        .await
        .unwrap()
        .remove(0);
    // The hashed payload holds commitments, never the values.
    assert!(
        !event.payload.get().contains("Lovelace"),
        "{}",
        event.payload.get()
    );
    assert!(event.payload.get().contains("$personal"));
    let fields = h.store.personal_fields(&event).await.unwrap();
    assert_eq!(fields.len(), 2);
    let name = fields.iter().find(|f| f.member == "beneficiary").unwrap();
    assert_eq!(name.value_json().unwrap(), json!("Ada Lovelace"));

    // The side table refuses edits.
    let err = h
        .raw("UPDATE personal_data SET value = '\"Eve\"'")
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("never changed"), "{err}");

    // Redaction: recorded, value gone, chain intact.
    let redaction = h
        .store
        .redact(
            &event,
            "beneficiary",
            "erasure request 2026-117",
            "regulator:abcd",
        )
        .await
        .unwrap();
    let record = h.store.read_all(redaction.seq, 1).await.unwrap().remove(0);
    assert_eq!(record.event_type, REDACTION_EVENT_TYPE);
    assert_eq!(record.stream_id, REDACTION_STREAM);
    assert_eq!(record.payload_value().unwrap()["member"], "beneficiary");
    assert_eq!(record.metadata_value().unwrap()["actor"], "regulator:abcd");
    let left = h.store.personal_fields(&event).await.unwrap();
    assert_eq!(
        left.iter().map(|f| f.member.as_str()).collect::<Vec<_>>(),
        vec!["account"]
    );
    let err = h
        .store
        .redact(&event, "beneficiary", "again", "x")
        .await
        .unwrap_err();
    assert!(
        matches!(err, LedgerError::NoSuchPersonalField { .. }),
        "{err}"
    );
    let report = verify_store(&h.store, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);

    // A swapped value no longer matches its commitment and is reported, not served.
    h.raw("DELETE FROM personal_data WHERE member = 'account'")
        .await
        .unwrap();
    let forged = format!(
        "INSERT INTO personal_data (event_id, member, value, salt) SELECT event_id, 'account', '{{\"iban\":\"XX\"}}', {} FROM events WHERE seq = {}",
        if h.store.postgres_pool().is_some() {
            "'\\x00000000000000000000000000000000'::bytea"
        } else {
            "zeroblob(16)"
        },
        event.seq
    );
    h.raw(&forged).await.unwrap();
    let err = h.store.personal_fields(&event).await.unwrap_err();
    assert!(
        err.to_string().contains("does not match the commitment"),
        "{err}"
    );

    // A name given both as public and personal is refused.
    let err = h
        .store
        .append(
            "clearing/m1",
            ExpectedVersion::Any,
            vec![
                NewEvent::new("ClearingDecided", json!({"beneficiary": "x"}))
                    .with_personal(json!({"beneficiary": "y"}).as_object().unwrap().clone()),
            ],
        )
        .await
        .unwrap_err();
    assert!(err.is_input_error(), "{err}");

    // A crash between the redaction record and the deletion is finished on the next open.
    let c = h
        .store
        .append(
            "clearing/m2",
            ExpectedVersion::Any,
            vec![
                NewEvent::new("ClearingDecided", json!({})).with_personal(
                    json!({"beneficiary": "Grace Hopper"})
                        .as_object()
                        .unwrap()
                        .clone(),
                ),
            ],
        )
        .await
        .unwrap();
    let victim = h.store.read_all(c[0].seq, 1).await.unwrap().remove(0);
    h.store
        .append(
            REDACTION_STREAM,
            ExpectedVersion::Any,
            vec![NewEvent::new(
                REDACTION_EVENT_TYPE,
                json!({"event_id": victim.event_id, "member": "beneficiary"}),
            )],
        )
        .await
        .unwrap();
    assert_eq!(h.store.personal_fields(&victim).await.unwrap().len(), 1);
    let reopened = EventStore::connect(&h.url, StoreConfig::default())
        .await
        .unwrap();
    assert!(reopened.personal_fields(&victim).await.unwrap().is_empty());
    reopened.shutdown().await;
    h.finish().await;
}

/// Time travel: a whole category up to a seq, the last of a kind before a point, and the
/// newest seq at a time.
async fn reads_as_of_a_seq_or_a_time<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let one = |stream: &'static str, kind: &'static str| async move {
        s.append(stream, ExpectedVersion::Any, vec![ev(kind, 0)])
            .await
            .unwrap()
            .remove(0)
    };
    let first = one("engine/sgp", "EngineActivated").await; // 1
    one("clearing/m1", "ClearingDecided").await; // 2
    one("engine", "NotInTheCategoryPrefix").await; // 3: category engine, no `engine/`
    one("engineering/x", "EngineActivated").await; // 4: another category
    tokio::time::sleep(Duration::from_millis(15)).await;
    // One batch: every event in it has the same time.
    let batch = s
        .append(
            "engine/hkg",
            ExpectedVersion::Any,
            vec![ev("EngineActivated", 5), ev("EngineDeactivated", 6)],
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(15)).await;
    let late = one("clearing/m1", "ClearingDecided").await; // 7
    one("engine/sgp", "EngineDeactivated").await; // 8
    let seqs = |events: Vec<aether_ledger::RecordedEvent>| {
        events.iter().map(|e| e.seq).collect::<Vec<_>>()
    };

    let engines = EventFilter {
        stream_prefix: Some("engine/".into()),
        ..Default::default()
    };
    assert_eq!(
        seqs(s.query(&engines, 0, 10).await.unwrap()),
        vec![1, 5, 6, 8]
    );
    assert_eq!(seqs(s.query(&engines, 1, 2).await.unwrap()), vec![5, 6]);
    let upto_6 = EventFilter {
        max_seq: Some(6),
        ..engines.clone()
    };
    assert_eq!(seqs(s.query(&upto_6, 0, 10).await.unwrap()), vec![1, 5, 6]);
    let upto_0 = EventFilter {
        max_seq: Some(0),
        ..engines.clone()
    };
    assert!(s.query(&upto_0, 0, 10).await.unwrap().is_empty());
    let huge = EventFilter {
        max_seq: Some(u64::MAX),
        ..engines.clone()
    };
    assert_eq!(s.query(&huge, 0, 10).await.unwrap().len(), 4);
    assert!(s.query(&engines, u64::MAX, 10).await.unwrap().is_empty());

    // Backward: newest first, before a seq and within the bound.
    assert_eq!(
        seqs(s.query_backward(&engines, u64::MAX, 10).await.unwrap()),
        vec![8, 6, 5, 1]
    );
    assert_eq!(
        seqs(s.query_backward(&upto_6, u64::MAX, 1).await.unwrap()),
        vec![6]
    );
    let activated = EventFilter {
        event_type: Some("EngineActivated".into()),
        max_seq: Some(4),
        ..Default::default()
    };
    assert_eq!(
        seqs(s.query_backward(&activated, u64::MAX, 1).await.unwrap()),
        vec![4]
    );
    assert_eq!(
        seqs(s.query_backward(&activated, 4, 10).await.unwrap()),
        vec![1]
    );

    // A time resolves to the last event recorded at or before it.
    let before = first.recorded_at - chrono::Duration::milliseconds(1);
    assert_eq!(s.seq_at_time(before).await.unwrap(), None);
    // Against the answer worked out from every event.
    let all = s.read_all(1, 100).await.unwrap();
    for probe in all.iter().map(|e| e.recorded_at) {
        let newest = all.iter().rev().find(|e| e.recorded_at <= probe);
        assert_eq!(
            s.seq_at_time(probe).await.unwrap(),
            newest.map(|e| (e.seq, e.recorded_at))
        );
    }
    let at_batch = s.seq_at_time(batch[0].recorded_at).await.unwrap();
    assert_eq!(at_batch, Some((6, batch[1].recorded_at)));
    let between = batch[0].recorded_at + chrono::Duration::milliseconds(5);
    assert_eq!(
        s.seq_at_time(between).await.unwrap().map(|(q, _)| q),
        Some(6)
    );
    assert!(between < late.recorded_at);
    let future = late.recorded_at + chrono::Duration::days(1);
    assert_eq!(
        s.seq_at_time(future).await.unwrap().map(|(q, _)| q),
        Some(8)
    );
    h.finish().await;
}

async fn lookup_by_metadata_values_finds_every_match_in_one_query<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let decided = |request_id: &str, member: &str| {
        NewEvent::new("ClearingDecided", json!({"r": request_id}))
            .with_metadata(json!({"request_id": request_id, "member": member}))
    };
    for (stream, event) in [
        ("clearing/m1", decided("r-1", "m1")),
        ("clearing/m2", decided("r-1", "m2")),
        ("clearing/m1", decided("r-2", "m1")),
        ("clearing/m1", decided("r-3", "m1")),
        (
            "netting",
            NewEvent::new("NettingComputed", json!({})).with_metadata(json!({"request_id": "r-2"})),
        ),
        (
            "other",
            NewEvent::new("ClearingDecided", json!({})).with_metadata(json!({"actor": "x"})),
        ),
    ] {
        s.append(stream, ExpectedVersion::Any, vec![event])
            .await
            .unwrap();
    }
    let seqs = |events: Vec<aether_ledger::RecordedEvent>| {
        events.iter().map(|e| e.seq).collect::<Vec<_>>()
    };
    let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let found = s
        .find_by_metadata(
            "request_id",
            &ids(&["r-2", "r-1", "r-9"]),
            "ClearingDecided",
        )
        .await
        .unwrap();
    // Both members' r-1, the decision r-2 but not the netting event naming it, in seq order.
    assert_eq!(seqs(found), vec![1, 2, 3]);
    let none = s
        .find_by_metadata("request_id", &ids(&["r-9"]), "ClearingDecided")
        .await
        .unwrap();
    assert!(none.is_empty());
    assert!(
        s.find_by_metadata("request_id", &[], "ClearingDecided")
            .await
            .unwrap()
            .is_empty()
    );
    // A value that looks like SQL is a value.
    let quoted = s
        .find_by_metadata("request_id", &ids(&["r-1' OR '1'='1"]), "ClearingDecided")
        .await
        .unwrap();
    assert!(quoted.is_empty());

    let err = s
        .find_by_metadata("password", &ids(&["x"]), "ClearingDecided")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("cannot be looked up"), "{err}");
    let too_many = vec!["x".to_owned(); aether_ledger::MAX_LOOKUP_VALUES + 1];
    let err = s
        .find_by_metadata("request_id", &too_many, "ClearingDecided")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("at most"), "{err}");
    h.finish().await;
}

/// The server dropping every connection (a restart, a failover) costs only the appends and
/// reads that find out: connections that failed are closed, never reused, and the ledger
/// goes on gapless and verifiable.
/// A checkpointer that cannot sign (here PostgreSQL refuses checkpoint rows for a while)
/// keeps running, and signs what it owes once it can again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpointer_that_cannot_sign_retries_until_it_can() {
    use sqlx::Connection;
    let h = Harness::postgres(StoreConfig::default()).await;
    for n in 0..25 {
        h.store
            .append("a", ExpectedVersion::Any, vec![ev("E", n)])
            .await
            .unwrap();
    }
    let mut admin = sqlx::PgConnection::connect(&h.url).await.unwrap();
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION refuse_checkpoints() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.stream_id = '{CHECKPOINT_STREAM}' THEN \
         RAISE EXCEPTION 'checkpoints refused by the test'; END IF; RETURN NEW; END $$; \
         CREATE TRIGGER refuse_checkpoints BEFORE INSERT ON events \
         FOR EACH ROW EXECUTE FUNCTION refuse_checkpoints();"
    ))
    .execute(&mut admin)
    .await
    .unwrap();
    let signer = CheckpointSigner::generate().unwrap();
    let trusted = signer.verifier();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let policy = CheckpointPolicy {
        every_events: 10,
        every: Duration::from_secs(3600),
    };
    let task = tokio::spawn(run_checkpointer(h.store.clone(), signer, policy, stop_rx));
    // Long enough for a refused signing and a retry a second later.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!task.is_finished(), "the checkpointer gave up");
    assert_eq!(h.store.stream_version(CHECKPOINT_STREAM).await.unwrap(), 0);

    sqlx::raw_sql("DROP TRIGGER refuse_checkpoints ON events")
        .execute(&mut admin)
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while h.store.stream_version(CHECKPOINT_STREAM).await.unwrap() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline && !task.is_finished(),
            "no checkpoints after the database took them again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_tx.send(true).unwrap();
    task.await.unwrap().unwrap();
    let report = verify_store(&h.store, Some(trusted), |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    let latest = report.latest_checkpoint.unwrap();
    assert_eq!(latest.tree_size, head_seq(&h.store).await - 1);
    h.finish().await;
}

/// A Merkle log whose file cannot be written (here `/dev/full`: every write is ENOSPC, as
/// on a full disk) refuses to catch up with the error, adds nothing half-written, and its
/// follower stays alive retrying rather than ending silently, until told to stop.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merkle_follower_whose_disk_is_full_keeps_retrying() {
    use aether_ledger::MerkleLog;
    let h = Harness::sqlite(StoreConfig::default()).await;
    let log = MerkleLog::open(std::path::Path::new("/dev/full"), &h.store)
        .await
        .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let follower = tokio::spawn(log.clone().follow(h.store.clone(), stop_rx));
    h.store
        .append("m", ExpectedVersion::Any, vec![ev("E", 1), ev("E", 2)])
        .await
        .unwrap();
    // Long enough for a failed catch-up and a retry a second later.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!follower.is_finished(), "the follower gave up");
    assert_eq!(log.len(), 0);
    let err = log.catch_up(&h.store).await.unwrap_err();
    assert!(err.to_string().contains("No space left on device"), "{err}");
    assert_eq!(log.len(), 0);
    stop_tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(5), follower)
        .await
        .expect("the follower stops when told")
        .unwrap();
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_recovers_after_the_server_drops_every_connection() {
    use sqlx::Connection;

    let h = Harness::postgres(StoreConfig::default()).await;
    let s = &h.store;
    let mut acked = Vec::new();
    // Warm up: appends, follower pages and lookups leave connections kept and pooled.
    for n in 0..20 {
        let c = s
            .append(
                "clearing/m1",
                ExpectedVersion::Any,
                vec![ev("ClearingDecided", n)],
            )
            .await
            .unwrap();
        acked.extend(c.into_iter().map(|c| c.event_id));
    }
    s.read_all(0, 100).await.unwrap();
    s.find_by_metadata("trace_id", &["t1".to_owned()], "ClearingDecided")
        .await
        .unwrap();

    let mut admin = sqlx::PgConnection::connect(&h.url).await.unwrap();
    let dropped: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    assert!(!dropped.is_empty(), "the store held connections to drop");
    admin.close().await.unwrap();

    let mut failures = 0;
    for n in 20..50 {
        loop {
            match s
                .append(
                    "clearing/m1",
                    ExpectedVersion::Any,
                    vec![ev("ClearingDecided", n)],
                )
                .await
            {
                Ok(c) => {
                    acked.extend(c.into_iter().map(|c| c.event_id));
                    break;
                }
                Err(e) => {
                    failures += 1;
                    assert!(failures < 30, "appends keep failing: {e}");
                }
            }
        }
    }
    // Reads recover the same way.
    let mut read = None;
    for _ in 0..30 {
        if let Ok(events) = s.read_all(0, 1_000).await {
            read = Some(events);
            break;
        }
    }
    let stored: HashSet<_> = read
        .expect("reads work again")
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    for id in &acked {
        assert!(stored.contains(id), "acknowledged event {id} is present");
    }
    let report = verify_store(s, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    h.finish().await;
}

/// Followers are served this process's recent commits from memory; what they get must be
/// what the database holds, byte for byte, with no gap where another process wrote.
async fn followers_get_what_the_database_holds_whoever_wrote_it<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let other = h.second_writer().await;
    let mut sub = h.store.subscribe(1);
    for round in 0..4u64 {
        // This process, then another, then this one again: the last batch does not follow
        // the one before it in this process's memory.
        for (store, n) in [(&h.store, 3), (&other, 2), (&h.store, 3)] {
            let mut tasks = Vec::new();
            for i in 0..n {
                let s = store.clone();
                tasks.push(tokio::spawn(async move {
                    s.append(
                        &format!("f/{i}"),
                        ExpectedVersion::Any,
                        vec![ev("E", round * 10 + i)],
                    )
                    .await
                    .unwrap()
                }));
            }
            for t in tasks {
                t.await.unwrap();
            }
        }
    }
    let head = head_seq(&h.store).await;
    assert_eq!(head, 32);
    let mut followed = Vec::new();
    while followed.len() < head as usize {
        let batch = tokio::time::timeout(Duration::from_secs(5), sub.next_batch(100))
            .await
            .expect("the subscriber reaches the head")
            .unwrap();
        followed.extend(batch);
    }
    let stored = h.store.read_all(1, 100).await.unwrap();
    let json = |e: &aether_ledger::RecordedEvent| serde_json::to_string(e).unwrap();
    assert_eq!(
        followed.iter().map(|e| json(e)).collect::<Vec<_>>(),
        stored.iter().map(json).collect::<Vec<_>>()
    );
    let hashes = h.store.read_hashes_following(1, 100).await.unwrap();
    let from_db = h.store.read_hashes(1, 100).await.unwrap();
    assert_eq!(hashes, from_db[..hashes.len()]);
    assert!(hashes.iter().map(|(s, _)| *s).eq(1..=hashes.len() as u64));
    other.shutdown().await;
    h.finish().await;
}

/// `read_all_into` (verify's read: one binary COPY on PostgreSQL) hands over exactly what
/// paged `read_all` returns, field by field, in pages of the asked size, from any seq.
async fn reading_everything_streamed_equals_reading_page_by_page<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    for batch in 0..5u64 {
        let events = (0..500)
            .map(|i| {
                let n = batch * 500 + i;
                NewEvent::new(
                    "ClearingDecided",
                    json!({"n": n, "memo": "crédit 清算 \"quoted\"\n", "big": 9_007_199_254_740_991i64}),
                )
                .with_metadata(json!({"request_id": format!("r{n}")}))
            })
            .collect();
        h.store
            .append(
                &format!("clearing/bank-{batch}"),
                ExpectedVersion::Any,
                events,
            )
            .await
            .unwrap();
    }
    let paged = h.store.read_all(1, 5_000).await.unwrap();
    assert_eq!(paged.len(), 2_500);
    for from in [1u64, 1_001, 2_500, 2_501] {
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        let reader = {
            let store = h.store.clone();
            tokio::spawn(async move { store.read_all_into(from, 1_000, &tx).await })
        };
        let mut streamed = Vec::new();
        let mut sizes = Vec::new();
        while let Some(page) = rx.recv().await {
            let page = page.unwrap();
            sizes.push(page.len());
            streamed.extend(page);
        }
        reader.await.unwrap().unwrap();
        let want = &paged[(from - 1) as usize..];
        assert_eq!(streamed.len(), want.len(), "from {from}");
        assert!(sizes.iter().rev().skip(1).all(|&n| n == 1_000), "{sizes:?}");
        for (got, want) in streamed.iter().zip(want) {
            assert_eq!(
                (got.seq, &got.stream_id, got.stream_version, got.event_id),
                (
                    want.seq,
                    &want.stream_id,
                    want.stream_version,
                    want.event_id
                )
            );
            assert_eq!(
                (&got.event_type, got.schema_version, got.recorded_at),
                (&want.event_type, want.schema_version, want.recorded_at)
            );
            assert_eq!(got.payload.get(), want.payload.get());
            assert_eq!(got.metadata.get(), want.metadata.get());
            assert_eq!((got.prev_hash, got.hash), (want.prev_hash, want.hash));
        }
    }
    h.finish().await;
}

/// A checkpoint may only cover the events before it. Verify builds the Merkle tree a page
/// ahead, so this is checked by position, not by the tree's size: a correctly signed
/// checkpoint at seq 6 that claims 6 or 7 events fails as beyond the log.
async fn a_checkpoint_covering_itself_or_later_events_is_refused<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    for claimed in [6u64, 7] {
        let h = open(StoreConfig::default()).await;
        let signer = CheckpointSigner::generate().unwrap();
        let trusted = signer.verifier();
        h.store
            .append(
                "a",
                ExpectedVersion::Any,
                (1..=5).map(|n| ev("E", n)).collect(),
            )
            .await
            .unwrap();
        let checkpoint = signer.sign(claimed, [7; 32], chrono::Utc::now());
        append_checkpoint(&h.store, &checkpoint).await;
        h.store
            .append("a", ExpectedVersion::Any, vec![ev("E", 6), ev("E", 7)])
            .await
            .unwrap();
        let report = verify_store(&h.store, Some(trusted), |_| {}).await.unwrap();
        let failure = report.failure.expect("refused");
        assert_eq!(failure.seq, 6, "claimed {claimed}");
        assert_eq!(
            failure.problem,
            Problem::CheckpointBeyondLog { tree_size: claimed }
        );
        h.finish().await;
    }
}

/// Verify stops reading at the first problem, with most of the ledger still unread (on
/// PostgreSQL mid-COPY: 60,000 events are six pages, the reader runs at most three ahead).
/// The store's connections must all still work afterwards; a connection handed back to
/// the pool mid-COPY failed the next query with a protocol error.
async fn a_verify_that_stops_early_leaves_the_store_usable<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    // One connection, so that the verify's is the one every later query gets.
    let h = open(StoreConfig {
        max_connections: 1,
        ..StoreConfig::default()
    })
    .await;
    for batch in 0..120u64 {
        h.store
            .append(
                "a",
                ExpectedVersion::Any,
                (0..500).map(|i| ev("E", batch * 500 + i)).collect(),
            )
            .await
            .unwrap();
    }
    h.tamper("UPDATE events SET payload = '{\"n\":700,\"note\":\"contract\"}' WHERE seq = 7")
        .await;
    for _ in 0..3 {
        let report = verify_store(&h.store, None, |_| {}).await.unwrap();
        assert_eq!(report.failure.expect("tampering found").seq, 7);
        // Give an aborted reader's connection time to go back (or away).
        tokio::time::sleep(Duration::from_millis(50)).await;
        let first = h.store.read_all(1, 10).await.unwrap();
        assert_eq!(
            first.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (1..=10).collect::<Vec<_>>()
        );
        h.store
            .append("b", ExpectedVersion::Any, vec![ev("E", 1)])
            .await
            .unwrap();
    }
    h.finish().await;
}

/// `with_own_pool`: the same ledger (one writer, one chain, the same followers' tail) for
/// tasks of another runtime, which can go away without taking connections the first
/// runtime's tasks use.
async fn a_store_over_its_own_pool_serves_another_runtime<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    for n in 1..=3 {
        h.store
            .append("notes/a", ExpectedVersion::Any, vec![ev("NoteTaken", n)])
            .await
            .unwrap();
    }
    let own = h.store.with_own_pool(2);
    let main = h.store.clone();
    let seen = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let seen = runtime.block_on(async move {
            let mut follower = own.subscribe(1);
            let mut seen = Vec::new();
            for _ in 0..3 {
                seen.push(follower.next().await.unwrap().seq);
            }
            // Its appends go through the one writer, onto the one chain.
            own.append(
                "notes/b",
                ExpectedVersion::NoStream,
                vec![ev("NoteTaken", 4)],
            )
            .await
            .unwrap();
            // And it follows what the other runtime appends, live.
            let live = tokio::spawn({
                let main = main.clone();
                async move {
                    main.append("notes/a", ExpectedVersion::Any, vec![ev("NoteTaken", 5)])
                        .await
                        .unwrap()
                }
            });
            for _ in 0..2 {
                seen.push(follower.next().await.unwrap().seq);
            }
            live.await.unwrap();
            assert_eq!(own.read_all(1, 100).await.unwrap().len(), 5);
            // Every connection its pool can hold (the 2 asked for, not the first store's
            // 8: a pool of its own), opened here.
            if let Some(pool) = own.postgres_pool() {
                assert_eq!(pool.options().get_max_connections(), 2);
                hold_every_connection(pool).await;
                assert_eq!(pool.size(), 2);
            }
            seen
        });
        // Gone, with every connection it opened.
        drop(runtime);
        seen
    })
    .join()
    .unwrap();
    assert_eq!(seen, vec![1, 2, 3, 4, 5]);
    // The first runtime's store still reads and appends.
    for n in 6..=8 {
        h.store
            .append("notes/a", ExpectedVersion::Any, vec![ev("NoteTaken", n)])
            .await
            .unwrap();
    }
    assert_eq!(h.store.read_all(1, 100).await.unwrap().len(), 8);
    assert_eq!(head_seq(&h.store).await, 8);
    // The first store's pool, which never held them, serves on as before.
    if let Some(pool) = h.store.postgres_pool() {
        hold_every_connection(pool).await;
    }
    let report = verify_store(&h.store, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    h.finish().await;
}

/// Acquires as many connections as `pool` may hold, at once, and runs a query on each.
async fn hold_every_connection(pool: &sqlx::PgPool) {
    let max = pool.options().get_max_connections();
    let mut held = Vec::new();
    for _ in 0..max {
        held.push(pool.acquire().await.unwrap());
    }
    for conn in &mut held {
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        assert_eq!(one, 1);
    }
}

/// For every hashed field, at the edges of what is accepted: what the database stores
/// re-hashes to the hash the append answered, and the ledger verifies. A field the database
/// silently changed (a clamped integer, a rounded number, a dropped character) would make the
/// answered hash unprovable for ever.
async fn every_hashed_field_at_its_limits_is_stored_as_answered<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let max_safe = 9_007_199_254_740_991i64;
    let strings = "\u{1}\u{1f}\"\\\n\t\u{7f}\u{2028}\u{fffd}\u{ffff}\u{10000}😀é";
    let payload = json!({
        "max": max_safe, "min": -max_safe, "zero": 0, "neg_zero": -0.0, "tiny": 5e-324,
        "small": 1e-7, "fraction": 0.1, "big_double": 9_007_199_254_740_991.0f64,
        "text": strings, "empty": "", "nested": {"a": [1, [2, [3, {"b": null}]]], "t": true},
        "\u{ffff}": "sorts after", "\u{10000}": "sorts before (UTF-16)", strings: "key",
    });
    let metadata = json!({"actor": "tést", "trace_id": "0af7651916cd43dd8448eb211c80319c",
                          "note": strings, "n": -max_safe});
    let event_id = uuid::Uuid::from_u128(u128::MAX);
    let long_type = format!("E{}", "x_.-9".repeat(127 / 5)) + "zz";
    let stream = "é".repeat(128); // 256 bytes, the limit
    let mut personal = serde_json::Map::new();
    personal.insert("holder".into(), json!({"name": strings, "n": max_safe}));
    let events = vec![
        NewEvent::new("Limits", payload.clone())
            .with_metadata(metadata.clone())
            .with_event_id(event_id)
            .with_schema_version(aether_ledger::MAX_SCHEMA_VERSION),
        NewEvent::new(long_type.clone(), json!({})).with_schema_version(0),
        NewEvent::new("Personal", json!({"kept": 1})).with_personal(personal),
    ];
    assert_eq!(long_type.len(), aether_ledger::MAX_EVENT_TYPE_BYTES);
    let committed = s
        .append(&stream, ExpectedVersion::NoStream, events)
        .await
        .unwrap();
    let stored = s.read_all(1, 10).await.unwrap();
    assert_eq!(stored.len(), 3);
    for (c, e) in committed.iter().zip(&stored) {
        assert_eq!((e.seq, e.event_id, e.hash), (c.seq, c.event_id, c.hash));
        assert_eq!(e.stream_id, stream);
        assert_eq!(e.stream_version, c.stream_version);
        assert_eq!(e.recorded_at, c.recorded_at);
        assert_eq!(e.computed_hash(), c.hash, "seq {} re-hashes", e.seq);
    }
    assert_eq!(stored[0].schema_version, aether_ledger::MAX_SCHEMA_VERSION);
    assert_eq!(stored[0].event_id, event_id);
    // Stored as the RFC 8785 text of what was sent (`-0.0` and `…991.0` become `0` and `…991`).
    let canonical = aether_ledger::hashing::canonical_json;
    assert_eq!(stored[0].payload.get(), canonical(&payload).unwrap());
    assert_eq!(stored[0].metadata.get(), canonical(&metadata).unwrap());
    assert_eq!(stored[1].schema_version, 0);
    assert_eq!(stored[1].event_type, long_type);
    let report = verify_store(s, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    h.finish().await;
}

/// Values just past what the databases store unchanged are refused with the reason, before
/// anything is hashed or written: a schema version past 2^31 − 1 (the column is 32-bit),
/// numbers past 2^53 − 1 in any form (`2^64` and `1e16` parse as doubles), U+0000 anywhere in
/// text (PostgreSQL's JSON refuses it), and a caller's imitation of a personal placeholder.
async fn values_the_database_would_change_are_refused_before_hashing<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig::default()).await;
    let s = &h.store;
    let parsed = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap();
    let mut nul_personal = serde_json::Map::new();
    nul_personal.insert("name".into(), json!("Ada\u{0}"));
    let cases: Vec<(&str, NewEvent, &str)> = vec![
        (
            "schema version 2^31",
            NewEvent::new("E", json!({})).with_schema_version(1 << 31),
            "schema_version 2147483648 is out of range: the ledger stores 0 to 2147483647",
        ),
        (
            "2^53",
            NewEvent::new("E", json!({"n": 9_007_199_254_740_992u64})),
            "payload number 9007199254740992 at $.n cannot be represented exactly",
        ),
        (
            "-2^53",
            NewEvent::new("E", json!({"n": -9_007_199_254_740_992i64})),
            "at $.n cannot be represented exactly",
        ),
        (
            "2^64",
            NewEvent::new("E", parsed(r#"{"n": 18446744073709551616}"#)),
            "at $.n cannot be represented exactly",
        ),
        (
            "1e16",
            NewEvent::new("E", json!({})).with_metadata(parsed(r#"{"a": [1, 1e16]}"#)),
            "at $.a[1] cannot be represented exactly",
        ),
        (
            "NUL in a value",
            NewEvent::new("E", json!({"a": {"b": "x\u{0}y"}})),
            "payload text at $.a.b contains U+0000",
        ),
        (
            "NUL in a name",
            NewEvent::new("E", json!({"a\u{0}": 1})),
            "payload text at $.a\\u0000 contains U+0000",
        ),
        (
            "NUL in metadata",
            NewEvent::new("E", json!({})).with_metadata(json!({"request_id": "\u{0}"})),
            "metadata text at $.request_id contains U+0000",
        ),
        (
            "NUL in a personal value",
            NewEvent::new("E", json!({})).with_personal(nul_personal),
            "personal text at $.name contains U+0000",
        ),
        (
            "imitated placeholder",
            NewEvent::new("E", json!({"a": [{"$personal": "NOT-HEX"}]})),
            "payload object at $.a[0] has a \"$personal\" member",
        ),
    ];
    for (name, event, message) in cases {
        let e = s
            .append("notes/a", ExpectedVersion::Any, vec![ev("E", 1), event])
            .await
            .expect_err(name);
        assert!(e.is_input_error(), "{name}: {e}");
        assert!(e.to_string().contains(message), "{name}: {e}");
    }
    assert_eq!(head_seq(s).await, 0, "nothing was written");
    // The largest accepted values next to them are stored.
    s.append(
        "notes/a",
        ExpectedVersion::Any,
        vec![
            NewEvent::new(
                "E",
                json!({"n": 9_007_199_254_740_991u64, "m": 1e15, "f": 1.5e-300}),
            )
            .with_schema_version(i32::MAX as u32),
        ],
    )
    .await
    .unwrap();
    let report = verify_store(s, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    h.finish().await;
}

/// One caller's event that the database itself refuses (here a trigger stands in for any
/// data the database will not store) fails that caller alone: the valid appends that shared
/// its group-commit batch are committed and answered, and the ledger verifies.
async fn a_row_the_database_refuses_fails_only_its_own_append<F, Fut>(open: F)
where
    F: Fn(StoreConfig) -> Fut,
    Fut: std::future::Future<Output = Harness>,
{
    let h = open(StoreConfig {
        max_wait: Duration::from_millis(20),
        ..StoreConfig::default()
    })
    .await;
    let poison = if h.store.postgres_pool().is_some() {
        "CREATE FUNCTION poison() RETURNS trigger AS $$ BEGIN \
           IF NEW.payload::text LIKE '%poison%' THEN \
             RAISE EXCEPTION 'poisoned row' USING ERRCODE = '22023'; END IF; \
           RETURN NEW; END $$ LANGUAGE plpgsql; \
         CREATE TRIGGER poison BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION poison();"
    } else {
        "CREATE TRIGGER poison BEFORE INSERT ON events WHEN NEW.payload LIKE '%poison%' \
         BEGIN SELECT RAISE(ABORT, 'poisoned row'); END;"
    };
    h.raw(poison).await.unwrap();
    let tasks: Vec<_> = (0..24u64)
        .map(|t| {
            let s = h.store.clone();
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                for i in 0..5u64 {
                    let poisoned = (t * 5 + i) % 11 == 0;
                    let payload = if poisoned {
                        json!({"n": t * 5 + i, "note": "poison"})
                    } else {
                        json!({"n": t * 5 + i})
                    };
                    let r = s
                        .append(
                            &format!("notes/{t}"),
                            ExpectedVersion::Any,
                            vec![NewEvent::new("Note", payload)],
                        )
                        .await;
                    outcomes.push((poisoned, r));
                }
                outcomes
            })
        })
        .collect();
    let mut acked = 0;
    let mut refused = 0;
    for t in tasks {
        for (poisoned, r) in t.await.unwrap() {
            match (poisoned, r) {
                (false, Ok(_)) => acked += 1,
                (true, Err(e)) => {
                    assert!(e.to_string().contains("poisoned row"), "{e}");
                    refused += 1;
                }
                (poisoned, r) => panic!("poisoned {poisoned}: {r:?}"),
            }
        }
    }
    assert_eq!((acked, refused), (120 - 11, 11));
    assert_eq!(head_seq(&h.store).await, 109);
    let report = verify_store(&h.store, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    h.finish().await;
}

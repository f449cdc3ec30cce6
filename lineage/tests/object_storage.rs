//! The Delta tables on a real S3-compatible server (`s3s-fs`, a child process speaking
//! signed S3 over HTTP): the relay writes both tables there, a reopened table resumes from
//! the store, a second writer's commit is refused by the store's conditional put (no
//! duplicate row), and a store without conditional puts is refused.

use std::collections::BTreeSet;
use std::time::Duration;

use aether_lineage::delta::{DeltaError, DeltaSink};
use aether_lineage::delta_relay::{DeltaRelayConfig, run_delta_relay};
use aether_lineage::testing::S3Server;
use serde_json::json;

mod support;
use support::{Chain, TempData, append_policies, open_sqlite_ledger, wait_until};

fn chain(n: usize) -> Vec<aether_ledger::RecordedEvent> {
    let mut chain = Chain::default();
    for i in 0..n {
        chain.append(
            &format!("policy/p{}", i % 3),
            "PolicyIngested",
            json!({"n": i}),
            json!({"actor": "test"}),
        );
    }
    chain.events
}

/// Runs the relay until the table holds every seq up to `seq`, then stops it.
async fn relay_until(store: &aether_ledger::EventStore, config: &DeltaRelayConfig, seq: u64) {
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let relay = tokio::spawn(run_delta_relay(store.clone(), config.clone(), stop_rx));
    wait_until("the relay reached the head", || async {
        DeltaSink::open_or_create_with(&config.location, &config.storage_options)
            .await
            .is_ok_and(|s| s.last_seq() == seq)
    })
    .await;
    stop.send(true).expect("relay running");
    relay.await.expect("task").expect("relay");
}

#[tokio::test]
async fn the_relay_writes_both_tables_to_the_object_store_and_a_reopened_table_resumes() {
    let server = S3Server::start();
    let dir = TempData::new("s3-relay");
    let store = open_sqlite_ledger(&dir.0).await;
    append_policies(&store, 0, 40).await;
    let events = server.uri("lineage/events");
    let config = DeltaRelayConfig {
        location: events.clone().into(),
        decisions: Some(server.uri("lineage/clearing_decisions").into()),
        max_events: 15,
        max_wait: Duration::from_millis(20),
        storage_options: server.options(),
    };
    relay_until(&store, &config, 40).await;

    // The tables are objects on the server, not files beside the ledger.
    let log = server.bucket_dir().join("lineage/events/_delta_log");
    assert!(log.join("00000000000000000000.json").is_file(), "{log:?}");
    assert!(
        server
            .bucket_dir()
            .join("lineage/clearing_decisions/_delta_log/00000000000000000000.json")
            .is_file()
    );
    assert!(!dir.0.join("delta").exists());
    assert_eq!(
        server.table_seqs(&events).await,
        (1..=40).collect::<Vec<i64>>()
    );

    // More events and a relay started again: it resumes from the table on the store.
    append_policies(&store, 40, 10).await;
    relay_until(&store, &config, 50).await;
    assert_eq!(
        server.table_seqs(&events).await,
        (1..=50).collect::<Vec<i64>>()
    );
}

#[tokio::test]
async fn a_second_writer_is_refused_by_the_store_and_no_row_is_written_twice() {
    let server = S3Server::start();
    let location = server.uri("tables/events");
    let options = server.options();
    let events = chain(12);
    // Both open the table at the same version: the second is a writer that lost its lease
    // while paused and wakes up believing it is still the relay.
    let mut holder = DeltaSink::open_or_create_with(&location, &options)
        .await
        .expect("open");
    let mut stale = DeltaSink::open_or_create_with(&location, &options)
        .await
        .expect("open");
    holder.append(&events[..8]).await.expect("first writer");
    let refused = stale.append(&events[..5]).await;
    assert!(
        matches!(refused, Err(DeltaError::Delta(_))),
        "the stale writer's commit was accepted: {refused:?}"
    );
    // Neither does a stale writer that goes on past what the holder wrote get in.
    let refused = stale.append(&events[5..]).await;
    assert!(refused.is_err(), "{refused:?}");

    let reopened = DeltaSink::open_or_create_with(&location, &options)
        .await
        .expect("reopen");
    assert_eq!(reopened.last_seq(), 8);
    let rows = server.table_seqs(&location).await;
    assert_eq!(rows, (1..=8).collect::<Vec<i64>>());
    assert_eq!(rows.iter().collect::<BTreeSet<_>>().len(), rows.len());

    // The holder carries on.
    holder.append(&events[8..]).await.expect("holder continues");
    assert_eq!(
        server.table_seqs(&location).await,
        (1..=12).collect::<Vec<i64>>()
    );
}

#[tokio::test]
async fn a_store_without_conditional_puts_is_refused() {
    let server = S3Server::start();
    let mut options = server.options();
    options.insert("aws_conditional_put".into(), "disabled".into());
    let error = DeltaSink::open_or_create_with(server.uri("unsafe/events"), &options)
        .await
        .expect_err("a store without conditional puts was used");
    let text = error.to_string();
    assert!(text.contains("conditional puts are disabled"), "{text}");
    assert!(!server.bucket_dir().join("unsafe").exists());
}

#[tokio::test]
async fn wrong_credentials_are_an_error_naming_the_table_not_a_local_fallback() {
    let server = S3Server::start();
    let mut options = server.options();
    options.insert("aws_secret_access_key".into(), "not-the-secret".into());
    let error = DeltaSink::open_or_create_with(server.uri("denied/events"), &options)
        .await
        .expect_err("wrong credentials were accepted");
    assert!(!server.bucket_dir().join("denied").exists(), "{error}");
}

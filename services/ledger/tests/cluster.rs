//! Leases with fencing tokens on the PostgreSQL ledger, against a real database: who holds
//! a duty, how its token moves, and that the database refuses a stale holder's write.

use std::time::Duration;

use aether_ledger::checkpoint::{CHECKPOINT_EVENT_TYPE, CheckpointSigner};
use aether_ledger::checkpointer::{CHECKPOINTER_LEASE, run_checkpointer_under};
use aether_ledger::cluster::{LeaseConfig, fence, keep_lease};
use aether_ledger::testing::TestDatabase;
use aether_ledger::{
    CheckpointPolicy, EventStore, ExpectedVersion, LedgerError, NewEvent, StoreConfig, verify_store,
};
use serde_json::json;
use sqlx::Connection;

async fn open(db: &TestDatabase) -> EventStore {
    EventStore::connect(&db.url, StoreConfig::default())
        .await
        .unwrap()
}

fn fenced(lease: &str, token: u64, n: u64) -> NewEvent {
    let mut metadata = json!({"actor": "duty"});
    fence(&mut metadata, lease, token);
    NewEvent::new("DutyDone", json!({"n": n})).with_metadata(metadata)
}

async fn head(store: &EventStore) -> u64 {
    store.head().await.unwrap().map_or(0, |(s, _)| s)
}

/// The lease's token rises at each change of holder and only then; a live lease is its
/// holder's alone; and the database stores a fenced event only under the current token of a
/// live lease: a holder that lost its lease while paused is refused, alone, even when its
/// write shares a group commit with others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_holders_write_is_refused_by_the_database() {
    let db = TestDatabase::create().await;
    let store = open(&db).await;
    let ttl = Duration::from_millis(400);
    assert_eq!(
        store.acquire_lease("duty", "node-a", ttl).await.unwrap(),
        Some(1)
    );
    assert_eq!(
        store.acquire_lease("duty", "node-a", ttl).await.unwrap(),
        Some(1),
        "a renewal keeps the token"
    );
    assert_eq!(
        store.acquire_lease("duty", "node-b", ttl).await.unwrap(),
        None,
        "a live lease is its holder's"
    );
    store
        .append("duties/a", ExpectedVersion::Any, vec![fenced("duty", 1, 1)])
        .await
        .unwrap();
    let wrong = store
        .append("duties/a", ExpectedVersion::Any, vec![fenced("duty", 7, 2)])
        .await
        .unwrap_err();
    assert!(matches!(wrong, LedgerError::Fenced(_)), "{wrong}");

    // node-a is paused past its lease; node-b takes it, with a new token.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    assert_eq!(
        store.acquire_lease("duty", "node-b", ttl).await.unwrap(),
        Some(2)
    );
    let before = head(&store).await;
    // node-a wakes and writes under its old token, among other callers' appends.
    let others: Vec<_> = (0..20u64)
        .map(|n| {
            let s = store.clone();
            tokio::spawn(async move {
                s.append(
                    "notes/x",
                    ExpectedVersion::Any,
                    vec![NewEvent::new("Note", json!({"n": n}))],
                )
                .await
            })
        })
        .collect();
    let stale = store
        .append("duties/a", ExpectedVersion::Any, vec![fenced("duty", 1, 3)])
        .await
        .unwrap_err();
    match &stale {
        LedgerError::Fenced(message) => {
            assert!(
                message.contains("lease duty is not held under token 1 (current: 2)"),
                "{message}"
            )
        }
        other => panic!("expected Fenced, got {other}"),
    }
    for other in others {
        other.await.unwrap().unwrap();
    }
    assert_eq!(
        head(&store).await,
        before + 20,
        "only the stale write was refused"
    );
    assert_eq!(
        store.acquire_lease("duty", "node-a", ttl).await.unwrap(),
        None
    );
    store
        .append("duties/a", ExpectedVersion::Any, vec![fenced("duty", 2, 4)])
        .await
        .unwrap();

    // An expired lease fences even its last holder until it takes the lease again.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let expired = store
        .append("duties/a", ExpectedVersion::Any, vec![fenced("duty", 2, 5)])
        .await
        .unwrap_err();
    assert!(matches!(expired, LedgerError::Fenced(_)), "{expired}");
    assert_eq!(
        store.acquire_lease("duty", "node-b", ttl).await.unwrap(),
        Some(3)
    );
    // Given up: the next holder takes it at once, with the next token.
    store.release_lease("duty", "node-b").await.unwrap();
    assert_eq!(
        store.acquire_lease("duty", "node-a", ttl).await.unwrap(),
        Some(4)
    );
    let leases = store.leases().await.unwrap();
    assert_eq!(
        (leases[0].holder.as_str(), leases[0].token, leases[0].live),
        ("node-a", 4, true)
    );

    // The first node's value of a cluster setting stays.
    assert_eq!(store.claim_setting("k", "first").await.unwrap(), "first");
    assert_eq!(store.claim_setting("k", "second").await.unwrap(), "first");
    let report = verify_store(&store, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    store.shutdown().await;
    db.drop_database().await;
}

/// Two checkpointers on one ledger (two nodes): one signs; when it dies without giving the
/// lease up, the other takes over after the lease's ttl and signs under a higher token;
/// every checkpoint is fenced, tokens never go down along the ledger, and it verifies with
/// the one cluster key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpointer_takes_over_when_the_holder_dies() {
    let db = TestDatabase::create().await;
    let a = open(&db).await;
    let b = open(&db).await;
    let keys = tempfile::tempdir().unwrap();
    let (signer, _) = CheckpointSigner::load_or_create(keys.path()).unwrap();
    let policy = CheckpointPolicy {
        every_events: 5,
        every: Duration::from_millis(200),
    };
    let ttl = Duration::from_millis(600);
    let config = |holder: &str| LeaseConfig {
        name: CHECKPOINTER_LEASE.into(),
        holder: holder.into(),
        ttl,
    };
    let (stop_a, stop_rx_a) = tokio::sync::watch::channel(false);
    let (_stop_b, stop_rx_b) = tokio::sync::watch::channel(false);
    let (lease_a, keeper_a) = keep_lease(a.clone(), config("node-a"), stop_rx_a.clone());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (lease_b, keeper_b) = keep_lease(b.clone(), config("node-b"), stop_rx_b.clone());
    let ckpt_a = tokio::spawn(run_checkpointer_under(
        a.clone(),
        CheckpointSigner::load_or_create(keys.path()).unwrap().0,
        policy.clone(),
        lease_a,
        stop_rx_a,
    ));
    let ckpt_b = tokio::spawn(run_checkpointer_under(
        b.clone(),
        signer,
        policy,
        lease_b,
        stop_rx_b,
    ));
    for n in 0..20u64 {
        a.append(
            "notes/a",
            ExpectedVersion::Any,
            vec![NewEvent::new("Note", json!({"n": n}))],
        )
        .await
        .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    // node-a dies: its lease keeper and checkpointer stop without a word.
    keeper_a.abort();
    ckpt_a.abort();
    let _ = stop_a;
    for n in 20..40u64 {
        b.append(
            "notes/b",
            ExpectedVersion::Any,
            vec![NewEvent::new("Note", json!({"n": n}))],
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(ttl * 2).await;
    let all = b.read_all(1, 10_000).await.unwrap();
    let checkpoints: Vec<(u64, String, u64)> = all
        .iter()
        .filter(|e| e.event_type == CHECKPOINT_EVENT_TYPE)
        .map(|e| {
            let m = e.metadata_value().unwrap();
            (
                e.seq,
                m["fence"]["lease"].as_str().unwrap().to_owned(),
                m["fence"]["token"].as_u64().unwrap(),
            )
        })
        .collect();
    let tokens: Vec<u64> = checkpoints.iter().map(|c| c.2).collect();
    assert!(
        checkpoints.iter().all(|c| c.1 == CHECKPOINTER_LEASE),
        "{checkpoints:?}"
    );
    assert!(
        tokens.windows(2).all(|w| w[0] <= w[1]),
        "tokens went down: {tokens:?}"
    );
    assert_eq!(tokens.first(), Some(&1), "node-a signed first: {tokens:?}");
    assert_eq!(tokens.last(), Some(&2), "node-b took over: {tokens:?}");
    let last_checkpoint = checkpoints.last().unwrap().0;
    assert!(
        last_checkpoint > 40,
        "node-b signed the events after the takeover"
    );
    let trusted = aether_ledger::CheckpointVerifier::from_pem_file(
        &keys.path().join(aether_ledger::checkpoint::PUBLIC_KEY_FILE),
    )
    .unwrap();
    let report = verify_store(&b, Some(trusted), |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    assert!(report.checkpoints_checked >= 2);
    ckpt_b.abort();
    keeper_b.abort();
    a.shutdown().await;
    b.shutdown().await;
    db.drop_database().await;
}

/// Two busy nodes appending to one ledger: every append goes through (none refused for a
/// race lost to the other writer), and the chain is one. Each writer, once it has seen the
/// other, plans and commits its batches under the append lock. Two followers on one node
/// (as its two lineage relays) each see every event once, in order, as stored, though most
/// come from the other node and one follower's reads serve the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_busy_writers_get_every_append_through() {
    let db = TestDatabase::create().await;
    let a = open(&db).await;
    let b = open(&db).await;
    let followers: Vec<_> = (0..2)
        .map(|_| {
            let mut subscription = a.subscribe(1);
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while seen.len() < 5120 {
                    for e in subscription.next_batch(500).await.unwrap() {
                        seen.push((e.seq, e.hash, e.payload.get().to_owned()));
                    }
                }
                seen
            })
        })
        .collect();
    let mut tasks = Vec::new();
    for t in 0..128u64 {
        let store = if t % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            let mut refused = Vec::new();
            for i in 0..40u64 {
                let event = NewEvent::new("Traded", json!({"t": t, "i": i}));
                if let Err(e) = store
                    .append(&format!("trades/{t}"), ExpectedVersion::Any, vec![event])
                    .await
                {
                    refused.push(e.to_string());
                }
            }
            refused
        }));
    }
    let mut refused = Vec::new();
    for task in tasks {
        refused.extend(task.await.unwrap());
    }
    assert!(
        refused.is_empty(),
        "{} of 5120 appends refused, first: {:?}",
        refused.len(),
        refused.first()
    );
    assert_eq!(head(&a).await, 5120);
    let report = verify_store(&a, None, |_| {}).await.unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    let stored: Vec<_> = b
        .read_all(1, 6000)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.seq, e.hash, e.payload.get().to_owned()))
        .collect();
    for follower in followers {
        let seen = tokio::time::timeout(Duration::from_secs(30), follower)
            .await
            .expect("a follower kept up")
            .unwrap();
        assert_eq!(seen.len(), stored.len());
        assert!(seen == stored, "a follower saw other events than stored");
    }
    a.shutdown().await;
    b.shutdown().await;
    db.drop_database().await;
}

/// A node under the append lock takes in, with its batch, the appends that queued while it
/// awaited the lock: they commit with it (one batch, one `recorded_at`) instead of each
/// waiting for the lock once more, which with three nodes on one machine cost a quarter of
/// the throughput.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_that_queue_for_the_lock_go_in_with_the_batch_that_holds_it() {
    let db = TestDatabase::create().await;
    let a = open(&db).await;
    let b = open(&db).await;
    let one = |n: u64| vec![NewEvent::new("Traded", json!({"n": n}))];
    // A meets B's write and appends under the lock from then on.
    for (store, n) in [(&a, 0), (&b, 1), (&a, 2)] {
        store
            .append("trades/warm-up", ExpectedVersion::Any, one(n))
            .await
            .unwrap();
    }
    let before = head(&a).await;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(27414623383024161)")
        .execute(&mut holder)
        .await
        .unwrap();
    let append = |n: u64| {
        let a = a.clone();
        tokio::spawn(async move {
            a.append(&format!("trades/{n}"), ExpectedVersion::Any, one(n))
                .await
        })
    };
    // The first append's batch is waiting for the lock before the others arrive.
    let mut appends = vec![append(10)];
    tokio::time::sleep(Duration::from_millis(300)).await;
    appends.extend((11..30).map(append));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        head(&b).await,
        before,
        "nothing goes in while the lock is held"
    );
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    for task in appends {
        task.await.unwrap().unwrap();
    }
    let recorded: Vec<(i64, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT seq, recorded_at FROM events WHERE seq > $1 ORDER BY seq")
            .bind(i64::try_from(before).unwrap())
            .fetch_all(&mut holder)
            .await
            .unwrap();
    assert_eq!(recorded.len(), 20);
    assert!(
        recorded.iter().all(|(_, at)| *at == recorded[0].1),
        "one batch: {recorded:?}"
    );
    a.shutdown().await;
    b.shutdown().await;
    db.drop_database().await;
}

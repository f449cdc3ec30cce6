//! Rotating the checkpoint key on a real ledger: a ledger signed by a sequence of keys
//! verifies from the first one; the retired key can sign nothing after the rotation, and a
//! checkpointer that holds only the retired key stops instead of signing.

use std::time::Duration;

use aether_ledger::checkpoint::{CHECKPOINT_STREAM, CheckpointSigner, CheckpointVerifier};
use aether_ledger::checkpointer::run_checkpointer_rotating;
use aether_ledger::cluster::HeldLease;
use aether_ledger::key_rotation::{KEY_ROTATION_STREAM, KeyRotation, key_in_force};
use aether_ledger::{
    CheckpointPolicy, EventStore, ExpectedVersion, LedgerError, NewEvent, Problem, StoreConfig,
    verify_store,
};
use serde_json::json;

async fn sqlite() -> (tempfile::TempDir, EventStore) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let store = EventStore::connect(&url, StoreConfig::default())
        .await
        .unwrap();
    (dir, store)
}

async fn append(store: &EventStore, n: u64) {
    for i in 0..n {
        store
            .append(
                "trades/a",
                ExpectedVersion::Any,
                vec![NewEvent::new("Traded", json!({"i": i}))],
            )
            .await
            .unwrap();
    }
}

/// Runs a checkpointer with `signer` (rotating from `previous`) over `n` new events, then
/// stops it (which signs a last checkpoint); returns what it ended with.
async fn sign_over(
    store: &EventStore,
    signer: &CheckpointSigner,
    previous: Option<&CheckpointSigner>,
    n: u64,
) -> Result<(), LedgerError> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let policy = CheckpointPolicy {
        every_events: 10,
        every: Duration::from_millis(200),
    };
    let task = tokio::spawn(run_checkpointer_rotating(
        store.clone(),
        signer.clone(),
        previous.cloned(),
        policy,
        HeldLease::always("checkpointer"),
        stop_rx,
    ));
    append(store, n).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let _ = stop_tx.send(true);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the checkpointer stops")
        .unwrap()
}

/// The Merkle root of the ledger's first `size` events.
async fn root_at(store: &EventStore, size: u64) -> aether_ledger::Hash {
    let log = aether_ledger::MerkleLog::default();
    log.catch_up(store).await.unwrap();
    log.root_at(size).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_signed_by_a_sequence_of_keys_verifies_from_the_first() {
    let (_dir, store) = sqlite().await;
    let first = CheckpointSigner::generate().unwrap();
    let second = CheckpointSigner::generate().unwrap();
    let third = CheckpointSigner::generate().unwrap();

    sign_over(&store, &first, None, 25).await.unwrap();
    assert_eq!(
        key_in_force(&store).await.unwrap(),
        Some(first.public_key_hex())
    );
    sign_over(&store, &second, Some(&first), 25).await.unwrap();
    sign_over(&store, &third, Some(&second), 25).await.unwrap();
    assert_eq!(
        key_in_force(&store).await.unwrap(),
        Some(third.public_key_hex())
    );
    assert_eq!(
        store.stream_version(KEY_ROTATION_STREAM).await.unwrap(),
        2,
        "one rotation per new key"
    );

    let report = verify_store(&store, Some(first.verifier()), |_| {})
        .await
        .unwrap();
    assert!(report.is_ok(), "{:?}", report.failure);
    assert_eq!(report.key_rotations.len(), 2);
    assert_eq!(report.key_rotations[1].new_key, third.public_key_hex());
    assert_eq!(
        report.latest_checkpoint.unwrap().public_key,
        third.public_key_hex(),
        "the newest checkpoint is signed by the newest key"
    );
    // Trusting a later key does not make the earlier checkpoints its own.
    let report = verify_store(&store, Some(second.verifier()), |_| {})
        .await
        .unwrap();
    assert!(
        matches!(
            report.failure.as_ref().map(|f| &f.problem),
            Some(Problem::BadCheckpoint { .. })
        ),
        "{:?}",
        report.failure
    );
    // Without a trusted key, the chain of keys is still followed.
    assert!(verify_store(&store, None, |_| {}).await.unwrap().is_ok());

    // A checkpointer that holds only a retired key stops instead of signing.
    let retired = sign_over(&store, &second, None, 15).await;
    assert!(
        matches!(retired, Err(LedgerError::CheckpointKeyRetired { .. })),
        "{retired:?}"
    );
    let report = verify_store(&store, Some(first.verifier()), |_| {})
        .await
        .unwrap();
    assert!(report.is_ok(), "nothing was signed by the retired key");
}

/// What a holder of a retired key could forge is refused by `verify`: a checkpoint signed
/// with it after the rotation, and a second rotation signed by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_key_can_sign_nothing_after_its_rotation() {
    let (_dir, store) = sqlite().await;
    let first = CheckpointSigner::generate().unwrap();
    let second = CheckpointSigner::generate().unwrap();
    sign_over(&store, &first, None, 12).await.unwrap();
    sign_over(&store, &second, Some(&first), 12).await.unwrap();
    let trusted = || Some(CheckpointVerifier::from_hex(&first.public_key_hex()).unwrap());
    assert!(
        verify_store(&store, trusted(), |_| {})
            .await
            .unwrap()
            .is_ok()
    );

    let head = store.head().await.unwrap().unwrap().0;
    let root = root_at(&store, head).await;
    let forged = first.sign(head, root, chrono::Utc::now());
    store
        .append(
            CHECKPOINT_STREAM,
            ExpectedVersion::Any,
            vec![forged.to_event()],
        )
        .await
        .unwrap();
    let report = verify_store(&store, trusted(), |_| {}).await.unwrap();
    let failure = report.failure.expect("a checkpoint by the retired key");
    assert_eq!(failure.seq, head + 1);
    assert!(
        matches!(failure.problem, Problem::BadCheckpoint { .. }),
        "{failure:?}"
    );

    let (_dir, store) = sqlite().await;
    sign_over(&store, &first, None, 12).await.unwrap();
    sign_over(&store, &second, Some(&first), 12).await.unwrap();
    let intruder = CheckpointSigner::generate().unwrap();
    let head = store.head().await.unwrap().unwrap().0;
    let root = root_at(&store, head).await;
    let hijack = KeyRotation::sign(&first, &intruder, head, root, chrono::Utc::now());
    store
        .append(
            KEY_ROTATION_STREAM,
            ExpectedVersion::Any,
            vec![hijack.to_event()],
        )
        .await
        .unwrap();
    let report = verify_store(&store, trusted(), |_| {}).await.unwrap();
    let failure = report.failure.expect("a rotation by the retired key");
    assert_eq!(failure.seq, head + 1);
    assert!(
        matches!(failure.problem, Problem::BadKeyRotation { .. }),
        "{failure:?}"
    );
}

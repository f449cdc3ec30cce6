//! The OpenLineage relay on a PostgreSQL ledger (a fresh database on the test server):
//! every event gets its record in one statement per page, a second relay over the same
//! cursor writes nothing twice, and the records table takes the cheap write path of
//! migration 0009 (no per-row foreign-key lock on `events`, LZ4 for the JSON).

use aether_ledger::testing::TestDatabase;
use aether_ledger::{EventStore, StoreConfig};
use aether_lineage::relay::record;

mod support;
use support::{append_policies as append, write_records};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_gets_one_record_on_postgres() {
    let db = TestDatabase::create().await;
    let store = EventStore::connect(&db.url, StoreConfig::default())
        .await
        .expect("open the ledger");
    let pool = store.postgres_pool().expect("a PostgreSQL ledger").clone();

    append(&store, 1, 40).await;
    write_records(&store).await;
    append(&store, 41, 15).await;
    write_records(&store).await;

    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM lineage_records")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(count, 55, "one record per event, none twice");
    for seq in [1, 40, 41, 55] {
        let r = record(&store, seq).await.expect("read").expect("record");
        assert_eq!(r.seq, seq);
        assert_eq!(
            r.openlineage_event["run"]["facets"]["aether_ledger"]["seq"],
            serde_json::json!(seq)
        );
    }

    // Migration 0009: the records table neither locks the event's row per insert (no
    // foreign key) nor compresses with pglz, where the server has LZ4 (Debian's has).
    let foreign_keys: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_constraint \
         WHERE conrelid = 'lineage_records'::regclass AND contype = 'f'",
    )
    .fetch_one(&pool)
    .await
    .expect("constraints");
    assert_eq!(foreign_keys, 0);
    let lz4_built: bool = sqlx::query_scalar(
        "SELECT count(*) > 0 FROM pg_config() WHERE name = 'CONFIGURE' AND setting LIKE '%--with-lz4%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap_or(false);
    let compression: String = sqlx::query_scalar(
        "SELECT attcompression::text FROM pg_attribute \
         WHERE attrelid = 'lineage_records'::regclass AND attname = 'openlineage_event'",
    )
    .fetch_one(&pool)
    .await
    .expect("column");
    if lz4_built {
        assert_eq!(compression, "l", "openlineage_event compresses with LZ4");
    }

    store.shutdown().await;
    pool.close().await;
    db.drop_database().await;
}

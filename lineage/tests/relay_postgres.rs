//! The OpenLineage relay on a PostgreSQL ledger (a fresh database on the test server):
//! every event gets its record in one COPY per page (a page written again keeps what is
//! stored and fills the gaps), a second relay over the same
//! cursor writes nothing twice, and the records table takes the cheap write path of
//! migration 0009 (no per-row foreign-key lock on `events`, LZ4 for the JSON).

use aether_ledger::testing::TestDatabase;
use aether_ledger::{EventStore, StoreConfig};
use aether_lineage::relay::record;

mod support;
use support::{append_policies as append, write_records};

/// A ledger on a fresh database of the test server, and its pool for direct reads.
async fn open_ledger() -> (TestDatabase, EventStore, sqlx::PgPool) {
    let db = TestDatabase::create().await;
    let store = EventStore::connect(&db.url, StoreConfig::default())
        .await
        .expect("open the ledger");
    let pool = store.postgres_pool().expect("a PostgreSQL ledger").clone();
    (db, store, pool)
}

/// Every stored record as (seq, its JSON, when it was written), in seq order.
async fn stored_records(pool: &sqlx::PgPool) -> Vec<(i64, String, String)> {
    sqlx::query_as(
        "SELECT seq, openlineage_event, openlineage_at::text FROM lineage_records ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .expect("read the records")
}

async fn close(db: TestDatabase, store: EventStore, pool: sqlx::PgPool) {
    store.shutdown().await;
    pool.close().await;
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_gets_one_record_on_postgres() {
    let (db, store, pool) = open_ledger().await;

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

    close(db, store, pool).await;
}

/// A page is written with one COPY, which refuses the whole page when one of its records
/// is already stored: after a crash between the insert and the cursor's save the relay
/// reads the page again, and the records it lacks must still be written, the others kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_written_again_keeps_its_records_and_fills_the_gaps() {
    let (db, store, pool) = open_ledger().await;

    append(&store, 1, 30).await;
    write_records(&store).await;
    let before = stored_records(&pool).await;
    assert_eq!(before.len(), 30);

    // As if the relay had written only part of a page and lost its cursor.
    sqlx::query("DELETE FROM lineage_records WHERE seq BETWEEN 10 AND 20 AND seq <> 15")
        .execute(&pool)
        .await
        .expect("remove some records");
    store
        .save_position(aether_lineage::relay::OPENLINEAGE_CURSOR, 0)
        .await
        .expect("rewind the cursor");
    write_records(&store).await;

    let after = stored_records(&pool).await;
    assert_eq!(after.len(), 30, "every event has exactly one record again");
    for (old, new) in before.iter().zip(&after) {
        assert_eq!(old.0, new.0);
        assert_eq!(old.1, new.1, "seq {}: the same record, mapped again", old.0);
        let rewritten = (10..=20).contains(&old.0) && old.0 != 15;
        if !rewritten {
            assert_eq!(
                old.2, new.2,
                "seq {}: a stored record is kept, not rewritten",
                old.0
            );
        }
    }

    close(db, store, pool).await;
}

//! PostgreSQL backend: production. Several Aether processes may share one ledger: the
//! primary key on `seq` and the unique `(stream_id, stream_version)` refuse a batch planned
//! on a stale chain, and its writer plans it again.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::Row;
use sqlx::postgres::{PgConnection, PgPool, PgRow};
use tokio::sync::oneshot;

use super::InsertError;
use super::plan::{EventRow, Head};
use super::{Cursor, Direction, EventFilter, decode_event, seq_param};
use crate::error::LedgerError;
use crate::event::RecordedEvent;
use crate::hashing::Hash;
use crate::pg_binary::{BinaryRows, copy_in};

pub(crate) async fn migrate(pool: &PgPool) -> Result<(), LedgerError> {
    sqlx::migrate!("../../migrations/postgres")
        .run(pool)
        .await?;
    Ok(())
}

fn event(row: &PgRow) -> Result<RecordedEvent, LedgerError> {
    let recorded_at: DateTime<Utc> = row.try_get("recorded_at")?;
    decode_event(row, recorded_at)
}

/// The last committed event, read outside any transaction: the writer caches it.
pub(crate) async fn read_head<'e>(
    executor: impl sqlx::PgExecutor<'e>,
) -> Result<Option<Head>, sqlx::Error> {
    sqlx::query("SELECT seq, hash, recorded_at FROM events ORDER BY seq DESC LIMIT 1")
        .fetch_optional(executor)
        .await?
        .map(|row| {
            Ok(Head {
                seq: row.try_get::<i64, _>("seq")? as u64,
                hash: hash_column(&row, "hash")?,
                recorded_at: row.try_get("recorded_at")?,
            })
        })
        .transpose()
}

/// Current versions of `streams` (absent streams are left out).
pub(crate) async fn read_versions<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    streams: &[String],
) -> Result<HashMap<String, u64>, sqlx::Error> {
    // One backward index probe per stream (O(log n)); a GROUP BY over ANY($1) would
    // scan every version of every stream.
    sqlx::query(
        "SELECT s.stream_id, e.stream_version AS v FROM UNNEST($1::text[]) AS s(stream_id) \
         CROSS JOIN LATERAL (SELECT stream_version FROM events \
             WHERE events.stream_id = s.stream_id ORDER BY stream_version DESC LIMIT 1) e",
    )
    .bind(streams)
    .fetch_all(executor)
    .await?
    .iter()
    .map(|r| Ok((r.try_get("stream_id")?, r.try_get::<i64, _>("v")? as u64)))
    .collect()
}

/// The advisory lock of a ledger's appends. Every batch is inserted holding it shared (so
/// a writer alone, or several that have not met, go on as before), and a writer in
/// contention mode (several processes appending) plans and commits holding it exclusive:
/// PostgreSQL queues later shared requests behind a waiting exclusive one, so a writer
/// that has not yet met the others cannot keep winning the race for the next seqs and
/// starve it. Taken in the transaction's first round trip, with its `BEGIN`.
#[cfg(test)]
const APPEND_LOCK: i64 = 0x0061_6574_6865_7221;
const BEGIN_SHARED: &str = "BEGIN; SELECT pg_advisory_xact_lock_shared(27414623383024161)";
const BEGIN_EXCLUSIVE: &str = "BEGIN; SELECT pg_advisory_xact_lock(27414623383024161)";

/// A transaction that holds the append lock exclusive: the chain it reads cannot move until
/// it ends. Managed by hand rather than as an sqlx transaction, so that its `BEGIN`, the
/// lock and the first reads go in one round trip (under contention every node waits for
/// the lock holder's round trips). Dropped unfinished, its connection is closed, not
/// pooled: PostgreSQL then ends the transaction and frees the lock at once.
pub(crate) struct LockedAppend {
    conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
}

/// The chain as the lock holder finds it.
pub(crate) struct ChainInLock {
    pub(crate) head: Option<Head>,
    /// The newest version of each stream appended to at seqs `after < seq ≤ after + max`
    /// (see [`LockedAppend::begin`]); empty when no `after` was given.
    pub(crate) versions_after: HashMap<String, u64>,
}

impl LockedAppend {
    /// Begins a transaction, waits for the lock, and reads the head and, given `after`,
    /// the versions changed in the next `max` seqs (what another writer did since this
    /// one's last batch): one round trip. Each statement of a simple query takes its own
    /// snapshot, so the reads see everything committed before the lock was granted.
    pub(crate) async fn begin(
        pool: &PgPool,
        after: Option<u64>,
        max: u64,
    ) -> Result<(LockedAppend, ChainInLock), sqlx::Error> {
        let mut locked = LockedAppend {
            conn: Some(pool.acquire().await?),
        };
        // No parameters in a simple query: the bounds are integers formatted here.
        let changed = match after {
            Some(after) => format!(
                " UNION ALL SELECT 1, NULL::bigint, NULL::bytea, NULL::timestamptz, stream_id, \
                 max(stream_version) FROM events WHERE seq > {} AND seq <= {} GROUP BY stream_id",
                seq_param(after),
                seq_param(after.saturating_add(max)),
            ),
            None => String::new(),
        };
        let sql = format!(
            "{BEGIN_EXCLUSIVE}; SELECT 0 AS part, seq, hash, recorded_at, NULL::text AS stream_id, \
             NULL::bigint AS v FROM (SELECT seq, hash, recorded_at FROM events \
             ORDER BY seq DESC LIMIT 1) AS head{changed}"
        );
        // A statement without arguments goes as a simple query: all of it in one message.
        let rows = sqlx::Executor::fetch_all(locked.connection()?, sql.as_str()).await?;
        let mut chain = ChainInLock {
            head: None,
            versions_after: HashMap::new(),
        };
        // The lock's own row has one column; the reads' rows six, `part` telling which.
        for row in rows.iter().filter(|r| r.len() == 6) {
            if row.try_get::<i32, _>("part")? == 0 {
                chain.head = Some(Head {
                    seq: row.try_get::<i64, _>("seq")? as u64,
                    hash: hash_column(row, "hash")?,
                    recorded_at: row.try_get("recorded_at")?,
                });
            } else {
                chain.versions_after.insert(
                    row.try_get("stream_id")?,
                    row.try_get::<i64, _>("v")? as u64,
                );
            }
        }
        Ok((locked, chain))
    }

    fn connection(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        self.conn
            .as_deref_mut()
            .ok_or_else(|| sqlx::Error::Protocol("the append lock's transaction has ended".into()))
    }

    pub(crate) async fn versions(
        &mut self,
        streams: &[String],
    ) -> Result<HashMap<String, u64>, sqlx::Error> {
        read_versions(self.connection()?, streams).await
    }

    /// Ends the transaction without writing, releasing the lock now.
    pub(crate) async fn release(mut self) -> Result<(), sqlx::Error> {
        self.end("ROLLBACK").await
    }

    /// Inserts the rows and commits, releasing the lock; on failure rolls back now.
    pub(crate) async fn commit(mut self, rows: &[EventRow]) -> Result<(), sqlx::Error> {
        if let Err(e) = insert(self.connection()?, rows).await {
            let _ = self.end("ROLLBACK").await;
            return Err(e);
        }
        self.end("COMMIT").await
    }

    /// Sends `statement` (COMMIT or ROLLBACK) and pools the connection again once it
    /// succeeded; on failure the connection is closed by the drop.
    async fn end(&mut self, statement: &str) -> Result<(), sqlx::Error> {
        sqlx::Executor::execute(self.connection()?, statement).await?;
        drop(self.conn.take());
        Ok(())
    }
}

impl Drop for LockedAppend {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Still inside the transaction (an error, or a cancelled append): closing the
            // connection ends it and frees the lock; pooled, it would hold both until the
            // connection was next used.
            drop(conn.detach());
        }
    }
}

/// Inserts one planned batch atomically, in one transaction holding the append lock shared
/// (both COPYs when there are personal side rows). The primary key on `seq` and the unique
/// `(stream_id, stream_version)` make a concurrent writer's batch fail rather than fork.
pub(crate) async fn insert_rows(pool: &PgPool, rows: &[EventRow]) -> Result<(), sqlx::Error> {
    inserted_in_transaction(pool, rows).await?.commit().await
}

/// A transaction holding `rows`, not yet committed. On failure it is rolled back now, not
/// when the connection is next used: until then its rows would hold the seqs that the
/// writer is about to insert again.
async fn inserted_in_transaction<'c>(
    pool: &PgPool,
    rows: &[EventRow],
) -> Result<sqlx::Transaction<'c, sqlx::Postgres>, sqlx::Error> {
    let mut tx = pool.begin_with(BEGIN_SHARED).await?;
    if let Err(e) = insert(&mut tx, rows).await {
        let _ = tx.rollback().await;
        return Err(e);
    }
    Ok(tx)
}

/// Inserts a batch while the one before it may still be in the database, on another
/// connection: the rows go in at once, but the transaction commits only when `after` says
/// that batch committed, and rolls back otherwise. So batches commit in seq order and a
/// batch planned on a chain that did not land never commits (no gap, no fork).
pub(crate) async fn insert_rows_after(
    pool: &PgPool,
    rows: &[EventRow],
    after: oneshot::Receiver<bool>,
) -> Result<(), InsertError> {
    let tx = inserted_in_transaction(pool, rows).await?;
    if after.await != Ok(true) {
        // Dropping the transaction would roll back too; saying so frees the rows now.
        let _ = tx.rollback().await;
        return Err(InsertError::PredecessorFailed);
    }
    Ok(tx.commit().await?)
}

pub(crate) async fn personal_fields(
    pool: &PgPool,
    event_id: uuid::Uuid,
) -> Result<Vec<(String, String, Vec<u8>)>, LedgerError> {
    let rows = sqlx::query(
        "SELECT member, value, salt FROM personal_data WHERE event_id = $1 ORDER BY member",
    )
    .bind(event_id)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get("member")?,
                r.try_get("value")?,
                r.try_get("salt")?,
            ))
        })
        .collect()
}

pub(crate) async fn delete_personal_field(
    pool: &PgPool,
    event_id: uuid::Uuid,
    member: &str,
) -> Result<u64, LedgerError> {
    Ok(
        sqlx::query("DELETE FROM personal_data WHERE event_id = $1 AND member = $2")
            .bind(event_id)
            .bind(member)
            .execute(pool)
            .await?
            .rows_affected(),
    )
}

/// The batch's events, and the side rows of their personal members, as binary COPY data
/// ([`crate::pg_binary`]): in SQL ~5 µs per event cheaper for the server than one
/// `INSERT … SELECT * FROM UNNEST` of column arrays, though under clearing load the extra
/// round trips of a transaction around two COPYs take about as much back (BENCHMARKS.md).
const COPY_EVENTS: &str = "COPY events (seq, stream_id, stream_version, event_id, event_type, \
     schema_version, payload, metadata, recorded_at, prev_hash, hash) FROM STDIN (FORMAT binary)";
const COPY_PERSONAL: &str =
    "COPY personal_data (event_id, member, value, salt) FROM STDIN (FORMAT binary)";
const WRITER: &str = "the ledger writer";

/// Inserts `rows` on `conn`: one COPY of the events, then one of their personal side rows
/// if there are any (the caller holds a transaction then, so that both commit or neither).
async fn insert(conn: &mut PgConnection, rows: &[EventRow]) -> Result<(), sqlx::Error> {
    copy_in(conn, COPY_EVENTS, events_copy(rows)?, WRITER).await?;
    if has_personal(rows) {
        copy_in(conn, COPY_PERSONAL, personal_copy(rows)?, WRITER).await?;
    }
    Ok(())
}

fn has_personal(rows: &[EventRow]) -> bool {
    rows.iter().any(|r| !r.personal.is_empty())
}

fn events_copy(rows: &[EventRow]) -> Result<Vec<u8>, sqlx::Error> {
    let text: usize = rows
        .iter()
        .map(|r| r.stream_id.len() + r.event_type.len() + r.payload.len() + r.metadata.len())
        .sum();
    let mut data = BinaryRows::new(11, text + rows.len() * 170);
    for r in rows {
        data.row()
            .int8(r.seq)
            .text(&r.stream_id)?
            .int8(r.stream_version)
            .uuid(&r.event_id)
            .text(&r.event_type)?
            .int4(r.schema_version)
            .text(&r.payload)?
            .text(&r.metadata)?
            .timestamptz(&r.recorded_at)
            .bytes(&r.prev_hash)?
            .bytes(&r.hash)?;
    }
    Ok(data.finish())
}

fn personal_copy(rows: &[EventRow]) -> Result<Vec<u8>, sqlx::Error> {
    let fields = rows
        .iter()
        .flat_map(|r| r.personal.iter().map(move |f| (r, f)));
    let text: usize = fields
        .clone()
        .map(|(_, f)| f.member.len() + f.value.len())
        .sum();
    let mut data = BinaryRows::new(4, text + fields.clone().count() * 60);
    for (r, f) in fields {
        data.row()
            .uuid(&r.event_id)
            .text(&f.member)?
            .text(&f.value)?
            .bytes(&f.salt)?;
    }
    Ok(data.finish())
}

pub(crate) fn hash_column(row: &PgRow, column: &str) -> Result<Hash, sqlx::Error> {
    let bytes: Vec<u8> = row.try_get(column)?;
    bytes
        .try_into()
        .map_err(|b: Vec<u8>| sqlx::Error::ColumnDecode {
            index: column.to_string(),
            source: format!("expected a 32-byte hash, found {} bytes", b.len()).into(),
        })
}

pub(crate) async fn read_all(
    pool: &PgPool,
    from_seq: u64,
    limit: u32,
) -> Result<Vec<RecordedEvent>, LedgerError> {
    sqlx::query(select_events!("WHERE seq >= $1 ORDER BY seq LIMIT $2"))
        .bind(from_seq as i64)
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?
        .iter()
        .map(event)
        .collect()
}

pub(crate) async fn read_stream(
    pool: &PgPool,
    stream_id: &str,
    from_version: u64,
    direction: Direction,
    limit: u32,
) -> Result<Vec<RecordedEvent>, LedgerError> {
    let sql = match direction {
        Direction::Forward => select_events!(
            "WHERE stream_id = $1 AND stream_version >= $2 ORDER BY stream_version LIMIT $3"
        ),
        Direction::Backward => select_events!(
            "WHERE stream_id = $1 AND stream_version <= $2 ORDER BY stream_version DESC LIMIT $3"
        ),
    };
    sqlx::query(sql)
        .bind(stream_id)
        .bind(i64::try_from(from_version).unwrap_or(i64::MAX))
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?
        .iter()
        .map(event)
        .collect()
}

pub(crate) async fn read_time_range(
    pool: &PgPool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    after_seq: u64,
    limit: u32,
) -> Result<Vec<RecordedEvent>, LedgerError> {
    sqlx::query(select_events!(
        "WHERE recorded_at >= $1 AND recorded_at < $2 AND seq > $3 ORDER BY seq LIMIT $4"
    ))
    .bind(from)
    .bind(to)
    .bind(after_seq as i64)
    .bind(i64::from(limit))
    .fetch_all(pool)
    .await?
    .iter()
    .map(event)
    .collect()
}

pub(crate) async fn head(pool: &PgPool) -> Result<Option<(u64, Hash)>, LedgerError> {
    let row = sqlx::query("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")
        .fetch_optional(pool)
        .await?;
    Ok(match row {
        Some(r) => Some((r.try_get::<i64, _>("seq")? as u64, hash_column(&r, "hash")?)),
        None => None,
    })
}

pub(crate) async fn stream_version(pool: &PgPool, stream_id: &str) -> Result<u64, LedgerError> {
    let v: Option<i64> =
        sqlx::query_scalar("SELECT MAX(stream_version) FROM events WHERE stream_id = $1")
            .bind(stream_id)
            .fetch_one(pool)
            .await?;
    Ok(v.unwrap_or(0) as u64)
}

pub(crate) async fn read_hashes(
    pool: &PgPool,
    from_seq: u64,
    limit: u32,
) -> Result<Vec<(u64, Hash)>, LedgerError> {
    let rows = sqlx::query("SELECT seq, hash FROM events WHERE seq >= $1 ORDER BY seq LIMIT $2")
        .bind(from_seq as i64)
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get::<i64, _>("seq")? as u64, hash_column(r, "hash")?)))
        .collect()
}

pub(crate) async fn existing_event_ids(
    pool: &PgPool,
    ids: &[uuid::Uuid],
) -> Result<Vec<uuid::Uuid>, LedgerError> {
    Ok(
        sqlx::query_scalar("SELECT event_id FROM events WHERE event_id = ANY($1)")
            .bind(ids)
            .fetch_all(pool)
            .await?,
    )
}

pub(crate) async fn load_position(pool: &PgPool, name: &str) -> Result<Option<u64>, LedgerError> {
    let v: Option<i64> =
        sqlx::query_scalar("SELECT position FROM subscription_positions WHERE name = $1")
            .bind(name)
            .fetch_optional(pool)
            .await?;
    Ok(v.map(|v| v as u64))
}

pub(crate) async fn positions(pool: &PgPool) -> Result<Vec<(String, u64)>, LedgerError> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT name, position FROM subscription_positions ORDER BY name")
            .fetch_all(pool)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(n, p)| (n, p.max(0) as u64))
        .collect())
}

pub(crate) async fn save_position(
    pool: &PgPool,
    name: &str,
    position: u64,
) -> Result<(), LedgerError> {
    sqlx::query(
        "INSERT INTO subscription_positions (name, position, updated_at) VALUES ($1, $2, now()) \
         ON CONFLICT (name) DO UPDATE SET position = EXCLUDED.position, updated_at = now()",
    )
    .bind(name)
    .bind(position as i64)
    .execute(pool)
    .await?;
    Ok(())
}

/// Filtered reads, forward from `after_seq` or backward from `before_seq`.
pub(crate) async fn query(
    pool: &PgPool,
    filter: &EventFilter,
    cursor: Cursor,
    limit: u32,
) -> Result<Vec<RecordedEvent>, LedgerError> {
    let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new(select_events!("WHERE seq "));
    match cursor {
        Cursor::After(seq) => q.push("> ").push_bind(seq_param(seq)),
        Cursor::Before(seq) => q.push("< ").push_bind(seq_param(seq)),
    };
    if let Some(max) = filter.max_seq {
        q.push(" AND seq <= ").push_bind(seq_param(max));
    }
    if let Some(from) = filter.from {
        q.push(" AND recorded_at >= ").push_bind(from);
    }
    if let Some(to) = filter.to {
        q.push(" AND recorded_at < ").push_bind(to);
    }
    if let Some(t) = &filter.event_type {
        q.push(" AND event_type = ").push_bind(t);
    }
    if let Some(category) = filter.category() {
        // Exactly the expression of the `events_stream_category` index.
        q.push(" AND split_part(stream_id, '/', 1) = ")
            .push_bind(category);
    }
    if let Some(prefix) = &filter.stream_prefix {
        q.push(" AND starts_with(stream_id, ")
            .push_bind(prefix)
            .push(")");
    }
    for (key, value) in &filter.metadata {
        // The key is spliced into the SQL so that its index applies (see
        // `metadata_member`); only the fixed list of plain names ever gets here.
        let Some(key) = crate::store::filter::FILTERABLE_METADATA
            .iter()
            .find(|k| **k == key.as_str())
        else {
            return Err(LedgerError::InvalidFilter(format!(
                "metadata member {key:?} cannot be filtered on"
            )));
        };
        if *key != "request_id" && crate::store::filter::verbatim_in_metadata(value) {
            q.push(" AND strpos(metadata, ")
                .push_bind(value)
                .push(") > 0");
        }
        q.push(format!(" AND {} = ", metadata_member(key)))
            .push_bind(value);
    }
    q.push(match cursor {
        Cursor::After(_) => " ORDER BY seq LIMIT ",
        Cursor::Before(_) => " ORDER BY seq DESC LIMIT ",
    })
    .push_bind(i64::from(limit));
    // Planned for these values every time: a generic plan, which PostgreSQL adopts for a
    // statement prepared and run often, cannot see that `engine` is rare or that a seq
    // range is most of the ledger, and picks a primary-key scan of every event (seen at
    // 1M events: 900 ms instead of 0.3 ms). Planning costs ~0.1 ms.
    q.build()
        .persistent(false)
        .fetch_all(pool)
        .await?
        .iter()
        .map(event)
        .collect()
}

/// Events whose metadata `key` is one of `values`. `key` is one of the fixed filterable
/// names, spliced as a literal so that its expression index applies.
///
/// One index probe per distinct value, planned for these values on every call. Until
/// autovacuum has analysed a ledger with data, PostgreSQL guesses that each value matches
/// 0.5 % of the events: `= ANY` with a batch's hundred request ids then looked like half
/// the ledger and was planned as a scan of all of it, and a plan cached on a nearly empty
/// ledger scanned it too (seen: 13–19 ms per lookup instead of 0.14 ms, the gateway at
/// half its throughput). A probe per value is cheaper than a scan under any statistics
/// (the same guesses once made each lookup worth JIT-compiling; the pool turns JIT off).
pub(crate) async fn find_by_metadata(
    pool: &PgPool,
    key: &str,
    values: &[String],
) -> Result<Vec<RecordedEvent>, LedgerError> {
    sqlx::query(&lookup_sql(key))
        .bind(values)
        .persistent(false)
        .fetch_all(pool)
        .await?
        .iter()
        .map(event)
        .collect()
}

/// A connection kept for one caller's repeated metadata lookups (the gateway's "was this
/// request decided?", hundreds a second): its statement is parsed and planned once, not
/// per call as on the pool.
///
/// Planning once is safe only because the plan cannot depend on the statistics: the
/// connection refuses sequential scans and always takes the generic plan, so even a plan
/// made on a nearly empty ledger is an index probe per value (see [`find_by_metadata`] for
/// what a cached scan cost). Parse and plan were two thirds of a lookup's time in
/// PostgreSQL (pgbench, 30 ids: 0.27 ms per call planned each time, 0.15 ms prepared).
pub(crate) struct LookupConnection {
    /// The pool whose host (the primary, after a failover too) a new connection goes to.
    pool: PgPool,
    conn: Option<PgConnection>,
}

impl LookupConnection {
    pub(crate) fn new(pool: &PgPool) -> Self {
        LookupConnection {
            pool: pool.clone(),
            conn: None,
        }
    }

    /// The connection, opened on first use and again after a failure.
    async fn connection(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        use sqlx::Connection as _;
        let conn = match self.conn.take() {
            Some(conn) => conn,
            None => {
                let options = (*self.pool.connect_options()).clone().options([
                    ("enable_seqscan", "off"),
                    ("plan_cache_mode", "force_generic_plan"),
                ]);
                PgConnection::connect_with(&options).await?
            }
        };
        Ok(self.conn.insert(conn))
    }

    /// A connection that failed (the server restarted, an administrator ended the session)
    /// is dropped, and a lookup that failed on a connection kept from before is tried once
    /// more on a fresh one: the caller sees an error only when the database is unreachable.
    pub(crate) async fn find(
        &mut self,
        key: &str,
        values: &[String],
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        let sql = lookup_sql(key);
        let kept = self.conn.is_some();
        let rows = match self.query(&sql, values).await {
            Err(_) if kept => self.query(&sql, values).await,
            other => other,
        }?;
        rows.iter().map(event).collect()
    }

    async fn query(&mut self, sql: &str, values: &[String]) -> Result<Vec<PgRow>, sqlx::Error> {
        let conn = self.connection().await?;
        let rows = sqlx::query(sql).bind(values).fetch_all(&mut *conn).await;
        if rows.is_err() {
            self.conn = None;
        }
        rows
    }

    #[cfg(all(test, feature = "testing"))]
    pub(crate) async fn explain(&mut self, key: &str) -> Result<String, sqlx::Error> {
        let conn = self.connection().await?;
        sqlx::raw_sql(&format!("PREPARE probe(text[]) AS {}", lookup_sql(key)))
            .execute(&mut *conn)
            .await?;
        let plan: Vec<String> = sqlx::query_scalar("EXPLAIN EXECUTE probe('{a,b}')")
            .persistent(false)
            .fetch_all(&mut *conn)
            .await?;
        sqlx::raw_sql("DEALLOCATE probe")
            .execute(&mut *conn)
            .await?;
        Ok(plan.join("\n"))
    }
}

fn lookup_sql(key: &str) -> String {
    format!(
        concat!(
            "SELECT e.* FROM (SELECT DISTINCT v FROM UNNEST($1::text[]) AS u(v)) AS r ",
            "CROSS JOIN LATERAL (",
            select_events!("WHERE {} = r.v OFFSET 0"),
            ") AS e ORDER BY e.seq"
        ),
        metadata_member(key)
    )
}

/// The SQL for metadata member `key` (one of the fixed filterable names) as its indexes
/// read it: the request id is a generated column with a hash index of its own
/// (`events_request_id`); others are the member of the metadata text.
fn metadata_member(key: &str) -> String {
    match key {
        "request_id" => "request_id".to_owned(),
        _ => format!("(metadata::json ->> '{key}')"),
    }
}

/// The newest event recorded at or before `at`: its seq and time. A backward scan of the
/// `recorded_at` index that stops after the newest time's events (one commit batch, sorted
/// incrementally), whatever the ledger's size and whatever plan is cached.
pub(crate) async fn seq_at_time(
    pool: &PgPool,
    at: DateTime<Utc>,
) -> Result<Option<(u64, DateTime<Utc>)>, LedgerError> {
    let row = sqlx::query(
        "SELECT seq, recorded_at FROM events WHERE recorded_at <= $1 \
         ORDER BY recorded_at DESC, seq DESC LIMIT 1",
    )
    .bind(at)
    .fetch_optional(pool)
    .await?;
    row.map(|r| {
        Ok((
            r.try_get::<i64, _>("seq")? as u64,
            r.try_get("recorded_at")?,
        ))
    })
    .transpose()
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use serde_json::json;

    use sqlx::Connection;
    use sqlx::postgres::PgConnection;

    use super::lookup_sql;
    use crate::testing::TestDatabase;
    use crate::{EventStore, ExpectedVersion, NewEvent, StoreConfig};

    /// A ledger on a fresh database of the test server, and its pool for direct queries.
    async fn open_ledger() -> (TestDatabase, EventStore, sqlx::PgPool) {
        let db = TestDatabase::create().await;
        let store = EventStore::connect(&db.url, StoreConfig::default())
            .await
            .unwrap();
        let pool = store.postgres_pool().unwrap().clone();
        (db, store, pool)
    }

    async fn close(db: TestDatabase, store: EventStore, pool: sqlx::PgPool) {
        store.shutdown().await;
        pool.close().await;
        db.drop_database().await;
    }

    /// A clearing decision whose metadata names request `r-{n}`.
    fn decided(n: u64) -> NewEvent {
        NewEvent::new("ClearingDecided", json!({"n": n}))
            .with_metadata(json!({"request_id": format!("r-{n}")}))
    }

    /// Rows `first..first + 3` of stream `direct`, decisions of requests `r-{seq}`, each
    /// with one personal side row.
    fn direct_rows(first: i64) -> Vec<super::EventRow> {
        let at = chrono::DateTime::from_timestamp_micros(1_796_169_600_123_456).unwrap();
        (first..first + 3)
            .map(|seq| super::EventRow {
                seq,
                stream_id: "direct/x".into(),
                stream_version: seq,
                event_id: uuid::Uuid::now_v7(),
                event_type: "ClearingDecided".into(),
                schema_version: 2,
                payload: format!("{{\"n\":{seq},\"text\":\"é\"}}"),
                metadata: format!("{{\"request_id\":\"r-{seq}\"}}"),
                recorded_at: at,
                prev_hash: [1; 32],
                hash: [u8::try_from(seq).unwrap(); 32],
                personal: vec![crate::personal::PersonalField {
                    member: "buyer".into(),
                    value: format!("\"B{seq}\""),
                    salt: [7; 16],
                }],
            })
            .collect()
    }

    /// A payload over the TOAST threshold (a batch's netting) is compressed with LZ4 where
    /// the server has it, and reads back as the exact text that was hashed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_large_payload_is_stored_with_lz4_and_reads_back_exactly() {
        let (db, store, pool) = open_ledger().await;
        let positions: Vec<serde_json::Value> = (0..200)
            .map(|i| json!({"party": format!("bank-{i}"), "currency": "SGD", "net_minor": (i * 7919).to_string()}))
            .collect();
        let committed = store
            .append(
                "netting/b1",
                ExpectedVersion::NoStream,
                vec![NewEvent::new(
                    "NettingComputed",
                    json!({"positions": positions}),
                )],
            )
            .await
            .unwrap();
        let seq = committed[0].seq as i64;
        let (method, length): (Option<String>, i32) = sqlx::query_as(
            "SELECT pg_column_compression(payload), octet_length(payload) FROM events WHERE seq = $1",
        )
        .bind(seq)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(length > 4096, "the payload is {length} bytes");
        let lz4_built: bool = sqlx::query_scalar(
            "SELECT count(*) > 0 FROM pg_settings WHERE name = 'default_toast_compression' \
             AND 'lz4' = ANY(enumvals)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        let expected = if lz4_built { "lz4" } else { "pglz" };
        assert_eq!(method.as_deref(), Some(expected));
        let read = store.read_all(committed[0].seq, 1).await.unwrap();
        assert_eq!(read[0].hash, committed[0].hash);
        assert_eq!(
            read[0].payload.get(),
            crate::jcs::to_string(&json!({"positions": positions}))
        );
        close(db, store, pool).await;
    }

    /// A batch goes in whole or not at all: when its events' COPY meets a seq already
    /// stored, neither its events nor its personal side rows are left behind; on free seqs
    /// every column and side row reads back as written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_and_its_personal_rows_go_in_whole_or_not_at_all() {
        let (db, store, pool) = open_ledger().await;
        store
            .append("s/1", ExpectedVersion::NoStream, vec![decided(1)])
            .await
            .unwrap();
        let count = |table: &'static str| {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {table}"))
                    .fetch_one(&pool)
                    .await
                    .unwrap()
            }
        };

        let refused = super::insert_rows(&pool, &direct_rows(1))
            .await
            .unwrap_err();
        assert!(
            matches!(&refused, sqlx::Error::Database(d) if d.is_unique_violation()),
            "{refused}"
        );
        assert_eq!(
            (count("events").await, count("personal_data").await),
            (1, 0)
        );

        let rows = direct_rows(2);
        super::insert_rows(&pool, &rows).await.unwrap();
        assert_eq!(
            (count("events").await, count("personal_data").await),
            (4, 3)
        );
        let read = super::read_all(&pool, 2, 10).await.unwrap();
        assert_eq!(read.len(), 3);
        for (row, event) in rows.iter().zip(&read) {
            assert_eq!(event.seq, u64::try_from(row.seq).unwrap());
            assert_eq!(event.stream_id, row.stream_id);
            assert_eq!(
                event.stream_version,
                u64::try_from(row.stream_version).unwrap()
            );
            assert_eq!(event.event_id, row.event_id);
            assert_eq!(event.event_type, row.event_type);
            assert_eq!(event.schema_version, 2);
            assert_eq!(event.payload.get(), row.payload);
            assert_eq!(event.metadata.get(), row.metadata);
            assert_eq!(event.recorded_at, row.recorded_at);
            assert_eq!((event.prev_hash, event.hash), (row.prev_hash, row.hash));
            let personal = super::personal_fields(&pool, row.event_id).await.unwrap();
            assert_eq!(
                personal,
                vec![("buyer".into(), format!("\"B{}\"", row.seq), vec![7; 16])]
            );
        }
        close(db, store, pool).await;
    }

    /// A ledger written before the request id became a generated column: the upgrade
    /// computes it for the rows already there, so their decisions are still found by
    /// request id, in a filter and in the gateway's batched lookup, as are later ones.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn decisions_written_before_the_request_id_column_are_still_found() {
        let db = TestDatabase::create().await;
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        let mut earlier = sqlx::migrate!("../../migrations/postgres");
        earlier.migrations = earlier
            .migrations
            .iter()
            .filter(|m| m.version < 20261207000012)
            .cloned()
            .collect::<Vec<_>>()
            .into();
        earlier.run(&pool).await.unwrap();
        super::insert_rows(&pool, &direct_rows(1)).await.unwrap();
        pool.close().await;

        let store = EventStore::connect(&db.url, StoreConfig::default())
            .await
            .unwrap();
        let pool = store.postgres_pool().unwrap().clone();
        let column: Vec<Option<String>> =
            sqlx::query_scalar("SELECT request_id FROM events ORDER BY seq")
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(column, ["r-1", "r-2", "r-3"].map(|r| Some(r.to_owned())));
        store
            .append("s/4", ExpectedVersion::NoStream, vec![decided(4)])
            .await
            .unwrap();
        let wanted = ["r-2", "r-4", "r-9"].map(str::to_owned);
        let found = store
            .find_by_metadata("request_id", &wanted, "ClearingDecided")
            .await
            .unwrap();
        assert_eq!(found.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 4]);
        let batched = store
            .metadata_lookup()
            .find("request_id", &wanted, "ClearingDecided")
            .await
            .unwrap();
        assert_eq!(batched.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 4]);
        close(db, store, pool).await;
    }

    /// A kept lookup connection plans its statement once, on whatever statistics the
    /// ledger has then; the plan is an index probe even when made on a ledger analysed
    /// with three events (where PostgreSQL's own generic plan scans every event), it finds
    /// what later appends add, and it survives its session being ended.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_lookup_plans_once_and_still_probes_the_index() {
        let (db, store, pool) = open_ledger().await;
        let append = |range: std::ops::Range<u64>| {
            store.append(
                "clearing/m1",
                ExpectedVersion::Any,
                range.map(decided).collect(),
            )
        };
        append(0..3).await.unwrap();
        sqlx::raw_sql("ANALYZE events")
            .execute(&pool)
            .await
            .unwrap();

        // Planned as the pool would plan it once cached: a scan.
        let mut plain = pool.acquire().await.unwrap();
        sqlx::raw_sql(&format!(
            "SET plan_cache_mode = force_generic_plan; PREPARE probe(text[]) AS {}",
            lookup_sql("request_id")
        ))
        .execute(&mut *plain)
        .await
        .unwrap();
        let generic: Vec<String> = sqlx::query_scalar("EXPLAIN EXECUTE probe('{a,b}')")
            .persistent(false)
            .fetch_all(&mut *plain)
            .await
            .unwrap();
        assert!(
            generic.join("\n").contains("Seq Scan on events"),
            "{generic:?}"
        );
        plain.close().await.unwrap();

        let mut lookup = store.metadata_lookup();
        let ids = |ns: &[u64]| ns.iter().map(|n| format!("r-{n}")).collect::<Vec<_>>();
        let found = lookup
            .find("request_id", &ids(&[1, 7]), "ClearingDecided")
            .await
            .unwrap();
        assert_eq!(
            found.iter().map(|e| e.stream_version).collect::<Vec<_>>(),
            [2]
        );
        let kept = lookup.connection.as_mut().unwrap();
        let plan = kept.explain("request_id").await.unwrap();
        assert!(plan.contains("events_request_id"), "{plan}");
        assert!(!plan.contains("Seq Scan on events"), "{plan}");

        append(3..2_000).await.unwrap();
        let found = lookup
            .find("request_id", &ids(&[1, 1_500, 5_000]), "ClearingDecided")
            .await
            .unwrap();
        assert_eq!(
            found.iter().map(|e| e.stream_version).collect::<Vec<_>>(),
            [2, 1_501]
        );
        // Another type is not this lookup's answer; a name outside the filterable list is
        // refused.
        assert!(
            lookup
                .find("request_id", &ids(&[1]), "EngineActivated")
                .await
                .unwrap()
                .is_empty()
        );
        assert!(matches!(
            lookup.find("buyer", &ids(&[1]), "ClearingDecided").await,
            Err(crate::LedgerError::InvalidFilter(_))
        ));

        // Its session ended from outside: the next lookup still answers.
        let ended: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND query LIKE 'SELECT e.* FROM%'",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        assert_eq!(ended, [true]);
        let found = lookup
            .find("request_id", &ids(&[1_999]), "ClearingDecided")
            .await
            .unwrap();
        assert_eq!(found.len(), 1);
        close(db, store, pool).await;
    }

    /// A batch's lookup on a ledger that outgrew its statistics (analysed while empty, as
    /// autovacuum first sees a fresh ledger) probes the request-id index; it never reads
    /// every event.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_lookup_probes_the_index_whatever_the_statistics() {
        let (db, store, pool) = open_ledger().await;
        sqlx::raw_sql("ANALYZE events")
            .execute(&pool)
            .await
            .unwrap();
        store
            .append(
                "clearing/m1",
                ExpectedVersion::Any,
                (0..3_000).map(decided).collect(),
            )
            .await
            .unwrap();
        let batch: Vec<String> = (0..100).map(|n| format!("q-{n}")).collect();
        let plan: Vec<String> =
            sqlx::query_scalar(&format!("EXPLAIN {}", lookup_sql("request_id")))
                .bind(&batch)
                .persistent(false)
                .fetch_all(&pool)
                .await
                .unwrap();
        let plan = plan.join("\n");
        assert!(plan.contains("events_request_id"), "{plan}");
        // Nor is it compiled: JIT cost ~10 ms per lookup when the guesses ran high.
        let jit: String = sqlx::query_scalar("SHOW jit")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(jit, "off");
        assert!(!plan.contains("Seq Scan on events"), "{plan}");
        let mut wanted = batch.clone();
        wanted.extend(["r-7".to_owned(), "r-7".to_owned(), "r-2999".to_owned()]);
        let found = store
            .find_by_metadata("request_id", &wanted, "ClearingDecided")
            .await
            .unwrap();
        assert_eq!(
            found.iter().map(|e| e.stream_version).collect::<Vec<_>>(),
            [8, 3000]
        );
        close(db, store, pool).await;
    }

    /// The type and category indexes hold only the events that are not clearing decisions,
    /// and filtered reads still find every event: the rare kinds through those indexes, the
    /// decisions in seq order from the primary key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_type_and_category_indexes_leave_the_decisions_out() {
        let (db, store, pool) = open_ledger().await;
        for round in 0..3_u64 {
            store
                .append(
                    "clearing/m1",
                    ExpectedVersion::Any,
                    (0..1_000).map(|n| decided(round * 1_000 + n)).collect(),
                )
                .await
                .unwrap();
            store
                .append(
                    "engine/e1",
                    ExpectedVersion::Any,
                    vec![NewEvent::new("EngineActivated", json!({"round": round}))],
                )
                .await
                .unwrap();
        }
        sqlx::raw_sql("VACUUM ANALYZE events")
            .execute(&pool)
            .await
            .unwrap();
        for index in ["events_event_type", "events_stream_category"] {
            let entries: f32 =
                sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE relname = $1")
                    .bind(index)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(entries, 3.0, "{index}");
        }
        for (filter, index) in [
            ("event_type = 'EngineActivated'", "events_event_type"),
            (
                "split_part(stream_id, '/', 1) = 'engine'",
                "events_stream_category",
            ),
        ] {
            let plan: Vec<String> = sqlx::query_scalar(&format!(
                "EXPLAIN SELECT seq FROM events WHERE seq > 0 AND {filter} ORDER BY seq LIMIT 10"
            ))
            .fetch_all(&pool)
            .await
            .unwrap();
            let plan = plan.join("\n");
            assert!(plan.contains(index), "{plan}");
        }

        let engine_seqs = [1_001, 2_002, 3_003];
        let by_type = |event_type: &str| super::super::EventFilter {
            event_type: Some(event_type.into()),
            ..Default::default()
        };
        let by_category = |prefix: &str| super::super::EventFilter {
            stream_prefix: Some(prefix.into()),
            ..Default::default()
        };
        let seqs = |events: Vec<crate::RecordedEvent>| -> Vec<u64> {
            events.iter().map(|e| e.seq).collect()
        };
        for filter in [by_type("EngineActivated"), by_category("engine/")] {
            assert_eq!(
                seqs(store.query(&filter, 0, 10).await.unwrap()),
                engine_seqs
            );
            assert_eq!(
                seqs(store.query_backward(&filter, u64::MAX, 1).await.unwrap()),
                [3_003]
            );
        }
        for filter in [by_type("ClearingDecided"), by_category("clearing/")] {
            let page = seqs(store.query(&filter, 1_000, 3).await.unwrap());
            assert_eq!(page, [1_002, 1_003, 1_004]);
            let last = seqs(store.query_backward(&filter, u64::MAX, 2).await.unwrap());
            assert_eq!(last, [3_002, 3_001]);
        }
        close(db, store, pool).await;
    }

    /// After the server dropped every connection (a restart, a failover, an administrator),
    /// the next append succeeds: idle connections are pinged and replaced, not used dead.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn appends_survive_the_server_dropping_idle_connections() {
        let db = TestDatabase::create().await;
        let config = StoreConfig {
            ping_idle_after: std::time::Duration::from_millis(50),
            ..StoreConfig::default()
        };
        let store = EventStore::connect(&db.url, config).await.unwrap();
        let event = |n: u64| NewEvent::new("PolicyIngested", json!({"n": n}));
        store
            .append("policy/p", ExpectedVersion::NoStream, vec![event(1)])
            .await
            .unwrap();

        let mut admin = PgConnection::connect(&crate::testing::admin_url())
            .await
            .unwrap();
        let dropped: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(&db.name)
        .fetch_all(&mut admin)
        .await
        .unwrap();
        assert!(!dropped.is_empty() && dropped.iter().all(|d| *d));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;

        let positions = store
            .append("policy/p", ExpectedVersion::Exact(1), vec![event(2)])
            .await
            .expect("the append after the connections were dropped");
        assert_eq!(positions.last().map(|p| p.stream_version), Some(2));
        assert_eq!(store.read_all(1, 10).await.unwrap().len(), 2);
        admin.close().await.unwrap();
        store.shutdown().await;
        db.drop_database().await;
    }
}

#[cfg(test)]
mod append_lock_tests {
    #[test]
    fn the_begin_statements_name_the_append_lock() {
        let key = super::APPEND_LOCK.to_string();
        assert!(super::BEGIN_SHARED.ends_with(&format!("_shared({key})")));
        assert!(super::BEGIN_EXCLUSIVE.ends_with(&format!("_lock({key})")));
    }
}

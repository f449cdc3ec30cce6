//! SQLite backend: the embedded default. WAL journal with `synchronous = FULL`, so an
//! acknowledged append survives a crash; `BEGIN IMMEDIATE` serialises writers.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{QueryBuilder, Row, Sqlite};

use super::plan::{EventRow, Head};
use super::{Cursor, Direction, EventFilter, decode_event, seq_param};
use crate::error::LedgerError;
use crate::event::RecordedEvent;
use crate::hashing::Hash;

/// SQLite allows 32766 bound variables per statement; 11 per row.
const ROWS_PER_INSERT: usize = 2000;

pub(crate) async fn migrate(pool: &SqlitePool) -> Result<(), LedgerError> {
    sqlx::migrate!("../../migrations/sqlite").run(pool).await?;
    Ok(())
}

/// Ledger time is stored as microseconds since the Unix epoch.
pub(crate) fn to_micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

fn from_micros(column: &str, micros: i64) -> Result<DateTime<Utc>, sqlx::Error> {
    DateTime::from_timestamp_micros(micros).ok_or_else(|| sqlx::Error::ColumnDecode {
        index: column.to_string(),
        source: format!("{micros} is not a valid timestamp").into(),
    })
}

fn event(row: &SqliteRow) -> Result<RecordedEvent, LedgerError> {
    let recorded_at = from_micros("recorded_at", row.try_get("recorded_at")?)?;
    decode_event(row, recorded_at)
}

/// The last committed event, read outside any transaction: the writer caches it.
pub(crate) async fn read_head(pool: &SqlitePool) -> Result<Option<Head>, sqlx::Error> {
    sqlx::query("SELECT seq, hash, recorded_at FROM events ORDER BY seq DESC LIMIT 1")
        .fetch_optional(pool)
        .await?
        .map(|row| {
            Ok(Head {
                seq: row.try_get::<i64, _>("seq")? as u64,
                hash: hash_column(&row, "hash")?,
                recorded_at: from_micros("recorded_at", row.try_get("recorded_at")?)?,
            })
        })
        .transpose()
}

/// Current versions of `streams` (absent streams are left out).
pub(crate) async fn read_versions(
    pool: &SqlitePool,
    streams: &[String],
) -> Result<HashMap<String, u64>, sqlx::Error> {
    let mut versions = HashMap::new();
    for stream_id in streams {
        // MAX over the (stream_id, stream_version) index is a single seek in SQLite.
        let v: Option<i64> =
            sqlx::query_scalar("SELECT MAX(stream_version) FROM events WHERE stream_id = ?")
                .bind(stream_id)
                .fetch_one(pool)
                .await?;
        if let Some(v) = v {
            versions.insert(stream_id.clone(), v as u64);
        }
    }
    Ok(versions)
}

/// Inserts one planned batch in one `BEGIN IMMEDIATE` transaction. The primary key on `seq`
/// and the unique `(stream_id, stream_version)` make a concurrent writer's batch fail
/// rather than fork.
pub(crate) async fn insert_rows(pool: &SqlitePool, rows: &[EventRow]) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        insert(&mut tx, chunk).await?;
    }
    for row in rows {
        for f in &row.personal {
            sqlx::query(
                "INSERT INTO personal_data (event_id, member, value, salt) VALUES (?, ?, ?, ?)",
            )
            .bind(row.event_id)
            .bind(&f.member)
            .bind(&f.value)
            .bind(f.salt.as_slice())
            .execute(&mut *tx)
            .await?;
        }
    }
    tx.commit().await
}

pub(crate) async fn personal_fields(
    pool: &SqlitePool,
    event_id: uuid::Uuid,
) -> Result<Vec<(String, String, Vec<u8>)>, LedgerError> {
    let rows = sqlx::query(
        "SELECT member, value, salt FROM personal_data WHERE event_id = ? ORDER BY member",
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
    pool: &SqlitePool,
    event_id: uuid::Uuid,
    member: &str,
) -> Result<u64, LedgerError> {
    Ok(
        sqlx::query("DELETE FROM personal_data WHERE event_id = ? AND member = ?")
            .bind(event_id)
            .bind(member)
            .execute(pool)
            .await?
            .rows_affected(),
    )
}

async fn insert(tx: &mut sqlx::SqliteConnection, rows: &[EventRow]) -> Result<(), sqlx::Error> {
    let mut q: QueryBuilder<Sqlite> = QueryBuilder::new(
        "INSERT INTO events (seq, stream_id, stream_version, event_id, event_type, schema_version, \
                             payload, metadata, recorded_at, prev_hash, hash) ",
    );
    q.push_values(rows, |mut b, r| {
        b.push_bind(r.seq)
            .push_bind(r.stream_id.as_str())
            .push_bind(r.stream_version)
            .push_bind(r.event_id)
            .push_bind(r.event_type.as_str())
            .push_bind(r.schema_version)
            .push_bind(r.payload.as_str())
            .push_bind(r.metadata.as_str())
            .push_bind(to_micros(r.recorded_at))
            .push_bind(r.prev_hash.as_slice())
            .push_bind(r.hash.as_slice());
    });
    q.build().execute(tx).await?;
    Ok(())
}

pub(crate) fn hash_column(row: &SqliteRow, column: &str) -> Result<Hash, sqlx::Error> {
    let bytes: Vec<u8> = row.try_get(column)?;
    bytes
        .try_into()
        .map_err(|b: Vec<u8>| sqlx::Error::ColumnDecode {
            index: column.to_string(),
            source: format!("expected a 32-byte hash, found {} bytes", b.len()).into(),
        })
}

pub(crate) async fn read_all(
    pool: &SqlitePool,
    from_seq: u64,
    limit: u32,
) -> Result<Vec<RecordedEvent>, LedgerError> {
    sqlx::query(select_events!("WHERE seq >= ? ORDER BY seq LIMIT ?"))
        .bind(from_seq as i64)
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?
        .iter()
        .map(event)
        .collect()
}

pub(crate) async fn read_stream(
    pool: &SqlitePool,
    stream_id: &str,
    from_version: u64,
    direction: Direction,
    limit: u32,
) -> Result<Vec<RecordedEvent>, LedgerError> {
    let sql = match direction {
        Direction::Forward => select_events!(
            "WHERE stream_id = ? AND stream_version >= ? ORDER BY stream_version LIMIT ?"
        ),
        Direction::Backward => select_events!(
            "WHERE stream_id = ? AND stream_version <= ? ORDER BY stream_version DESC LIMIT ?"
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
    pool: &SqlitePool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    after_seq: u64,
    limit: u32,
) -> Result<Vec<RecordedEvent>, LedgerError> {
    sqlx::query(select_events!(
        "WHERE recorded_at >= ? AND recorded_at < ? AND seq > ? ORDER BY seq LIMIT ?"
    ))
    .bind(to_micros(from))
    .bind(to_micros(to))
    .bind(after_seq as i64)
    .bind(i64::from(limit))
    .fetch_all(pool)
    .await?
    .iter()
    .map(event)
    .collect()
}

pub(crate) async fn head(pool: &SqlitePool) -> Result<Option<(u64, Hash)>, LedgerError> {
    let row = sqlx::query("SELECT seq, hash FROM events ORDER BY seq DESC LIMIT 1")
        .fetch_optional(pool)
        .await?;
    Ok(match row {
        Some(r) => Some((r.try_get::<i64, _>("seq")? as u64, hash_column(&r, "hash")?)),
        None => None,
    })
}

pub(crate) async fn stream_version(pool: &SqlitePool, stream_id: &str) -> Result<u64, LedgerError> {
    let v: Option<i64> =
        sqlx::query_scalar("SELECT MAX(stream_version) FROM events WHERE stream_id = ?")
            .bind(stream_id)
            .fetch_one(pool)
            .await?;
    Ok(v.unwrap_or(0) as u64)
}

pub(crate) async fn read_hashes(
    pool: &SqlitePool,
    from_seq: u64,
    limit: u32,
) -> Result<Vec<(u64, Hash)>, LedgerError> {
    let rows = sqlx::query("SELECT seq, hash FROM events WHERE seq >= ? ORDER BY seq LIMIT ?")
        .bind(from_seq as i64)
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get::<i64, _>("seq")? as u64, hash_column(r, "hash")?)))
        .collect()
}

pub(crate) async fn existing_event_ids(
    pool: &SqlitePool,
    ids: &[uuid::Uuid],
) -> Result<Vec<uuid::Uuid>, LedgerError> {
    let mut found = Vec::new();
    for id in ids {
        let hit: Option<uuid::Uuid> =
            sqlx::query_scalar("SELECT event_id FROM events WHERE event_id = ?")
                .bind(id)
                .fetch_optional(pool)
                .await?;
        found.extend(hit);
    }
    Ok(found)
}

pub(crate) async fn load_position(
    pool: &SqlitePool,
    name: &str,
) -> Result<Option<u64>, LedgerError> {
    let v: Option<i64> =
        sqlx::query_scalar("SELECT position FROM subscription_positions WHERE name = ?")
            .bind(name)
            .fetch_optional(pool)
            .await?;
    Ok(v.map(|v| v as u64))
}

pub(crate) async fn positions(pool: &SqlitePool) -> Result<Vec<(String, u64)>, LedgerError> {
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
    pool: &SqlitePool,
    name: &str,
    position: u64,
) -> Result<(), LedgerError> {
    sqlx::query(
        "INSERT INTO subscription_positions (name, position, updated_at) VALUES (?, ?, ?) \
         ON CONFLICT (name) DO UPDATE SET position = excluded.position, updated_at = excluded.updated_at",
    )
    .bind(name)
    .bind(position as i64)
    .bind(to_micros(Utc::now()))
    .execute(pool)
    .await?;
    Ok(())
}

/// Events whose metadata `key` is one of `values` (passed as one JSON
/// array). `key` is one of the fixed filterable names, spliced so that its expression
/// index applies.
pub(crate) async fn find_by_metadata(
    pool: &SqlitePool,
    key: &str,
    values: &[String],
) -> Result<Vec<RecordedEvent>, LedgerError> {
    let sql = format!(
        select_events!(
            "WHERE json_extract(metadata, '$.{0}') IN (SELECT value FROM json_each(?)) \
                        AND json_extract(metadata, '$.{0}') IS NOT NULL ORDER BY seq"
        ),
        key
    );
    let values = serde_json::Value::from(values.to_vec()).to_string();
    sqlx::query(&sql)
        .bind(values)
        .fetch_all(pool)
        .await?
        .iter()
        .map(event)
        .collect()
}

/// Filtered reads, forward from `after_seq` or backward from `before_seq`.
pub(crate) async fn query(
    pool: &SqlitePool,
    filter: &EventFilter,
    cursor: Cursor,
    limit: u32,
) -> Result<Vec<RecordedEvent>, LedgerError> {
    let mut q = QueryBuilder::<Sqlite>::new(select_events!("WHERE seq "));
    match cursor {
        Cursor::After(seq) => q.push("> ").push_bind(seq_param(seq)),
        Cursor::Before(seq) => q.push("< ").push_bind(seq_param(seq)),
    };
    if let Some(max) = filter.max_seq {
        q.push(" AND seq <= ").push_bind(seq_param(max));
    }
    if let Some(from) = filter.from {
        q.push(" AND recorded_at >= ").push_bind(to_micros(from));
    }
    if let Some(to) = filter.to {
        q.push(" AND recorded_at < ").push_bind(to_micros(to));
    }
    if let Some(t) = &filter.event_type {
        q.push(" AND event_type = ").push_bind(t);
    }
    if let Some(category) = filter.category() {
        // Exactly the expression of the `events_stream_category` index: SQLite uses an
        // index on an expression only for the same expression.
        q.push(" AND substr(stream_id, 1, instr(stream_id || '/', '/') - 1) = ")
            .push_bind(category);
    }
    if let Some(prefix) = &filter.stream_prefix {
        q.push(" AND substr(stream_id, 1, length(")
            .push_bind(prefix)
            .push(")) = ")
            .push_bind(prefix);
    }
    for (key, value) in &filter.metadata {
        // The key is spliced as a literal so that an expression index on it (e.g.
        // `events_request_id`) applies; only the fixed list of plain names ever gets here.
        let Some(key) = crate::store::filter::FILTERABLE_METADATA
            .iter()
            .find(|k| **k == key.as_str())
        else {
            return Err(LedgerError::InvalidFilter(format!(
                "metadata member {key:?} cannot be filtered on"
            )));
        };
        if *key != "request_id" && crate::store::filter::verbatim_in_metadata(value) {
            q.push(" AND instr(metadata, ")
                .push_bind(value)
                .push(") > 0");
        }
        q.push(format!(" AND json_extract(metadata, '$.{key}') = "))
            .push_bind(value);
    }
    q.push(match cursor {
        Cursor::After(_) => " ORDER BY seq LIMIT ",
        Cursor::Before(_) => " ORDER BY seq DESC LIMIT ",
    })
    .push_bind(i64::from(limit));
    q.build().fetch_all(pool).await?.iter().map(event).collect()
}

/// The newest event recorded at or before `at`: its seq and time, from the `recorded_at`
/// index (whose entries are in seq order within one time).
pub(crate) async fn seq_at_time(
    pool: &SqlitePool,
    at: DateTime<Utc>,
) -> Result<Option<(u64, DateTime<Utc>)>, LedgerError> {
    let row = sqlx::query(
        "SELECT seq, recorded_at FROM events WHERE recorded_at <= ? \
         ORDER BY recorded_at DESC, seq DESC LIMIT 1",
    )
    .bind(to_micros(at))
    .fetch_optional(pool)
    .await?;
    row.map(|r| {
        Ok((
            r.try_get::<i64, _>("seq")? as u64,
            from_micros("recorded_at", r.try_get("recorded_at")?)?,
        ))
    })
    .transpose()
}

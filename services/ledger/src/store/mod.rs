//! [`EventStore`]: the one way into and out of the event tables, on PostgreSQL or SQLite.

/// `SELECT <every event column> FROM events <rest>` as a static string.
macro_rules! select_events {
    ($rest:literal) => {
        concat!(
            "SELECT seq, stream_id, stream_version, event_id, event_type, schema_version, ",
            "payload, metadata, recorded_at, prev_hash, hash FROM events ",
            $rest
        )
    };
}

mod failover;
mod filter;
mod pg_copy;
pub(crate) mod plan;
pub(crate) mod postgres;
mod sqlite;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{ColumnIndex, Connection, Decode, Row, Type};
use tokio::sync::{Mutex, mpsc, oneshot, watch};
use uuid::Uuid;

use crate::error::LedgerError;
use crate::event::{
    Committed, DEFAULT_MAX_PAYLOAD_BYTES, ExpectedVersion, NewEvent, RecordedEvent, ValidEvent,
    validate_stream_id,
};
use crate::hashing::Hash;
use crate::personal::{PersonalField, REDACTION_EVENT_TYPE, REDACTION_STREAM, placeholder};
use crate::tail::Tail;
// The one import circle left in the crate, kept on purpose: the writer is the store's own
// group-commit task (the store starts it and sends it the appends; it runs the store's
// inserts on the store's pools), in a file of its own for length, not a component apart.
use crate::writer::{self, WriterMsg};
use plan::StreamAppend;

pub use filter::{EventFilter, FILTERABLE_METADATA};

/// Most values one [`EventStore::find_by_metadata`] takes.
pub const MAX_LOOKUP_VALUES: usize = 1_000;

/// WAL pages (4 KiB) after which a committing SQLite connection copies the WAL back into
/// the database file: 10,000 (~40 MiB) rather than SQLite's 1,000. The indexes' last pages
/// change in every batch, and a checkpoint writes each page once however often it changed
/// since the last one, so checkpointing a tenth as often writes far fewer pages; at 1,000
/// checkpoints were a sixth of SQLite's time under clearing load. Durability is the WAL's
/// own `fsync` at each commit either way; a restart replays at most this much WAL.
pub const SQLITE_WAL_AUTOCHECKPOINT: &str = "10000";

/// The ledger's SQLite durability settings for a connection to `url`: WAL, `synchronous =
/// FULL` (an acknowledged commit survives a crash) and [`SQLITE_WAL_AUTOCHECKPOINT`]. The
/// benches' raw SQLite baselines open their files with these too.
pub fn sqlite_options(url: &str) -> Result<SqliteConnectOptions, sqlx::Error> {
    Ok(SqliteConnectOptions::from_str(url)?
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .pragma("wal_autocheckpoint", SQLITE_WAL_AUTOCHECKPOINT))
}

/// Repeated metadata lookups from one task: [`EventStore::metadata_lookup`].
pub struct MetadataLookup {
    store: EventStore,
    /// PostgreSQL only; SQLite answers from the store's pool.
    connection: Option<postgres::LookupConnection>,
}

impl MetadataLookup {
    /// As [`EventStore::find_by_metadata`].
    pub async fn find(
        &mut self,
        key: &str,
        values: &[String],
        event_type: &str,
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        let Some(connection) = self.connection.as_mut() else {
            return self.store.find_by_metadata(key, values, event_type).await;
        };
        let key = lookup_key(key, values)?;
        if values.is_empty() {
            return Ok(Vec::new());
        }
        Ok(of_type(connection.find(key, values).await?, event_type))
    }
}

/// `key` as one of [`FILTERABLE_METADATA`], with at most [`MAX_LOOKUP_VALUES`] values.
fn lookup_key(key: &str, values: &[String]) -> Result<&'static str, LedgerError> {
    let Some(key) = FILTERABLE_METADATA.iter().find(|k| **k == key) else {
        return Err(LedgerError::InvalidFilter(format!(
            "metadata member {key:?} cannot be looked up; use one of {}",
            FILTERABLE_METADATA.join(", ")
        )));
    };
    if values.len() > MAX_LOOKUP_VALUES {
        return Err(LedgerError::InvalidFilter(format!(
            "{} values in one lookup; at most {MAX_LOOKUP_VALUES}",
            values.len()
        )));
    }
    Ok(key)
}

/// The type is checked here, not in SQL: with it there, PostgreSQL ANDs in the event-type
/// index, whose matches grow with the ledger (seen: 1.7 ms instead of 0.1 ms at 22k
/// events), while the metadata index alone finds a few rows.
fn of_type(mut found: Vec<RecordedEvent>, event_type: &str) -> Vec<RecordedEvent> {
    found.retain(|e| e.event_type == event_type);
    found
}

/// Tuning of the store and its group-commit writer.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Most events committed in one transaction (a single larger append goes alone).
    pub max_batch: usize,
    /// Longest the writer waits for more appends before committing a batch.
    pub max_wait: Duration,
    /// Largest canonical payload accepted.
    pub max_payload_bytes: usize,
    /// Most events in one append call.
    pub max_events_per_append: usize,
    /// Appends waiting for the writer before callers get [`LedgerError::Overloaded`].
    pub queue_capacity: usize,
    /// Connections in the pool (PostgreSQL; SQLite files use up to this many readers).
    pub max_connections: u32,
    /// Batches the writer may have in the database at once (PostgreSQL; SQLite has one
    /// writer at a time, so 1 there). With 2, batch N+1 is inserted on a second connection
    /// while N commits, and commits only after it. 1 by default: 2 measured no faster at
    /// 256 appenders and worse in p99 at 5,000 events/s offered (BENCHMARKS.md).
    pub pipeline_depth: usize,
    /// A pooled PostgreSQL connection idle at least this long is pinged before use, and
    /// replaced if the server no longer answers it, so that the first append after a
    /// database restart does not fail on a dead connection. Busy connections are not
    /// pinged: a ping per query cost a tenth of the gateway's CPU under load.
    pub ping_idle_after: Duration,
    /// Longest a caller waits for a pooled PostgreSQL connection (a new one included)
    /// before its call fails as unavailable: while the database is unreachable, callers
    /// hear so within this bound instead of hanging.
    pub acquire_timeout: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            max_batch: 500,
            max_wait: Duration::from_millis(1),
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            max_events_per_append: 10_000,
            queue_capacity: 100_000,
            max_connections: 8,
            pipeline_depth: 1,
            ping_idle_after: Duration::from_secs(1),
            acquire_timeout: Duration::from_secs(1),
        }
    }
}

/// Which way to read a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Backward,
}

/// One stream's part of an atomic multi-stream append.
#[derive(Clone, Debug)]
pub struct AppendToStream {
    pub stream_id: String,
    pub expected: ExpectedVersion,
    pub events: Vec<NewEvent>,
}

/// An event checked and in its canonical form ([`EventStore::prepare`]), ready to append.
///
/// Why: a caller that may have to append an event again (the clearing batch, when another
/// node took one of its request ids) kept a copy of its JSON tree for that, and copying the
/// tree of every decision was 3 % of a node's CPU under clearing load; a prepared event's
/// copy is its canonical text. Preparing also moves the canonicalisation out of the
/// appender's task into the caller's.
#[derive(Clone, Debug)]
pub struct PreparedEvent(ValidEvent);

/// One stream's part of [`EventStore::append_prepared`].
#[derive(Clone, Debug)]
pub struct PreparedAppend {
    pub stream_id: String,
    pub expected: ExpectedVersion,
    pub events: Vec<PreparedEvent>,
}

#[derive(Clone, Debug)]
pub(crate) enum Db {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

impl Db {
    /// The PostgreSQL pool, for the writer's contention mode (`None` on SQLite: one process).
    pub(crate) fn postgres(&self) -> Option<&PgPool> {
        match self {
            Db::Postgres(p) => Some(p),
            Db::Sqlite(_) => None,
        }
    }

    pub(crate) async fn read_head(&self) -> Result<Option<plan::Head>, sqlx::Error> {
        match self {
            Db::Postgres(p) => postgres::read_head(p).await,
            Db::Sqlite(p) => sqlite::read_head(p).await,
        }
    }

    pub(crate) async fn read_versions(
        &self,
        streams: &[String],
    ) -> Result<std::collections::HashMap<String, u64>, sqlx::Error> {
        match self {
            Db::Postgres(p) => postgres::read_versions(p, streams).await,
            Db::Sqlite(p) => sqlite::read_versions(p, streams).await,
        }
    }

    pub(crate) async fn insert_rows(&self, rows: &[plan::EventRow]) -> Result<(), sqlx::Error> {
        match self {
            Db::Postgres(p) => postgres::insert_rows(p, rows).await,
            Db::Sqlite(p) => sqlite::insert_rows(p, rows).await,
        }
    }

    /// How many batches the writer may have in the database at once.
    pub(crate) fn pipeline_depth(&self, configured: usize) -> usize {
        match self {
            Db::Postgres(_) => configured.max(1),
            Db::Sqlite(_) => 1,
        }
    }

    /// Inserts a batch that must commit after the batch whose commit `after` reports, if
    /// any (see [`StoreConfig::pipeline_depth`]).
    pub(crate) async fn insert_rows_after(
        &self,
        rows: &[plan::EventRow],
        after: Option<tokio::sync::oneshot::Receiver<bool>>,
    ) -> Result<(), InsertError> {
        match (self, after) {
            (_, None) => Ok(self.insert_rows(rows).await?),
            (Db::Postgres(p), Some(after)) => postgres::insert_rows_after(p, rows, after).await,
            (Db::Sqlite(p), Some(after)) => {
                if after.await != Ok(true) {
                    return Err(InsertError::PredecessorFailed);
                }
                Ok(sqlite::insert_rows(p, rows).await?)
            }
        }
    }

    pub(crate) async fn existing_event_ids(&self, ids: &[Uuid]) -> Result<Vec<Uuid>, LedgerError> {
        match self {
            Db::Postgres(p) => postgres::existing_event_ids(p, ids).await,
            Db::Sqlite(p) => sqlite::existing_event_ids(p, ids).await,
        }
    }
}

/// Why a batch's insert did not commit.
#[derive(Debug)]
pub(crate) enum InsertError {
    Sql(sqlx::Error),
    /// The batch before it did not commit, so this one, planned on its chain, rolled back.
    PredecessorFailed,
}

impl From<sqlx::Error> for InsertError {
    fn from(e: sqlx::Error) -> Self {
        InsertError::Sql(e)
    }
}

/// Where a filtered read starts, exclusive: forward after a seq or backward before one.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Cursor {
    After(u64),
    Before(u64),
}

/// A seq as the databases' signed 64-bit integer (seqs beyond it do not exist).
pub(crate) fn seq_param(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

/// Decodes the columns both backends share; `recorded_at` is stored differently.
fn decode_event<'r, R>(row: &'r R, recorded_at: DateTime<Utc>) -> Result<RecordedEvent, LedgerError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    i32: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    Uuid: Decode<'r, R::Database> + Type<R::Database>,
{
    let seq: i64 = row.try_get("seq")?;
    let corrupt = |reason: String| LedgerError::CorruptRow { seq, reason };
    let hash = |column: &'r str| -> Result<Hash, LedgerError> {
        let bytes: Vec<u8> = row.try_get(column)?;
        bytes
            .try_into()
            .map_err(|b: Vec<u8>| corrupt(format!("{column} has {} bytes, not 32", b.len())))
    };
    let raw = |column: &'r str| -> Result<Box<RawValue>, LedgerError> {
        let text: String = row.try_get(column)?;
        RawValue::from_string(text).map_err(|e| corrupt(format!("{column} is not JSON: {e}")))
    };
    Ok(RecordedEvent {
        seq: seq as u64,
        stream_id: row.try_get("stream_id")?,
        stream_version: row.try_get::<i64, _>("stream_version")? as u64,
        event_id: row.try_get("event_id")?,
        event_type: row.try_get("event_type")?,
        schema_version: row.try_get::<i32, _>("schema_version")? as u32,
        payload: raw("payload")?,
        metadata: raw("metadata")?,
        recorded_at,
        prev_hash: hash("prev_hash")?,
        hash: hash("hash")?,
    })
}

struct Inner {
    db: Db,
    config: StoreConfig,
    writer: mpsc::Sender<WriterMsg>,
    committed: watch::Receiver<u64>,
    /// What this process committed last, for followers (see `tail.rs`).
    tail: Arc<Tail>,
    writer_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The hosts of a multi-host URL, whose primary every pool of the store follows.
    failover: Option<Arc<failover::Failover>>,
}

/// How the store's PostgreSQL pools acquire connections. `primary_only` (a multi-host
/// URL): a new connection to a host in recovery (a standby) is refused, so the pool never
/// writes to a host that cannot take writes and the failover watcher finds the primary.
fn pg_pool_options(
    config: &StoreConfig,
    max_connections: u32,
    primary_only: bool,
) -> PgPoolOptions {
    let ping_idle_after = config.ping_idle_after;
    let options = PgPoolOptions::new();
    let options = if primary_only {
        options.after_connect(|conn, _| {
            Box::pin(async move {
                let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                    .fetch_one(&mut *conn)
                    .await?;
                if in_recovery {
                    return Err(sqlx::Error::Configuration(
                        "connected to a standby (in recovery); the ledger writes to the primary"
                            .into(),
                    ));
                }
                Ok(())
            })
        })
    } else {
        options
    };
    options
        .max_connections(max_connections)
        .acquire_timeout(config.acquire_timeout)
        // No ping before every acquire: it was a round trip per query (a tenth of the
        // gateway's CPU under load). Only connections that sat idle are pinged; one that
        // fails the ping is closed and another taken.
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= ping_idle_after {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
}

/// The ledger's event store. Cheap to clone; all clones share one group-commit writer.
#[derive(Clone)]
pub struct EventStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EventStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStore")
            .field("backend", &self.backend_name())
            .finish_non_exhaustive()
    }
}

impl EventStore {
    /// Opens the store at `url` (`postgres://…` or `sqlite:…`), runs migrations and starts
    /// the writer.
    pub async fn connect(url: &str, config: StoreConfig) -> Result<Self, LedgerError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // No JIT compilation: the ledger's statements are short index probes, and
            // PostgreSQL's cost guesses on a ledger it has not analysed yet put a batch's
            // lookup over `jit_above_cost`, so each one spent ~10 ms compiling.
            let tune = |options: PgConnectOptions| options.options([("jit", "off")]);
            // Several hosts (a primary and its standbys): the one that is the primary now,
            // followed when it changes.
            let (options, failover) = match failover::split_hosts(url)? {
                Some(hosts) => {
                    let (failover, options) = failover::Failover::connect(hosts, tune).await?;
                    (options, Some(failover))
                }
                None => (tune(PgConnectOptions::from_str(url)?), None),
            };
            // One connection on its own first: the pool retries until its acquire timeout
            // and then says only "pool timed out", not why (refused, no such database, a
            // wrong password).
            let probe = PgConnection::connect_with(&options).await?;
            let _ = probe.close().await;
            let pool = pg_pool_options(&config, config.max_connections, failover.is_some())
                .connect_with(options)
                .await?;
            if let Some(failover) = &failover {
                failover.register(&pool);
                failover::Failover::watch(failover);
            }
            postgres::migrate(&pool).await?;
            Self::start(Db::Postgres(pool), config, failover).await
        } else if url.starts_with("sqlite:") {
            let options = sqlite_options(url)?
                .create_if_missing(true)
                .busy_timeout(Duration::from_secs(10));
            let in_memory = url.contains(":memory:") || url.contains("mode=memory");
            let pool = SqlitePoolOptions::new()
                .max_connections(if in_memory { 1 } else { config.max_connections })
                .connect_with(options)
                .await?;
            Self::open_sqlite(pool, config).await
        } else {
            Err(LedgerError::UnsupportedUrl(redact_url(url)))
        }
    }

    /// Opens a PostgreSQL streaming replica of the ledger for reading: no migrations (a
    /// standby cannot run them; its schema is the primary's), and appends through it fail
    /// (the server refuses writes). How far it has replayed: [`Self::head`].
    pub async fn connect_replica(url: &str, config: StoreConfig) -> Result<Self, LedgerError> {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(LedgerError::UnsupportedUrl(redact_url(url)));
        }
        let options = PgConnectOptions::from_str(url)?.options([("jit", "off")]);
        let probe = PgConnection::connect_with(&options).await?;
        let _ = probe.close().await;
        let pool = pg_pool_options(&config, config.max_connections, false)
            .connect_with(options)
            .await?;
        Self::start(Db::Postgres(pool), config, None).await
    }

    pub async fn open_postgres(pool: PgPool, config: StoreConfig) -> Result<Self, LedgerError> {
        postgres::migrate(&pool).await?;
        Self::start(Db::Postgres(pool), config, None).await
    }

    pub async fn open_sqlite(pool: SqlitePool, config: StoreConfig) -> Result<Self, LedgerError> {
        sqlite::migrate(&pool).await?;
        Self::start(Db::Sqlite(pool), config, None).await
    }

    async fn start(
        db: Db,
        config: StoreConfig,
        failover: Option<Arc<failover::Failover>>,
    ) -> Result<Self, LedgerError> {
        let store = Self::start_writer(db, config, failover).await?;
        let finished = store.reapply_redactions().await?;
        if finished > 0 {
            tracing::warn!(finished, "finished redactions interrupted by a crash");
        }
        Ok(store)
    }

    async fn start_writer(
        db: Db,
        config: StoreConfig,
        failover: Option<Arc<failover::Failover>>,
    ) -> Result<Self, LedgerError> {
        let head = match &db {
            Db::Postgres(p) => postgres::head(p).await?,
            Db::Sqlite(p) => sqlite::head(p).await?,
        };
        let (committed_tx, committed) = watch::channel(head.map_or(0, |(seq, _)| seq));
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        let tail = Arc::new(Tail::default());
        let task = tokio::spawn(writer::run(
            db.clone(),
            rx,
            committed_tx,
            Arc::clone(&tail),
            config.max_batch.max(1),
            config.max_wait,
            db.pipeline_depth(config.pipeline_depth),
        ));
        Ok(EventStore {
            inner: Arc::new(Inner {
                db,
                config,
                writer: tx,
                committed,
                tail,
                writer_task: Mutex::new(Some(task)),
                failover,
            }),
        })
    }

    /// The same ledger (its writer, commit signal and tail) over a PostgreSQL pool of its
    /// own of up to `max_connections`, opened on first use. For work on another tokio
    /// runtime: a connection stays bound to the runtime whose task opened it, so a
    /// low-priority runtime's tasks must not open connections that the answers' tasks
    /// then wait on. SQLite connections run on threads of their own and are shared.
    pub fn with_own_pool(&self, max_connections: u32) -> EventStore {
        let failover = self.inner.failover.clone();
        let db = match &self.inner.db {
            Db::Postgres(p) => {
                let options = match &failover {
                    Some(f) => f.current_options(),
                    None => (*p.connect_options()).clone(),
                };
                let pool = pg_pool_options(
                    &self.inner.config,
                    max_connections.max(1),
                    failover.is_some(),
                )
                .connect_lazy_with(options);
                if let Some(f) = &failover {
                    f.register(&pool);
                }
                Db::Postgres(pool)
            }
            Db::Sqlite(p) => Db::Sqlite(p.clone()),
        };
        EventStore {
            inner: Arc::new(Inner {
                db,
                config: self.inner.config.clone(),
                writer: self.inner.writer.clone(),
                committed: self.inner.committed.clone(),
                tail: Arc::clone(&self.inner.tail),
                writer_task: Mutex::new(None),
                failover,
            }),
        }
    }

    /// `"postgres"` or `"sqlite"`.
    pub fn backend_name(&self) -> &'static str {
        match self.inner.db {
            Db::Postgres(_) => "postgres",
            Db::Sqlite(_) => "sqlite",
        }
    }

    /// The PostgreSQL pool, for crates that keep tables of their own beside the ledger.
    pub fn postgres_pool(&self) -> Option<&PgPool> {
        match &self.inner.db {
            Db::Postgres(p) => Some(p),
            Db::Sqlite(_) => None,
        }
    }

    /// The SQLite pool, for crates that keep tables of their own beside the ledger.
    pub fn sqlite_pool(&self) -> Option<&SqlitePool> {
        match &self.inner.db {
            Db::Sqlite(p) => Some(p),
            Db::Postgres(_) => None,
        }
    }

    pub fn config(&self) -> &StoreConfig {
        &self.inner.config
    }

    /// Appends `events` to one stream if it is at `expected`; answers once committed.
    pub async fn append(
        &self,
        stream_id: &str,
        expected: ExpectedVersion,
        events: Vec<NewEvent>,
    ) -> Result<Vec<Committed>, LedgerError> {
        self.append_multi(vec![AppendToStream {
            stream_id: stream_id.to_owned(),
            expected,
            events,
        }])
        .await
    }

    /// Appends to several streams atomically: all expectations hold and every event is
    /// committed, or nothing is.
    pub async fn append_multi(
        &self,
        appends: Vec<AppendToStream>,
    ) -> Result<Vec<Committed>, LedgerError> {
        self.check_streams(
            appends
                .iter()
                .map(|a| (a.stream_id.as_str(), a.events.len())),
        )?;
        let max_payload_bytes = self.inner.config.max_payload_bytes;
        let appends = appends
            .into_iter()
            .map(|a| {
                Ok(StreamAppend {
                    stream_id: a.stream_id,
                    expected: a.expected,
                    events: a
                        .events
                        .into_iter()
                        .map(|e| e.validate(max_payload_bytes))
                        .collect::<Result<_, LedgerError>>()?,
                })
            })
            .collect::<Result<_, LedgerError>>()?;
        self.write(appends).await
    }

    /// Checks `event` and puts it in canonical form, as an append would (the same errors),
    /// for [`append_prepared`](Self::append_prepared).
    pub fn prepare(&self, event: NewEvent) -> Result<PreparedEvent, LedgerError> {
        event
            .validate(self.inner.config.max_payload_bytes)
            .map(PreparedEvent)
    }

    /// [`append_multi`](Self::append_multi) of prepared events.
    pub async fn append_prepared(
        &self,
        appends: Vec<PreparedAppend>,
    ) -> Result<Vec<Committed>, LedgerError> {
        let appends = appends
            .into_iter()
            .map(|a| StreamAppend {
                stream_id: a.stream_id,
                expected: a.expected,
                events: a.events.into_iter().map(|PreparedEvent(e)| e).collect(),
            })
            .collect::<Vec<_>>();
        self.check_streams(
            appends
                .iter()
                .map(|a| (a.stream_id.as_str(), a.events.len())),
        )?;
        self.write(appends).await
    }

    /// Hands valid events to the writer; answers once committed.
    async fn write(&self, appends: Vec<StreamAppend>) -> Result<Vec<Committed>, LedgerError> {
        let (reply, answer) = oneshot::channel();
        self.inner
            .writer
            .try_send(WriterMsg::Append {
                appends,
                reply,
                enqueued: std::time::Instant::now(),
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => LedgerError::Overloaded,
                mpsc::error::TrySendError::Closed(_) => LedgerError::WriterClosed,
            })?;
        answer.await.map_err(|_| LedgerError::WriterClosed)?
    }

    /// An append's size within bounds, its stream ids valid and each named once: for each
    /// stream, its id and how many events it gets.
    fn check_streams<'a>(
        &self,
        streams: impl Iterator<Item = (&'a str, usize)> + Clone,
    ) -> Result<(), LedgerError> {
        let count: usize = streams.clone().map(|(_, n)| n).sum();
        if count == 0 {
            return Err(LedgerError::EmptyAppend);
        }
        let limit = self.inner.config.max_events_per_append;
        if count > limit {
            return Err(LedgerError::TooManyEvents { count, limit });
        }
        let mut seen = std::collections::HashSet::new();
        for (stream_id, _) in streams {
            validate_stream_id(stream_id)?;
            if !seen.insert(stream_id) {
                return Err(LedgerError::DuplicateStream {
                    stream_id: stream_id.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// Up to `limit` events from `from_seq` on, in seq order.
    pub async fn read_all(
        &self,
        from_seq: u64,
        limit: u32,
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        // Seqs are stored as signed 64-bit integers: none lies beyond.
        if from_seq > i64::MAX as u64 {
            return Ok(Vec::new());
        }
        match &self.inner.db {
            Db::Postgres(p) => postgres::read_all(p, from_seq, limit).await,
            Db::Sqlite(p) => sqlite::read_all(p, from_seq, limit).await,
        }
    }

    /// Every event from `from_seq` on, in seq order, sent to `pages` `page_len` at a time;
    /// returns when all are sent or the receiver is gone. On PostgreSQL one binary `COPY`
    /// streams them from one snapshot (`verify`'s read, the cheapest PostgreSQL offers);
    /// on SQLite pages of [`read_all`](Self::read_all) follow each other.
    pub async fn read_all_into(
        &self,
        from_seq: u64,
        page_len: u32,
        pages: &mpsc::Sender<Result<Vec<RecordedEvent>, LedgerError>>,
    ) -> Result<(), LedgerError> {
        if let Db::Postgres(p) = &self.inner.db {
            return pg_copy::copy_all(p, from_seq, page_len as usize, pages).await;
        }
        let mut next = from_seq;
        loop {
            let page = self.read_all(next, page_len).await?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            next = last.seq + 1;
            let short = page.len() < page_len as usize;
            if pages.send(Ok(page)).await.is_err() || short {
                return Ok(());
            }
        }
    }

    /// Up to `limit` events of one stream, starting at `from_version` (inclusive) and going
    /// `direction`; `u64::MAX` with [`Direction::Backward`] starts at the end.
    pub async fn read_stream(
        &self,
        stream_id: &str,
        from_version: u64,
        direction: Direction,
        limit: u32,
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        validate_stream_id(stream_id)?;
        match &self.inner.db {
            Db::Postgres(p) => {
                postgres::read_stream(p, stream_id, from_version, direction, limit).await
            }
            Db::Sqlite(p) => {
                sqlite::read_stream(p, stream_id, from_version, direction, limit).await
            }
        }
    }

    /// Events of `event_type` whose metadata member `key` is one of `values`, in seq order:
    /// e.g. the decisions recorded for a batch of request ids. One indexed query however
    /// many values (at most [`MAX_LOOKUP_VALUES`]), planned once per connection; `key` must
    /// be one of [`FILTERABLE_METADATA`]. For a caller that asks again and again, a
    /// [`MetadataLookup`] is cheaper.
    pub async fn find_by_metadata(
        &self,
        key: &str,
        values: &[String],
        event_type: &str,
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        let key = lookup_key(key, values)?;
        if values.is_empty() {
            return Ok(Vec::new());
        }
        let found = match &self.inner.db {
            Db::Postgres(p) => postgres::find_by_metadata(p, key, values).await?,
            Db::Sqlite(p) => sqlite::find_by_metadata(p, key, values).await?,
        };
        Ok(of_type(found, event_type))
    }

    /// A handle for repeated [`find_by_metadata`](Self::find_by_metadata) calls from one
    /// task. On PostgreSQL it keeps a connection of its own (beyond the pool's
    /// `max_connections`), opened on first use, whose statement is prepared and planned
    /// once.
    pub fn metadata_lookup(&self) -> MetadataLookup {
        let connection = match &self.inner.db {
            Db::Postgres(p) => Some(postgres::LookupConnection::new(p)),
            Db::Sqlite(_) => None,
        };
        MetadataLookup {
            store: self.clone(),
            connection,
        }
    }

    /// Up to `limit` events matching `filter` with seq > `after_seq`, in seq order.
    pub async fn query(
        &self,
        filter: &EventFilter,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        self.filtered(filter, Cursor::After(after_seq), limit).await
    }

    /// Up to `limit` events matching `filter` with seq < `before_seq`, newest first (the
    /// last of a kind before a point: `query_backward(&f, u64::MAX, 1)` is the newest).
    pub async fn query_backward(
        &self,
        filter: &EventFilter,
        before_seq: u64,
        limit: u32,
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        self.filtered(filter, Cursor::Before(before_seq), limit)
            .await
    }

    async fn filtered(
        &self,
        filter: &EventFilter,
        cursor: Cursor,
        limit: u32,
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        filter.validate()?;
        match &self.inner.db {
            Db::Postgres(p) => postgres::query(p, filter, cursor, limit).await,
            Db::Sqlite(p) => sqlite::query(p, filter, cursor, limit).await,
        }
    }

    /// The newest event recorded at or before `at`, as its seq and time (`None` when every
    /// event is younger): what "the ledger as of a time" means. Index probes only.
    pub async fn seq_at_time(
        &self,
        at: DateTime<Utc>,
    ) -> Result<Option<(u64, DateTime<Utc>)>, LedgerError> {
        match &self.inner.db {
            Db::Postgres(p) => postgres::seq_at_time(p, at).await,
            Db::Sqlite(p) => sqlite::seq_at_time(p, at).await,
        }
    }

    /// Events recorded in `[from, to)`, after `after_seq`, in seq order (= time order).
    pub async fn read_time_range(
        &self,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<RecordedEvent>, LedgerError> {
        match &self.inner.db {
            Db::Postgres(p) => postgres::read_time_range(p, from, to, after_seq, limit).await,
            Db::Sqlite(p) => sqlite::read_time_range(p, from, to, after_seq, limit).await,
        }
    }

    /// The last committed seq and hash (`None` for an empty ledger), read from the database.
    pub async fn head(&self) -> Result<Option<(u64, Hash)>, LedgerError> {
        match &self.inner.db {
            Db::Postgres(p) => postgres::head(p).await,
            Db::Sqlite(p) => sqlite::head(p).await,
        }
    }

    /// The stream's current version (0 when it has no events).
    pub async fn stream_version(&self, stream_id: &str) -> Result<u64, LedgerError> {
        validate_stream_id(stream_id)?;
        match &self.inner.db {
            Db::Postgres(p) => postgres::stream_version(p, stream_id).await,
            Db::Sqlite(p) => sqlite::stream_version(p, stream_id).await,
        }
    }

    /// Up to `limit` `(seq, hash)` pairs from `from_seq` on: the Merkle log's leaves.
    pub async fn read_hashes(
        &self,
        from_seq: u64,
        limit: u32,
    ) -> Result<Vec<(u64, Hash)>, LedgerError> {
        match &self.inner.db {
            Db::Postgres(p) => postgres::read_hashes(p, from_seq, limit).await,
            Db::Sqlite(p) => sqlite::read_hashes(p, from_seq, limit).await,
        }
    }

    /// Up to `limit` committed events from `from_seq` on, for a follower of the ledger:
    /// from memory when this process committed or read `from_seq` recently, else from
    /// the database (and then kept for the other followers). A page from memory is what the database holds at those seqs but may end
    /// sooner (later events written by other processes), so a follower that sees a short
    /// page must still read again later, as it does for writes from other processes.
    ///
    /// Events from memory are shared with the tail and the other followers, not copied.
    pub async fn read_following(
        &self,
        from_seq: u64,
        limit: u32,
    ) -> Result<Vec<Arc<RecordedEvent>>, LedgerError> {
        match self.inner.tail.events_from(from_seq, limit as usize) {
            Some(page) if !page.is_empty() => Ok(page),
            _ => {
                let page: Vec<Arc<RecordedEvent>> = self
                    .read_all(from_seq, limit)
                    .await?
                    .into_iter()
                    .map(Arc::new)
                    .collect();
                self.inner.tail.learn(&page);
                Ok(page)
            }
        }
    }

    /// [`EventStore::read_hashes`] for a follower, as [`EventStore::read_following`].
    pub async fn read_hashes_following(
        &self,
        from_seq: u64,
        limit: u32,
    ) -> Result<Vec<(u64, Hash)>, LedgerError> {
        match self.inner.tail.hashes_from(from_seq, limit as usize) {
            Some(page) if !page.is_empty() => Ok(page),
            _ => {
                let page = self.read_hashes(from_seq, limit).await?;
                self.inner.tail.learn_hashes(&page);
                Ok(page)
            }
        }
    }

    /// The highest seq this process has seen committed; changes as the writer commits.
    pub fn committed_seq(&self) -> watch::Receiver<u64> {
        self.inner.committed.clone()
    }

    /// The personal values of `event` still held (not redacted), each checked against the
    /// commitment the event carries.
    pub async fn personal_fields(
        &self,
        event: &RecordedEvent,
    ) -> Result<Vec<PersonalField>, LedgerError> {
        let rows = match &self.inner.db {
            Db::Postgres(p) => postgres::personal_fields(p, event.event_id).await?,
            Db::Sqlite(p) => sqlite::personal_fields(p, event.event_id).await?,
        };
        let payload = event.payload_value().map_err(|e| LedgerError::CorruptRow {
            seq: event.seq as i64,
            reason: format!("payload is not JSON: {e}"),
        })?;
        rows.into_iter()
            .map(|(member, value, salt)| {
                let corrupt = |reason: String| LedgerError::CorruptRow {
                    seq: event.seq as i64,
                    reason,
                };
                let salt: [u8; 16] = salt
                    .try_into()
                    .map_err(|_| corrupt(format!("personal field {member:?} has a bad salt")))?;
                let field = PersonalField {
                    member,
                    value,
                    salt,
                };
                if placeholder(&payload, &field.member) != Some(field.commitment()) {
                    return Err(corrupt(format!(
                        "personal field {:?} does not match the commitment in the event",
                        field.member
                    )));
                }
                Ok(field)
            })
            .collect()
    }

    /// Erases one personal value of `event`: appends a `RedactionApplied` event naming the
    /// event, member, commitment, reason and actor, then deletes the value. The chain and
    /// every proof still verify; the commitment stays.
    pub async fn redact(
        &self,
        event: &RecordedEvent,
        member: &str,
        reason: &str,
        actor: &str,
    ) -> Result<Committed, LedgerError> {
        let held = self.personal_fields(event).await?;
        let field = held.iter().find(|f| f.member == member).ok_or_else(|| {
            LedgerError::NoSuchPersonalField {
                event_id: event.event_id,
                member: member.to_owned(),
            }
        })?;
        let record = NewEvent::new(
            REDACTION_EVENT_TYPE,
            serde_json::json!({
                "event_id": event.event_id,
                "seq": event.seq,
                "member": member,
                "commitment": hex::encode(field.commitment()),
                "reason": reason,
            }),
        )
        .with_metadata(serde_json::json!({ "actor": actor }));
        let committed = self
            .append(REDACTION_STREAM, ExpectedVersion::Any, vec![record])
            .await?
            .into_iter()
            .next()
            .ok_or(LedgerError::WriterClosed)?;
        self.delete_personal_field(event.event_id, member).await?;
        Ok(committed)
    }

    async fn delete_personal_field(
        &self,
        event_id: Uuid,
        member: &str,
    ) -> Result<u64, LedgerError> {
        match &self.inner.db {
            Db::Postgres(p) => postgres::delete_personal_field(p, event_id, member).await,
            Db::Sqlite(p) => sqlite::delete_personal_field(p, event_id, member).await,
        }
    }

    /// Finishes redactions whose event was committed but whose deletion did not happen
    /// (a crash between the two); runs when a store opens.
    async fn reapply_redactions(&self) -> Result<u64, LedgerError> {
        let filter = EventFilter {
            event_type: Some(REDACTION_EVENT_TYPE.to_owned()),
            stream_prefix: Some(REDACTION_STREAM.to_owned()),
            ..EventFilter::default()
        };
        let mut after = 0;
        let mut deleted = 0;
        loop {
            let page = self.query(&filter, after, 1000).await?;
            let Some(last) = page.last() else {
                return Ok(deleted);
            };
            after = last.seq;
            for e in &page {
                let p = e.payload_value().unwrap_or_default();
                let id = p["event_id"].as_str().and_then(|s| Uuid::parse_str(s).ok());
                if let (Some(id), Some(member)) = (id, p["member"].as_str()) {
                    deleted += self.delete_personal_field(id, member).await?;
                }
            }
        }
    }

    /// The last seq a named subscriber stored as processed.
    pub async fn load_position(&self, name: &str) -> Result<Option<u64>, LedgerError> {
        match &self.inner.db {
            Db::Postgres(p) => postgres::load_position(p, name).await,
            Db::Sqlite(p) => sqlite::load_position(p, name).await,
        }
    }

    /// Every named subscriber's stored position.
    pub async fn positions(&self) -> Result<Vec<(String, u64)>, LedgerError> {
        match &self.inner.db {
            Db::Postgres(p) => postgres::positions(p).await,
            Db::Sqlite(p) => sqlite::positions(p).await,
        }
    }

    /// Refuses a ledger whose head is behind what a witness has already seen: each witness
    /// is `(what it is, the highest seq it saw)`, e.g. the Merkle log file, a subscriber's
    /// stored position, a lineage table. Called before anything is written, so that a
    /// ledger whose newest events were deleted (or restored from an older backup) is never
    /// extended, signed or relayed over as if nothing happened. Every named subscriber's
    /// stored position is a witness too.
    pub async fn ensure_not_behind(
        &self,
        mut witnesses: Vec<(String, u64)>,
    ) -> Result<(), LedgerError> {
        let head = self.head().await?.map_or(0, |(seq, _)| seq);
        for (name, position) in self.positions().await? {
            witnesses.push((
                format!("the stored position of subscriber {name:?}"),
                position,
            ));
        }
        match witnesses.into_iter().max_by_key(|(_, seen)| *seen) {
            Some((witness, seen)) if seen > head => Err(LedgerError::Truncated {
                head,
                witness,
                seen,
            }),
            _ => Ok(()),
        }
    }

    /// Stores that a named subscriber has processed everything up to `position`.
    pub async fn save_position(&self, name: &str, position: u64) -> Result<(), LedgerError> {
        match &self.inner.db {
            Db::Postgres(p) => postgres::save_position(p, name, position).await,
            Db::Sqlite(p) => sqlite::save_position(p, name, position).await,
        }
    }

    /// Stops accepting appends, commits everything already queued, and waits for the
    /// writer to finish. Appends after this fail with [`LedgerError::WriterClosed`].
    pub async fn shutdown(&self) {
        let (ack, done) = oneshot::channel();
        if self
            .inner
            .writer
            .send(WriterMsg::Shutdown { ack })
            .await
            .is_ok()
        {
            let _ = done.await;
        }
        if let Some(task) = self.inner.writer_task.lock().await.take() {
            let _ = task.await;
        }
    }
}

/// A database URL with any password replaced, for messages and logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme_end + 3],
                    &userinfo[..colon],
                    &url[at..]
                ),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A store on the SQLite ledger file in `dir` (several may share it, as processes do).
    async fn sqlite_store(dir: &tempfile::TempDir) -> EventStore {
        let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
        EventStore::connect(&url, StoreConfig::default())
            .await
            .unwrap()
    }

    /// SQLite copies the WAL back into the database file only after ~40 MiB of it (see
    /// [`SQLITE_WAL_AUTOCHECKPOINT`]): with SQLite's own setting the WAL file would stop
    /// growing near 4 MiB.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_sqlite_wal_is_checkpointed_after_tens_of_mebibytes() {
        let dir = tempfile::tempdir().unwrap();
        let store = sqlite_store(&dir).await;
        let text = "x".repeat(3_000);
        for append in 0..60 {
            let events = (0..50)
                .map(|n| NewEvent::new("Note", json!({"n": append * 50 + n, "text": text})))
                .collect();
            store
                .append(
                    &format!("notes/{}", append % 7),
                    ExpectedVersion::Any,
                    events,
                )
                .await
                .unwrap();
        }
        let wal = std::fs::metadata(dir.path().join("ledger.db-wal"))
            .unwrap()
            .len();
        assert!(
            wal > 8 << 20,
            "the WAL holds {wal} bytes: checkpointed early"
        );
        store.shutdown().await;
    }

    /// What the writer commits reaches the followers' tail, personal values left out, on
    /// the real write path (a writer that never published would only show as load on the
    /// database).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn committed_batches_reach_the_followers_tail() {
        let dir = tempfile::tempdir().unwrap();
        let store = sqlite_store(&dir).await;
        for n in 0..3 {
            let mut personal = serde_json::Map::new();
            personal.insert("buyer".into(), json!("Alice"));
            let event = NewEvent::new("ClearingDecided", json!({"n": n})).with_personal(personal);
            store
                .append("clearing/m1", ExpectedVersion::Any, vec![event])
                .await
                .unwrap();
        }
        let from_tail = store.inner.tail.events_from(1, 10).expect("kept in memory");
        let from_db = store.read_all(1, 10).await.unwrap();
        let json = |e: &RecordedEvent| serde_json::to_string(e).unwrap();
        assert_eq!(
            from_tail.iter().map(|e| json(e)).collect::<Vec<_>>(),
            from_db.iter().map(json).collect::<Vec<_>>()
        );
        assert_eq!(from_tail.len(), 3);
        assert!(!from_tail[0].payload.get().contains("Alice"));
        store.shutdown().await;
    }

    /// Events another process wrote are read from the database once: the first follower's
    /// page is kept, and the next follower of this process shares it; hashes read alone
    /// likewise.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_writers_events_are_read_once_per_process() {
        let dir = tempfile::tempdir().unwrap();
        let writer = sqlite_store(&dir).await;
        let reader = sqlite_store(&dir).await;
        for n in 0..4 {
            let event = NewEvent::new("ClearingDecided", json!({"n": n}));
            writer
                .append("clearing/m1", ExpectedVersion::Any, vec![event])
                .await
                .unwrap();
        }
        assert!(reader.inner.tail.events_from(1, 10).is_none());
        assert!(reader.inner.tail.hashes_from(1, 10).is_none());
        let hashes = reader.read_hashes_following(3, 10).await.unwrap();
        assert_eq!(hashes.iter().map(|h| h.0).collect::<Vec<_>>(), vec![3, 4]);
        assert_eq!(reader.inner.tail.hashes_from(3, 10), Some(hashes));
        let first = reader.read_following(1, 10).await.unwrap();
        assert_eq!(first.len(), 4);
        let second = reader.read_following(2, 10).await.unwrap();
        assert_eq!(second.len(), 3);
        assert!(Arc::ptr_eq(&first[1], &second[0]), "shared, not read again");
        assert_eq!(
            reader.inner.tail.hashes_from(1, 10).map(|h| h.len()),
            Some(4)
        );
        writer.shutdown().await;
        reader.shutdown().await;
    }
}

//! The cluster as the ledger's PostgreSQL database defines it: the nodes that beat in it,
//! the settings they must share, and leases with fencing tokens, by which the nodes agree
//! which of them runs a singleton duty (the checkpointer, a lineage relay …).
//!
//! A lease is a row `(name, holder, token, expires_at)`. Taking it while it is free or
//! expired raises its token; its holder renews it before it expires and keeps the token.
//! Times are the database's clock only, so nodes' clocks never need to agree. A duty
//! marks each event it appends with [`fence`]: the database stores such an event only while
//! its token is the lease's current one and the lease has not expired (trigger
//! `events_fence`), so a holder paused past its lease (SIGSTOP, a long GC, a partition)
//! cannot write under it when it wakes: it learns on its next renewal that it lost the lease,
//! and any write it attempts before that is refused by the database.
//!
//! SQLite is the single-node embedded ledger: one process holds its data directory, so a
//! lease there is always this process's and nothing is fenced.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::watch;

use crate::error::LedgerError;
use crate::store::EventStore;

/// The metadata member that fences an event: `{"lease": name, "token": n}`.
pub const FENCE_MEMBER: &str = "fence";

pub use crate::error::FENCED_SQLSTATE;

/// A lease as the database holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LeaseState {
    pub name: String,
    pub holder: String,
    pub token: u64,
    pub acquired_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    /// Not expired by the database's clock when read.
    pub live: bool,
}

/// A lease's name and token as an event carries them in its metadata (member
/// [`FENCE_MEMBER`]): the database stores the event only under that token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Fence {
    pub lease: String,
    pub token: u64,
}

/// Adds the fence `{lease, token}` to an event's metadata object.
pub fn fence(metadata: &mut serde_json::Value, lease: &str, token: u64) {
    if let Some(object) = metadata.as_object_mut() {
        object.insert(
            FENCE_MEMBER.to_owned(),
            serde_json::json!({"lease": lease, "token": token}),
        );
    }
}

/// What to keep: which lease, in whose name, for how long per renewal.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub name: String,
    /// The node id.
    pub holder: String,
    /// How long a renewal lasts; renewed every third of it. Another node takes the duty
    /// at most this long after the holder dies.
    pub ttl: Duration,
}

/// The token of a lease while this process holds it (`None` while another does).
#[derive(Clone)]
pub struct HeldLease {
    name: String,
    token: watch::Receiver<Option<u64>>,
    /// Whether writes under it carry a fence the database checks (PostgreSQL's leases).
    fenced: bool,
}

impl HeldLease {
    /// A lease that is always this process's (SQLite's single node): token 1, never fenced.
    pub fn always(name: &str) -> HeldLease {
        let (_, token) = watch::channel(Some(1));
        HeldLease {
            name: name.to_owned(),
            token,
            fenced: false,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Fences an event's metadata with the current token, where the database checks fences.
    pub fn fence(&self, metadata: &mut serde_json::Value, token: u64) {
        if self.fenced {
            fence(metadata, &self.name, token);
        }
    }

    /// The fence for writes under `token`, where the database checks fences (`None` on
    /// SQLite, where nothing is fenced).
    pub fn fence_for(&self, token: u64) -> Option<Fence> {
        self.fenced.then(|| Fence {
            lease: self.name.clone(),
            token,
        })
    }

    /// The token while held. A process that was paused may still believe it holds a lease
    /// it lost: its writes under it are refused by the database.
    pub fn token(&self) -> Option<u64> {
        *self.token.borrow()
    }

    /// Waits until the lease is held or lost (a change either way).
    pub async fn changed(&mut self) {
        if self.token.changed().await.is_err() {
            // The keeper stopped: nothing will change any more.
            std::future::pending::<()>().await;
        }
    }
}

/// Keeps trying to take and renew `config`'s lease until `stop`; on stop, gives it up so
/// that another node takes the duty at once. On SQLite the lease is simply held.
pub fn keep_lease(
    store: EventStore,
    config: LeaseConfig,
    mut stop: watch::Receiver<bool>,
) -> (HeldLease, tokio::task::JoinHandle<()>) {
    if store.postgres_pool().is_none() {
        let held = HeldLease::always(&config.name);
        return (held, tokio::spawn(async {}));
    }
    let (tx, token) = watch::channel(None);
    let held = HeldLease {
        name: config.name.clone(),
        token,
        fenced: true,
    };
    let task = tokio::spawn(async move {
        let every = config.ttl / 3;
        let mut last_renewed: Option<tokio::time::Instant> = None;
        loop {
            match store
                .acquire_lease(&config.name, &config.holder, config.ttl)
                .await
            {
                Ok(token) => {
                    if token.is_some() {
                        last_renewed = Some(tokio::time::Instant::now());
                    }
                    if tx.send_if_modified(|held| {
                        let changed = *held != token;
                        *held = token;
                        changed
                    }) {
                        match token {
                            Some(token) => {
                                tracing::info!(lease = %config.name, token, "took the lease")
                            }
                            None => {
                                tracing::info!(lease = %config.name, "the lease is another node's")
                            }
                        }
                        metrics::gauge!("aether_lease_held", "lease" => config.name.clone())
                            .set(if token.is_some() { 1.0 } else { 0.0 });
                    }
                }
                Err(e) => {
                    // Without a renewal the lease may be gone: stop believing in it once it
                    // would have expired.
                    tracing::warn!(lease = %config.name, error = %e, "cannot renew the lease");
                    if last_renewed.is_none_or(|at| at.elapsed() >= config.ttl) {
                        tx.send_if_modified(|held| held.take().is_some());
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => {}
            }
            if *stop.borrow() {
                if tx.borrow().is_some() {
                    let _ = store.release_lease(&config.name, &config.holder).await;
                }
                let _ = tx.send(None);
                return;
            }
        }
    });
    (held, task)
}

impl EventStore {
    /// Takes the lease `name` for `holder` for `ttl`, or renews it if `holder` has it:
    /// the token while held, `None` if another holder's lease is live. Taking a free or
    /// expired lease raises its token, renewing a live one keeps it. PostgreSQL only.
    pub async fn acquire_lease(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, LedgerError> {
        let pool = self
            .postgres_pool()
            .ok_or(LedgerError::LeasesNeedPostgres)?;
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let token: Option<i64> = sqlx::query_scalar(
            "INSERT INTO leases AS l (name, holder, token, acquired_at, renewed_at, expires_at) \
             VALUES ($1, $2, 1, clock_timestamp(), clock_timestamp(), \
                     clock_timestamp() + $3 * interval '1 millisecond') \
             ON CONFLICT (name) DO UPDATE SET \
               token = CASE WHEN l.holder = EXCLUDED.holder AND l.expires_at > clock_timestamp() \
                            THEN l.token ELSE l.token + 1 END, \
               acquired_at = CASE WHEN l.holder = EXCLUDED.holder AND l.expires_at > clock_timestamp() \
                            THEN l.acquired_at ELSE clock_timestamp() END, \
               holder = EXCLUDED.holder, \
               renewed_at = clock_timestamp(), \
               expires_at = EXCLUDED.expires_at \
             WHERE l.holder = EXCLUDED.holder OR l.expires_at <= clock_timestamp() \
             RETURNING token",
        )
        .bind(name)
        .bind(holder)
        .bind(ttl_ms)
        .fetch_optional(pool)
        .await?;
        Ok(token.map(|t| t.max(0) as u64))
    }

    /// Gives up `holder`'s lease `name` (it expires now, keeping its token: the next holder
    /// raises it). Nothing happens if another holds it.
    pub async fn release_lease(&self, name: &str, holder: &str) -> Result<(), LedgerError> {
        let pool = self
            .postgres_pool()
            .ok_or(LedgerError::LeasesNeedPostgres)?;
        sqlx::query(
            "UPDATE leases SET expires_at = clock_timestamp() WHERE name = $1 AND holder = $2",
        )
        .bind(name)
        .bind(holder)
        .execute(pool)
        .await?;
        Ok(())
    }

    /// Every lease, live or expired (empty on SQLite).
    pub async fn leases(&self) -> Result<Vec<LeaseState>, LedgerError> {
        let Some(pool) = self.postgres_pool() else {
            return Ok(Vec::new());
        };
        #[derive(sqlx::FromRow)]
        struct Row {
            name: String,
            holder: String,
            token: i64,
            acquired_at: DateTime<Utc>,
            expires_at: DateTime<Utc>,
            live: bool,
        }
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT name, holder, token, acquired_at, expires_at, \
               expires_at > clock_timestamp() AS live FROM leases ORDER BY name",
        )
        .fetch_all(pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| LeaseState {
                name: r.name,
                holder: r.holder,
                token: r.token.max(0) as u64,
                acquired_at: r.acquired_at,
                expires_at: r.expires_at,
                live: r.live,
            })
            .collect())
    }

    /// Records `value` for the cluster-wide setting `name` if none is recorded, and returns
    /// the recorded value (the first node's). PostgreSQL only; SQLite returns `value`.
    pub async fn claim_setting(&self, name: &str, value: &str) -> Result<String, LedgerError> {
        let Some(pool) = self.postgres_pool() else {
            return Ok(value.to_owned());
        };
        sqlx::query("INSERT INTO ledger_settings (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING")
            .bind(name)
            .bind(value)
            .execute(pool)
            .await?;
        Ok(
            sqlx::query_scalar("SELECT value FROM ledger_settings WHERE name = $1")
                .bind(name)
                .fetch_one(pool)
                .await?,
        )
    }
}

/// A node as it last reported itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NodeState {
    pub node_id: String,
    pub http_address: String,
    pub grpc_address: String,
    pub version: String,
    pub started_at: DateTime<Utc>,
    pub heartbeat_at: DateTime<Utc>,
    /// Milliseconds since its last heartbeat, by the database's clock.
    pub silent_ms: u64,
    /// The seq through which it has applied the control plane recorded on the ledger.
    pub control_seq: u64,
}

impl EventStore {
    /// Records that `node` is alive now (its addresses and version as given).
    pub async fn heartbeat(
        &self,
        node_id: &str,
        http_address: &str,
        grpc_address: &str,
        version: &str,
        started_at: DateTime<Utc>,
        control_seq: u64,
    ) -> Result<(), LedgerError> {
        let Some(pool) = self.postgres_pool() else {
            return Ok(());
        };
        sqlx::query(
            "INSERT INTO cluster_nodes (node_id, http_address, grpc_address, version, started_at, heartbeat_at, control_seq) \
             VALUES ($1, $2, $3, $4, $5, clock_timestamp(), $6) \
             ON CONFLICT (node_id) DO UPDATE SET http_address = EXCLUDED.http_address, \
               grpc_address = EXCLUDED.grpc_address, version = EXCLUDED.version, \
               started_at = EXCLUDED.started_at, heartbeat_at = clock_timestamp(), \
               control_seq = EXCLUDED.control_seq",
        )
        .bind(node_id)
        .bind(http_address)
        .bind(grpc_address)
        .bind(version)
        .bind(started_at)
        .bind(i64::try_from(control_seq).unwrap_or(i64::MAX))
        .execute(pool)
        .await?;
        Ok(())
    }

    /// Every node that has beaten in this database, the most recently heard first.
    pub async fn nodes(&self) -> Result<Vec<NodeState>, LedgerError> {
        let Some(pool) = self.postgres_pool() else {
            return Ok(Vec::new());
        };
        #[derive(sqlx::FromRow)]
        struct Row {
            node_id: String,
            http_address: String,
            grpc_address: String,
            version: String,
            started_at: DateTime<Utc>,
            heartbeat_at: DateTime<Utc>,
            silent_ms: f64,
            control_seq: i64,
        }
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT node_id, http_address, grpc_address, version, started_at, heartbeat_at, \
               EXTRACT(EPOCH FROM clock_timestamp() - heartbeat_at)::float8 * 1000 AS silent_ms, \
               control_seq \
             FROM cluster_nodes ORDER BY heartbeat_at DESC",
        )
        .fetch_all(pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| NodeState {
                node_id: r.node_id,
                http_address: r.http_address,
                grpc_address: r.grpc_address,
                version: r.version,
                started_at: r.started_at,
                heartbeat_at: r.heartbeat_at,
                silent_ms: r.silent_ms.max(0.0) as u64,
                control_seq: u64::try_from(r.control_seq).unwrap_or(0),
            })
            .collect())
    }
}

/// How long a node that has not beaten is still presumed alive: a duty waits for it, a
/// snapshot asks it to prepare.
pub const PRESUMED_DOWN_AFTER: Duration = Duration::from_secs(5);

/// A row of `snapshot_prepares`: node, answered at, digest, error.
type AnswerRow = (
    String,
    Option<DateTime<Utc>>,
    Option<String>,
    Option<String>,
);

/// A node's answer to a snapshot's prepare request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PrepareAnswer {
    /// Not answered yet.
    Pending,
    /// Prepared: the digest of its participants' state.
    Prepared(String),
    /// It could not prepare, and why.
    Refused(String),
}

impl EventStore {
    /// The live nodes other than `this_node` (heard from within [`PRESUMED_DOWN_AFTER`]);
    /// none on SQLite.
    pub async fn live_other_nodes(&self, this_node: &str) -> Result<Vec<String>, LedgerError> {
        let mut nodes: Vec<String> = self
            .nodes()
            .await?
            .into_iter()
            .filter(|n| {
                n.node_id != this_node && n.silent_ms < PRESUMED_DOWN_AFTER.as_millis() as u64
            })
            .map(|n| n.node_id)
            .collect();
        nodes.sort();
        Ok(nodes)
    }

    /// Where a control event at `seq` (a rollback) is in force: `this_node`, and every
    /// other live node (heard from within [`PRESUMED_DOWN_AFTER`]) whose follower has
    /// applied it, waiting up to `patience` for them; the live nodes that have not are the
    /// second list (lagging).
    pub async fn in_force(
        &self,
        this_node: &str,
        seq: u64,
        patience: Duration,
    ) -> (Vec<String>, Vec<String>) {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let nodes = self.nodes().await.unwrap_or_default();
            let (mut done, mut lagging) = (vec![this_node.to_owned()], Vec::new());
            for node in nodes.iter().filter(|n| {
                n.node_id != this_node && n.silent_ms < PRESUMED_DOWN_AFTER.as_millis() as u64
            }) {
                if node.control_seq >= seq {
                    done.push(node.node_id.clone());
                } else {
                    lagging.push(node.node_id.clone());
                }
            }
            if lagging.is_empty() || tokio::time::Instant::now() >= deadline {
                return (done, lagging);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Asks `nodes` to prepare snapshot `snapshot_id` before `ttl` passes (and forgets
    /// requests older than an hour).
    pub async fn request_prepares(
        &self,
        snapshot_id: &str,
        nodes: &[String],
        ttl: Duration,
    ) -> Result<(), LedgerError> {
        let Some(pool) = self.postgres_pool() else {
            return Err(LedgerError::LeasesNeedPostgres);
        };
        sqlx::query("DELETE FROM snapshot_prepares WHERE requested_at < now() - interval '1 hour'")
            .execute(pool)
            .await?;
        sqlx::query(
            "INSERT INTO snapshot_prepares (snapshot_id, node_id, deadline) \
             SELECT $1, node, clock_timestamp() + make_interval(secs => $3) FROM UNNEST($2::text[]) AS node",
        )
        .bind(snapshot_id)
        .bind(nodes)
        .bind(ttl.as_secs_f64())
        .execute(pool)
        .await?;
        Ok(())
    }

    /// The snapshots `node` has been asked to prepare and has not answered, with the time
    /// left to answer (none on SQLite).
    pub async fn pending_prepares(
        &self,
        node: &str,
    ) -> Result<Vec<(String, Duration)>, LedgerError> {
        let Some(pool) = self.postgres_pool() else {
            return Ok(Vec::new());
        };
        let rows: Vec<(String, f64)> = sqlx::query_as(
            "SELECT snapshot_id, EXTRACT(EPOCH FROM deadline - clock_timestamp())::float8 \
             FROM snapshot_prepares WHERE node_id = $1 AND answered_at IS NULL \
               AND deadline > clock_timestamp()",
        )
        .bind(node)
        .fetch_all(pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(id, secs)| (id, Duration::from_secs_f64(secs.max(0.0))))
            .collect())
    }

    /// Records `node`'s answer to a prepare request.
    pub async fn answer_prepare(
        &self,
        snapshot_id: &str,
        node: &str,
        answer: Result<&str, &str>,
    ) -> Result<(), LedgerError> {
        let Some(pool) = self.postgres_pool() else {
            return Err(LedgerError::LeasesNeedPostgres);
        };
        let (digest, error) = match answer {
            Ok(digest) => (Some(digest), None),
            Err(error) => (None, Some(error)),
        };
        sqlx::query(
            "UPDATE snapshot_prepares SET answered_at = clock_timestamp(), digest = $3, error = $4 \
             WHERE snapshot_id = $1 AND node_id = $2 AND answered_at IS NULL",
        )
        .bind(snapshot_id)
        .bind(node)
        .bind(digest)
        .bind(error)
        .execute(pool)
        .await?;
        Ok(())
    }

    /// Each asked node's answer to snapshot `snapshot_id`'s prepare request.
    pub async fn prepare_answers(
        &self,
        snapshot_id: &str,
    ) -> Result<Vec<(String, PrepareAnswer)>, LedgerError> {
        let Some(pool) = self.postgres_pool() else {
            return Ok(Vec::new());
        };
        let rows: Vec<AnswerRow> = sqlx::query_as(
            "SELECT node_id, answered_at, digest, error FROM snapshot_prepares \
                 WHERE snapshot_id = $1 ORDER BY node_id",
        )
        .bind(snapshot_id)
        .fetch_all(pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(|(node, answered, digest, error)| {
                let answer = match (answered, digest, error) {
                    (None, _, _) => PrepareAnswer::Pending,
                    (Some(_), Some(d), _) => PrepareAnswer::Prepared(d),
                    (Some(_), None, e) => PrepareAnswer::Refused(e.unwrap_or_default()),
                };
                (node, answer)
            })
            .collect())
    }
}

//! The node's place in its cluster: its id, its heartbeat, the checkpoint key every node
//! must share, and the leases its singleton duties run under (`GET /v1/cluster` shows them).
//!
//! A cluster is the set of `aether serve` processes on one PostgreSQL ledger. SQLite is the
//! single-node embedded default: one process holds its data directory (`serve.lock`).

use std::path::Path;
use std::time::Duration;

use aether_ledger::EventStore;
use aether_ledger::checkpoint::key_fingerprint as fingerprint;
use aether_ledger::cluster::{HeldLease, LeaseConfig, keep_lease};
use aether_ledger::hashing::sm3;
use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use clap::Args;
use tokio::sync::watch;

/// The setting under which the cluster's checkpoint public key is recorded.
const CHECKPOINT_KEY_SETTING: &str = "checkpoint_public_key";

/// The setting under which the cluster's Delta tables' location is recorded.
const DELTA_LOCATION_SETTING: &str = "delta_location";

/// The leases of the lineage relays: one writer of the OpenLineage records, of the Delta
/// tables and of the OpenLineage HTTP backend for the whole cluster.
pub const OPENLINEAGE_LEASE: &str = "lineage-openlineage";
pub const DELTA_LEASE: &str = "lineage-delta";
pub const OPENLINEAGE_HTTP_LEASE: &str = "lineage-http";
/// The drift hand-offs (webhook, retraining command): one node delivers each.
pub const HANDOFF_LEASE: &str = "handoffs";

/// How often a node beats.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// This node's id in its cluster. Default: the host name and a digest of the data
    /// directory, so that two nodes on one host differ.
    #[arg(long, env = "AETHER_NODE_ID")]
    pub node_id: Option<String>,
    /// How long a singleton duty's lease lasts without renewal (milliseconds, 500–60000):
    /// when its holder dies, another node takes the duty within about this long plus a
    /// third of it.
    #[arg(long, env = "AETHER_LEASE_TTL_MS", default_value_t = 3000,
          value_parser = clap::value_parser!(u64).range(500..=60_000))]
    pub lease_ttl_ms: u64,
}

impl ClusterArgs {
    /// The node id: as given, or `<host>-<first 4 bytes of SM3(data dir)>`.
    pub fn node_id(&self, data_dir: &std::path::Path) -> String {
        if let Some(id) = &self.node_id {
            return id.clone();
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "node".to_owned());
        let dir = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_owned());
        let digest = sm3(dir.to_string_lossy().as_bytes());
        format!("{host}-{}", hex::encode(&digest[..4]))
    }

    /// A duty's lease for this node.
    pub fn lease(&self, name: &str, node_id: &str) -> LeaseConfig {
        LeaseConfig {
            name: name.to_owned(),
            holder: node_id.to_owned(),
            ttl: Duration::from_millis(self.lease_ttl_ms),
        }
    }
}

/// Checks the node's node id: 1–64 letters, digits, `.`, `_` or `-`.
pub fn check_node_id(id: &str) -> anyhow::Result<()> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !ok {
        bail!("--node-id {id:?} must be 1-64 letters, digits, '.', '_' or '-'");
    }
    Ok(())
}

/// One signer for the cluster: the first node records its checkpoint public key in the
/// ledger database; a node with another key refuses to start (checkpoints signed by two
/// keys would fail `aether verify` against either).
pub async fn claim_checkpoint_key(
    store: &EventStore,
    public_key_hex: &str,
    previous_key_hex: Option<&str>,
) -> anyhow::Result<()> {
    let recorded = store
        .claim_setting(CHECKPOINT_KEY_SETTING, public_key_hex)
        .await?;
    // The ledger itself says which key signs now (after any rotation); the setting only
    // decides before the first checkpoint.
    let in_force = aether_ledger::key_rotation::key_in_force(store)
        .await?
        .unwrap_or(recorded);
    if in_force == public_key_hex {
        return Ok(());
    }
    if previous_key_hex == Some(in_force.as_str()) {
        tracing::info!(
            from = %fingerprint(&in_force),
            to = %fingerprint(public_key_hex),
            "the checkpoint key is rotated when this node holds the checkpointer lease"
        );
        return Ok(());
    }
    bail!(
        "this node's checkpoint key (fingerprint {}) is not the cluster's (fingerprint {}): \
         every node of a cluster signs with the key the ledger's checkpoints are signed with; \
         start it with --checkpoint-key (AETHER_CHECKPOINT_KEY) naming that private key, or \
         rotate to this one with --previous-checkpoint-key naming it",
        fingerprint(public_key_hex),
        fingerprint(&in_force)
    );
}

/// Where the cluster's Delta tables are: `--delta-uri` (an `s3://` or `s3a://` location, or
/// a directory, made absolute), default `<data>/delta`. Refuses any other URL scheme.
pub fn delta_location(delta_uri: Option<&str>, data_dir: &Path) -> anyhow::Result<String> {
    let location = match delta_uri {
        Some(uri) if aether_lineage::object_storage::is_object_store(uri) => {
            let trimmed = uri.trim_end_matches('/');
            if trimmed
                .split_once("://")
                .is_none_or(|(_, rest)| rest.is_empty())
            {
                bail!("--delta-uri {uri:?} names no bucket");
            }
            return Ok(trimmed.to_owned());
        }
        Some(uri) if uri.contains("://") => bail!(
            "--delta-uri {uri:?}: only s3:// (or s3a://) locations and local directories are supported"
        ),
        Some(dir) => std::path::PathBuf::from(dir),
        None => data_dir.join("delta"),
    };
    std::fs::create_dir_all(&location)
        .with_context(|| format!("cannot create the Delta directory {}", location.display()))?;
    let absolute = std::fs::canonicalize(&location)
        .with_context(|| format!("cannot resolve {}", location.display()))?;
    absolute
        .to_str()
        .map(str::to_owned)
        .ok_or_else(|| anyhow::anyhow!("the Delta directory {} is not UTF-8", absolute.display()))
}

/// One set of Delta tables for the cluster: the first node records where they are; a node
/// that would write elsewhere refuses to start (two nodes' tables would each hold part of
/// the ledger).
pub async fn claim_delta_location(store: &EventStore, location: &str) -> anyhow::Result<()> {
    let recorded = store
        .claim_setting(DELTA_LOCATION_SETTING, location)
        .await?;
    if recorded != location {
        bail!(
            "this node's Delta tables would be at {location}, but the cluster's are at \
             {recorded}: every node of a cluster writes the same tables; start it with \
             --delta-uri {recorded} (AETHER_DELTA_URI), an object store or a directory every \
             node reaches"
        );
    }
    Ok(())
}

/// Runs a singleton duty only while this node holds its lease: started when the lease is
/// taken, told to stop (through the duty's own stop signal) when the lease is lost or at
/// `stop`, and started again when the lease comes back. What a duty writes after its lease
/// is gone is refused by the database or the table, not by this wrapper (see DEPLOYMENT.md).
pub async fn while_held<F, Fut, E>(
    duty: &'static str,
    mut lease: HeldLease,
    mut stop: watch::Receiver<bool>,
    mut run: F,
) -> Result<(), E>
where
    F: FnMut(watch::Receiver<bool>) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    loop {
        while lease.token().is_none() {
            if *stop.borrow() {
                return Ok(());
            }
            tokio::select! {
                _ = lease.changed() => {}
                changed = stop.changed() => if changed.is_err() { return Ok(()) },
            }
        }
        if *stop.borrow() {
            return Ok(());
        }
        let token = lease.token();
        tracing::info!(duty, ?token, "this node runs the duty");
        let (duty_stop, duty_stop_rx) = watch::channel(false);
        let running = run(duty_stop_rx);
        tokio::pin!(running);
        let mut stopping = false;
        let result = loop {
            tokio::select! {
                result = &mut running => break result,
                _ = lease.changed(), if !stopping => {
                    if lease.token() != token {
                        tracing::warn!(duty, "lease lost: stopping the duty here");
                        stopping = true;
                        let _ = duty_stop.send(true);
                    }
                }
                changed = stop.changed(), if !stopping => {
                    if changed.is_err() || *stop.borrow() {
                        stopping = true;
                        let _ = duty_stop.send(true);
                    }
                }
            }
        };
        if *stop.borrow() {
            return result;
        }
        if let Err(e) = result {
            tracing::error!(duty, error = %e, "duty failed; it starts again while the lease is held");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// Beats for this node every second until `stop`.
pub fn heartbeat(
    store: EventStore,
    control: aether_control::ControlState,
    node_id: String,
    http_address: String,
    grpc_address: String,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let started: DateTime<Utc> = Utc::now();
    tokio::spawn(async move {
        let version = env!("CARGO_PKG_VERSION");
        let mut failing = false;
        loop {
            match store
                .heartbeat(
                    &node_id,
                    &http_address,
                    &grpc_address,
                    version,
                    started,
                    control.followed_through(),
                )
                .await
            {
                Ok(()) if failing => {
                    failing = false;
                    tracing::info!("heartbeats recorded again");
                }
                Ok(()) => {}
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "cannot record this node's heartbeat");
                }
                Err(_) => {}
            }
            tokio::select! {
                _ = tokio::time::sleep(HEARTBEAT_EVERY) => {}
                _ = stop.changed() => return,
            }
        }
    })
}

/// The other nodes of the cluster heard from within `PRESUMED_DOWN_AFTER` (a rollback
/// does not wait for the others, a snapshot does not ask them).
pub async fn live_others(
    store: &EventStore,
    this_node: &str,
) -> anyhow::Result<std::collections::HashSet<String>> {
    Ok(store
        .live_other_nodes(this_node)
        .await?
        .into_iter()
        .collect())
}

/// How often a node looks for snapshots other nodes ask it to prepare.
const PREPARES_EVERY: Duration = Duration::from_millis(100);

/// Answers the prepare requests of the snapshots other nodes take (PostgreSQL only), until
/// `stop`: first applies every control event committed before the request (so a node a
/// follow step behind prepares the same state), then prepares its own participants and
/// answers with their state digest, or why it cannot.
pub async fn answer_snapshot_prepares(
    store: EventStore,
    control: aether_control::ControlState,
    node_id: String,
    mut stop: watch::Receiver<bool>,
) {
    if store.postgres_pool().is_none() {
        return;
    }
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(PREPARES_EVERY) => {}
        }
        let pending = match store.pending_prepares(&node_id).await {
            Ok(pending) => pending,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the snapshot prepare requests");
                continue;
            }
        };
        for (id, left) in pending {
            let answer = match uuid::Uuid::parse_str(&id) {
                Err(_) => Err(format!("snapshot id {id:?} is not a UUID")),
                Ok(snapshot) => {
                    let until = tokio::time::Instant::now() + left;
                    if let Ok(Some((head, _))) = store.head().await {
                        while control.followed_through() < head
                            && tokio::time::Instant::now() < until
                        {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                    let participants = control.participants();
                    control
                        .snapshots
                        .prepare_here(&participants, snapshot, left)
                        .await
                }
            };
            if let Err(e) = store
                .answer_prepare(&id, &node_id, answer.as_deref().map_err(String::as_str))
                .await
            {
                tracing::warn!(snapshot = %id, error = %e, "cannot answer a snapshot prepare request");
            }
        }
    }
}

/// Keeps a duty's lease for this node (see [`keep_lease`]).
pub fn lease(
    store: &EventStore,
    args: &ClusterArgs,
    name: &str,
    node_id: &str,
    stop: watch::Receiver<bool>,
) -> (HeldLease, tokio::task::JoinHandle<()>) {
    keep_lease(store.clone(), args.lease(name, node_id), stop)
}

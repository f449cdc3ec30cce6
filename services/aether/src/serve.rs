//! `aether serve`: opens the ledger, starts the checkpointer and the HTTP API, and on
//! SIGINT / SIGTERM stops taking requests, drains the writer and signs a last checkpoint.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use aether_ledger::checkpoint::CheckpointSigner;
use aether_ledger::checkpointer::{CHECKPOINTER_LEASE, run_checkpointer_rotating};
use aether_ledger::{CheckpointPolicy, EventStore, MerkleLog, StoreConfig};
use anyhow::{Context, bail};
use clap::Args;
use metrics_exporter_prometheus::PrometheusBuilder;

use crate::LedgerArgs;
use aether_api::auth::{TokenSource, Tokens};
use aether_api::{AppState, router};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub ledger: LedgerArgs,
    /// HTTP listen address.
    #[arg(long, env = "AETHER_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Checkpoint signing key (PKCS#8 PEM). Default: created in `<data>/keys/`.
    #[arg(long, env = "AETHER_CHECKPOINT_KEY")]
    pub checkpoint_key: Option<std::path::PathBuf>,
    /// The key the ledger's checkpoints are signed with until now (PKCS#8 PEM), to rotate
    /// from: the node holding the checkpointer lease records a `CheckpointKeyRotated`
    /// signed by both and signs with `--checkpoint-key` from then on. Give it to every
    /// node during a rotation; it does nothing once the ledger's key is the new one.
    #[arg(long, env = "AETHER_PREVIOUS_CHECKPOINT_KEY")]
    pub previous_checkpoint_key: Option<std::path::PathBuf>,
    /// Sign a checkpoint after this many new events.
    #[arg(long, env = "AETHER_CHECKPOINT_EVERY_EVENTS", default_value_t = 1000)]
    pub checkpoint_every_events: u64,
    /// Sign a checkpoint at least this often (seconds) while events arrive.
    #[arg(long, env = "AETHER_CHECKPOINT_EVERY_SECS", default_value_t = 10)]
    pub checkpoint_every_secs: u64,
    /// Most events per group-commit transaction.
    #[arg(long, env = "AETHER_MAX_BATCH", default_value_t = 500)]
    pub max_batch: usize,
    /// Longest the writer waits to fill a batch, in microseconds.
    #[arg(long, env = "AETHER_MAX_WAIT_US", default_value_t = 1000)]
    pub max_wait_us: u64,
    /// Also append every OpenLineage record to this JSON-lines file (one RunEvent per
    /// line, synced to disk before the relay moves on). Off unless named: the records are
    /// always stored in the database and served at `/api/v1`, and the file grows by ~2 KB
    /// per event without bound.
    #[arg(long, env = "AETHER_OPENLINEAGE_FILE")]
    pub openlineage_file: Option<std::path::PathBuf>,
    /// Where the lineage Delta tables (`events`, `clearing_decisions`) are: a directory, or
    /// `s3://bucket/prefix` on an S3-compatible store, set up by the usual `AWS_*`
    /// variables (`AWS_ENDPOINT`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
    /// `AWS_SECRET_ACCESS_KEY`, `AWS_ALLOW_HTTP`). Every node of a cluster names the same
    /// location. Default: `<data>/delta`.
    #[arg(long, env = "AETHER_DELTA_URI")]
    pub delta_uri: Option<String>,
    /// A streaming replica of the PostgreSQL ledger for regulators' reads (audit event
    /// queries and evidence exports). An answer with proofs reads from it only once it has
    /// replayed past the proof's tree size, else from the primary.
    #[arg(long, env = "AETHER_READ_DATABASE_URL", hide_env_values = true)]
    pub read_database_url: Option<String>,
    /// The operators' incoming webhook: drift review tickets (opened, overdue) and drift
    /// escalations are POSTed there, `{text, aether}` (Slack, Mattermost, Rocket.Chat and
    /// Teams show `text`), signed `X-Aether-Signature: hmac-sm3=<hex>` over the body and
    /// retried with doubling waits; each outcome is a `HandoffDelivered` or
    /// `HandoffFailed` event. Needs `--review-webhook-secret-file`.
    #[arg(long, env = "AETHER_REVIEW_WEBHOOK")]
    pub review_webhook: Option<String>,
    /// The HMAC-SM3 key of the webhook's signatures (the file's content, at least 16 bytes).
    #[arg(long, env = "AETHER_REVIEW_WEBHOOK_SECRET_FILE")]
    pub review_webhook_secret_file: Option<std::path::PathBuf>,
    /// Run for each `RetrainRequested` (through `sh -c`), with the request in the
    /// environment: `AETHER_RETRAIN_REQUEST` (event id), `_ROLLOUT`, `_CANDIDATE`, `_FROM`,
    /// `_TO` (the data range, RFC 3339) and `_FEATURES` (comma-separated); recorded as
    /// `RetrainStarted` and `RetrainFinished` or `RetrainFailed` (the OpenLineage job
    /// `model.retrain`, a child of the request's run). It should start the pipeline and
    /// return: it is killed after `--retrain-timeout-secs`.
    #[arg(long, env = "AETHER_RETRAIN_COMMAND")]
    pub retrain_command: Option<String>,
    #[arg(long, env = "AETHER_RETRAIN_TIMEOUT_SECS", default_value_t = 600)]
    pub retrain_timeout_secs: u64,
    /// How much lower in CPU priority the lineage relays and the Merkle log follower run
    /// than the answers (added to their threads' nice value, as `nice -n`; 0 = the same).
    /// On a busy machine they yield the cores to the decisions being answered and catch
    /// up when the load eases.
    #[arg(long, env = "AETHER_BACKGROUND_NICE", default_value_t = 10,
          value_parser = clap::value_parser!(i32).range(0..=19))]
    pub background_nice: i32,
    #[command(flatten)]
    pub clearing: crate::clearing::ClearingArgs,
    #[command(flatten)]
    pub cluster: crate::cluster::ClusterArgs,
    /// Most HTTP connections open at once (lowered to fit the open-files limit, with a
    /// warning); a connection past it is closed at once.
    #[arg(long, env = "AETHER_MAX_HTTP_CONNECTIONS", default_value_t = 1024)]
    pub max_http_connections: usize,
    /// Longest an HTTP connection may take to send a request's headers, idle time between
    /// requests included (milliseconds); then it is closed.
    #[arg(long, env = "AETHER_HTTP_HEADER_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub http_header_timeout_ms: u64,
    /// Directories local model artifacts may be registered from (repeat, or `:`-separated
    /// in the environment). Default: `<data>/model`. A registration naming a file
    /// elsewhere, or not a regular file, is refused.
    #[arg(long = "model-dir", env = "AETHER_MODEL_DIRS", value_delimiter = ':')]
    pub model_dirs: Vec<std::path::PathBuf>,
    /// Largest model artifact read, in bytes.
    #[arg(long, env = "AETHER_MAX_MODEL_BYTES",
          default_value_t = aether_control::models::ArtifactPolicy::DEFAULT_MAX_BYTES)]
    pub max_model_bytes: u64,
    #[command(flatten)]
    pub audit: AuditArgs,
}

/// Settings of the audit API.
#[derive(clap::Args, Debug, Clone)]
pub struct AuditArgs {
    /// Personal field paths revealed to regulators in audit answers: `*` (every value still
    /// held), `none`, or a list such as `trade.buyer,trade.seller`. Erased fields are never
    /// revealed (audit/REDACTION.md).
    #[arg(long, env = "AETHER_AUDIT_REVEAL", default_value = "*")]
    pub audit_reveal: aether_audit::redaction::RedactionPolicy,
}

/// Every file the service creates is readable by its own user only (0600, directories
/// 0700): the ledger, its WAL, the Merkle file, the Delta tables and the OpenLineage records
/// hold personal data and the trail regulators rely on. SQLite, delta-rs and the rest create
/// their files with the process's umask, so it is set once here, before any of them runs.
fn keep_files_private() {
    // SAFETY: umask only swaps the process's file-creation mask; it cannot fail.
    unsafe {
        libc::umask(0o077);
    }
}

/// Gives the data directory mode 0700, so that files an older version created with wider
/// modes inside it are out of other users' reach too.
fn make_private(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).with_context(
            || {
                format!(
                    "cannot make data directory {} private (0700)",
                    dir.display()
                )
            },
        )?;
        tracing::warn!(dir = %dir.display(), was = %format!("{:o}", mode & 0o777), "data directory was readable by others; now 0700");
    }
    Ok(())
}

/// Before anything is written (no checkpoint signed, no relay started): the ledger's head
/// must not be behind what this node already saw of it: the Merkle log file's event hashes,
/// the Delta `events` table's last seq, and every subscriber's stored position (the
/// OpenLineage and Delta relays'). A ledger whose newest events were deleted would
/// otherwise be extended over the gap, re-using those seqs, and signed as if nothing happened.
async fn refuse_a_ledger_behind_its_witnesses(
    store: &EventStore,
    data_dir: &std::path::Path,
    delta_events: &str,
) -> anyhow::Result<()> {
    let merkle_file = data_dir.join("merkle").join("event-hashes");
    let mut witnesses = vec![(
        format!("the Merkle log file {}", merkle_file.display()),
        MerkleLog::recorded_events(&merkle_file)
            .with_context(|| format!("cannot open the Merkle log at {}", merkle_file.display()))?,
    )];
    let options = aether_lineage::delta::StorageOptions::new();
    if let Some(last_seq) = aether_lineage::delta::events_table_last_seq(delta_events, &options)
        .await
        .with_context(|| format!("cannot open the Delta table {delta_events}"))?
    {
        witnesses.push((format!("the Delta table {delta_events}"), last_seq));
    }
    store
        .ensure_not_behind(witnesses)
        .await
        .context("refusing to start")?;
    Ok(())
}

/// The drift hand-offs as configured; a webhook without its secret is refused.
fn handoff_config(args: &ServeArgs) -> anyhow::Result<crate::handoffs::HandoffConfig> {
    let webhook = match (&args.review_webhook, &args.review_webhook_secret_file) {
        (Some(url), Some(secret)) => Some(crate::handoffs::Webhook::new(url, secret)?),
        (Some(_), None) => bail!(
            "--review-webhook needs --review-webhook-secret-file: deliveries are signed (HMAC-SM3)"
        ),
        (None, Some(_)) => bail!("--review-webhook-secret-file without --review-webhook"),
        (None, None) => None,
    };
    if args.retrain_timeout_secs == 0 {
        bail!("--retrain-timeout-secs must be at least 1");
    }
    Ok(crate::handoffs::HandoffConfig {
        webhook,
        retrain_command: args
            .retrain_command
            .clone()
            .filter(|c| !c.trim().is_empty()),
        retrain_timeout: std::time::Duration::from_secs(args.retrain_timeout_secs),
    })
}

/// Connections of the background runtime's pool: one each for the two relays, the
/// HTTP transport and the Merkle log follower.
const BACKGROUND_CONNECTIONS: u32 = 4;

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    // First: a SIGTERM during the start is then answered by an orderly stop.
    let shutdown = shutdown_signal();
    // Held to the end: its drop exports the last spans.
    let _telemetry = crate::init_logging()?;
    crate::clearing::check_worker_device(&args.clearing)?;
    let handoffs = handoff_config(&args)?;
    keep_files_private();
    std::fs::create_dir_all(&args.ledger.data_dir).with_context(|| {
        format!(
            "cannot create data directory {}",
            args.ledger.data_dir.display()
        )
    })?;
    make_private(&args.ledger.data_dir)?;
    // Held until `run` returns; the kernel releases it when the process dies, however.
    let _data_dir_lock = lock_data_dir(&args.ledger.data_dir)?;
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .context("cannot install the metrics recorder")?;

    let config = StoreConfig {
        max_batch: args.max_batch,
        max_wait: Duration::from_micros(args.max_wait_us),
        ..StoreConfig::default()
    };
    let store = EventStore::connect(&args.ledger.url(), config)
        .await
        .with_context(|| format!("cannot open the ledger at {}", args.ledger.describe()))?;
    let delta_root =
        crate::cluster::delta_location(args.delta_uri.as_deref(), &args.ledger.data_dir)?;
    let delta_events = format!("{delta_root}/events");
    refuse_a_ledger_behind_its_witnesses(&store, &args.ledger.data_dir, &delta_events).await?;
    let reads = match &args.read_database_url {
        Some(url) if store.postgres_pool().is_some() => {
            let reads = EventStore::connect_replica(url, StoreConfig::default())
                .await
                .with_context(|| {
                    format!(
                        "cannot open the read replica {}",
                        aether_ledger::redact_url(url)
                    )
                })?;
            tracing::info!(replica = %aether_ledger::redact_url(url), "regulators' reads go to the replica");
            reads
        }
        Some(_) => anyhow::bail!("--read-database-url needs a PostgreSQL ledger (DATABASE_URL)"),
        None => store.clone(),
    };

    let signer = match &args.checkpoint_key {
        Some(path) => CheckpointSigner::from_pem_file(path)?,
        None => {
            let keys = args.ledger.data_dir.join("keys");
            let (signer, created) = CheckpointSigner::load_or_create(&keys)?;
            if created {
                tracing::info!(dir = %keys.display(), "created the SM2 checkpoint key pair");
            }
            signer
        }
    };
    let public_key = signer.public_key_hex();
    let previous_signer = args
        .previous_checkpoint_key
        .as_deref()
        .map(CheckpointSigner::from_pem_file)
        .transpose()?;
    let node_id = args.cluster.node_id(&args.ledger.data_dir);
    crate::cluster::check_node_id(&node_id)?;
    crate::cluster::claim_checkpoint_key(
        &store,
        &public_key,
        previous_signer
            .as_ref()
            .map(CheckpointSigner::public_key_hex)
            .as_deref(),
    )
    .await?;
    crate::cluster::claim_delta_location(&store, &delta_root).await?;
    let (tokens, source) = Tokens::load(&args.ledger.data_dir)?;
    match &source {
        TokenSource::Environment => tracing::info!("API tokens from AETHER_TOKENS"),
        TokenSource::File(p) => tracing::info!(file = %p.display(), "API tokens from file"),
        TokenSource::Created(p) => {
            tracing::info!(file = %p.display(), "created API tokens (operator, regulator, worker)")
        }
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let policy = CheckpointPolicy {
        every_events: args.checkpoint_every_events.max(1),
        every: Duration::from_secs(args.checkpoint_every_secs.max(1)),
    };
    // The cluster's duties run under leases (on SQLite: simply held). Their own stop comes
    // after the duties' last writes, so that the final checkpoint is signed under the lease.
    let (lease_stop_tx, lease_stop_rx) = tokio::sync::watch::channel(false);
    let (checkpointer_lease, checkpointer_lease_task) = crate::cluster::lease(
        &store,
        &args.cluster,
        CHECKPOINTER_LEASE,
        &node_id,
        lease_stop_rx.clone(),
    );
    // A node whose key the cluster rotated away from stops (in order) rather than hold the
    // checkpointer lease without signing.
    let (retired_tx, mut retired_rx) = tokio::sync::watch::channel(None::<String>);
    let checkpointer = tokio::spawn({
        let (store, stop) = (store.clone(), stop_rx.clone());
        async move {
            let result = run_checkpointer_rotating(
                store,
                signer,
                previous_signer,
                policy,
                checkpointer_lease,
                stop,
            )
            .await;
            if let Err(e @ aether_ledger::LedgerError::CheckpointKeyRetired { .. }) = &result {
                tracing::error!(error = %e, "stopping: this node's checkpoint key was retired");
                let _ = retired_tx.send(Some(e.to_string()));
            }
            result
        }
    });
    let upkeep = {
        let handle = metrics.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                handle.run_upkeep();
            }
        })
    };

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let local = listener.local_addr()?;
    // Lineage: OpenLineage records for every event, in the database and, when asked for,
    // a JSON-lines file.
    if let Some(dir) = args
        .openlineage_file
        .as_deref()
        .and_then(std::path::Path::parent)
        .filter(|d| !d.as_os_str().is_empty())
    {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    // An OpenLineage backend at OPENLINEAGE_URL, when set: the stored records, from the
    // transport's own cursor, so a slow or absent endpoint delays only this relay.
    let http_lineage = aether_lineage::http_transport::HttpTransportConfig::from_env()
        .context("invalid OpenLineage HTTP transport configuration")?;
    tracing::info!(
        http = %format!("http://{local}"),
        ledger = %args.ledger.describe(),
        checkpoint_key = %public_key,
        "aether serving"
    );
    // A line on stdout that scripts and tests can wait for.
    println!("aether listening on http://{local}");

    // The event hashes live in a file beside the Delta tables; memory keeps ~0.5 byte an
    // event of the tree instead of 64.
    let merkle_file = args.ledger.data_dir.join("merkle").join("event-hashes");
    let merkle = MerkleLog::open(&merkle_file, &store)
        .await
        .with_context(|| format!("cannot open the Merkle log at {}", merkle_file.display()))?;
    tracing::info!(
        events = merkle.len(),
        file = %merkle_file.display(),
        "Merkle log loaded"
    );
    let control = aether_control::ControlState::replay(&store).await?;
    let model_dirs = if args.model_dirs.is_empty() {
        vec![args.ledger.data_dir.join("model")]
    } else {
        args.model_dirs.clone()
    };
    control
        .models
        .set_artifact_policy(aether_control::models::ArtifactPolicy {
            dirs: model_dirs,
            max_bytes: args.max_model_bytes,
        });
    tracing::info!(
        policies = control.policies.policies().len(),
        engines = control.engines.engines().len(),
        "control plane rebuilt from the ledger"
    );
    // Policies and models recorded through other nodes of the cluster, applied here too.
    let control_follower = tokio::spawn(
        control
            .clone()
            .follow(Duration::from_millis(200), stop_rx.clone()),
    );
    // An activation another live node runs is its own, not one this node's restart cut.
    control.engines.set_node(&node_id);
    // A snapshot taken here prepares on the other live nodes too; this node answers theirs.
    control.snapshots.set_node(&node_id);
    let prepares = tokio::spawn(crate::cluster::answer_snapshot_prepares(
        store.clone(),
        control.clone(),
        node_id.clone(),
        stop_rx.clone(),
    ));
    let running_elsewhere = crate::cluster::live_others(&store, &node_id).await?;
    let interrupted = control
        .engines
        .fail_interrupted(control.snapshots.in_force(), &running_elsewhere)
        .await?;
    if interrupted > 0 {
        tracing::warn!(
            interrupted,
            "closed engine activations interrupted by a restart"
        );
    }
    // Automated rollouts: the gateway reports each routed request, the supervisor runs a
    // controller per rollout.
    let (observations, observed) = crate::rollout_supervisor::channel();
    let (rollout_lease, rollout_lease_task) = crate::cluster::lease(
        &store,
        &args.cluster,
        crate::rollout_supervisor::ROLLOUT_LEASE,
        &node_id,
        lease_stop_rx.clone(),
    );
    let supervisor = tokio::spawn(crate::rollout_supervisor::run(
        store.clone(),
        control.clone(),
        observed,
        rollout_lease,
        node_id.clone(),
        stop_rx.clone(),
    ));
    let (grpc_stop_tx, grpc_stop_rx) = tokio::sync::watch::channel(false);
    let grpc = if args.clearing.no_grpc {
        None
    } else {
        let (addr, task) = crate::clearing::start(
            &args.clearing,
            &args.ledger.data_dir,
            store.clone(),
            control.clone(),
            grpc_stop_rx,
            Some(observations),
        )
        .await?;
        tracing::info!(grpc = %addr, "clearing gateway serving (mTLS)");
        println!("aether clearing on https://{addr}");
        Some((addr, task))
    };
    let heartbeat = crate::cluster::heartbeat(
        store.clone(),
        control.clone(),
        node_id.clone(),
        format!("http://{local}"),
        grpc.as_ref()
            .map(|(addr, _)| format!("https://{addr}"))
            .unwrap_or_default(),
        lease_stop_rx,
    );
    let grpc = grpc.map(|(_, task)| task);
    tracing::info!(node_id = %node_id, "cluster node");
    let schema_base = format!("http://{local}");
    // Lineage and the Merkle log follow the ledger on a lower-priority runtime, over
    // connections of their own (a connection belongs to the runtime that opened it).
    // Started once nothing else can fail: a Delta commit cut off by an early return
    // would take the runtime down mid-operation.
    let background = crate::background::start(args.background_nice)?;
    let background_store = store.with_own_pool(BACKGROUND_CONNECTIONS);
    let follower = background.handle().spawn(
        merkle
            .clone()
            .follow(background_store.clone(), stop_rx.clone()),
    );
    // The relays stop last, after they have caught up with the final checkpoint. Each runs
    // on one node of the cluster at a time, under its lease; their leases are given up only
    // once they have stopped.
    let (relay_stop_tx, relay_stop_rx) = tokio::sync::watch::channel(false);
    let (relay_lease_stop_tx, relay_lease_stop_rx) = tokio::sync::watch::channel(false);
    let mut relay_leases = Vec::new();
    let mut relay_lease = |name: &str| {
        let (held, task) = crate::cluster::lease(
            &store,
            &args.cluster,
            name,
            &node_id,
            relay_lease_stop_rx.clone(),
        );
        relay_leases.push((held.clone(), task));
        held
    };
    let handoff_lease = (!handoffs.is_empty()).then(|| relay_lease(crate::cluster::HANDOFF_LEASE));
    let openlineage_lease = relay_lease(crate::cluster::OPENLINEAGE_LEASE);
    let delta_lease = relay_lease(crate::cluster::DELTA_LEASE);
    let http_lease = http_lineage
        .as_ref()
        .map(|_| relay_lease(crate::cluster::OPENLINEAGE_HTTP_LEASE));
    let relay = {
        let store = background_store.clone();
        let context = aether_lineage::MappingContext::new(&schema_base);
        let file = args.openlineage_file.clone();
        background.handle().spawn(crate::cluster::while_held(
            "openlineage relay",
            openlineage_lease,
            relay_stop_rx.clone(),
            move |stop| {
                aether_lineage::relay::run_openlineage_relay(
                    store.clone(),
                    context.clone(),
                    file.clone(),
                    stop,
                )
            },
        ))
    };
    let http_relay = http_lineage.zip(http_lease).map(|(config, lease)| {
        let store = background_store.clone();
        background.handle().spawn(crate::cluster::while_held(
            "openlineage http relay",
            lease,
            relay_stop_rx.clone(),
            move |stop| {
                aether_lineage::http_transport::run_http_relay(store.clone(), config.clone(), stop)
            },
        ))
    });
    let handoff_task = handoff_lease.map(|lease| {
        let store = background_store.clone();
        background.handle().spawn(crate::cluster::while_held(
            "drift hand-offs",
            lease,
            relay_stop_rx.clone(),
            move |stop| crate::handoffs::run(store.clone(), handoffs.clone(), stop),
        ))
    });
    // Delta Lake: every event as a row of the `events` table, many events per commit.
    let delta_relay = {
        let store = background_store.clone();
        let config = aether_lineage::delta_relay::DeltaRelayConfig::new(&delta_events);
        background.handle().spawn(crate::cluster::while_held(
            "delta relay",
            delta_lease,
            relay_stop_rx,
            move |stop| {
                aether_lineage::delta_relay::run_delta_relay(store.clone(), config.clone(), stop)
            },
        ))
    };
    let state = AppState {
        store: store.clone(),
        tokens: Arc::new(tokens),
        metrics,
        merkle,
        control,
        node_id: node_id.clone().into(),
        sessions: Default::default(),
        reads,
    };
    let app = router(state)
        .layer(axum::Extension(Arc::new(args.audit.audit_reveal)))
        .layer(axum::Extension(aether_api::CheckpointCadence {
            every_events: args.checkpoint_every_events.max(1),
            every_secs: args.checkpoint_every_secs.max(1),
        }));
    // A failure of the HTTP server still stops everything in order below.
    let limits = crate::http_server::HttpLimits {
        header_timeout: Duration::from_millis(args.http_header_timeout_ms),
        max_connections: crate::http_server::connection_cap(args.max_http_connections),
    };
    let shutdown = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = retired_rx.wait_for(Option::is_some) => {}
        }
    };
    let served = crate::http_server::serve(listener, app, limits, shutdown)
        .await
        .context("HTTP server failed");

    let _ = grpc_stop_tx.send(true);
    if let Some(task) = grpc {
        // Members' streams get a few seconds to finish; then they are cut.
        let abort = task.abort_handle();
        if tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
    tracing::info!("shutting down: signing a last checkpoint and draining the ledger writer");
    let _ = stop_tx.send(true);
    let _ = supervisor.await;
    let _ = control_follower.await;
    let _ = prepares.await;
    let mut retired = None;
    match checkpointer.await {
        Ok(Err(e @ aether_ledger::LedgerError::CheckpointKeyRetired { .. })) => retired = Some(e),
        Ok(Err(e)) => tracing::error!(error = %e, "checkpointer failed"),
        Err(e) => tracing::error!(error = %e, "checkpointer task failed"),
        Ok(Ok(())) => {}
    }
    // The duties' last writes are done: give the leases up so another node takes over now.
    let _ = lease_stop_tx.send(true);
    let _ = checkpointer_lease_task.await;
    let _ = rollout_lease_task.await;
    let _ = heartbeat.await;
    follower.abort();
    // Only the relays this node runs are waited for (another node's resume from the
    // cursors it shares).
    let held = |name: &str| {
        relay_leases
            .iter()
            .any(|(lease, _)| lease.name() == name && lease.token().is_some())
    };
    let mut draining = Vec::new();
    if held(crate::cluster::OPENLINEAGE_LEASE) {
        draining.push(aether_lineage::relay::OPENLINEAGE_CURSOR);
    }
    if held(crate::cluster::DELTA_LEASE) {
        draining.push(aether_lineage::delta_relay::DELTA_CURSOR);
    }
    if held(crate::cluster::OPENLINEAGE_HTTP_LEASE) {
        draining.push(aether_lineage::http_transport::HTTP_CURSOR);
    }
    drain_relay(&store, &draining).await;
    let _ = relay_stop_tx.send(true);
    let mut relays = vec![("openlineage", relay), ("delta", delta_relay)];
    relays.extend(http_relay.map(|task| ("openlineage-http", task)));
    if let Some(task) = handoff_task {
        match task.await {
            Ok(Err(e)) => tracing::error!(error = %e, "the drift hand-offs failed"),
            Err(e) => tracing::error!(error = %e, "the drift hand-offs task failed"),
            Ok(Ok(())) => {}
        }
    }
    for (sink, task) in relays {
        match task.await {
            Ok(Err(e)) => tracing::error!(sink, error = %e, "lineage relay failed"),
            Err(e) => tracing::error!(sink, error = %e, "lineage relay task failed"),
            Ok(Ok(())) => {}
        }
    }
    let _ = relay_lease_stop_tx.send(true);
    for (_, task) in relay_leases {
        let _ = task.await;
    }
    store.shutdown().await;
    upkeep.abort();
    tracing::info!("stopped");
    if let Some(e) = retired {
        return Err(e).context("this node stopped");
    }
    served
}

/// Resolves at SIGINT or SIGTERM. The handlers are installed when this is called, not when
/// the future is first polled, so a signal that arrives while the service is still starting
/// is not lost to the default action (an abrupt exit) but stops it in order once it serves.
pub(crate) fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    async move {
        let ctrl_c = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        #[cfg(unix)]
        let term = async move {
            match term {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let term = std::future::pending::<()>();
        tokio::select! {
            _ = ctrl_c => {},
            _ = term => {},
        }
    }
}

/// Gives the lineage relays up to 10 s to reach the ledger's head before they are stopped
/// (they resume from their cursors on the next start either way): those at `cursors`, the
/// ones this node runs.
async fn drain_relay(store: &EventStore, cursors: &[&str]) {
    if cursors.is_empty() {
        return;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        let head = store.head().await.ok().flatten().map_or(0, |(s, _)| s);
        let mut done = u64::MAX;
        for &cursor in cursors {
            let at = store
                .load_position(cursor)
                .await
                .ok()
                .flatten()
                .unwrap_or(0);
            done = done.min(at);
        }
        if done >= head {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tracing::warn!("lineage relay still behind at shutdown; it resumes on the next start");
}

/// Takes the data directory for this process alone: its files (the Merkle log, the Delta
/// tables, the lineage cursors' files, keys created on first start) each assume one writer.
/// The lock file holds the owner's pid, for the message a second `serve` gets.
fn lock_data_dir(dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let path = dir.join("serve.lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut owner = String::new();
            let _ = file.read_to_string(&mut owner);
            anyhow::bail!(
                "the data directory {} is in use by another `aether serve` (pid {}): stop it, \
                 or give this one its own --data-dir",
                dir.display(),
                owner.trim()
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", path.display()));
        }
    }
    file.set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| write!(file, "{}", std::process::id()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(file)
}

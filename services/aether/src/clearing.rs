//! Clearing over gRPC in `aether serve`, and the `certs` and `client` commands.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aether_control::ControlState;
use aether_control::rollout_controller::ObservationSender;
use aether_gateway::certs::{DevPkiSpec, InitOutcome, KeyAlgorithm, PkiLayout, init_dev_pki};
use aether_gateway::clearing::{ClearingGateway, GatewayConfig};
use aether_gateway::client::ClearingClient;
use aether_gateway::envelope::{
    EnvelopeKey, RequestKeys, RequestKeysPolicy, SessionKeys, SessionPolicy,
};
use aether_gateway::identity::Role;
use aether_gateway::pb::v1::clearing_service_server::ClearingServiceServer;
use aether_gateway::pb::v1::worker_service_server::WorkerServiceServer;
use aether_gateway::pb::v1::{ClearingRequest, Trade};
use aether_gateway::risk_book::RiskSettings;
use aether_gateway::service::ClearingServer;
use aether_gateway::tls::{ClientTls, ServerIdentities, ServerTls, TlsPaths, TlsSuite};
use aether_gateway::workers::{WorkerPool, WorkerServer};
use aether_gpu_worker::DeviceChoice;
use aether_gpu_worker::model::device_name;
use aether_ledger::EventStore;
use anyhow::Context;
use clap::Args;

/// Members and workers the development PKI issues certificates for on first start.
pub const DEV_MEMBERS: [&str; 2] = ["bank-a", "bank-b"];
pub const DEV_WORKERS: [&str; 1] = ["worker-1"];

#[derive(Args, Debug, Clone)]
pub struct ClearingArgs {
    /// gRPC (mTLS) listen address of the clearing gateway.
    #[arg(long, env = "AETHER_GRPC_LISTEN", default_value = "127.0.0.1:50051")]
    pub grpc_listen: SocketAddr,
    /// Do not start the clearing gateway.
    #[arg(long)]
    pub no_grpc: bool,
    /// CA, certificate and key (PEM) of the gRPC server; default: the development PKI in
    /// `<data>/certs`, created on first start.
    #[arg(long, env = "AETHER_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    #[arg(long, env = "AETHER_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "AETHER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The TLS 1.3 suites the gRPC port offers: `standard` (AES-GCM, ChaCha20; ECDSA/RSA
    /// certificates), `gm` (RFC 8998: TLS_SM4_GCM_SM3, curveSM2, SM2 certificates) or
    /// `both` (each client gets what its hello asks for).
    #[arg(long, env = "AETHER_TLS_SUITE", default_value = "standard", value_parser = parse_tls_suite)]
    pub tls_suite: TlsSuite,
    /// CA, certificate and key (PEM) of the SM2 identity for `--tls-suite gm|both`;
    /// default: the development SM2 PKI in `<data>/certs/sm2`, created on first start.
    #[arg(long, env = "AETHER_TLS_SM2_CA", requires_all = ["tls_sm2_cert", "tls_sm2_key"])]
    pub tls_sm2_ca: Option<PathBuf>,
    #[arg(long, env = "AETHER_TLS_SM2_CERT")]
    pub tls_sm2_cert: Option<PathBuf>,
    #[arg(long, env = "AETHER_TLS_SM2_KEY")]
    pub tls_sm2_key: Option<PathBuf>,
    /// The gateway's SM2 envelope key (PKCS#8 PEM); default: `<data>/keys/envelope.pem`.
    #[arg(long, env = "AETHER_ENVELOPE_KEY")]
    pub envelope_key: Option<PathBuf>,
    /// The engine region this gateway clears for (default: the only active engine).
    #[arg(long, env = "AETHER_CLEARING_REGION")]
    pub clearing_region: Option<String>,
    /// Most trades per scoring batch.
    #[arg(long, env = "AETHER_BATCH_MAX", default_value_t = 500)]
    pub batch_max: usize,
    /// Longest a trade waits for its batch to fill, in microseconds.
    #[arg(long, env = "AETHER_BATCH_DELAY_US", default_value_t = 2000)]
    pub batch_delay_us: u64,
    /// Trades waiting for a worker before new ones are refused (RESOURCE_EXHAUSTED).
    #[arg(long, env = "AETHER_QUEUE_CAPACITY", default_value_t = 10_000)]
    pub queue_capacity: usize,
    /// Batches scored at once, in process or on remote workers (0: one per core).
    #[arg(long, env = "AETHER_WORKERS", default_value_t = 0)]
    pub workers: usize,
    /// Score only on remote workers (`aether worker`), never in this process.
    #[arg(long, env = "AETHER_NO_LOCAL_WORKERS")]
    pub no_local_workers: bool,
    /// Where this process's workers score: `cpu`, `cuda`, `cuda:N` or `auto` (GPU 0 if one
    /// answers, else the CPU). A GPU needs a build with `--features cuda`.
    #[arg(long, env = "AETHER_WORKER_DEVICE", default_value = "cpu")]
    pub worker_device: DeviceChoice,
    /// Anomaly score at or above which a trade is held for review.
    #[arg(long, env = "AETHER_HOLD_SCORE", default_value_t = 0.8)]
    pub hold_score: f64,
    /// Percent of cleared trades explained too (held and rejected ones always are): a
    /// stable sample by request id, 0 to 100.
    #[arg(long, env = "AETHER_EXPLAIN_CLEARED_PERCENT", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub explain_cleared_percent: u32,
    /// Explain no decision (held and rejected ones then say that explanations are off):
    /// for measuring what explanations cost.
    #[arg(long, env = "AETHER_NO_EXPLANATIONS")]
    pub no_explanations: bool,
    /// The gateway stage's latency budget, ms (envelope open, validation, answer sealing);
    /// each stage's time is a histogram and each time over budget a count in `/metrics`.
    #[arg(long, env = "AETHER_BUDGET_GATEWAY_MS", default_value_t = 30)]
    pub budget_gateway_ms: u64,
    /// The orchestration stage's budget, ms (routing, rules, RAG citations).
    #[arg(long, env = "AETHER_BUDGET_ORCHESTRATION_MS", default_value_t = 50)]
    pub budget_orchestration_ms: u64,
    /// The batch subsystem's budget, ms (queue wait and scoring, a fallback included).
    #[arg(long, env = "AETHER_BUDGET_BATCH_MS", default_value_t = 100)]
    pub budget_batch_ms: u64,
    /// The ledger commit's budget, ms (the asynchronous trigger of every lineage record).
    #[arg(long, env = "AETHER_BUDGET_COMMIT_MS", default_value_t = 20)]
    pub budget_commit_ms: u64,
    /// The scoring breaker: remote workers' batch p99 above this (ms) over the window
    /// sends batches to the in-process path until probes find the workers fast again.
    #[arg(long, env = "AETHER_BREAKER_P99_MS", default_value_t = 85)]
    pub breaker_p99_ms: u64,
    /// The breaker's window, in seconds.
    #[arg(long, env = "AETHER_BREAKER_WINDOW_SECS", default_value_t = 10)]
    pub breaker_window_secs: u64,
    /// Remote batches the window must hold before the breaker may open.
    #[arg(long, env = "AETHER_BREAKER_MIN_BATCHES", default_value_t = 20)]
    pub breaker_min_batches: usize,
    /// How long the open breaker waits before probing the workers again, ms.
    #[arg(long, env = "AETHER_BREAKER_PROBE_AFTER_MS", default_value_t = 1000)]
    pub breaker_probe_after_ms: u64,
    /// JSON file with the rules' risk settings: `{reporting_threshold_minor,
    /// high_risk_jurisdictions, limits}`.
    #[arg(long, env = "AETHER_RISK_SETTINGS")]
    pub risk_settings: Option<PathBuf>,
}

/// Opens the device in-process workers are to score on, before anything starts: a GPU
/// asked for and missing is a deployment error, refused, never a reason to score on the
/// CPU instead (`auto` is the way to ask for either).
pub fn check_worker_device(args: &ClearingArgs) -> anyhow::Result<()> {
    if args.no_grpc || args.no_local_workers {
        return Ok(());
    }
    let device = args
        .worker_device
        .open()
        .with_context(|| format!("--worker-device {}", args.worker_device))?;
    tracing::info!(device = %device_name(&device), "in-process workers score on this device");
    Ok(())
}

/// Where the envelope key lives by default, and its public half for clients.
pub fn envelope_paths(data_dir: &Path) -> (PathBuf, PathBuf) {
    let keys = data_dir.join("keys");
    (keys.join("envelope.pem"), keys.join("envelope.pub.pem"))
}

/// Starts the clearing gateway; returns its address and the server task. Rollout traffic
/// is reported to `observations` (the rollout supervisor's channel) when given.
pub async fn start(
    args: &ClearingArgs,
    data_dir: &Path,
    store: EventStore,
    control: ControlState,
    mut stop: tokio::sync::watch::Receiver<bool>,
    observations: Option<ObservationSender>,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let given =
        |ca: &Option<PathBuf>, cert: &Option<PathBuf>, key: &Option<PathBuf>| match (ca, cert, key)
        {
            (Some(ca), Some(cert), Some(key)) => Some(TlsPaths {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        };
    let mut identities = ServerIdentities {
        standard: given(&args.tls_ca, &args.tls_cert, &args.tls_key),
        sm2: given(&args.tls_sm2_ca, &args.tls_sm2_cert, &args.tls_sm2_key),
    };
    for &algorithm in args.tls_suite.algorithms() {
        let slot = match algorithm {
            KeyAlgorithm::EcdsaP256 => &mut identities.standard,
            KeyAlgorithm::Sm2 => &mut identities.sm2,
        };
        if slot.is_none() {
            let report = init_dev_pki(data_dir, &dev_spec(false, algorithm))?;
            let layout = PkiLayout::of(data_dir, algorithm);
            if report.outcome != InitOutcome::Exists {
                tracing::info!(dir = %layout.certs_dir.display(), "created the development PKI");
            }
            *slot = Some(TlsPaths::server(&layout));
        }
    }
    let tls = ServerTls::load_suite(args.tls_suite, &identities)?;
    let (key_path, public_path) = envelope_paths(data_dir);
    let key_path = args.envelope_key.clone().unwrap_or(key_path);
    if let Some(dir) = key_path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let (envelope, created) = EnvelopeKey::load_or_create(&key_path)?;
    if created {
        tracing::info!(file = %key_path.display(), "created the SM2 envelope key");
    }
    std::fs::write(&public_path, envelope.public_key_pem()?)
        .with_context(|| format!("cannot write {}", public_path.display()))?;

    let risk = match &args.risk_settings {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            serde_json::from_str::<RiskSettings>(&text)
                .with_context(|| format!("{} is not valid risk settings", path.display()))?
        }
        None => RiskSettings::default(),
    };
    let mut config = GatewayConfig {
        region: args.clearing_region.clone(),
        hold_score: args.hold_score,
        risk,
        observations,
        explain_cleared_percent: args.explain_cleared_percent,
        explanations: !args.no_explanations,
        budgets: aether_gateway::budgets::StageBudgets {
            gateway: Duration::from_millis(args.budget_gateway_ms),
            orchestration: Duration::from_millis(args.budget_orchestration_ms),
            batch: Duration::from_millis(args.budget_batch_ms),
            commit: Duration::from_millis(args.budget_commit_ms),
        },
        ..GatewayConfig::default()
    };
    config.batcher.max_batch = args.batch_max.max(1);
    config.batcher.max_delay = Duration::from_micros(args.batch_delay_us);
    config.batcher.queue_capacity = args.queue_capacity.max(1);
    if args.workers > 0 {
        config.batcher.workers = args.workers;
    }
    config.batcher.local_workers = !args.no_local_workers;
    config.batcher.breaker = aether_gateway::breaker::BreakerConfig {
        threshold: Duration::from_millis(args.breaker_p99_ms),
        window: Duration::from_secs(args.breaker_window_secs.max(1)),
        min_batches: args.breaker_min_batches.max(1),
        probe_after: Duration::from_millis(args.breaker_probe_after_ms),
        ..aether_gateway::breaker::BreakerConfig::default()
    };
    config.device = args.worker_device;
    let pool = WorkerPool::default();
    let gateway = ClearingGateway::new(store, control, config, pool.clone());
    let server = ClearingServer::new(
        gateway,
        Arc::new(envelope),
        SessionKeys::new(SessionPolicy::default()),
        RequestKeys::new(RequestKeysPolicy::default()),
    );
    let housekeeping = server.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(30)).await;
            housekeeping.purge_expired();
        }
    });

    // Health reports every service this port serves; reflection (v1, and v1alpha for the
    // tools and libraries that still speak only it) advertises exactly those.
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<ClearingServiceServer<ClearingServer>>()
        .await;
    health_reporter
        .set_serving::<WorkerServiceServer<WorkerServer>>()
        .await;
    let reflection_builder = || {
        SERVED_SERVICES.iter().fold(
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(aether_gateway::pb::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(
                    tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
                )
                .include_reflection_service(false),
            |builder, name| builder.with_service_name(*name),
        )
    };
    let reflection = reflection_builder()
        .build_v1()
        .context("cannot build gRPC reflection")?;
    let reflection_v1alpha = reflection_builder()
        .build_v1alpha()
        .context("cannot build gRPC reflection (v1alpha)")?;
    let listener = tokio::net::TcpListener::bind(args.grpc_listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.grpc_listen))?;
    let local = listener.local_addr()?;
    let incoming = tls.incoming(listener);
    let task = tokio::spawn(async move {
        let result = tonic::transport::Server::builder()
            .add_service(health)
            .add_service(reflection)
            .add_service(reflection_v1alpha)
            .add_service(ClearingServiceServer::new(server))
            .add_service(WorkerServiceServer::new(WorkerServer::new(pool.clone())))
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop.changed().await;
                // Open work streams would hold the graceful shutdown forever.
                pool.close_all();
            })
            .await;
        if let Err(e) = result {
            tracing::error!(error = %e, "the clearing gateway stopped");
        }
    });
    Ok((local, task))
}

/// The services the clearing port serves, as reflection lists them and health reports them
/// (with the reflection services themselves); `aether.v1.SnapshotParticipant` is not one.
pub const SERVED_SERVICES: &[&str] = &[
    "aether.v1.ClearingService",
    "aether.v1.WorkerService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

fn dev_spec(force: bool, algorithm: KeyAlgorithm) -> DevPkiSpec {
    DevPkiSpec {
        members: DEV_MEMBERS.iter().map(|s| (*s).to_owned()).collect(),
        workers: DEV_WORKERS.iter().map(|s| (*s).to_owned()).collect(),
        server_names: Vec::new(),
        force,
        algorithm,
    }
}

/// `--tls-suite`'s values.
pub fn parse_tls_suite(s: &str) -> Result<TlsSuite, String> {
    s.parse()
}

/// `aether certs init`.
pub fn certs_init(
    data_dir: &Path,
    members: Vec<String>,
    workers: Vec<String>,
    force: bool,
    algorithm: KeyAlgorithm,
) -> anyhow::Result<()> {
    let mut spec = dev_spec(force, algorithm);
    spec.members.extend(members);
    spec.workers.extend(workers);
    spec.members.sort();
    spec.members.dedup();
    spec.workers.sort();
    spec.workers.dedup();
    let report = init_dev_pki(data_dir, &spec)?;
    let layout = PkiLayout::of(data_dir, algorithm);
    match report.outcome {
        InitOutcome::Exists => println!(
            "the development PKI in {} already has every certificate (use --force to replace it)",
            layout.certs_dir.display()
        ),
        _ => {
            println!(
                "wrote the development PKI in {}:",
                layout.certs_dir.display()
            );
            for path in &report.written {
                println!("  {}", path.display());
            }
        }
    }
    Ok(())
}

/// What `aether client submit` sends.
#[derive(Args, Debug)]
pub struct SubmitArgs {
    /// Data directory holding the development PKI and the gateway's public key.
    #[arg(long, env = "AETHER_DATA_DIR", default_value = "./aether-data")]
    pub data_dir: PathBuf,
    #[arg(long, default_value = "https://127.0.0.1:50051")]
    pub endpoint: String,
    /// The member to submit as (its certificate must be in `<data>/certs`).
    #[arg(long, default_value = "bank-a")]
    pub member: String,
    /// Idempotency key (default: a fresh UUID).
    #[arg(long)]
    pub request_id: Option<String>,
    #[arg(long, default_value = "bank-a")]
    pub buyer: String,
    #[arg(long, default_value = "bank-b")]
    pub seller: String,
    #[arg(long, default_value = "SG0000000001")]
    pub instrument: String,
    #[arg(long, default_value = "SGD")]
    pub currency: String,
    /// Amount in minor units (cents). A negative one is sent as given, for the gateway to
    /// refuse.
    #[arg(long, default_value_t = 125_000, allow_negative_numbers = true)]
    pub amount_minor: i64,
    /// Settlement date (default: today).
    #[arg(long)]
    pub value_date: Option<String>,
    #[arg(long, default_value = "SG")]
    pub jurisdiction: String,
    #[arg(long, default_value_t = 2)]
    pub counterparty_tier: u32,
    /// Use a session key (KeyExchange) instead of a key per request.
    #[arg(long)]
    pub session: bool,
    /// The TLS 1.3 suites to offer: `standard`, `gm` (RFC 8998, with the member's SM2
    /// certificate from `<data>/certs/sm2`) or `both`.
    #[arg(long, env = "AETHER_TLS_SUITE", default_value = "standard", value_parser = parse_tls_suite)]
    pub tls_suite: TlsSuite,
}

/// `aether client submit`: one trade, the decision printed as JSON.
pub async fn submit(args: SubmitArgs) -> anyhow::Result<()> {
    let tls = ClientTls::dev(&args.data_dir, args.tls_suite, Role::Member, &args.member)?;
    let (_, public_key) = envelope_paths(&args.data_dir);
    let mut client =
        ClearingClient::connect_with(&args.endpoint, &tls, &public_key, &args.member).await?;
    if args.session {
        client.key_exchange().await?;
    }
    let request_id = args
        .request_id
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let value_date = args
        .value_date
        .unwrap_or_else(|| chrono::Utc::now().format("%Y-%m-%d").to_string());
    let answer = client
        .submit(
            &request_id,
            &ClearingRequest {
                trade: Some(Trade {
                    buyer: args.buyer,
                    seller: args.seller,
                    instrument: args.instrument,
                    currency: args.currency,
                    amount_minor: args.amount_minor,
                    value_date,
                    jurisdiction: args.jurisdiction,
                    counterparty_tier: args.counterparty_tier,
                }),
                ..ClearingRequest::default()
            },
        )
        .await?;
    let decision = aether_gateway::pb::v1::Decision::try_from(answer.decision)
        .map(|d| d.as_str_name().to_owned())
        .unwrap_or_else(|_| answer.decision.to_string());
    let receipt = answer.receipt.unwrap_or_default();
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "request_id": answer.request_id,
            "decision": decision,
            "score": answer.score,
            "confidence": answer.confidence,
            "rules_fired": answer.rules_fired,
            "cited_clauses": answer.cited_clauses,
            "model_ref": answer.model_ref,
            "model_stage": answer.model_stage,
            "replayed": answer.replayed,
            "receipt": {
                "seq": receipt.seq,
                "event_hash": receipt.event_hash,
                "snapshot_id": receipt.snapshot_id,
                "trace_id": receipt.trace_id,
            },
        }))?
    );
    Ok(())
}

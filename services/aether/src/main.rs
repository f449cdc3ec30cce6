//! `aether`: the command line and composition root of the Aether compliance ledger.

mod audit_export;
mod background;
mod clearing;
mod cluster;
mod demo;
mod handoffs;
mod http_server;
mod model;
mod rollout_supervisor;
mod serve;
mod telemetry;
mod worker;

use std::path::PathBuf;
use std::process::ExitCode;

use aether_audit::BundleError;
use aether_ledger::checkpoint::{CheckpointVerifier, PUBLIC_KEY_FILE};
use aether_ledger::{EventStore, StoreConfig, redact_url};
use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};

/// jemalloc instead of the system allocator: the service allocates many small, short-lived
/// values per request (JSON and CEL values, rows), where glibc malloc spent a quarter of the
/// CPU under load. Not mimalloc, used before: most of its time was cache misses on blocks
/// another thread had freed (a request is built on one thread, committed and dropped on
/// another), while jemalloc reuses a freed block on the thread that freed it; the gateway
/// used less CPU per decision in each of eight alternated pairs (1–30 %, median 11 %;
/// BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "aether",
    version,
    about = "Event-sourced compliance and lineage ledger"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the service: ledger, checkpointer and HTTP API.
    Serve(Box<serve::ServeArgs>),
    /// Verify the whole ledger: hash chain, stream versions and signed checkpoints.
    Verify(VerifyArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(aether_bench::BenchCommand),
    /// Regulator tools: verify a bundle offline (no service, database or network), or
    /// export one from a running service.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Lineage checks.
    #[command(subcommand)]
    Lineage(LineageCommand),
    /// Run a clearing worker that connects to the gateway and scores batches.
    Worker(worker::WorkerArgs),
    /// The clearing model.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Development certificates for mTLS.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// A clearing member's client.
    #[command(subcommand)]
    Client(ClientCommand),
    /// Cluster tools.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Watch the rollout controller at work: a fresh service, a baseline, a flawed
    /// candidate rolled out under clearing traffic, widened, breached and rolled back.
    Demo(demo::DemoArgs),
    /// Rebuild the control plane's state from seq 1 and print its digest (compare with
    /// `GET /v1/state` of the running service).
    Replay {
        #[command(flatten)]
        ledger: LedgerArgs,
        /// Print the whole state as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// A cluster of real nodes under clearing, event and policy load, a random node
    /// SIGKILLed and restarted every few seconds; then checks that nothing acknowledged was
    /// lost or doubled, the ledger verifies, and the Delta table and OpenLineage records
    /// match it; reports how long each duty was unowned. Exit 1 when a check fails.
    Chaos(aether_bench::chaos::ChaosArgs),
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Train the anomaly MLP on the documented synthetic dataset and print its held-out
    /// AUC and the SM3 digest to register it with.
    Train(model::TrainArgs),
    /// Recompute a decision's recorded explanation from the ledger and the model artifact
    /// and check it matches bit for bit (exit 0; 1 when it differs).
    Explain(model::ExplainArgs),
}

#[derive(Subcommand)]
enum CertsCommand {
    /// Write a development CA, a server certificate (localhost, 127.0.0.1, ::1) and member
    /// and worker client certificates into `<data>/certs` (bank-a, bank-b, worker-1 and any
    /// named here).
    Init {
        #[arg(long, env = "AETHER_DATA_DIR", default_value = "./aether-data")]
        data_dir: PathBuf,
        /// Another member to issue a certificate for (repeatable).
        #[arg(long = "member")]
        members: Vec<String>,
        /// Another worker to issue a certificate for (repeatable).
        #[arg(long = "worker")]
        workers: Vec<String>,
        /// Replace an existing PKI (a new CA: every old certificate stops working).
        #[arg(long)]
        force: bool,
        /// An SM2 PKI instead (SM2 keys, SM2-with-SM3 signatures), in `<data>/certs/sm2`,
        /// for `--tls-suite gm` or `both`.
        #[arg(long)]
        sm2: bool,
    },
}

#[derive(Subcommand)]
enum ClientCommand {
    /// Submit one trade over mTLS with an SM4 envelope and print the sealed answer, opened.
    Submit(clearing::SubmitArgs),
}

#[derive(Subcommand)]
enum LineageCommand {
    /// Lists events missing their OpenLineage record or their Delta table version, and those
    /// the OpenLineage endpoint rejected; exits 1 when there is any.
    Reconcile {
        #[command(flatten)]
        ledger: LedgerArgs,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Verify an evidence bundle offline (format: audit/BUNDLE.md). Exit 0: valid and signed
    /// by the trusted key; 3: valid but the signer was not independently trusted; 2: invalid
    /// (a file that is not a well-formed bundle included); 1: the bundle or key file could
    /// not be read.
    Verify {
        /// The bundle file (JSON).
        bundle: PathBuf,
        /// The operator's checkpoint public key (PEM) to trust.
        #[arg(long)]
        public_key: Option<PathBuf>,
        /// Print the verdict as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Export an evidence bundle from a running service (regulator token) into a file.
    Export(audit_export::ExportArgs),
}

/// Where the ledger lives; shared by the commands that open it.
#[derive(Args, Clone, Debug)]
pub struct LedgerArgs {
    /// Data directory: SQLite ledger, keys, tokens.
    #[arg(long, env = "AETHER_DATA_DIR", default_value = "./aether-data")]
    pub data_dir: PathBuf,
    /// `postgres://…` to use PostgreSQL; default: SQLite in the data directory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
}

impl LedgerArgs {
    /// The ledger's database URL.
    pub fn url(&self) -> String {
        match &self.database_url {
            Some(url) if !url.is_empty() => url.clone(),
            _ => format!("sqlite:{}", self.sqlite_path().display()),
        }
    }

    pub fn sqlite_path(&self) -> PathBuf {
        self.data_dir.join("ledger.db")
    }

    pub fn uses_sqlite(&self) -> bool {
        self.url().starts_with("sqlite:")
    }

    /// A human description of where the ledger is, without secrets.
    pub fn describe(&self) -> String {
        if self.uses_sqlite() {
            format!("SQLite {}", self.sqlite_path().display())
        } else {
            format!("PostgreSQL {}", redact_url(&self.url()))
        }
    }
}

#[derive(Args)]
struct VerifyArgs {
    #[command(flatten)]
    ledger: LedgerArgs,
    /// Trusted checkpoint public key (PEM). Default: `<data>/keys/checkpoint-sm2.pub.pem`.
    #[arg(long, env = "AETHER_CHECKPOINT_PUBLIC_KEY")]
    public_key: Option<PathBuf>,
    /// A tree head you already trust, `TREE_SIZE:ROOT_HASH` (from an evidence bundle's
    /// anchor checkpoint, or one kept from an earlier verify): fails unless the ledger still
    /// holds those events with that root, so removed newest events are caught.
    #[arg(long, value_name = "TREE_SIZE:ROOT_HASH")]
    since_checkpoint: Option<aether_ledger::TrustedAnchor>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    // rustls has two crypto providers in this build (ring, and aws-lc-rs through the Delta
    // Lake stack); pick one before any TLS is set up.
    aether_gateway::tls::install_default_crypto_provider();
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Serve(_) | Command::Worker(_) | Command::Demo(_)
    ) {
        one_thread_per_model_matmul();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => serve::run(*args).await.map(|_| ExitCode::SUCCESS),
            Command::Verify(args) => verify(args).await,
            Command::Bench(cmd) => aether_bench::run(cmd).await.map(|_| ExitCode::SUCCESS),
            Command::Cluster(ClusterCommand::Chaos(args)) => aether_bench::chaos::run(args).await,
            Command::Audit(AuditCommand::Verify {
                bundle,
                public_key,
                json,
            }) => audit_verify(&bundle, public_key.as_deref(), json),
            Command::Audit(AuditCommand::Export(args)) => {
                audit_export::run(args).await.map(|_| ExitCode::SUCCESS)
            }
            Command::Replay { ledger, json } => replay(ledger, json).await,
            Command::Certs(CertsCommand::Init {
                data_dir,
                members,
                workers,
                force,
                sm2,
            }) => {
                let algorithm = if sm2 {
                    aether_gateway::certs::KeyAlgorithm::Sm2
                } else {
                    aether_gateway::certs::KeyAlgorithm::EcdsaP256
                };
                clearing::certs_init(&data_dir, members, workers, force, algorithm)
                    .map(|_| ExitCode::SUCCESS)
            }
            Command::Model(ModelCommand::Train(args)) => {
                model::train_command(args).map(|_| ExitCode::SUCCESS)
            }
            Command::Model(ModelCommand::Explain(args)) => model::explain_command(args).await,
            Command::Worker(args) => worker::run(args).await.map(|_| ExitCode::SUCCESS),
            Command::Demo(args) => demo::run(args).await.map(|_| ExitCode::SUCCESS),
            Command::Client(ClientCommand::Submit(args)) => {
                clearing::submit(args).await.map(|_| ExitCode::SUCCESS)
            }
            Command::Lineage(LineageCommand::Reconcile { ledger, json }) => {
                reconcile(ledger, json).await
            }
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", aether_gateway::errors::error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Candle sizes each matmul's thread pool from `RAYON_NUM_THREADS`, read on every call; when
/// it is unset it counts physical cores by reading `/proc/cpuinfo`, every time. Under
/// clearing load that read was ~2.5 % of the gateway's CPU, more than the matmuls
/// themselves. The clearing model's matmuls are small and the batcher already scores one
/// batch per core, so a process that clears runs each on one thread. An explicit setting
/// is kept. Must run before any other thread exists (the runtime starts after it).
fn one_thread_per_model_matmul() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: called from `main` before the runtime or any other thread is started, so
        // nothing reads the environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
}

/// Libraries that describe their internals at INFO on every Delta commit and snapshot
/// (about a dozen lines each) or search-index write: at WARN unless `AETHER_LOG` names
/// them.
const QUIET_UNLESS_NAMED: [&str; 3] = ["buoyant_kernel", "deltalake_core", "tantivy"];

/// The log filter for `AETHER_LOG` (default `info`), with [`QUIET_UNLESS_NAMED`] at WARN
/// unless the spec names them. An invalid spec falls back to `info` with a warning.
fn log_filter(spec: Option<&str>) -> (tracing_subscriber::EnvFilter, Option<String>) {
    let requested = spec.unwrap_or("info");
    let (filter, invalid) = match tracing_subscriber::EnvFilter::try_new(requested) {
        Ok(filter) => (filter, None),
        Err(e) => (
            tracing_subscriber::EnvFilter::new("info"),
            Some(format!(
                "AETHER_LOG={requested:?} is not a valid filter ({e}); logging at info"
            )),
        ),
    };
    let filter = QUIET_UNLESS_NAMED
        .iter()
        .filter(|target| !requested.contains(*target))
        .filter_map(|target| format!("{target}=warn").parse().ok())
        .fold(filter, tracing_subscriber::EnvFilter::add_directive);
    (filter, invalid)
}

/// Sets up logging: text to stderr, JSON when `AETHER_LOG_FORMAT=json`.
/// Logs to stderr (text, or JSON with `AETHER_LOG_FORMAT=json`) filtered by `AETHER_LOG`,
/// and OpenTelemetry traces when the `OTEL_*` variables name an exporter (`telemetry.rs`).
/// Call inside the tokio runtime; keep the returned handle to flush the spans at exit.
pub fn init_logging() -> anyhow::Result<telemetry::Telemetry> {
    use tracing_subscriber::prelude::*;
    let spec = std::env::var("AETHER_LOG").ok();
    let (filter, invalid) = log_filter(spec.as_deref());
    // Every line written inside a request carries its trace and span ids (`JoinedUp`).
    // Colours only for a person at a terminal: a log file or a collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let fmt = if std::env::var("AETHER_LOG_FORMAT").is_ok_and(|f| f == "json") {
        let format = tracing_subscriber::fmt::format().json();
        fmt.json()
            .event_format(telemetry::JoinedUp::new(format, true))
            .with_filter(filter)
            .boxed()
    } else {
        let format = tracing_subscriber::fmt::format();
        fmt.event_format(telemetry::JoinedUp::new(format, false))
            .with_filter(filter)
            .boxed()
    };
    let (otel, telemetry) = telemetry::layer().map_err(|e| anyhow::anyhow!(e))?;
    tracing_subscriber::registry().with(fmt).with(otel).init();
    if let Some(warning) = invalid {
        tracing::warn!("{warning}");
    }
    Ok(telemetry)
}

async fn verify(args: VerifyArgs) -> anyhow::Result<ExitCode> {
    if args.ledger.uses_sqlite() && !args.ledger.sqlite_path().exists() {
        bail!(
            "no ledger at {} (set --data-dir or DATABASE_URL)",
            args.ledger.sqlite_path().display()
        );
    }
    let default_key = args.ledger.data_dir.join("keys").join(PUBLIC_KEY_FILE);
    let key_path = args
        .public_key
        .clone()
        .or(default_key.exists().then_some(default_key));
    let trusted = match &key_path {
        Some(path) => Some(CheckpointVerifier::from_pem_file(path)?),
        None => {
            eprintln!(
                "warning: no trusted checkpoint key given; checkpoints are checked against the key they name"
            );
            None
        }
    };
    let store = EventStore::connect(&args.ledger.url(), StoreConfig::default())
        .await
        .with_context(|| format!("cannot open the ledger at {}", args.ledger.describe()))?;
    let total = store.head().await?.map_or(0, |(seq, _)| seq);
    let bar = if args.json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(total)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "verifying {bar:40} {pos}/{len} events ({per_sec}, eta {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let started = std::time::Instant::now();
    let report =
        aether_ledger::verify_store_anchored(&store, trusted, args.since_checkpoint, |n| {
            bar.set_position(n)
        })
        .await?;
    bar.finish_and_clear();
    store.shutdown().await;
    let elapsed = started.elapsed();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        match &report.failure {
            None => println!(
                "OK: {} events, {} signed checkpoints verified in {:.2} s; head {}{}{}",
                report.events_checked,
                report.checkpoints_checked,
                elapsed.as_secs_f64(),
                report.head_hash.as_deref().unwrap_or("(empty ledger)"),
                report
                    .latest_checkpoint
                    .as_ref()
                    .map(|c| format!("; latest checkpoint covers {} events", c.tree_size))
                    .unwrap_or_default(),
                report
                    .key_rotations
                    .last()
                    .map(|r| format!(
                        "; {} key rotation(s), checkpoints now signed by the key with fingerprint {}",
                        report.key_rotations.len(),
                        aether_ledger::checkpoint::key_fingerprint(&r.new_key)
                    ))
                    .unwrap_or_default()
            ),
            Some(f) => println!(
                "FAILED at seq {}: {} ({} events before it verified)",
                f.seq, f.problem, report.events_checked
            ),
        }
    }
    Ok(if report.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

fn audit_verify(
    bundle: &std::path::Path,
    public_key: Option<&std::path::Path>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let trusted = public_key
        .map(CheckpointVerifier::from_pem_file)
        .transpose()?;
    let bar = if json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(0)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("verifying {bar:40} {pos}/{len} ({eta})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let verdict = match aether_audit::verify_bundle_file(bundle, trusted.as_ref(), |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    }) {
        Ok(verdict) => verdict,
        // A file that cannot be read says nothing of the bundle: exit 1, as any error.
        Err(e @ (BundleError::File { .. } | BundleError::Io(_))) => {
            return Err(anyhow::Error::new(e)
                .context(format!("cannot read the bundle {}", bundle.display())));
        }
        // Anything read that is not a well-formed bundle is an invalid bundle.
        Err(e) => {
            bar.finish_and_clear();
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "ok": false, "malformed": e.to_string()
                    }))?
                );
            } else {
                println!(
                    "INVALID: {} is not a well-formed bundle: {e}",
                    bundle.display()
                );
            }
            return Ok(ExitCode::from(2));
        }
    };
    bar.finish_and_clear();
    if json {
        println!("{}", serde_json::to_string_pretty(&verdict)?);
    } else {
        print!("{verdict}");
        if verdict.ok && !verdict.signer_trusted {
            println!(
                "WARNING: no trusted key was given (--public-key); the bundle is consistent, but anyone could have signed it"
            );
        }
    }
    Ok(match (verdict.ok, verdict.signer_trusted) {
        (true, true) => ExitCode::SUCCESS,
        (true, false) => ExitCode::from(3),
        (false, _) => ExitCode::from(2),
    })
}

async fn reconcile(ledger: LedgerArgs, json: bool) -> anyhow::Result<ExitCode> {
    if ledger.uses_sqlite() && !ledger.sqlite_path().exists() {
        bail!("no ledger at {}", ledger.sqlite_path().display());
    }
    let store = EventStore::connect(&ledger.url(), StoreConfig::default())
        .await
        .with_context(|| format!("cannot open the ledger at {}", ledger.describe()))?;
    let report = aether_lineage::relay::reconcile(&store).await?;
    store.shutdown().await;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let list = |seqs: &[u64]| {
            let shown: Vec<String> = seqs.iter().take(20).map(u64::to_string).collect();
            let more = if seqs.len() > 20 { ", …" } else { "" };
            format!("{}{more}", shown.join(", "))
        };
        println!("{} events", report.events);
        println!(
            "missing an OpenLineage record: {} [{}]",
            report.missing_openlineage.len(),
            list(&report.missing_openlineage)
        );
        println!(
            "missing a Delta table version: {} [{}]",
            report.missing_delta.len(),
            list(&report.missing_delta)
        );
        println!(
            "rejected by the OpenLineage endpoint: {} [{}]",
            report.rejected_by_endpoint.len(),
            list(&report.rejected_by_endpoint)
        );
    }
    Ok(
        if report.missing_openlineage.is_empty()
            && report.missing_delta.is_empty()
            && report.rejected_by_endpoint.is_empty()
        {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        },
    )
}

async fn replay(ledger: LedgerArgs, json: bool) -> anyhow::Result<ExitCode> {
    if ledger.uses_sqlite() && !ledger.sqlite_path().exists() {
        bail!("no ledger at {}", ledger.sqlite_path().display());
    }
    let store = EventStore::connect(&ledger.url(), StoreConfig::default())
        .await
        .with_context(|| format!("cannot open the ledger at {}", ledger.describe()))?;
    let head = store.head().await?.map_or(0, |(s, _)| s);
    let state = aether_control::ControlState::replay(&store).await?;
    store.shutdown().await;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "head_seq": head, "digest": state.digest(), "state": state.document(),
            }))?
        );
    } else {
        println!(
            "replayed {head} events: {} policies, {} models, {} engines, {} rollouts; state digest {}",
            state.policies.policies().len(),
            state.models.all().len(),
            state.engines.engines().len(),
            state.rollouts.all().len(),
            state.digest()
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn the_delta_and_index_libraries_log_warnings_only_unless_named() {
        let (filter, invalid) = log_filter(None);
        let text = filter.to_string();
        assert!(invalid.is_none());
        for target in ["buoyant_kernel", "deltalake_core", "tantivy"] {
            assert!(text.contains(&format!("{target}=warn")), "{text}");
        }
        let (filter, _) = log_filter(Some("debug,deltalake_core=trace"));
        let text = filter.to_string();
        assert!(text.contains("deltalake_core=trace"), "{text}");
        assert!(!text.contains("deltalake_core=warn"), "{text}");
        assert!(text.contains("buoyant_kernel=warn"), "{text}");
    }

    #[test]
    fn an_invalid_filter_is_reported_and_info_is_used() {
        let (filter, invalid) = log_filter(Some("aether=loud"));
        let warning = invalid.expect("a warning");
        assert!(warning.contains("aether=loud"), "{warning}");
        assert!(filter.to_string().contains("info"), "{filter}");
    }
}

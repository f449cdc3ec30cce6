//! `aether bench clearing`: clearing throughput and latency through a real `aether serve`
//! (mTLS, SM2/SM4 session keys, rules, batching, scoring, netting and decision events on
//! the ledger), against two baselines measured in the same run: the durable baseline
//! (`durable`: the envelope opened, the request appended by a group commit to the same kind
//! of database, the answer sealed after the commit, nothing else) and a bare tonic mTLS
//! echo server.
//!
//! Three processes: this one (the driver: starts `aether serve`, sets up the engine over
//! HTTP, hosts the echo server, prints the report), the server, and a load client
//! (`aether bench clearing client …`, hidden) that drives both targets in turn, so that
//! the client never shares a runtime with what it measures.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::node::{ServeChild, copy_dir, http_request, setup_engine};
use crate::scratch::Scratch;
use crate::trades::{MEMBERS, SplitMix, trade_request, value_date};
use aether_gateway::client::ClearingClient;
use aether_gateway::envelope::{Aad, Direction, Sm4Key, open, seal, unix_now, wrap_key};
use aether_gateway::identity::Role;
use aether_gateway::pb::v1::clearing_service_client::ClearingServiceClient;
use aether_gateway::pb::v1::clearing_service_server::ClearingService;
use aether_gateway::pb::v1::{
    ClearingAnswer, Decision, KeyExchangeRequest, KeyExchangeResponse, SealedBatchRequest,
    SealedBatchResponse, SealedRequest, SealedResponse,
};
use aether_gateway::service::{METHOD_SUBMIT, METHOD_SUBMIT_STREAM};
use aether_gateway::tls::{ClientTls, TlsSuite};
use aether_ledger::redact_url;
use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use prost::Message;
use serde::{Deserialize, Serialize};
use sm2::pkcs8::DecodePublicKey;
use sqlx::Connection;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

/// Prefix of the client's result lines on its stdout.
const RESULT_PREFIX: &str = "aether-bench-result ";
/// The targets on the 2-core machine.
const TARGET_RPS: f64 = 10_000.0;
const TARGET_P99_MS: f64 = 50.0;
const TARGET_RATIO: f64 = 0.4;
/// The gateway's share of the durable baseline's throughput (at the p99 target).
const TARGET_DURABLE_RATIO: f64 = 0.5;

/// `--tls-suite` as clap reads it.
fn parse_tls_suite(s: &str) -> Result<TlsSuite, String> {
    s.parse()
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ClearingBench {
    #[command(subcommand)]
    mode: Option<ClearingMode>,
    /// Ledger of the server: `postgres://…` (a scratch database is created and dropped;
    /// needs CREATE DATABASE). Default: SQLite in the temp data directory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Measured seconds per target (after the warm-up).
    #[arg(long, default_value_t = 20)]
    duration_secs: u64,
    /// Warm-up seconds per target, not measured.
    #[arg(long, default_value_t = 5)]
    warmup_secs: u64,
    /// Concurrent requests in flight (closed loop: one task per request in flight). 256 is
    /// where the targets were measured; past it the extra requests only queue.
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// mTLS channels (HTTP/2 connections) the tasks share, alternating members; with
    /// `--nodes`, rounded up to a multiple of the nodes so that each gets as many.
    #[arg(long, default_value_t = 4)]
    channels: usize,
    /// The server's batch delay (`aether serve --batch-delay-us`).
    #[arg(long, default_value_t = 2000)]
    batch_delay_us: u64,
    /// How requests travel, for the gateway and the echo alike: one unary `Submit` call
    /// each, or messages on one long-lived `SubmitStream` per task (the default: how a
    /// member sending many trades would connect).
    #[arg(long, value_enum, default_value_t = Api::Stream)]
    api: Api,
    /// Also measure a cluster: after the single node, 2 … N `aether serve` nodes on the same
    /// PostgreSQL database (one PKI, checkpoint key and Delta location), the load spread
    /// over their gateways, each phase against the single node of the same run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=8))]
    nodes: u64,
    /// The TLS 1.3 suites of the gateway, the echo and the load: `standard`, `gm` (RFC
    /// 8998 with SM2 certificates) or `both` (the server offers both, the load the standard).
    #[arg(long, default_value = "standard", value_parser = parse_tls_suite)]
    tls_suite: TlsSuite,
    /// Requests one session key of the durable baseline may open (default: unlimited).
    /// The load client re-keys a channel whose key is used up, as a member's client does;
    /// a small number here makes it do so often.
    #[arg(long)]
    durable_key_uses: Option<u64>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Keep the temp directory and the scratch database (to look at them afterwards).
    #[arg(long)]
    keep: bool,
}

#[derive(Subcommand)]
enum ClearingMode {
    /// The load client (started by the bench in its own process).
    #[command(hide = true)]
    Client(ClientArgs),
}

#[derive(Args, Clone)]
struct ClientArgs {
    /// Data directory of the server (development PKI and envelope public key).
    #[arg(long)]
    data_dir: PathBuf,
    /// `https://…` of the clearing gateway; several, comma-separated, for a cluster (the
    /// channels go to them in turn).
    #[arg(long)]
    gateway: String,
    /// `https://…` of the echo server.
    #[arg(long)]
    echo: Option<String>,
    /// `https://…` of the durable baseline.
    #[arg(long)]
    durable: Option<String>,
    #[arg(long)]
    durable_pid: Option<u32>,
    /// The gateways' processes (comma-separated): their CPU is reported, summed.
    #[arg(long, value_delimiter = ',')]
    gateway_pid: Vec<u32>,
    #[arg(long)]
    echo_pid: Option<u32>,
    /// The server's PostgreSQL database: CPU of its backends is reported.
    #[arg(long)]
    database_name: Option<String>,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    #[arg(long, default_value_t = 4)]
    channels: usize,
    #[arg(long, default_value_t = 20)]
    duration_secs: u64,
    #[arg(long, default_value_t = 5)]
    warmup_secs: u64,
    #[arg(long, value_enum, default_value_t = Api::Unary)]
    api: Api,
    #[arg(long, default_value = "standard", value_parser = parse_tls_suite)]
    tls_suite: TlsSuite,
}

/// The clearing API the load uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `Submit`: one HTTP/2 stream per request.
    Unary,
    /// `SubmitStream`: each task keeps one stream open and sends its requests on it, one
    /// at a time (still a closed loop).
    Stream,
}

impl Api {
    fn name(self) -> &'static str {
        match self {
            Api::Unary => "unary",
            Api::Stream => "stream",
        }
    }

    /// The method the envelope's AAD binds.
    fn method(self) -> &'static str {
        match self {
            Api::Unary => METHOD_SUBMIT,
            Api::Stream => METHOD_SUBMIT_STREAM,
        }
    }
}

pub async fn run(b: ClearingBench) -> anyhow::Result<()> {
    match b.mode {
        Some(ClearingMode::Client(args)) => client_main(args).await,
        None => driver(b).await,
    }
}

// ---------------------------------------------------------------------------------------
// Results

/// One target's measurement, as the load client reports it.
#[derive(Serialize, Deserialize, Debug, Clone, Default)]
struct PhaseResult {
    target: String,
    concurrency: usize,
    channels: usize,
    warmup_secs: u64,
    duration_secs: u64,
    /// Successful requests completed in the measured interval.
    ok: u64,
    requests_per_sec: f64,
    mean_ms: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    max_ms: f64,
    /// RESOURCE_EXHAUSTED answers (load shed by the server) in the measured interval.
    shed: u64,
    /// Other failures in the measured interval, by gRPC code.
    errors: BTreeMap<String, u64>,
    /// First failure message seen, for the report.
    first_error: Option<String>,
    /// Mean sealed sizes on the wire (ciphertext with tag), bytes.
    request_bytes: u64,
    response_bytes: u64,
    /// Decisions in the measured interval (gateway only).
    decisions: BTreeMap<String, u64>,
    replayed: u64,
    /// Highest ledger seq in a receipt (gateway only).
    max_receipt_seq: u64,
    /// Completions per second of the measured interval.
    per_second: Vec<u64>,
    /// The slowest answer completed in each second of the measured interval, ms: whether
    /// the tail is a few slow seconds (and which) or spread evenly.
    #[serde(default)]
    per_second_max_ms: Vec<f64>,
    /// CPU seconds over the measured interval: this client, the server process, and the
    /// PostgreSQL backends of the server's database (backends that exited in between are
    /// missed, ones that started in between count whole).
    client_cpu_secs: Option<f64>,
    server_cpu_secs: Option<f64>,
    /// The part of `server_cpu_secs` spent on the server's lower-priority threads (the
    /// lineage relays and the Merkle log follower; threads that ended in between are
    /// missed).
    #[serde(default)]
    server_background_cpu_secs: Option<f64>,
    postgres_cpu_secs: Option<f64>,
    /// Busy share of all cores over the measured interval (whole machine).
    machine_busy: Option<f64>,
    /// What the server's PostgreSQL did over the measured interval (gateway only).
    #[serde(default)]
    postgres: Option<PostgresWindow>,
}

/// PostgreSQL's checkpoints and WAL over a measured interval. A checkpoint ends with an
/// fsync of every file it wrote, and after it the first change to each page is logged
/// whole; under clearing load the default `max_wal_size` (1 GB) starts one every ~12 s, so
/// whether one fell in the interval explains much of a run's p99.9.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
struct PostgresWindow {
    /// Checkpoints that completed in the interval (timed and requested).
    checkpoints: u64,
    /// Of those, requested: by WAL volume (`max_wal_size`) or explicitly.
    checkpoints_requested: u64,
    /// WAL written by the whole cluster in the interval.
    wal_bytes: u64,
    max_wal_size: String,
    checkpoint_timeout: String,
}

#[derive(Serialize)]
struct Report {
    command: String,
    database: String,
    build: &'static str,
    cores: usize,
    loadavg_before: Option<String>,
    loadavg_after: Option<String>,
    batch_delay_us: u64,
    api: Api,
    /// Whether lineage kept up with the gateway phase: the rate is sustainable only then.
    lineage: Option<LineageLag>,
    gateway: PhaseResult,
    echo: Option<PhaseResult>,
    ratio_to_echo: Option<f64>,
    /// The durable baseline (on the same kind of database as the server).
    durable: Option<PhaseResult>,
    ratio_to_durable: Option<f64>,
    /// The server's resident memory around the gateway phase.
    memory: Option<ServerMemory>,
    /// With `--nodes N`: the gateway phase with 2 … N nodes, after the single node's.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    cluster: Vec<NodesPhase>,
    targets: Vec<Verdict>,
}

/// The server's resident set (`VmRSS`), MiB: engine set up and idle, right after the
/// gateway phase, and after lineage caught up and [`MEMORY_SETTLE`] more without load.
#[derive(Serialize, Debug, Clone)]
struct ServerMemory {
    idle_mib: f64,
    after_load_mib: f64,
    settled_mib: f64,
    settle_secs: u64,
}

/// How long the server is left without load before its memory is read again.
const MEMORY_SETTLE: Duration = Duration::from_secs(10);

/// A process's resident set in MiB (`VmRSS` of `/proc/<pid>/status`), if readable.
fn resident_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// The load spread over `nodes` gateways of one cluster.
#[derive(Serialize, Debug, Clone)]
struct NodesPhase {
    nodes: u64,
    result: PhaseResult,
    /// Throughput against the single node of the same run.
    ratio_to_one_node: f64,
}

/// The target for a cluster on one machine: N nodes lose at most 15 %.
const TARGET_CLUSTER_RATIO: f64 = 0.85;

#[derive(Serialize)]
struct Verdict {
    target: String,
    measured: String,
    met: bool,
}

// ---------------------------------------------------------------------------------------
// The driver

async fn driver(b: ClearingBench) -> anyhow::Result<()> {
    if b.concurrency == 0 || b.channels == 0 || b.duration_secs == 0 {
        bail!("--concurrency, --channels and --duration-secs must be positive");
    }
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let loadavg_before = loadavg();
    let tmp = tempfile::Builder::new()
        .prefix("aether-bench-clearing-")
        .tempdir()
        .context("cannot create a temp directory")?;
    let data = tmp.path().join("data");
    let scratch = match b.database_url.as_deref() {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            Some(Scratch::new(url).await?)
        }
        Some(url) if !url.is_empty() && !url.starts_with("sqlite:") => {
            bail!("--database-url must be postgres://… or sqlite:")
        }
        _ => None,
    };
    let database = match &scratch {
        Some(db) => format!("PostgreSQL {}", redact_url(&db.url)),
        None => {
            "SQLite (in the temp data directory; the issue's targets are for PostgreSQL)".into()
        }
    };
    say(b.json, &format!("# aether bench clearing on {database}"));

    let result = measure(
        &b,
        &data,
        tmp.path(),
        scratch
            .as_ref()
            .map(|s| (s.url.as_str(), s.database_name().unwrap_or_default())),
    )
    .await;
    if b.keep {
        let kept = tmp.keep();
        eprintln!("kept {}", kept.display());
        if let Some(db) = &scratch {
            eprintln!("kept {}", redact_url(&db.url));
        }
    } else if let Some(db) = scratch {
        db.drop().await;
    }
    let (gateway, echo, durable, memory, lineage, cluster_phases) = result?;

    let ratio = echo
        .as_ref()
        .filter(|e| e.requests_per_sec > 0.0)
        .map(|e| gateway.requests_per_sec / e.requests_per_sec);
    let mut targets = vec![
        Verdict {
            target: format!("throughput ≥ {TARGET_RPS:.0} requests/s"),
            measured: format!("{:.0} requests/s", gateway.requests_per_sec),
            met: gateway.requests_per_sec >= TARGET_RPS,
        },
        Verdict {
            target: format!("p99 ≤ {TARGET_P99_MS:.0} ms"),
            measured: format!("{:.2} ms", gateway.p99_ms),
            met: gateway.ok > 0 && gateway.p99_ms <= TARGET_P99_MS,
        },
    ];
    let ratio_to_durable = durable
        .as_ref()
        .filter(|d| d.requests_per_sec > 0.0)
        .map(|d| gateway.requests_per_sec / d.requests_per_sec);
    if let Some(r) = ratio_to_durable {
        targets.push(Verdict {
            target: format!(
                "≥ {TARGET_DURABLE_RATIO} of the durable baseline's throughput at p99 ≤ {TARGET_P99_MS:.0} ms"
            ),
            measured: format!("{r:.3}"),
            met: r >= TARGET_DURABLE_RATIO && gateway.ok > 0 && gateway.p99_ms <= TARGET_P99_MS,
        });
    }
    if let Some(r) = ratio {
        targets.push(Verdict {
            target: format!("≥ {TARGET_RATIO} of the echo's throughput"),
            measured: format!("{r:.3}"),
            met: r >= TARGET_RATIO,
        });
    }
    let cluster: Vec<NodesPhase> = cluster_phases
        .into_iter()
        .map(|(nodes, result)| NodesPhase {
            nodes,
            ratio_to_one_node: if gateway.requests_per_sec > 0.0 {
                result.requests_per_sec / gateway.requests_per_sec
            } else {
                0.0
            },
            result,
        })
        .collect();
    if let Some(last) = cluster.last() {
        targets.push(Verdict {
            target: format!(
                "{} nodes ≥ {TARGET_CLUSTER_RATIO} of one node's throughput",
                last.nodes
            ),
            measured: format!("{:.3}", last.ratio_to_one_node),
            met: last.ratio_to_one_node >= TARGET_CLUSTER_RATIO,
        });
    }
    let report = Report {
        command,
        database,
        build: if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        loadavg_before,
        loadavg_after: loadavg(),
        batch_delay_us: b.batch_delay_us,
        api: b.api,
        lineage,
        gateway,
        echo,
        ratio_to_echo: ratio,
        durable,
        ratio_to_durable,
        memory,
        cluster,
        targets,
    };
    if b.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn say(json: bool, line: &str) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// What [`measure`] brings back: the gateway, the echo, lineage's lag after the gateway
/// phase, and with `--nodes` each cluster phase (nodes, result).
type Measured = (
    PhaseResult,
    Option<PhaseResult>,
    Option<PhaseResult>,
    Option<ServerMemory>,
    Option<LineageLag>,
    Vec<(u64, PhaseResult)>,
);

/// Starts the server, sets up the engine, starts the echo server, runs the client; with
/// `--nodes`, then starts the other nodes and runs the client over 2 … N gateways.
async fn measure(
    b: &ClearingBench,
    data: &Path,
    tmp: &Path,
    database: Option<(&str, &str)>,
) -> anyhow::Result<Measured> {
    if b.nodes > 1 && database.is_none() {
        bail!("--nodes needs PostgreSQL (--database-url): SQLite is a single node");
    }
    let operator = format!("bench-operator-{}", uuid::Uuid::now_v7().simple());
    let regulator = format!("bench-regulator-{}", uuid::Uuid::now_v7().simple());
    let log_path = tmp.join("serve.log");
    let mut server = ServeChild::start_with_env(
        data,
        &log_path,
        database.map(|(url, _)| url),
        Some(&format!("operator:{operator},regulator:{regulator}")),
        b.batch_delay_us,
        "warn",
        &[("AETHER_TLS_SUITE", b.tls_suite.name())],
    )
    .await?;
    say(
        b.json,
        &format!(
            "server pid {} at {} and {} (log {}), TLS suites: {}",
            server.pid,
            server.http,
            server.grpc,
            log_path.display(),
            b.tls_suite
        ),
    );
    let mut extra: Vec<ServeChild> = Vec::new();
    let outcome = async {
        setup_engine(&server.http, data, &operator, &regulator).await?;
        let answer_len = probe(&server.grpc, data, b.tls_suite).await?;
        say(
            b.json,
            &format!("engine active; a probe trade was cleared (sealed answer {answer_len} bytes)"),
        );
        let idle_mib = resident_mib(server.pid);
        let (echo_url, echo_stop) = start_echo(data, answer_len, b.tls_suite).await?;
        // The durable baseline appends to the same database, in a table of its own, with
        // the group commit `aether serve` runs by default (--max-batch, --max-wait-us).
        // On SQLite, a database file of its own beside the server's, with the ledger's
        // settings (one writer per file: sharing the ledger's would make each wait for
        // the other).
        let durable_url = match database {
            Some((url, _)) => url.to_owned(),
            None => format!("sqlite:{}", tmp.join("durable.db").display()),
        };
        let durable = Some(
            crate::durable::start(
                data,
                &durable_url,
                b.tls_suite,
                crate::durable::GroupCommit {
                    max_batch: 500,
                    max_wait: Duration::from_micros(1000),
                },
                b.durable_key_uses.unwrap_or(u64::MAX),
            )
            .await?,
        );
        let client = run_client(
            b,
            data,
            &server.grpc,
            Some(&echo_url),
            durable.as_ref().map(|(url, _)| url.as_str()),
            &[server.pid],
            database,
        )
        .await;
        let _ = echo_stop.send(true);
        if let Some((_, stop)) = &durable {
            let _ = stop.send(true);
        }
        let (gateway, echo, durable) = client?;
        let after_load_mib = resident_mib(server.pid);
        // A bench that ran is reported even if the gauges cannot be read.
        let lineage = lineage_catch_up(&server.http, &operator)
            .await
            .inspect_err(|e| {
                eprintln!(
                    "cannot tell whether lineage kept up: {}",
                    aether_gateway::errors::error_chain(e.as_ref())
                )
            })
            .ok();
        let mut phases = Vec::new();
        for n in 2..=b.nodes {
            let node = start_node(b, data, tmp, n, database, &operator, &regulator).await?;
            say(
                b.json,
                &format!(
                    "node {n} pid {} at {}; it follows the engine",
                    node.pid, node.grpc
                ),
            );
            extra.push(node);
            let grpc: Vec<&str> = std::iter::once(server.grpc.as_str())
                .chain(extra.iter().map(|n| n.grpc.as_str()))
                .collect();
            let pids: Vec<u32> = std::iter::once(server.pid)
                .chain(extra.iter().map(|n| n.pid))
                .collect();
            let (result, _, _) =
                run_client(b, data, &grpc.join(","), None, None, &pids, database).await?;
            say(
                b.json,
                &format!(
                    "{n} nodes: {:.0} requests/s, p99 {:.2} ms",
                    result.requests_per_sec, result.p99_ms
                ),
            );
            phases.push((n, result));
            // The relays drain before the next phase, as after the single node's.
            let _ = lineage_catch_up(&server.http, &operator).await;
        }
        // What the server holds once lineage has caught up and the load has been gone a
        // while: whether the load's memory came back.
        tokio::time::sleep(MEMORY_SETTLE).await;
        let memory = match (idle_mib, after_load_mib, resident_mib(server.pid)) {
            (Some(idle_mib), Some(after_load_mib), Some(settled_mib)) => Some(ServerMemory {
                idle_mib,
                after_load_mib,
                settled_mib,
                settle_secs: MEMORY_SETTLE.as_secs(),
            }),
            _ => None,
        };
        anyhow::Ok((gateway, echo, durable, memory, lineage, phases))
    }
    .await;
    for mut node in extra {
        node.stop().await;
    }
    server.stop().await;
    outcome.map_err(|e| {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        e.context(format!("the server's log ends:\n{}", tail.join("\n")))
    })
}

/// Starts node `n` of the cluster in `<tmp>/data-<n>` with the first node's PKI, keys and
/// Delta location, and waits until it has followed the engine the first node activated.
async fn start_node(
    b: &ClearingBench,
    data: &Path,
    tmp: &Path,
    n: u64,
    database: Option<(&str, &str)>,
    operator: &str,
    regulator: &str,
) -> anyhow::Result<ServeChild> {
    let own = tmp.join(format!("data-{n}"));
    for dir in ["certs", "keys"] {
        copy_dir(&data.join(dir), &own.join(dir))
            .with_context(|| format!("cannot copy {dir} for node {n}"))?;
    }
    let delta = data.join("delta");
    let models = data.join("model");
    let (delta, models) = (
        delta.to_str().context("the temp path is not UTF-8")?,
        models.to_str().context("the temp path is not UTF-8")?,
    );
    let node_id = format!("bench-node-{n}");
    let node = ServeChild::start_with_env(
        &own,
        &tmp.join(format!("serve-{n}.log")),
        database.map(|(url, _)| url),
        Some(&format!("operator:{operator},regulator:{regulator}")),
        b.batch_delay_us,
        "warn",
        &[
            ("AETHER_NODE_ID", node_id.as_str()),
            ("AETHER_DELTA_URI", delta),
            ("AETHER_MODEL_DIRS", models),
            ("AETHER_TLS_SUITE", b.tls_suite.name()),
        ],
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = http_request(&node.http, "GET", "/v1/engines", operator, None).await?;
        let engines: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        if status == 200 && engines["engines"][0]["status"] == "active" {
            return Ok(node);
        }
        if Instant::now() > deadline {
            bail!("node {n} did not follow the engine within 30 s: {body}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How long the bench waits for the lineage relays once the load has stopped.
const LINEAGE_CATCH_UP_LIMIT: Duration = Duration::from_secs(120);

/// How far the lineage relays were behind the ledger when the load stopped (their lag
/// gauges, as `/metrics` shows them), and how long they then took to reach it.
#[derive(Clone, Debug, Serialize)]
struct LineageLag {
    delta_events_behind: u64,
    openlineage_events_behind: u64,
    /// `None`: still behind after [`LINEAGE_CATCH_UP_LIMIT`].
    caught_up_ms: Option<u64>,
}

async fn lineage_catch_up(http: &str, token: &str) -> anyhow::Result<LineageLag> {
    let started = Instant::now();
    let (delta_events_behind, openlineage_events_behind) = lineage_lags(http, token).await?;
    let mut caught_up_ms = None;
    while started.elapsed() < LINEAGE_CATCH_UP_LIMIT {
        if lineage_lags(http, token).await? == (0, 0) {
            caught_up_ms = Some(u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(LineageLag {
        delta_events_behind,
        openlineage_events_behind,
        caught_up_ms,
    })
}

/// The Delta and OpenLineage relays' lag gauges from the server's `/metrics`.
async fn lineage_lags(http: &str, token: &str) -> anyhow::Result<(u64, u64)> {
    let (status, body) = http_request(http, "GET", "/metrics", token, None).await?;
    if status != 200 {
        bail!("GET /metrics answered {status}");
    }
    lag_gauges(&body)
}

fn lag_gauges(metrics: &str) -> anyhow::Result<(u64, u64)> {
    let gauge = |name: &str| -> anyhow::Result<u64> {
        let value = metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .with_context(|| format!("/metrics has no {name}"))?;
        let lag: f64 = value
            .trim()
            .parse()
            .with_context(|| format!("{name} is {value:?}"))?;
        Ok(lag.max(0.0) as u64)
    };
    Ok((
        gauge("aether_lineage_delta_lag_events")?,
        gauge("aether_lineage_openlineage_lag_events")?,
    ))
}

async fn probe(grpc: &str, data: &Path, suite: TlsSuite) -> anyhow::Result<usize> {
    let member = MEMBERS[0];
    let mut client = ClearingClient::connect_with(
        grpc,
        &ClientTls::dev(data, load_suite(suite), Role::Member, member)?,
        &data.join("keys").join("envelope.pub.pem"),
        member,
    )
    .await?;
    client.key_exchange().await?;
    let mut rng = SplitMix(u64::MAX);
    let request = trade_request(&mut rng, member, &value_date());
    let answer = client
        .submit(&format!("probe-{}", uuid::Uuid::now_v7()), &request)
        .await
        .context("the probe trade failed")?;
    if answer.receipt.as_ref().is_none_or(|r| r.seq == 0) {
        bail!("the probe's answer has no receipt: {answer:?}");
    }
    // Ciphertext = the encoded answer plus the 16-byte GCM tag.
    Ok(answer.encoded_len() + aether_gateway::envelope::TAG_LEN)
}

/// Spawns the load client and collects its results.
async fn run_client(
    b: &ClearingBench,
    data: &Path,
    gateway: &str,
    echo: Option<&str>,
    durable: Option<&str>,
    gateway_pids: &[u32],
    database: Option<(&str, &str)>,
) -> anyhow::Result<(PhaseResult, Option<PhaseResult>, Option<PhaseResult>)> {
    let exe = std::env::current_exe().context("cannot find the aether binary")?;
    let mut cmd = tokio::process::Command::new(exe);
    let pids: Vec<String> = gateway_pids.iter().map(u32::to_string).collect();
    cmd.args(["bench", "clearing", "client", "--data-dir"])
        .arg(data)
        .args(["--gateway", gateway])
        .args(["--gateway-pid", &pids.join(",")]);
    if let Some(echo) = echo {
        cmd.args(["--echo", echo])
            .args(["--echo-pid", &std::process::id().to_string()]);
    }
    if let Some(durable) = durable {
        cmd.args(["--durable", durable])
            .args(["--durable-pid", &std::process::id().to_string()]);
    }
    cmd.args(["--concurrency", &b.concurrency.to_string()])
        .args(["--channels", &b.channels.to_string()])
        .args(["--duration-secs", &b.duration_secs.to_string()])
        .args(["--warmup-secs", &b.warmup_secs.to_string()])
        .args(["--api", b.api.name()])
        .args(["--tls-suite", b.tls_suite.name()])
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    if let Some((url, name)) = database {
        cmd.args(["--database-name", name]);
        // In the environment, not on the command line, where `ps` would show a password.
        cmd.env(POSTGRES_URL_ENV, url);
    }
    let child = cmd.spawn().context("cannot start the load client")?;
    let out = child.wait_with_output().await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut results: Vec<PhaseResult> = Vec::new();
    for line in stdout.lines() {
        if let Some(json) = line.strip_prefix(RESULT_PREFIX) {
            results.push(serde_json::from_str(json).context("unreadable client result")?);
        }
    }
    if !out.status.success() {
        bail!("the load client failed ({})", out.status);
    }
    let gateway = results
        .iter()
        .find(|r| r.target == "gateway")
        .cloned()
        .context("the load client reported no gateway result")?;
    let echo = results.iter().find(|r| r.target == "echo").cloned();
    let durable = results.into_iter().find(|r| r.target == "durable");
    Ok((gateway, echo, durable))
}

/// The report's line on PostgreSQL's checkpoints and WAL in the gateway's interval.
fn postgres_line(w: &PostgresWindow, requests: u64) -> String {
    let per_request = w
        .wal_bytes
        .checked_div(requests)
        .map_or(String::new(), |b| {
            format!(" ({:.1} KB per request)", b as f64 / 1000.0)
        });
    format!(
        "PostgreSQL in the gateway's measured interval: {} checkpoint(s), {} of them requested (WAL volume or explicit); {:.0} MB of WAL{per_request}; max_wal_size {}, checkpoint_timeout {}",
        w.checkpoints,
        w.checkpoints_requested,
        w.wal_bytes as f64 / 1e6,
        w.max_wal_size,
        w.checkpoint_timeout,
    )
}

/// CPU per answered request, µs, of each process measured in a phase: server, PostgreSQL
/// (`None` for a SQLite ledger, which has none) and client. `None` where nothing was
/// answered or the server or client was not measured.
fn cpu_per_request_us(p: &PhaseResult) -> Option<(f64, Option<f64>, f64)> {
    if p.ok == 0 {
        return None;
    }
    let us = |secs: Option<f64>| secs.map(|s| s * 1e6 / p.ok as f64);
    Some((
        us(p.server_cpu_secs)?,
        us(p.postgres_cpu_secs),
        us(p.client_cpu_secs)?,
    ))
}

/// The server's lower-priority threads' CPU per answered request, µs.
fn background_per_request_us(p: &PhaseResult) -> Option<f64> {
    let secs = p.server_background_cpu_secs?;
    (p.ok > 0).then(|| secs * 1e6 / p.ok as f64)
}

/// One phase's CPU per request as `total (server …, PostgreSQL …, client …)`; without the
/// PostgreSQL share when `database` is false (the echo: what the gateway's idle database
/// does meanwhile is not the echo's).
fn cpu_parts(p: &PhaseResult, database: bool) -> Option<(f64, String)> {
    let (server, postgres, client) = cpu_per_request_us(p)?;
    let postgres = postgres.filter(|_| database);
    let total = server + postgres.unwrap_or(0.0) + client;
    let postgres = postgres.map_or(String::new(), |us| format!(", PostgreSQL {us:.0}"));
    let background = background_per_request_us(p)
        .filter(|_| database)
        .map_or(String::new(), |us| format!(" of which lineage {us:.0}"));
    Some((
        total,
        format!("{total:.0} (server {server:.0}{background}{postgres}, client {client:.0})"),
    ))
}

/// What a request costs the machine in each phase, and the quotient of the two: with the
/// cores equally busy in both phases, the ratio to the echo is the echo's CPU per request
/// over the gateway's, whatever the latency; the figure that explains a ratio.
fn cpu_line(
    gateway: &PhaseResult,
    echo: Option<&PhaseResult>,
    durable: Option<&PhaseResult>,
) -> Option<String> {
    let (gateway_total, gateway_parts) = cpu_parts(gateway, true)?;
    let mut line = format!("CPU per request, µs: gateway {gateway_parts}");
    if let Some((durable_total, durable_parts)) = durable.and_then(|d| cpu_parts(d, true)) {
        line.push_str(&format!(
            "; durable baseline {durable_parts}; durable / gateway {:.3}",
            durable_total / gateway_total
        ));
    }
    if let Some((echo_total, echo_parts)) = echo.and_then(|e| cpu_parts(e, false)) {
        line.push_str(&format!(
            "; echo {echo_parts}; echo / gateway {:.3} (what the ratio comes to at equal machine busy)",
            echo_total / gateway_total
        ));
    }
    Some(line)
}

fn print_table(r: &Report) {
    println!(
        "\n{} build, {} cores, load average before {} / after {}; batch delay {} µs; {} API\n",
        r.build,
        r.cores,
        r.loadavg_before.as_deref().unwrap_or("?"),
        r.loadavg_after.as_deref().unwrap_or("?"),
        r.batch_delay_us,
        r.api.name()
    );
    println!(
        "| target | requests/s | p50 ms | p99 ms | p99.9 ms | max ms | shed | errors | req/resp bytes | client CPU s | server CPU s | postgres CPU s | machine busy |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let secs = |v: Option<f64>| v.map_or("—".to_owned(), |v| format!("{v:.1}"));
    for p in std::iter::once(&r.gateway)
        .chain(r.durable.iter())
        .chain(r.echo.iter())
    {
        println!(
            "| {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {}/{} | {} | {} | {} | {} |",
            p.target,
            p.requests_per_sec,
            p.p50_ms,
            p.p99_ms,
            p.p999_ms,
            p.max_ms,
            p.shed,
            p.errors.values().sum::<u64>(),
            p.request_bytes,
            p.response_bytes,
            secs(p.client_cpu_secs),
            secs(p.server_cpu_secs),
            secs(p.postgres_cpu_secs),
            p.machine_busy
                .map_or("—".to_owned(), |v| format!("{:.0} %", v * 100.0)),
        );
    }
    let g = &r.gateway;
    println!(
        "\ngateway: {} ok in {} s after {} s warm-up, {} tasks over {} channels; decisions {:?}, replayed {}, highest receipt seq {}",
        g.ok,
        g.duration_secs,
        g.warmup_secs,
        g.concurrency,
        g.channels,
        g.decisions,
        g.replayed,
        g.max_receipt_seq
    );
    println!("gateway completions per second: {:?}", g.per_second);
    println!(
        "gateway slowest answer per second, ms: [{}]",
        g.per_second_max_ms
            .iter()
            .map(|ms| format!("{ms:.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !g.errors.is_empty() {
        println!(
            "gateway errors: {:?} (first: {})",
            g.errors,
            g.first_error.as_deref().unwrap_or("")
        );
    }
    if let Some(e) = &r.echo {
        println!("echo completions per second: {:?}", e.per_second);
        if !e.errors.is_empty() {
            println!(
                "echo errors: {:?} (first: {})",
                e.errors,
                e.first_error.as_deref().unwrap_or("")
            );
        }
    }
    if let Some(l) = &r.lineage {
        println!(
            "lineage when the load stopped: Delta relay {} events behind the ledger, OpenLineage relay {}; {}",
            l.delta_events_behind,
            l.openlineage_events_behind,
            match l.caught_up_ms {
                Some(ms) => format!("both caught up {ms} ms later"),
                None => format!("not caught up after {} s", LINEAGE_CATCH_UP_LIMIT.as_secs()),
            }
        );
    }
    if let Some(w) = &g.postgres {
        println!("{}", postgres_line(w, g.ok));
    }
    if let Some(d) = &r.durable {
        if let Some(w) = &d.postgres {
            println!("durable baseline: {}", postgres_line(w, d.ok));
        }
        if !d.errors.is_empty() {
            println!(
                "durable errors: {:?} (first: {})",
                d.errors,
                d.first_error.as_deref().unwrap_or("")
            );
        }
    }
    if let Some(m) = &r.memory {
        println!(
            "server memory (RSS): idle {:.0} MiB, after the gateway phase {:.0} MiB, {} s later {:.0} MiB",
            m.idle_mib, m.after_load_mib, m.settle_secs, m.settled_mib
        );
    }
    if let Some(ratio) = r.ratio_to_durable {
        println!("ratio gateway / durable baseline: {ratio:.3}");
    }
    if let Some(ratio) = r.ratio_to_echo {
        println!("ratio gateway / echo: {ratio:.3}");
    }
    if let Some(line) = cpu_line(g, r.echo.as_ref(), r.durable.as_ref()) {
        println!("{line}");
    }
    if !r.cluster.is_empty() {
        println!(
            "\n| nodes | requests/s | p50 ms | p99 ms | p99.9 ms | errors | CPU µs/request: servers | PostgreSQL | vs one node |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        let per_request = |p: &PhaseResult, secs: Option<f64>| {
            secs.filter(|_| p.ok > 0).map_or("—".to_owned(), |s| {
                format!("{:.0}", s * 1e6 / p.ok as f64)
            })
        };
        let phases = std::iter::once((1, g, 1.0)).chain(
            r.cluster
                .iter()
                .map(|c| (c.nodes, &c.result, c.ratio_to_one_node)),
        );
        for (nodes, p, ratio) in phases {
            println!(
                "| {} | {:.0} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {:.3} |",
                nodes,
                p.requests_per_sec,
                p.p50_ms,
                p.p99_ms,
                p.p999_ms,
                p.errors.values().sum::<u64>(),
                per_request(p, p.server_cpu_secs),
                per_request(p, p.postgres_cpu_secs),
                ratio
            );
        }
    }
    println!("\n| target | measured | verdict |\n|---|---|---|");
    for v in &r.targets {
        println!(
            "| {} | {} | {} |",
            v.target,
            v.measured,
            if v.met { "met" } else { "**not met**" }
        );
    }
}

// ---------------------------------------------------------------------------------------
// The echo server: same TLS 1.3 acceptor and PKI as the gateway, no work at all.

struct Echo {
    /// Every answer is padded to this many bytes, the size of a real sealed answer.
    answer_len: usize,
}

#[tonic::async_trait]
impl ClearingService for Echo {
    async fn key_exchange(
        &self,
        _request: Request<KeyExchangeRequest>,
    ) -> Result<Response<KeyExchangeResponse>, Status> {
        Ok(Response::new(KeyExchangeResponse {
            key_id: "echo".into(),
            expires_at_unix_ms: i64::MAX,
            max_uses: u64::MAX,
        }))
    }

    async fn submit(
        &self,
        request: Request<SealedRequest>,
    ) -> Result<Response<SealedResponse>, Status> {
        Ok(Response::new(echo(request.into_inner(), self.answer_len)))
    }

    async fn submit_batch(
        &self,
        _request: Request<SealedBatchRequest>,
    ) -> Result<Response<SealedBatchResponse>, Status> {
        Err(Status::unimplemented(
            "the echo server answers Submit and SubmitStream only",
        ))
    }

    type SubmitStreamStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<SealedResponse, Status>> + Send>>;

    /// Each message answered in order, as `Submit` answers it.
    async fn submit_stream(
        &self,
        request: Request<Streaming<SealedRequest>>,
    ) -> Result<Response<Self::SubmitStreamStream>, Status> {
        use futures::StreamExt;
        let answer_len = self.answer_len;
        let answers = request
            .into_inner()
            .map(move |sealed| sealed.map(|s| echo(s, answer_len)));
        Ok(Response::new(Box::pin(answers)))
    }
}

/// The echo's answer: the request's ciphertext, padded to `answer_len`.
fn echo(sealed: SealedRequest, answer_len: usize) -> SealedResponse {
    let mut ciphertext = sealed.ciphertext;
    ciphertext.resize(ciphertext.len().max(answer_len), 0);
    SealedResponse {
        request_id: sealed.request_id,
        nonce: sealed.nonce,
        ciphertext,
        issued_at: sealed.issued_at,
        error: None,
    }
}

/// Serves the echo on a free port with the server's own certificate from `data`.
async fn start_echo(
    data: &Path,
    answer_len: usize,
    suite: TlsSuite,
) -> anyhow::Result<(String, tokio::sync::watch::Sender<bool>)> {
    crate::tls_server::serve(Echo { answer_len }, data, suite, "the echo server").await
}

// ---------------------------------------------------------------------------------------
// The load client

async fn client_main(args: ClientArgs) -> anyhow::Result<()> {
    if args.concurrency == 0 || args.channels == 0 || args.duration_secs == 0 {
        bail!("--concurrency, --channels and --duration-secs must be positive");
    }
    let pem = std::fs::read_to_string(args.data_dir.join("keys").join("envelope.pub.pem"))
        .context("cannot read the gateway's envelope public key")?;
    let server_key = Arc::new(
        sm2::PublicKey::from_public_key_pem(&pem)
            .map_err(|e| anyhow::anyhow!("the envelope public key is unusable: {e}"))?,
    );
    let run_id = uuid::Uuid::now_v7().simple().to_string();
    let mut targets = Vec::new();
    if let Some(echo) = &args.echo {
        targets.push((
            Target::Echo,
            echo.clone(),
            args.echo_pid.into_iter().collect(),
        ));
    }
    if let Some(durable) = &args.durable {
        targets.push((
            Target::Durable,
            durable.clone(),
            args.durable_pid.into_iter().collect(),
        ));
    }
    targets.push((
        Target::Gateway,
        args.gateway.clone(),
        args.gateway_pid.clone(),
    ));
    for (i, (target, url, pid)) in targets.into_iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        eprintln!(
            "{}: {} tasks over {} channels, {} s warm-up + {} s measured…",
            target.name(),
            args.concurrency,
            channels_over(args.channels, &url),
            args.warmup_secs,
            args.duration_secs
        );
        let result = phase(&args, target, &url, &pid, server_key.clone(), &run_id).await?;
        println!("{RESULT_PREFIX}{}", serde_json::to_string(&result)?);
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Gateway,
    Echo,
    Durable,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Gateway => "gateway",
            Target::Echo => "echo",
            Target::Durable => "durable",
        }
    }
}

/// What one task saw in the measured interval.
#[derive(Default)]
struct TaskStats {
    latencies_us: Vec<u32>,
    per_second: Vec<u64>,
    per_second_max_us: Vec<u32>,
    shed: u64,
    errors: BTreeMap<String, u64>,
    first_error: Option<String>,
    request_bytes: u64,
    response_bytes: u64,
    decisions: BTreeMap<String, u64>,
    replayed: u64,
    max_receipt_seq: u64,
}

impl TaskStats {
    fn for_secs(secs: u64) -> Self {
        TaskStats {
            per_second: vec![0; secs as usize],
            per_second_max_us: vec![0; secs as usize],
            ..TaskStats::default()
        }
    }
}

/// The suites the load offers: the server's, but the standard ones against `both` (the
/// members a mixed server serves mostly speak those).
fn load_suite(server: TlsSuite) -> TlsSuite {
    match server {
        TlsSuite::Gm => TlsSuite::Gm,
        TlsSuite::Standard | TlsSuite::Both => TlsSuite::Standard,
    }
}

async fn connect(
    url: &str,
    data: &Path,
    member: &str,
    suite: TlsSuite,
) -> anyhow::Result<ClearingServiceClient<Channel>> {
    let tls = ClientTls::dev(data, load_suite(suite), Role::Member, member)?;
    let channel = tls.connect(url).await?;
    Ok(ClearingServiceClient::new(channel))
}

/// The channels opened to the gateways of `urls` (comma-separated): as many on each node
/// of a cluster — 4 over 3 nodes would give one node half the load — so `wanted` rounded
/// up to a multiple of the nodes (6 there).
fn channels_over(wanted: usize, urls: &str) -> usize {
    let nodes = urls.split(',').filter(|u| !u.is_empty()).count().max(1);
    wanted.div_ceil(nodes) * nodes
}

async fn phase(
    args: &ClientArgs,
    target: Target,
    url: &str,
    server_pids: &[u32],
    server_key: Arc<sm2::PublicKey>,
    run_id: &str,
) -> anyhow::Result<PhaseResult> {
    let urls: Vec<&str> = url.split(',').filter(|u| !u.is_empty()).collect();
    // One session key per channel, shared by its tasks, as a member's client would: the
    // gateway keeps at most 64 keys per member and retires the oldest past that.
    let channel_count = channels_over(args.channels, url);
    let mut channels = Vec::with_capacity(channel_count);
    for i in 0..channel_count {
        let member = MEMBERS[i % MEMBERS.len()];
        let url = urls[i % urls.len().max(1)];
        let mut grpc = connect(url, &args.data_dir, member, args.tls_suite).await?;
        let session = Arc::new(ChannelSession {
            current: std::sync::RwLock::new(exchange_key(&mut grpc, &server_key).await?),
            rekeying: tokio::sync::Mutex::new(()),
            server_key: server_key.clone(),
        });
        channels.push((grpc, member, session));
    }
    let measure_from = tokio::time::Instant::now() + Duration::from_secs(args.warmup_secs);
    let measure_to = measure_from + Duration::from_secs(args.duration_secs);
    let date = value_date();
    let mut tasks = Vec::with_capacity(args.concurrency);
    for t in 0..args.concurrency {
        let (grpc, member, session) = channels[t % channels.len()].clone();
        let ctx = TaskCtx {
            grpc,
            member,
            session,
            target,
            prefix: format!("{run_id}-{}-{t}", target.name()),
            seed: t as u64,
            date: date.clone(),
            measure_from,
            measure_to,
            secs: args.duration_secs,
            api: args.api,
        };
        tasks.push(tokio::spawn(load_task(ctx)));
    }
    // The server's database, for the gateway: its checkpoints and WAL in the interval.
    let mut postgres = match (target, std::env::var(POSTGRES_URL_ENV)) {
        (Target::Gateway | Target::Durable, Ok(url)) => Some(
            sqlx::PgConnection::connect(&url)
                .await
                .context("cannot connect to the server's database")?,
        ),
        _ => None,
    };
    // CPU use over the measured interval only.
    tokio::time::sleep_until(measure_from).await;
    let database = args.database_name.as_deref();
    let before = CpuSnapshot::take(server_pids, database);
    let wal_before = match postgres.as_mut() {
        Some(conn) => Some(WalSnapshot::take(conn).await?),
        None => None,
    };
    tokio::time::sleep_until(measure_to).await;
    let after = CpuSnapshot::take(server_pids, database);
    let postgres = match (postgres.as_mut(), wal_before) {
        (Some(conn), Some(before)) => Some(WalSnapshot::take(conn).await?.since(&before)),
        _ => None,
    };
    let mut all = TaskStats::for_secs(args.duration_secs);
    for task in tasks {
        let s = task.await.context("a load task panicked")??;
        all.latencies_us.extend(s.latencies_us);
        for (a, b) in all.per_second.iter_mut().zip(&s.per_second) {
            *a += b;
        }
        for (a, b) in all.per_second_max_us.iter_mut().zip(&s.per_second_max_us) {
            *a = (*a).max(*b);
        }
        all.shed += s.shed;
        for (k, v) in s.errors {
            *all.errors.entry(k).or_default() += v;
        }
        all.first_error = all.first_error.or(s.first_error);
        all.request_bytes += s.request_bytes;
        all.response_bytes += s.response_bytes;
        for (k, v) in s.decisions {
            *all.decisions.entry(k).or_default() += v;
        }
        all.replayed += s.replayed;
        all.max_receipt_seq = all.max_receipt_seq.max(s.max_receipt_seq);
    }
    let mut lat = all.latencies_us;
    lat.sort_unstable();
    let ok = lat.len() as u64;
    let pct = |p: f64| -> f64 {
        if lat.is_empty() {
            return 0.0;
        }
        // Nearest rank: the smallest value with at least p of the samples at or below it.
        let rank = ((p * lat.len() as f64).ceil() as usize).clamp(1, lat.len());
        f64::from(lat[rank - 1]) / 1000.0
    };
    let mean_ms = if lat.is_empty() {
        0.0
    } else {
        lat.iter().map(|&l| u64::from(l)).sum::<u64>() as f64 / lat.len() as f64 / 1000.0
    };
    let cpu = |f: fn(&CpuSnapshot) -> Option<u64>| -> Option<f64> {
        Some((f(&after)?.saturating_sub(f(&before)?)) as f64 / CLOCK_TICKS)
    };
    let machine_busy = match (before.machine, after.machine) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => {
            Some(b1.saturating_sub(b0) as f64 / (t1 - t0) as f64)
        }
        _ => None,
    };
    Ok(PhaseResult {
        target: target.name().into(),
        concurrency: args.concurrency,
        channels: channel_count,
        warmup_secs: args.warmup_secs,
        duration_secs: args.duration_secs,
        ok,
        requests_per_sec: ok as f64 / args.duration_secs as f64,
        mean_ms,
        p50_ms: pct(0.5),
        p90_ms: pct(0.9),
        p99_ms: pct(0.99),
        p999_ms: pct(0.999),
        max_ms: lat.last().map_or(0.0, |&l| f64::from(l) / 1000.0),
        shed: all.shed,
        errors: all.errors,
        first_error: all.first_error,
        request_bytes: all.request_bytes.checked_div(ok).unwrap_or(0),
        response_bytes: all.response_bytes.checked_div(ok).unwrap_or(0),
        decisions: all.decisions,
        replayed: all.replayed,
        max_receipt_seq: all.max_receipt_seq,
        per_second: all.per_second,
        per_second_max_ms: all
            .per_second_max_us
            .iter()
            .map(|&us| f64::from(us) / 1000.0)
            .collect(),
        client_cpu_secs: cpu(|s| s.client),
        server_cpu_secs: cpu(|s| s.server),
        server_background_cpu_secs: cpu(|s| s.server_background),
        postgres_cpu_secs: cpu(|s| s.postgres),
        machine_busy,
        postgres,
    })
}

/// A channel's session key, shared by its tasks, and replaced when the server says it is
/// used up (as a member's client does: a new `KeyExchange`), by one task for all.
struct ChannelSession {
    current: std::sync::RwLock<Arc<(Sm4Key, String)>>,
    rekeying: tokio::sync::Mutex<()>,
    server_key: Arc<sm2::PublicKey>,
}

impl ChannelSession {
    fn current(&self) -> Arc<(Sm4Key, String)> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// A new key for the channel unless another task already replaced `used_up`.
    async fn rekey(
        &self,
        grpc: &mut ClearingServiceClient<Channel>,
        used_up: &str,
    ) -> anyhow::Result<()> {
        let _one_at_a_time = self.rekeying.lock().await;
        if self.current().1 != used_up {
            return Ok(());
        }
        let fresh = exchange_key(grpc, &self.server_key).await?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
        Ok(())
    }
}

/// A fresh SM4 key, sealed to the server's envelope key and registered by `KeyExchange`.
async fn exchange_key(
    grpc: &mut ClearingServiceClient<Channel>,
    server_key: &sm2::PublicKey,
) -> anyhow::Result<Arc<(Sm4Key, String)>> {
    let key = Sm4Key::generate()?;
    let wrapped = wrap_key(server_key, &key)?;
    let key_id = grpc
        .key_exchange(KeyExchangeRequest {
            wrapped_key: wrapped.to_vec(),
        })
        .await
        .context("KeyExchange failed")?
        .into_inner()
        .key_id;
    Ok(Arc::new((key, key_id)))
}

struct TaskCtx {
    grpc: ClearingServiceClient<Channel>,
    member: &'static str,
    /// The channel's session key and its id.
    session: Arc<ChannelSession>,
    target: Target,
    prefix: String,
    seed: u64,
    date: String,
    measure_from: tokio::time::Instant,
    measure_to: tokio::time::Instant,
    secs: u64,
    api: Api,
}

/// How one task sends its requests: a unary call each, or on its own open stream.
struct Caller {
    grpc: ClearingServiceClient<Channel>,
    api: Api,
    /// The open stream (`Api::Stream`): where requests go and where answers come back.
    stream: Option<(
        tokio::sync::mpsc::Sender<SealedRequest>,
        Streaming<SealedResponse>,
    )>,
}

impl Caller {
    /// Sends one request and waits for its answer. On a stream, a failed request ends the
    /// stream (the gateway's contract), so the next call opens a new one.
    async fn call(&mut self, request: SealedRequest) -> Result<SealedResponse, Status> {
        if self.api == Api::Unary {
            return self.grpc.submit(request).await.map(Response::into_inner);
        }
        let request = match &self.stream {
            Some((tx, _)) => tx.send(request).await.err().map(|e| e.0),
            None => Some(request),
        };
        if let Some(first) = request {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            // Queued before the call so that the stream opens with a message in it.
            let _ = tx.send(first).await;
            let answers = self
                .grpc
                .submit_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await?
                .into_inner();
            self.stream = Some((tx, answers));
        }
        let Some((_, answers)) = &mut self.stream else {
            return Err(Status::internal("no stream"));
        };
        match answers.message().await {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => {
                self.stream = None;
                Err(Status::unavailable("the server ended the stream"))
            }
            Err(status) => {
                self.stream = None;
                Err(status)
            }
        }
    }
}

/// One closed-loop task: one request at a time, under its channel's session key, until
/// the end.
async fn load_task(c: TaskCtx) -> anyhow::Result<TaskStats> {
    let mut stats = TaskStats::for_secs(c.secs);
    let mut caller = Caller {
        grpc: c.grpc.clone(),
        api: c.api,
        stream: None,
    };
    let mut rng = SplitMix(c.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xA5A5);
    let mut n = 0u64;
    while tokio::time::Instant::now() < c.measure_to {
        n += 1;
        let session = c.session.current();
        let (key, key_id) = (&session.0, &session.1);
        let request_id = format!("{}-{n}", c.prefix);
        let body = trade_request(&mut rng, c.member, &c.date).encode_to_vec();
        let begun = tokio::time::Instant::now();
        let issued_at = unix_now();
        let aad = Aad {
            direction: Direction::Request,
            method: c.api.method(),
            request_id: &request_id,
            member_id: c.member,
            key_id,
            issued_at,
        };
        let sealed = seal(key, &aad, &body)?;
        let request_bytes = sealed.ciphertext.len() as u64;
        let call = caller
            .call(SealedRequest {
                member_id: c.member.to_owned(),
                request_id: request_id.clone(),
                key_id: key_id.clone(),
                nonce: sealed.nonce.to_vec(),
                ciphertext: sealed.ciphertext,
                issued_at,
            })
            .await;
        let outcome = match call {
            Ok(response) => {
                let size = response.ciphertext.len() as u64;
                match c.target {
                    Target::Echo => {
                        if response.request_id == request_id {
                            Ok((size, None))
                        } else {
                            Err(("BAD_ANSWER".to_owned(), "wrong request id".to_owned()))
                        }
                    }
                    // A stream item the gateway refused on its own (`SealedResponse.error`).
                    Target::Gateway | Target::Durable if response.error.is_some() => {
                        let e = response.error.unwrap_or_default();
                        Err((format!("ITEM_{}", e.code), e.message))
                    }
                    Target::Gateway | Target::Durable => open(
                        key,
                        &aad.response(response.issued_at),
                        &response.nonce,
                        &response.ciphertext,
                    )
                    .map_err(|e| e.to_string())
                    .and_then(|p| ClearingAnswer::decode(p.as_slice()).map_err(|e| e.to_string()))
                    .map(|a| (size, Some(a)))
                    .map_err(|e| ("BAD_ANSWER".to_owned(), e)),
                }
            }
            Err(status) => Err((code_name(status.code()), status.message().to_owned())),
        };
        let done = tokio::time::Instant::now();
        let measured = done >= c.measure_from && done < c.measure_to;
        match outcome {
            Ok((size, answer)) => {
                if !measured {
                    continue;
                }
                let micros = done.duration_since(begun).as_micros();
                let micros = u32::try_from(micros).unwrap_or(u32::MAX);
                stats.latencies_us.push(micros);
                let second = done.duration_since(c.measure_from).as_secs() as usize;
                if let Some(slot) = stats.per_second.get_mut(second) {
                    *slot += 1;
                }
                if let Some(slot) = stats.per_second_max_us.get_mut(second) {
                    *slot = (*slot).max(micros);
                }
                stats.request_bytes += request_bytes;
                stats.response_bytes += size;
                if let Some(a) = answer {
                    let name = Decision::try_from(a.decision)
                        .map(|d| d.as_str_name().to_owned())
                        .unwrap_or_else(|_| a.decision.to_string());
                    *stats.decisions.entry(name).or_default() += 1;
                    stats.replayed += u64::from(a.replayed);
                    if let Some(r) = &a.receipt {
                        stats.max_receipt_seq = stats.max_receipt_seq.max(r.seq);
                    }
                }
            }
            // The channel's key reached the uses the server allows it: a new one for the
            // channel, and the request is sent again as a new one (not a failure).
            Err((_, message)) if message.contains("send a new KeyExchange") => {
                c.session.rekey(&mut caller.grpc, key_id).await?;
            }
            Err((code, message)) => {
                if measured {
                    if code == "RESOURCE_EXHAUSTED" {
                        stats.shed += 1;
                    } else {
                        *stats.errors.entry(code.clone()).or_default() += 1;
                    }
                    if stats.first_error.is_none() {
                        stats.first_error = Some(format!("{code}: {message}"));
                    }
                }
                // A refused request is retried as a new one after a short pause, so that a
                // failing server is not hammered in a tight loop.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
    Ok(stats)
}

/// `RESOURCE_EXHAUSTED` for `Code::ResourceExhausted`.
fn code_name(code: tonic::Code) -> String {
    let mut out = String::new();
    for (i, ch) in format!("{code:?}").chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

/// `sysconf(_SC_CLK_TCK)` on Linux x86-64 and aarch64.
const CLOCK_TICKS: f64 = 100.0;

/// The scratch database's URL, handed to the load client.
const POSTGRES_URL_ENV: &str = "AETHER_BENCH_POSTGRES_URL";

/// PostgreSQL's cumulative checkpoint counts and WAL position at one moment.
struct WalSnapshot {
    checkpoints: u64,
    requested: u64,
    wal_lsn: u64,
    max_wal_size: String,
    checkpoint_timeout: String,
}

impl WalSnapshot {
    async fn take(conn: &mut sqlx::PgConnection) -> anyhow::Result<WalSnapshot> {
        // PostgreSQL 17 moved the counts to `pg_stat_checkpointer`.
        let counts = if server_version(conn).await? >= 170_000 {
            "SELECT num_timed + num_requested, num_requested FROM pg_stat_checkpointer"
        } else {
            "SELECT checkpoints_timed + checkpoints_req, checkpoints_req FROM pg_stat_bgwriter"
        };
        let (checkpoints, requested): (i64, i64) = sqlx::query_as(counts)
            .fetch_one(&mut *conn)
            .await
            .context("cannot read PostgreSQL's checkpoint counts")?;
        let (wal_lsn, max_wal_size, checkpoint_timeout): (i64, String, String) = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, \
                    current_setting('max_wal_size'), current_setting('checkpoint_timeout')",
        )
        .fetch_one(&mut *conn)
        .await
        .context("cannot read PostgreSQL's WAL position")?;
        Ok(WalSnapshot {
            checkpoints: u64::try_from(checkpoints).unwrap_or(0),
            requested: u64::try_from(requested).unwrap_or(0),
            wal_lsn: u64::try_from(wal_lsn).unwrap_or(0),
            max_wal_size,
            checkpoint_timeout,
        })
    }

    fn since(&self, before: &WalSnapshot) -> PostgresWindow {
        PostgresWindow {
            checkpoints: self.checkpoints.saturating_sub(before.checkpoints),
            checkpoints_requested: self.requested.saturating_sub(before.requested),
            wal_bytes: self.wal_lsn.saturating_sub(before.wal_lsn),
            max_wal_size: self.max_wal_size.clone(),
            checkpoint_timeout: self.checkpoint_timeout.clone(),
        }
    }
}

async fn server_version(conn: &mut sqlx::PgConnection) -> anyhow::Result<i64> {
    let (version,): (String,) = sqlx::query_as("SHOW server_version_num")
        .fetch_one(&mut *conn)
        .await
        .context("cannot read PostgreSQL's version")?;
    version
        .parse()
        .with_context(|| format!("unexpected server_version_num {version:?}"))
}

struct CpuSnapshot {
    client: Option<u64>,
    server: Option<u64>,
    /// The server's threads named by `serve`'s background runtime.
    server_background: Option<u64>,
    postgres: Option<u64>,
    /// (busy, total) jiffies of all cores.
    machine: Option<(u64, u64)>,
}

impl CpuSnapshot {
    /// `servers`: the server processes (several nodes: summed).
    fn take(servers: &[u32], database: Option<&str>) -> CpuSnapshot {
        let sum = |ticks: &dyn Fn(u32) -> Option<u64>| {
            servers
                .iter()
                .map(|p| ticks(*p))
                .try_fold(0, |total, t| t.map(|t| total + t))
                .filter(|_| !servers.is_empty())
        };
        CpuSnapshot {
            client: process_ticks("self"),
            server: sum(&|p| process_ticks(&p.to_string())),
            server_background: sum(&background_ticks),
            postgres: database.and_then(postgres_ticks),
            machine: machine_ticks(),
        }
    }
}

/// utime + stime of the server's background threads (`aether-background`, which
/// `/proc` cuts to 15 bytes), in clock ticks; `None` for a server without them.
fn background_ticks(pid: u32) -> Option<u64> {
    let mut total = None;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))
        .ok()?
        .flatten()
    {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim_end() == "aether-backgrou"
            && let Some(ticks) = stat_ticks(&entry.path().join("stat"))
        {
            *total.get_or_insert(0) += ticks;
        }
    }
    total
}

/// utime + stime of a process, in clock ticks.
fn process_ticks(pid: &str) -> Option<u64> {
    stat_ticks(std::path::Path::new(&format!("/proc/{pid}/stat")))
}

/// utime + stime from a `/proc` stat file (a process's or a thread's), in clock ticks.
fn stat_ticks(path: &std::path::Path) -> Option<u64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line: 11 and 12 after the name.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// CPU of the PostgreSQL backends serving `database` (their process titles name it).
/// Shared background processes (WAL writer, checkpointer) are not counted.
fn postgres_ticks(database: &str) -> Option<u64> {
    let mut total = 0;
    let mut found = false;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim() != "postgres" {
            continue;
        }
        let title = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&title).contains(database)
            && let Some(t) = process_ticks(pid)
        {
            total += t;
            found = true;
        }
    }
    found.then_some(total)
}

fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

fn loadavg() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::parse_response;

    #[test]
    fn every_node_of_a_cluster_gets_as_many_channels() {
        assert_eq!(channels_over(4, "https://a:1"), 4);
        assert_eq!(channels_over(4, "https://a:1,https://b:2"), 4);
        assert_eq!(channels_over(4, "https://a:1,https://b:2,https://c:3"), 6);
        assert_eq!(channels_over(1, "https://a:1,https://b:2,https://c:3"), 3);
    }

    #[tokio::test]
    async fn the_postgres_window_counts_checkpoints_and_wal() {
        let url = aether_ledger::testing::admin_url();
        let mut conn = sqlx::PgConnection::connect(&url)
            .await
            .expect("tests need PostgreSQL (scripts/test.sh provides one)");
        let before = WalSnapshot::take(&mut conn).await.expect("first snapshot");
        sqlx::raw_sql("CHECKPOINT")
            .execute(&mut conn)
            .await
            .expect("CHECKPOINT (the tests connect as a superuser)");
        let window = WalSnapshot::take(&mut conn)
            .await
            .expect("second snapshot")
            .since(&before);
        assert!(
            window.checkpoints >= 1 && window.checkpoints_requested >= 1,
            "an explicit CHECKPOINT is counted as a requested one: {window:?}"
        );
        assert!(
            window.wal_bytes > 0,
            "the checkpoint record is WAL: {window:?}"
        );
        assert!(!window.max_wal_size.is_empty() && !window.checkpoint_timeout.is_empty());
    }

    #[test]
    fn the_cpu_line_divides_each_process_by_the_answered_requests() {
        let phase = |ok, server, postgres, client| PhaseResult {
            ok,
            server_cpu_secs: server,
            postgres_cpu_secs: postgres,
            client_cpu_secs: client,
            ..PhaseResult::default()
        };
        let gateway = phase(10_000, Some(1.8), Some(0.75), Some(0.3));
        // The gateway's idle database during the echo's phase is not the echo's.
        let echo = phase(100_000, Some(1.3), Some(0.1), Some(1.2));
        assert_eq!(
            cpu_line(&gateway, Some(&echo), None).as_deref(),
            Some(
                "CPU per request, µs: gateway 285 (server 180, PostgreSQL 75, client 30); \
                 echo 25 (server 13, client 12); echo / gateway 0.088 (what the ratio comes to at equal machine busy)"
            )
        );
        assert_eq!(
            cpu_line(&gateway, None, None).as_deref(),
            Some("CPU per request, µs: gateway 285 (server 180, PostgreSQL 75, client 30)")
        );
        // The server's lineage threads, when measured, as part of the server's figure.
        let with_lineage = PhaseResult {
            server_background_cpu_secs: Some(0.4),
            ..phase(10_000, Some(1.8), Some(0.75), Some(0.3))
        };
        assert_eq!(
            cpu_line(&with_lineage, None, None).as_deref(),
            Some(
                "CPU per request, µs: gateway 285 (server 180 of which lineage 40, PostgreSQL 75, client 30)"
            )
        );
        // Nothing answered, or a process not measured: no line rather than a wrong one.
        assert_eq!(
            cpu_line(&phase(0, Some(1.0), Some(1.0), Some(1.0)), None, None),
            None
        );
        assert_eq!(
            cpu_line(&phase(10, None, Some(1.0), Some(1.0)), None, None),
            None
        );
        // A SQLite ledger: no PostgreSQL share to print.
        assert_eq!(
            cpu_line(&phase(4, Some(0.002), None, Some(0.001)), None, None).as_deref(),
            Some("CPU per request, µs: gateway 750 (server 500, client 250)")
        );
        let echo_unmeasured = phase(100_000, None, None, Some(1.2));
        assert!(
            !cpu_line(&gateway, Some(&echo_unmeasured), None)
                .expect("the gateway's line")
                .contains("echo")
        );
    }

    #[test]
    fn the_postgres_line_gives_wal_per_request_only_when_there_were_requests() {
        let w = PostgresWindow {
            checkpoints: 2,
            checkpoints_requested: 2,
            wal_bytes: 1_070_000_000,
            max_wal_size: "1GB".into(),
            checkpoint_timeout: "5min".into(),
        };
        let line = postgres_line(&w, 200_000);
        assert!(
            line.contains("2 checkpoint(s), 2 of them requested"),
            "{line}"
        );
        assert!(
            line.contains("1070 MB of WAL (5.3 KB per request)"),
            "{line}"
        );
        assert!(
            line.contains("max_wal_size 1GB, checkpoint_timeout 5min"),
            "{line}"
        );
        assert!(!postgres_line(&w, 0).contains("per request"));
    }

    #[test]
    fn responses_are_parsed_plain_and_chunked() {
        let plain = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(plain).ok(), Some((201, "{}".to_owned())));
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(
            parse_response(chunked).ok(),
            Some((200, "abcde".to_owned()))
        );
        assert!(parse_response(b"HTTP/1.1 200").is_err());
    }

    #[test]
    fn lineage_lags_are_read_from_the_metrics_text() {
        let text = "# TYPE aether_lineage_delta_lag_events gauge\n\
                    aether_lineage_delta_lag_events 1234\n\
                    aether_lineage_delta_lag_events_total 9\n\
                    # TYPE aether_lineage_openlineage_lag_events gauge\n\
                    aether_lineage_openlineage_lag_events 0\n";
        assert_eq!(lag_gauges(text).unwrap(), (1234, 0));
        let missing = lag_gauges("aether_lineage_delta_lag_events 3\n").unwrap_err();
        assert!(missing.to_string().contains("openlineage"), "{missing}");
    }

    #[test]
    fn code_names_are_grpc_names() {
        assert_eq!(
            code_name(tonic::Code::ResourceExhausted),
            "RESOURCE_EXHAUSTED"
        );
        assert_eq!(code_name(tonic::Code::Unavailable), "UNAVAILABLE");
    }

    #[test]
    fn trades_are_valid() {
        let mut rng = SplitMix(7);
        for _ in 0..1000 {
            let r = trade_request(&mut rng, "bank-a", "2026-12-04");
            let t = r.trade.unwrap_or_default();
            assert!(t.amount_minor >= 10_000 && t.amount_minor < 17_000_000);
            assert_ne!(t.buyer, t.seller);
            assert!((1..=3).contains(&t.counterparty_tier));
        }
    }
}

//! `aether cluster chaos`: a cluster of real `aether serve` nodes on one scratch PostgreSQL
//! database (and, with `s3s-fs`, the Delta tables on an S3-compatible server), under
//! clearing, event, policy, snapshot and rollback load through every node, with a random node SIGKILLed and
//! restarted every few seconds. At the end it checks what a clearing house would: every
//! acknowledged event, policy version, decision, snapshot and rollback present exactly once, `aether verify`
//! OK with the one cluster key, the Delta `events` table equal to the ledger, every
//! OpenLineage record written; and it reports how long each duty was unowned after its
//! holder was killed. Exit status 1 when a check fails.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_gateway::certs::PkiLayout;
use aether_gateway::client::ClearingClient;
use aether_gateway::identity::Role;
use aether_gateway::tls::TlsPaths;
use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};

use crate::node::{ServeChild, copy_dir, http_request, post_json, setup_engine};
use crate::scratch::Scratch;
use crate::trades::{MEMBERS, SplitMix, trade_request, value_date};

#[derive(Args)]
pub struct ChaosArgs {
    /// PostgreSQL server (a scratch database is created and dropped; needs CREATE DATABASE).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Nodes in the cluster (1: a lone node, killed and restarted under the same load).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=5))]
    nodes: u64,
    /// How long the load and the kills go on, seconds.
    #[arg(long, default_value_t = 120)]
    duration_secs: u64,
    /// A random node is SIGKILLed (and restarted) this often, seconds.
    #[arg(long, default_value_t = 10)]
    kill_every_secs: u64,
    /// How long a killed node stays down before it is started again, milliseconds (its
    /// duties pass to another node once their leases expire).
    #[arg(long, default_value_t = 3000)]
    down_ms: u64,
    /// The nodes' lease ttl, milliseconds.
    #[arg(long, default_value_t = 1500)]
    lease_ttl_ms: u64,
    /// An `s3s-fs` binary: the Delta tables then go on an S3-compatible server started for
    /// the run. Without it they are in a directory every node shares.
    #[arg(long, env = "AETHER_S3S_FS")]
    s3s_fs: Option<PathBuf>,
    /// Seed of the kills and the trades (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Kill in the transitions too: the kills take turns between a running node, one
    /// stopping (SIGTERM, then SIGKILL 20-300 ms later, mid-drain) and one starting (its
    /// restart SIGKILLed 100-800 ms after the spawn, then started again).
    #[arg(long)]
    in_transitions: bool,
}

/// Where in a node's life a kill lands.
#[derive(Clone, Copy, Debug)]
enum KillPhase {
    Running,
    Stopping,
    Starting,
}

impl KillPhase {
    fn of(kill: usize, in_transitions: bool) -> KillPhase {
        match (in_transitions, kill % 3) {
            (true, 1) => KillPhase::Stopping,
            (true, 2) => KillPhase::Starting,
            _ => KillPhase::Running,
        }
    }
}

const OPERATOR: &str = "chaos-operator-token-0000000000000";
const REGULATOR: &str = "chaos-regulator-token-000000000000";
/// The duties whose unowned time is reported.
const DUTIES: [&str; 4] = [
    "checkpointer",
    "lineage-openlineage",
    "lineage-delta",
    "rollout-controller",
];
const POLICY: &str = "chaos_load";

/// A node's addresses while it runs.
#[derive(Clone)]
struct Endpoint {
    http: String,
    grpc: String,
}

/// What the load saw acknowledged, and the live nodes it sends to.
#[derive(Default)]
struct Shared {
    live: Vec<Option<Endpoint>>,
    events: Vec<String>,
    policies: Vec<String>,
    decisions: Vec<String>,
    /// Snapshot ids committed, and the seqs of the rollbacks answered.
    snapshots: Vec<String>,
    rollbacks: Vec<u64>,
    retries: u64,
}

type State = Arc<Mutex<Shared>>;

fn pick(state: &State, rng: &mut SplitMix) -> Option<(usize, Endpoint)> {
    let shared = state.lock().ok()?;
    let live: Vec<(usize, &Endpoint)> = shared
        .live
        .iter()
        .enumerate()
        .filter_map(|(i, e)| e.as_ref().map(|e| (i, e)))
        .collect();
    if live.is_empty() {
        return None;
    }
    let (i, e) = live[rng.below(live.len() as u64) as usize];
    Some((i, e.clone()))
}

fn record(state: &State, what: impl FnOnce(&mut Shared)) {
    if let Ok(mut shared) = state.lock() {
        what(&mut shared);
    }
}

struct S3 {
    /// Killed when the run ends (`kill_on_drop`).
    _child: tokio::process::Child,
    env: Vec<(String, String)>,
}

/// Starts `s3s-fs` on a free port with the bucket `aether` under `root`.
async fn start_s3(binary: &Path, root: &Path) -> anyhow::Result<S3> {
    std::fs::create_dir_all(root.join("aether"))?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let (key, secret) = ("chaos", "chaos-secret-key");
    let child = tokio::process::Command::new(binary)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", key, "--secret-key", secret])
        .arg(root)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))?;
    let started = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        if started.elapsed() > Duration::from_secs(20) {
            bail!("{} did not listen on port {port}", binary.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let env = [
        ("AWS_ACCESS_KEY_ID", key.to_owned()),
        ("AWS_SECRET_ACCESS_KEY", secret.to_owned()),
        ("AWS_REGION", "us-east-1".to_owned()),
        ("AWS_ENDPOINT", format!("http://127.0.0.1:{port}")),
        ("AWS_ALLOW_HTTP", "true".to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    Ok(S3 { _child: child, env })
}

struct Cluster {
    url: String,
    tmp: PathBuf,
    ttl: String,
    delta_uri: String,
    aws: Vec<(String, String)>,
    children: Vec<Option<ServeChild>>,
}

impl Cluster {
    fn data(&self, i: usize) -> PathBuf {
        self.tmp.join(format!("node-{i}"))
    }

    async fn start(&self, i: usize) -> anyhow::Result<ServeChild> {
        let id = format!("node-{i}");
        let mut env: Vec<(&str, &str)> = vec![
            ("AETHER_NODE_ID", id.as_str()),
            ("AETHER_LEASE_TTL_MS", self.ttl.as_str()),
            ("AETHER_CHECKPOINT_EVERY_SECS", "1"),
            ("AETHER_DELTA_URI", self.delta_uri.as_str()),
        ];
        env.extend(self.aws.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let data = self.data(i);
        ServeChild::start_with_env(
            &data,
            &self.tmp.join(format!("node-{i}.log")),
            Some(&self.url),
            Some(&format!("operator:{OPERATOR},regulator:{REGULATOR}")),
            2_000,
            "warn",
            &env,
        )
        .await
        .with_context(|| format!("cannot start {id} (log: {}.log)", data.display()))
    }
}

pub async fn run(args: ChaosArgs) -> anyhow::Result<std::process::ExitCode> {
    if !args.database_url.starts_with("postgres") {
        bail!("a cluster needs PostgreSQL: pass --database-url postgres://…");
    }
    let scratch = Scratch::new(&args.database_url).await?;
    let tmp = tempfile::tempdir()?;
    let result = chaos(&args, &scratch.url, tmp.path()).await;
    scratch.drop().await;
    let failures = result?;
    if failures.is_empty() {
        println!("chaos: every check passed");
        Ok(std::process::ExitCode::SUCCESS)
    } else {
        for failure in &failures {
            println!("FAILED: {failure}");
        }
        Ok(std::process::ExitCode::FAILURE)
    }
}

async fn chaos(args: &ChaosArgs, url: &str, tmp: &Path) -> anyhow::Result<Vec<String>> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let s3 = match &args.s3s_fs {
        Some(binary) => Some(start_s3(binary, &tmp.join("s3")).await?),
        None => None,
    };
    let (delta_uri, aws) = match &s3 {
        Some(s3) => ("s3://aether/chaos".to_owned(), s3.env.clone()),
        None => (path_text(&tmp.join("delta"))?, Vec::new()),
    };
    let nodes = args.nodes as usize;
    println!(
        "chaos: {nodes} nodes, {} s, a SIGKILL every {} s (down {} ms), lease ttl {} ms, Delta tables at {delta_uri}, seed {seed}",
        args.duration_secs, args.kill_every_secs, args.down_ms, args.lease_ttl_ms
    );
    let mut cluster = Cluster {
        url: url.to_owned(),
        tmp: tmp.to_owned(),
        ttl: args.lease_ttl_ms.to_string(),
        delta_uri: delta_uri.clone(),
        aws,
        children: Vec::new(),
    };
    // The first node makes the keys and the member PKI; the others get copies (one
    // checkpoint key, one envelope key, one CA for the cluster).
    let first = cluster.start(0).await?;
    setup_engine(&first.http, &cluster.data(0), OPERATOR, REGULATOR).await?;
    let state: State = Arc::new(Mutex::new(Shared {
        live: vec![None; nodes],
        ..Shared::default()
    }));
    record(&state, |s| {
        s.live[0] = Some(Endpoint {
            http: first.http.clone(),
            grpc: first.grpc.clone(),
        })
    });
    cluster.children.push(Some(first));
    for i in 1..nodes {
        for dir in ["keys", "certs"] {
            copy_dir(&cluster.data(0).join(dir), &cluster.data(i).join(dir))?;
        }
        let child = cluster.start(i).await?;
        record(&state, |s| {
            s.live[i] = Some(Endpoint {
                http: child.http.clone(),
                grpc: child.grpc.clone(),
            })
        });
        cluster.children.push(Some(child));
    }

    let deadline = Instant::now() + Duration::from_secs(args.duration_secs);
    let pki = cluster.data(0);
    let loads = vec![
        tokio::spawn(event_load(state.clone(), deadline, seed ^ 1)),
        tokio::spawn(policy_load(state.clone(), deadline, seed ^ 2)),
        tokio::spawn(snapshot_load(state.clone(), deadline, seed ^ 5)),
        tokio::spawn(clearing_load(state.clone(), deadline, seed ^ 3, pki)),
    ];
    let (views_stop, views_rx) = tokio::sync::watch::channel(false);
    let views = Arc::new(Mutex::new(Views::default()));
    let watcher = tokio::spawn(watch_duties(state.clone(), views.clone(), views_rx, seed));

    // The kills.
    let mut rng = SplitMix(seed);
    let mut kills = 0;
    let every = Duration::from_secs(args.kill_every_secs.max(1));
    let mut next_kill = Instant::now() + every;
    while next_kill < deadline {
        tokio::time::sleep_until(next_kill.into()).await;
        next_kill = (next_kill + every).max(Instant::now() + Duration::from_secs(1));
        let victim = rng.below(nodes as u64) as usize;
        record(&state, |s| s.live[victim] = None);
        let phase = KillPhase::of(kills, args.in_transitions);
        if let Some(mut child) = cluster.children[victim].take() {
            if let Ok(mut v) = views.lock() {
                v.killed(&format!("node-{victim}"));
            }
            match phase {
                // SIGTERM, then SIGKILL while it drains.
                KillPhase::Stopping => {
                    child
                        .terminate(Duration::from_millis(20 + rng.below(280)))
                        .await
                }
                _ => child.stop().await, // SIGKILL
            }
        }
        kills += 1;
        // Down a while: its duties pass to another node once their leases expire.
        tokio::time::sleep(Duration::from_millis(args.down_ms)).await;
        if let KillPhase::Starting = phase {
            // Dropped unfinished, the start's child is SIGKILLed (`kill_on_drop`).
            let cut = Duration::from_millis(100 + rng.below(700));
            let started = tokio::time::timeout(cut, cluster.start(victim)).await;
            if let Ok(Ok(mut child)) = started {
                child.stop().await;
            }
        }
        let held: Vec<String> = views
            .lock()
            .map(|v| {
                v.holders
                    .iter()
                    .filter(|(_, (holder, _))| *holder == format!("node-{victim}"))
                    .map(|(duty, _)| duty.clone())
                    .collect()
            })
            .unwrap_or_default();
        println!("kill {kills}: node-{victim} {phase:?} (holding {held:?})");
        let child = cluster.start(victim).await?;
        record(&state, |s| {
            s.live[victim] = Some(Endpoint {
                http: child.http.clone(),
                grpc: child.grpc.clone(),
            })
        });
        cluster.children[victim] = Some(child);
        if let Ok(mut v) = views.lock() {
            v.restarted(&format!("node-{victim}"));
        }
    }
    for load in loads {
        load.await??;
    }
    // The relays catch up with the last load before the nodes stop.
    let store = aether_ledger::EventStore::connect(url, Default::default()).await?;
    let caught_up = wait_for_lineage(&store, Duration::from_secs(90)).await;
    let _ = views_stop.send(true);
    let _ = watcher.await;
    for child in cluster.children.iter_mut().flatten() {
        child.terminate(Duration::from_secs(30)).await;
    }

    let failures = check(&store, &state, &cluster, caught_up).await?;
    let unowned = views.lock().map(|v| v.gaps.clone()).unwrap_or_default();
    report_unowned(&unowned, kills);
    store.shutdown().await;
    drop(s3);
    Ok(failures)
}

fn path_text(path: &Path) -> anyhow::Result<String> {
    path.to_str()
        .map(str::to_owned)
        .with_context(|| format!("{} is not UTF-8", path.display()))
}

/// Events on streams of their own (`chaos/<n>`), each appended with "no stream yet" so a
/// retry after a lost answer cannot write it twice (409 then means it is there).
async fn event_load(state: State, deadline: Instant, seed: u64) -> anyhow::Result<()> {
    let mut rng = SplitMix(seed);
    let mut n = 0u64;
    while Instant::now() < deadline {
        let Some((_, node)) = pick(&state, &mut rng) else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let stream = format!("chaos/{n}");
        let body = json!({
            "stream_id": stream,
            "expected_version": "no_stream",
            "events": [{"event_type": "ChaosNote", "payload": {"n": n}}],
        });
        match post_json(&node.http, "/v1/events", OPERATOR, &body).await {
            Ok((201 | 409, _)) => {
                record(&state, |s| s.events.push(stream));
                n += 1;
            }
            _ => {
                record(&state, |s| s.retries += 1);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    Ok(())
}

/// A policy version every 500 ms through a random node; a version already recorded (409
/// after a lost answer) counts as there.
async fn policy_load(state: State, deadline: Instant, seed: u64) -> anyhow::Result<()> {
    let mut rng = SplitMix(seed);
    let mut version = 0u64;
    while Instant::now() < deadline {
        let Some((_, node)) = pick(&state, &mut rng) else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let text = format!(
            "name: {POLICY}\nversion: 1.0.{version}\nrules:\n  - id: large\n    \
             expression: request.amount_minor >= {}\n    action: hold\n    severity: low\n",
            1_000_000_000 + version
        );
        let answer = http_request(
            &node.http,
            "POST",
            "/v1/policy/ingest",
            OPERATOR,
            Some(("application/yaml", text.as_bytes())),
        )
        .await;
        match answer {
            Ok((201 | 409, _)) => {
                record(&state, |s| s.policies.push(format!("1.0.{version}")));
                version += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            _ => {
                record(&state, |s| s.retries += 1);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    Ok(())
}

/// A snapshot every 3 s through a random node, and a rollback to it through another after
/// the next policy versions: the two-phase snapshot and the rollback under kills too.
async fn snapshot_load(state: State, deadline: Instant, seed: u64) -> anyhow::Result<()> {
    let mut rng = SplitMix(seed);
    let mut last: Option<String> = None;
    let mut cycle = 0u64;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let Some((_, node)) = pick(&state, &mut rng) else {
            continue;
        };
        cycle += 1;
        match (&last, cycle % 2) {
            (Some(id), 0) => {
                let body = json!({"snapshot_id": id, "reason": "chaos: back to the last snapshot"});
                match post_json(&node.http, "/v1/rollback", OPERATOR, &body).await {
                    Ok((200, answer)) => {
                        let seq = serde_json::from_str::<Value>(&answer)
                            .ok()
                            .and_then(|a| a["seq"].as_u64());
                        if let Some(seq) = seq {
                            record(&state, |s| s.rollbacks.push(seq));
                        }
                    }
                    _ => record(&state, |s| s.retries += 1),
                }
            }
            _ => match post_json(&node.http, "/v1/snapshots", OPERATOR, &json!({})).await {
                Ok((201, answer)) => {
                    let id = serde_json::from_str::<Value>(&answer)
                        .ok()
                        .and_then(|a| a["id"].as_str().map(str::to_owned));
                    if let Some(id) = id {
                        record(&state, |s| s.snapshots.push(id.clone()));
                        last = Some(id);
                    }
                }
                _ => record(&state, |s| s.retries += 1),
            },
        }
    }
    Ok(())
}

/// Trades from one member through random nodes; a call that fails is sent again with the
/// same request id to another node, so an answer lost with its node is replayed there.
async fn clearing_load(
    state: State,
    deadline: Instant,
    seed: u64,
    pki: PathBuf,
) -> anyhow::Result<()> {
    let mut rng = SplitMix(seed);
    let member = MEMBERS[0];
    let layout = PkiLayout::new(&pki);
    let tls = TlsPaths::client(&layout, Role::Member, member);
    let server_key = pki.join("keys").join("envelope.pub.pem");
    let date = value_date();
    let mut clients: HashMap<String, ClearingClient> = HashMap::new();
    let mut n = 0u64;
    let mut request = trade_request(&mut rng, member, &date);
    while Instant::now() < deadline {
        let Some((_, node)) = pick(&state, &mut rng) else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let request_id = format!("chaos-{n}");
        let client = match clients.get_mut(&node.grpc) {
            Some(c) => c,
            None => match ClearingClient::connect(&node.grpc, &tls, &server_key, member).await {
                Ok(c) => clients.entry(node.grpc.clone()).or_insert(c),
                Err(_) => {
                    record(&state, |s| s.retries += 1);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            client.submit(&request_id, &request),
        )
        .await;
        match answer {
            Ok(Ok(_)) => {
                record(&state, |s| s.decisions.push(request_id));
                n += 1;
                request = trade_request(&mut rng, member, &date);
            }
            _ => {
                clients.remove(&node.grpc);
                record(&state, |s| s.retries += 1);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    Ok(())
}

/// The duties' holders as last seen, and how long each was unowned after its holder died.
#[derive(Default)]
struct Views {
    holders: HashMap<String, (String, u64)>,
    orphaned: HashMap<String, Orphaned>,
    gaps: BTreeMap<String, Vec<u128>>,
}

/// A duty whose holder was killed.
struct Orphaned {
    since: Instant,
    holder: String,
    token: u64,
    /// The holder has been started again: its new process renews the lease under the same
    /// token, so from now on the holder's name means a live process.
    back: bool,
}

impl Views {
    fn killed(&mut self, node: &str) {
        let since = Instant::now();
        for (duty, (holder, token)) in &self.holders {
            if holder == node {
                self.orphaned.entry(duty.clone()).or_insert(Orphaned {
                    since,
                    holder: holder.clone(),
                    token: *token,
                    back: false,
                });
            }
        }
    }

    fn restarted(&mut self, node: &str) {
        for orphan in self.orphaned.values_mut() {
            if orphan.holder == node {
                orphan.back = true;
            }
        }
    }

    fn seen(&mut self, duty: &str, holder: &str, token: u64) {
        if let Some(orphan) = self.orphaned.get(duty)
            && (token != orphan.token || (orphan.back && holder == orphan.holder))
        {
            self.gaps
                .entry(duty.to_owned())
                .or_default()
                .push(orphan.since.elapsed().as_millis());
            self.orphaned.remove(duty);
        }
        self.holders
            .insert(duty.to_owned(), (holder.to_owned(), token));
    }
}

/// Polls `GET /v1/cluster` on a live node every 50 ms.
async fn watch_duties(
    state: State,
    views: Arc<Mutex<Views>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
    seed: u64,
) {
    let mut rng = SplitMix(seed ^ 4);
    while !*stop.borrow() {
        if let Some((_, node)) = pick(&state, &mut rng)
            && let Ok((200, body)) =
                http_request(&node.http, "GET", "/v1/cluster", REGULATOR, None).await
            && let Ok(view) = serde_json::from_str::<Value>(&body)
            && let Ok(mut v) = views.lock()
        {
            for lease in view["leases"].as_array().into_iter().flatten() {
                let (Some(name), Some(holder), Some(token)) = (
                    lease["name"].as_str(),
                    lease["holder"].as_str(),
                    lease["token"].as_u64(),
                ) else {
                    continue;
                };
                if lease["live"] == true {
                    v.seen(name, holder, token);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            _ = stop.changed() => {}
        }
    }
}

/// Waits until every event has its OpenLineage record and Delta version; whether it did.
async fn wait_for_lineage(store: &aether_ledger::EventStore, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if let Ok(report) = aether_lineage::relay::reconcile(store).await
            && report.missing_openlineage.is_empty()
            && report.missing_delta.is_empty()
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

async fn check(
    store: &aether_ledger::EventStore,
    state: &State,
    cluster: &Cluster,
    caught_up: bool,
) -> anyhow::Result<Vec<String>> {
    let mut failures = Vec::new();
    let pool = store
        .postgres_pool()
        .context("the chaos run's ledger is PostgreSQL")?;
    let (events, policies, decisions, snapshots, rollbacks, retries) = {
        let s = state
            .lock()
            .map_err(|_| anyhow::anyhow!("load state poisoned"))?;
        (
            s.events.clone(),
            s.policies.clone(),
            s.decisions.clone(),
            s.snapshots.clone(),
            s.rollbacks.clone(),
            s.retries,
        )
    };
    println!(
        "load: {} events, {} policy versions, {} decisions, {} snapshots, {} rollbacks acknowledged ({retries} calls retried at another node)",
        events.len(),
        policies.len(),
        decisions.len(),
        snapshots.len(),
        rollbacks.len()
    );

    let counts = |rows: Vec<(String, i64)>| rows.into_iter().collect::<HashMap<String, i64>>();
    let stored_events = counts(
        sqlx::query_as(
            "SELECT stream_id, count(*) FROM events WHERE stream_id LIKE 'chaos/%' GROUP BY stream_id",
        )
        .fetch_all(pool)
        .await?,
    );
    let stored_policies = counts(
        sqlx::query_as(
            "SELECT payload::jsonb ->> 'version', count(*) FROM events \
             WHERE stream_id = $1 AND event_type = 'PolicyIngested' GROUP BY 1",
        )
        .bind(format!("policy/{POLICY}"))
        .fetch_all(pool)
        .await?,
    );
    let stored_decisions = counts(
        sqlx::query_as(
            "SELECT request_id, count(*) FROM events WHERE event_type = 'ClearingDecided' \
             AND request_id IS NOT NULL GROUP BY request_id",
        )
        .fetch_all(pool)
        .await?,
    );
    let stored_snapshots = counts(
        sqlx::query_as(
            "SELECT payload::jsonb ->> 'id', count(*) FROM events \
             WHERE stream_id = 'snapshot' AND event_type = 'SnapshotCommitted' GROUP BY 1",
        )
        .fetch_all(pool)
        .await?,
    );
    let stored_rollbacks = counts(
        sqlx::query_as(
            "SELECT seq::text, count(*) FROM events \
             WHERE stream_id = 'snapshot' AND event_type = 'RolledBack' GROUP BY 1",
        )
        .fetch_all(pool)
        .await?,
    );
    let rollbacks: Vec<String> = rollbacks.iter().map(u64::to_string).collect();
    for (what, acked, stored) in [
        ("event", &events, &stored_events),
        ("policy version", &policies, &stored_policies),
        ("decision", &decisions, &stored_decisions),
        ("snapshot", &snapshots, &stored_snapshots),
        ("rollback", &rollbacks, &stored_rollbacks),
    ] {
        let wrong: Vec<String> = acked
            .iter()
            .filter(|k| stored.get(*k).copied() != Some(1))
            .map(|k| format!("{k} ×{}", stored.get(k).copied().unwrap_or(0)))
            .collect();
        if wrong.is_empty() {
            println!(
                "every acknowledged {what} is in the ledger exactly once ({})",
                acked.len()
            );
        } else {
            failures.push(format!(
                "acknowledged {what}s not in the ledger exactly once: {}",
                wrong.join(", ")
            ));
        }
    }

    // One chain, every checkpoint signed by the cluster's key.
    let public = cluster
        .data(0)
        .join("keys")
        .join(aether_ledger::checkpoint::PUBLIC_KEY_FILE);
    let exe = std::env::current_exe()?;
    let verify = tokio::process::Command::new(exe)
        .arg("verify")
        .arg("--public-key")
        .arg(&public)
        .arg("--data-dir")
        .arg(cluster.data(0))
        .env("DATABASE_URL", &cluster.url)
        .output()
        .await?;
    if verify.status.success() {
        println!("aether verify: OK with the one cluster key");
    } else {
        failures.push(format!(
            "aether verify failed: {}{}",
            String::from_utf8_lossy(&verify.stdout),
            String::from_utf8_lossy(&verify.stderr)
        ));
    }

    // The Delta table is the ledger: every seq once, no gap.
    let head = store.head().await?.map_or(0, |(seq, _)| seq);
    let options: aether_lineage::delta::StorageOptions = cluster
        .aws
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.clone()))
        .collect();
    let table = format!("{}/events", cluster.delta_uri);
    let seqs = aether_lineage::delta::events_table_seqs(&table, &options).await?;
    let expected: Vec<u64> = (1..=head).collect();
    if seqs == expected {
        println!("the Delta events table holds seqs 1..={head}, each once");
    } else {
        let duplicates = seqs.windows(2).filter(|w| w[0] == w[1]).count();
        failures.push(format!(
            "the Delta events table is not the ledger: {} rows for {head} events, {duplicates} duplicates",
            seqs.len()
        ));
    }
    let report = aether_lineage::relay::reconcile(store).await?;
    if caught_up && report.missing_openlineage.is_empty() && report.missing_delta.is_empty() {
        println!("every event has its OpenLineage record and Delta version");
    } else {
        failures.push(format!(
            "lineage incomplete: {} events without an OpenLineage record, {} without a Delta version",
            report.missing_openlineage.len(),
            report.missing_delta.len()
        ));
    }
    Ok(failures)
}

fn report_unowned(gaps: &BTreeMap<String, Vec<u128>>, kills: usize) {
    println!("kills: {kills}");
    for duty in DUTIES {
        match gaps.get(duty) {
            Some(times) if !times.is_empty() => {
                let mut times = times.clone();
                times.sort_unstable();
                let at = |q: f64| {
                    times[((times.len() as f64 * q).ceil() as usize).clamp(1, times.len()) - 1]
                };
                println!(
                    "{duty}: unowned after its holder was killed, {} times: p50 {} ms, p99 {} ms, max {} ms",
                    times.len(),
                    at(0.5),
                    at(0.99),
                    times[times.len() - 1]
                );
            }
            _ => println!("{duty}: its holder was never killed"),
        }
    }
}

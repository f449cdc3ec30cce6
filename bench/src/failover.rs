//! `aether bench failover`: how long the cluster's checkpointer duty is unowned after its
//! holder is SIGKILLed. Two real `aether serve` nodes on one scratch PostgreSQL database
//! (one checkpoint key, a short lease ttl); each round kills the holder, times until the
//! other node holds the lease (polled on `GET /v1/cluster` every 20 ms), and restarts the
//! killed node.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use serde_json::Value;

use crate::node::{ServeChild, copy_dir, http_request};
use crate::scratch::Scratch;

#[derive(Args)]
pub struct FailoverBench {
    /// PostgreSQL server (a scratch database is created and dropped; needs CREATE DATABASE).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Kills to time.
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// The nodes' lease ttl, milliseconds (`--lease-ttl-ms` of `aether serve`).
    #[arg(long, default_value_t = 3000)]
    lease_ttl_ms: u64,
    /// Policy versions to ingest through one node, timing until the other serves the same
    /// rule set (0: skip).
    #[arg(long, default_value_t = 20)]
    policies: usize,
}

const REGULATOR: &str = "bench-failover-regulator-token-0000";
const OPERATOR: &str = "bench-failover-operator-token-00000";

pub async fn run(b: FailoverBench) -> anyhow::Result<()> {
    if !b.database_url.starts_with("postgres") {
        bail!("a cluster needs PostgreSQL: pass --database-url postgres://…");
    }
    let scratch = Scratch::new(&b.database_url).await?;
    let tmp = tempfile::tempdir()?;
    let result = rounds(&b, &scratch.url, tmp.path()).await;
    scratch.drop().await;
    let (kills, policies) = result?;
    println!(
        "checkpointer failover after SIGKILL of its holder, lease ttl {} ms, {} kills: {}",
        b.lease_ttl_ms,
        kills.len(),
        spread(kills)
    );
    if !policies.is_empty() {
        println!(
            "policy propagation to the other node, {} ingests: {}",
            policies.len(),
            spread(policies)
        );
    }
    Ok(())
}

/// `p50 …, p99 …, max … ms (min …)` of some milliseconds.
fn spread(mut times: Vec<u128>) -> String {
    times.sort_unstable();
    let at = |q: f64| times[((times.len() as f64 * q).ceil() as usize).clamp(1, times.len()) - 1];
    format!(
        "p50 {} ms, p99 {} ms, max {} ms (min {} ms)",
        at(0.50),
        at(0.99),
        times[times.len() - 1],
        times[0]
    )
}

async fn start(url: &str, data: &Path, id: &str, ttl: &str) -> anyhow::Result<ServeChild> {
    // The Delta tables every node shares, beside the nodes' data directories.
    let delta = data.with_file_name("delta");
    let delta = delta
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("{} is not UTF-8", delta.display()))?;
    ServeChild::start_with_env(
        data,
        &data.with_extension("log"),
        Some(url),
        Some(&format!("operator:{OPERATOR},regulator:{REGULATOR}")),
        2_000,
        "warn",
        &[
            ("AETHER_NODE_ID", id),
            ("AETHER_LEASE_TTL_MS", ttl),
            ("AETHER_CHECKPOINT_EVERY_SECS", "1"),
            ("AETHER_DELTA_URI", delta),
        ],
    )
    .await
}

/// The checkpointer's live holder, as `node` sees it.
async fn holder(node: &ServeChild) -> anyhow::Result<Option<String>> {
    let (status, body) = http_request(&node.http, "GET", "/v1/cluster", REGULATOR, None).await?;
    if status != 200 {
        bail!("GET /v1/cluster answered {status}: {body}");
    }
    let view: Value = serde_json::from_str(&body)?;
    Ok(view["leases"].as_array().and_then(|leases| {
        leases.iter().find_map(|l| {
            (l["name"] == "checkpointer" && l["live"] == true)
                .then(|| l["holder"].as_str().unwrap_or_default().to_owned())
        })
    }))
}

async fn wait_for(node: &ServeChild, id: &str, limit: Duration) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        if holder(node).await?.as_deref() == Some(id) {
            return Ok(started.elapsed());
        }
        if started.elapsed() > limit {
            bail!(
                "{id} did not take the checkpointer within {} s",
                limit.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The rule set digest `node` serves.
async fn rule_set(node: &ServeChild) -> anyhow::Result<String> {
    let (status, body) = http_request(&node.http, "GET", "/v1/policies", REGULATOR, None).await?;
    if status != 200 {
        bail!("GET /v1/policies answered {status}: {body}");
    }
    let view: Value = serde_json::from_str(&body)?;
    Ok(view["rule_set_digest"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

/// Ingests `count` versions of a policy through `from` and times, for each, until `to`
/// serves the same rule set (polled every 5 ms).
async fn propagation(
    from: &ServeChild,
    to: &ServeChild,
    count: usize,
) -> anyhow::Result<Vec<u128>> {
    let mut times = Vec::with_capacity(count);
    for n in 0..count {
        let policy = format!(
            "name: bench_propagation\nversion: 1.0.{n}\nrules:\n  - id: large\n    \
             expression: request.amount_minor >= {}\n    action: hold\n    severity: low\n",
            1_000_000 + n
        );
        let started = Instant::now();
        let (status, body) = http_request(
            &from.http,
            "POST",
            "/v1/policy/ingest",
            OPERATOR,
            Some(("application/yaml", policy.as_bytes())),
        )
        .await?;
        if status != 201 {
            bail!("the policy ingest answered {status}: {body}");
        }
        let wanted = rule_set(from).await?;
        while rule_set(to).await? != wanted {
            if started.elapsed() > Duration::from_secs(30) {
                bail!("the other node did not apply policy version 1.0.{n} within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        times.push(started.elapsed().as_millis());
    }
    Ok(times)
}

async fn rounds(
    b: &FailoverBench,
    url: &str,
    tmp: &Path,
) -> anyhow::Result<(Vec<u128>, Vec<u128>)> {
    let ttl = b.lease_ttl_ms.to_string();
    let limit = Duration::from_millis(b.lease_ttl_ms * 4 + 10_000);
    let dirs = [tmp.join("a"), tmp.join("b")];
    let ids = ["node-a", "node-b"];
    let first = start(url, &dirs[0], ids[0], &ttl).await?;
    // One checkpoint key for the cluster: the second node gets the first's keys.
    copy_dir(&dirs[0].join("keys"), &dirs[1].join("keys"))?;
    let second = start(url, &dirs[1], ids[1], &ttl).await?;
    let mut nodes = [first, second];
    wait_for(&nodes[1], ids[0], limit).await?;
    let policies = propagation(&nodes[0], &nodes[1], b.policies).await?;
    let mut holder_index = 0;
    let mut times = Vec::with_capacity(b.kills);
    for round in 0..b.kills {
        let other = 1 - holder_index;
        nodes[holder_index].stop().await; // SIGKILL
        let took = wait_for(&nodes[other], ids[other], limit).await?;
        println!(
            "kill {}: {} took the checkpointer after {} ms",
            round + 1,
            ids[other],
            took.as_millis()
        );
        times.push(took.as_millis());
        nodes[holder_index] = start(url, &dirs[holder_index], ids[holder_index], &ttl)
            .await
            .with_context(|| format!("cannot restart {}", ids[holder_index]))?;
        holder_index = other;
    }
    for node in &mut nodes {
        node.stop().await;
    }
    Ok((times, policies))
}

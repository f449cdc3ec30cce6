//! `aether bench ledger`: append throughput and latency at several concurrencies, an
//! open-loop latency run at a fixed offered rate, and verification time, each against a
//! baseline measured in the same run on the same database server.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aether_ledger::checkpoint::CheckpointSigner;
use aether_ledger::{
    CheckpointPolicy, EventStore, ExpectedVersion, NewEvent, StoreConfig, redact_url,
    run_checkpointer, verify_store,
};
use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use sqlx::Connection;
use sqlx::postgres::PgConnection;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Ledger append throughput / latency and verify speed, with a raw-INSERT baseline.
    Ledger(LedgerBench),
    /// Audit: inclusion-proof latency and evidence export at scale, against plain reads.
    Audit(AuditBench),
    /// Clearing over gRPC (mTLS, SM2/SM4 session keys) through a real `aether serve`,
    /// against a bare tonic mTLS echo server in the same run.
    Clearing(crate::bench_clearing::ClearingBench),
    /// Lineage: relay throughput into Delta and the OpenLineage store, OpenLineage lag at
    /// an offered rate, and the time to open the Delta `events` table.
    Lineage(crate::bench_lineage::LineageBench),
    /// Cluster: how long the checkpointer duty is unowned after its holder is SIGKILLed
    /// (two real nodes on one PostgreSQL database).
    Failover(crate::bench_failover::FailoverBench),
}

#[derive(Args)]
pub struct AuditBench {
    /// Server to benchmark on: `postgres://…` (needs CREATE DATABASE) or `sqlite:` (temp files).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Events in the ledger.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Events in the exported bundle.
    #[arg(long, default_value_t = 100_000)]
    export_events: u64,
    /// Inclusion proofs to time.
    #[arg(long, default_value_t = 10_000)]
    proofs: u64,
    /// Approximate canonical payload size per event, bytes.
    #[arg(long, default_value_t = 500)]
    payload_bytes: usize,
    /// Rounds of control-plane changes spread over the fill (policy version, model,
    /// engine activation, rollout; a corpus version and a snapshot every fifth).
    #[arg(long, default_value_t = 20)]
    control_rounds: u64,
    /// State-as-of queries to time, at random points of the ledger.
    #[arg(long, default_value_t = 300)]
    states: u64,
    /// Timeline pages to time (the console's `GET /v1/audit/events` pages of 100).
    #[arg(long, default_value_t = 200)]
    pages: u64,
    /// Keep the scratch PostgreSQL database afterwards (to look at query plans).
    #[arg(long)]
    keep_database: bool,
}

#[derive(Args)]
pub struct LedgerBench {
    /// Server to benchmark on: `postgres://…` (needs CREATE DATABASE) or `sqlite:` (temp files).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Concurrent appenders per run.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
    concurrency: Vec<usize>,
    /// Seconds each throughput run lasts.
    #[arg(long, default_value_t = 5)]
    secs: u64,
    /// Approximate canonical payload size per event, bytes.
    #[arg(long, default_value_t = 500)]
    payload_bytes: usize,
    /// Offered load for the open-loop latency run, events per second (0 skips it).
    #[arg(long, default_value_t = 5000)]
    rate: u64,
    /// Events in the verify run (0 skips it).
    #[arg(long, default_value_t = 1_000_000)]
    verify_events: u64,
    /// Group-commit wait, microseconds.
    #[arg(long, default_value_t = 1000)]
    max_wait_us: u64,
    /// Batches in the database at once (PostgreSQL); 1 commits each before the next.
    #[arg(long, default_value_t = 1)]
    pipeline_depth: usize,
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Ledger(b) => ledger(b).await,
        BenchCommand::Audit(b) => audit(b).await,
        BenchCommand::Clearing(b) => crate::bench_clearing::run(b).await,
        BenchCommand::Lineage(b) => crate::bench_lineage::run(b).await,
        BenchCommand::Failover(b) => crate::bench_failover::run(b).await,
    }
}

/// A scratch ledger: a fresh database on the server, or a temp SQLite file.
pub(crate) struct Scratch {
    pub(crate) url: String,
    cleanup: Option<(String, String)>,
    _dir: Option<tempfile::TempDir>,
}

impl Scratch {
    pub(crate) async fn new(base: &str) -> anyhow::Result<Scratch> {
        if base.starts_with("sqlite:") {
            let dir = tempfile::tempdir()?;
            let url = format!("sqlite:{}", dir.path().join("bench.db").display());
            return Ok(Scratch {
                url,
                cleanup: None,
                _dir: Some(dir),
            });
        }
        let name = format!("aether_bench_{}", uuid::Uuid::now_v7().simple());
        let mut conn = PgConnection::connect(base)
            .await
            .with_context(|| format!("cannot connect to {}", redact_url(base)))?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .context("CREATE DATABASE (the bench needs a role that may create databases)")?;
        // Each measured run starts with the previous run's dirty pages written out, so that
        // it does not pay for them. (The open-loop p99 right after the 256-appender run
        // still varies from 8 to 53 ms with it, against 2–4 ms on its own.)
        if let Err(e) = sqlx::raw_sql("CHECKPOINT").execute(&mut conn).await {
            eprintln!(
                "note: CHECKPOINT before the run failed ({e}); the run may overlap the previous one's writes"
            );
        }
        conn.close().await?;
        Ok(Scratch {
            url: aether_ledger_url_with_db(base, &name),
            cleanup: Some((base.to_owned(), name)),
            _dir: None,
        })
    }

    /// The scratch database's name (PostgreSQL only).
    pub(crate) fn database_name(&self) -> Option<&str> {
        self.cleanup.as_ref().map(|(_, name)| name.as_str())
    }

    pub(crate) async fn drop(self) {
        if let Some((base, name)) = self.cleanup
            && let Ok(mut conn) = PgConnection::connect(&base).await
        {
            let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut conn)
                .await;
        }
    }
}

/// `url` with its database path replaced by `name` (query string kept).
fn aether_ledger_url_with_db(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let start = base.find("://").map_or(0, |i| i + 3);
    let path = base[start..].find('/').map_or(base.len(), |i| start + i);
    let mut out = format!("{}/{name}", &base[..path]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Serialised size of [`payload`] without its padding (the `"pad"` member included).
const PAYLOAD_BASE_BYTES: usize = 134 + 10;

pub(crate) fn payload(bytes: usize, n: u64) -> serde_json::Value {
    // A clearing-decision-like object padded to about `bytes` canonical bytes. The size is
    // a constant rather than measured per event: serialising each payload an extra time
    // would be the bench's cost, not the ledger's.
    let mut obj = serde_json::json!({
        "request_id": format!("req-{n:012}"),
        "member": "member-0042",
        "decision": "cleared",
        "amount_minor": 125_000_000 + n,
        "currency": "SGD",
        "score": 0.1234,
    });
    obj["pad"] = serde_json::Value::String("x".repeat(bytes.saturating_sub(PAYLOAD_BASE_BYTES)));
    obj
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Bytes in MiB, for printing.
fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

struct RunResult {
    events: u64,
    secs: f64,
    latencies: Vec<Duration>,
}

impl RunResult {
    fn rate(&self) -> f64 {
        self.events as f64 / self.secs
    }
}

/// `concurrency` appenders, each appending one event at a time, for `secs`.
async fn closed_loop(
    store: &EventStore,
    concurrency: usize,
    secs: u64,
    payload_bytes: usize,
) -> RunResult {
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let store = store.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let stream = format!("clearing/member-{:04}", t % 64);
                let mut n = t as u64 * 1_000_000;
                while !stop.load(Ordering::Relaxed) {
                    let begun = Instant::now();
                    let e = NewEvent::new("ClearingDecided", payload(payload_bytes, n));
                    if store
                        .append(&stream, ExpectedVersion::Any, vec![e])
                        .await
                        .is_ok()
                    {
                        latencies.push(begun.elapsed());
                    }
                    n += 1;
                }
                latencies
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await.unwrap_or_default());
    }
    let secs = started.elapsed().as_secs_f64();
    latencies.sort();
    RunResult {
        events: latencies.len() as u64,
        secs,
        latencies,
    }
}

/// One event every `1/rate` s regardless of completions, for `secs`.
async fn open_loop(store: &EventStore, rate: u64, secs: u64, payload_bytes: usize) -> RunResult {
    let started = Instant::now();
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let total = rate * secs;
    let mut tasks = Vec::with_capacity(total as usize);
    for n in 0..total {
        ticker.tick().await;
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let begun = Instant::now();
            let e = NewEvent::new("ClearingDecided", payload(payload_bytes, n));
            let stream = format!("clearing/member-{:04}", n % 64);
            store
                .append(&stream, ExpectedVersion::Any, vec![e])
                .await
                .ok()
                .map(|_| begun.elapsed())
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        if let Ok(Some(l)) = t.await {
            latencies.push(l);
        }
    }
    latencies.sort();
    RunResult {
        events: latencies.len() as u64,
        secs: started.elapsed().as_secs_f64(),
        latencies,
    }
}

/// Raw batched INSERTs of rows shaped like ledger rows (same columns, constraints and
/// indexes, same commit durability) but with no chain, no validation and no triggers:
/// `writers` connections, each inserting 500-row UNNEST batches back to back.
async fn baseline_postgres(
    url: &str,
    writers: usize,
    secs: u64,
    payload_bytes: usize,
) -> anyhow::Result<f64> {
    // Configured as the ledger's pool is (no ping before each acquire), so that the ratio
    // compares the chain, not pool settings.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(writers as u32 + 1)
        .test_before_acquire(false)
        .connect(url)
        .await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS baseline_events (LIKE events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)",
    )
    .execute(&pool)
    .await?;
    let text = payload(payload_bytes, 0).to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let next_seq = Arc::new(std::sync::atomic::AtomicI64::new(1));
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let pool = pool.clone();
            let stop = stop.clone();
            let next_seq = next_seq.clone();
            let text = text.clone();
            tokio::spawn(async move {
                let mut rows = 0u64;
                let mut version = (w as i64) * 1_000_000_000;
                while !stop.load(Ordering::Relaxed) {
                    let first = next_seq.fetch_add(500, Ordering::Relaxed);
                    let seqs: Vec<i64> = (first..first + 500).collect();
                    let versions: Vec<i64> = (0..500).map(|i| version + i + 1).collect();
                    version += 500;
                    let streams = vec![format!("baseline/{w}"); 500];
                    let ids: Vec<uuid::Uuid> = (0..500).map(|_| uuid::Uuid::now_v7()).collect();
                    let types = vec!["ClearingDecided"; 500];
                    let schema = vec![1i32; 500];
                    let payloads = vec![text.as_str(); 500];
                    let metadata = vec!["{}"; 500];
                    let now = vec![chrono::Utc::now(); 500];
                    let hashes: Vec<Vec<u8>> = seqs.iter().map(|s| {
                        aether_ledger::hashing::sm3(&s.to_be_bytes()).to_vec()
                    }).collect();
                    let r = sqlx::query(
                        "INSERT INTO baseline_events (seq, stream_id, stream_version, event_id, event_type, schema_version, payload, metadata, recorded_at, prev_hash, hash) \
                         SELECT * FROM UNNEST($1::bigint[], $2::text[], $3::bigint[], $4::uuid[], $5::text[], $6::int[], $7::text[], $8::text[], $9::timestamptz[], $10::bytea[], $11::bytea[])",
                    )
                    .bind(&seqs).bind(&streams).bind(&versions).bind(&ids).bind(&types)
                    .bind(&schema).bind(&payloads).bind(&metadata).bind(&now).bind(&hashes).bind(&hashes)
                    .execute(&pool)
                    .await;
                    if r.is_ok() {
                        rows += 500;
                    }
                }
                rows
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut rows = 0;
    for t in tasks {
        rows += t.await.unwrap_or(0);
    }
    let rate = rows as f64 / started.elapsed().as_secs_f64();
    pool.close().await;
    Ok(rate)
}

async fn ledger(b: LedgerBench) -> anyhow::Result<()> {
    if b.concurrency.is_empty() || b.concurrency.contains(&0) {
        bail!("--concurrency needs positive numbers, e.g. 1,16,256");
    }
    let config = StoreConfig {
        max_wait: Duration::from_micros(b.max_wait_us),
        pipeline_depth: b.pipeline_depth,
        ..StoreConfig::default()
    };
    let postgres = !b.database_url.starts_with("sqlite:");
    println!(
        "# aether bench ledger on {} ({} s per run, ~{} B payloads, max wait {} µs, pipeline depth {})\n",
        redact_url(&b.database_url),
        b.secs,
        b.payload_bytes,
        b.max_wait_us,
        b.pipeline_depth
    );

    println!("| appenders | events/s | p50 ms | p99 ms | max ms |");
    println!("|---:|---:|---:|---:|---:|");
    let mut best = Vec::new();
    for &c in &b.concurrency {
        let scratch = Scratch::new(&b.database_url).await?;
        let store = EventStore::connect(&scratch.url, config.clone()).await?;
        let r = closed_loop(&store, c, b.secs, b.payload_bytes).await;
        println!(
            "| {c} | {:.0} | {:.2} | {:.2} | {:.2} |",
            r.rate(),
            ms(percentile(&r.latencies, 0.5)),
            ms(percentile(&r.latencies, 0.99)),
            ms(r.latencies.last().copied().unwrap_or_default())
        );
        best.push((c, r.rate()));
        store.shutdown().await;
        scratch.drop().await;
    }

    if postgres {
        let scratch = Scratch::new(&b.database_url).await?;
        // Creates the events table the baseline copies its shape from.
        EventStore::connect(&scratch.url, config.clone())
            .await?
            .shutdown()
            .await;
        let one = baseline_postgres(&scratch.url, 1, b.secs, b.payload_bytes).await?;
        let four = baseline_postgres(&scratch.url, 4, b.secs, b.payload_bytes).await?;
        let baseline = one.max(four);
        println!(
            "\nbaseline raw batched INSERT (500 rows/txn, no chain): 1 writer {one:.0} rows/s, 4 writers {four:.0} rows/s"
        );
        if let Some(&(c, ours)) = best.iter().max_by_key(|(c, _)| *c) {
            println!(
                "ratio at {c} appenders: {ours:.0} / {baseline:.0} = {:.2}",
                ours / baseline
            );
        }
        scratch.drop().await;
    }

    if b.rate > 0 {
        let scratch = Scratch::new(&b.database_url).await?;
        let store = EventStore::connect(&scratch.url, config.clone()).await?;
        let r = open_loop(&store, b.rate, b.secs, b.payload_bytes).await;
        println!(
            "\nopen loop at {} events/s offered: {} appended, achieved {:.0}/s, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            b.rate,
            r.events,
            r.rate(),
            ms(percentile(&r.latencies, 0.5)),
            ms(percentile(&r.latencies, 0.99)),
            ms(r.latencies.last().copied().unwrap_or_default())
        );
        store.shutdown().await;
        scratch.drop().await;
    }

    if b.verify_events > 0 {
        let scratch = Scratch::new(&b.database_url).await?;
        let store = EventStore::connect(
            &scratch.url,
            StoreConfig {
                max_events_per_append: 500,
                ..config.clone()
            },
        )
        .await?;
        let signer = CheckpointSigner::generate()?;
        let trusted = signer.verifier();
        let fill_started = Instant::now();
        fill_signed(&store, signer, b.verify_events, b.payload_bytes, false).await?;
        let filled = fill_started.elapsed();
        let started = Instant::now();
        let report = verify_store(&store, Some(trusted), |_| {}).await?;
        let took = started.elapsed();
        if let Some(f) = &report.failure {
            bail!("verify failed at seq {}: {}", f.seq, f.problem);
        }
        // Baseline: reading the same rows without checking anything.
        let started = Instant::now();
        let mut next = 1;
        loop {
            let page = store.read_all(next, 10_000).await?;
            match page.last() {
                Some(last) => next = last.seq + 1,
                None => break,
            }
        }
        let read_only = started.elapsed();
        // And the stream verify reads (one binary COPY on PostgreSQL), without checking.
        let started = Instant::now();
        let (tx, mut rx) = tokio::sync::mpsc::channel(2);
        let reader = {
            let store = store.clone();
            tokio::spawn(async move { store.read_all_into(1, 10_000, &tx).await })
        };
        while rx.recv().await.is_some() {}
        reader.await??;
        let streamed = started.elapsed();
        println!(
            "\nverify: {} events and {} checkpoints in {:.2} s ({:.0} events/s); reading the same rows alone takes {:.2} s in pages, {:.2} s as verify reads them (filled in {:.1} s)",
            report.events_checked,
            report.checkpoints_checked,
            took.as_secs_f64(),
            report.events_checked as f64 / took.as_secs_f64(),
            read_only.as_secs_f64(),
            streamed.as_secs_f64(),
            filled.as_secs_f64()
        );
        store.shutdown().await;
        scratch.drop().await;
    }
    Ok(())
}

/// Appends `events` events from 4 tasks in 500-event appends while a checkpointer signs
/// every 1,000; ends with a final checkpoint covering everything. With `access`, one task
/// in four writes regulators' `AuditQueried` records to `access/audit` instead of
/// clearing decisions.
async fn fill_signed(
    store: &EventStore,
    signer: CheckpointSigner,
    events: u64,
    payload_bytes: usize,
    access: bool,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let checkpointer = tokio::spawn(run_checkpointer(
        store.clone(),
        signer,
        CheckpointPolicy::default(),
        stop_rx,
    ));
    let per_task = events / 4;
    let fills: Vec<_> = (0..4u64)
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut done = 0;
                let (stream, kind) = match t {
                    3 if access => ("access/audit".to_owned(), "AuditQueried"),
                    _ => (format!("clearing/member-{t}"), "ClearingDecided"),
                };
                while done < per_task {
                    let n = (per_task - done).min(500);
                    let events = (0..n)
                        .map(|i| NewEvent::new(kind, payload(payload_bytes, done + i)))
                        .collect();
                    store.append(&stream, ExpectedVersion::Any, events).await?;
                    done += n;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for f in fills {
        f.await??;
    }
    let _ = stop_tx.send(true);
    checkpointer.await??;
    Ok(())
}

async fn audit(b: AuditBench) -> anyhow::Result<()> {
    use aether_ledger::checkpoint::SignedCheckpoint;
    use aether_ledger::{Direction, EventFilter, MerkleLog};
    use rand::RngExt;

    println!(
        "# aether bench audit on {} ({} events, export of {}, {} proofs)\n",
        redact_url(&b.database_url),
        b.events,
        b.export_events,
        b.proofs
    );
    let scratch = Scratch::new(&b.database_url).await?;
    let store = EventStore::connect(&scratch.url, StoreConfig::default()).await?;
    let signer = CheckpointSigner::generate()?;
    let trusted = signer.verifier();
    let control = tokio::spawn(control_rounds(store.clone(), b.events, b.control_rounds));
    fill_signed(&store, signer, b.events, b.payload_bytes, true).await?;
    let control_events = control.await??;
    if let Some(pool) = store.postgres_pool() {
        // Statistics as autovacuum would have them on a ledger this size: the query plans
        // measured below are the ones a long-running service gets.
        sqlx::query("ANALYZE events").execute(pool).await?;
    }
    let anchor: SignedCheckpoint = store
        .read_stream(
            aether_ledger::checkpoint::CHECKPOINT_STREAM,
            u64::MAX,
            Direction::Backward,
            1,
        )
        .await?
        .first()
        .and_then(SignedCheckpoint::from_event)
        .and_then(Result::ok)
        .ok_or_else(|| anyhow::anyhow!("no checkpoint after the fill"))?;

    // The log as `aether serve` keeps it (event hashes in a file), and the whole tree in
    // memory as the baseline.
    let started = Instant::now();
    let memory = MerkleLog::default();
    let leaves = memory.catch_up(&store).await?;
    println!(
        "Merkle log in memory: {leaves} leaves loaded in {:.2} s, {:.1} MiB of hashes",
        started.elapsed().as_secs_f64(),
        mib(memory.resident_hashes() * 32)
    );
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("event-hashes");
    let started = Instant::now();
    let first = MerkleLog::open(&file, &store).await?;
    let built = started.elapsed();
    drop(first);
    let started = Instant::now();
    let log = MerkleLog::open(&file, &store).await?;
    println!(
        "Merkle log with its file (as served): built in {:.2} s, opened again in {:.2} s, {:.2} MiB of hashes in memory",
        built.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        mib(log.resident_hashes() * 32)
    );
    anyhow::ensure!(
        log.root_at(anchor.tree_size)? == memory.root_at(anchor.tree_size)?,
        "the two logs disagree at the checkpoint's size"
    );

    // Inclusion proofs at the anchor's size, against a primary-key read of the same events.
    let mut rng = rand::rng();
    let seqs: Vec<u64> = (0..b.proofs)
        .map(|_| rng.random_range(1..=anchor.tree_size))
        .collect();
    let time_proofs = |log: &MerkleLog| -> anyhow::Result<Vec<Duration>> {
        let mut times = Vec::with_capacity(seqs.len());
        for &seq in &seqs {
            let t = Instant::now();
            let proof = log.inclusion_proof(seq, anchor.tree_size)?;
            times.push(t.elapsed());
            std::hint::black_box(proof);
        }
        times.sort();
        Ok(times)
    };
    let proof_times = time_proofs(&log)?;
    let memory_times = time_proofs(&memory)?;
    let mut read_times = Vec::with_capacity(seqs.len());
    for &seq in seqs.iter().take(2000) {
        let t = Instant::now();
        std::hint::black_box(store.read_all(seq, 1).await?);
        read_times.push(t.elapsed());
    }
    read_times.sort();
    println!(
        "inclusion proof at tree size {}: p50 {:.4} ms, p99 {:.4} ms, max {:.4} ms; in memory p50 {:.4} ms, p99 {:.4} ms; baseline: reading one event by seq p50 {:.3} ms, p99 {:.3} ms",
        anchor.tree_size,
        ms(percentile(&proof_times, 0.5)),
        ms(percentile(&proof_times, 0.99)),
        ms(proof_times.last().copied().unwrap_or_default()),
        ms(percentile(&memory_times, 0.5)),
        ms(percentile(&memory_times, 0.99)),
        ms(percentile(&read_times, 0.5)),
        ms(percentile(&read_times, 0.99)),
    );

    // Export: the same path as POST /v1/audit/exports.
    let filter = EventFilter {
        event_type: Some("ClearingDecided".into()),
        ..EventFilter::default()
    };
    let started = Instant::now();
    let mut events = Vec::new();
    let mut after = 0;
    while (events.len() as u64) < b.export_events {
        let want = (b.export_events - events.len() as u64).min(1000) as u32;
        let page = store.query(&filter, after, want).await?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        events.extend(page.into_iter().filter(|e| e.seq <= anchor.tree_size));
    }
    let read = started.elapsed();
    let count = events.len();
    // The bundle's build, timed: with every hash in memory (the baseline), then as served.
    let build = |events, proofs: &dyn aether_ledger::merkle::MerkleProofs| {
        let started = Instant::now();
        let bundle = aether_audit::Bundle::build(
            events,
            proofs,
            vec![anchor.clone()],
            serde_json::json!({"event_type": "ClearingDecided"}),
            chrono::Utc::now(),
        );
        bundle.map(|b| (b, started.elapsed()))
    };
    let (in_memory, built_in_memory) = build(events.clone(), &memory.proofs())?;
    drop((in_memory, memory));
    let (bundle, built) = build(events, &log.proofs())?;
    let bytes = bundle.to_vec()?;
    let exported = started.elapsed() - built_in_memory;
    let started = Instant::now();
    let parsed = aether_audit::Bundle::from_slice(&bytes)?;
    let verdict = aether_audit::verify_bundle(&parsed, Some(&trusted));
    let verified = started.elapsed();
    anyhow::ensure!(verdict.ok, "the exported bundle does not verify: {verdict}");
    println!(
        "export of {count} events with proofs: {:.2} s ({} MiB; of which the bundle's build {:.2} s, {:.2} s with the log in memory); reading them alone: {:.2} s; offline verify: {:.2} s",
        exported.as_secs_f64(),
        bytes.len() / (1024 * 1024),
        built.as_secs_f64(),
        built_in_memory.as_secs_f64(),
        read.as_secs_f64(),
        verified.as_secs_f64()
    );
    state_as_of(&store, control_events, b.states).await?;
    timeline_pages(&store, anchor.tree_size, b.pages).await?;
    store.shutdown().await;
    if b.keep_database {
        println!("kept {}", redact_url(&scratch.url));
    } else {
        scratch.drop().await;
    }
    Ok(())
}

/// Policy source for a bench round: the example policy at another version.
const AML_POLICY: &str = include_str!("../../rules/policies/aml_v2.yaml");
const BASEL_POLICY: &str = include_str!("../../rules/policies/basel3_delta.yaml");

/// Control-plane changes through the registries, spread over a fill of `events`: round
/// `r` starts once the ledger passes `events * r / (rounds + 1)`. Returns how many control
/// events were written.
async fn control_rounds(store: EventStore, events: u64, rounds: u64) -> anyhow::Result<u64> {
    use aether_control::{
        ActivationRequest, Command, ControlState, CorpusIngest, ModelSpec, Origin, RolloutRequest,
    };
    use aether_rules::PolicyFormat;

    let live = ControlState::replay(&store).await?;
    let op = Origin::from("operator:bench");
    let mut committed = store.committed_seq();
    let mut written = 0u64;
    let n = |c: Option<aether_ledger::Committed>| u64::from(c.is_some());
    for r in 1..=rounds {
        let threshold = events * r / (rounds + 1);
        while *committed.borrow_and_update() < threshold {
            committed.changed().await?;
        }
        let aml = AML_POLICY.replace("version: 2.0.0", &format!("version: 2.0.{r}"));
        written += n(live.policies.ingest(&aml, PolicyFormat::Yaml, &op).await?.1);
        if r % 4 == 0 {
            let basel = BASEL_POLICY.replace("version: 1.0.0", &format!("version: 1.0.{r}"));
            written += n(live
                .policies
                .ingest(&basel, PolicyFormat::Yaml, &op)
                .await?
                .1);
        }
        let region = format!("region-{}", r % 4);
        let model_ref = format!("finmoe-r{r}@{region}");
        let spec = ModelSpec {
            model_ref: model_ref.clone(),
            // Remote artifacts are checked by the workers that fetch them.
            uri: format!("s3://aether-bench/models/r{r}.bin"),
            digest: hex::encode(aether_ledger::hashing::sm3(model_ref.as_bytes())),
            feature_schema: serde_json::json!({"amount_minor": "int"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
        };
        written += n(live.models.register(spec, &op).await?);
        let (request, activation) = live
            .engines
            .request_activation(
                ActivationRequest {
                    model_ref: model_ref.clone(),
                    traffic_weight: 0.5,
                    policy_hooks: vec!["aml_v2".into()],
                },
                &op,
            )
            .await?;
        written += n(Some(request));
        activation.await?;
        // Four steps after the request (verified, bound, breaker, activated).
        written += 4;
        if r > 4 {
            let (rollout, started) = live
                .rollouts
                .start(
                    RolloutRequest {
                        baseline: format!("finmoe-r{}@{region}", r - 4),
                        candidate: model_ref.clone(),
                        steps: vec![10, 50, 100],
                        analysis: Default::default(),
                        automated: false,
                    },
                    &op,
                )
                .await?;
            written += n(Some(started));
            for command in [Command::Step, Command::Step, Command::Promote] {
                written += n(Some(
                    live.rollouts
                        .command(&rollout.id, command, None, None, &op)
                        .await?
                        .1,
                ));
            }
        }
        if r % 5 == 0 {
            let text =
                format!("# Notice {r}\n\n## Reporting\n\nReport trades above threshold {r}.\n");
            let ingest: CorpusIngest = serde_json::from_value(serde_json::json!({
                "name": "mas-notices",
                "documents": [{"id": format!("notice-{r}"), "text": text}],
            }))?;
            written += n(live.corpora.ingest(ingest, &op).await?.1);
            let snapshot = NewEvent::new(
                aether_control::SNAPSHOT_COMMITTED,
                serde_json::json!({"id": format!("snap-{r}"), "rules_digest": hex::encode(live.policies.engine().snapshot().digest())}),
            );
            store
                .append(
                    aether_control::SNAPSHOT_STREAM,
                    ExpectedVersion::Any,
                    vec![snapshot],
                )
                .await?;
            written += 1;
        }
    }
    Ok(written)
}

/// The console's timeline: pages of 100 events from random cursors, the way
/// `GET /v1/audit/events?cursor=&limit=100` reads them (with no filter, by event type, by
/// stream prefix, and by a type that is rare, for which the page spans the most of the
/// ledger), each after the access record the API writes first; against reading the same
/// number of events by seq alone.
async fn timeline_pages(store: &EventStore, tree_size: u64, pages: u64) -> anyhow::Result<()> {
    use aether_ledger::EventFilter;
    use rand::RngExt;

    let mut rng = rand::rng();
    let cursors: Vec<u64> = (0..pages.max(1))
        .map(|_| rng.random_range(0..tree_size))
        .collect();
    let mut read_times = Vec::with_capacity(cursors.len());
    for &cursor in &cursors {
        let t = Instant::now();
        std::hint::black_box(store.read_all(cursor + 1, 100).await?);
        read_times.push(t.elapsed());
    }
    read_times.sort();
    let filters = [
        ("no filter", EventFilter::default()),
        (
            "event_type=AuditQueried",
            EventFilter {
                event_type: Some("AuditQueried".into()),
                ..EventFilter::default()
            },
        ),
        (
            "stream_prefix=clearing/member-1",
            EventFilter {
                stream_prefix: Some("clearing/member-1".into()),
                ..EventFilter::default()
            },
        ),
        (
            "event_type=PolicyIngested (rare)",
            EventFilter {
                event_type: Some("PolicyIngested".into()),
                ..EventFilter::default()
            },
        ),
        (
            "actor=operator:bench (rare, metadata)",
            EventFilter {
                metadata: vec![("actor".into(), "operator:bench".into())],
                ..EventFilter::default()
            },
        ),
    ];
    println!(
        "\ntimeline pages of 100 events from {} random cursors (baseline: reading 100 events by seq p50 {:.2} ms, p99 {:.2} ms):",
        cursors.len(),
        ms(percentile(&read_times, 0.5)),
        ms(percentile(&read_times, 0.99))
    );
    for (name, filter) in filters {
        let mut times = Vec::with_capacity(cursors.len());
        for &cursor in &cursors {
            let t = Instant::now();
            let access = NewEvent::new("AuditQueried", serde_json::json!({"query": "events"}));
            store
                .append("access/audit", ExpectedVersion::Any, vec![access])
                .await?;
            std::hint::black_box(store.query(&filter, cursor, 100).await?);
            times.push(t.elapsed());
        }
        times.sort();
        println!(
            "  {name}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (access record included)",
            ms(percentile(&times, 0.5)),
            ms(percentile(&times, 0.99)),
            ms(times.last().copied().unwrap_or_default())
        );
    }
    Ok(())
}

/// State as of random points of the ledger, the way `GET /v1/audit/state?at=<time>`
/// computes it (time → seq, that event, the replay up to it, its digest), against reading
/// the same control events alone and against the full replay a start does.
async fn state_as_of(store: &EventStore, control_events: u64, samples: u64) -> anyhow::Result<()> {
    use aether_control::ControlState;
    use aether_ledger::EventFilter;
    use rand::RngExt;

    let head = store.head().await?.map_or(0, |(seq, _)| seq);
    let mut rng = rand::rng();
    let mut picks = Vec::new();
    for _ in 0..samples {
        let seq = rng.random_range(1..=head);
        let event = store.read_all(seq, 1).await?;
        let at = event
            .first()
            .map(|e| e.recorded_at)
            .ok_or_else(|| anyhow::anyhow!("no event at seq {seq}"))?;
        picks.push((seq, at));
    }
    let mut times = Vec::with_capacity(picks.len());
    let mut last = None;
    for &(seq, at) in &picks {
        let t = Instant::now();
        let resolved = store.seq_at_time(at).await?.map_or(0, |(s, _)| s);
        let event = store.read_all(resolved, 1).await?;
        let past = ControlState::replay_until(store, resolved).await?;
        let digest = past.digest();
        times.push(t.elapsed());
        anyhow::ensure!(
            resolved >= seq,
            "{at} resolved to {resolved}, before seq {seq}"
        );
        std::hint::black_box((event, past.snapshot().map(|e| e.seq)));
        last = Some((resolved, digest));
    }
    // The same reads with nothing applied: the floor for any replay.
    let categories = ["policy/", "model/", "corpus/", "engine/", "rollout/"];
    let mut reads = Vec::with_capacity(picks.len());
    for &(seq, _) in &picks {
        let t = Instant::now();
        let mut n = 0;
        for prefix in categories {
            let filter = EventFilter {
                stream_prefix: Some(prefix.into()),
                max_seq: Some(seq),
                ..EventFilter::default()
            };
            n += store.query(&filter, 0, 500).await?.len();
        }
        reads.push(t.elapsed());
        std::hint::black_box(n);
    }
    let started = Instant::now();
    let now = ControlState::replay(store).await?;
    let full = started.elapsed();
    let at_head = ControlState::replay_until(store, head).await?;
    anyhow::ensure!(
        at_head.digest() == now.digest(),
        "the state as of the head differs from the replay of everything"
    );
    std::hint::black_box(last);
    // Where a replay's time goes: each projection alone, at the head.
    use aether_control::{
        CorpusRegistry, EngineRegistry, ModelRegistry, PolicyRegistry, RolloutRegistry,
    };
    let t = Instant::now();
    PolicyRegistry::load(store.clone()).await?;
    let policies = ms(t.elapsed());
    let t = Instant::now();
    CorpusRegistry::load(store.clone()).await?;
    let corpora = ms(t.elapsed());
    let t = Instant::now();
    ModelRegistry::load(store.clone()).await?;
    let models = ms(t.elapsed());
    let t = Instant::now();
    EngineRegistry::load(store.clone(), now.models.clone(), now.policies.clone()).await?;
    let engines = ms(t.elapsed());
    let t = Instant::now();
    RolloutRegistry::load(store.clone(), now.models.clone(), now.engines.clone()).await?;
    let rollouts = ms(t.elapsed());
    times.sort();
    reads.sort();
    println!(
        "state as of a time ({} random points of {head} events, {control_events} of them control events): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; baseline: reading the same control events alone p50 {:.2} ms, p99 {:.2} ms; full replay at the head {:.2} ms",
        times.len(),
        ms(percentile(&times, 0.5)),
        ms(percentile(&times, 0.99)),
        ms(times.last().copied().unwrap_or_default()),
        ms(percentile(&reads, 0.5)),
        ms(percentile(&reads, 0.99)),
        ms(full),
    );
    println!(
        "  each projection alone at the head: policies {policies:.2} ms (compiled again), corpora {corpora:.2} ms (versions rebuilt and indexed), models {models:.2} ms, engines {engines:.2} ms, rollouts {rollouts:.2} ms"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_payloads_have_the_size_asked_for() {
        for bytes in [500, 2_000] {
            let text = payload(bytes, 42).to_string();
            assert!(text.len().abs_diff(bytes) <= 1, "{bytes}: {}", text.len());
        }
    }

    #[test]
    fn scratch_urls_keep_host_and_query() {
        assert_eq!(
            aether_ledger_url_with_db("postgres://u@h:5432/postgres?sslmode=disable", "x"),
            "postgres://u@h:5432/x?sslmode=disable"
        );
        assert_eq!(
            aether_ledger_url_with_db("postgres://h", "x"),
            "postgres://h/x"
        );
    }
}

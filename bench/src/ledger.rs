//! `aether bench ledger`: append throughput and latency at several concurrencies, an
//! open-loop latency run at a fixed offered rate, and verification time, each against a
//! baseline measured in the same run on the same database server (on PostgreSQL the same
//! rows written by binary `COPY`, as the ledger's writer writes them, without the chain).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aether_ledger::checkpoint::CheckpointSigner;
use aether_ledger::pg_binary::{BinaryRows, copy_in};
use aether_ledger::{EventStore, ExpectedVersion, NewEvent, StoreConfig, redact_url, verify_store};
use anyhow::{Context, bail};
use sqlx::Connection;
use sqlx::postgres::PgConnection;

use crate::report::{ms, payload, percentile};
use crate::scratch::{Scratch, fill_signed};
use clap::Args;

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

/// The stream of the `n`th appender or event: 64 streams, as a clearing house's members.
pub(crate) fn stream_of(n: u64) -> String {
    format!("clearing/member-{:04}", n % 64)
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
                let stream = stream_of(t as u64);
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
            let stream = stream_of(n);
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

/// The physical limit of the ledger's own write: rows shaped like ledger rows (same
/// columns, constraints and indexes as `events`, same payload size, same commit durability)
/// written as the ledger's writer writes them, one binary `COPY` per 500-row transaction,
/// by `writers` connections back to back; but with no chain to plan, no validation and no
/// triggers.
async fn baseline_copy(
    url: &str,
    writers: usize,
    secs: u64,
    payload_bytes: usize,
) -> anyhow::Result<f64> {
    sqlx::raw_sql(
        "DROP TABLE IF EXISTS baseline_events; \
         CREATE TABLE baseline_events (LIKE events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)",
    )
    .execute(&mut PgConnection::connect(url).await?)
    .await?;
    let text = payload(payload_bytes, 0).to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let next_seq = Arc::new(std::sync::atomic::AtomicI64::new(1));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(writers);
    for _ in 0..writers {
        let mut conn = PgConnection::connect(url).await?;
        let (stop, next_seq, text) = (stop.clone(), next_seq.clone(), text.clone());
        tasks.push(tokio::spawn(async move {
            let mut rows = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let first = next_seq.fetch_add(500, Ordering::Relaxed);
                let now = chrono::Utc::now();
                let mut data = BinaryRows::new(11, 500 * (text.len() + 200));
                for seq in first..first + 500 {
                    let hash = aether_ledger::hashing::sm3(&seq.to_be_bytes());
                    // The ledger run's 64 streams, each row going to the next (seq n is
                    // version n / 64 + 1 of `stream_of(n)`), so the stream index takes
                    // inserts at as many places as the ledger's batches give it.
                    data.row()
                        .int8(seq)
                        .text(&stream_of(seq as u64))?
                        .int8(seq / 64 + 1)
                        .uuid(&uuid::Uuid::now_v7())
                        .text("ClearingDecided")?
                        .int4(1)
                        .text(&text)?
                        .text("{}")?
                        .timestamptz(&now)
                        .bytes(&hash)?
                        .bytes(&hash)?;
                }
                let mut tx = conn.begin().await?;
                copy_in(&mut tx, COPY_BASELINE, data.finish(), "the COPY baseline").await?;
                tx.commit().await?;
                rows += 500;
            }
            anyhow::Ok(rows)
        }));
    }
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut rows = 0;
    for t in tasks {
        rows += t.await.context("a COPY baseline writer panicked")??;
    }
    Ok(rows as f64 / started.elapsed().as_secs_f64())
}

/// The physical limit of the same write on SQLite (the embedded default): rows shaped like
/// ledger rows (a copy of `events`' own DDL and indexes, without its append-only triggers)
/// inserted as the ledger's writer inserts them, one multi-row `INSERT` per 500-row
/// `BEGIN IMMEDIATE` transaction, on a connection with the ledger's settings
/// ([`aether_ledger::sqlite_options`]); SQLite has one writer, so one connection. No chain
/// to plan, no validation, no triggers.
async fn baseline_sqlite(url: &str, secs: u64, payload_bytes: usize) -> anyhow::Result<f64> {
    let options = aether_ledger::sqlite_options(url)?;
    let mut conn = sqlx::SqliteConnection::connect_with(&options).await?;
    let ddl: Vec<String> = sqlx::query_scalar(
        "SELECT sql FROM sqlite_master WHERE tbl_name = 'events' AND sql IS NOT NULL \
         AND type IN ('table', 'index') ORDER BY type DESC",
    )
    .fetch_all(&mut conn)
    .await?;
    if ddl.is_empty() {
        bail!("the scratch ledger has no events table to copy the shape of");
    }
    for statement in &ddl {
        sqlx::raw_sql(&statement.replace("events", "baseline_events"))
            .execute(&mut conn)
            .await?;
    }
    let text = payload(payload_bytes, 0).to_string();
    let started = Instant::now();
    let mut rows = 0i64;
    let mut seq = 1i64;
    while started.elapsed() < Duration::from_secs(secs) {
        let now = chrono::Utc::now().timestamp_micros();
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        let mut insert: sqlx::QueryBuilder<sqlx::Sqlite> = sqlx::QueryBuilder::new(
            "INSERT INTO baseline_events (seq, stream_id, stream_version, event_id, event_type, \
             schema_version, payload, metadata, recorded_at, prev_hash, hash) ",
        );
        insert.push_values(seq..seq + 500, |mut b, n| {
            let hash = aether_ledger::hashing::sm3(&n.to_be_bytes());
            // The ledger run's streams, each row going to the next (seq n is version
            // n / 64 + 1 of `stream_of(n)`), so the stream index takes the same inserts.
            b.push_bind(n)
                .push_bind(stream_of(n as u64))
                .push_bind(n / 64 + 1)
                .push_bind(uuid::Uuid::now_v7())
                .push_bind("ClearingDecided")
                .push_bind(1i32)
                .push_bind(text.clone())
                .push_bind("{}")
                .push_bind(now)
                .push_bind(hash.to_vec())
                .push_bind(hash.to_vec());
        });
        insert.build().execute(&mut *tx).await?;
        tx.commit().await?;
        seq += 500;
        rows += 500;
    }
    Ok(rows as f64 / started.elapsed().as_secs_f64())
}

const COPY_BASELINE: &str = "COPY baseline_events (seq, stream_id, stream_version, event_id, \
     event_type, schema_version, payload, metadata, recorded_at, prev_hash, hash) \
     FROM STDIN (FORMAT binary)";

pub async fn run(b: LedgerBench) -> anyhow::Result<()> {
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

    // The same rows written by the database alone, in the same run: a binary COPY on
    // PostgreSQL, the ledger's own multi-row INSERT on SQLite.
    {
        let scratch = Scratch::new(&b.database_url).await?;
        // Creates the events table the baseline copies its shape from.
        EventStore::connect(&scratch.url, config.clone())
            .await?
            .shutdown()
            .await;
        let (baseline, target) = if postgres {
            let one = baseline_copy(&scratch.url, 1, b.secs, b.payload_bytes).await?;
            let four = baseline_copy(&scratch.url, 4, b.secs, b.payload_bytes).await?;
            println!(
                "\nbaseline binary COPY of the same rows (500 rows/txn, no chain): 1 writer {one:.0} rows/s, 4 writers {four:.0} rows/s"
            );
            (one.max(four), 0.8)
        } else {
            let baseline = baseline_sqlite(&scratch.url, b.secs, b.payload_bytes).await?;
            println!(
                "\nbaseline SQLite INSERT of the same rows (500 rows/txn, WAL, synchronous FULL, no chain): {baseline:.0} rows/s"
            );
            (baseline, 0.4)
        };
        if let Some(&(c, ours)) = best.iter().max_by_key(|(c, _)| *c) {
            println!(
                "ratio at {c} appenders: {ours:.0} / {baseline:.0} = {:.2} (target ≥ {target})",
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

//! `aether bench lineage`: events/s through the lineage relays into the Delta `events`
//! table and the OpenLineage store, the lag of the OpenLineage records (which follow the
//! Delta commits) at an offered rate, and the time to open the `events` table.

use std::time::{Duration, Instant};

use aether_ledger::hashing::GENESIS_PREV_HASH;
use aether_ledger::{
    AppendToStream, EventStore, ExpectedVersion, NewEvent, RecordedEvent, StoreConfig, redact_url,
};
use aether_lineage::MappingContext;
use aether_lineage::delta::DeltaSink;
use aether_lineage::delta_relay::{DELTA_CURSOR, DeltaRelayConfig, run_delta_relay};
use aether_lineage::relay::{OPENLINEAGE_CURSOR, run_openlineage_relay};
use clap::Args;

use crate::report::{ms, payload, percentile};
use crate::scratch::Scratch;

#[derive(Args)]
pub struct LineageBench {
    /// Server to benchmark on: `postgres://…` (needs CREATE DATABASE) or `sqlite:` (temp files).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// Events in the ledger for the throughput run; the `events` table is then opened at
    /// that size.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Offered load for the lag run, events per second (0 skips it).
    #[arg(long, default_value_t = 10_000)]
    rate: u64,
    /// Seconds the lag run lasts.
    #[arg(long, default_value_t = 20)]
    secs: u64,
    /// Approximate canonical payload size per event, bytes.
    #[arg(long, default_value_t = 500)]
    payload_bytes: usize,
    /// Commits for the Delta growth run (0 skips it): the `events` table over that many
    /// appends, as the relay makes them (one a second while events arrive), with
    /// compaction and without it (checkpoints every 10 commits: the release before).
    #[arg(long, default_value_t = 0)]
    commits: u64,
    /// Events per commit in the growth run.
    #[arg(long, default_value_t = 8)]
    events_per_commit: u64,
}

/// Both relays of `aether serve` on `store`, writing under `dir`.
struct Relays {
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), aether_lineage::relay::RelayError>>>,
}

impl Relays {
    fn start(store: &EventStore, dir: &std::path::Path) -> Relays {
        let (stop, rx) = tokio::sync::watch::channel(false);
        let tasks = vec![
            tokio::spawn(run_delta_relay(
                store.clone(),
                DeltaRelayConfig::new(dir.join("delta").join("events")),
                rx.clone(),
            )),
            tokio::spawn(run_openlineage_relay(
                store.clone(),
                MappingContext::new("http://127.0.0.1:8080"),
                None,
                rx,
            )),
        ];
        Relays { stop, tasks }
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// The lower of the two relays' cursors.
async fn relayed(store: &EventStore) -> anyhow::Result<u64> {
    let delta = store.load_position(DELTA_CURSOR).await?.unwrap_or(0);
    let openlineage = store.load_position(OPENLINEAGE_CURSOR).await?.unwrap_or(0);
    Ok(delta.min(openlineage))
}

/// Events `first..first + count` as one atomic append over up to 64 streams.
fn batch(first: u64, count: u64, payload_bytes: usize) -> Vec<AppendToStream> {
    let streams = count.min(64);
    (0..streams)
        .map(|s| AppendToStream {
            stream_id: format!("clearing/member-{s:04}"),
            expected: ExpectedVersion::Any,
            events: (first + s..first + count)
                .step_by(streams as usize)
                .map(|n| NewEvent::new("ClearingDecided", payload(payload_bytes, n)))
                .collect(),
        })
        .collect()
}

/// Appends `n` events in batches of 500.
async fn fill(store: &EventStore, n: u64, payload_bytes: usize) -> anyhow::Result<()> {
    let mut done = 0;
    while done < n {
        let count = (n - done).min(500);
        store
            .append_multi(batch(done, count, payload_bytes))
            .await?;
        done += count;
    }
    Ok(())
}

pub async fn run(b: LineageBench) -> anyhow::Result<()> {
    println!(
        "# aether bench lineage on {} (~{} B payloads)\n",
        redact_url(&b.database_url),
        b.payload_bytes
    );

    // Throughput: a filled ledger, then both relays from zero until both reach the head.
    let scratch = Scratch::new(&b.database_url).await?;
    let dir = tempfile::tempdir()?;
    let store = EventStore::connect(&scratch.url, StoreConfig::default()).await?;
    let filling = Instant::now();
    fill(&store, b.events, b.payload_bytes).await?;
    println!(
        "filled {} events in {:.1} s",
        b.events,
        filling.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let relays = Relays::start(&store, dir.path());
    while relayed(&store).await? < b.events {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    relays.stop().await;
    println!(
        "relay throughput (Delta + OpenLineage records): {} events in {secs:.1} s = {:.0} events/s",
        b.events,
        b.events as f64 / secs
    );

    // Opening the `events` table at that size.
    let mut opens = Vec::new();
    for _ in 0..5 {
        let begun = Instant::now();
        let sink = DeltaSink::open_or_create(dir.path().join("delta").join("events")).await?;
        opens.push(begun.elapsed());
        anyhow::ensure!(
            sink.last_seq() == b.events,
            "the table holds {} events",
            sink.last_seq()
        );
    }
    opens.sort();
    println!(
        "open the events table at {} events: median {:.1} ms, max {:.1} ms",
        b.events,
        ms(percentile(&opens, 0.5)),
        ms(percentile(&opens, 1.0))
    );
    store.shutdown().await;
    scratch.drop().await;

    if b.rate > 0 {
        lag(&b).await?;
    }
    if b.commits > 0 {
        growth(&b).await?;
    }
    Ok(())
}

/// The `events` table over `b.commits` appends of `b.events_per_commit` events, all on one
/// date: per stretch of commits the time an append takes (compaction included), the live
/// data files, the data files on disk and the log's bytes; without compaction first.
async fn growth(b: &LineageBench) -> anyhow::Result<()> {
    println!(
        "\nDelta growth: {} commits of {} events (~{} B payloads), one partition\n",
        b.commits, b.events_per_commit, b.payload_bytes
    );
    println!("| sink | commits | ms per append | live files | files on disk | log MB |");
    println!("|---|---:|---:|---:|---:|---:|");
    for compacting in [false, true] {
        let dir = tempfile::tempdir()?;
        let location = dir.path().join("events");
        let mut sink = DeltaSink::open_or_create(&location).await?;
        let name = if compacting {
            "compacting"
        } else {
            // The release before: no compaction, a checkpoint every 10 commits.
            sink.table()
                .clone()
                .set_tbl_properties()
                .with_properties(std::collections::HashMap::from([(
                    "delta.checkpointInterval".to_owned(),
                    "10".to_owned(),
                )]))
                .await?;
            sink = DeltaSink::open_or_create(&location)
                .await?
                .without_compaction();
            "no compaction, checkpoint every 10"
        };
        let report_every = (b.commits / 6).max(1);
        let mut prev = GENESIS_PREV_HASH;
        let mut window = Duration::ZERO;
        for k in 0..b.commits {
            let events: Vec<RecordedEvent> = (1..=b.events_per_commit)
                .map(|i| {
                    let seq = k * b.events_per_commit + i;
                    let event = synthetic(seq, prev, b.payload_bytes);
                    prev = event.hash;
                    event
                })
                .collect();
            let begun = Instant::now();
            sink.append(&events).await?;
            window += begun.elapsed();
            if (k + 1) % report_every == 0 || k + 1 == b.commits {
                let n = (k % report_every) + 1;
                let live = sink.table().get_file_uris()?.count();
                let (files, _) = disk_usage(&location, false);
                let (_, log_bytes) = disk_usage(&location.join("_delta_log"), true);
                println!(
                    "| {name} | {} | {:.1} | {live} | {files} | {:.1} |",
                    k + 1,
                    ms(window) / n as f64,
                    log_bytes as f64 / 1e6
                );
                window = Duration::ZERO;
            }
        }
        sink.finish_compaction().await;
    }
    Ok(())
}

/// A chained event that is never hashed for real: the sink checks links, not hashes.
fn synthetic(seq: u64, prev_hash: aether_ledger::Hash, payload_bytes: usize) -> RecordedEvent {
    let mut hash = [0u8; 32];
    hash[..8].copy_from_slice(&seq.to_be_bytes());
    let raw = |v: String| serde_json::value::RawValue::from_string(v);
    RecordedEvent {
        seq,
        stream_id: crate::ledger::stream_of(seq),
        stream_version: seq / 64 + 1,
        event_id: uuid::Uuid::now_v7(),
        event_type: "ClearingDecided".into(),
        schema_version: 1,
        payload: raw(payload(payload_bytes, seq).to_string()).expect("a JSON value's text"),
        metadata: raw("{}".to_owned()).expect("JSON"),
        recorded_at: chrono::Utc::now(),
        prev_hash,
        hash,
    }
}

/// Parquet data files (outside the log) and all bytes under `dir`; `log` counts the
/// bytes of every file there instead.
fn disk_usage(dir: &std::path::Path, log: bool) -> (usize, u64) {
    let mut files = 0;
    let mut bytes = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if log || path.file_name().is_some_and(|n| n != "_delta_log") {
                let (f, b) = disk_usage(&path, log);
                files += f;
                bytes += b;
            }
        } else if log || path.extension().is_some_and(|e| e == "parquet") {
            files += 1;
            bytes += entry.metadata().map_or(0, |m| m.len());
        }
    }
    (files, bytes)
}

/// Open loop at `rate` events/s for `secs`: the lag from each event's commit to its
/// OpenLineage record (written once its Delta commit is linked), sampled every 10 ms.
async fn lag(b: &LineageBench) -> anyhow::Result<()> {
    let scratch = Scratch::new(&b.database_url).await?;
    let dir = tempfile::tempdir()?;
    let store = EventStore::connect(&scratch.url, StoreConfig::default()).await?;
    let relays = Relays::start(&store, dir.path());
    let (payload_bytes, rate, secs) = (b.payload_bytes, b.rate, b.secs);
    // Commit times by seq, from the appender; batches of rate/100 every 10 ms.
    let writer = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut committed: Vec<(u64, Instant)> = Vec::new();
            let per_tick = (rate / 100).max(1);
            let mut ticker = tokio::time::interval(Duration::from_millis(10));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let mut n = 0;
            for _ in 0..secs * 100 {
                ticker.tick().await;
                let appends = batch(n, per_tick, payload_bytes);
                n += per_tick;
                if let Ok(events) = store.append_multi(appends).await
                    && let Some(last) = events.last()
                {
                    committed.push((last.seq, Instant::now()));
                }
            }
            committed
        })
    };
    let mut seen: Vec<(u64, Instant)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(secs + 60);
    loop {
        let at = relayed(&store).await?;
        if seen.last().is_none_or(|(s, _)| *s < at) {
            seen.push((at, Instant::now()));
        }
        if writer.is_finished() && store.head().await?.is_some_and(|(h, _)| at >= h) {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the relays did not catch up");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let committed = writer.await?;
    relays.stop().await;
    // Each batch's lag: from its commit to the first sample at or past its last seq.
    let mut lags: Vec<Duration> = committed
        .iter()
        .filter_map(|(seq, at)| {
            seen.iter()
                .find(|(s, _)| s >= seq)
                .map(|(_, t)| t.saturating_duration_since(*at))
        })
        .collect();
    lags.sort();
    let events = committed.last().map_or(0, |(s, _)| *s);
    println!(
        "lag at an offered {rate} events/s for {secs} s ({events} events): p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        ms(percentile(&lags, 0.5)),
        ms(percentile(&lags, 0.99)),
        ms(percentile(&lags, 1.0))
    );
    store.shutdown().await;
    scratch.drop().await;
    Ok(())
}

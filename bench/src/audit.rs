//! `aether bench audit`: inclusion-proof latency, evidence export, state as of a past
//! moment and timeline pages on a ledger of a million events, against plain reads.

use std::time::{Duration, Instant};

use aether_ledger::checkpoint::CheckpointSigner;
use aether_ledger::{EventStore, ExpectedVersion, NewEvent, StoreConfig, redact_url};
use clap::Args;

use crate::report::{mib, ms, percentile};
use crate::scratch::{Scratch, fill_signed};

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

pub async fn run(b: AuditBench) -> anyhow::Result<()> {
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
const AML_POLICY: &str = include_str!("../../services/rules/policies/aml_v2.yaml");
const BASEL_POLICY: &str = include_str!("../../services/rules/policies/basel3_delta.yaml");

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

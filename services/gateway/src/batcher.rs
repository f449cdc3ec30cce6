//! The dynamic batcher: trades queue here after the rules and are scored in batches.
//!
//! A batch closes when it holds `max_batch` trades or its first trade has waited
//! `max_delay`, whichever comes first; it then goes to a free worker. The queue is bounded
//! (`queue_capacity`) and a full queue refuses at once ([`Overloaded`]), so memory never
//! grows with load: callers answer RESOURCE_EXHAUSTED and members retry. Each batch is
//! netted by the worker; its `NettingComputed` event and the decisions of its trades are
//! then committed together, in one atomic append (one group commit per request, not two),
//! before any trade of the batch is answered.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use aether_gpu_worker::{
    ClearingModel, ExplainPlan, Explanation, Netting, Score, Trade, TradeContext, net,
};
use aether_ledger::{
    Committed, EventStore, ExpectedVersion, LedgerError, NewEvent, PreparedAppend, PreparedEvent,
};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc, oneshot};
use uuid::Uuid;

use crate::breaker::{Breaker, BreakerConfig, Route, backoff_before};
use crate::observations::Observed;
use crate::pb::v1::{self as pb, WorkAssignment, WorkItem};
use crate::workers::{DispatchError, WorkerPool};

/// Stream of per-batch netting results.
pub const NETTING_STREAM: &str = "netting";
/// Event type of a batch's netting.
pub const NETTING_COMPUTED: &str = "NettingComputed";

/// Scored batches that may wait for the ledger at once, per scoring worker.
const BATCHES_RECORDING_PER_WORKER: usize = 4;

/// How trades are batched and how many batches run at once.
#[derive(Clone, Debug)]
pub struct BatcherConfig {
    pub max_batch: usize,
    pub max_delay: Duration,
    pub queue_capacity: usize,
    /// Batches scored at the same time (in process or on remote workers).
    pub workers: usize,
    /// Score in process when no remote worker holds the model.
    pub local_workers: bool,
    /// How long a remote worker has to answer a batch before it is sent elsewhere.
    pub worker_timeout: Duration,
    /// Remote attempts per batch before giving up (or falling back to in process), backed
    /// off 10, 30 and 80 ms.
    pub worker_attempts: usize,
    /// When slow remote workers send batches to the in-process path ([`crate::breaker`]).
    pub breaker: BreakerConfig,
}

impl Default for BatcherConfig {
    /// 500 trades, 2 ms, 10,000 queued, one worker per core (at least 1).
    fn default() -> Self {
        BatcherConfig {
            max_batch: 500,
            max_delay: Duration::from_millis(2),
            queue_capacity: 10_000,
            workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            local_workers: true,
            worker_timeout: Duration::from_secs(10),
            worker_attempts: 3,
            breaker: BreakerConfig::default(),
        }
    }
}

/// The model a trade is scored with: its registered identity, and the loaded model when
/// this process may score in process. A gateway without local workers never loads the
/// artifact: remote workers check the digest against their own copy.
#[derive(Clone)]
pub struct ModelHandle {
    pub model_ref: String,
    /// SM3 of the artifact, as registered.
    pub digest: String,
    pub local: Option<Arc<ClearingModel>>,
}

impl ModelHandle {
    /// A loaded model, usable in process and remotely.
    pub fn loaded(model: Arc<ClearingModel>) -> Self {
        ModelHandle {
            model_ref: model.model().model_ref().to_owned(),
            digest: model.model().digest().to_owned(),
            local: Some(model),
        }
    }
}

/// One trade waiting to be scored.
pub struct Job {
    pub model: ModelHandle,
    pub trade: Trade,
    pub context: TradeContext,
    pub reply: oneshot::Sender<Result<Scored, String>>,
    /// The rollout stage this trade's model serves, when its batches are reported.
    pub observed: Option<Observed>,
    /// Explain this trade's score whatever it is (the rules hold or reject it).
    pub explain: bool,
    /// Explain it when it scores at least this (the hold threshold).
    pub explain_at_or_above: Option<f32>,
    /// The W3C `traceparent` of the request's scoring span when it is traced (empty
    /// otherwise), carried to a remote worker with the trade.
    pub traceparent: String,
    /// The W3C `baggage` of the request's context when it is traced (empty otherwise),
    /// carried to a remote worker with its `traceparent`.
    pub baggage: String,
    /// When a traced trade was queued (set by [`Batcher::submit`]), for its queue-wait span.
    pub queued_at: Option<std::time::SystemTime>,
}

/// A trade's explanation, when one was asked for, or why there is none.
pub type ExplanationOutcome = Option<Result<Explanation, String>>;

/// A trade's score and the batch it was scored in.
#[derive(Debug)]
pub struct Scored {
    pub score: Score,
    pub batch_id: Uuid,
    pub batch_size: usize,
    /// `cpu` or `cuda:N`, as the worker reported.
    pub device: String,
    pub worker: String,
    pub worker_elapsed: Duration,
    pub explanation: ExplanationOutcome,
    /// Where the trade's decision goes to be recorded with the batch.
    pub recorder: Recorder,
}

/// A decision on its way back to its batch, with where to send its committed position.
struct Decided {
    stream_id: String,
    /// The member's request id (the event's `request_id` metadata).
    request_id: String,
    event: PreparedEvent,
    reply: oneshot::Sender<Result<Committed, RecordError>>,
}

/// Why a decision was not recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordError {
    /// Another decision for the same member and request id is on the ledger already (made
    /// by another node or process at the same time): that one stands.
    AlreadyDecided,
    /// The batch could not be recorded.
    Failed(String),
}

/// The way back for a scored trade's decision: the batch appends its `NettingComputed`
/// and every decision its trades send, atomically, so the netting is never on the ledger
/// without the decisions it covered, nor a decision without its netting. A recorder
/// dropped unused (a request given up) leaves its trade out of the append.
pub struct Recorder {
    tx: oneshot::Sender<Decided>,
    store: EventStore,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder").finish_non_exhaustive()
    }
}

impl Recorder {
    /// Records `event` on `stream_id` with the batch; answers once it is committed. The
    /// event is checked and made canonical here, in the caller's task.
    pub async fn record(
        self,
        stream_id: String,
        event: NewEvent,
    ) -> Result<Committed, RecordError> {
        let request_id = event.metadata["request_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let event = self
            .store
            .prepare(event)
            .map_err(|e| RecordError::Failed(format!("the decision cannot be recorded: {e}")))?;
        let (reply, committed) = oneshot::channel();
        let stopped =
            || RecordError::Failed("the batch stopped before the decision was recorded".into());
        self.tx
            .send(Decided {
                stream_id,
                request_id,
                event,
                reply,
            })
            .map_err(|_| stopped())?;
        committed.await.map_err(|_| stopped())?
    }
}

/// The queue is full: the caller should shed load (RESOURCE_EXHAUSTED).
#[derive(Debug, thiserror::Error)]
#[error("the clearing queue is full ({capacity} trades waiting); retry shortly")]
pub struct Overloaded {
    pub capacity: usize,
}

/// Handle to the batcher task.
#[derive(Clone)]
pub struct Batcher {
    tx: mpsc::Sender<Job>,
    capacity: usize,
}

impl Batcher {
    /// Starts the collector task; it stops when every handle is dropped.
    pub fn start(config: BatcherConfig, store: EventStore, pool: WorkerPool) -> Batcher {
        let capacity = config.queue_capacity.max(1);
        let (tx, rx) = mpsc::channel(capacity);
        tokio::spawn(collect(config, store, pool, rx));
        Batcher { tx, capacity }
    }

    /// Queues a trade, or refuses at once when the queue is full.
    pub fn submit(&self, mut job: Job) -> Result<(), Overloaded> {
        if !job.traceparent.is_empty() {
            job.queued_at = Some(std::time::SystemTime::now());
        }
        let depth = self.capacity - self.tx.capacity();
        metrics::gauge!("aether_clearing_queue_depth").set(depth as f64);
        self.tx.try_send(job).map_err(|_| {
            metrics::counter!("aether_clearing_overloaded_total").increment(1);
            Overloaded {
                capacity: self.capacity,
            }
        })
    }
}

async fn collect(
    config: BatcherConfig,
    store: EventStore,
    pool: WorkerPool,
    mut rx: mpsc::Receiver<Job>,
) {
    let workers = Arc::new(Semaphore::new(config.workers.max(1)));
    let recording = Arc::new(Semaphore::new(
        config.workers.max(1) * BATCHES_RECORDING_PER_WORKER,
    ));
    let max_batch = config.max_batch.max(1);
    let breaker = Arc::new(Breaker::new(config.breaker.clone(), store.clone()));
    while let Some(first) = rx.recv().await {
        // One timer per batch, not one per trade received.
        let deadline = tokio::time::sleep(config.max_delay);
        tokio::pin!(deadline);
        let mut batch = vec![first];
        while batch.len() < max_batch {
            tokio::select! {
                biased;
                () = &mut deadline => break,
                job = rx.recv() => match job {
                    Some(job) => batch.push(job),
                    None => break,
                },
            }
        }
        // Wait for a free worker before taking more: a busy pool backs the queue up, and
        // the bounded queue then refuses new trades.
        let Ok(permit) = workers.clone().acquire_owned().await else {
            return;
        };
        let queue_depth = rx.len();
        // A batch may hold trades for several models (baseline and candidate).
        let mut by_model: HashMap<String, Vec<Job>> = HashMap::new();
        for job in batch {
            by_model
                .entry(job.model.digest.clone())
                .or_default()
                .push(job);
        }
        let (store, pool, config) = (store.clone(), pool.clone(), config.clone());
        let recording = Arc::clone(&recording);
        let breaker = Arc::clone(&breaker);
        tokio::spawn(async move {
            let scorer = Scorer {
                store: &store,
                pool: &pool,
                config: &config,
                breaker: &breaker,
            };
            let mut scored = Vec::new();
            for (_, jobs) in by_model {
                scored.extend(score_batch(&scorer, jobs, queue_depth).await);
            }
            // Scored: the next batch may score while this one is recorded, up to a bound
            // on batches waiting for the ledger, so that a stalled ledger still backs the
            // queue up.
            let Ok(recording) = recording.acquire_owned().await else {
                return;
            };
            drop(permit);
            for batch in scored {
                record(&store, batch).await;
            }
            drop(recording);
        });
    }
}

/// The queue wait of each traced trade of a batch, as a span under its scoring span.
fn queue_spans(jobs: &[Job], batch_id: Uuid, queue_depth: usize) {
    let now = std::time::SystemTime::now();
    for job in jobs {
        if let Some(queued_at) = job.queued_at {
            crate::telemetry::past_span(
                "batch.queue",
                &job.traceparent,
                queued_at,
                now,
                vec![
                    opentelemetry::KeyValue::new("aether.batch_id", batch_id.to_string()),
                    opentelemetry::KeyValue::new("aether.batch_size", jobs.len() as i64),
                    opentelemetry::KeyValue::new("aether.queue_depth", queue_depth as i64),
                ],
            );
        }
    }
}

/// What scoring a batch gave, wherever it ran.
struct Executed {
    scores: Vec<Score>,
    explanations: Vec<ExplanationOutcome>,
    netting: Netting,
    device: String,
    worker: String,
    elapsed: Duration,
    model_ref: String,
    model_digest: String,
}

/// Where batches are scored: the remote workers, the batcher's settings and the breaker
/// between them and the in-process path.
struct Scorer<'a> {
    store: &'a EventStore,
    pool: &'a WorkerPool,
    config: &'a BatcherConfig,
    breaker: &'a Breaker,
}

/// Scores and nets a batch: on a remote worker holding the model when one is connected
/// (another one after a loss, backed off), else in process when allowed; in process too
/// while the breaker is open, but for the probes it sends to the workers.
async fn execute(
    scorer: &Scorer<'_>,
    model: ModelHandle,
    inputs: Vec<(Trade, TradeContext)>,
    plan: ExplainPlan,
    contexts: &[(String, String)],
) -> Result<Executed, String> {
    let Scorer {
        pool,
        config,
        breaker,
        ..
    } = *scorer;
    let ModelHandle {
        model_ref,
        digest,
        local,
    } = model;
    let in_process_possible = local.is_some() && config.local_workers;
    let route = if pool.serves(&digest) {
        breaker.route(in_process_possible)
    } else {
        Route::InProcess
    };
    let mut last_error = None;
    let mut probe_answered = false;
    for attempt in 0..config.worker_attempts.max(1) {
        if route == Route::InProcess || !pool.serves(&digest) {
            break;
        }
        tokio::time::sleep(backoff_before(attempt)).await;
        let assignment = WorkAssignment {
            batch_id: Uuid::now_v7().to_string(),
            model_ref: model_ref.clone(),
            model_digest: digest.clone(),
            items: inputs
                .iter()
                .enumerate()
                .map(|(i, (t, c))| {
                    let mut item = work_item(t, c, plan.marked.get(i).copied().unwrap_or(false));
                    if let Some((traceparent, baggage)) = contexts.get(i) {
                        item.traceparent.clone_from(traceparent);
                        item.baggage.clone_from(baggage);
                    }
                    item
                })
                .collect(),
            explain_at_or_above: plan.at_or_above.map(f64::from),
        };
        let sent = std::time::Instant::now();
        let dispatched = pool.dispatch(assignment, config.worker_timeout).await;
        // A batch answered, or not answered in time, is a measure of the workers' speed.
        if matches!(&dispatched, Ok(_) | Err(DispatchError::Timeout(_))) {
            probe_answered |= route == Route::Probe;
            breaker
                .observe(sent.elapsed(), route == Route::Probe, in_process_possible)
                .await;
        }
        match dispatched {
            Ok((worker, result)) => match check_remote(&inputs, &result) {
                Ok((scores, netting)) => {
                    return Ok(Executed {
                        explanations: result.scores.iter().map(remote_explanation).collect(),
                        scores,
                        netting,
                        device: result.device,
                        worker,
                        elapsed: Duration::from_micros(result.elapsed_us),
                        model_ref,
                        model_digest: digest,
                    });
                }
                Err(reason) => {
                    tracing::error!(%worker, %reason, "a worker's result was refused");
                    last_error = Some(format!("worker {worker}: {reason}"));
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "batch dispatch failed; trying again");
                metrics::counter!("aether_clearing_batch_redispatch_total").increment(1);
                last_error = Some(e.to_string());
            }
        }
    }
    if route == Route::Probe && !probe_answered {
        breaker.probe_unanswered();
    }
    let Some(model) = local.filter(|_| config.local_workers) else {
        return Err(last_error.unwrap_or_else(|| DispatchError::NoWorker(digest).to_string()));
    };
    // A traced batch scored here has a span of its own, entered on the blocking thread so
    // that its stages (scoring, netting, explanations) are its children.
    let span = in_process_span(contexts, inputs.len());
    let result = tokio::task::spawn_blocking(move || {
        span.in_scope(|| model.score_net_and_explain(&inputs, &plan))
    })
    .await
    .map_err(|e| format!("the worker stopped: {e}"))?
    .map_err(|e| e.to_string())?;
    Ok(Executed {
        explanations: result
            .explanations
            .into_iter()
            .map(|e| e.map(|r| r.map_err(|e| e.to_string())))
            .collect(),
        scores: result.scores,
        netting: result.netting,
        device: result.device,
        worker: "in-process".to_owned(),
        elapsed: result.elapsed,
        model_ref: result.model_ref,
        model_digest: result.model_digest,
    })
}

/// The span of a batch scored in process for traced requests: a child of the first traced
/// request's scoring span, as a remote worker's batch span is; none for an untraced batch.
fn in_process_span(contexts: &[(String, String)], size: usize) -> tracing::Span {
    let mut traced = contexts.iter().filter(|(t, _)| !t.is_empty());
    let Some((traceparent, baggage)) = traced.next() else {
        return tracing::Span::none();
    };
    let span = tracing::debug_span!(
        "worker.batch",
        otel.name = "clearing.batch",
        aether.worker = "in-process",
        aether.batch_size = size,
        aether.traced_items = 1 + traced.count(),
    );
    crate::telemetry::follow_context(&span, traceparent, "", baggage);
    span
}

/// A remote worker's explanation, read as strictly as the worker's own type; a reply
/// without one (an older worker) says so rather than leaving the decision unexplained.
fn remote_explanation(score: &pb::ItemScore) -> ExplanationOutcome {
    if !score.explanation_json.is_empty() {
        return Some(
            serde_json::from_str::<Explanation>(&score.explanation_json)
                .map_err(|e| format!("the worker's explanation is unreadable: {e}"))
                .and_then(|e| {
                    // The reference pass and the worker's device agree to f32 rounding.
                    if (e.score - score.score).abs() < 1e-4 {
                        Ok(e)
                    } else {
                        Err(format!(
                            "the worker's explanation is of score {}, not {}",
                            e.score, score.score
                        ))
                    }
                }),
        );
    }
    (!score.explanation_error.is_empty()).then(|| Err(score.explanation_error.clone()))
}

fn work_item(trade: &Trade, context: &TradeContext, explain: bool) -> WorkItem {
    WorkItem {
        request_id: trade.request_id.clone(),
        member_id: trade.member_id.clone(),
        trade: Some(pb::Trade {
            buyer: trade.buyer.clone(),
            seller: trade.seller.clone(),
            instrument: trade.instrument.clone(),
            currency: trade.currency.clone(),
            amount_minor: trade.amount_minor,
            value_date: trade.value_date.to_string(),
            jurisdiction: trade.jurisdiction.clone(),
            counterparty_tier: u32::from(trade.counterparty_tier),
        }),
        hour_utc: u32::from(context.hour_utc),
        velocity: context.velocity,
        explain,
        traceparent: String::new(),
        baggage: String::new(),
    }
}

/// A remote result is used only if it scores every trade, in order, with finite values,
/// and its netting equals the gateway's own.
fn check_remote(
    inputs: &[(Trade, TradeContext)],
    result: &pb::BatchResult,
) -> Result<(Vec<Score>, Netting), String> {
    if result.scores.len() != inputs.len() {
        return Err(format!(
            "{} scores for {} trades",
            result.scores.len(),
            inputs.len()
        ));
    }
    let mut scores = Vec::with_capacity(inputs.len());
    for ((trade, _), s) in inputs.iter().zip(&result.scores) {
        if s.request_id != trade.request_id
            || !(0.0..=1.0).contains(&s.score)
            || !(0.0..=1.0).contains(&s.confidence)
        {
            return Err(format!("bad score for request {}", trade.request_id));
        }
        scores.push(Score {
            score: s.score as f32,
            confidence: s.confidence as f32,
        });
    }
    let netting = net(inputs.iter().map(|(t, _)| t)).map_err(|e| e.to_string())?;
    let theirs: Vec<(String, String, String)> = result
        .netting
        .iter()
        .map(|p| (p.party.clone(), p.currency.clone(), p.net_minor.clone()))
        .collect();
    let ours: Vec<(String, String, String)> = netting
        .positions
        .iter()
        .map(|p| (p.party.clone(), p.currency.clone(), p.net_minor.to_string()))
        .collect();
    if theirs != ours {
        return Err("its netting differs from the gateway's".into());
    }
    Ok((scores, netting))
}

/// Scores and nets one single-model batch and answers every job with its score and a
/// recorder; what is returned records the batch once its trades have decided;
/// `queue_depth`: trades waiting when the batch started, for its rollout report.
async fn score_batch(scorer: &Scorer<'_>, jobs: Vec<Job>, queue_depth: usize) -> Option<Recording> {
    let model = jobs.first().map(|j| j.model.clone())?;
    let batch_id = Uuid::now_v7();
    let inputs: Vec<(Trade, TradeContext)> =
        jobs.iter().map(|j| (j.trade.clone(), j.context)).collect();
    let plan = ExplainPlan {
        marked: jobs.iter().map(|j| j.explain).collect(),
        at_or_above: jobs.iter().find_map(|j| j.explain_at_or_above),
    };
    let config = scorer.config;
    queue_spans(&jobs, batch_id, queue_depth);
    // Only a traced request's item carries its span (and baggage) to the worker.
    let contexts: Vec<(String, String)> = if jobs.iter().any(|j| !j.traceparent.is_empty()) {
        jobs.iter()
            .map(|j| (j.traceparent.clone(), j.baggage.clone()))
            .collect()
    } else {
        Vec::new()
    };
    let result = match execute(scorer, model, inputs, plan, &contexts).await {
        Ok(result) => result,
        Err(reason) => {
            metrics::counter!("aether_clearing_batch_failures_total").increment(1);
            for job in jobs {
                let _ = job.reply.send(Err(reason.clone()));
            }
            return None;
        }
    };
    metrics::histogram!("aether_clearing_batch_size").record(jobs.len() as f64);
    if let Some(observed) = jobs.first().and_then(|j| j.observed.as_ref()) {
        observed.batch(
            jobs.len(),
            config.max_batch,
            queue_depth,
            u64::try_from(result.elapsed.as_micros()).unwrap_or(u64::MAX),
        );
    }
    metrics::histogram!("aether_clearing_worker_seconds").record(result.elapsed.as_secs_f64());
    // Amounts as decimal strings: a sum may exceed the ledger's exact JSON integers.
    let positions: Vec<_> = result
        .netting
        .positions
        .iter()
        .map(|p| json!({"party": p.party, "currency": p.currency, "net_minor": p.net_minor.to_string()}))
        .collect();
    let currencies: Vec<_> = result
        .netting
        .currencies
        .iter()
        .map(|c| {
            json!({
                "currency": c.currency,
                "gross_minor": c.gross_minor.to_string(),
                "net_settlement_minor": c.net_settlement_minor.to_string(),
                "trades": c.trades,
            })
        })
        .collect();
    let event = NewEvent::new(
        NETTING_COMPUTED,
        json!({
            "batch_id": batch_id.to_string(),
            "trades": jobs.len(),
            "request_ids": jobs.iter().map(|j| format!("{}/{}", j.trade.member_id, j.trade.request_id)).collect::<Vec<_>>(),
            "model_ref": result.model_ref,
            "model_digest": result.model_digest,
            "device": result.device,
            "worker_elapsed_us": u64::try_from(result.elapsed.as_micros()).unwrap_or(u64::MAX),
            "positions": positions,
            "currencies": currencies,
        }),
    );
    let size = jobs.len();
    let mut decided = Vec::with_capacity(size);
    let explanations = result
        .explanations
        .into_iter()
        .chain(std::iter::repeat(None));
    for ((job, score), explanation) in jobs.into_iter().zip(result.scores).zip(explanations) {
        let (tx, rx) = oneshot::channel();
        let _ = job.reply.send(Ok(Scored {
            score,
            explanation,
            batch_id,
            batch_size: size,
            device: result.device.clone(),
            worker: result.worker.clone(),
            worker_elapsed: result.elapsed,
            recorder: Recorder {
                tx,
                store: scorer.store.clone(),
            },
        }));
        decided.push(rx);
    }
    Some(Recording {
        netting: event,
        decided,
    })
}

/// A scored batch waiting for its trades' decisions, to record them with its netting.
struct Recording {
    netting: NewEvent,
    decided: Vec<oneshot::Receiver<Decided>>,
}

/// Appends a batch's netting (first) and its decisions, grouped by stream, in one atomic
/// append, and answers each decision with its committed position.
async fn record(store: &EventStore, recording: Recording) {
    let Recording { netting, decided } = recording;
    // Every trade answers at once (its decision is CPU work after the score) or gave up.
    let mut decided: Vec<Decided> = futures::future::join_all(decided)
        .await
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    let netting = match store.prepare(netting) {
        Ok(netting) => netting,
        Err(e) => {
            return fail(
                decided,
                &format!("the batch's netting cannot be recorded: {e}"),
            );
        }
    };
    // A decision another node recorded for the same request id meanwhile fails the atomic
    // append (the database allows one per member and request id): those are answered as
    // already decided, and the batch is recorded without them.
    for attempt in 0..3 {
        let (appends, positions) = parts(&netting, &decided);
        match store.append_prepared(appends).await {
            Ok(committed) => {
                for (Decided { reply, .. }, position) in decided.into_iter().zip(positions) {
                    let answer = committed.get(position).cloned().ok_or_else(|| {
                        RecordError::Failed(
                            "the ledger returned fewer positions than events".to_owned(),
                        )
                    });
                    let _ = reply.send(answer);
                }
                return;
            }
            Err(LedgerError::RequestIdTaken { .. }) if attempt < 2 => {
                match recorded_elsewhere(store, &decided).await {
                    Ok(taken) if !taken.is_empty() => {
                        let (gone, kept): (Vec<_>, Vec<_>) = decided
                            .into_iter()
                            .enumerate()
                            .partition(|(i, _)| taken.contains(i));
                        for (_, Decided { reply, .. }) in gone {
                            let _ = reply.send(Err(RecordError::AlreadyDecided));
                        }
                        decided = kept.into_iter().map(|(_, d)| d).collect();
                    }
                    _ => {
                        fail(
                            decided,
                            "a decision's request id is taken, but by which is unknown",
                        );
                        return;
                    }
                }
            }
            Err(e) => {
                fail(
                    decided,
                    &format!("the batch's netting and decisions could not be recorded: {e}"),
                );
                return;
            }
        }
    }
    fail(
        decided,
        "the batch's request ids kept being taken by other decisions",
    );
}

fn fail(decided: Vec<Decided>, reason: &str) {
    for Decided { reply, .. } in decided {
        let _ = reply.send(Err(RecordError::Failed(reason.to_owned())));
    }
}

/// The netting (first) and the decisions grouped by stream (a stream may appear once in
/// an append), and where each decision's committed position will be.
fn parts(netting: &PreparedEvent, decided: &[Decided]) -> (Vec<PreparedAppend>, Vec<usize>) {
    let mut appends = vec![PreparedAppend {
        stream_id: NETTING_STREAM.to_owned(),
        expected: ExpectedVersion::Any,
        events: vec![netting.clone()],
    }];
    let mut streams: HashMap<&str, usize> = HashMap::from([(NETTING_STREAM, 0)]);
    let mut placed = Vec::with_capacity(decided.len());
    for Decided {
        stream_id, event, ..
    } in decided
    {
        let part = *streams.entry(stream_id.as_str()).or_insert_with(|| {
            appends.push(PreparedAppend {
                stream_id: stream_id.clone(),
                expected: ExpectedVersion::Any,
                events: Vec::new(),
            });
            appends.len() - 1
        });
        placed.push((part, appends[part].events.len()));
        appends[part].events.push(event.clone());
    }
    // Committed positions come back in the order of the parts and their events.
    let mut offsets = Vec::with_capacity(appends.len());
    let mut offset = 0;
    for part in &appends {
        offsets.push(offset);
        offset += part.events.len();
    }
    let positions = placed
        .into_iter()
        .map(|(part, index)| offsets[part] + index)
        .collect();
    (appends, positions)
}

/// Which of `decided` (by index) already have a decision recorded for their stream and
/// request id.
async fn recorded_elsewhere(
    store: &EventStore,
    decided: &[Decided],
) -> Result<Vec<usize>, LedgerError> {
    let ids: Vec<String> = decided.iter().map(|d| d.request_id.clone()).collect();
    let found = store
        .find_by_metadata("request_id", &ids, crate::decision::CLEARING_DECIDED)
        .await?;
    let on_ledger: std::collections::HashSet<(String, String)> = found
        .iter()
        .filter_map(|e| {
            let metadata = e.metadata_value().ok()?;
            Some((
                e.stream_id.clone(),
                metadata["request_id"].as_str()?.to_owned(),
            ))
        })
        .collect();
    Ok(decided
        .iter()
        .enumerate()
        .filter(|(_, d)| on_ledger.contains(&(d.stream_id.clone(), d.request_id.clone())))
        .map(|(i, _)| i)
        .collect())
}

//! What the gateway reports to the rollout supervisor while a rollout of its region routes
//! traffic (issue 7): one observation per decided request for the stage that decided it,
//! a shadow score by the other stage on a sample (agreement needs both), and one report per
//! batch. Shadow scores are never decisions and never reach the ledger.
//!
//! Invariant: reporting never waits and never fails a request. An observation that does
//! not fit the channel is counted in `aether_rollout_observations_dropped_total`; a shadow
//! score that cannot be taken is counted in `aether_rollout_shadow_skipped_total`.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use aether_control::analysis::{BatchReport, RequestObservation, Stage};
use aether_control::rollout_controller::{ObservationSender, RolloutObservation};
use aether_gpu_worker::{ClearingModel, FEATURE_NAMES, Score, Trade, TradeContext, features};
use aether_ledger::hashing::sm3;
use chrono::Utc;
use tokio::sync::mpsc::{self, error::TrySendError};

/// Observations that did not fit the channel (label `reason`: `full` or `closed`).
pub const DROPPED_TOTAL: &str = "aether_rollout_observations_dropped_total";
/// Shadow scores not taken (label `reason`: `saturated`, `no_local_model`, `failed`).
pub const SHADOW_SKIPPED_TOTAL: &str = "aether_rollout_shadow_skipped_total";
/// Most shadow trades scored in one model call.
const SHADOW_BATCH: usize = 256;

/// How much shadow scoring the gateway does during a rollout.
#[derive(Clone, Debug)]
pub struct ShadowSettings {
    /// Share of requests, in [0, 1], also scored by the other stage; chosen by a stable
    /// draw from the request id so a replay samples the same requests.
    pub fraction: f64,
    /// Shadow trades waiting to be scored; beyond it they are skipped, not queued.
    pub queue_capacity: usize,
}

impl Default for ShadowSettings {
    /// Every request, at most 1,024 waiting.
    fn default() -> Self {
        ShadowSettings {
            fraction: 1.0,
            queue_capacity: 1024,
        }
    }
}

/// Sends without waiting; what does not fit is counted, never retried.
pub fn send(tx: &ObservationSender, observation: RolloutObservation) {
    if let Err(e) = tx.try_send(observation) {
        let reason = match e {
            TrySendError::Full(_) => "full",
            TrySendError::Closed(_) => "closed",
        };
        metrics::counter!(DROPPED_TOTAL, "reason" => reason).increment(1);
    }
}

/// The analysis stage of a route's colour: `green` is the candidate, anything else the
/// baseline.
pub fn stage_of(colour: &str) -> Stage {
    if colour == "green" {
        Stage::Candidate
    } else {
        Stage::Baseline
    }
}

fn other(stage: Stage) -> Stage {
    match stage {
        Stage::Baseline => Stage::Candidate,
        Stage::Candidate => Stage::Baseline,
    }
}

/// The model's input features by their documented names, for the drift tests.
pub fn feature_map(trade: &Trade, context: &TradeContext) -> BTreeMap<String, f64> {
    FEATURE_NAMES
        .iter()
        .zip(features(trade, context))
        .map(|(name, value)| ((*name).to_owned(), f64::from(value)))
        .collect()
}

/// Whether a request is in the shadow sample: a stable draw from its id, separate from
/// the routing bucket so that the sample does not lean towards either stage.
pub fn in_shadow_sample(request_id: &str, fraction: f64) -> bool {
    if fraction >= 1.0 {
        return true;
    }
    if fraction.is_nan() || fraction <= 0.0 {
        return false;
    }
    let h = sm3(format!("shadow/{request_id}").as_bytes());
    let draw = f64::from(u32::from_be_bytes([h[0], h[1], h[2], h[3]])) / 4_294_967_296.0;
    draw < fraction
}

/// Where one request's or batch's observations go: the rollout and the stage that served.
#[derive(Clone, Debug)]
pub struct Observed {
    pub rollout_id: String,
    pub stage: Stage,
    /// A shadow score (not the decision): counts for agreement and drift, not latency.
    pub shadow: bool,
    pub tx: ObservationSender,
}

/// What the stage's model said about a trade, and what the rules said.
#[derive(Clone, Debug)]
pub struct Verdict {
    pub score: Score,
    /// The model would hold the trade (score ≥ the gateway's hold score).
    pub flagged: bool,
    pub rules_flagged: bool,
    pub features: BTreeMap<String, f64>,
}

impl Observed {
    /// The stage answered the request.
    pub fn answered(&self, request_id: &str, latency_us: u64, verdict: Verdict) {
        self.request(RequestObservation {
            request_id: request_id.to_owned(),
            stage: self.stage,
            latency_us,
            error: false,
            score: f64::from(verdict.score.score),
            confidence: f64::from(verdict.score.confidence),
            flagged: verdict.flagged,
            rules_flagged: verdict.rules_flagged,
            features: verdict.features,
            shadow: self.shadow,
            at: Utc::now(),
        });
    }

    /// The stage failed to answer (its model could not be loaded, the worker failed):
    /// counted for latency and error rate only, so the score is neutral.
    pub fn failed(&self, request_id: &str, latency_us: u64) {
        self.request(RequestObservation {
            request_id: request_id.to_owned(),
            stage: self.stage,
            latency_us,
            error: true,
            score: 0.0,
            confidence: 0.5,
            flagged: false,
            rules_flagged: false,
            features: BTreeMap::new(),
            shadow: self.shadow,
            at: Utc::now(),
        });
    }

    fn request(&self, observation: RequestObservation) {
        send(
            &self.tx,
            RolloutObservation::Request {
                rollout_id: self.rollout_id.clone(),
                observation,
            },
        );
    }

    /// One batch this stage's model ran.
    pub fn batch(&self, batch_size: usize, max_batch: usize, queue_depth: usize, elapsed_us: u64) {
        let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        send(
            &self.tx,
            RolloutObservation::Batch {
                rollout_id: self.rollout_id.clone(),
                report: BatchReport {
                    stage: self.stage,
                    batch_size: clamp(batch_size),
                    max_batch: clamp(max_batch.max(1)),
                    queue_depth: clamp(queue_depth),
                    elapsed_us,
                    at: Utc::now(),
                },
            },
        );
    }
}

/// A decided request to be scored again by the other stage's model.
pub struct ShadowJob {
    /// The stage that decided; the shadow is reported for the other one.
    pub live: Observed,
    /// The other stage's registered model.
    pub model_ref: String,
    pub request_id: String,
    pub trade: Trade,
    pub context: TradeContext,
    pub rules_flagged: bool,
    pub features: BTreeMap<String, f64>,
}

struct Queued {
    job: ShadowJob,
    since: Instant,
}

/// The bounded queue in front of the shadow scorer: offering never waits.
#[derive(Clone)]
pub struct ShadowQueue {
    tx: mpsc::Sender<Queued>,
}

impl ShadowQueue {
    /// Starts the scorer task; it ends when every queue handle is dropped. `load` gives the
    /// in-process model of a ref (its digest checked), or `None` when there is none here.
    pub fn start<L, F>(settings: &ShadowSettings, hold_score: f64, load: L) -> ShadowQueue
    where
        L: Fn(String) -> F + Send + 'static,
        F: Future<Output = Option<Arc<ClearingModel>>> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(settings.queue_capacity.max(1));
        tokio::spawn(score_shadows(rx, hold_score, load));
        ShadowQueue { tx }
    }

    /// Queues a shadow score, or skips it (counted) when the scorer is behind.
    pub fn offer(&self, job: ShadowJob) {
        let queued = Queued {
            job,
            since: Instant::now(),
        };
        if self.tx.try_send(queued).is_err() {
            metrics::counter!(SHADOW_SKIPPED_TOTAL, "reason" => "saturated").increment(1);
        }
    }
}

/// Scores queued shadows a batch per model at a time. Latency is from queueing to score:
/// the in-process model's time, not a decision's.
async fn score_shadows<L, F>(mut rx: mpsc::Receiver<Queued>, hold_score: f64, load: L)
where
    L: Fn(String) -> F,
    F: Future<Output = Option<Arc<ClearingModel>>>,
{
    while let Some(first) = rx.recv().await {
        let mut by_model: HashMap<String, Vec<Queued>> = HashMap::new();
        by_model
            .entry(first.job.model_ref.clone())
            .or_default()
            .push(first);
        for _ in 1..SHADOW_BATCH {
            let Ok(next) = rx.try_recv() else { break };
            by_model
                .entry(next.job.model_ref.clone())
                .or_default()
                .push(next);
        }
        for (model_ref, queued) in by_model {
            let skip = |reason: &'static str, n: usize| {
                metrics::counter!(SHADOW_SKIPPED_TOTAL, "reason" => reason).increment(n as u64);
            };
            let Some(model) = load(model_ref.clone()).await else {
                skip("no_local_model", queued.len());
                continue;
            };
            let inputs: Vec<(Trade, TradeContext)> = queued
                .iter()
                .map(|q| (q.job.trade.clone(), q.job.context))
                .collect();
            let scores = match tokio::task::spawn_blocking(move || {
                model.model().score_batch(&inputs)
            })
            .await
            {
                Ok(Ok(scores)) if scores.len() == queued.len() => scores,
                other => {
                    tracing::warn!(%model_ref, ok = matches!(other, Ok(Ok(_))), "shadow scoring failed");
                    skip("failed", queued.len());
                    continue;
                }
            };
            for (q, score) in queued.into_iter().zip(scores) {
                let latency_us = u64::try_from(q.since.elapsed().as_micros()).unwrap_or(u64::MAX);
                let shadow = Observed {
                    stage: other(q.job.live.stage),
                    shadow: true,
                    ..q.job.live
                };
                shadow.answered(
                    &q.job.request_id,
                    latency_us,
                    Verdict {
                        flagged: f64::from(score.score) >= hold_score,
                        score,
                        rules_flagged: q.job.rules_flagged,
                        features: q.job.features,
                    },
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shadow_sample_is_stable_and_near_its_fraction() {
        let ids: Vec<String> = (0..10_000).map(|i| format!("req-{i}")).collect();
        let taken = ids.iter().filter(|id| in_shadow_sample(id, 0.25)).count();
        assert!((2_250..2_750).contains(&taken), "{taken}");
        assert!(ids.iter().all(|id| in_shadow_sample(id, 1.0)));
        assert!(!ids.iter().any(|id| in_shadow_sample(id, 0.0)));
        assert!(!in_shadow_sample("x", f64::NAN));
        let again = ids.iter().filter(|id| in_shadow_sample(id, 0.25)).count();
        assert_eq!(taken, again);
    }

    #[test]
    fn features_carry_their_documented_names() {
        let trade = Trade {
            request_id: "r".into(),
            member_id: "m".into(),
            buyer: "a".into(),
            seller: "b".into(),
            instrument: "SG0000000001".into(),
            currency: "SGD".into(),
            amount_minor: 1_000,
            value_date: chrono::NaiveDate::from_ymd_opt(2026, 12, 2).unwrap_or_default(),
            jurisdiction: "SG".into(),
            counterparty_tier: 2,
        };
        let map = feature_map(
            &trade,
            &TradeContext {
                hour_utc: 3,
                velocity: 1,
            },
        );
        assert_eq!(map.len(), FEATURE_NAMES.len());
        assert!(map.values().all(|v| v.is_finite()));
    }

    #[tokio::test]
    async fn a_full_or_closed_channel_drops_without_waiting() {
        let (tx, rx) = mpsc::channel(1);
        let observed = Observed {
            rollout_id: "r1".into(),
            shadow: false,
            stage: Stage::Candidate,
            tx,
        };
        observed.failed("a", 1);
        observed.failed("b", 1);
        drop(rx);
        observed.batch(1, 1, 0, 1);
    }
}

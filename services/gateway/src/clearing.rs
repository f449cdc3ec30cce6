//! The clearing pipeline, independent of the transport: validate → colour → rules →
//! cited clauses → route by the active rollout → batch → worker → decision →
//! `ClearingDecided` committed → answer with a receipt.
//!
//! Invariant: a member is answered only after the decision's event has committed. A
//! repeated `(member, request_id)` gets the original decision back and writes nothing,
//! whether the first is still in flight, recent, or only on the ledger.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;
use tracing::Instrument as _;

use aether_control::rollout_controller::ObservationSender;
use aether_control::{ControlState, EngineStatus, Origin, RolloutPhase};
use aether_gpu_worker::{ClearingModel, DeviceChoice, Trade, TradeContext};
use aether_ledger::hashing::{canonical_json, push_json_string, sm3, to_hex};
use aether_ledger::{EventStore, NewEvent};
use aether_rules::Action;
use chrono::{NaiveDate, Timelike, Utc};
use serde_json::{Value, json};
use tokio::sync::{OnceCell, oneshot};

use crate::batcher::{Batcher, BatcherConfig, Job, ModelHandle, RecordError};
use crate::budgets::Stage;
pub use crate::decision::{
    Answer, CLEARING_DECIDED, ClearError, Decision, Receipt, answer_of, clearing_stream,
};
use crate::lookups::RecordedLookups;
use crate::observations::{
    Observed, ShadowJob, ShadowQueue, ShadowSettings, Verdict, feature_map, in_shadow_sample,
    stage_of,
};
use crate::risk_book::{RiskBook, RiskSettings};
use crate::workers::WorkerPool;

/// Request fields that are personal data: the parties' identifiers (a member's client
/// account ids). They are recorded as erasable salted commitments in place (see
/// `aether_ledger::personal`); everything else in the trade is public.
pub const PERSONAL_FIELDS: [&str; 2] = ["trade.buyer", "trade.seller"];
/// Answers remembered in memory for fast repeats (older ones come from the ledger).
const RECENT_ANSWERS: usize = 100_000;

/// The trade as the member sent it (proto fields, before validation).
#[derive(Clone, Debug, Default)]
pub struct TradeInput {
    pub buyer: String,
    pub seller: String,
    pub instrument: String,
    pub currency: String,
    pub amount_minor: i64,
    pub value_date: String,
    pub jurisdiction: String,
    pub counterparty_tier: u32,
}

/// Traffic colouring from the request (all optional).
#[derive(Clone, Debug, Default)]
pub struct Colouring {
    pub trace_id: String,
    pub model_stage: String,
    pub semantic_tag: String,
    pub traceparent: String,
}

/// One submission, its member taken from the client certificate.
#[derive(Clone, Debug)]
pub struct Submission {
    pub member_id: String,
    pub request_id: String,
    pub trade: TradeInput,
    pub colouring: Colouring,
}

/// Gateway settings.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The engine region this gateway clears for; `None`: the only active engine.
    pub region: Option<String>,
    /// Anomaly score at or above which a trade is held for review.
    pub hold_score: f64,
    pub batcher: BatcherConfig,
    pub risk: RiskSettings,
    pub device: DeviceChoice,
    /// Where the rollout supervisor listens; `None`: nothing is observed or computed for it.
    pub observations: Option<ObservationSender>,
    /// Shadow scoring by the other stage while a rollout is observed.
    pub shadow: ShadowSettings,
    /// Percent (0–100) of the trades neither rules nor score hold that are explained
    /// too (a stable sample by request id); held and rejected ones always are.
    pub explain_cleared_percent: u32,
    /// Off: no decision is explained; a held or rejected one says so (for measuring what
    /// explanations cost, and for models without a training book).
    pub explanations: bool,
    /// Each stage's share of the request's latency budget (`crate::budgets`).
    pub budgets: crate::budgets::StageBudgets,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            region: None,
            hold_score: 0.8,
            batcher: BatcherConfig::default(),
            risk: RiskSettings::default(),
            device: DeviceChoice::Cpu,
            observations: None,
            shadow: ShadowSettings::default(),
            explain_cleared_percent: 0,
            explanations: true,
            budgets: crate::budgets::StageBudgets::default(),
        }
    }
}

impl GatewayConfig {
    /// Reports rollout traffic to `tx` (see [`crate::observations`]).
    pub fn with_observations(mut self, tx: ObservationSender) -> Self {
        self.observations = Some(tx);
        self
    }
}

/// A request's `(member, request_id)`, shared by the in-flight and recent maps.
type RequestKey = Arc<(String, String)>;
type InFlight = Arc<OnceCell<Result<Arc<Answer>, ClearError>>>;

struct Inner {
    control: ControlState,
    config: GatewayConfig,
    batcher: Batcher,
    /// Present only when observations are sent.
    shadow: Option<ShadowQueue>,
    risk: RiskBook,
    models: Mutex<HashMap<String, Arc<ClearingModel>>>,
    in_flight: Mutex<HashMap<RequestKey, InFlight>>,
    recent: Mutex<RecentAnswers>,
    lookups: RecordedLookups,
    snapshot_ids: SnapshotIds,
}

/// Snapshot ids remembered: they change only with the control plane, and a rollout uses
/// two at a time (baseline and candidate).
const SNAPSHOT_IDS_KEPT: usize = 4;

/// [`snapshot_id`], remembered for the last few inputs: its canonical JSON and SM3 were
/// ~1.5 % of the gateway's CPU when computed per request.
#[derive(Default)]
struct SnapshotIds {
    kept: Mutex<Vec<(SnapshotInputs, String)>>,
}

impl SnapshotIds {
    fn id(
        &self,
        route: &Route,
        rules_digest: &str,
        corpora: &std::collections::BTreeMap<String, String>,
    ) -> String {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, id)) = kept
            .iter()
            .find(|(inputs, _)| inputs.same(route, rules_digest, corpora))
        {
            return id.clone();
        }
        let id = snapshot_id(route, rules_digest, corpora);
        if kept.len() >= SNAPSHOT_IDS_KEPT {
            kept.remove(0);
        }
        kept.push((
            SnapshotInputs {
                region: route.region.clone(),
                model_ref: route.model_ref.clone(),
                stage: route.stage,
                rollout: route.rollout.clone(),
                rules_digest: rules_digest.to_owned(),
                corpora: corpora.clone(),
            },
            id.clone(),
        ));
        id
    }
}

/// What a snapshot id is computed from (see [`snapshot_id`]).
#[derive(Debug)]
struct SnapshotInputs {
    region: String,
    model_ref: String,
    stage: &'static str,
    rollout: Option<(String, u32)>,
    rules_digest: String,
    corpora: std::collections::BTreeMap<String, String>,
}

impl SnapshotInputs {
    fn same(
        &self,
        route: &Route,
        rules_digest: &str,
        corpora: &std::collections::BTreeMap<String, String>,
    ) -> bool {
        self.region == route.region
            && self.model_ref == route.model_ref
            && self.stage == route.stage
            && self.rollout == route.rollout
            && self.rules_digest == rules_digest
            && &self.corpora == corpora
    }
}

/// The clearing gateway's core; cheap to clone.
#[derive(Clone)]
pub struct ClearingGateway {
    inner: Arc<Inner>,
}

/// A bounded map of recent answers, oldest evicted first. Keys and answers are shared, not
/// copied: a copy of each per request was a dozen allocations on the clearing path.
#[derive(Default)]
struct RecentAnswers {
    map: HashMap<RequestKey, Arc<Answer>>,
    order: std::collections::VecDeque<RequestKey>,
}

impl RecentAnswers {
    fn insert(&mut self, key: RequestKey, answer: Arc<Answer>) {
        if self.map.insert(Arc::clone(&key), answer).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > RECENT_ANSWERS {
            if let Some(old) = self.order.pop_front() {
                self.map.remove(&old);
            }
        }
    }
}

/// Which model a trade goes to.
struct Route {
    region: String,
    model_ref: String,
    /// `blue` (baseline) or `green` (candidate).
    stage: &'static str,
    hooks: Vec<String>,
    rollout: Option<(String, u32)>,
    /// During a rollout, the other stage's model (the one that shadow-scores).
    shadow_ref: Option<String>,
    /// For a candidate request while the candidate's fallback path is on: the baseline,
    /// which decides if the candidate fails.
    fallback_ref: Option<String>,
}

impl ClearingGateway {
    /// Each stage's latency budget, for the stages timed outside the gateway (the gRPC
    /// service's envelope work).
    pub fn budgets(&self) -> crate::budgets::StageBudgets {
        self.inner.config.budgets
    }

    pub fn new(
        store: EventStore,
        control: ControlState,
        config: GatewayConfig,
        workers: WorkerPool,
    ) -> Self {
        config.budgets.publish();
        let batcher = Batcher::start(config.batcher.clone(), store.clone(), workers);
        // The shadow scorer loads models through the gateway but must not keep it alive.
        let inner = Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| {
            let shadow = config.observations.as_ref().map(|_| {
                let weak = weak.clone();
                ShadowQueue::start(&config.shadow, config.hold_score, move |model_ref| {
                    let weak = weak.clone();
                    async move {
                        let gateway = ClearingGateway {
                            inner: weak.upgrade()?,
                        };
                        gateway.model(&model_ref).await.ok()?.local
                    }
                })
            });
            Inner {
                risk: RiskBook::new(config.risk.clone()),
                lookups: RecordedLookups::start(store),
                control,
                config,
                batcher,
                shadow,
                models: Mutex::default(),
                in_flight: Mutex::default(),
                recent: Mutex::default(),
                snapshot_ids: SnapshotIds::default(),
            }
        });
        ClearingGateway { inner }
    }

    /// Clears one submission; see the module docs for the guarantees. The submission is
    /// checked whole before anything is looked up or batched: a malformed one (a NUL in
    /// its request id, say) never reaches a query or a batch that other members share.
    pub async fn clear(&self, submission: Submission) -> Result<Answer, ClearError> {
        let (trade, digest) =
            crate::stage_span!("clearing.validate").in_scope(|| check(&submission))?;
        let key: RequestKey =
            Arc::new((submission.member_id.clone(), submission.request_id.clone()));
        let recent = self.lock_recent().map.get(&key).cloned();
        if let Some(answer) = recent {
            return same_trade(Answer::clone(&answer), &digest).map(replayed);
        }
        let cell = {
            let mut in_flight = self
                .inner
                .in_flight
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            Arc::clone(in_flight.entry(Arc::clone(&key)).or_default())
        };
        let mut ran = false;
        let result = cell
            .get_or_init(|| {
                ran = true;
                async {
                    self.decide_once(submission, trade, &digest)
                        .await
                        .map(Arc::new)
                }
            })
            .await;
        if ran {
            if let Ok(answer) = result {
                self.lock_recent()
                    .insert(Arc::clone(&key), Arc::clone(answer));
            }
            self.inner
                .in_flight
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&key);
            result.as_deref().cloned().map_err(Clone::clone)
        } else {
            // The same request id in flight: this caller's trade must be that one's.
            let answer = result.as_deref().cloned().map_err(Clone::clone)?;
            same_trade(answer, &digest).map(replayed)
        }
    }

    fn lock_recent(&self) -> std::sync::MutexGuard<'_, RecentAnswers> {
        self.inner
            .recent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The first submission of a request id: the ledger may still know it from before a
    /// restart; otherwise decide.
    async fn decide_once(
        &self,
        submission: Submission,
        trade: Trade,
        digest: &str,
    ) -> Result<Answer, ClearError> {
        if let Some(answer) = self
            .inner
            .lookups
            .recorded(&submission.member_id, &submission.request_id)
            .await?
        {
            return same_trade(answer, digest).map(replayed);
        }
        self.decide(submission, trade, digest).await
    }

    async fn decide(
        &self,
        s: Submission,
        trade: Trade,
        digest: &str,
    ) -> Result<Answer, ClearError> {
        let started = Instant::now();
        let now = Utc::now();
        let (route, origin) = crate::stage_span!("clearing.route").in_scope(|| {
            let route = self.route(&s.request_id, &s.colouring.model_stage)?;
            let origin = origin_of(&s, &route)?;
            Ok::<_, ClearError>((route, origin))
        })?;
        let observed = self.observed(&route);
        let stage_failed = |e: ClearError| {
            if let Some(o) = &observed {
                o.failed(&s.request_id, micros_since(started));
            }
            e
        };

        // Rules against the live context, then the clauses the fired rules cite.
        let rules_span =
            crate::stage_span!("clearing.rules", aether.rules_fired = tracing::field::Empty);
        let (velocity, evaluation, corpora, cited, rules_digest, snapshot_id) = rules_span
            .in_scope(|| {
                let (context, velocity) = self.inner.risk.context(&s.member_id, &trade.seller, now);
                let rules = self.inner.control.policies.engine();
                let rule_set = rules.snapshot();
                let hooks: Vec<&str> = route.hooks.iter().map(String::as_str).collect();
                let evaluation = rule_set
                    .evaluate_members(&rules_request(&s, &trade), &context, &hooks)
                    .map_err(|e| {
                        ClearError::NoEngine(format!("the engine's policies cannot run: {e}"))
                    })?;
                let corpora = self.inner.control.corpora.current_versions();
                let cited = crate::stage_span!("clearing.citations")
                    .in_scope(|| self.cited(&evaluation.cited_clauses()));
                let rules_digest = to_hex(&evaluation.rules_digest);
                let snapshot_id = self.inner.snapshot_ids.id(&route, &rules_digest, &corpora);
                Ok::<_, ClearError>((
                    velocity,
                    evaluation,
                    corpora,
                    cited,
                    rules_digest,
                    snapshot_id,
                ))
            })?;
        rules_span.record("aether.rules_fired", evaluation.fired.len());

        // Score in a batch; while the candidate's fallback path is on, the baseline
        // decides a request the candidate fails.
        let budgets = self.inner.config.budgets;
        budgets.record(Stage::Orchestration, started.elapsed());
        let context_for_model = TradeContext {
            hour_utc: u8::try_from(now.hour()).unwrap_or(0),
            velocity,
        };
        let explain = self.inner.config.explanations
            && (matches!(evaluation.decision, Action::Hold | Action::Deny)
                || explain_sampled(&s.request_id, self.inner.config.explain_cleared_percent));
        let score_span = crate::stage_span!(
            "clearing.score",
            aether.model_ref = %route.model_ref,
            aether.worker = tracing::field::Empty,
            aether.device = tracing::field::Empty,
            aether.batch_size = tracing::field::Empty,
            aether.explained = explain,
        );
        let scoring = Instant::now();
        let (model, scored, fallback) = match self
            .score(
                &route.model_ref,
                &trade,
                context_for_model,
                observed.clone(),
                explain,
            )
            .instrument(score_span.clone())
            .await
        {
            Ok((model, scored)) => (model, scored, None::<(String, Value)>),
            Err(e) => {
                let e = stage_failed(e);
                let Some(baseline) = &route.fallback_ref else {
                    return Err(e);
                };
                let (model, scored) = self
                    .score(baseline, &trade, context_for_model, None, explain)
                    .await?;
                let taken =
                    json!({"from": route.model_ref, "to": baseline, "reason": e.to_string()});
                (model, scored, Some((baseline.clone(), taken)))
            }
        };
        budgets.record(Stage::Batch, scoring.elapsed());

        score_span.record("aether.worker", scored.worker.as_str());
        score_span.record("aether.device", scored.device.as_str());
        score_span.record("aether.batch_size", scored.batch_size);
        drop(score_span);
        let score = f64::from(scored.score.score);
        let decision = match evaluation.decision {
            Action::Deny => Decision::Rejected,
            Action::Hold => Decision::HeldForReview,
            _ if score >= self.inner.config.hold_score => Decision::HeldForReview,
            _ => Decision::Cleared,
        };
        let rules_fired: Vec<String> = evaluation
            .fired
            .iter()
            .map(|f| format!("{}/{}", f.policy, f.rule_id))
            .collect();
        let model_stage = origin.model_stage.clone().unwrap_or_default();
        let latency_us = micros_since(started);
        // A held or rejected decision is never silently unexplained: without an
        // explanation it says why there is none.
        let explanation = match (&scored.explanation, decision) {
            (Some(Ok(e)), _) => Some(json!(e)),
            (Some(Err(reason)), _) => Some(json!({"status": "unavailable", "reason": reason})),
            (None, Decision::Cleared) => None,
            (None, _) if !self.inner.config.explanations => Some(json!({
                "status": "unavailable",
                "reason": "explanations are off on this node (--no-explanations)",
            })),
            (None, _) => Some(json!({
                "status": "unavailable",
                "reason": "the worker returned no explanation",
            })),
        };
        let event = NewEvent::new(
            CLEARING_DECIDED,
            json!({
                "request_id": s.request_id,
                "member": s.member_id,
                "trade_digest": digest,
                // buyer and seller: personal, sealed in place below.
                "trade": {
                    "instrument": trade.instrument,
                    "currency": trade.currency,
                    // A string: amounts may exceed the ledger's exact JSON integers.
                    "amount_minor": trade.amount_minor.to_string(),
                    "value_date": trade.value_date.to_string(),
                    "jurisdiction": trade.jurisdiction,
                    "counterparty_tier": trade.counterparty_tier,
                },
                "decision": decision,
                "score": round6(score),
                "confidence": round6(f64::from(scored.score.confidence)),
                "rules": evaluation.fired,
                "rule_errors": evaluation.errors,
                "rules_fired": rules_fired,
                "cited_clauses": cited,
                "model_ref": fallback.as_ref().map_or(&route.model_ref, |(to, _)| to),
                "model_digest": model.digest,
                "fallback": fallback.as_ref().map(|(_, taken)| taken),
                "model_stage": model_stage,
                "rollout": route.rollout.as_ref().map(|(id, w)| json!({"id": id, "candidate_weight": w})),
                "region": route.region,
                "worker": scored.worker,
                "device": scored.device,
                "batch_id": scored.batch_id.to_string(),
                "batch_size": scored.batch_size,
                "latency_us": latency_us,
                "snapshot_id": snapshot_id,
                "snapshot": {
                    "rules_digest": rules_digest,
                    "corpora": corpora,
                },
                "explanation": explanation,
            }),
        )
        .with_personal(personal_members(&trade))
        .with_metadata(origin.metadata(json!({
            "request_id": s.request_id,
            "member": s.member_id,
            "snapshot_id": snapshot_id,
        })));
        // Committed with the batch's netting, in one append.
        let committing = Instant::now();
        let committed = match scored
            .recorder
            .record(clearing_stream(&s.member_id), event)
            .instrument(crate::stage_span!(
                "ledger.commit",
                otel.kind = "client",
                db.operation.name = "append",
                db.collection.name = %clearing_stream(&s.member_id),
            ))
            .await
        {
            Ok(committed) => committed,
            // Another node or process decided this request id at the same moment: the
            // database kept that decision, and this caller gets it (or the refusal if it
            // was for another trade).
            Err(RecordError::AlreadyDecided) => {
                let recorded = self
                    .inner
                    .lookups
                    .recorded(&s.member_id, &s.request_id)
                    .await?
                    .ok_or_else(|| {
                        ClearError::Ledger(
                            "the decision that took this request id cannot be read".into(),
                        )
                    })?;
                return same_trade(recorded, digest).map(replayed);
            }
            Err(RecordError::Failed(e)) => return Err(ClearError::Ledger(e)),
        };
        budgets.record(Stage::Commit, committing.elapsed());
        self.inner
            .risk
            .record(&trade, decision == Decision::Cleared, now);
        // A request the fallback decided was reported as the candidate's failure.
        if let Some(o) = observed.filter(|_| fallback.is_none()) {
            let rules_flagged = matches!(evaluation.decision, Action::Hold | Action::Deny);
            self.report_decided(
                o,
                &route,
                &trade,
                context_for_model,
                latency_us,
                scored.score,
                rules_flagged,
            );
        }
        metrics::counter!("aether_clearing_decisions_total", "decision" => decision_label(decision), "stage" => route.stage).increment(1);
        metrics::histogram!("aether_clearing_latency_seconds", "stage" => route.stage)
            .record(started.elapsed().as_secs_f64());
        Ok(Answer {
            request_id: s.request_id,
            decision,
            score: round6(score),
            confidence: round6(f64::from(scored.score.confidence)),
            rules_fired,
            cited_clauses: cited,
            model_ref: fallback.map_or(route.model_ref, |(to, _)| to),
            model_stage,
            receipt: Receipt {
                seq: committed.seq,
                event_hash: to_hex(&committed.hash),
                snapshot_id,
                trace_id: origin.trace_id,
            },
            replayed: false,
            trade_digest: digest.to_owned(),
        })
    }

    /// Where this request's observations go: only with a channel and during a rollout.
    fn observed(&self, route: &Route) -> Option<Observed> {
        let tx = self.inner.config.observations.as_ref()?;
        let (rollout_id, _) = route.rollout.as_ref()?;
        Some(Observed {
            rollout_id: rollout_id.clone(),
            stage: stage_of(route.stage),
            shadow: false,
            tx: tx.clone(),
        })
    }

    /// Reports a decided request for its stage and, on the sample, queues the other
    /// stage's shadow score (off the request's path).
    #[allow(clippy::too_many_arguments)]
    fn report_decided(
        &self,
        observed: Observed,
        route: &Route,
        trade: &Trade,
        context: TradeContext,
        latency_us: u64,
        score: aether_gpu_worker::Score,
        rules_flagged: bool,
    ) {
        let features = feature_map(trade, &context);
        let shadow = self.inner.shadow.as_ref().zip(route.shadow_ref.as_ref());
        if let Some((queue, model_ref)) = shadow
            && in_shadow_sample(&trade.request_id, self.inner.config.shadow.fraction)
        {
            queue.offer(ShadowJob {
                live: observed.clone(),
                model_ref: model_ref.clone(),
                request_id: trade.request_id.clone(),
                trade: trade.clone(),
                context,
                rules_flagged,
                features: features.clone(),
            });
        }
        observed.answered(
            &trade.request_id,
            latency_us,
            Verdict {
                score,
                flagged: f64::from(score.score) >= self.inner.config.hold_score,
                rules_flagged,
                features,
            },
        );
    }

    /// Scores `trade` with `model_ref` in a batch.
    async fn score(
        &self,
        model_ref: &str,
        trade: &Trade,
        context: TradeContext,
        observed: Option<Observed>,
        explain: bool,
    ) -> Result<(ModelHandle, crate::batcher::Scored), ClearError> {
        let model = self.model(model_ref).await?;
        let (reply, scored) = oneshot::channel();
        self.inner
            .batcher
            .submit(Job {
                model: model.clone(),
                trade: trade.clone(),
                context,
                reply,
                observed,
                explain,
                explain_at_or_above: self
                    .inner
                    .config
                    .explanations
                    .then_some(self.inner.config.hold_score as f32),
                traceparent: crate::telemetry::current_traceparent(),
                baggage: crate::telemetry::current_baggage(),
                queued_at: None,
            })
            .map_err(|e| ClearError::Overloaded(e.to_string()))?;
        let scored = scored
            .await
            .map_err(|_| ClearError::Worker("the batch was dropped".into()))
            .and_then(|r| r.map_err(ClearError::Worker))?;
        Ok((model, scored))
    }

    /// The active engine and, during a rollout, baseline or candidate for this request.
    fn route(&self, request_id: &str, requested_stage: &str) -> Result<Route, ClearError> {
        let active: Vec<_> = self
            .inner
            .control
            .engines
            .engines()
            .into_iter()
            .filter(|e| e.status == EngineStatus::Active)
            .collect();
        let engine = match &self.inner.config.region {
            Some(region) => active.iter().find(|e| &e.region == region).ok_or_else(|| {
                ClearError::NoEngine(format!("no active engine in region {region}"))
            })?,
            None => match active.as_slice() {
                [one] => one,
                [] => return Err(ClearError::NoEngine("no engine has been activated".into())),
                many => {
                    return Err(ClearError::NoEngine(format!(
                        "several regions are active ({}); start the gateway with a region",
                        many.iter()
                            .map(|e| e.region.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
            },
        };
        let rollout = self.inner.control.rollouts.all().into_iter().find(|r| {
            r.region == engine.region
                && matches!(r.phase, RolloutPhase::Progressing | RolloutPhase::Paused)
        });
        let (model_ref, stage, shadow_ref) = match &rollout {
            Some(r) => {
                let candidate = if requested_stage.starts_with("green-") {
                    true
                } else if requested_stage.starts_with("blue-") {
                    false
                } else {
                    bucket(request_id) < r.candidate_weight
                };
                if candidate {
                    (r.candidate.clone(), "green", Some(r.baseline.clone()))
                } else {
                    (r.baseline.clone(), "blue", Some(r.candidate.clone()))
                }
            }
            None => (engine.model_ref.clone(), "blue", None),
        };
        let fallback_ref = rollout
            .as_ref()
            .filter(|r| r.fallback && stage == "green")
            .map(|r| r.baseline.clone());
        Ok(Route {
            region: engine.region.clone(),
            model_ref,
            stage,
            hooks: engine.policy_hooks.clone(),
            rollout: rollout.map(|r| (r.id, r.candidate_weight)),
            shadow_ref,
            fallback_ref,
        })
    }

    /// The registered model for `model_ref`, loaded (its digest checked) only when this
    /// process may score in process.
    async fn model(&self, model_ref: &str) -> Result<ModelHandle, ClearError> {
        let spec =
            self.inner.control.models.get(model_ref).ok_or_else(|| {
                ClearError::NoEngine(format!("model {model_ref} is not registered"))
            })?;
        if !self.inner.config.batcher.local_workers {
            return Ok(ModelHandle {
                model_ref: model_ref.to_owned(),
                digest: spec.digest,
                local: None,
            });
        }
        if let Some(m) = self
            .inner
            .models
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&spec.digest)
        {
            return Ok(ModelHandle::loaded(m.clone()));
        }
        let path = aether_control::models::local_path(&spec.uri).ok_or_else(|| {
            ClearError::NoEngine(format!(
                "model {model_ref} is at {}, which in-process workers cannot read",
                spec.uri
            ))
        })?;
        let device = self.inner.config.device;
        let digest = spec.digest.clone();
        let loaded =
            tokio::task::spawn_blocking(move || ClearingModel::load(&path, &digest, device))
                .await
                .map_err(|e| ClearError::Worker(e.to_string()))?
                .map_err(|e| ClearError::NoEngine(format!("model {model_ref}: {e}")))?;
        let loaded = Arc::new(loaded);
        self.inner
            .models
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(spec.digest, loaded.clone());
        Ok(ModelHandle::loaded(loaded))
    }

    /// The cited clause ids that exist in a current corpus version, as `corpus:clause`.
    fn cited(&self, ids: &[&str]) -> Vec<String> {
        let corpora = self.inner.control.corpora.corpora();
        let mut out = Vec::new();
        for id in ids {
            let found = corpora.keys().find(|name| {
                self.inner
                    .control
                    .corpora
                    .corpus(name)
                    .is_some_and(|c| c.current().clause(id).is_some())
            });
            match found {
                Some(name) => out.push(format!("{name}:{id}")),
                None => out.push((*id).to_owned()),
            }
        }
        out
    }
}

fn replayed(mut answer: Answer) -> Answer {
    answer.replayed = true;
    answer
}

/// The earlier answer to a request id, if it decided the same trade; a different trade
/// under a used request id is refused, never answered with the other trade's decision.
fn same_trade(answer: Answer, digest: &str) -> Result<Answer, ClearError> {
    if answer.trade_digest.is_empty() || answer.trade_digest == digest {
        return Ok(answer);
    }
    Err(ClearError::RequestIdReused {
        request_id: answer.request_id,
        seq: answer.receipt.seq,
        original: answer.trade_digest,
        submitted: digest.to_owned(),
    })
}

/// SM3 over `aether.trade.v1` and the RFC 8785 text of the trade as submitted (parties,
/// instrument, currency, amount as a decimal string, value date, jurisdiction, tier), in
/// lowercase hex: what tells a repeat of a request from a different trade under its id.
///
/// The RFC 8785 text is written member by member in its order (sorted names, strings
/// escaped as JCS escapes them), not through a JSON tree and its canonical form: every
/// request computes it (a test checks the two agree on arbitrary trades).
pub fn trade_digest(t: &Trade) -> String {
    let mut bytes = Vec::with_capacity(160 + t.buyer.len() + t.seller.len());
    let mut out = |b: &[u8]| bytes.extend_from_slice(b);
    out(b"aether.trade.v1{\"amount_minor\":");
    push_json_string(&mut out, &t.amount_minor.to_string());
    out(b",\"buyer\":");
    push_json_string(&mut out, &t.buyer);
    out(b",\"counterparty_tier\":");
    out(t.counterparty_tier.to_string().as_bytes());
    out(b",\"currency\":");
    push_json_string(&mut out, &t.currency);
    out(b",\"instrument\":");
    push_json_string(&mut out, &t.instrument);
    out(b",\"jurisdiction\":");
    push_json_string(&mut out, &t.jurisdiction);
    out(b",\"seller\":");
    push_json_string(&mut out, &t.seller);
    out(b",\"value_date\":");
    push_json_string(&mut out, &t.value_date.to_string());
    out(b"}");
    to_hex(&sm3(&bytes))
}

/// A gRPC caller's trace id is a W3C trace-id, as `clearing.proto` defines it: 32
/// lowercase hex digits, not all zero (empty: the gateway makes one). It is echoed in the
/// receipt, so anything else would be a receipt that breaks the documented shape.
fn check_trace_id(trace_id: &str) -> Result<(), ClearError> {
    let ok = trace_id.is_empty()
        || (trace_id.len() == 32
            && trace_id
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            && trace_id.bytes().any(|b| b != b'0'));
    if ok {
        Ok(())
    } else {
        let shown: String = trace_id
            .chars()
            .take(64)
            .flat_map(char::escape_debug)
            .collect();
        Err(ClearError::InvalidColouring(format!(
            "trace_id must be 32 lowercase hex digits, not all zero (a W3C trace-id), or empty; got \"{shown}\""
        )))
    }
}

fn decision_label(d: Decision) -> &'static str {
    match d {
        Decision::Cleared => "cleared",
        Decision::HeldForReview => "held_for_review",
        Decision::Rejected => "rejected",
    }
}

fn micros_since(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Scores are recorded rounded so that the event's JSON is exact and stable.
fn round6(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}

/// Whether a request id falls in the `percent` explained although cleared: a stable
/// sample, independent of the rollout buckets (SM3 of `explain:` ‖ id).
fn explain_sampled(request_id: &str, percent: u32) -> bool {
    percent > 0 && {
        let h = sm3(format!("explain:{request_id}").as_bytes());
        u32::from(u16::from_be_bytes([h[0], h[1]])) % 100 < percent
    }
}

/// A stable bucket in 0..100 for a request id (SM3, first two bytes).
fn bucket(request_id: &str) -> u32 {
    let h = sm3(request_id.as_bytes());
    u32::from(u16::from_be_bytes([h[0], h[1]])) % 100
}

/// The content address of what a decision was made under: routing, rule set, corpora.
fn snapshot_id(
    route: &Route,
    rules_digest: &str,
    corpora: &std::collections::BTreeMap<String, String>,
) -> String {
    let doc = json!({
        "gateway": {
            "region": route.region,
            "model_ref": route.model_ref,
            "stage": route.stage,
            "rollout": route.rollout.as_ref().map(|(id, w)| json!({"id": id, "candidate_weight": w})),
        },
        "rules": rules_digest,
        "rag": corpora,
    });
    hex::encode(sm3(canonical_json(&doc).unwrap_or_default().as_bytes()))
}

/// What [`ClearingGateway::clear`] checks before anything else: every field of the trade
/// and the trace id. The trade and its digest on success.
pub fn check(submission: &Submission) -> Result<(Trade, String), ClearError> {
    let trade = validate(submission)?;
    check_trace_id(&submission.colouring.trace_id)?;
    let digest = trade_digest(&trade);
    Ok((trade, digest))
}

fn validate(s: &Submission) -> Result<Trade, ClearError> {
    let t = &s.trade;
    // Exactly YYYY-MM-DD: chrono also reads "+2026-12-02" and "2026-1-2", which would be
    // recorded as another text than the member sent.
    let value_date = NaiveDate::parse_from_str(&t.value_date, "%Y-%m-%d")
        .ok()
        .filter(|d| d.format("%Y-%m-%d").to_string() == t.value_date)
        .ok_or_else(|| {
            let shown: String = t.value_date.chars().take(64).collect();
            let more = if shown.len() < t.value_date.len() {
                "…"
            } else {
                ""
            };
            ClearError::InvalidTrade(format!(
                "value_date {shown:?}{more} is not a date in the form YYYY-MM-DD"
            ))
        })?;
    let tier = u8::try_from(t.counterparty_tier)
        .ok()
        .filter(|t| (1..=5).contains(t))
        .ok_or_else(|| {
            ClearError::InvalidTrade(format!(
                "counterparty_tier must be 1 to 5, got {}",
                t.counterparty_tier
            ))
        })?;
    let trade = Trade {
        request_id: s.request_id.clone(),
        member_id: s.member_id.clone(),
        buyer: t.buyer.clone(),
        seller: t.seller.clone(),
        instrument: t.instrument.clone(),
        currency: t.currency.clone(),
        amount_minor: t.amount_minor,
        value_date,
        jurisdiction: t.jurisdiction.clone(),
        counterparty_tier: tier,
    };
    trade
        .validate()
        .map_err(|e| ClearError::InvalidTrade(e.to_string()))?;
    if trade.buyer == trade.seller {
        return Err(ClearError::InvalidTrade(
            "buyer and seller are the same party".into(),
        ));
    }
    Ok(trade)
}

fn origin_of(s: &Submission, route: &Route) -> Result<Origin, ClearError> {
    let opt = |v: &str| (!v.is_empty()).then(|| v.to_owned());
    let model_name = route
        .model_ref
        .split('@')
        .next()
        .unwrap_or_default()
        .to_ascii_lowercase();
    let stage = format!("{}-{model_name}", route.stage);
    let c = &s.colouring;
    Origin::from_headers(
        &format!("member:{}", s.member_id),
        opt(&c.trace_id).as_deref(),
        opt(&c.traceparent).as_deref(),
        Some(&stage),
        opt(&c.semantic_tag).as_deref(),
    )
    .map_err(|e| ClearError::InvalidColouring(e.to_string()))
}

/// The personal fields of a trade, by their path in the decision's payload.
fn personal_members(t: &Trade) -> serde_json::Map<String, Value> {
    let values = [&t.buyer, &t.seller];
    PERSONAL_FIELDS
        .iter()
        .zip(values)
        .map(|(path, value)| ((*path).to_owned(), json!(value)))
        .collect()
}

/// The rules' `request`: the trade in the documented shape (see `aether_rules::sample_request`).
fn rules_request(s: &Submission, t: &Trade) -> serde_json::Map<String, Value> {
    [
        ("request_id", json!(s.request_id)),
        ("member", json!(s.member_id)),
        ("buyer", json!(t.buyer)),
        ("seller", json!(t.seller)),
        ("counterparty", json!(t.seller)),
        ("instrument", json!(t.instrument)),
        ("currency", json!(t.currency)),
        ("amount_minor", json!(t.amount_minor)),
        ("value_date", json!(t.value_date.to_string())),
        ("jurisdiction", json!(t.jurisdiction)),
        ("counterparty_tier", json!(t.counterparty_tier)),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The digest as the RFC 8785 form of the trade's JSON object (how it was computed
    /// before it was written directly, and how an outside implementer would).
    fn digest_of_json(t: &Trade) -> String {
        let doc = json!({
            "buyer": t.buyer,
            "seller": t.seller,
            "instrument": t.instrument,
            "currency": t.currency,
            "amount_minor": t.amount_minor.to_string(),
            "value_date": t.value_date.to_string(),
            "jurisdiction": t.jurisdiction,
            "counterparty_tier": t.counterparty_tier,
        });
        let mut bytes = b"aether.trade.v1".to_vec();
        bytes.extend_from_slice(canonical_json(&doc).unwrap().as_bytes());
        to_hex(&sm3(&bytes))
    }

    proptest::proptest! {
        /// Any text (control characters, quotes, backslashes, non-ASCII), any amount and
        /// tier, any date: the directly written digest is the JSON object's.
        #[test]
        fn the_trade_digest_is_that_of_the_trades_canonical_json(
            parties in proptest::collection::vec("(.|[\\x00-\\x1f\"\\\\]){0,24}", 5),
            amount in proptest::num::i64::ANY,
            tier in proptest::num::u8::ANY,
            day in 0i64..200_000,
        ) {
            let trade = Trade {
                request_id: "r".into(),
                member_id: "m".into(),
                buyer: parties[0].clone(),
                seller: parties[1].clone(),
                instrument: parties[2].clone(),
                currency: parties[3].clone(),
                amount_minor: amount,
                value_date: NaiveDate::from_num_days_from_ce_opt(day as i32).unwrap(),
                jurisdiction: parties[4].clone(),
                counterparty_tier: tier,
            };
            proptest::prop_assert_eq!(trade_digest(&trade), digest_of_json(&trade));
        }
    }

    fn route(stage: &'static str, rollout: Option<(&str, u32)>) -> Route {
        Route {
            region: "sg".into(),
            model_ref: "m@1".into(),
            stage,
            hooks: Vec::new(),
            rollout: rollout.map(|(id, w)| (id.to_owned(), w)),
            shadow_ref: None,
            fallback_ref: None,
        }
    }

    #[test]
    fn remembered_snapshot_ids_follow_every_input() {
        let ids = SnapshotIds::default();
        let corpora = BTreeMap::from([("c".to_owned(), "v1".to_owned())]);
        let newer = BTreeMap::from([("c".to_owned(), "v2".to_owned())]);
        let blue = route("blue", None);
        let cases = [
            (route("blue", None), "r1", &corpora),
            (route("blue", None), "r2", &corpora),
            (route("blue", None), "r2", &newer),
            (route("green", Some(("ro", 10))), "r2", &newer),
            (route("green", Some(("ro", 20))), "r2", &newer),
            (route("blue", Some(("ro", 20))), "r2", &newer),
        ];
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2 {
            for (r, rules, c) in &cases {
                let id = ids.id(r, rules, c);
                assert_eq!(id, snapshot_id(r, rules, c));
                seen.insert(id);
            }
        }
        assert_eq!(seen.len(), cases.len(), "every input changes the id");
        assert_eq!(
            ids.id(&blue, "r1", &corpora),
            snapshot_id(&blue, "r1", &corpora)
        );
        assert!(ids.kept.lock().unwrap().len() <= SNAPSHOT_IDS_KEPT);
    }
}

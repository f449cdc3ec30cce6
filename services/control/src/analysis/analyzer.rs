//! The `Analyzer`: one check per closed window, returning what the rollout should do as
//! values (the lead turns each into a ledger event). Its whole state is `AnalyzerState`,
//! serialisable, so a controller restarted mid-rollout resumes exactly where it was.
//!
//! Per conclusive check, in this order: evidence → drift tier action → controller
//! transition (fuse / degrade / recover) → semantic rollback → weight increase or promote.
//! Safety actions (fuse, freeze, rollback) act whatever the gate; widening needs the gate
//! open, the controller Normal and a healthy check.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::composite::{self, Escalation, RecentScores};
use super::drift::{DriftReport, DriftTier, ReferenceSample, assess_drift, drift_tier};
use super::metrics::{WindowMetrics, WindowSamples};
use super::risk::{Controller, ControllerMode, RiskAssessment, Transition, assess, next_weight};
use super::rollback::{
    CommittedSnapshot, RollbackDecision, RollbackTrigger, WindowBreach, window_breaches,
};
use super::settings::{AnalysisSettings, DriftMethod, DriftSettings, SettingsError};
use super::significance::{GoldenMetric, PairedWindow, Significance, compare};

/// Whether this check's drift outcome (the last pushed) is tier L1.
fn drift_tier_is_l1(out: &[AnalysisOutcome]) -> bool {
    out.iter()
        .rev()
        .any(|o| matches!(o, AnalysisOutcome::Drift(d) if d.tier == DriftTier::L1))
}

/// Scores kept per window for the composite's long window.
const RECENT_POINTS: usize = 100;

/// Whether the rollout may widen, as far as the analysis is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gate {
    Open,
    /// Held until `Analyzer::resume` (the operator's resume).
    Paused {
        reason: PauseReason,
    },
    /// Candidate at 0 % until `Analyzer::release_freeze` (the review ticket closed).
    Frozen,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseReason {
    /// Too little evidence: pause, never abort.
    Inconclusive,
    /// Drift tier L2; a retrain was requested.
    DriftL2,
    /// An operator paused the rollout (a manual gate); their resume opens it.
    Operator,
    /// Promotion was due but the candidate is significantly worse than the baseline on a
    /// golden metric; the operator decides (resume for more evidence, or promote).
    SignificantlyWorse,
}

/// How a rollout ended, as far as the analysis is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    Promoted,
    RolledBack,
}

/// Which piece of evidence a check lacked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Evidence {
    BaselineRequests,
    CandidateRequests,
    ShadowSample,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Shortfall {
    pub evidence: Evidence,
    pub have: u64,
    pub need: u64,
}

/// What the drift tier asks for in this check (a request already made is not repeated).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriftResponse {
    Record,
    PauseAndRequestRetrain,
    FreezeAndOpenReview,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriftAction {
    pub at: DateTime<Utc>,
    pub tier: DriftTier,
    pub response: DriftResponse,
    pub report: DriftReport,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightReason {
    Increase,
    Fuse,
    DriftFreeze,
    Rollback,
}

/// A change of the candidate's traffic share, in percent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightChange {
    pub at: DateTime<Utc>,
    pub from: u32,
    pub to: u32,
    pub reason: WeightReason,
}

/// One thing a check concluded; a check returns them in the order they happened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AnalysisOutcome {
    /// Not enough evidence; nothing else was judged in this check.
    Inconclusive {
        at: DateTime<Utc>,
        step: u64,
        missing: Vec<Shortfall>,
        metrics: WindowMetrics,
    },
    /// The gate closed (only when it changes, so no event is repeated).
    Paused {
        at: DateTime<Utc>,
        reason: PauseReason,
    },
    /// The evidence of every conclusive check.
    Assessed {
        at: DateTime<Utc>,
        step: u64,
        metrics: WindowMetrics,
        risk: RiskAssessment,
        /// The candidate against the baseline over the kept windows, this one included.
        #[serde(default)]
        significance: Significance,
    },
    /// The composite score rose above `warn_above` and then, within `within_ms`, to
    /// `escalate_at` or more (recorded whatever the method; it freezes with `composite`).
    DriftEscalated(Escalation),
    Drift(DriftAction),
    Transition(Transition),
    WeightChange(WeightChange),
    Rollback(RollbackDecision),
    /// Promotion was due but the candidate is significantly worse on these metrics
    /// (`significance.promotion_requires_not_worse`); a `Paused` follows.
    PromotionWithheld {
        at: DateTime<Utc>,
        worse: Vec<GoldenMetric>,
    },
    /// A review opened by an L3 freeze is past its deadline, unanswered (once).
    ReviewOverdue {
        at: DateTime<Utc>,
        opened_at: DateTime<Utc>,
        deadline: DateTime<Utc>,
    },
    /// The L1 archive: per-feature summary statistics of the candidate in this window.
    FeatureHealth {
        at: DateTime<Utc>,
        scores: Summary,
        features: std::collections::BTreeMap<String, Summary>,
    },
    /// Healthy at the last step: promote the candidate to 100 %.
    Promote {
        at: DateTime<Utc>,
        weight: u32,
    },
}

/// Everything the analyzer remembers between checks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AnalyzerState {
    /// The candidate's traffic share, in percent.
    pub weight: u32,
    pub controller: Controller,
    pub gate: Gate,
    pub rollback: RollbackTrigger,
    /// The reference window for drift; when none is given, the baseline's samples of the
    /// first conclusive window.
    pub reference: Option<ReferenceSample>,
    pub finished: Option<Finish>,
    /// The newest conclusive windows' golden metrics (at most
    /// `significance.max_windows`), for the paired tests.
    #[serde(default)]
    pub paired: Vec<PairedWindow>,
    /// The candidate's scores of the long window's earlier windows, thinned.
    #[serde(default)]
    pub recent_scores: Vec<RecentScores>,
    /// The last composite score above `warn_above` not yet escalated: (window end, score).
    #[serde(default)]
    pub composite_warning: Option<(DateTime<Utc>, f64)>,
    /// The review an L3 freeze opened, until an operator closes it.
    #[serde(default)]
    pub open_review: Option<OpenReview>,
    /// `ReviewTicketClosed` events applied (the rollout's count).
    #[serde(default)]
    pub reviews_closed: u64,
}

/// An open drift review and its deadline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpenReview {
    pub opened_at: DateTime<Utc>,
    pub deadline: DateTime<Utc>,
    /// `ReviewOverdue` was returned already.
    pub overdue: bool,
}

/// Summary statistics of one series (nearest-rank percentiles).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub n: u64,
    pub mean: f64,
    pub std: f64,
    pub min: f64,
    pub p05: f64,
    pub p50: f64,
    pub p95: f64,
    pub max: f64,
}

impl Summary {
    /// Of the finite values; all zero when there are none.
    pub fn of(values: &[f64]) -> Summary {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Summary {
                n: 0,
                mean: 0.0,
                std: 0.0,
                min: 0.0,
                p05: 0.0,
                p50: 0.0,
                p95: 0.0,
                max: 0.0,
            };
        }
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        let rank = |q: f64| v[((q * n).ceil() as usize).clamp(1, v.len()) - 1];
        Summary {
            n: v.len() as u64,
            mean,
            std: var.sqrt(),
            min: v[0],
            p05: rank(0.05),
            p50: rank(0.5),
            p95: rank(0.95),
            max: v[v.len() - 1],
        }
    }
}

/// One check's input: a closed window, the rollout step it was observed under and the
/// snapshots committed so far (for a rollback's target).
#[derive(Clone, Copy, Debug)]
pub struct Check<'a> {
    pub window: &'a WindowSamples,
    pub step: u64,
    pub snapshots: &'a [CommittedSnapshot],
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AnalysisError {
    #[error(transparent)]
    Settings(#[from] SettingsError),
    #[error("steps must rise strictly within 1..=100 and end at 100, got {0:?}")]
    BadSteps(Vec<u32>),
    #[error("weight must be at most 100 %, got {0}")]
    BadWeight(u32),
    #[error("the rollout is finished ({0:?}); no further checks")]
    Finished(Finish),
}

/// The rollout analysis of one rollout.
#[derive(Clone, Debug)]
pub struct Analyzer {
    settings: AnalysisSettings,
    steps: Vec<u32>,
    state: AnalyzerState,
}

impl Analyzer {
    /// A fresh analysis: Normal, gate open, candidate at `weight`.
    pub fn new(
        settings: AnalysisSettings,
        steps: Vec<u32>,
        weight: u32,
    ) -> Result<Self, AnalysisError> {
        let state = AnalyzerState {
            weight,
            controller: Controller::default(),
            gate: Gate::Open,
            rollback: RollbackTrigger::default(),
            reference: None,
            finished: None,
            paired: Vec::new(),
            recent_scores: Vec::new(),
            composite_warning: None,
            open_review: None,
            reviews_closed: 0,
        };
        Analyzer::from_state(settings, steps, state)
    }

    /// Resumes from a saved state (a restart mid-rollout).
    pub fn from_state(
        settings: AnalysisSettings,
        steps: Vec<u32>,
        state: AnalyzerState,
    ) -> Result<Self, AnalysisError> {
        settings.validate()?;
        let rising = steps.windows(2).all(|w| w[0] < w[1]);
        if steps.is_empty() || !rising || steps[0] == 0 || steps.last() != Some(&100) {
            return Err(AnalysisError::BadSteps(steps));
        }
        if state.weight > 100 {
            return Err(AnalysisError::BadWeight(state.weight));
        }
        Ok(Analyzer {
            settings,
            steps,
            state,
        })
    }

    /// Sets the reference window the candidate's drift is measured against.
    pub fn with_reference(mut self, reference: ReferenceSample) -> Self {
        self.state.reference = Some(reference);
        self
    }

    pub fn state(&self) -> &AnalyzerState {
        &self.state
    }

    pub fn settings(&self) -> &AnalysisSettings {
        &self.settings
    }

    /// The operator's pause: an open gate closes until their resume (safety actions
    /// still act). Returns whether anything changed.
    pub fn hold(&mut self) -> bool {
        let open = self.state.gate == Gate::Open;
        if open {
            self.state.gate = Gate::Paused {
                reason: PauseReason::Operator,
            };
        }
        open
    }

    /// Fixes the drift reference (after a restart, or thinned by the caller).
    pub fn set_reference(&mut self, reference: Option<ReferenceSample>) {
        self.state.reference = reference;
    }

    /// The operator's resume: a paused gate opens (a freeze needs `release_freeze`).
    /// Returns whether anything changed.
    pub fn resume(&mut self) -> bool {
        let paused = matches!(self.state.gate, Gate::Paused { .. });
        if paused {
            self.state.gate = Gate::Open;
        }
        paused
    }

    /// The review closed: a frozen candidate may earn traffic again, from the first step.
    pub fn release_freeze(&mut self) -> bool {
        let frozen = self.state.gate == Gate::Frozen;
        if frozen {
            self.state.gate = Gate::Open;
        }
        frozen
    }

    /// The operator closed reviews up to `closed` (the rollout's count): a newer close
    /// releases the freeze and forgets the open review. Returns whether it changed.
    pub fn close_reviews(&mut self, closed: u64) -> bool {
        if closed <= self.state.reviews_closed {
            return false;
        }
        self.state.reviews_closed = closed;
        self.state.open_review = None;
        self.release_freeze()
    }

    fn shortfalls(&self, m: &WindowMetrics) -> Vec<Shortfall> {
        let e = &self.settings.evidence;
        [
            (
                Evidence::BaselineRequests,
                m.baseline.requests,
                e.min_requests,
            ),
            (
                Evidence::CandidateRequests,
                m.candidate.requests,
                e.min_requests,
            ),
            (
                Evidence::ShadowSample,
                m.agreement.shadow_sample,
                e.min_shadow_sample,
            ),
        ]
        .into_iter()
        .filter(|(_, have, need)| have < need)
        .map(|(evidence, have, need)| Shortfall {
            evidence,
            have,
            need,
        })
        .collect()
    }

    fn set_weight(
        &mut self,
        to: u32,
        reason: WeightReason,
        at: DateTime<Utc>,
        out: &mut Vec<AnalysisOutcome>,
    ) {
        if self.state.weight != to {
            out.push(AnalysisOutcome::WeightChange(WeightChange {
                at,
                from: self.state.weight,
                to,
                reason,
            }));
            self.state.weight = to;
        }
    }

    /// The composite drift of this window, its long window and the escalation pattern;
    /// with `method: composite` it sets the report's tier (an escalation is L3).
    fn composite_drift(
        &mut self,
        window: &WindowSamples,
        drift: &mut DriftReport,
    ) -> Option<Escalation> {
        let d: &DriftSettings = &self.settings.drift;
        let c = &d.composite;
        let end = window.end;
        let assessed = composite::assess(
            &window.candidate,
            end,
            &self.state.recent_scores,
            self.state.reference.as_ref(),
            self.settings.evidence.min_drift_samples,
            d.score_range,
            c,
        );
        self.state.recent_scores.push(RecentScores {
            end,
            scores: composite::thinned(&window.candidate.scores, RECENT_POINTS),
        });
        let horizon = chrono::TimeDelta::milliseconds(c.long_window_ms as i64);
        self.state.recent_scores.retain(|r| end - r.end < horizon);
        let score = assessed.as_ref().map(|a| a.score)?;
        let within = chrono::TimeDelta::milliseconds(c.within_ms as i64);
        let mut escalation = None;
        match self.state.composite_warning {
            Some((first_at, first_score))
                if end > first_at && end - first_at <= within && score >= c.escalate_at =>
            {
                escalation = Some(Escalation {
                    first_at,
                    first_score,
                    at: end,
                    score,
                });
                self.state.composite_warning = None;
            }
            Some((first_at, _)) if end - first_at <= within => {}
            _ => {
                self.state.composite_warning = (score > c.warn_above).then_some((end, score));
            }
        }
        if d.method == DriftMethod::Composite {
            let thresholds = DriftSettings {
                l2_from: c.l2_from,
                l3_above: c.l3_above,
                ..d.clone()
            };
            drift.tier = if escalation.is_some() {
                DriftTier::L3
            } else {
                drift_tier(score, &thresholds)
            };
        }
        drift.composite = assessed;
        escalation
    }

    /// Judges one closed window.
    pub fn check(&mut self, check: Check<'_>) -> Result<Vec<AnalysisOutcome>, AnalysisError> {
        if let Some(finish) = self.state.finished {
            return Err(AnalysisError::Finished(finish));
        }
        let window = check.window;
        let at = window.end;
        let metrics = window.metrics(&self.settings.window);
        let mut out = Vec::new();
        // An unanswered review past its deadline is escalated, conclusive window or not.
        if let Some(review) = self.state.open_review.as_mut()
            && !review.overdue
            && at > review.deadline
        {
            review.overdue = true;
            out.push(AnalysisOutcome::ReviewOverdue {
                at,
                opened_at: review.opened_at,
                deadline: review.deadline,
            });
        }

        let missing = self.shortfalls(&metrics);
        if !missing.is_empty() {
            out.push(AnalysisOutcome::Inconclusive {
                at,
                step: check.step,
                missing,
                metrics,
            });
            if self.state.gate == Gate::Open {
                let reason = PauseReason::Inconclusive;
                self.state.gate = Gate::Paused { reason };
                out.push(AnalysisOutcome::Paused { at, reason });
            }
            return Ok(out);
        }

        let mut drift = assess_drift(
            &window.candidate,
            &window.baseline,
            self.state.reference.as_ref(),
            self.settings.evidence.min_drift_samples,
            &self.settings.drift,
        );
        let escalation = self.composite_drift(window, &mut drift);
        if self.state.reference.is_none() {
            self.state.reference = Some(ReferenceSample::from_stage(&window.baseline));
        }
        let risk = assess(&metrics, &self.settings.risk, &self.settings.sla);
        self.state.paired.push(PairedWindow::from(&metrics));
        let keep = self.settings.significance.max_windows as usize;
        if self.state.paired.len() > keep {
            let excess = self.state.paired.len() - keep;
            self.state.paired.drain(..excess);
        }
        let significance = compare(&self.state.paired, &self.settings.significance);
        let worse = significance.worse();
        out.push(AnalysisOutcome::Assessed {
            at,
            step: check.step,
            metrics: metrics.clone(),
            risk: risk.clone(),
            significance,
        });

        let response = match (drift.tier, self.state.gate) {
            (DriftTier::L1, _) => DriftResponse::Record,
            (DriftTier::L2, Gate::Open)
            | (
                DriftTier::L2,
                Gate::Paused {
                    reason: PauseReason::Inconclusive,
                },
            ) => DriftResponse::PauseAndRequestRetrain,
            (DriftTier::L3, gate) if gate != Gate::Frozen => DriftResponse::FreezeAndOpenReview,
            _ => DriftResponse::Record,
        };
        let drift_score = drift.score;
        if let Some(e) = escalation {
            out.push(AnalysisOutcome::DriftEscalated(e));
        }
        out.push(AnalysisOutcome::Drift(DriftAction {
            at,
            tier: drift.tier,
            response,
            report: drift,
        }));
        match response {
            DriftResponse::PauseAndRequestRetrain => {
                let reason = PauseReason::DriftL2;
                self.state.gate = Gate::Paused { reason };
                out.push(AnalysisOutcome::Paused { at, reason });
            }
            DriftResponse::FreezeAndOpenReview => {
                self.state.gate = Gate::Frozen;
                self.state.open_review = Some(OpenReview {
                    opened_at: at,
                    deadline: at
                        + chrono::TimeDelta::milliseconds(self.settings.review.sla_ms as i64),
                    overdue: false,
                });
                self.set_weight(0, WeightReason::DriftFreeze, at, &mut out);
            }
            DriftResponse::Record => {
                if drift_tier_is_l1(&out) {
                    out.push(AnalysisOutcome::FeatureHealth {
                        at,
                        scores: Summary::of(&window.candidate.scores),
                        features: window
                            .candidate
                            .features
                            .iter()
                            .map(|(name, values)| (name.clone(), Summary::of(values)))
                            .collect(),
                    });
                }
            }
        }

        let transition = self.state.controller.observe(
            &risk,
            &metrics,
            self.settings.risk.healthy_checks_to_recover,
            &self.settings.risk,
        );
        let transitioned = transition.is_some();
        if let Some(t) = transition {
            let fused = t.to == ControllerMode::Fused;
            out.push(AnalysisOutcome::Transition(t));
            if fused {
                self.set_weight(0, WeightReason::Fuse, at, &mut out);
            }
        }

        let breach = WindowBreach {
            start: window.start,
            end: window.end,
            step: check.step,
            breaches: window_breaches(&metrics, drift_score, &self.settings.rollback),
        };
        if let Some(decision) =
            self.state
                .rollback
                .observe(breach, check.snapshots, &self.settings.rollback)
        {
            out.push(AnalysisOutcome::Rollback(decision));
            self.set_weight(0, WeightReason::Rollback, at, &mut out);
            self.state.finished = Some(Finish::RolledBack);
            return Ok(out);
        }

        let may_widen = !transitioned
            && self.state.controller.mode == ControllerMode::Normal
            && self.state.gate == Gate::Open
            && risk.healthy();
        if may_widen {
            match next_weight(
                self.state.weight,
                &self.steps,
                self.settings.risk.increase_factor,
            ) {
                Some(to) => self.set_weight(to, WeightReason::Increase, at, &mut out),
                None if self.settings.significance.promotion_requires_not_worse
                    && !worse.is_empty() =>
                {
                    out.push(AnalysisOutcome::PromotionWithheld { at, worse });
                    let reason = PauseReason::SignificantlyWorse;
                    self.state.gate = Gate::Paused { reason };
                    out.push(AnalysisOutcome::Paused { at, reason });
                }
                None => {
                    out.push(AnalysisOutcome::Promote {
                        at,
                        weight: self.state.weight,
                    });
                    self.state.finished = Some(Finish::Promoted);
                }
            }
        }
        Ok(out)
    }
}

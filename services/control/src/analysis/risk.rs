//! The risk score of one window, the traffic decision it leads to, and the controller's
//! circuit-breaker state machine (Normal → Fused → Degraded → Normal).
//!
//! risk = (w_L·L + w_E·E + w_S·S) / (w_L + w_E + w_S), defaults 0.40 / 0.35 / 0.25 (sum 1):
//! - L = clamp((p99_cand / max(p99_base, 1 µs) − 1) / latency_ratio_span, 0, 1)
//! - E = clamp((error_rate_cand − error_rate_base) / error_jump_span, 0, 1)
//! - S = candidate saturation (already in [0, 1])
//!
//! A term that is NaN counts as 1: an unreadable signal is treated as the worst one.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::metrics::WindowMetrics;
use super::settings::{RiskSettings, SlaSettings};
use super::unit_or_worst;

/// A golden metric, named in SLA failures and rollback breaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    LatencyP99,
    ErrorRate,
    Agreement,
    ComplianceMissRate,
    MeanConfidence,
    Drift,
}

/// A metric outside its bound.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bound {
    pub metric: Metric,
    pub value: f64,
    pub limit: f64,
}

/// The three normalised terms of the risk score, each in [0, 1].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RiskTerms {
    pub latency_ratio: f64,
    pub error_jump: f64,
    pub saturation: f64,
}

/// What the risk score asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RiskDecision {
    /// risk > fuse_above: candidate weight → 0 (RolledBack).
    Fuse,
    /// risk > degrade_above: hold the weight, candidate's fallback path on.
    Degrade,
    /// SLA met and risk < increase_below: weight × increase_factor, capped at the next step.
    Increase,
    Hold,
}

/// The SLA verdict: met when `failures` is empty.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SlaCheck {
    pub met: bool,
    pub failures: Vec<Bound>,
}

/// Risk score, its terms, the SLA verdict and the decision, for one window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RiskAssessment {
    pub risk: f64,
    pub terms: RiskTerms,
    pub sla: SlaCheck,
    pub decision: RiskDecision,
}

impl RiskAssessment {
    /// A check that would widen traffic is what recovery counts as healthy.
    pub fn healthy(&self) -> bool {
        self.decision == RiskDecision::Increase
    }
}

pub fn risk_terms(m: &WindowMetrics, s: &RiskSettings) -> RiskTerms {
    let base_p99 = m.baseline.latency_p99_us.max(1) as f64;
    let ratio = m.candidate.latency_p99_us as f64 / base_p99;
    RiskTerms {
        latency_ratio: unit_or_worst((ratio - 1.0) / s.latency_ratio_span),
        error_jump: unit_or_worst(
            (m.candidate.error_rate - m.baseline.error_rate) / s.error_jump_span,
        ),
        saturation: unit_or_worst(m.candidate.saturation),
    }
}

/// Weighted mean of the terms, in [0, 1] for any non-negative weights.
pub fn risk_score(t: &RiskTerms, s: &RiskSettings) -> f64 {
    let weights = [s.latency_weight, s.error_weight, s.saturation_weight]
        .map(|w| if w.is_finite() && w > 0.0 { w } else { 0.0 });
    let total: f64 = weights.iter().sum();
    if total <= 0.0 {
        return 1.0;
    }
    let terms = [t.latency_ratio, t.error_jump, t.saturation].map(unit_or_worst);
    let sum: f64 = weights.iter().zip(terms).map(|(w, x)| w * x).sum();
    unit_or_worst(sum / total)
}

pub fn sla_check(m: &WindowMetrics, s: &SlaSettings) -> SlaCheck {
    let c = &m.candidate;
    let mut failures = Vec::new();
    if c.latency_p99_us > s.max_p99_us {
        failures.push(Bound {
            metric: Metric::LatencyP99,
            value: c.latency_p99_us as f64,
            limit: s.max_p99_us as f64,
        });
    }
    if c.error_rate.is_nan() || c.error_rate > s.max_error_rate {
        failures.push(Bound {
            metric: Metric::ErrorRate,
            value: c.error_rate,
            limit: s.max_error_rate,
        });
    }
    if m.agreement.jaccard.is_nan() || m.agreement.jaccard < s.min_agreement {
        failures.push(Bound {
            metric: Metric::Agreement,
            value: m.agreement.jaccard,
            limit: s.min_agreement,
        });
    }
    if c.compliance_miss_rate.is_nan() || c.compliance_miss_rate > s.max_compliance_miss_rate {
        failures.push(Bound {
            metric: Metric::ComplianceMissRate,
            value: c.compliance_miss_rate,
            limit: s.max_compliance_miss_rate,
        });
    }
    SlaCheck {
        met: failures.is_empty(),
        failures,
    }
}

/// The decision table of issue 7, first match wins.
pub fn decide(risk: f64, sla_met: bool, s: &RiskSettings) -> RiskDecision {
    if risk.is_nan() || risk > s.fuse_above {
        RiskDecision::Fuse
    } else if risk > s.degrade_above {
        RiskDecision::Degrade
    } else if sla_met && risk < s.increase_below {
        RiskDecision::Increase
    } else {
        RiskDecision::Hold
    }
}

pub fn assess(m: &WindowMetrics, risk: &RiskSettings, sla: &SlaSettings) -> RiskAssessment {
    let terms = risk_terms(m, risk);
    let score = risk_score(&terms, risk);
    let sla = sla_check(m, sla);
    RiskAssessment {
        risk: score,
        terms,
        decision: decide(score, sla.met, risk),
        sla,
    }
}

/// The candidate's next weight on an Increase: ⌈current × factor⌉, at least current + 1,
/// never past the next step of the rollout; from 0 it is the first step. None when no
/// step lies above the current weight.
pub fn next_weight(current: u32, steps: &[u32], factor: f64) -> Option<u32> {
    let next = steps.iter().copied().find(|&s| s > current)?;
    if current == 0 {
        return Some(next);
    }
    let grown = (f64::from(current) * factor).ceil();
    let grown = if grown.is_finite() {
        grown.min(100.0) as u32
    } else {
        100
    };
    Some(grown.max(current + 1).min(next))
}

/// The controller's mode, a circuit breaker over the candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControllerMode {
    /// Widening as the analysis allows.
    Normal,
    /// Candidate at 0 % after a fuse; still shadow-scored, so it can prove itself again.
    Fused,
    /// Weight held, the candidate's fallback path on.
    Degraded,
}

impl ControllerMode {
    /// Whether the gateway should send the candidate's failures to its fallback path.
    pub fn fallback_path(self) -> bool {
        self != ControllerMode::Normal
    }
}

/// A change of mode, with the evidence that caused it; the lead appends it as an event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub from: ControllerMode,
    pub to: ControllerMode,
    pub reason: String,
    pub at: DateTime<Utc>,
    pub metrics: WindowMetrics,
    pub risk: RiskAssessment,
}

/// The mode and the run of healthy checks towards recovery.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Controller {
    pub mode: ControllerMode,
    pub healthy_streak: u32,
}

impl Default for Controller {
    fn default() -> Self {
        Controller {
            mode: ControllerMode::Normal,
            healthy_streak: 0,
        }
    }
}

impl Controller {
    /// Feeds one conclusive check.
    ///
    /// - any mode, Fuse → Fused (from Fused: stays, the streak restarts);
    /// - Normal, Degrade → Degraded;
    /// - Fused, `recover_after` healthy checks in a row → Degraded;
    /// - Degraded, `recover_after` healthy checks in a row → Normal;
    /// - an unhealthy check in Fused or Degraded restarts the streak.
    pub fn observe(
        &mut self,
        assessment: &RiskAssessment,
        metrics: &WindowMetrics,
        recover_after: u32,
        risk_settings: &RiskSettings,
    ) -> Option<Transition> {
        let from = self.mode;
        let (to, reason) = match (from, assessment.decision) {
            (ControllerMode::Fused, RiskDecision::Fuse) => {
                self.healthy_streak = 0;
                return None;
            }
            (_, RiskDecision::Fuse) => (
                ControllerMode::Fused,
                format!(
                    "risk {:.3} > fuse threshold {:.2}: candidate weight to 0",
                    assessment.risk, risk_settings.fuse_above
                ),
            ),
            (ControllerMode::Normal, RiskDecision::Degrade) => (
                ControllerMode::Degraded,
                format!(
                    "risk {:.3} > degrade threshold {:.2}: weight held, fallback path on",
                    assessment.risk, risk_settings.degrade_above
                ),
            ),
            (ControllerMode::Normal, _) => return None,
            (mode, _) if assessment.healthy() => {
                self.healthy_streak += 1;
                if self.healthy_streak < recover_after {
                    return None;
                }
                let to = if mode == ControllerMode::Fused {
                    ControllerMode::Degraded
                } else {
                    ControllerMode::Normal
                };
                (
                    to,
                    format!(
                        "{} healthy checks in a row (risk {:.3} < {:.2}, SLA met)",
                        self.healthy_streak, assessment.risk, risk_settings.increase_below
                    ),
                )
            }
            _ => {
                self.healthy_streak = 0;
                return None;
            }
        };
        self.mode = to;
        self.healthy_streak = 0;
        Some(Transition {
            from,
            to,
            reason,
            at: metrics.end,
            metrics: metrics.clone(),
            risk: assessment.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_weight_grows_by_half_and_stops_at_the_next_step() {
        let steps = [1, 2, 5, 10, 25, 50, 100];
        assert_eq!(next_weight(0, &steps, 1.5), Some(1));
        assert_eq!(next_weight(1, &steps, 1.5), Some(2));
        assert_eq!(next_weight(2, &steps, 1.5), Some(3));
        assert_eq!(next_weight(3, &steps, 1.5), Some(5));
        assert_eq!(next_weight(10, &steps, 1.5), Some(15));
        assert_eq!(next_weight(20, &steps, 1.5), Some(25));
        assert_eq!(next_weight(50, &steps, 1.5), Some(75));
        assert_eq!(next_weight(75, &steps, 1.5), Some(100));
        assert_eq!(next_weight(100, &steps, 1.5), None);
        assert_eq!(next_weight(0, &[10, 100], 1.5), Some(10));
    }

    #[test]
    fn decision_thresholds_are_strict() {
        let s = RiskSettings::default();
        assert_eq!(decide(0.86, true, &s), RiskDecision::Fuse);
        assert_eq!(decide(0.85, true, &s), RiskDecision::Degrade);
        assert_eq!(decide(0.65, true, &s), RiskDecision::Hold);
        assert_eq!(decide(0.3999, true, &s), RiskDecision::Increase);
        assert_eq!(decide(0.40, true, &s), RiskDecision::Hold);
        assert_eq!(decide(0.1, false, &s), RiskDecision::Hold);
        assert_eq!(decide(f64::NAN, true, &s), RiskDecision::Fuse);
    }

    #[test]
    fn risk_score_is_the_weighted_mean() {
        let s = RiskSettings::default();
        let t = RiskTerms {
            latency_ratio: 1.0,
            error_jump: 0.0,
            saturation: 0.0,
        };
        assert!((risk_score(&t, &s) - 0.40).abs() < 1e-12);
        let t = RiskTerms {
            latency_ratio: f64::NAN,
            error_jump: 1.0,
            saturation: 1.0,
        };
        assert_eq!(risk_score(&t, &s), 1.0);
    }
}

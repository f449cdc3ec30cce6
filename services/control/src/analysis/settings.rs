//! Every threshold of the rollout analysis in one serde struct, so that a rollout's
//! `analysis` object (kept verbatim in `RolloutStarted`) can override any of them and a
//! replay reads back exactly the numbers a decision was made under.
//!
//! Each group has `#[serde(default)]`: an operator writes only what differs from the
//! defaults of issue 7, e.g. `{"window": {"length_ms": 1000}}`.

use serde::{Deserialize, Serialize};

/// All analysis settings; `AnalysisSettings::default()` is issue 7's defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AnalysisSettings {
    pub window: WindowSettings,
    pub evidence: EvidenceSettings,
    pub sla: SlaSettings,
    pub risk: RiskSettings,
    pub drift: DriftSettings,
    pub rollback: RollbackSettings,
    pub significance: SignificanceSettings,
    pub review: ReviewSettings,
}

/// The human review an L3 drift opens.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReviewSettings {
    /// How long the operators have to answer (the ticket's deadline); past it the ticket
    /// is escalated as `ReviewTicketOverdue`. Default 2 h, the design's example SLA.
    pub sla_ms: u64,
}

impl Default for ReviewSettings {
    fn default() -> Self {
        ReviewSettings { sla_ms: 7_200_000 }
    }
}

/// How observations are cut into windows and how saturation is read from them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WindowSettings {
    /// Window length; 60 s in production, down to 1 s for tests.
    pub length_ms: u64,
    /// A worker queue holding this many full batches counts as saturated (queue fill 1).
    pub saturated_queue_batches: f64,
}

impl Default for WindowSettings {
    fn default() -> Self {
        WindowSettings {
            length_ms: 60_000,
            saturated_queue_batches: 4.0,
        }
    }
}

/// The least evidence a check needs; below it the check is inconclusive and the
/// rollout pauses (it never aborts on missing evidence).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvidenceSettings {
    /// Requests per stage (baseline and candidate, shadow included) in the window.
    pub min_requests: u64,
    /// Requests scored by both stages (the agreement sample).
    pub min_shadow_sample: u64,
    /// Values per side below which a KS test or a Wasserstein distance is not computed.
    pub min_drift_samples: u64,
}

impl Default for EvidenceSettings {
    fn default() -> Self {
        EvidenceSettings {
            min_requests: 100,
            min_shadow_sample: 30,
            min_drift_samples: 30,
        }
    }
}

/// What the candidate must meet before it may get more traffic.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SlaSettings {
    pub max_p99_us: u64,
    pub max_error_rate: f64,
    /// Jaccard agreement of flagged sets on the shadow sample (issue 7: ≥ 0.91).
    pub min_agreement: f64,
    pub max_compliance_miss_rate: f64,
}

impl Default for SlaSettings {
    fn default() -> Self {
        SlaSettings {
            max_p99_us: 420_000,
            max_error_rate: 0.01,
            min_agreement: 0.91,
            max_compliance_miss_rate: 0.02,
        }
    }
}

/// Risk score weights, normalisation spans and decision thresholds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RiskSettings {
    pub latency_weight: f64,
    pub error_weight: f64,
    pub saturation_weight: f64,
    /// p99 ratio excess that counts as full latency risk: ratio 1 + span → term 1.
    pub latency_ratio_span: f64,
    /// Error-rate increase (absolute) that counts as full error risk.
    pub error_jump_span: f64,
    /// risk > fuse → Fuse.
    pub fuse_above: f64,
    /// risk > degrade → Degrade.
    pub degrade_above: f64,
    /// risk < increase_below and SLA met → Increase (a "healthy" check).
    pub increase_below: f64,
    /// Weight multiplier of an Increase, capped at the next step.
    pub increase_factor: f64,
    /// Healthy checks in a row to go Fused → Degraded and Degraded → Normal.
    pub healthy_checks_to_recover: u32,
}

impl Default for RiskSettings {
    fn default() -> Self {
        RiskSettings {
            latency_weight: 0.40,
            error_weight: 0.35,
            saturation_weight: 0.25,
            latency_ratio_span: 1.0,
            error_jump_span: 0.05,
            fuse_above: 0.85,
            degrade_above: 0.65,
            increase_below: 0.40,
            increase_factor: 1.5,
            healthy_checks_to_recover: 3,
        }
    }
}

/// Drift test level and tier thresholds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DriftSettings {
    /// A feature's KS statistic counts only when its p-value is below this.
    pub ks_alpha: f64,
    /// Width of the score scale; a Wasserstein distance of this much is drift 1.
    pub score_range: f64,
    /// drift ≥ l2_from → L2 (pause + retrain requested).
    pub l2_from: f64,
    /// drift > l3_above → L3 (frozen at 0 % + review ticket).
    pub l3_above: f64,
    /// Which score the tiers read; both are computed and recorded.
    pub method: DriftMethod,
    /// The source design's composite score (KL, JS, PSI; long window; escalation).
    pub composite: CompositeSettings,
}

impl Default for DriftSettings {
    fn default() -> Self {
        DriftSettings {
            ks_alpha: 0.01,
            score_range: 1.0,
            l2_from: 0.15,
            l3_above: 0.30,
            method: DriftMethod::KsWasserstein,
            composite: CompositeSettings::default(),
        }
    }
}

/// The drift score the tiers are judged on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriftMethod {
    /// The worst of the KS feature tests and the score Wasserstein distances, tiers at
    /// `l2_from` / `l3_above`.
    KsWasserstein,
    /// The composite score, tiers at `composite.l2_from` / `composite.l3_above`, and an
    /// escalation freezes like L3.
    Composite,
}

/// Weights of the composite's three divergences.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompositeWeights {
    pub kl: f64,
    pub js: f64,
    pub psi: f64,
}

impl Default for CompositeWeights {
    fn default() -> Self {
        CompositeWeights {
            kl: 0.4,
            js: 0.35,
            psi: 0.25,
        }
    }
}

/// The composite drift score of the source design.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompositeSettings {
    pub weights: CompositeWeights,
    /// Quantile bins of the reference for KL, JS and PSI.
    pub bins: usize,
    /// The long window: closed windows this far back count, time-decayed.
    pub long_window_ms: u64,
    /// A window this old weighs half as much in the long window.
    pub half_life_ms: u64,
    /// Composite tiers (with `method: composite`): L2 from, L3 above.
    pub l2_from: f64,
    pub l3_above: f64,
    /// Escalation: a score above `warn_above` followed within `within_ms` by one at or
    /// above `escalate_at` (`DriftEscalated`).
    pub warn_above: f64,
    pub escalate_at: f64,
    pub within_ms: u64,
}

impl Default for CompositeSettings {
    fn default() -> Self {
        CompositeSettings {
            weights: CompositeWeights::default(),
            bins: 10,
            long_window_ms: 300_000,
            half_life_ms: 120_000,
            l2_from: 0.7,
            l3_above: 0.85,
            warn_above: 0.7,
            escalate_at: 0.85,
            within_ms: 30_000,
        }
    }
}

/// Semantic rollback: breach bounds and how many windows in a row trigger it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RollbackSettings {
    pub min_mean_confidence: f64,
    pub max_p99_us: u64,
    pub max_drift: f64,
    pub consecutive_windows: u32,
}

impl Default for RollbackSettings {
    fn default() -> Self {
        RollbackSettings {
            min_mean_confidence: 0.82,
            max_p99_us: 420_000,
            max_drift: 0.35,
            consecutive_windows: 3,
        }
    }
}

/// The paired tests of the candidate against the baseline over the rollout's windows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SignificanceSettings {
    /// One-sided level of "significantly worse".
    pub alpha: f64,
    /// Paired windows needed before a test is made (6: the fewest at which an exact
    /// two-sided p can fall below 0.05).
    pub min_windows: u64,
    /// The newest windows kept for the tests (an hour at 60 s windows).
    pub max_windows: u64,
    /// Withhold promotion (pause for the operator) while the candidate is significantly
    /// worse than the baseline on any golden metric.
    pub promotion_requires_not_worse: bool,
}

impl Default for SignificanceSettings {
    fn default() -> Self {
        SignificanceSettings {
            alpha: 0.05,
            min_windows: 6,
            max_windows: 60,
            promotion_requires_not_worse: true,
        }
    }
}

/// Why a settings object cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    #[error("window.length_ms must be at least 1000 (1 s), got {0}")]
    WindowTooShort(u64),
    #[error("{name} must be a finite number in {range}, got {value}")]
    OutOfRange {
        name: &'static str,
        range: &'static str,
        value: f64,
    },
    #[error("risk weights must not all be zero")]
    ZeroRiskWeights,
    #[error(
        "risk thresholds must satisfy increase_below ≤ degrade_above ≤ fuse_above, got {increase} / {degrade} / {fuse}"
    )]
    RiskThresholdOrder {
        increase: f64,
        degrade: f64,
        fuse: f64,
    },
    #[error("drift tiers must satisfy l2_from ≤ l3_above, got {l2} / {l3}")]
    DriftTierOrder { l2: f64, l3: f64 },
    #[error("{0} must be at least 1")]
    ZeroCount(&'static str),
}

impl AnalysisSettings {
    /// Checks that every number is usable, so the analysis itself can assume it.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.window.length_ms < 1000 {
            return Err(SettingsError::WindowTooShort(self.window.length_ms));
        }
        positive(
            "window.saturated_queue_batches",
            self.window.saturated_queue_batches,
        )?;
        unit("sla.max_error_rate", self.sla.max_error_rate)?;
        unit("sla.min_agreement", self.sla.min_agreement)?;
        unit(
            "sla.max_compliance_miss_rate",
            self.sla.max_compliance_miss_rate,
        )?;
        let r = &self.risk;
        non_negative("risk.latency_weight", r.latency_weight)?;
        non_negative("risk.error_weight", r.error_weight)?;
        non_negative("risk.saturation_weight", r.saturation_weight)?;
        if r.latency_weight + r.error_weight + r.saturation_weight <= 0.0 {
            return Err(SettingsError::ZeroRiskWeights);
        }
        positive("risk.latency_ratio_span", r.latency_ratio_span)?;
        positive("risk.error_jump_span", r.error_jump_span)?;
        unit("risk.fuse_above", r.fuse_above)?;
        unit("risk.degrade_above", r.degrade_above)?;
        unit("risk.increase_below", r.increase_below)?;
        if r.increase_below > r.degrade_above || r.degrade_above > r.fuse_above {
            return Err(SettingsError::RiskThresholdOrder {
                increase: r.increase_below,
                degrade: r.degrade_above,
                fuse: r.fuse_above,
            });
        }
        if !(r.increase_factor.is_finite() && r.increase_factor > 1.0) {
            return Err(SettingsError::OutOfRange {
                name: "risk.increase_factor",
                range: "(1, ∞)",
                value: r.increase_factor,
            });
        }
        if r.healthy_checks_to_recover == 0 {
            return Err(SettingsError::ZeroCount("risk.healthy_checks_to_recover"));
        }
        let d = &self.drift;
        unit("drift.ks_alpha", d.ks_alpha)?;
        positive("drift.score_range", d.score_range)?;
        unit("drift.l2_from", d.l2_from)?;
        unit("drift.l3_above", d.l3_above)?;
        if d.l2_from > d.l3_above {
            return Err(SettingsError::DriftTierOrder {
                l2: d.l2_from,
                l3: d.l3_above,
            });
        }
        let c = &d.composite;
        non_negative("drift.composite.weights.kl", c.weights.kl)?;
        non_negative("drift.composite.weights.js", c.weights.js)?;
        non_negative("drift.composite.weights.psi", c.weights.psi)?;
        if c.weights.kl + c.weights.js + c.weights.psi <= 0.0 {
            return Err(SettingsError::OutOfRange {
                name: "drift.composite.weights",
                range: "a positive sum",
                value: 0.0,
            });
        }
        if !(2..=1000).contains(&c.bins) {
            return Err(SettingsError::OutOfRange {
                name: "drift.composite.bins",
                range: "[2, 1000]",
                value: c.bins as f64,
            });
        }
        if c.long_window_ms < 1000 || c.half_life_ms == 0 {
            return Err(SettingsError::OutOfRange {
                name: "drift.composite.long_window_ms / half_life_ms",
                range: "≥ 1000 / ≥ 1",
                value: c.long_window_ms.min(c.half_life_ms) as f64,
            });
        }
        for (name, value) in [
            ("drift.composite.l2_from", c.l2_from),
            ("drift.composite.l3_above", c.l3_above),
            ("drift.composite.warn_above", c.warn_above),
            ("drift.composite.escalate_at", c.escalate_at),
        ] {
            unit(name, value)?;
        }
        if c.l2_from > c.l3_above {
            return Err(SettingsError::DriftTierOrder {
                l2: c.l2_from,
                l3: c.l3_above,
            });
        }
        unit(
            "rollback.min_mean_confidence",
            self.rollback.min_mean_confidence,
        )?;
        unit("rollback.max_drift", self.rollback.max_drift)?;
        if self.rollback.consecutive_windows == 0 {
            return Err(SettingsError::ZeroCount("rollback.consecutive_windows"));
        }
        if self.review.sla_ms < 1000 {
            return Err(SettingsError::OutOfRange {
                name: "review.sla_ms",
                range: "≥ 1000",
                value: self.review.sla_ms as f64,
            });
        }
        let g = &self.significance;
        if !(g.alpha.is_finite() && g.alpha > 0.0 && g.alpha < 1.0) {
            return Err(SettingsError::OutOfRange {
                name: "significance.alpha",
                range: "(0, 1)",
                value: g.alpha,
            });
        }
        if g.min_windows == 0 {
            return Err(SettingsError::ZeroCount("significance.min_windows"));
        }
        if g.max_windows < g.min_windows || g.max_windows > MAX_SIGNIFICANCE_WINDOWS {
            return Err(SettingsError::OutOfRange {
                name: "significance.max_windows",
                range: "[min_windows, 1000]",
                value: g.max_windows as f64,
            });
        }
        Ok(())
    }
}

/// The most windows a rollout's state keeps for the paired tests (each check records
/// them, so the bound keeps `RolloutChecked` small).
pub const MAX_SIGNIFICANCE_WINDOWS: u64 = 1000;

fn unit(name: &'static str, value: f64) -> Result<(), SettingsError> {
    if value.is_finite() && (0.0..=1.0).contains(&value) {
        Ok(())
    } else {
        Err(SettingsError::OutOfRange {
            name,
            range: "[0, 1]",
            value,
        })
    }
}

fn positive(name: &'static str, value: f64) -> Result<(), SettingsError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(SettingsError::OutOfRange {
            name,
            range: "(0, ∞)",
            value,
        })
    }
}

fn non_negative(name: &'static str, value: f64) -> Result<(), SettingsError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(SettingsError::OutOfRange {
            name,
            range: "[0, ∞)",
            value,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_issue_7s_and_valid() {
        let s = AnalysisSettings::default();
        assert_eq!(s.window.length_ms, 60_000);
        assert_eq!(s.rollback.consecutive_windows, 3);
        assert_eq!(s.rollback.max_p99_us, 420_000);
        assert_eq!(s.risk.healthy_checks_to_recover, 3);
        assert_eq!(s.validate(), Ok(()));
    }

    #[test]
    fn partial_json_overrides_only_what_it_names() {
        let s: AnalysisSettings =
            serde_json::from_str(r#"{"window": {"length_ms": 1000}, "drift": {"l2_from": 0.2}}"#)
                .expect("valid settings");
        assert_eq!(s.window.length_ms, 1000);
        assert_eq!(s.window.saturated_queue_batches, 4.0);
        assert_eq!(s.drift.l2_from, 0.2);
        assert_eq!(s.drift.l3_above, 0.30);
        assert!(serde_json::from_str::<AnalysisSettings>(r#"{"windw": {}}"#).is_err());
    }

    #[test]
    fn rejects_unusable_numbers() {
        let mut s = AnalysisSettings::default();
        s.window.length_ms = 999;
        assert_eq!(s.validate(), Err(SettingsError::WindowTooShort(999)));
        let mut s = AnalysisSettings::default();
        s.risk.degrade_above = 0.9;
        assert!(matches!(
            s.validate(),
            Err(SettingsError::RiskThresholdOrder { .. })
        ));
        let mut s = AnalysisSettings::default();
        s.drift.ks_alpha = f64::NAN;
        assert!(matches!(
            s.validate(),
            Err(SettingsError::OutOfRange { .. })
        ));
    }
}

//! Rollout analysis (issue 7), the pure decision core: golden metrics per window, drift,
//! the risk score and its circuit breaker, semantic rollback, and the `Analyzer` that
//! turns one closed window into the outcomes a rollout controller appends as events.
//!
//! This module does no I/O and reads no clock: every time comes in with the data, so a
//! replay of the same observations yields the same decisions. `ANALYSIS.md` beside
//! `Cargo.toml` writes down every formula and default.

pub mod analyzer;
pub mod composite;
pub mod drift;
pub mod metrics;
pub mod risk;
pub mod rollback;
pub mod settings;
pub mod significance;

pub use analyzer::{
    AnalysisError, AnalysisOutcome, Analyzer, AnalyzerState, Check, DriftAction, DriftResponse,
    Evidence, Finish, Gate, PauseReason, Shortfall, WeightChange, WeightReason,
};
pub use composite::{CompositeDrift, Escalation, RecentScores, SeriesDrift};
pub use drift::{
    DriftReport, DriftTier, FeatureDrift, KsTest, ReferenceSample, assess_drift, drift_tier,
    kolmogorov_q, ks_two_sample, wasserstein_1,
};
pub use metrics::{
    Agreement, BatchReport, ObservationError, RequestObservation, Stage, StageMetrics,
    StageSamples, WindowAggregator, WindowMetrics, WindowSamples, jaccard, nearest_rank,
};
pub use risk::{
    Bound, Controller, ControllerMode, Metric, RiskAssessment, RiskDecision, RiskTerms, SlaCheck,
    Transition, assess, decide, next_weight, risk_score, risk_terms, sla_check,
};
pub use rollback::{
    CommittedSnapshot, RollbackDecision, RollbackTrigger, WindowBreach, rollback_target,
    window_breaches,
};
pub use settings::{
    AnalysisSettings, CompositeSettings, CompositeWeights, DriftMethod, DriftSettings,
    EvidenceSettings, ReviewSettings, RiskSettings, RollbackSettings, SettingsError,
    SignificanceSettings, SlaSettings, WindowSettings,
};
pub use significance::{
    CliffsDelta, GoldenMetric, GoldenMetrics, Magnitude, MetricComparison, PMethod, PairedWindow,
    Significance, Wilcoxon, cliffs_delta, wilcoxon_signed_rank,
};

/// Clamps to [0, 1], reading NaN as 1: an unreadable signal counts as the worst one, so a
/// bug upstream can stop a rollout but never wave one through.
pub(crate) fn unit_or_worst(x: f64) -> f64 {
    if x.is_nan() { 1.0 } else { x.clamp(0.0, 1.0) }
}

//! Semantic rollback: when the golden metrics stay out of bounds for N consecutive
//! windows (default 3), restore the last committed snapshot before the step at which the
//! trouble began — routing, rule set and corpus together, in one RolledBack event.
//!
//! Inconclusive windows are skipped: they neither count towards the run nor break it,
//! because missing evidence is not evidence of health.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::metrics::WindowMetrics;
use super::risk::{Bound, Metric};
use super::settings::RollbackSettings;

/// One window that breached, with the rollout step it was observed under.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowBreach {
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
    pub step: u64,
    pub breaches: Vec<Bound>,
}

/// A snapshot committed at a rollout step (the caller's step numbering, rising).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommittedSnapshot {
    pub step: u64,
    pub snapshot_id: String,
}

/// The decision to roll back, with every breach that led to it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RollbackDecision {
    pub reason: String,
    /// The step of the first window of the breaching run.
    pub offending_step: u64,
    pub breaches: Vec<WindowBreach>,
    /// The last committed snapshot before the offending step; None when the caller knew
    /// of none (the lead must then refuse to restore rather than guess).
    pub target: Option<CommittedSnapshot>,
}

/// The golden-metric bounds one window breaks: candidate mean confidence, candidate
/// p99 and the drift score.
pub fn window_breaches(m: &WindowMetrics, drift: f64, s: &RollbackSettings) -> Vec<Bound> {
    let c = &m.candidate;
    let mut out = Vec::new();
    if c.mean_confidence.is_nan() || c.mean_confidence < s.min_mean_confidence {
        out.push(Bound {
            metric: Metric::MeanConfidence,
            value: c.mean_confidence,
            limit: s.min_mean_confidence,
        });
    }
    if c.latency_p99_us > s.max_p99_us {
        out.push(Bound {
            metric: Metric::LatencyP99,
            value: c.latency_p99_us as f64,
            limit: s.max_p99_us as f64,
        });
    }
    if drift.is_nan() || drift > s.max_drift {
        out.push(Bound {
            metric: Metric::Drift,
            value: drift,
            limit: s.max_drift,
        });
    }
    out
}

/// The last snapshot committed strictly before `offending_step`; of several at one step,
/// the one given last (the caller lists them in commit order).
pub fn rollback_target(
    offending_step: u64,
    snapshots: &[CommittedSnapshot],
) -> Option<CommittedSnapshot> {
    snapshots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.step < offending_step)
        .max_by_key(|(i, s)| (s.step, *i))
        .map(|(_, s)| s.clone())
}

/// The run of consecutive breaching windows.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RollbackTrigger {
    pub streak: Vec<WindowBreach>,
}

impl RollbackTrigger {
    /// Feeds one conclusive window: a clean window ends the run; the N-th breaching one
    /// in a row yields the decision (and empties the run).
    pub fn observe(
        &mut self,
        window: WindowBreach,
        snapshots: &[CommittedSnapshot],
        s: &RollbackSettings,
    ) -> Option<RollbackDecision> {
        if window.breaches.is_empty() {
            self.streak.clear();
            return None;
        }
        self.streak.push(window);
        if (self.streak.len() as u64) < u64::from(s.consecutive_windows.max(1)) {
            return None;
        }
        let breaches = std::mem::take(&mut self.streak);
        let offending_step = breaches.first().map_or(0, |w| w.step);
        let mut metrics: Vec<Metric> = breaches
            .iter()
            .flat_map(|w| w.breaches.iter().map(|b| b.metric))
            .collect();
        metrics.sort();
        metrics.dedup();
        let names: Vec<String> = metrics
            .iter()
            .map(|m| match m {
                Metric::MeanConfidence => format!("mean confidence < {}", s.min_mean_confidence),
                Metric::LatencyP99 => format!("p99 > {} ms", s.max_p99_us as f64 / 1000.0),
                Metric::Drift => format!("drift > {}", s.max_drift),
                other => format!("{other:?}"),
            })
            .collect();
        let target = rollback_target(offending_step, snapshots);
        let reason = format!(
            "golden metrics out of bounds for {} consecutive windows since step {} ({})",
            breaches.len(),
            offending_step,
            names.join(", ")
        );
        Some(RollbackDecision {
            reason,
            offending_step,
            breaches,
            target,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(step: u64, id: &str) -> CommittedSnapshot {
        CommittedSnapshot {
            step,
            snapshot_id: id.into(),
        }
    }

    #[test]
    fn target_is_the_last_snapshot_strictly_before_the_step() {
        let snaps = [snap(0, "s0"), snap(2, "s2"), snap(3, "s3"), snap(1, "s1")];
        assert_eq!(rollback_target(3, &snaps), Some(snap(2, "s2")));
        assert_eq!(rollback_target(4, &snaps), Some(snap(3, "s3")));
        assert_eq!(rollback_target(0, &snaps), None);
        let twice = [snap(1, "a"), snap(1, "b"), snap(2, "c")];
        assert_eq!(rollback_target(2, &twice), Some(snap(1, "b")));
        assert_eq!(rollback_target(5, &[]), None);
    }
}

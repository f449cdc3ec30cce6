//! Drift: has the candidate's input or output moved away from what it was judged on?
//!
//! Inputs: a two-sample Kolmogorov–Smirnov test per feature, the candidate's features in
//! this window against a reference window. Outputs: the Wasserstein-1 distance between
//! score distributions, candidate against baseline (same window) and against the
//! reference. The drift score is the worst of the three signals, each in [0, 1]
//! (ANALYSIS.md has the formula); one drifted signal is reason enough, and an average
//! would let a stable signal hide it.
//!
//! The Kolmogorov distribution is implemented here from its series rather than taken from
//! statrs 0.19 (`stats_tests::ks_test::ks_twosample`, `TwoSidedAsymptotic`): that one sums
//! only the alternating series until a term is below 1e-10, so for identical samples
//! (D = 0, the usual no-drift case) every term is 1 and it never returns; it also has no
//! small-sample correction, and its exact mode stops at n·m > 10 000. The two series below
//! are a dozen lines with published reference values to test against.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use super::metrics::ReferenceSample;
use super::metrics::StageSamples;
use super::settings::DriftSettings;
use super::unit_or_worst;

/// A two-sample KS test: D = sup |F₁ − F₂| and its asymptotic p-value.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct KsTest {
    pub statistic: f64,
    pub p_value: f64,
    pub n: u64,
    pub m: u64,
}

/// Two-sample Kolmogorov–Smirnov test. Non-finite values are ignored; None when either
/// side is then empty.
///
/// p-value: Q_KS(λ) with λ = (√nₑ + 0.12 + 0.11/√nₑ)·D, nₑ = n·m/(n+m) — Stephens'
/// (1970) small-sample correction of the asymptotic distribution, as in Press et al.,
/// *Numerical Recipes* (3rd ed., 2007), §14.3.3, eq. 14.3.18.
pub fn ks_two_sample(a: &[f64], b: &[f64]) -> Option<KsTest> {
    let a = sorted_finite(a);
    let b = sorted_finite(b);
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let (n, m) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j, mut d) = (0usize, 0usize, 0.0f64);
    while i < a.len() && j < b.len() {
        // Step past every copy of the next value on both sides, so ties move together.
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / n - j as f64 / m).abs());
    }
    let ne = (n * m / (n + m)).sqrt();
    let lambda = (ne + 0.12 + 0.11 / ne) * d;
    Some(KsTest {
        statistic: d,
        p_value: kolmogorov_q(lambda),
        n: a.len() as u64,
        m: b.len() as u64,
    })
}

/// Survival function of the Kolmogorov distribution, Q_KS(λ) = P(K > λ).
///
/// For λ ≥ 1.18: Q = 2 Σ_{j≥1} (−1)^{j−1} e^{−2j²λ²} (Kolmogorov 1933), which converges
/// in a few terms there. Below, the alternating series converges slowly, so use the
/// Jacobi-transformed form P(K ≤ λ) = (√(2π)/λ) Σ_{j≥1} e^{−(2j−1)²π²/(8λ²)} and return
/// 1 − P (the switch point 1.18 is the one Numerical Recipes uses, §6.14).
pub fn kolmogorov_q(lambda: f64) -> f64 {
    if lambda.is_nan() {
        return 0.0;
    }
    if lambda <= 0.0 {
        return 1.0;
    }
    let q = if lambda < 1.18 {
        let mut sum = 0.0;
        for j in 1..=64u32 {
            let k = f64::from(2 * j - 1);
            let term = (-(k * k) * std::f64::consts::PI.powi(2) / (8.0 * lambda * lambda)).exp();
            sum += term;
            if term < 1e-18 * sum.max(f64::MIN_POSITIVE) {
                break;
            }
        }
        1.0 - (2.0 * std::f64::consts::PI).sqrt() / lambda * sum
    } else {
        let mut sum = 0.0;
        let mut sign = 1.0;
        for j in 1..=64u32 {
            let j = f64::from(j);
            let term = (-2.0 * j * j * lambda * lambda).exp();
            sum += sign * term;
            sign = -sign;
            if term < 1e-18 {
                break;
            }
        }
        2.0 * sum
    };
    q.clamp(0.0, 1.0)
}

/// Wasserstein-1 (earth mover's) distance between two empirical distributions:
/// ∫ |F₁(x) − F₂(x)| dx, integrated exactly between consecutive sample points.
/// Non-finite values are ignored; None when either side is then empty.
pub fn wasserstein_1(a: &[f64], b: &[f64]) -> Option<f64> {
    let a = sorted_finite(a);
    let b = sorted_finite(b);
    if a.is_empty() || b.is_empty() {
        return None;
    }
    let (n, m) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j) = (0usize, 0usize);
    let mut prev = a[0].min(b[0]);
    let mut total = 0.0f64;
    while i < a.len() || j < b.len() {
        let x = match (a.get(i), b.get(j)) {
            (Some(&p), Some(&q)) => p.min(q),
            (Some(&p), None) => p,
            (None, Some(&q)) => q,
            (None, None) => break,
        };
        let gap = (i as f64 / n - j as f64 / m).abs();
        // Skipping zero gaps keeps 0·∞ (values ±1e308 apart) from turning into NaN.
        if gap > 0.0 {
            total += gap * (x - prev);
        }
        prev = x;
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
    }
    Some(total)
}

fn sorted_finite(values: &[f64]) -> Vec<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Drift tier and what it asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriftTier {
    /// Below l2_from: record only.
    L1,
    /// From l2_from up to l3_above: pause and request a retrain.
    L2,
    /// Above l3_above: freeze the candidate at 0 % and open a review ticket.
    L3,
}

/// The tier of a drift score; NaN counts as the worst tier.
pub fn drift_tier(score: f64, settings: &DriftSettings) -> DriftTier {
    if score.is_nan() || score > settings.l3_above {
        DriftTier::L3
    } else if score >= settings.l2_from {
        DriftTier::L2
    } else {
        DriftTier::L1
    }
}

/// One feature's test against the reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FeatureDrift {
    /// None when either side had fewer than `min_drift_samples` values.
    pub ks: Option<KsTest>,
    /// p < ks_alpha: the statistic counts towards the drift score.
    pub significant: bool,
}

/// All drift evidence of one window, and the score and tier it adds up to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriftReport {
    /// max(ks_term, baseline_term, reference_term), in [0, 1].
    pub score: f64,
    pub tier: DriftTier,
    pub features: BTreeMap<String, FeatureDrift>,
    /// Largest KS statistic among significant features (0 if none).
    pub ks_term: f64,
    pub w1_vs_baseline: Option<f64>,
    pub w1_vs_reference: Option<f64>,
    /// min(1, W₁(candidate, baseline) / score_range).
    pub baseline_term: f64,
    /// min(1, W₁(candidate, reference) / score_range).
    pub reference_term: f64,
    /// The source design's composite score (absent until there is a reference). With
    /// `drift.method: composite` it decides `tier`; `score` stays the KS/Wasserstein
    /// one, which the semantic rollback reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub composite: Option<super::composite::CompositeDrift>,
}

/// Drift of the candidate in one window. A test with fewer than `min_samples` values on
/// either side is left out (its term is 0), so thin evidence never invents drift; the
/// evidence check decides separately whether the window is conclusive at all.
pub fn assess_drift(
    candidate: &StageSamples,
    baseline: &StageSamples,
    reference: Option<&ReferenceSample>,
    min_samples: u64,
    settings: &DriftSettings,
) -> DriftReport {
    let enough = |v: &[f64]| v.len() as u64 >= min_samples.max(1);
    let mut features = BTreeMap::new();
    let mut ks_term = 0.0f64;
    if let Some(reference) = reference {
        for (name, current) in &candidate.features {
            let past = reference
                .features
                .get(name)
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            let ks = (enough(current) && enough(past))
                .then(|| ks_two_sample(current, past))
                .flatten();
            let significant = ks.is_some_and(|k| k.p_value < settings.ks_alpha);
            if let Some(k) = ks.filter(|_| significant) {
                ks_term = ks_term.max(k.statistic);
            }
            features.insert(name.clone(), FeatureDrift { ks, significant });
        }
    }
    let distance = |other: &[f64]| {
        (enough(&candidate.scores) && enough(other))
            .then(|| wasserstein_1(&candidate.scores, other))
            .flatten()
    };
    let w1_vs_baseline = distance(&baseline.scores);
    let w1_vs_reference = reference.and_then(|r| distance(&r.scores));
    let term = |w: Option<f64>| w.map_or(0.0, |w| unit_or_worst(w / settings.score_range));
    let baseline_term = term(w1_vs_baseline);
    let reference_term = term(w1_vs_reference);
    let score = unit_or_worst(ks_term)
        .max(baseline_term)
        .max(reference_term);
    DriftReport {
        score,
        tier: drift_tier(score, settings),
        features,
        ks_term,
        w1_vs_baseline,
        w1_vs_reference,
        baseline_term,
        reference_term,
        composite: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ks_of_disjoint_and_identical_samples() {
        let k = ks_two_sample(&[1.0, 2.0, 3.0], &[4.0, 5.0]).expect("non-empty");
        assert_eq!(k.statistic, 1.0);
        let k = ks_two_sample(&[1.0, 2.0, 3.0], &[3.0, 1.0, 2.0]).expect("non-empty");
        assert_eq!(k.statistic, 0.0);
        assert_eq!(k.p_value, 1.0);
        assert!(ks_two_sample(&[], &[1.0]).is_none());
        assert!(ks_two_sample(&[f64::NAN], &[1.0]).is_none());
    }

    #[test]
    fn ks_ties_move_together() {
        // F₁ and F₂ at x = 1: 2/3 vs 1/2; at 2: 1 vs 1 → D = 1/6.
        let k = ks_two_sample(&[1.0, 1.0, 2.0], &[1.0, 2.0]).expect("non-empty");
        assert!((k.statistic - 1.0 / 6.0).abs() < 1e-15);
    }

    #[test]
    fn wasserstein_of_point_masses_is_their_distance() {
        assert_eq!(wasserstein_1(&[0.0], &[1.0]), Some(1.0));
        assert_eq!(wasserstein_1(&[2.0, 2.0], &[2.0]), Some(0.0));
        assert_eq!(wasserstein_1(&[], &[1.0]), None);
        let w = wasserstein_1(&[-1e308, 1e308], &[1e308]).expect("non-empty");
        assert!(!w.is_nan());
    }

    #[test]
    fn tiers_follow_the_thresholds() {
        let s = DriftSettings::default();
        assert_eq!(drift_tier(0.0, &s), DriftTier::L1);
        assert_eq!(drift_tier(0.1499, &s), DriftTier::L1);
        assert_eq!(drift_tier(0.15, &s), DriftTier::L2);
        assert_eq!(drift_tier(0.30, &s), DriftTier::L2);
        assert_eq!(drift_tier(0.3001, &s), DriftTier::L3);
        assert_eq!(drift_tier(f64::NAN, &s), DriftTier::L3);
    }
}

//! The source design's drift score, next to the KS/Wasserstein one of `drift.rs`: a
//! composite of KL divergence, Jensen–Shannon divergence and the population stability
//! index over a short window, a time-decayed Wasserstein distance over a long one, and
//! the escalation pattern (a score above 0.7 followed by one of at least 0.85 soon
//! after). `ANALYSIS.md` writes down the binning, the mapping to [0, 1] and how it relates
//! to the other score. Pure, like the rest of the analysis.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::metrics::{ReferenceSample, StageSamples};
use super::settings::CompositeSettings;
use super::unit_or_worst;

/// Probability mass given to an empty bin, so that no log divides by zero.
pub const EMPTY_BIN: f64 = 1e-4;

/// KL(p ‖ q) = Σ p ln(p/q), in nats.
pub fn kl_divergence(p: &[f64], q: &[f64]) -> f64 {
    p.iter()
        .zip(q)
        .filter(|(a, _)| **a > 0.0)
        .map(|(a, b)| a * (a / b).ln())
        .sum()
}

/// Jensen–Shannon divergence in bits (base 2), in [0, 1].
pub fn js_divergence(p: &[f64], q: &[f64]) -> f64 {
    let m: Vec<f64> = p.iter().zip(q).map(|(a, b)| (a + b) / 2.0).collect();
    (kl_divergence(p, &m) + kl_divergence(q, &m)) / 2.0 / std::f64::consts::LN_2
}

/// Population stability index Σ (p − q) ln(p/q).
pub fn psi(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(a, b)| (a - b) * (a / b).ln()).sum()
}

/// The current and the reference values as bin proportions over the reference's
/// quantile bins (`bins` of them; values outside the reference's range fall in the end
/// bins), each empty bin given [`EMPTY_BIN`] and the proportions renormalised. `None`
/// when either side has no finite value.
pub fn binned(current: &[f64], reference: &[f64], bins: usize) -> Option<(Vec<f64>, Vec<f64>)> {
    let mut r: Vec<f64> = reference
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .collect();
    let c: Vec<f64> = current.iter().copied().filter(|x| x.is_finite()).collect();
    if r.is_empty() || c.is_empty() || bins == 0 {
        return None;
    }
    r.sort_by(f64::total_cmp);
    // Inner edges at the reference's k/bins quantiles (nearest rank), duplicates merged.
    let mut edges: Vec<f64> = (1..bins)
        .map(|k| r[(k * r.len() / bins).min(r.len() - 1)])
        .collect();
    edges.dedup();
    let bin_of = |x: f64| edges.partition_point(|e| *e <= x);
    let proportions = |values: &[f64]| {
        let mut counts = vec![0f64; edges.len() + 1];
        for v in values {
            counts[bin_of(*v)] += 1.0;
        }
        let smoothed: Vec<f64> = counts
            .iter()
            .map(|c| (c / values.len() as f64).max(EMPTY_BIN))
            .collect();
        let total: f64 = smoothed.iter().sum();
        smoothed
            .into_iter()
            .map(|p| p / total)
            .collect::<Vec<f64>>()
    };
    Some((proportions(&c), proportions(&r)))
}

/// KL, JS and PSI of one series against the reference, and their composite in [0, 1].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeriesDrift {
    pub kl: f64,
    pub js: f64,
    pub psi: f64,
    /// (w_kl·(1 − e^−KL) + w_js·JS + w_psi·(1 − e^−PSI)) / Σw.
    pub composite: f64,
}

/// Weighted Wasserstein-1 between a weighted sample and a plain one: ∫ |F_w − F| dx.
pub fn wasserstein_1_weighted(weighted: &[(f64, f64)], plain: &[f64]) -> Option<f64> {
    let mut a: Vec<(f64, f64)> = weighted
        .iter()
        .copied()
        .filter(|(x, w)| x.is_finite() && w.is_finite() && *w > 0.0)
        .collect();
    let mut b: Vec<f64> = plain.iter().copied().filter(|x| x.is_finite()).collect();
    let total: f64 = a.iter().map(|(_, w)| w).sum();
    if a.is_empty() || b.is_empty() || total <= 0.0 {
        return None;
    }
    a.sort_by(|x, y| x.0.total_cmp(&y.0));
    b.sort_by(f64::total_cmp);
    let m = b.len() as f64;
    let (mut i, mut j) = (0usize, 0usize);
    let (mut fa, mut prev, mut sum) = (0.0f64, a[0].0.min(b[0]), 0.0f64);
    loop {
        let x = match (a.get(i), b.get(j)) {
            (Some(p), Some(q)) => p.0.min(*q),
            (Some(p), None) => p.0,
            (None, Some(q)) => *q,
            (None, None) => break,
        };
        let gap = (fa - j as f64 / m).abs();
        if gap > 0.0 {
            sum += gap * (x - prev);
        }
        prev = x;
        while i < a.len() && a[i].0 <= x {
            fa += a[i].1 / total;
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
    }
    Some(sum)
}

/// The candidate's scores of one closed window, thinned, for the long window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecentScores {
    pub end: DateTime<Utc>,
    pub scores: Vec<f64>,
}

/// Evenly spaced order statistics: at most `max` values with the same distribution.
pub fn thinned(values: &[f64], max: usize) -> Vec<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    sorted.sort_by(f64::total_cmp);
    if sorted.len() <= max || max == 0 {
        return sorted;
    }
    (0..max)
        .map(|k| sorted[k * (sorted.len() - 1) / (max - 1).max(1)])
        .collect()
}

/// The composite drift of one check.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompositeDrift {
    /// max over the series (scores and each feature) of the short window's composite.
    pub short: f64,
    /// min(1, time-decayed W₁(candidate scores of the long window, reference) / score_range).
    pub long: f64,
    /// max(short, long), in [0, 1].
    pub score: f64,
    /// Per series of the short window: `score` and each feature's name.
    pub series: BTreeMap<String, SeriesDrift>,
    /// Windows in the long window.
    pub long_windows: u64,
}

/// A score above `warn_above` followed within `within_ms` by one at or above
/// `escalate_at`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Escalation {
    pub first_at: DateTime<Utc>,
    pub first_score: f64,
    pub at: DateTime<Utc>,
    pub score: f64,
}

/// Computes the composite drift of the candidate's window `current` (ending at `end`)
/// against `reference`, with `recent` the earlier windows' scores (oldest first, this
/// window not among them). `None` without a reference or with too few values.
pub fn assess(
    current: &StageSamples,
    end: DateTime<Utc>,
    recent: &[RecentScores],
    reference: Option<&ReferenceSample>,
    min_samples: u64,
    score_range: f64,
    settings: &CompositeSettings,
) -> Option<CompositeDrift> {
    let reference = reference?;
    let enough = |v: &[f64]| v.len() as u64 >= min_samples.max(1);
    let mut series = BTreeMap::new();
    let mut pairs: Vec<(String, &[f64], &[f64])> =
        vec![("score".to_owned(), &current.scores, &reference.scores)];
    for (name, values) in &current.features {
        if let Some(past) = reference.features.get(name) {
            pairs.push((format!("feature:{name}"), values, past));
        }
    }
    for (name, now, past) in pairs {
        if !(enough(now) && enough(past)) {
            continue;
        }
        if let Some((p, q)) = binned(now, past, settings.bins) {
            let (kl, js, psi) = (kl_divergence(&p, &q), js_divergence(&p, &q), psi(&p, &q));
            let w = &settings.weights;
            let composite = unit_or_worst(
                (w.kl * (1.0 - (-kl).exp()) + w.js * js + w.psi * (1.0 - (-psi).exp()))
                    / (w.kl + w.js + w.psi),
            );
            series.insert(
                name,
                SeriesDrift {
                    kl,
                    js,
                    psi,
                    composite,
                },
            );
        }
    }
    let short = series.values().map(|s| s.composite).fold(0.0, f64::max);
    // The long window: this window and the earlier ones, each weighted by its age.
    let mut weighted: Vec<(f64, f64)> = Vec::new();
    let mut windows = 0u64;
    let mut add = |scores: &[f64], window_end: DateTime<Utc>| {
        let age_ms = (end - window_end).num_milliseconds().max(0) as f64;
        if age_ms <= settings.long_window_ms as f64 {
            let weight = 0.5f64.powf(age_ms / settings.half_life_ms as f64);
            let each = weight / scores.len().max(1) as f64;
            weighted.extend(scores.iter().map(|s| (*s, each)));
            windows += 1;
        }
    };
    add(&current.scores, end);
    for r in recent {
        add(&r.scores, r.end);
    }
    let long = (weighted.len() as u64 >= min_samples.max(1) && enough(&reference.scores))
        .then(|| wasserstein_1_weighted(&weighted, &reference.scores))
        .flatten()
        .map_or(0.0, |w| unit_or_worst(w / score_range));
    Some(CompositeDrift {
        short,
        long,
        score: short.max(long),
        series,
        long_windows: windows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divergences_of_a_two_bin_case_by_hand() {
        // p = (½, ½), q = (0.9, 0.1); values from Python's math.log.
        let (p, q) = ([0.5, 0.5], [0.9, 0.1]);
        assert!((kl_divergence(&p, &q) - 0.5108256237659907).abs() < 1e-15);
        assert!((js_divergence(&p, &q) - 0.14679310243605212).abs() < 1e-15);
        assert!((psi(&p, &q) - 0.8788898309344878).abs() < 1e-15);
        assert_eq!(kl_divergence(&p, &p), 0.0);
        assert_eq!(js_divergence(&q, &q), 0.0);
        // JS is symmetric and at most 1 bit, reached by disjoint distributions.
        assert!((js_divergence(&q, &p) - js_divergence(&p, &q)).abs() < 1e-15);
        assert!((js_divergence(&[1.0, 0.0], &[0.0, 1.0]) - 1.0).abs() < 1e-15);
    }

    #[test]
    fn bins_are_the_references_quantiles() {
        let reference: Vec<f64> = (0..100).map(f64::from).collect();
        let (p, q) = binned(&reference, &reference, 10).expect("values");
        assert_eq!(p.len(), 10);
        assert!(p.iter().zip(&q).all(|(a, b)| (a - b).abs() < 1e-15));
        assert!(q.iter().all(|b| (b - 0.1).abs() < 1e-12));
        // Everything above the reference lands in the last bin.
        let (p, _) = binned(&[500.0, 600.0], &reference, 10).expect("values");
        assert!(p[9] > 0.99 && p[..9].iter().all(|b| *b < 1e-3));
    }

    #[test]
    fn weighted_wasserstein_with_equal_weights_is_the_plain_one() {
        let a = [0.0, 1.0, 3.0];
        let b = [5.0, 6.0, 8.0];
        let weighted: Vec<(f64, f64)> = a.iter().map(|x| (*x, 2.0)).collect();
        // scipy.stats.wasserstein_distance([0, 1, 3], [5, 6, 8]) = 5.
        assert!((wasserstein_1_weighted(&weighted, &b).expect("values") - 5.0).abs() < 1e-12);
        // A weight of 3:1 on 0 and 4 against a point at 0: ¼ of the mass moved 4.
        let w = wasserstein_1_weighted(&[(0.0, 3.0), (4.0, 1.0)], &[0.0]).expect("values");
        assert!((w - 1.0).abs() < 1e-12);
    }

    #[test]
    fn thinning_keeps_the_ends_and_the_count() {
        let values: Vec<f64> = (0..1000).map(f64::from).collect();
        let t = thinned(&values, 101);
        assert_eq!(t.len(), 101);
        assert_eq!((t[0], t[100]), (0.0, 999.0));
        assert_eq!(thinned(&[3.0, 1.0], 10), vec![1.0, 3.0]);
    }
}

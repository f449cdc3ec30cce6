//! A/B significance over a rollout's windows: each golden metric of the candidate paired
//! with the baseline's in the same window, judged by the Wilcoxon signed-rank test (no
//! normality assumed) and sized by Cliff's delta (so a tiny but consistent difference is
//! not read as a large one), as the gray-release protocol asks. Pure, like the rest of
//! the analysis; `ANALYSIS.md` writes down the rules and their sources.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::metrics::{StageMetrics, WindowMetrics};
use super::settings::SignificanceSettings;

/// The per-stage golden metrics one window contributes to the paired tests.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GoldenMetrics {
    pub latency_p99_us: f64,
    pub error_rate: f64,
    pub mean_confidence: f64,
    pub compliance_miss_rate: f64,
}

impl From<&StageMetrics> for GoldenMetrics {
    fn from(m: &StageMetrics) -> Self {
        GoldenMetrics {
            latency_p99_us: m.latency_p99_us as f64,
            error_rate: m.error_rate,
            mean_confidence: m.mean_confidence,
            compliance_miss_rate: m.compliance_miss_rate,
        }
    }
}

/// One conclusive window's golden metrics of both stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairedWindow {
    pub end: DateTime<Utc>,
    pub baseline: GoldenMetrics,
    pub candidate: GoldenMetrics,
}

impl From<&WindowMetrics> for PairedWindow {
    fn from(m: &WindowMetrics) -> Self {
        PairedWindow {
            end: m.end,
            baseline: GoldenMetrics::from(&m.baseline),
            candidate: GoldenMetrics::from(&m.candidate),
        }
    }
}

/// A golden metric and the direction in which it gets worse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GoldenMetric {
    LatencyP99Us,
    ErrorRate,
    MeanConfidence,
    ComplianceMissRate,
}

impl GoldenMetric {
    pub const ALL: [GoldenMetric; 4] = [
        GoldenMetric::LatencyP99Us,
        GoldenMetric::ErrorRate,
        GoldenMetric::MeanConfidence,
        GoldenMetric::ComplianceMissRate,
    ];

    fn of(self, m: &GoldenMetrics) -> f64 {
        match self {
            GoldenMetric::LatencyP99Us => m.latency_p99_us,
            GoldenMetric::ErrorRate => m.error_rate,
            GoldenMetric::MeanConfidence => m.mean_confidence,
            GoldenMetric::ComplianceMissRate => m.compliance_miss_rate,
        }
    }

    /// Whether a higher value is worse (latency, errors, misses) or a lower one
    /// (confidence).
    pub fn higher_is_worse(self) -> bool {
        !matches!(self, GoldenMetric::MeanConfidence)
    }
}

/// How a Wilcoxon p-value was computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PMethod {
    /// The exact null distribution of W⁺ (no ties among |d|, n ≤ 50).
    Exact,
    /// The normal approximation with the tie correction of the variance, no continuity
    /// correction.
    Normal,
}

/// The Wilcoxon signed-rank test of paired differences d = candidate − baseline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Wilcoxon {
    /// Pairs whose difference is not zero (zeros are dropped, Wilcoxon's own rule).
    pub n: u64,
    pub zeros: u64,
    /// Sum of the ranks of |d| over positive differences.
    pub w_plus: f64,
    pub w_minus: f64,
    /// min(W⁺, W⁻), the two-sided statistic.
    pub statistic: f64,
    pub p_two_sided: f64,
    /// P(W⁺ ≥ observed) under H₀: small when the candidate is above the baseline.
    pub p_greater: f64,
    /// P(W⁺ ≤ observed) under H₀: small when the candidate is below the baseline.
    pub p_less: f64,
    pub method: PMethod,
}

/// Largest n for which the exact distribution is used (as SciPy's `method="auto"`).
pub const EXACT_MAX_N: usize = 50;

/// The Wilcoxon signed-rank test; `None` when every difference is zero (or none is
/// finite): there is nothing to rank.
pub fn wilcoxon_signed_rank(differences: &[f64]) -> Option<Wilcoxon> {
    let zeros = differences.iter().filter(|d| **d == 0.0).count() as u64;
    let mut d: Vec<f64> = differences
        .iter()
        .copied()
        .filter(|d| d.is_finite() && *d != 0.0)
        .collect();
    if d.is_empty() {
        return None;
    }
    d.sort_by(|a, b| a.abs().total_cmp(&b.abs()));
    let n = d.len();
    // Average ranks of |d|, and the tie groups' sizes for the variance correction.
    let mut ranks = vec![0.0; n];
    let mut tie_term = 0.0;
    let mut i = 0;
    while i < n {
        let mut j = i + 1;
        while j < n && d[j].abs() == d[i].abs() {
            j += 1;
        }
        let rank = (i + j + 1) as f64 / 2.0; // mean of ranks i+1 ..= j
        ranks[i..j].iter_mut().for_each(|r| *r = rank);
        let t = (j - i) as f64;
        tie_term += t * t * t - t;
        i = j;
    }
    let w_plus: f64 = d
        .iter()
        .zip(&ranks)
        .filter(|(d, _)| **d > 0.0)
        .map(|(_, r)| r)
        .sum();
    let total = (n * (n + 1)) as f64 / 2.0;
    let w_minus = total - w_plus;
    let (p_greater, p_less, method) = if n <= EXACT_MAX_N && tie_term == 0.0 {
        let (greater, less) = exact_tails(n, w_plus.round() as usize);
        (greater, less, PMethod::Exact)
    } else {
        let nf = n as f64;
        let mean = nf * (nf + 1.0) / 4.0;
        let var = nf * (nf + 1.0) * (2.0 * nf + 1.0) / 24.0 - tie_term / 48.0;
        let z = (w_plus - mean) / var.sqrt();
        (upper_normal(z), upper_normal(-z), PMethod::Normal)
    };
    Some(Wilcoxon {
        n: n as u64,
        zeros,
        w_plus,
        w_minus,
        statistic: w_plus.min(w_minus),
        p_two_sided: (2.0 * p_greater.min(p_less)).min(1.0),
        p_greater,
        p_less,
        method,
    })
}

/// P(W⁺ ≥ w) and P(W⁺ ≤ w) under H₀, from the number of subsets of {1, …, n} with each
/// sum (each rank's sign is a fair coin). Counts stay below 2⁵⁰, exact in u64.
fn exact_tails(n: usize, w: usize) -> (f64, f64) {
    let max = n * (n + 1) / 2;
    let mut counts = vec![0u64; max + 1];
    counts[0] = 1;
    for rank in 1..=n {
        for sum in (rank..=max).rev() {
            counts[sum] += counts[sum - rank];
        }
    }
    let all = 2f64.powi(n as i32);
    let w = w.min(max);
    let at_least: u64 = counts[w..].iter().sum();
    let at_most: u64 = counts[..=w].iter().sum();
    (at_least as f64 / all, at_most as f64 / all)
}

/// 1 − Φ(z), the standard normal's upper tail.
fn upper_normal(z: f64) -> f64 {
    0.5 * libm::erfc(z / std::f64::consts::SQRT_2)
}

/// Cliff's delta's conventional size (Romano et al., 2006: 0.147, 0.33, 0.474).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Magnitude {
    Negligible,
    Small,
    Medium,
    Large,
}

/// Cliff's delta of x against y: P(x > y) − P(x < y) over all pairs, in [−1, 1].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CliffsDelta {
    pub delta: f64,
    pub magnitude: Magnitude,
}

/// Cliff's delta; `None` when either side is empty.
pub fn cliffs_delta(x: &[f64], y: &[f64]) -> Option<CliffsDelta> {
    if x.is_empty() || y.is_empty() {
        return None;
    }
    let mut above = 0i64;
    let mut below = 0i64;
    for a in x {
        for b in y {
            match a.partial_cmp(b) {
                Some(std::cmp::Ordering::Greater) => above += 1,
                Some(std::cmp::Ordering::Less) => below += 1,
                _ => {}
            }
        }
    }
    let delta = (above - below) as f64 / (x.len() * y.len()) as f64;
    Some(CliffsDelta {
        delta,
        magnitude: magnitude(delta),
    })
}

pub fn magnitude(delta: f64) -> Magnitude {
    match delta.abs() {
        d if d < 0.147 => Magnitude::Negligible,
        d if d < 0.33 => Magnitude::Small,
        d if d < 0.474 => Magnitude::Medium,
        _ => Magnitude::Large,
    }
}

/// One golden metric of the candidate against the baseline over the kept windows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricComparison {
    pub metric: GoldenMetric,
    pub higher_is_worse: bool,
    /// Paired windows compared.
    pub windows: u64,
    /// Median of candidate − baseline over the windows.
    pub median_difference: f64,
    /// Absent when every difference is zero or the windows are fewer than
    /// `significance.min_windows`.
    pub wilcoxon: Option<Wilcoxon>,
    /// One-sided p-value of "the candidate is worse" (the tail in the metric's worse
    /// direction).
    pub p_worse: Option<f64>,
    /// Cliff's delta of the candidate's values against the baseline's.
    pub cliffs_delta: Option<CliffsDelta>,
    /// p_worse < alpha.
    pub significantly_worse: bool,
}

/// The A/B comparison of one check: every golden metric over the kept windows.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Significance {
    pub alpha: f64,
    pub windows: u64,
    pub comparisons: Vec<MetricComparison>,
}

impl Significance {
    /// The metrics on which the candidate is significantly worse.
    pub fn worse(&self) -> Vec<GoldenMetric> {
        self.comparisons
            .iter()
            .filter(|c| c.significantly_worse)
            .map(|c| c.metric)
            .collect()
    }
}

/// Compares the candidate with the baseline over `windows` (oldest first).
pub fn compare(windows: &[PairedWindow], settings: &SignificanceSettings) -> Significance {
    let comparisons = GoldenMetric::ALL
        .iter()
        .map(|&metric| {
            let candidate: Vec<f64> = windows.iter().map(|w| metric.of(&w.candidate)).collect();
            let baseline: Vec<f64> = windows.iter().map(|w| metric.of(&w.baseline)).collect();
            let differences: Vec<f64> = candidate
                .iter()
                .zip(&baseline)
                .map(|(c, b)| c - b)
                .collect();
            let enough = windows.len() as u64 >= settings.min_windows;
            let wilcoxon = enough.then(|| wilcoxon_signed_rank(&differences)).flatten();
            let p_worse = wilcoxon.as_ref().map(|w| {
                if metric.higher_is_worse() {
                    w.p_greater
                } else {
                    w.p_less
                }
            });
            MetricComparison {
                metric,
                higher_is_worse: metric.higher_is_worse(),
                windows: windows.len() as u64,
                median_difference: median(&differences),
                significantly_worse: p_worse.is_some_and(|p| p < settings.alpha),
                wilcoxon,
                p_worse,
                cliffs_delta: cliffs_delta(&candidate, &baseline),
            }
        })
        .collect();
    Significance {
        alpha: settings.alpha,
        windows: windows.len() as u64,
        comparisons,
    }
}

fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SciPy's `scipy.stats.wilcoxon` documentation: Fisher's differences in height of
    /// cross- and self-fertilised Zea mays (15 pairs).
    const FISHER: [f64; 15] = [
        6.0, 8.0, 14.0, 16.0, 23.0, 24.0, 28.0, 29.0, 41.0, -48.0, 49.0, 56.0, 60.0, -67.0, 75.0,
    ];

    #[test]
    fn exact_two_sided_and_one_sided_match_scipys_documented_values() {
        let w = wilcoxon_signed_rank(&FISHER).expect("non-zero differences");
        assert_eq!(w.method, PMethod::Exact);
        assert_eq!(w.statistic, 24.0);
        assert_eq!(w.w_plus, 96.0);
        // wilcoxon(d) → pvalue=0.041259765625; alternative='greater' → 0.020629882812...
        assert_eq!(w.p_two_sided, 0.041259765625);
        assert_eq!(w.p_greater, 0.0206298828125);
        assert!(w.p_less > 0.97);
    }

    #[test]
    fn the_normal_approximation_matches_scipys_approx_method() {
        // Ties force the normal approximation: the same data with one |d| repeated.
        let mut d = FISHER.to_vec();
        d.push(6.0);
        let w = wilcoxon_signed_rank(&d).expect("non-zero differences");
        assert_eq!(w.method, PMethod::Normal);
        // By hand: n = 16, ranks 1.5, 1.5, 3, …; W⁻ = 11 + 15 = 26, W⁺ = 136 − 26 = 110;
        // mean 68, var 16·17·33/24 − (8 − 2)/48 = 373.875; z = 42 / √373.875.
        assert_eq!(w.w_minus, 26.0);
        let z = 42.0 / 373.875f64.sqrt();
        let expected = 0.5 * libm::erfc(z / std::f64::consts::SQRT_2);
        assert!((w.p_greater - expected).abs() < 1e-15);
        // And SciPy's documented figure for method='approx' on the untied data:
        // wilcoxon(d, method='approx') → pvalue=0.04088813291185591.
        let untied = normal_two_sided(&FISHER);
        assert!((untied - 0.04088813291185591).abs() < 1e-12, "{untied}");
    }

    /// The normal approximation on data the exact rule would take, for the reference.
    fn normal_two_sided(d: &[f64]) -> f64 {
        let n = d.len() as f64;
        let w = wilcoxon_signed_rank(d).expect("data");
        let z =
            (w.statistic - n * (n + 1.0) / 4.0) / (n * (n + 1.0) * (2.0 * n + 1.0) / 24.0).sqrt();
        2.0 * upper_normal(z.abs())
    }

    #[test]
    fn zeros_are_dropped_and_all_zero_is_no_test() {
        assert_eq!(wilcoxon_signed_rank(&[0.0, 0.0]), None);
        let w = wilcoxon_signed_rank(&[0.0, 1.0, 2.0, 3.0]).expect("three non-zero");
        assert_eq!((w.n, w.zeros), (3, 1));
        // All three positive: P(W⁺ ≥ 6) = 1/8.
        assert_eq!(w.p_greater, 0.125);
        assert_eq!(w.p_two_sided, 0.25);
    }

    #[test]
    fn exact_distribution_sums_to_one_at_the_largest_exact_n() {
        let (greater, less) = exact_tails(EXACT_MAX_N, 0);
        assert_eq!(greater, 1.0);
        assert_eq!(less, 2f64.powi(-(EXACT_MAX_N as i32)));
    }

    #[test]
    fn cliffs_delta_by_hand() {
        // x = 1, 2, 3 against y = 2, 3, 4: one pair above (3 > 2), six below, two equal.
        let d = cliffs_delta(&[1.0, 2.0, 3.0], &[2.0, 3.0, 4.0]).expect("both sides");
        assert!((d.delta - (-5.0 / 9.0)).abs() < 1e-15);
        assert_eq!(d.magnitude, Magnitude::Large);
        let d = cliffs_delta(&[10.0, 20.0], &[1.0, 2.0]).expect("both sides");
        assert_eq!(d.delta, 1.0);
        let d = cliffs_delta(&[1.0, 2.0, 3.0, 4.0], &[1.0, 2.0, 3.0, 4.0]).expect("both sides");
        assert_eq!(d.delta, 0.0);
        assert_eq!(d.magnitude, Magnitude::Negligible);
        assert_eq!(magnitude(0.2), Magnitude::Small);
        assert_eq!(magnitude(-0.4), Magnitude::Medium);
        assert_eq!(cliffs_delta(&[], &[1.0]), None);
    }

    fn window(i: i64, candidate_p99: f64, candidate_confidence: f64) -> PairedWindow {
        let base = GoldenMetrics {
            latency_p99_us: 100_000.0,
            error_rate: 0.0,
            mean_confidence: 0.9,
            compliance_miss_rate: 0.0,
        };
        PairedWindow {
            end: DateTime::from_timestamp(i * 60, 0).expect("time"),
            baseline: base,
            candidate: GoldenMetrics {
                latency_p99_us: candidate_p99,
                mean_confidence: candidate_confidence,
                ..base
            },
        }
    }

    #[test]
    fn a_consistently_slower_candidate_is_significantly_worse_on_latency_only() {
        let windows: Vec<_> = (0..8)
            .map(|i| window(i, 120_000.0 + i as f64, 0.95))
            .collect();
        let s = compare(&windows, &SignificanceSettings::default());
        assert_eq!(s.worse(), vec![GoldenMetric::LatencyP99Us]);
        let latency = &s.comparisons[0];
        // Eight positive differences: P(W⁺ ≥ 36) = 1/256.
        assert_eq!(latency.p_worse, Some(1.0 / 256.0));
        assert_eq!(latency.cliffs_delta.as_ref().map(|d| d.delta), Some(1.0));
        // Higher confidence is better: its one-sided "worse" p is large.
        let confidence = &s.comparisons[2];
        assert!(confidence.p_worse.is_some_and(|p| p > 0.9));
        // Equal error rates: no test, not worse.
        assert_eq!(s.comparisons[1].wilcoxon, None);
    }

    #[test]
    fn too_few_windows_are_never_significant() {
        let windows: Vec<_> = (0..3).map(|i| window(i, 200_000.0, 0.5)).collect();
        let s = compare(&windows, &SignificanceSettings::default());
        assert!(s.worse().is_empty());
        assert!(s.comparisons.iter().all(|c| c.wilcoxon.is_none()));
        // The effect size is still reported.
        assert_eq!(
            s.comparisons[0].cliffs_delta.as_ref().map(|d| d.delta),
            Some(1.0)
        );
    }
}

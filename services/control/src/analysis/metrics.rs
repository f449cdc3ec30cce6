//! Golden metrics per stage per window, from what the gateway observes per request and
//! what workers report per batch.
//!
//! Latency percentiles are exact (nearest rank over the sorted window), not from a
//! histogram: a decision such as "p99 > 420 ms" must be reproducible from the recorded
//! observations to the microsecond, and a histogram bucket (hdrhistogram's is ±0.1 % at
//! three significant digits, 256 µs wide near 420 ms) could move a value across the
//! bound. The samples are kept anyway for the drift tests, so the cost is one sort.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};

use super::settings::{SettingsError, WindowSettings};

/// Which model produced an observation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Baseline,
    Candidate,
}

/// One request scored by one stage (live or shadow), as the gateway saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestObservation {
    pub request_id: String,
    pub stage: Stage,
    pub latency_us: u64,
    /// The stage failed to answer; the request counts for latency and error rate only.
    pub error: bool,
    pub score: f64,
    /// The model's confidence in its decision, in [0, 1].
    pub confidence: f64,
    /// The model would hold (flag) the trade.
    pub flagged: bool,
    /// The compliance rules flagged the trade.
    pub rules_flagged: bool,
    /// Input features, for drift; may be empty.
    #[serde(default)]
    pub features: BTreeMap<String, f64>,
    /// A shadow score (the stage did not decide the request): counts as evidence and for
    /// agreement, confidence and drift, but not for latency or error rate, which only
    /// live answers measure.
    #[serde(default)]
    pub shadow: bool,
    pub at: DateTime<Utc>,
}

/// One batch a worker ran, as it reported it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchReport {
    pub stage: Stage,
    pub batch_size: u32,
    pub max_batch: u32,
    /// Requests waiting at the worker when the batch started.
    pub queue_depth: u32,
    pub elapsed_us: u64,
    pub at: DateTime<Utc>,
}

/// Why an observation was refused (nothing was recorded).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ObservationError {
    #[error("request {request_id}: {field} must be a finite number, got {value}")]
    NonFinite {
        request_id: String,
        field: String,
        value: f64,
    },
    #[error("request {request_id}: confidence must be in [0, 1], got {value}")]
    ConfidenceOutOfRange { request_id: String, value: f64 },
    #[error("batch report: max_batch must be at least 1")]
    ZeroCapacity,
    #[error("batch report: batch_size {batch_size} exceeds max_batch {max_batch}")]
    Overfull { batch_size: u32, max_batch: u32 },
    #[error(
        "observation at {at} is before the open window starting {open_from}; it was not counted"
    )]
    Late {
        at: DateTime<Utc>,
        open_from: DateTime<Utc>,
    },
    #[error(transparent)]
    Settings(#[from] SettingsError),
}

/// One batch report, as kept in a window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BatchSample {
    pub batch_size: u32,
    pub max_batch: u32,
    pub queue_depth: u32,
    pub elapsed_us: u64,
}

/// Everything one stage produced in one window: the raw material of its metrics and of
/// the drift tests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageSamples {
    pub requests: u64,
    /// Of `requests`, shadow scores.
    #[serde(default)]
    pub shadow: u64,
    pub errors: u64,
    pub latencies_us: Vec<u64>,
    /// Scores of answered (non-error) requests.
    pub scores: Vec<f64>,
    /// Confidences of answered requests.
    pub confidences: Vec<f64>,
    /// Request ids answered by this stage.
    pub scored_ids: BTreeSet<String>,
    /// Request ids this stage flagged.
    pub flagged_ids: BTreeSet<String>,
    pub rules_flagged: u64,
    /// Answered requests the rules flagged but this stage would have cleared.
    pub compliance_misses: u64,
    pub features: BTreeMap<String, Vec<f64>>,
    pub batches: Vec<BatchSample>,
}

impl StageSamples {
    fn add_request(&mut self, o: RequestObservation) {
        self.requests += 1;
        if o.shadow {
            self.shadow += 1;
        } else {
            self.latencies_us.push(o.latency_us);
        }
        if o.error {
            // A shadow that failed says nothing of the stage's live error rate.
            self.errors += u64::from(!o.shadow);
            return;
        }
        self.scores.push(o.score);
        self.confidences.push(o.confidence);
        if o.rules_flagged {
            self.rules_flagged += 1;
            if !o.flagged {
                self.compliance_misses += 1;
            }
        }
        for (name, value) in o.features {
            self.features.entry(name).or_default().push(value);
        }
        if o.flagged {
            self.flagged_ids.insert(o.request_id.clone());
        }
        self.scored_ids.insert(o.request_id);
    }

    /// Adds what another node saw of this stage in the same window: counts add up,
    /// samples and id sets join.
    pub fn merge(&mut self, other: StageSamples) {
        self.requests += other.requests;
        self.shadow += other.shadow;
        self.errors += other.errors;
        self.latencies_us.extend(other.latencies_us);
        self.scores.extend(other.scores);
        self.confidences.extend(other.confidences);
        self.scored_ids.extend(other.scored_ids);
        self.flagged_ids.extend(other.flagged_ids);
        self.rules_flagged += other.rules_flagged;
        self.compliance_misses += other.compliance_misses;
        for (name, values) in other.features {
            self.features.entry(name).or_default().extend(values);
        }
        self.batches.extend(other.batches);
    }

    /// Bounds each series to `max` values, keeping the counts exact: evenly spaced order
    /// statistics, the same distribution for percentiles, KS and Wasserstein.
    fn thin_values(&mut self, max: usize) {
        thin_u64(&mut self.latencies_us, max);
        thin_f64(&mut self.scores, max);
        thin_f64(&mut self.confidences, max);
        for values in self.features.values_mut() {
            thin_f64(values, max);
        }
        if self.batches.len() > max {
            let n = self.batches.len();
            self.batches = (0..max)
                .map(|i| self.batches[i * (n - 1) / (max - 1).max(1)].clone())
                .collect();
        }
    }

    fn sample_count(&self) -> usize {
        self.latencies_us.len()
            + self.scores.len()
            + self.confidences.len()
            + self.features.values().map(Vec::len).sum::<usize>()
            + self.batches.len()
            + self.scored_ids.len()
            + self.flagged_ids.len()
    }

    /// The golden metrics of this stage; `settings` says when a queue is full.
    pub fn metrics(&self, settings: &WindowSettings) -> StageMetrics {
        let mut sorted = self.latencies_us.clone();
        sorted.sort_unstable();
        let answered = self.scores.len() as u64;
        let (mut items, mut capacity, mut queue_fill, mut depth) = (0u64, 0u64, 0.0, 0.0);
        for b in &self.batches {
            items += u64::from(b.batch_size);
            capacity += u64::from(b.max_batch);
            let full_queue = f64::from(b.max_batch) * settings.saturated_queue_batches;
            queue_fill += (f64::from(b.queue_depth) / full_queue).min(1.0);
            depth += f64::from(b.queue_depth);
        }
        let n_batches = self.batches.len() as f64;
        let batch_fill = ratio(items, capacity);
        let queue_fill = if self.batches.is_empty() {
            0.0
        } else {
            queue_fill / n_batches
        };
        StageMetrics {
            requests: self.requests,
            errors: self.errors,
            error_rate: ratio(self.errors, self.requests - self.shadow),
            latency_p50_us: nearest_rank(&sorted, 500),
            latency_p95_us: nearest_rank(&sorted, 950),
            latency_p99_us: nearest_rank(&sorted, 990),
            answered,
            mean_confidence: mean(&self.confidences),
            rules_flagged: self.rules_flagged,
            compliance_misses: self.compliance_misses,
            compliance_miss_rate: ratio(self.compliance_misses, self.rules_flagged),
            batches: self.batches.len() as u64,
            batch_fill,
            queue_fill,
            saturation: batch_fill.max(queue_fill),
            mean_queue_depth: if self.batches.is_empty() {
                0.0
            } else {
                depth / n_batches
            },
        }
    }
}

/// Golden metrics of one stage in one window. Every ratio with an empty denominator is
/// 0, never NaN; the counts beside it say how much evidence there was.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageMetrics {
    pub requests: u64,
    pub errors: u64,
    pub error_rate: f64,
    pub latency_p50_us: u64,
    pub latency_p95_us: u64,
    pub latency_p99_us: u64,
    /// Non-error requests (the denominator of mean confidence).
    pub answered: u64,
    pub mean_confidence: f64,
    pub rules_flagged: u64,
    pub compliance_misses: u64,
    /// compliance_misses / rules_flagged.
    pub compliance_miss_rate: f64,
    pub batches: u64,
    /// Σ batch_size / Σ max_batch.
    pub batch_fill: f64,
    /// Mean over batches of min(1, queue_depth / (max_batch · saturated_queue_batches)).
    pub queue_fill: f64,
    /// max(batch_fill, queue_fill), in [0, 1].
    pub saturation: f64,
    pub mean_queue_depth: f64,
}

/// Agreement of candidate and baseline on the requests both scored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Agreement {
    /// |C ∩ B| / |C ∪ B| over the flagged sets restricted to the shadow sample; 1 when
    /// both are empty (the models agree that nothing is suspicious).
    pub jaccard: f64,
    /// Requests answered by both stages.
    pub shadow_sample: u64,
    pub candidate_flagged: u64,
    pub baseline_flagged: u64,
    pub both_flagged: u64,
}

/// The golden metrics of one window, both stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowMetrics {
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
    pub baseline: StageMetrics,
    pub candidate: StageMetrics,
    pub agreement: Agreement,
}

/// One closed (or hand-built) window of samples for both stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowSamples {
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
    pub baseline: StageSamples,
    pub candidate: StageSamples,
}

impl WindowSamples {
    pub fn new(start: DateTime<Utc>, end: DateTime<Utc>) -> Self {
        WindowSamples {
            start,
            end,
            baseline: StageSamples::default(),
            candidate: StageSamples::default(),
        }
    }

    pub fn stage(&self, stage: Stage) -> &StageSamples {
        match stage {
            Stage::Baseline => &self.baseline,
            Stage::Candidate => &self.candidate,
        }
    }

    fn stage_mut(&mut self, stage: Stage) -> &mut StageSamples {
        match stage {
            Stage::Baseline => &mut self.baseline,
            Stage::Candidate => &mut self.candidate,
        }
    }

    /// Adds what another node saw in the same window.
    pub fn merge(&mut self, other: WindowSamples) {
        self.baseline.merge(other.baseline);
        self.candidate.merge(other.candidate);
    }

    /// Bounds the samples to `max` values per series and about `max` request ids per
    /// stage, keeping the counts exact: series become evenly spaced order statistics, ids a
    /// deterministic subset chosen by each id's SM3, the same for both stages, so their
    /// agreement is still measured on common requests. Returns whether anything was dropped.
    pub fn thin(&mut self, max: usize) -> bool {
        let before = self.baseline.sample_count() + self.candidate.sample_count();
        self.baseline.thin_values(max);
        self.candidate.thin_values(max);
        let ids = self
            .baseline
            .scored_ids
            .len()
            .max(self.candidate.scored_ids.len());
        if ids > max {
            // The same threshold for both stages, so their common requests stay common.
            let keep = id_sampler(ids, max);
            for stage in [&mut self.baseline, &mut self.candidate] {
                stage.scored_ids.retain(|id| keep(id));
                stage.flagged_ids.retain(|id| keep(id));
            }
        }
        self.baseline.sample_count() + self.candidate.sample_count() < before
    }

    /// Adds one request after checking it; the window's time bounds are the caller's
    /// business (the aggregator checks them).
    pub fn add_request(&mut self, o: RequestObservation) -> Result<(), ObservationError> {
        validate_request(&o)?;
        self.stage_mut(o.stage).add_request(o);
        Ok(())
    }

    pub fn add_batch(&mut self, b: BatchReport) -> Result<(), ObservationError> {
        validate_batch(&b)?;
        self.stage_mut(b.stage).batches.push(BatchSample {
            batch_size: b.batch_size,
            max_batch: b.max_batch,
            queue_depth: b.queue_depth,
            elapsed_us: b.elapsed_us,
        });
        Ok(())
    }

    pub fn metrics(&self, settings: &WindowSettings) -> WindowMetrics {
        let shadow: BTreeSet<&String> = self
            .candidate
            .scored_ids
            .intersection(&self.baseline.scored_ids)
            .collect();
        let cand: BTreeSet<&String> = self
            .candidate
            .flagged_ids
            .iter()
            .filter(|id| shadow.contains(id))
            .collect();
        let base: BTreeSet<&String> = self
            .baseline
            .flagged_ids
            .iter()
            .filter(|id| shadow.contains(id))
            .collect();
        WindowMetrics {
            start: self.start,
            end: self.end,
            baseline: self.baseline.metrics(settings),
            candidate: self.candidate.metrics(settings),
            agreement: Agreement {
                jaccard: jaccard(&cand, &base),
                shadow_sample: shadow.len() as u64,
                candidate_flagged: cand.len() as u64,
                baseline_flagged: base.len() as u64,
                both_flagged: cand.intersection(&base).count() as u64,
            },
        }
    }
}

/// Jaccard index |A ∩ B| / |A ∪ B|; two empty sets agree perfectly (1).
pub fn jaccard<T: Ord>(a: &BTreeSet<T>, b: &BTreeSet<T>) -> f64 {
    let both = a.intersection(b).count();
    let either = a.len() + b.len() - both;
    if either == 0 {
        1.0
    } else {
        both as f64 / either as f64
    }
}

/// Nearest-rank percentile of sorted values: the value at rank ⌈q·n⌉ (q in per mille);
/// 0 for an empty window, whose evidence check fails anyway.
pub fn nearest_rank(sorted: &[u64], per_mille: u64) -> u64 {
    let n = sorted.len() as u64;
    if n == 0 {
        return 0;
    }
    let rank = (per_mille.min(1000) * n).div_ceil(1000).max(1);
    sorted[(rank - 1) as usize]
}

/// Mean with Neumaier-compensated summation, so that a hundred confidences of 0.82 average
/// to 0.82 and not to 0.8199999999999998, which would breach a `< 0.82` bound. 0 when empty.
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let (mut sum, mut carry) = (0.0f64, 0.0f64);
    for &x in values {
        let t = sum + x;
        carry += if sum.abs() >= x.abs() {
            (sum - t) + x
        } else {
            (x - t) + sum
        };
        sum = t;
    }
    (sum + carry) / values.len() as f64
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

fn validate_request(o: &RequestObservation) -> Result<(), ObservationError> {
    let non_finite = |field: &str, value: f64| ObservationError::NonFinite {
        request_id: o.request_id.clone(),
        field: field.to_owned(),
        value,
    };
    if !o.score.is_finite() {
        return Err(non_finite("score", o.score));
    }
    if !o.confidence.is_finite() {
        return Err(non_finite("confidence", o.confidence));
    }
    if !(0.0..=1.0).contains(&o.confidence) {
        return Err(ObservationError::ConfidenceOutOfRange {
            request_id: o.request_id.clone(),
            value: o.confidence,
        });
    }
    if let Some((name, value)) = o.features.iter().find(|(_, v)| !v.is_finite()) {
        return Err(non_finite(&format!("features.{name}"), *value));
    }
    Ok(())
}

fn validate_batch(b: &BatchReport) -> Result<(), ObservationError> {
    if b.max_batch == 0 {
        return Err(ObservationError::ZeroCapacity);
    }
    if b.batch_size > b.max_batch {
        return Err(ObservationError::Overfull {
            batch_size: b.batch_size,
            max_batch: b.max_batch,
        });
    }
    Ok(())
}

/// Cuts observations into fixed windows `[origin + k·len, origin + (k+1)·len)` and hands
/// them out once the injected clock has passed their end. Observations may arrive out of
/// order within open windows; one for an already closed window is refused (`Late`).
#[derive(Clone, Debug)]
pub struct WindowAggregator {
    origin: DateTime<Utc>,
    length_ms: i64,
    /// First window index not yet closed.
    next_index: i64,
    open: BTreeMap<i64, WindowSamples>,
}

impl WindowAggregator {
    pub fn new(origin: DateTime<Utc>, settings: &WindowSettings) -> Result<Self, ObservationError> {
        if settings.length_ms < 1000 {
            return Err(SettingsError::WindowTooShort(settings.length_ms).into());
        }
        // Longer than ~292 million years is not a window; cap rather than refuse.
        let length_ms = i64::try_from(settings.length_ms).unwrap_or(i64::MAX);
        Ok(WindowAggregator {
            origin,
            length_ms,
            next_index: 0,
            open: BTreeMap::new(),
        })
    }

    fn start_of(&self, index: i64) -> DateTime<Utc> {
        self.length_ms
            .checked_mul(index)
            .and_then(TimeDelta::try_milliseconds)
            .and_then(|d| self.origin.checked_add_signed(d))
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }

    /// Window index of `at`, or None before the origin.
    fn index_of(&self, at: DateTime<Utc>) -> Option<i64> {
        let since = at.signed_duration_since(self.origin).num_milliseconds();
        (since >= 0).then(|| since / self.length_ms)
    }

    fn window_for(&mut self, at: DateTime<Utc>) -> Result<&mut WindowSamples, ObservationError> {
        let late = ObservationError::Late {
            at,
            open_from: self.start_of(self.next_index),
        };
        let index = match self.index_of(at) {
            Some(i) if i >= self.next_index => i,
            _ => return Err(late),
        };
        let (start, end) = (self.start_of(index), self.start_of(index + 1));
        Ok(self
            .open
            .entry(index)
            .or_insert_with(|| WindowSamples::new(start, end)))
    }

    pub fn observe(&mut self, o: RequestObservation) -> Result<(), ObservationError> {
        validate_request(&o)?;
        self.window_for(o.at)?.add_request(o)
    }

    pub fn report(&mut self, b: BatchReport) -> Result<(), ObservationError> {
        validate_batch(&b)?;
        self.window_for(b.at)?.add_batch(b)
    }

    /// Where the next window to close starts.
    pub fn next_start(&self) -> DateTime<Utc> {
        self.start_of(self.next_index)
    }

    /// The window length.
    pub fn length(&self) -> TimeDelta {
        TimeDelta::try_milliseconds(self.length_ms).unwrap_or(TimeDelta::MAX)
    }

    /// Marks every window before `end` closed (their observations, if any, are dropped).
    pub fn skip_to(&mut self, end: DateTime<Utc>) {
        if let Some(index) = self.index_of(end) {
            self.open.retain(|i, _| *i >= index);
            self.next_index = self.next_index.max(index);
        }
    }

    /// Closes every window that ended at or before `now`, in time order. A run of windows
    /// with no observation at all comes back as one empty window spanning the gap, so a
    /// long silence is one inconclusive check, not thousands.
    pub fn close_until(&mut self, now: DateTime<Utc>) -> Vec<WindowSamples> {
        let Some(current) = self.index_of(now) else {
            return Vec::new();
        };
        // Windows with index < current have ended (end ≤ now).
        let mut closed = Vec::new();
        let ready: Vec<i64> = self.open.range(..current).map(|(i, _)| *i).collect();
        for index in ready {
            if index > self.next_index {
                closed.push(WindowSamples::new(
                    self.start_of(self.next_index),
                    self.start_of(index),
                ));
            }
            if let Some(w) = self.open.remove(&index) {
                closed.push(w);
            }
            self.next_index = index + 1;
        }
        if current > self.next_index {
            closed.push(WindowSamples::new(
                self.start_of(self.next_index),
                self.start_of(current),
            ));
            self.next_index = current;
        }
        closed
    }
}

/// Evenly spaced order statistics: at most `max` values of the same distribution.
fn thin_f64(values: &mut Vec<f64>, max: usize) {
    if values.len() > max && max > 1 {
        values.sort_by(f64::total_cmp);
        let n = values.len();
        *values = (0..max).map(|i| values[i * (n - 1) / (max - 1)]).collect();
    }
}

fn thin_u64(values: &mut Vec<u64>, max: usize) {
    if values.len() > max && max > 1 {
        values.sort_unstable();
        let n = values.len();
        *values = (0..max).map(|i| values[i * (n - 1) / (max - 1)]).collect();
    }
}

/// Keeps about `max` of `n` request ids, the same ones wherever it is asked: those whose
/// SM3's first two bytes fall below `65536 · max / n`.
fn id_sampler(n: usize, max: usize) -> impl Fn(&String) -> bool {
    let threshold = (65_536u64 * max as u64 / n.max(1) as u64).min(65_536);
    move |id: &String| {
        use sm3::Digest;
        let digest = sm3::Sm3::digest(id.as_bytes());
        u64::from(u16::from_be_bytes([digest[0], digest[1]])) < threshold
    }
}

/// What the candidate is compared with besides the baseline: usually the baseline's
/// samples from the first conclusive window of the rollout.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReferenceSample {
    pub scores: Vec<f64>,
    pub features: BTreeMap<String, Vec<f64>>,
}

impl ReferenceSample {
    pub fn from_stage(samples: &StageSamples) -> Self {
        ReferenceSample {
            scores: samples.scores.clone(),
            features: samples.features.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).expect("in range")
    }

    fn obs(id: &str, stage: Stage, latency_us: u64, at: DateTime<Utc>) -> RequestObservation {
        RequestObservation {
            request_id: id.into(),
            stage,
            latency_us,
            error: false,
            score: 0.5,
            confidence: 0.9,
            flagged: false,
            rules_flagged: false,
            features: BTreeMap::new(),
            shadow: false,
            at,
        }
    }

    #[test]
    fn shadows_are_evidence_but_not_latency_or_errors() {
        let mut w = WindowSamples::new(t(0), t(60_000));
        w.add_request(obs("a", Stage::Candidate, 400_000, t(1)))
            .unwrap();
        let mut shadow = obs("b", Stage::Candidate, 10, t(2));
        shadow.shadow = true;
        w.add_request(shadow.clone()).unwrap();
        shadow.request_id = "c".into();
        shadow.error = true;
        w.add_request(shadow).unwrap();
        let m = w.metrics(&WindowSettings::default()).candidate;
        assert_eq!(m.requests, 3);
        assert_eq!(m.latency_p50_us, 400_000, "only the live answer's latency");
        assert_eq!((m.errors, m.error_rate), (0, 0.0));
        assert_eq!(m.answered, 2);
    }

    #[test]
    fn nearest_rank_percentiles_are_exact() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(nearest_rank(&v, 500), 50);
        assert_eq!(nearest_rank(&v, 950), 95);
        assert_eq!(nearest_rank(&v, 990), 99);
        assert_eq!(nearest_rank(&[7], 990), 7);
        assert_eq!(nearest_rank(&[], 990), 0);
        // Ten values: p99 is the largest (rank ⌈9.9⌉ = 10), p50 the fifth.
        let v: Vec<u64> = (1..=10).map(|x| x * 10).collect();
        assert_eq!(nearest_rank(&v, 990), 100);
        assert_eq!(nearest_rank(&v, 500), 50);
    }

    #[test]
    fn mean_is_compensated() {
        assert_eq!(mean(&[0.82; 100]), 0.82);
        assert_eq!(mean(&[0.8; 10]), 0.8);
        assert_eq!(mean(&[]), 0.0);
    }

    #[test]
    fn errors_count_for_latency_and_error_rate_only() {
        let mut w = WindowSamples::new(t(0), t(1000));
        let mut bad = obs("r1", Stage::Candidate, 900, t(1));
        bad.error = true;
        bad.flagged = true;
        w.add_request(bad).expect("valid");
        w.add_request(obs("r2", Stage::Candidate, 100, t(2)))
            .expect("valid");
        let m = w.metrics(&WindowSettings::default()).candidate;
        assert_eq!((m.requests, m.errors, m.answered), (2, 1, 1));
        assert_eq!(m.error_rate, 0.5);
        assert_eq!(m.latency_p99_us, 900);
        assert_eq!(m.mean_confidence, 0.9);
        assert!(w.candidate.flagged_ids.is_empty());
    }

    #[test]
    fn refuses_bad_numbers() {
        let mut w = WindowSamples::new(t(0), t(1000));
        let mut o = obs("r1", Stage::Baseline, 1, t(0));
        o.score = f64::NAN;
        assert!(matches!(
            w.add_request(o),
            Err(ObservationError::NonFinite { .. })
        ));
        let mut o = obs("r1", Stage::Baseline, 1, t(0));
        o.confidence = 1.5;
        assert!(matches!(
            w.add_request(o),
            Err(ObservationError::ConfidenceOutOfRange { .. })
        ));
        let b = BatchReport {
            stage: Stage::Baseline,
            batch_size: 9,
            max_batch: 8,
            queue_depth: 0,
            elapsed_us: 1,
            at: t(0),
        };
        assert!(matches!(
            w.add_batch(b),
            Err(ObservationError::Overfull { .. })
        ));
        assert_eq!(w.baseline, StageSamples::default());
    }

    #[test]
    fn aggregator_closes_windows_in_order_and_collapses_gaps() {
        let settings = WindowSettings {
            length_ms: 1000,
            ..WindowSettings::default()
        };
        let mut agg = WindowAggregator::new(t(0), &settings).expect("valid");
        agg.observe(obs("a", Stage::Baseline, 1, t(1500)))
            .expect("open");
        agg.observe(obs("b", Stage::Baseline, 2, t(10)))
            .expect("open");
        agg.observe(obs("c", Stage::Candidate, 3, t(9_999)))
            .expect("open");
        assert!(agg.close_until(t(999)).is_empty());
        let closed = agg.close_until(t(2000));
        assert_eq!(closed.len(), 2);
        assert_eq!((closed[0].start, closed[0].end), (t(0), t(1000)));
        assert_eq!(closed[0].baseline.requests, 1);
        assert_eq!((closed[1].start, closed[1].end), (t(1000), t(2000)));
        // Late for a closed window.
        assert!(matches!(
            agg.observe(obs("d", Stage::Baseline, 1, t(1999))),
            Err(ObservationError::Late { .. })
        ));
        // Windows 2..9 are empty: one gap window, then window 9.
        let closed = agg.close_until(t(12_500));
        assert_eq!(closed.len(), 3);
        assert_eq!((closed[0].start, closed[0].end), (t(2000), t(9000)));
        assert_eq!(
            closed[0].baseline.requests + closed[0].candidate.requests,
            0
        );
        assert_eq!(closed[1].candidate.requests, 1);
        assert_eq!((closed[2].start, closed[2].end), (t(10_000), t(12_000)));
    }

    #[test]
    fn aggregator_refuses_sub_second_windows() {
        let settings = WindowSettings {
            length_ms: 500,
            ..WindowSettings::default()
        };
        assert!(WindowAggregator::new(t(0), &settings).is_err());
    }
}

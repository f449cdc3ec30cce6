//! Why the model scored what it did: Shapley attributions of the anomaly score with a
//! bootstrap 95 % interval each, and a LIME local-fidelity audit, both **checked** — an
//! explanation that does not add up, is too uncertain, or whose local surrogate does not
//! reproduce the model is marked failed, never passed off as an explanation.
//!
//! Everything runs on the plain-f32 reference forward pass ([`MlpWeights::forward`], the
//! pure-Rust `expf`) in a fixed order, seeded from the request id, so `aether model
//! explain` recomputes a recorded explanation bit for bit on any machine.
//!
//! - **Players** are the 8 feature groups of [`GROUPS`], not the 17 inputs: a currency is
//!   one one-hot block and the hour one (sin, cos) pair; replacing one slot of a block
//!   alone would ask the model about trades that cannot exist.
//! - **Value function** (interventional): v(S) = mean over the background rows b of
//!   f(x on S, b elsewhere). The background is the first [`ExplainSettings::background_size`]
//!   trades of the model's own training book (its `model.json` names generator and seed,
//!   pinned by the artifact digest), before anomalies are planted.
//! - **Shapley values** exactly, over all 2⁸ coalitions, per background row; their mean
//!   is the attribution (so no sampling error), and Σ φ = f(x) − mean f(b) holds exactly
//!   up to rounding (checked).
//! - **Bootstrap CI**: 200 resamples of the background rows with replacement, the mean of
//!   the per-row Shapley values each time, the 2.5th and 97.5th percentiles (nearest
//!   rank) per group. The interval says how much the attribution depends on the
//!   background drawn.
//! - **LIME audit**: 256 neighbours z′ ∈ {0, 1}⁸ (each group kept with probability ¾,
//!   the rest from a random background row; the instance itself first), weighted by
//!   LIME's tabular kernel π = √exp(−d²/w²), d the distance from x in standardised units;
//!   a weighted ridge regression (λ = 1, intercept free, LIME's defaults)
//!   g(z′) = β₀ + β·z′. Fidelity |f(x) − g(1)| < ε₁; neighbourhood: the kernel-weighted
//!   RMS distance √(Σ π d² / Σ π) < ε₂. Recorded numbers are rounded to 9 decimals.

use serde::{Deserialize, Serialize};
use sm3::{Digest, Sm3};

use crate::artifact::{MlpWeights, ModelSpec};
use crate::features::{FEATURE_COUNT, FEATURE_NAMES, features};
use crate::train::{GENERATOR, SplitMix64, generate};

/// The explanation format recorded with a decision.
pub const METHOD: &str = "aether.explain.v1";

/// The players: named groups of the feature vector, in vector order.
pub const GROUPS: [(&str, &[usize]); 8] = [
    ("amount", &[0]),
    ("near_reporting_threshold", &[1]),
    ("currency", &[2, 3, 4, 5, 6, 7, 8, 9, 10]),
    ("jurisdiction_risk", &[11]),
    ("counterparty_tier", &[12]),
    ("hour", &[13, 14]),
    ("velocity", &[15]),
    ("value_date_weekend", &[16]),
];

const PLAYERS: usize = GROUPS.len();
const COALITIONS: usize = 1 << PLAYERS;
/// Coalitions evaluated side by side (one AVX2 register of f32): those that differ only in
/// the last three groups.
const LANES: usize = 8;
/// The groups a block of lanes shares.
const BLOCK_GROUPS: usize = PLAYERS - 3;

/// How an explanation is computed and judged. Part of the record, so a recomputation
/// uses exactly these.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExplainSettings {
    /// Background rows (the value function's expectation is over them).
    pub background_size: usize,
    /// Bootstrap resamples of the background for the intervals.
    pub resamples: usize,
    /// Neighbours of the LIME audit, the instance included.
    pub lime_samples: usize,
    /// Probability that a neighbour keeps each group of the instance (0.75: LIME's ½
    /// put most neighbours so far from an unusual trade that a linear surrogate missed
    /// the score by 0.10 at the median).
    pub keep_probability: f64,
    /// Width w of the neighbourhood kernel √exp(−d²/w²), standardised units (1.5:
    /// LIME's 0.75·√17 ≈ 3.09 weighs neighbours four σ away at ½).
    pub kernel_width: f64,
    /// Largest |f(x) − g(1)| of the local surrogate: 0.05, a twentieth of the score
    /// scale (on 500 of the reference model's held trades the error is 0.009 at the
    /// median, 0.029 at p95; 3 are over: `cargo bench -p aether-gpu-worker --bench
    /// explain`).
    pub epsilon1: f64,
    /// Largest kernel-weighted RMS distance of the neighbourhood from x, in standard
    /// deviations of the training data: 2, a neighbourhood within two σ of the trade
    /// (1.07 median, 1.47 at most on the reference model's held trades).
    pub epsilon2: f64,
    /// Widest 95 % interval allowed for any attribution, in score units: a quarter of
    /// the scale (widest seen on held trades: 0.16).
    pub max_ci_width: f64,
    /// Largest |Σ φ − (f(x) − base)|: f32 rounding only.
    pub efficiency_tolerance: f64,
}

impl Default for ExplainSettings {
    fn default() -> Self {
        ExplainSettings {
            background_size: 32,
            resamples: 200,
            lime_samples: 256,
            keep_probability: 0.75,
            kernel_width: 1.5,
            epsilon1: 0.05,
            epsilon2: 2.0,
            max_ci_width: 0.25,
            efficiency_tolerance: 1e-4,
        }
    }
}

/// Why no explanation could be computed at all (as opposed to a failed one).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExplainError {
    #[error(
        "the model records no training book to draw a background from (model.json has no `training` by {GENERATOR})"
    )]
    NoBackground,
    #[error("explain settings unusable: {0}")]
    Settings(String),
}

/// Where the background rows come from, and their SM3 (over the f32 rows, little-endian).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackgroundSource {
    pub generator: String,
    pub seed: u64,
    pub size: usize,
    pub digest: String,
}

/// The background sample of a model.
#[derive(Clone, Debug)]
pub struct Background {
    pub rows: Vec<[f32; FEATURE_COUNT]>,
    pub source: BackgroundSource,
}

impl Background {
    /// The first `size` trades of the model's training book, before anomalies.
    pub fn of_model(spec: &ModelSpec, size: usize) -> Result<Background, ExplainError> {
        let training = spec
            .training
            .as_ref()
            .filter(|t| t.generator == GENERATOR)
            .ok_or(ExplainError::NoBackground)?;
        if size == 0 {
            return Err(ExplainError::Settings("background_size must be ≥ 1".into()));
        }
        let rows: Vec<[f32; FEATURE_COUNT]> = generate(training.seed, size, 0.0)
            .iter()
            .map(|t| features(&t.trade, &t.context))
            .collect();
        let mut hasher = Sm3::new();
        for row in &rows {
            for v in row {
                hasher.update(v.to_le_bytes());
            }
        }
        Ok(Background {
            rows,
            source: BackgroundSource {
                generator: GENERATOR.to_owned(),
                seed: training.seed,
                size,
                digest: hex::encode(hasher.finalize()),
            },
        })
    }
}

/// One player's attribution.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attribution {
    pub feature: String,
    pub value: f64,
    pub ci95: [f64; 2],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExplanationStatus {
    /// Every check passed.
    Explained,
    /// Computed, but a check failed (`failures` says which): not to be relied on.
    Failed,
}

/// The local surrogate's audit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimeAudit {
    pub samples: usize,
    pub kernel_width: f64,
    /// g(1), the surrogate at the instance.
    pub surrogate_at_instance: f64,
    pub fidelity_error: f64,
    pub neighbourhood_distance: f64,
}

/// A decision's explanation, as recorded (compact: 8 attributions and a few figures).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Explanation {
    pub method: String,
    pub status: ExplanationStatus,
    /// Which checks failed: `efficiency`, `ci_width:<feature>`, `fidelity`,
    /// `neighbourhood`.
    pub failures: Vec<String>,
    /// f(x) by the reference forward pass.
    pub score: f64,
    /// Mean f over the background: the score with nothing known about the trade.
    pub base_value: f64,
    /// Σ φ − (score − base_value).
    pub efficiency_error: f64,
    /// 16 lowercase hex digits: the seed of the bootstrap and the neighbours.
    pub seed: String,
    /// The raw feature row explained (17 values, `aether.features.v1` order).
    pub features: Vec<f32>,
    pub background: BackgroundSource,
    pub attributions: Vec<Attribution>,
    pub lime: LimeAudit,
    pub settings: ExplainSettings,
}

/// The seed of a request's explanation: the first 8 bytes of
/// SM3("aether.explain.seed.v1\n" ‖ request id), big-endian.
pub fn seed_for(request_id: &str) -> u64 {
    let digest = Sm3::new()
        .chain_update(b"aether.explain.seed.v1\n")
        .chain_update(request_id.as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The model side of an explanation: the weights and how inputs are standardised.
pub struct Explainer<'a> {
    pub weights: &'a MlpWeights,
    pub spec: &'a ModelSpec,
    pub background: &'a Background,
    pub settings: &'a ExplainSettings,
}

impl Explainer<'_> {
    fn standardised(&self, raw: &[f32; FEATURE_COUNT]) -> [f32; FEATURE_COUNT] {
        let n = &self.spec.normalisation;
        let mut out = [0f32; FEATURE_COUNT];
        for (i, o) in out.iter_mut().enumerate() {
            *o = (raw[i] - n.mean[i]) / n.std[i];
        }
        out
    }

    /// f on a raw row, by the reference forward pass.
    pub fn f(&self, raw: &[f32; FEATURE_COUNT]) -> f64 {
        f64::from(self.weights.forward(&self.standardised(raw)))
    }

    /// x on the groups in `mask`, `b` elsewhere.
    fn blend(
        x: &[f32; FEATURE_COUNT],
        b: &[f32; FEATURE_COUNT],
        mask: usize,
    ) -> [f32; FEATURE_COUNT] {
        let mut row = *b;
        for (g, (_, slots)) in GROUPS.iter().enumerate() {
            if mask & (1 << g) != 0 {
                for &i in slots.iter() {
                    row[i] = x[i];
                }
            }
        }
        row
    }

    /// Exact Shapley values of the single-baseline game v_b(S) = f(x on S, b elsewhere).
    pub fn shapley_against(&self, x: &[f32; FEATURE_COUNT], b: &[f32; FEATURE_COUNT]) -> [f64; 8] {
        let mlp = ByInput::new(self.weights);
        self.shapley_fast(&mlp, &self.standardised(x), &self.standardised(b))
    }

    /// [`Explainer::shapley_against`] on standardised rows (standardising is per feature,
    /// so blending standardised rows gives the same bits as standardising a blend).
    fn shapley_fast(
        &self,
        mlp: &ByInput,
        xs: &[f32; FEATURE_COUNT],
        bs: &[f32; FEATURE_COUNT],
    ) -> [f64; 8] {
        let mut scratch = Scratch::default();
        let mut v = [0f64; COALITIONS];
        mlp.coalition_values(xs, bs, &mut v, &mut scratch);
        shapley_from_values(&v)
    }

    /// Explains one raw feature row with the given seed.
    pub fn explain(
        &self,
        x: &[f32; FEATURE_COUNT],
        seed: u64,
    ) -> Result<Explanation, ExplainError> {
        let s = self.settings;
        if s.resamples == 0 || s.lime_samples < PLAYERS + 2 {
            return Err(ExplainError::Settings(format!(
                "resamples must be ≥ 1 and lime_samples ≥ {}",
                PLAYERS + 2
            )));
        }
        let rows = &self.background.rows;
        let score = self.f(x);
        let mlp = ByInput::new(self.weights);
        let xs = self.standardised(x);
        // f of every coalition against every background row: the Shapley values' games,
        // and also every value the base value and the LIME audit ask for (f(b) is the
        // empty coalition's, a neighbour's the value of its mask against its row), each
        // the same bits as its own forward pass.
        let mut scratch = Scratch::default();
        let games: Vec<[f64; COALITIONS]> = rows
            .iter()
            .map(|b| {
                let mut v = [0f64; COALITIONS];
                mlp.coalition_values(&xs, &self.standardised(b), &mut v, &mut scratch);
                v
            })
            .collect();
        let per_row = shapley_of_games(&games);
        let base_value = games.iter().map(|v| v[0]).sum::<f64>() / rows.len() as f64;
        let phi = mean_rows(&per_row, (0..per_row.len()).collect::<Vec<_>>().as_slice());

        // Bootstrap over the background rows.
        let mut rng = SplitMix64::new(seed);
        let mut resampled: Vec<[f64; PLAYERS]> = Vec::with_capacity(s.resamples);
        let mut picks = vec![0usize; per_row.len()];
        for _ in 0..s.resamples {
            for p in picks.iter_mut() {
                *p = rng.int(0, per_row.len() as u64 - 1) as usize;
            }
            resampled.push(mean_rows(&per_row, &picks));
        }
        let lo_rank = (0.025 * s.resamples as f64).ceil().max(1.0) as usize - 1;
        let hi_rank = (0.975 * s.resamples as f64).ceil().max(1.0) as usize - 1;
        let mut attributions = Vec::with_capacity(PLAYERS);
        let mut failures = Vec::new();
        for (g, (name, _)) in GROUPS.iter().enumerate() {
            let mut values: Vec<f64> = resampled.iter().map(|r| r[g]).collect();
            // The two ranks' values, as a full sort would place them (the order is total).
            let mut at_rank = |rank: usize| {
                let rank = rank.min(values.len() - 1);
                *values.select_nth_unstable_by(rank, f64::total_cmp).1
            };
            let ci95 = [at_rank(lo_rank), at_rank(hi_rank)];
            if !at_most(ci95[1] - ci95[0], s.max_ci_width) {
                failures.push(format!("ci_width:{name}"));
            }
            attributions.push(Attribution {
                feature: (*name).to_owned(),
                value: phi[g],
                ci95,
            });
        }
        let efficiency_error = phi.iter().sum::<f64>() - (score - base_value);
        if !at_most(efficiency_error.abs(), s.efficiency_tolerance) {
            failures.insert(0, "efficiency".to_owned());
        }

        let lime = self.lime(x, score, &games, &mut rng);
        if !below(lime.fidelity_error, s.epsilon1) {
            failures.push("fidelity".to_owned());
        }
        if !below(lime.neighbourhood_distance, s.epsilon2) {
            failures.push("neighbourhood".to_owned());
        }
        let attributions = attributions
            .into_iter()
            .map(|a| Attribution {
                value: round9(a.value),
                ci95: a.ci95.map(round9),
                ..a
            })
            .collect();
        let lime = LimeAudit {
            surrogate_at_instance: round9(lime.surrogate_at_instance),
            fidelity_error: round9(lime.fidelity_error),
            neighbourhood_distance: round9(lime.neighbourhood_distance),
            ..lime
        };
        Ok(Explanation {
            method: METHOD.to_owned(),
            status: if failures.is_empty() {
                ExplanationStatus::Explained
            } else {
                ExplanationStatus::Failed
            },
            failures,
            score: round9(score),
            base_value: round9(base_value),
            efficiency_error: round9(efficiency_error),
            seed: format!("{seed:016x}"),
            features: x.to_vec(),
            background: self.background.source.clone(),
            attributions,
            lime,
            settings: s.clone(),
        })
    }

    /// The audit, its neighbours' values looked up in `games` (f of each coalition
    /// against each background row).
    fn lime(
        &self,
        x: &[f32; FEATURE_COUNT],
        score: f64,
        games: &[[f64; COALITIONS]],
        rng: &mut SplitMix64,
    ) -> LimeAudit {
        let rows = &self.background.rows;
        let xs = self.standardised(x);
        let n = self.settings.lime_samples;
        let all = COALITIONS - 1;
        // Design rows [1, z′₁ … z′₈], targets and weights.
        let mut design: Vec<[f64; PLAYERS + 1]> = Vec::with_capacity(n);
        let mut targets = Vec::with_capacity(n);
        let mut weights = Vec::with_capacity(n);
        let mut weighted_sq = 0.0;
        for k in 0..n {
            let (mask, b) = if k == 0 {
                (all, 0)
            } else {
                let mut mask = 0;
                for g in 0..PLAYERS {
                    if rng.chance(self.settings.keep_probability) {
                        mask |= 1 << g;
                    }
                }
                (mask, rng.int(0, rows.len() as u64 - 1) as usize)
            };
            let z = Self::blend(x, &rows[b], mask);
            let zs = self.standardised(&z);
            let d2: f64 = zs
                .iter()
                .zip(&xs)
                .map(|(a, b)| {
                    let d = f64::from(a - b);
                    d * d
                })
                .sum();
            let w = self.settings.kernel_width;
            let pi = libm::sqrt(libm::exp(-d2 / (w * w)));
            let mut row = [1.0; PLAYERS + 1];
            for (g, cell) in row.iter_mut().skip(1).enumerate() {
                *cell = if mask & (1 << g) != 0 { 1.0 } else { 0.0 };
            }
            design.push(row);
            targets.push(games[b][mask]);
            weights.push(pi);
            weighted_sq += pi * d2;
        }
        let total_weight: f64 = weights.iter().sum();
        let beta = weighted_ridge(&design, &targets, &weights, 1.0);
        let surrogate_at_instance: f64 = beta.iter().sum();
        LimeAudit {
            samples: n,
            kernel_width: self.settings.kernel_width,
            surrogate_at_instance,
            fidelity_error: (score - surrogate_at_instance).abs(),
            neighbourhood_distance: libm::sqrt(weighted_sq / total_weight),
        }
    }
}

/// `value ≤ bound`; NaN is never within a bound, so a broken figure fails its check.
fn at_most(value: f64, bound: f64) -> bool {
    value <= bound
}

/// `value < bound`, NaN failing.
fn below(value: f64, bound: f64) -> bool {
    value < bound
}

/// Rounds to 9 decimals (checks run before): short numbers that any JSON parser reads
/// back to the same f64, so a recorded explanation compares bit for bit; −0 becomes 0.
pub fn round9(x: f64) -> f64 {
    (x * 1e9).round() / 1e9 + 0.0
}

/// The MLP with each layer's weights laid out input by input (`[in][out]`), so that a
/// layer is `inputs` passes over its outputs, eight coalitions side by side, while each
/// output still sums its products in input order, from 0, then adds its bias: bit for bit
/// [`MlpWeights::forward`] (property tests check it). Explaining one decision asks for
/// 8,192 coalition values.
pub struct ByInput {
    layers: Vec<(usize, usize, Vec<f32>, Vec<f32>)>,
}

impl ByInput {
    /// f of every coalition of the 8 groups (`x` on the groups of the mask, `b`
    /// elsewhere; both standardised), into `values[mask]`. The first layer's sums are
    /// shared: groups are contiguous and in input order, so extending each output's sum
    /// group by group (both ways at each group) is exactly what a whole pass does, and
    /// computes a prefix once for all the coalitions that share it (638 instead of 4,352
    /// input rows). Bit for bit the same values as 256 forward passes.
    pub fn coalition_values(
        &self,
        x: &[f32; FEATURE_COUNT],
        b: &[f32; FEATURE_COUNT],
        values: &mut [f64; COALITIONS],
        scratch: &mut Scratch,
    ) {
        let Some((inputs, _, _, _)) = self.layers.first() else {
            values.fill(f64::NAN);
            return;
        };
        if *inputs != FEATURE_COUNT {
            values.fill(f64::NAN);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            unsafe { self.coalitions_avx2(x, b, values, scratch) };
            return;
        }
        self.coalitions::<false>(x, b, values, scratch);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn coalitions_avx2(
        &self,
        x: &[f32; FEATURE_COUNT],
        b: &[f32; FEATURE_COUNT],
        values: &mut [f64; COALITIONS],
        scratch: &mut Scratch,
    ) {
        self.coalitions::<true>(x, b, values, scratch);
    }

    #[inline(always)]
    fn coalitions<const AVX2: bool>(
        &self,
        x: &[f32; FEATURE_COUNT],
        b: &[f32; FEATURE_COUNT],
        values: &mut [f64; COALITIONS],
        scratch: &mut Scratch,
    ) {
        let packs = Packs::new(x, b);
        let mut hidden = std::mem::take(&mut scratch.hidden);
        self.first_layer::<AVX2>(x, b, &packs, scratch, &mut hidden);
        self.finish::<AVX2>(&hidden, &packs, values, scratch);
        scratch.hidden = hidden;
    }

    /// The first layer of every coalition into `hidden` (`outputs` values per coalition,
    /// after the bias and, with layers after it, ReLU), laid out as [`ByInput::finish`]
    /// reads it: block `m mod 32` holds the coalitions m that agree on the first five
    /// groups, its lane `m >> 5` says which of the last three groups they take from `x`;
    /// `[output][lane]` in each block. The first five groups' sums are extended level by
    /// level (level g: the 2^g prefixes over groups 0..g, by mask), the last three side by
    /// side in the lanes.
    #[inline(always)]
    fn first_layer<const AVX2: bool>(
        &self,
        x: &[f32; FEATURE_COUNT],
        b: &[f32; FEATURE_COUNT],
        packs: &Packs,
        scratch: &mut Scratch,
        hidden: &mut Vec<f32>,
    ) {
        let (_, outputs, by_input, bias) = &self.layers[0];
        let outputs = *outputs;
        let Scratch {
            a: level, b: next, ..
        } = scratch;
        level.clear();
        level.resize(outputs, 0.0);
        for (g, (_, slots)) in GROUPS.iter().enumerate().take(BLOCK_GROUPS) {
            let prefixes = 1 << g;
            next.clear();
            next.resize(2 * prefixes * outputs, 0.0);
            for take_x in [false, true] {
                let value = |i: usize| if take_x { x[i] } else { b[i] };
                let (to, more) = next.split_at_mut(prefixes * outputs);
                let to = if take_x { more } else { to };
                for (prev, out) in level
                    .chunks_exact(outputs)
                    .zip(to.chunks_exact_mut(outputs))
                {
                    // The first input is added on the way from the level above (a copy
                    // and then an add cost a tenth of an explanation in short copies).
                    let Some((&i, rest)) = slots.split_first() else {
                        out.copy_from_slice(prev);
                        continue;
                    };
                    let (v, row) = (value(i), &by_input[i * outputs..][..outputs]);
                    for ((sum, p), w) in out.iter_mut().zip(prev).zip(row) {
                        *sum = p + w * v;
                    }
                    for &i in rest {
                        let (v, row) = (value(i), &by_input[i * outputs..][..outputs]);
                        for (sum, w) in out.iter_mut().zip(row) {
                            *sum += w * v;
                        }
                    }
                }
            }
            std::mem::swap(level, next);
        }
        // Each input of the last three groups, with its value in every lane (the same in
        // every pack: lane j takes the lane groups of `packs.lane(j)`).
        let lane_inputs: Vec<(usize, [f32; LANES])> = GROUPS[BLOCK_GROUPS..]
            .iter()
            .enumerate()
            .flat_map(|(k, (_, slots))| {
                slots.iter().map(move |&i| {
                    let lanes = std::array::from_fn(|j| {
                        if packs.lane(j) >> k & 1 == 1 {
                            x[i]
                        } else {
                            b[i]
                        }
                    });
                    (i, lanes)
                })
            })
            .collect();
        // Every value is written below: no clearing.
        hidden.resize(packs.count() * outputs * LANES, 0.0);
        let more = self.layers.len() > 1;
        for (pack, out) in hidden.chunks_exact_mut(outputs * LANES).enumerate() {
            // The block of each run of lanes: its first-layer prefix sums.
            let runs: [&[f32]; LANES] = std::array::from_fn(|r| {
                let block = packs.block(pack, r * packs.lanes_per_block());
                &level[block * outputs..][..outputs]
            });
            let runs = &runs[..LANES / packs.lanes_per_block()];
            let mut o0 = 0;
            #[cfg(target_arch = "x86_64")]
            if AVX2 {
                while o0 + 8 <= outputs {
                    let block = &mut out[o0 * LANES..][..8 * LANES];
                    // SAFETY: `AVX2` is true only under `coalitions_avx2`, which runs only
                    // where the CPU has AVX2.
                    unsafe {
                        first_lanes_avx2(runs, &lane_inputs, by_input, bias, more, o0, block)
                    };
                    o0 += 8;
                }
            }
            for (o, lanes) in out.chunks_exact_mut(LANES).enumerate().skip(o0) {
                let per_run = LANES / runs.len();
                let mut sum: [f32; LANES] = std::array::from_fn(|j| runs[j / per_run][o]);
                for (i, v) in &lane_inputs {
                    let w = by_input[i * outputs + o];
                    for (s, v) in sum.iter_mut().zip(v) {
                        *s += w * v;
                    }
                }
                for s in &mut sum {
                    *s += bias[o];
                }
                if more {
                    for s in &mut sum {
                        *s = s.max(0.0);
                    }
                }
                lanes.copy_from_slice(&sum);
            }
        }
    }

    /// The layers after the first, for every coalition's first-layer activations (laid
    /// out by [`ByInput::first_layer`]: blocks of [`LANES`] coalitions, `[output][lane]` in each),
    /// a block at a time (see [`ByInput::lanes_from`]).
    #[inline(always)]
    fn finish<const AVX2: bool>(
        &self,
        hidden: &[f32],
        packs: &Packs,
        values: &mut [f64; COALITIONS],
        scratch: &mut Scratch,
    ) {
        let width = hidden.len() / (packs.count() * LANES);
        for pack in 0..packs.count() {
            let input = &hidden[pack * width * LANES..][..width * LANES];
            let probabilities = if self.layers.len() == 1 {
                let mut z = [f32::NAN; LANES];
                for (z, v) in z.iter_mut().zip(input) {
                    *z = *v;
                }
                crate::sigmoid8::sigmoid8(z)
            } else {
                self.lanes_from::<AVX2>(1, input, scratch)
            };
            for (j, p) in probabilities.into_iter().enumerate() {
                values[packs.block(pack, j) | packs.lane(j) << BLOCK_GROUPS] = f64::from(p);
            }
        }
        // The rest blend the same rows as the computed coalition without the groups on
        // which x and b agree.
        for mask in 0..COALITIONS {
            values[mask] = values[mask & !packs.same];
        }
    }

    /// The layers from `first` on for [`LANES`] inputs at once, laid out `[input][lane]`
    /// in `input`; their probabilities. Each lane is one coalition and does exactly
    /// the operations of [`ByInput::layers_from`] in the same order (so the same bits),
    /// but the lanes are independent: eight outputs of eight coalitions are summed side by
    /// side, which keeps the vector units busy where one coalition's sums wait on each
    /// other (4× fewer cycles per coalition on the reference model).
    #[inline(always)]
    fn lanes_from<const AVX2: bool>(
        &self,
        first: usize,
        input: &[f32],
        scratch: &mut Scratch,
    ) -> [f32; LANES] {
        const BLOCK: usize = 8;
        let Scratch { a, b, .. } = scratch;
        let last = self.layers.len().saturating_sub(1);
        for (l, (inputs, outputs, by_input, bias)) in self.layers.iter().enumerate().skip(first) {
            let (inputs, outputs) = (*inputs, *outputs);
            b.clear();
            b.resize(outputs * LANES, 0.0);
            let x = if l == first { input } else { &a[..] };
            let x = &x[..inputs * LANES];
            let mut o0 = 0;
            while o0 + BLOCK <= outputs {
                let out = &mut b[o0 * LANES..][..BLOCK * LANES];
                #[cfg(target_arch = "x86_64")]
                if AVX2 {
                    // SAFETY: `AVX2` is true only under `coalitions_avx2`, which runs only where
                    // the CPU has AVX2.
                    unsafe { block_avx2(x, by_input, outputs, o0, out) };
                    o0 += BLOCK;
                    continue;
                }
                let mut acc = [[0f32; LANES]; BLOCK];
                for (i, xi) in x.chunks_exact(LANES).enumerate() {
                    let w = &by_input[i * outputs + o0..][..BLOCK];
                    for (row, wr) in acc.iter_mut().zip(w) {
                        for (sum, v) in row.iter_mut().zip(xi) {
                            *sum += wr * v;
                        }
                    }
                }
                for (row, o) in acc.iter().zip(out.chunks_exact_mut(LANES)) {
                    o.copy_from_slice(row);
                }
                o0 += BLOCK;
            }
            for o in o0..outputs {
                let mut sum = [0f32; LANES];
                for (i, xi) in x.chunks_exact(LANES).enumerate() {
                    let wr = by_input[i * outputs + o];
                    for (s, v) in sum.iter_mut().zip(xi) {
                        *s += wr * v;
                    }
                }
                b[o * LANES..][..LANES].copy_from_slice(&sum);
            }
            let relu = l < last;
            for (o, bias) in bias.iter().enumerate().take(outputs) {
                let row = &mut b[o * LANES..][..LANES];
                for sum in row.iter_mut() {
                    *sum += bias;
                }
                if relu {
                    for sum in row.iter_mut() {
                        *sum = sum.max(0.0);
                    }
                }
            }
            std::mem::swap(a, b);
        }
        match a.get(..LANES) {
            Some(z) => {
                let mut lanes = [0f32; LANES];
                lanes.copy_from_slice(z);
                crate::sigmoid8::sigmoid8(lanes)
            }
            None => [f32::NAN; LANES],
        }
    }
}

/// Eight outputs (from `o0`) of [`LANES`] inputs laid out `[input][lane]`, into `out`
/// (`[output][lane]`), before bias: one register per output, the lanes side by side. A
/// product and a sum each round on their own (no fused multiply-add), in input order from
/// 0, as [`MlpWeights::forward`] does. (Written out because the compiler, left to itself,
/// vectorised across the outputs and spent its time shuffling.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn block_avx2(x: &[f32], by_input: &[f32], outputs: usize, o0: usize, out: &mut [f32]) {
    use std::arch::x86_64::{
        __m256, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_storeu_ps,
    };
    let mut acc: [__m256; 8] = [_mm256_setzero_ps(); 8];
    for (i, xi) in x.chunks_exact(LANES).enumerate() {
        // SAFETY: `xi` holds LANES = 8 floats.
        let v = unsafe { _mm256_loadu_ps(xi.as_ptr()) };
        let w = &by_input[i * outputs + o0..][..8];
        for (sum, wr) in acc.iter_mut().zip(w) {
            *sum = _mm256_add_ps(*sum, _mm256_mul_ps(_mm256_set1_ps(*wr), v));
        }
    }
    for (sum, o) in acc.iter().zip(out.chunks_exact_mut(LANES)) {
        // SAFETY: `o` holds LANES = 8 floats.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *sum) };
    }
}

/// The first layer's eight outputs from `o0` for a pack of [`LANES`] coalitions, into
/// `out` (`[output][lane]`): each lane starts from the prefix sum of its run's block
/// (`runs`: one, two, four or eight blocks, each taking as many lanes), adds the products
/// of the last three groups' inputs (their values per lane in `lane_inputs`) in input
/// order, then the bias, then ReLU when `relu`: what the portable loop does, with eight
/// outputs' sums side by side (one output alone is a chain of dependent additions that
/// keeps the vector units waiting).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn first_lanes_avx2(
    runs: &[&[f32]],
    lane_inputs: &[(usize, [f32; LANES])],
    by_input: &[f32],
    bias: &[f32],
    relu: bool,
    o0: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::{
        __m256, _mm_set1_ps, _mm256_add_ps, _mm256_loadu_ps, _mm256_max_ps, _mm256_mul_ps,
        _mm256_set1_ps, _mm256_setr_m128, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    let outputs = bias.len();
    let per_run = LANES / runs.len();
    // (A loop, not `array::from_fn`: its closure was not inlined.)
    let mut acc: [__m256; 8] = [_mm256_setzero_ps(); 8];
    for (k, sum) in acc.iter_mut().enumerate() {
        let o = o0 + k;
        *sum = match runs {
            [one] => _mm256_set1_ps(one[o]),
            [low, high] => _mm256_setr_m128(_mm_set1_ps(low[o]), _mm_set1_ps(high[o])),
            _ => {
                let mut lanes = [0f32; LANES];
                for (j, lane) in lanes.iter_mut().enumerate() {
                    *lane = runs[j / per_run][o];
                }
                // SAFETY: `lanes` holds LANES = 8 floats.
                unsafe { _mm256_loadu_ps(lanes.as_ptr()) }
            }
        };
    }
    for (i, v) in lane_inputs {
        // SAFETY: `v` holds LANES = 8 floats.
        let v = unsafe { _mm256_loadu_ps(v.as_ptr()) };
        let w = &by_input[i * outputs + o0..][..8];
        for (sum, wr) in acc.iter_mut().zip(w) {
            *sum = _mm256_add_ps(*sum, _mm256_mul_ps(_mm256_set1_ps(*wr), v));
        }
    }
    for ((sum, o), b) in acc
        .iter_mut()
        .zip(out.chunks_exact_mut(LANES))
        .zip(&bias[o0..])
    {
        *sum = _mm256_add_ps(*sum, _mm256_set1_ps(*b));
        if relu {
            // `max(s, 0)` is 0 for NaN, as `f32::max` is; ±0 either way (a zero
            // activation's sign never reaches a later sum, which starts at +0).
            *sum = _mm256_max_ps(*sum, _mm256_setzero_ps());
        }
        // SAFETY: `o` holds LANES = 8 floats.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *sum) };
    }
}

/// Which coalitions a walk computes, eight to a register. A coalition that takes from x a
/// group on which x and b agree bit for bit (a currency, a tier, the weekend flag often
/// do) blends the same row as the one without it: only the coalitions taking none of
/// those groups are computed, the others copied. They are listed block by block (block:
/// the first five groups' mask; lane: the last three's), each block's distinct lanes
/// side by side, and cut into packs of [`LANES`]; fewer than eight in all are repeated
/// to fill one.
struct Packs {
    /// The groups on which x and b agree (bit g: group g).
    same: usize,
    /// Blocks without any of those groups, in order.
    blocks: Vec<usize>,
    /// Lane masks without any of them, in order (1, 2, 4 or 8 of them).
    lanes: Vec<usize>,
}

impl Packs {
    fn new(x: &[f32; FEATURE_COUNT], b: &[f32; FEATURE_COUNT]) -> Packs {
        let same = GROUPS
            .iter()
            .enumerate()
            .filter(|(_, (_, slots))| slots.iter().all(|&i| x[i].to_bits() == b[i].to_bits()))
            .fold(0usize, |mask, (g, _)| mask | 1 << g);
        let block_same = same & ((1 << BLOCK_GROUPS) - 1);
        let lane_same = same >> BLOCK_GROUPS;
        let blocks: Vec<usize> = (0..COALITIONS / LANES)
            .filter(|m| m & block_same == 0)
            .collect();
        let lanes: Vec<usize> = (0..LANES).filter(|l| l & lane_same == 0).collect();
        Packs {
            same,
            blocks,
            lanes,
        }
    }

    /// Lanes each block takes in a pack.
    fn lanes_per_block(&self) -> usize {
        self.lanes.len()
    }

    /// Coalitions computed (a power of two).
    fn distinct(&self) -> usize {
        self.blocks.len() * self.lanes_per_block()
    }

    fn count(&self) -> usize {
        self.distinct().div_ceil(LANES)
    }

    /// The block of lane `j` of `pack`.
    fn block(&self, pack: usize, j: usize) -> usize {
        self.blocks[((pack * LANES + j) % self.distinct()) / self.lanes_per_block()]
    }

    /// The lane mask of lane `j` (the same in every pack, as eight is a multiple of the
    /// lanes per block).
    fn lane(&self, j: usize) -> usize {
        self.lanes[j % self.lanes_per_block()]
    }
}

/// Buffers reused across forward passes and coalition walks.
#[derive(Default)]
pub struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
    hidden: Vec<f32>,
}

impl ByInput {
    pub fn new(weights: &MlpWeights) -> ByInput {
        let layers = weights
            .layers
            .iter()
            .map(|l| {
                let mut by_input = vec![0f32; l.inputs * l.outputs];
                for o in 0..l.outputs {
                    for i in 0..l.inputs {
                        by_input[i * l.outputs + o] = l.weight[o * l.inputs + i];
                    }
                }
                (l.inputs, l.outputs, by_input, l.bias.clone())
            })
            .collect();
        ByInput { layers }
    }
}

/// |S|!(M−|S|−1)!/M! by coalition size |S| < M.
fn shapley_weights() -> [f64; PLAYERS] {
    let mut factorial = [1f64; PLAYERS + 1];
    for k in 1..=PLAYERS {
        factorial[k] = factorial[k - 1] * k as f64;
    }
    std::array::from_fn(|size| factorial[size] * factorial[PLAYERS - size - 1] / factorial[PLAYERS])
}

/// Shapley values of an 8-player game given every coalition's value (bit g = player g):
/// φᵢ = Σ_{S ∌ i} |S|!(M−|S|−1)!/M! · (v(S ∪ {i}) − v(S)), summed in mask order.
pub fn shapley_from_values(v: &[f64; COALITIONS]) -> [f64; PLAYERS] {
    let weight = shapley_weights();
    // Masks outside, players inside: each φᵢ still adds its terms in mask order. Where
    // the mask holds i already the term is w · (v − v) = +0, and adding +0 leaves φᵢ as
    // it is (it starts at +0 and, rounding to nearest, never becomes −0; the values are
    // probabilities, never infinite): so every player takes a term at every mask, without
    // a branch, eight side by side.
    let mut phi = [0f64; PLAYERS];
    for (mask, at) in v.iter().enumerate() {
        let w = weight[(mask.count_ones() as usize).min(PLAYERS - 1)];
        for (i, p) in phi.iter_mut().enumerate() {
            *p += w * (v[mask | (1 << i)] - at);
        }
    }
    phi
}

/// [`shapley_from_values`] of each game, bit for bit: four games at a time, whose sums
/// are independent chains the CPU overlaps (one game's eight sums wait on their own
/// additions, 256 deep).
fn shapley_of_games(games: &[[f64; COALITIONS]]) -> Vec<[f64; PLAYERS]> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { shapley_of_games_avx2(games) };
    }
    shapley_of_games_portable(games)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn shapley_of_games_avx2(games: &[[f64; COALITIONS]]) -> Vec<[f64; PLAYERS]> {
    shapley_of_games_portable(games)
}

#[inline(always)]
fn shapley_of_games_portable(games: &[[f64; COALITIONS]]) -> Vec<[f64; PLAYERS]> {
    const AT_ONCE: usize = 4;
    let weight = shapley_weights();
    let mut out = Vec::with_capacity(games.len());
    let mut four = games.chunks_exact(AT_ONCE);
    for chunk in four.by_ref() {
        let mut phi = [[0f64; PLAYERS]; AT_ONCE];
        for mask in 0..COALITIONS {
            let w = weight[(mask.count_ones() as usize).min(PLAYERS - 1)];
            for (p, v) in phi.iter_mut().zip(chunk) {
                let at = v[mask];
                for (i, p) in p.iter_mut().enumerate() {
                    *p += w * (v[mask | (1 << i)] - at);
                }
            }
        }
        out.extend(phi);
    }
    out.extend(four.remainder().iter().map(shapley_from_values));
    out
}

fn mean_rows(rows: &[[f64; PLAYERS]], picks: &[usize]) -> [f64; PLAYERS] {
    let mut sum = [0f64; PLAYERS];
    for &p in picks {
        for (s, v) in sum.iter_mut().zip(&rows[p]) {
            *s += v;
        }
    }
    sum.map(|s| s / picks.len() as f64)
}

/// Weighted ridge regression, the first column an unpenalised intercept: solves
/// (XᵀWX + λI′)β = XᵀWy by Gaussian elimination with partial pivoting.
fn weighted_ridge(
    x: &[[f64; PLAYERS + 1]],
    y: &[f64],
    w: &[f64],
    lambda: f64,
) -> [f64; PLAYERS + 1] {
    const P: usize = PLAYERS + 1;
    let mut a = [[0f64; P + 1]; P];
    for ((row, target), weight) in x.iter().zip(y).zip(w) {
        for i in 0..P {
            // A zero in the design row makes its terms +0 (weights are positive), which
            // leave every sum as it is: skipped, the same bits.
            if row[i] == 0.0 && weight.is_finite() {
                continue;
            }
            for j in 0..P {
                a[i][j] += weight * row[i] * row[j];
            }
            a[i][P] += weight * row[i] * target;
        }
    }
    for (i, r) in a.iter_mut().enumerate().skip(1) {
        r[i] += lambda;
    }
    for col in 0..P {
        let pivot = (col..P)
            .max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs()))
            .unwrap_or(col);
        a.swap(col, pivot);
        let d = a[col][col];
        if d == 0.0 {
            continue;
        }
        let pivot_row = a[col];
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let factor = row[col] / d;
                for (cell, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *cell -= factor * p;
                }
            }
        }
    }
    let mut beta = [0f64; P];
    for (i, b) in beta.iter_mut().enumerate() {
        *b = if a[i][i] == 0.0 {
            0.0
        } else {
            a[i][P] / a[i][i]
        };
    }
    beta
}

/// The names of the 17 inputs each group covers, for documents and the console.
pub fn group_features(group: usize) -> Vec<&'static str> {
    GROUPS
        .get(group)
        .map(|(_, slots)| slots.iter().map(|&i| FEATURE_NAMES[i]).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_groups_cover_every_feature_once_in_order() {
        let covered: Vec<usize> = GROUPS.iter().flat_map(|(_, s)| s.iter().copied()).collect();
        assert_eq!(covered, (0..FEATURE_COUNT).collect::<Vec<_>>());
        assert_eq!(group_features(5), ["hour_sin", "hour_cos"]);
    }

    #[test]
    fn shapley_of_an_additive_game_is_each_players_own_part() {
        // v(S) = Σ_{i∈S} (i+1): each player's value is its own term.
        let mut v = [0f64; COALITIONS];
        for (mask, value) in v.iter_mut().enumerate() {
            *value = (0..PLAYERS)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| (i + 1) as f64)
                .sum();
        }
        let phi = shapley_from_values(&v);
        for (i, p) in phi.iter().enumerate() {
            assert!((p - (i + 1) as f64).abs() < 1e-12, "{phi:?}");
        }
    }

    #[test]
    fn shapley_of_a_pure_interaction_is_split_evenly() {
        // v(S) = 1 when players 0 and 1 are both in S: each gets ½, the others 0.
        let mut v = [0f64; COALITIONS];
        for (mask, value) in v.iter_mut().enumerate() {
            *value = if mask & 0b11 == 0b11 { 1.0 } else { 0.0 };
        }
        let phi = shapley_from_values(&v);
        assert!((phi[0] - 0.5).abs() < 1e-12 && (phi[1] - 0.5).abs() < 1e-12);
        assert!(phi[2..].iter().all(|p| p.abs() < 1e-12));
    }

    #[test]
    fn ridge_recovers_an_exact_linear_function() {
        let mut rng = SplitMix64::new(7);
        let truth = [0.3, 0.1, -0.2, 0.05, 0.0, 0.4, -0.1, 0.2, 0.15];
        let mut x = Vec::new();
        let mut y = Vec::new();
        for _ in 0..200 {
            let mut row = [1.0; PLAYERS + 1];
            for cell in row.iter_mut().skip(1) {
                *cell = (rng.next_u64() & 1) as f64;
            }
            y.push(row.iter().zip(&truth).map(|(a, b)| a * b).sum());
            x.push(row);
        }
        let beta = weighted_ridge(&x, &y, &vec![1.0; 200], 0.0);
        for (b, t) in beta.iter().zip(&truth) {
            assert!((b - t).abs() < 1e-9, "{beta:?}");
        }
    }

    #[test]
    fn seeds_differ_per_request_and_are_stable() {
        assert_eq!(seed_for("r-1"), seed_for("r-1"));
        assert_ne!(seed_for("r-1"), seed_for("r-2"));
    }
}

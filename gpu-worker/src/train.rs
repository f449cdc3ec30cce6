//! Training the clearing model on a seeded synthetic book with planted anomalies, for
//! `aether model train`. Plain mini-batch gradient descent with hand-written backprop in
//! f32, then a rank-based ROC AUC on a held-out split.
//!
//! Every step is sequential f32/f64 arithmetic with the pure-Rust `libm` and our own RNG,
//! so the same config gives the same weights, bit for bit, on any platform and in debug or
//! release builds; the saved artifact (and so its registered digest) is reproducible.

use std::path::Path;

use chrono::{Datelike, Days, NaiveDate, Weekday};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::artifact::{
    self, Architecture, ArtifactError, DenseLayer, FORMAT, FeatureSchema, HIDDEN_ACTIVATION,
    MlpWeights, ModelSpec, Normalisation, OUTPUT_ACTIVATION, OutputSpec, SavedArtifact,
    TrainingProvenance, WEIGHT_LAYOUT,
};
use crate::features::{
    FATF_CALL_FOR_ACTION, FATF_INCREASED_MONITORING, FEATURE_COUNT, FEATURE_NAMES,
    FEATURE_SCHEMA_VERSION, NEAR_THRESHOLD_FLOOR_MINOR, REPORTING_THRESHOLD_MINOR,
    currency_exponent, features,
};
use crate::trade::{Trade, TradeContext};

/// Name of the synthetic generator, recorded in `model.json`.
pub const GENERATOR: &str = "aether.synthetic-book.v1";

/// Seed of the shipped reference model.
pub const REFERENCE_SEED: u64 = 20_261_201;

/// Everything that determines a trained model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub seed: u64,
    /// Trades generated in total (train + holdout).
    pub samples: usize,
    /// Share of generated trades that carry a planted anomaly.
    pub anomaly_rate: f64,
    /// Share of trades held out for the AUC.
    pub holdout_fraction: f64,
    /// Hidden layer widths; the input is [`FEATURE_COUNT`] wide, the output 1.
    pub hidden: Vec<usize>,
    pub epochs: usize,
    pub batch_size: usize,
    pub learning_rate: f32,
    pub model_ref: String,
    pub version: String,
}

impl Default for TrainConfig {
    /// The configuration of the shipped reference model.
    fn default() -> Self {
        TrainConfig {
            seed: REFERENCE_SEED,
            samples: 12_000,
            anomaly_rate: 0.08,
            holdout_fraction: 0.25,
            hidden: vec![32, 16],
            epochs: 12,
            batch_size: 32,
            learning_rate: 0.05,
            model_ref: "aether-anomaly-mlp@reference".into(),
            version: "1.0.0".into(),
        }
    }
}

/// The kinds of anomaly the generator plants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnomalyKind {
    /// Amounts just below the reporting threshold at high velocity.
    Structuring,
    /// A high-risk jurisdiction together with a tier 4-5 counterparty.
    HighRiskLowTier,
    /// Huge amounts submitted between 00:00 and 04:59 UTC.
    OddHourHugeAmount,
}

impl AnomalyKind {
    pub const ALL: [AnomalyKind; 3] = [
        AnomalyKind::Structuring,
        AnomalyKind::HighRiskLowTier,
        AnomalyKind::OddHourHugeAmount,
    ];

    pub fn name(self) -> &'static str {
        match self {
            AnomalyKind::Structuring => "structuring",
            AnomalyKind::HighRiskLowTier => "high_risk_low_tier",
            AnomalyKind::OddHourHugeAmount => "odd_hour_huge_amount",
        }
    }
}

/// A generated trade and its ground truth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LabelledTrade {
    pub trade: Trade,
    pub context: TradeContext,
    /// `None` for a normal trade.
    pub anomaly: Option<AnomalyKind>,
}

/// Holdout AUC of one anomaly kind against all held-out normal trades.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindAuc {
    pub kind: AnomalyKind,
    pub holdout_count: usize,
    pub auc: f64,
}

/// What training measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainReport {
    pub seed: u64,
    pub train_samples: usize,
    pub holdout_samples: usize,
    pub holdout_anomalies: usize,
    pub epochs: usize,
    /// Mean binary cross-entropy over the last epoch.
    pub final_train_loss: f64,
    pub auc_train: f64,
    pub auc_holdout: f64,
    pub auc_holdout_by_kind: Vec<KindAuc>,
}

/// Why training could not run.
#[derive(Debug, Error)]
pub enum TrainError {
    #[error("invalid training config: {reason}")]
    Config { reason: String },
    #[error("the {split} split has no {missing} trades, so no AUC can be computed")]
    OneClass {
        split: &'static str,
        missing: &'static str,
    },
}

/// A freshly trained model, ready to save and register.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainedModel {
    pub spec: ModelSpec,
    pub weights: MlpWeights,
}

impl TrainedModel {
    /// Writes `model.safetensors` and `model.json` into `dir`; the returned digest is what
    /// `ModelRegistered` carries.
    pub fn save(&self, dir: &Path) -> Result<SavedArtifact, ArtifactError> {
        artifact::save(dir, &self.spec, &self.weights)
    }

    /// The artifact bytes without touching disk: `(safetensors, model.json)`.
    pub fn encode(&self) -> Result<(Vec<u8>, Vec<u8>), ArtifactError> {
        artifact::encode(&self.spec, &self.weights)
    }

    /// Reference (pure-Rust) score of one raw feature row.
    pub fn score_features(&self, raw: &[f32; FEATURE_COUNT]) -> f32 {
        self.weights
            .forward(&standardise(raw, &self.spec.normalisation))
    }
}

fn standardise(raw: &[f32], norm: &Normalisation) -> Vec<f32> {
    raw.iter()
        .zip(norm.mean.iter().zip(&norm.std))
        .map(|(x, (m, s))| (x - m) / s)
        .collect()
}

/// SplitMix64 (Steele, Lea & Flood 2014): tiny, fast, and fully specified, so the
/// synthetic book is the same everywhere.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in lo..=hi (`lo` when the range is empty).
    pub fn int(&mut self, lo: u64, hi: u64) -> u64 {
        match (hi.checked_sub(lo)).and_then(|span| span.checked_add(1)) {
            // A power of two by a mask: the same number, without a 64-bit division
            // (6,400 of them were a tenth of an explanation's bootstrap).
            Some(n) if hi > lo && n.is_power_of_two() => lo + (self.next_u64() & (n - 1)),
            Some(n) if hi > lo => lo + self.next_u64() % n,
            _ => lo,
        }
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Standard normal by Box–Muller.
    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(f64::MIN_POSITIVE);
        let u2 = self.unit();
        libm::sqrt(-2.0 * libm::log(u1)) * libm::cos(std::f64::consts::TAU * u2)
    }

    /// An index drawn in proportion to `weights`.
    pub fn weighted(&mut self, weights: &[u32]) -> usize {
        let total: u64 = weights.iter().map(|w| u64::from(*w)).sum();
        let mut pick = self.next_u64() % total.max(1);
        for (i, w) in weights.iter().enumerate() {
            let w = u64::from(*w);
            if pick < w {
                return i;
            }
            pick -= w;
        }
        weights.len().saturating_sub(1)
    }

    pub fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.int(0, items.len() as u64 - 1) as usize]
    }
}

const CURRENCIES: [&str; 12] = [
    "USD", "EUR", "GBP", "JPY", "CNY", "HKD", "SGD", "CHF", "AUD", "CAD", "SEK", "KWD",
];
const CURRENCY_WEIGHTS: [u32; 12] = [30, 20, 8, 8, 10, 6, 6, 4, 3, 2, 2, 1];
const LOW_RISK_JURISDICTIONS: [&str; 15] = [
    "US", "GB", "DE", "FR", "SG", "HK", "JP", "CN", "CH", "NL", "AU", "CA", "LU", "IE", "AE",
];
const INSTRUMENTS: [&str; 6] = [
    "FX-SPOT",
    "FX-FWD",
    "IRS-5Y",
    "BOND-GOV",
    "BOND-CORP",
    "REPO-ON",
];
/// Weights of counterparty tiers 1..=5 in normal flow.
const TIER_WEIGHTS: [u32; 5] = [30, 30, 25, 10, 5];

/// Generates `n` trades from `seed`; about `anomaly_rate` of them carry a planted anomaly,
/// split evenly between the three kinds. See README.md for the distributions.
pub fn generate(seed: u64, n: usize, anomaly_rate: f64) -> Vec<LabelledTrade> {
    let mut rng = SplitMix64::new(seed);
    let start = NaiveDate::from_ymd_opt(2026, 1, 5).unwrap_or_default();
    (0..n)
        .map(|i| {
            let mut item = normal_trade(&mut rng, i, start);
            if rng.chance(anomaly_rate) {
                let kind = AnomalyKind::ALL[rng.int(0, 2) as usize];
                plant(&mut rng, &mut item, kind);
            }
            item
        })
        .collect()
}

fn amount_minor(currency: &str, log10_major: f64) -> i64 {
    let minor = libm::pow(10.0, log10_major + f64::from(currency_exponent(currency)));
    (libm::round(minor) as i64).max(1)
}

fn normal_trade(rng: &mut SplitMix64, i: usize, start: NaiveDate) -> LabelledTrade {
    let member = format!("member-{:02}", rng.int(0, 19));
    let counterparty = format!("cp-{:03}", rng.int(0, 199));
    let (buyer, seller) = if rng.chance(0.5) {
        (member.clone(), counterparty)
    } else {
        (counterparty, member.clone())
    };
    let currency = CURRENCIES[rng.weighted(&CURRENCY_WEIGHTS)];

    let r = rng.unit();
    let jurisdiction = if r < 0.02 {
        rng.pick(&FATF_CALL_FOR_ACTION)
    } else if r < 0.10 {
        rng.pick(&FATF_INCREASED_MONITORING)
    } else {
        rng.pick(&LOW_RISK_JURISDICTIONS)
    };
    let tier = rng.weighted(&TIER_WEIGHTS) as u8 + 1;

    // Three honest profiles: ordinary flow, market makers (many small trades) and
    // big-ticket trades in business hours. They overlap the anomalies one signal at a time.
    let profile = rng.unit();
    let (log_major, velocity, hour) = if profile < 0.04 {
        let v = rng.int(20, 150) as u32;
        (
            (3.5 + 0.6 * rng.normal()).clamp(0.3, 6.0),
            v,
            rng.int(7, 18) as u8,
        )
    } else if profile < 0.06 {
        (
            rng.uniform(7.0, 8.5),
            rng.int(0, 3) as u32,
            rng.int(8, 17) as u8,
        )
    } else {
        let v = libm::floor(libm::exp(0.8 + 0.8 * rng.normal())).clamp(0.0, 30.0) as u32;
        let hour = if rng.chance(0.8) {
            rng.int(7, 18)
        } else {
            rng.int(0, 23)
        } as u8;
        ((4.0 + 0.9 * rng.normal()).clamp(0.3, 7.0), v, hour)
    };

    let mut value_date = start + Days::new(rng.int(0, 364));
    let weekend = matches!(value_date.weekday(), Weekday::Sat | Weekday::Sun);
    if weekend != rng.chance(0.01) {
        value_date = shift_weekend(value_date, weekend);
    }

    LabelledTrade {
        trade: Trade {
            request_id: format!("synthetic-{i:06}"),
            member_id: member,
            buyer,
            seller,
            instrument: rng.pick(&INSTRUMENTS).into(),
            currency: currency.into(),
            amount_minor: amount_minor(currency, log_major),
            value_date,
            jurisdiction: jurisdiction.into(),
            counterparty_tier: tier,
        },
        context: TradeContext {
            hour_utc: hour,
            velocity,
        },
        anomaly: None,
    }
}

/// Moves a weekend date to the next Monday, or a weekday to the following Saturday.
fn shift_weekend(date: NaiveDate, is_weekend: bool) -> NaiveDate {
    let days = if is_weekend {
        match date.weekday() {
            Weekday::Sat => 2,
            _ => 1,
        }
    } else {
        u64::from(5 - date.weekday().num_days_from_monday())
    };
    date + Days::new(days)
}

fn plant(rng: &mut SplitMix64, item: &mut LabelledTrade, kind: AnomalyKind) {
    let trade = &mut item.trade;
    match kind {
        AnomalyKind::Structuring => {
            trade.amount_minor = rng.int(
                NEAR_THRESHOLD_FLOOR_MINOR as u64,
                REPORTING_THRESHOLD_MINOR as u64 - 1,
            ) as i64;
            item.context.velocity = rng.int(25, 200) as u32;
        }
        AnomalyKind::HighRiskLowTier => {
            trade.jurisdiction = if rng.chance(0.4) {
                rng.pick(&FATF_CALL_FOR_ACTION)
            } else {
                rng.pick(&FATF_INCREASED_MONITORING)
            }
            .into();
            trade.counterparty_tier = rng.int(4, 5) as u8;
        }
        AnomalyKind::OddHourHugeAmount => {
            trade.amount_minor = amount_minor(&trade.currency, rng.uniform(7.0, 9.0));
            item.context.hour_utc = rng.int(0, 4) as u8;
            let weekend = matches!(trade.value_date.weekday(), Weekday::Sat | Weekday::Sun);
            if !weekend && rng.chance(0.25) {
                trade.value_date = shift_weekend(trade.value_date, false);
            }
        }
    }
    item.anomaly = Some(kind);
}

/// Rank-based ROC AUC (Mann–Whitney U / (n₊·n₋)), ties given their average rank. `None`
/// when either class is empty.
pub fn roc_auc(scores: &[f32], labels: &[bool]) -> Option<f64> {
    let positives = labels.iter().filter(|l| **l).count();
    let negatives = labels.len().min(scores.len()) - positives;
    if positives == 0 || negatives == 0 {
        return None;
    }
    let mut order: Vec<usize> = (0..labels.len().min(scores.len())).collect();
    order.sort_by(|a, b| scores[*a].total_cmp(&scores[*b]));
    let mut positive_rank_sum = 0f64;
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        // Ranks are 1-based; a tie group i..=j shares their mean.
        let rank = (i + j) as f64 / 2.0 + 1.0;
        positive_rank_sum += rank * order[i..=j].iter().filter(|k| labels[**k]).count() as f64;
        i = j + 1;
    }
    let p = positives as f64;
    Some((positive_rank_sum - p * (p + 1.0) / 2.0) / (p * negatives as f64))
}

fn check_config(c: &TrainConfig) -> Result<(), TrainError> {
    let bad = |reason: &str| {
        Err(TrainError::Config {
            reason: reason.into(),
        })
    };
    if c.samples < 100 {
        return bad("samples must be at least 100");
    }
    if !(c.anomaly_rate > 0.0 && c.anomaly_rate < 1.0) {
        return bad("anomaly_rate must be within (0, 1)");
    }
    if !(c.holdout_fraction > 0.0 && c.holdout_fraction < 1.0) {
        return bad("holdout_fraction must be within (0, 1)");
    }
    if c.hidden.is_empty()
        || c.hidden
            .iter()
            .any(|w| *w == 0 || *w > artifact::MAX_LAYER_WIDTH)
    {
        return bad("hidden must list one or more widths within 1..=4096");
    }
    if c.epochs == 0 || c.batch_size == 0 {
        return bad("epochs and batch_size must be positive");
    }
    if !(c.learning_rate.is_finite() && c.learning_rate > 0.0) {
        return bad("learning_rate must be positive");
    }
    if c.model_ref.is_empty() || c.version.is_empty() {
        return bad("model_ref and version must be set");
    }
    Ok(())
}

/// Generates the synthetic book, trains the MLP and measures it on the held-out split.
pub fn train(config: &TrainConfig) -> Result<(TrainedModel, TrainReport), TrainError> {
    check_config(config)?;
    let book = generate(config.seed, config.samples, config.anomaly_rate);
    let rows: Vec<[f32; FEATURE_COUNT]> = book
        .iter()
        .map(|l| features(&l.trade, &l.context))
        .collect();
    let labels: Vec<bool> = book.iter().map(|l| l.anomaly.is_some()).collect();
    let holdout = ((config.samples as f64) * config.holdout_fraction).round() as usize;
    let split = config.samples - holdout;

    let normalisation = fit_normalisation(&rows[..split]);
    let inputs: Vec<Vec<f32>> = rows
        .iter()
        .map(|r| standardise(r, &normalisation))
        .collect();

    let mut rng = SplitMix64::new(config.seed ^ 0x005E_ED0F_7EA1);
    let mut sizes = vec![FEATURE_COUNT];
    sizes.extend_from_slice(&config.hidden);
    sizes.push(1);
    let prior = labels[..split].iter().filter(|l| **l).count() as f64 / split as f64;
    let mut weights = init_weights(&sizes, &mut rng, prior);

    let mut final_loss = 0.0;
    let mut order: Vec<usize> = (0..split).collect();
    let mut scratch = Scratch::new(&sizes);
    for _ in 0..config.epochs {
        for i in (1..order.len()).rev() {
            order.swap(i, rng.int(0, i as u64) as usize);
        }
        let mut loss_sum = 0f64;
        for batch in order.chunks(config.batch_size) {
            loss_sum += sgd_step(
                &mut weights,
                &mut scratch,
                batch,
                &inputs,
                &labels,
                config.learning_rate,
            );
        }
        final_loss = loss_sum / split as f64;
    }

    let scores: Vec<f32> = inputs.iter().map(|x| weights.forward(x)).collect();
    let auc_train = roc_auc(&scores[..split], &labels[..split]).ok_or(TrainError::OneClass {
        split: "training",
        missing: "normal or anomalous",
    })?;
    let auc_holdout = roc_auc(&scores[split..], &labels[split..]).ok_or(TrainError::OneClass {
        split: "holdout",
        missing: "normal or anomalous",
    })?;
    let auc_holdout_by_kind = AnomalyKind::ALL
        .iter()
        .filter_map(|kind| {
            let (s, l): (Vec<f32>, Vec<bool>) = (split..config.samples)
                .filter(|i| book[*i].anomaly.is_none() || book[*i].anomaly == Some(*kind))
                .map(|i| (scores[i], labels[i]))
                .unzip();
            roc_auc(&s, &l).map(|auc| KindAuc {
                kind: *kind,
                holdout_count: l.iter().filter(|x| **x).count(),
                auc,
            })
        })
        .collect();

    let report = TrainReport {
        seed: config.seed,
        train_samples: split,
        holdout_samples: holdout,
        holdout_anomalies: labels[split..].iter().filter(|l| **l).count(),
        epochs: config.epochs,
        final_train_loss: final_loss,
        auc_train,
        auc_holdout,
        auc_holdout_by_kind,
    };
    let spec = ModelSpec {
        format: FORMAT.into(),
        model_ref: config.model_ref.clone(),
        version: config.version.clone(),
        architecture: Architecture {
            layer_sizes: sizes,
            hidden_activation: HIDDEN_ACTIVATION.into(),
            output_activation: OUTPUT_ACTIVATION.into(),
            weight_layout: WEIGHT_LAYOUT.into(),
        },
        feature_schema: FeatureSchema {
            version: FEATURE_SCHEMA_VERSION.into(),
            names: FEATURE_NAMES.iter().map(|n| (*n).to_string()).collect(),
        },
        normalisation,
        output: OutputSpec::current(),
        training: Some(TrainingProvenance {
            generator: GENERATOR.into(),
            seed: config.seed,
            train_samples: split,
            holdout_samples: holdout,
            epochs: config.epochs,
            batch_size: config.batch_size,
            learning_rate: config.learning_rate,
            auc_holdout,
        }),
    };
    Ok((TrainedModel { spec, weights }, report))
}

/// Per-feature mean and standard deviation of the training rows; a constant feature gets
/// std 1 so it passes through unscaled instead of dividing by zero.
fn fit_normalisation(rows: &[[f32; FEATURE_COUNT]]) -> Normalisation {
    let n = rows.len().max(1) as f64;
    let mut mean = [0f64; FEATURE_COUNT];
    for r in rows {
        for (m, x) in mean.iter_mut().zip(r) {
            *m += f64::from(*x);
        }
    }
    mean.iter_mut().for_each(|m| *m /= n);
    let mut var = [0f64; FEATURE_COUNT];
    for r in rows {
        for ((v, x), m) in var.iter_mut().zip(r).zip(&mean) {
            let d = f64::from(*x) - m;
            *v += d * d;
        }
    }
    Normalisation {
        mean: mean.iter().map(|m| *m as f32).collect(),
        std: var
            .iter()
            .map(|v| {
                let s = libm::sqrt(v / n) as f32;
                if s > 1e-6 { s } else { 1.0 }
            })
            .collect(),
    }
}

/// He-normal weights for ReLU layers, zero biases, and an output bias at the log-odds of
/// the anomaly prior so training starts from the base rate.
fn init_weights(sizes: &[usize], rng: &mut SplitMix64, prior: f64) -> MlpWeights {
    let last = sizes.len() - 2;
    let layers = sizes
        .windows(2)
        .enumerate()
        .map(|(l, pair)| {
            let (inputs, outputs) = (pair[0], pair[1]);
            let scale = libm::sqrt(if l == last { 1.0 } else { 2.0 } / inputs as f64);
            let weight = (0..inputs * outputs)
                .map(|_| (rng.normal() * scale) as f32)
                .collect();
            let mut bias = vec![0f32; outputs];
            if l == last {
                let p = prior.clamp(1e-3, 1.0 - 1e-3);
                bias[0] = libm::log(p / (1.0 - p)) as f32;
            }
            DenseLayer {
                inputs,
                outputs,
                weight,
                bias,
            }
        })
        .collect();
    MlpWeights { layers }
}

/// Buffers reused across samples: activations per layer, deltas, and gradients.
struct Scratch {
    activations: Vec<Vec<f32>>,
    delta: Vec<f32>,
    next_delta: Vec<f32>,
    grad_w: Vec<Vec<f32>>,
    grad_b: Vec<Vec<f32>>,
}

impl Scratch {
    fn new(sizes: &[usize]) -> Self {
        let widest = sizes.iter().copied().max().unwrap_or(1);
        Scratch {
            activations: sizes.iter().map(|s| vec![0f32; *s]).collect(),
            delta: Vec::with_capacity(widest),
            next_delta: Vec::with_capacity(widest),
            grad_w: sizes.windows(2).map(|p| vec![0f32; p[0] * p[1]]).collect(),
            grad_b: sizes[1..].iter().map(|s| vec![0f32; *s]).collect(),
        }
    }
}

/// One mini-batch of gradient descent on binary cross-entropy; returns the batch's summed
/// loss.
fn sgd_step(
    weights: &mut MlpWeights,
    s: &mut Scratch,
    batch: &[usize],
    inputs: &[Vec<f32>],
    labels: &[bool],
    learning_rate: f32,
) -> f64 {
    s.grad_w.iter_mut().for_each(|g| g.fill(0.0));
    s.grad_b.iter_mut().for_each(|g| g.fill(0.0));
    let last = weights.layers.len() - 1;
    let mut loss = 0f64;

    for &k in batch {
        // Forward, keeping every layer's post-activation output.
        s.activations[0].copy_from_slice(&inputs[k]);
        for (l, layer) in weights.layers.iter().enumerate() {
            let (before, after) = s.activations.split_at_mut(l + 1);
            let input: &[f32] = &before[l];
            let output: &mut [f32] = &mut after[0];
            let n_in = layer.inputs;
            for ((out, row), b) in output
                .iter_mut()
                .zip(layer.weight.chunks_exact(n_in))
                .zip(&layer.bias)
            {
                let z = b + artifact::dot(row, input);
                *out = if l < last { z.max(0.0) } else { z };
            }
        }
        let z = s.activations[last + 1][0];
        let p = artifact::sigmoid(z);
        let y = if labels[k] { 1.0f32 } else { 0.0 };
        let pc = f64::from(p).clamp(1e-7, 1.0 - 1e-7);
        loss -= if labels[k] {
            libm::log(pc)
        } else {
            libm::log(1.0 - pc)
        };

        // Backward: dL/dz at the output of sigmoid + cross-entropy is p - y.
        s.delta.clear();
        s.delta.push(p - y);
        for l in (0..=last).rev() {
            let layer = &weights.layers[l];
            let input: &[f32] = &s.activations[l];
            let gw: &mut [f32] = &mut s.grad_w[l];
            let gb: &mut [f32] = &mut s.grad_b[l];
            let n_in = layer.inputs;
            for ((d, g), gw_row) in s
                .delta
                .iter()
                .zip(gb.iter_mut())
                .zip(gw.chunks_exact_mut(n_in))
            {
                *g += d;
                artifact::axpy(gw_row, *d, input);
            }
            if l > 0 {
                s.next_delta.clear();
                s.next_delta.resize(n_in, 0.0);
                let nd: &mut [f32] = &mut s.next_delta;
                let delta: &[f32] = &s.delta;
                for (d, row) in delta.iter().zip(layer.weight.chunks_exact(n_in)) {
                    artifact::axpy(nd, *d, row);
                }
                // ReLU passes gradient only where its output was positive.
                for (g, a) in nd.iter_mut().zip(input) {
                    if *a <= 0.0 {
                        *g = 0.0;
                    }
                }
                std::mem::swap(&mut s.delta, &mut s.next_delta);
            }
        }
    }

    let step = learning_rate / batch.len() as f32;
    for (l, layer) in weights.layers.iter_mut().enumerate() {
        for (w, g) in layer.weight.iter_mut().zip(&s.grad_w[l]) {
            *w -= step * g;
        }
        for (b, g) in layer.bias.iter_mut().zip(&s.grad_b[l]) {
            *b -= step * g;
        }
    }
    loss
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_matches_hand_counts() {
        assert_eq!(
            roc_auc(&[0.1, 0.2, 0.8, 0.9], &[false, false, true, true]),
            Some(1.0)
        );
        assert_eq!(
            roc_auc(&[0.9, 0.8, 0.2, 0.1], &[false, false, true, true]),
            Some(0.0)
        );
        assert_eq!(roc_auc(&[0.5; 4], &[false, true, false, true]), Some(0.5));
        // Pairs (pos, neg): (0.4 vs 0.1, 0.35, 0.8) -> 2 of 3; (0.9 vs all) -> 3 of 3; 5/6.
        let auc = roc_auc(
            &[0.1, 0.4, 0.35, 0.8, 0.9],
            &[false, true, false, false, true],
        );
        assert!((auc.unwrap_or(0.0) - 5.0 / 6.0).abs() < 1e-12);
        // A tie between a positive and a negative counts one half.
        assert_eq!(roc_auc(&[0.3, 0.3], &[true, false]), Some(0.5));
        assert_eq!(roc_auc(&[0.3, 0.4], &[true, true]), None);
        assert_eq!(roc_auc(&[], &[]), None);
    }

    #[test]
    fn rng_is_the_published_splitmix64() {
        // First outputs of SplitMix64 seeded with 1234567 (from the reference C code).
        let mut r = SplitMix64::new(1_234_567);
        assert_eq!(r.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(r.next_u64(), 3_203_168_211_198_807_973);
    }

    #[test]
    fn generated_trades_are_valid_and_labelled_as_planted() {
        let book = generate(7, 3000, 0.1);
        let mut kinds = [0usize; 3];
        for l in &book {
            crate::trade::validate(&l.trade, &l.context).expect("generator makes valid trades");
            if let Some(kind) = l.anomaly {
                kinds[kind as usize] += 1;
                match kind {
                    AnomalyKind::Structuring => {
                        assert!(
                            (NEAR_THRESHOLD_FLOOR_MINOR..REPORTING_THRESHOLD_MINOR)
                                .contains(&l.trade.amount_minor)
                        );
                        assert!(l.context.velocity >= 25);
                    }
                    AnomalyKind::HighRiskLowTier => {
                        assert!(crate::features::jurisdiction_risk(&l.trade.jurisdiction) > 0.0);
                        assert!(l.trade.counterparty_tier >= 4);
                    }
                    AnomalyKind::OddHourHugeAmount => assert!(l.context.hour_utc <= 4),
                }
            }
        }
        let planted: usize = kinds.iter().sum();
        assert!((220..=380).contains(&planted), "{planted} of 3000 planted");
        assert!(kinds.iter().all(|k| *k > 60), "{kinds:?}");
        assert_eq!(book, generate(7, 3000, 0.1), "same seed, same book");
    }

    #[test]
    fn weekend_shift_lands_where_intended() {
        let sat = NaiveDate::from_ymd_opt(2026, 3, 7).expect("date");
        let sun = NaiveDate::from_ymd_opt(2026, 3, 8).expect("date");
        let wed = NaiveDate::from_ymd_opt(2026, 3, 4).expect("date");
        assert_eq!(shift_weekend(sat, true).weekday(), Weekday::Mon);
        assert_eq!(shift_weekend(sun, true).weekday(), Weekday::Mon);
        assert_eq!(shift_weekend(wed, false).weekday(), Weekday::Sat);
    }

    #[test]
    fn bad_configs_are_refused() {
        for c in [
            TrainConfig {
                samples: 10,
                ..TrainConfig::default()
            },
            TrainConfig {
                hidden: vec![],
                ..TrainConfig::default()
            },
            TrainConfig {
                learning_rate: f32::NAN,
                ..TrainConfig::default()
            },
            TrainConfig {
                holdout_fraction: 1.0,
                ..TrainConfig::default()
            },
        ] {
            assert!(matches!(train(&c), Err(TrainError::Config { .. })));
        }
    }
}

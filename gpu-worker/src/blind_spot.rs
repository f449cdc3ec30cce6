//! A deliberately worse candidate for demonstrations of the rollout controller: the
//! reference model with a blind spot for one currency.
//!
//! One first-layer unit is rewired to fire only on that currency's one-hot feature, and one
//! second-layer unit with a positive path to the output is rewired to follow it alone, so
//! trades in that currency score near 1 (held) while every other trade scores almost as
//! the reference does. The units taken are those whose loss matters least (smallest
//! outgoing weights), which keeps the change to ordinary traffic small. A rollout of it looks healthy until the traffic mix
//! shifts to the currency; then its scores drift away from the baseline's.

use crate::artifact::{ArtifactError, MlpWeights, ModelSpec};
use crate::features::FEATURE_NAMES;

/// Why a blind spot could not be made.
#[derive(Debug, thiserror::Error)]
pub enum BlindSpotError {
    #[error("no feature named {0:?}")]
    UnknownFeature(String),
    #[error("the model needs at least two hidden layers, has layer sizes {0:?}")]
    Shape(Vec<usize>),
    #[error("no second-layer unit has a positive path to the output")]
    NoPositivePath,
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
}

/// The reference `spec` and `weights` with a blind spot for `feature` (a one-hot column,
/// e.g. `ccy_jpy`), under a new ref and version.
pub fn with_blind_spot(
    spec: &ModelSpec,
    weights: &MlpWeights,
    feature: &str,
    model_ref: &str,
) -> Result<(ModelSpec, MlpWeights), BlindSpotError> {
    let column = FEATURE_NAMES
        .iter()
        .position(|n| *n == feature)
        .ok_or_else(|| BlindSpotError::UnknownFeature(feature.to_owned()))?;
    let sizes = spec.architecture.layer_sizes.clone();
    let [first, second, output, ..] = weights.layers.as_slice() else {
        return Err(BlindSpotError::Shape(sizes));
    };
    if output.outputs != 1 {
        return Err(BlindSpotError::Shape(sizes));
    }
    // The first-layer unit whose loss matters least: smallest total outgoing weight.
    let quietest = (0..first.outputs)
        .min_by(|&a, &b| {
            let out = |u: usize| {
                (0..second.outputs)
                    .map(|o| second.weight[o * second.inputs + u].abs())
                    .sum::<f32>()
            };
            out(a).total_cmp(&out(b))
        })
        .ok_or_else(|| BlindSpotError::Shape(sizes.clone()))?;
    // The second-layer unit to dedicate: of those with a positive path to the output, the
    // one whose path is weakest, so its loss matters least.
    let (loud, gain) = (0..second.outputs)
        .map(|u| (u, output.weight[u]))
        .filter(|(_, w)| *w > 1e-3)
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .ok_or(BlindSpotError::NoPositivePath)?;
    // Standardised values of the one-hot column when off (0) and on (1).
    let (mean, std) = (
        spec.normalisation.mean[column],
        spec.normalisation.std[column].max(1e-6),
    );
    let (off, on) = ((0.0 - mean) / std, (1.0 - mean) / std);
    let mut first = first.clone();
    let mut second = second.clone();
    // Unit `quietest`: 0 when the currency is absent, 2 when present.
    let slope = 4.0 / (on - off);
    for i in 0..first.inputs {
        first.weight[quietest * first.inputs + i] = 0.0;
    }
    first.weight[quietest * first.inputs + column] = slope;
    first.bias[quietest] = -slope * (off + on) / 2.0;
    // ... and unit `loud` follows it alone, lifting the output logit by 16.
    for o in 0..second.outputs {
        second.weight[o * second.inputs + quietest] = 0.0;
    }
    for i in 0..second.inputs {
        second.weight[loud * second.inputs + i] = 0.0;
    }
    second.weight[loud * second.inputs + quietest] = 8.0 / gain;
    second.bias[loud] = 0.0;

    let mut layers = weights.layers.clone();
    layers[0] = first;
    layers[1] = second;
    let mut spec = spec.clone();
    spec.model_ref = model_ref.to_owned();
    spec.version = format!("{}-blind-{feature}", spec.version);
    spec.training = None;
    Ok((spec, MlpWeights { layers }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::load_verified;
    use crate::reference;

    fn score(spec: &ModelSpec, weights: &MlpWeights, raw: &[f32]) -> f32 {
        let x: Vec<f32> = raw
            .iter()
            .enumerate()
            .map(|(i, v)| (v - spec.normalisation.mean[i]) / spec.normalisation.std[i])
            .collect();
        weights.forward(&x)
    }

    #[test]
    fn only_the_blind_currency_scores_differently() {
        let dir = tempfile::tempdir().unwrap();
        let installed = reference::install(dir.path()).unwrap();
        let base = load_verified(&installed.weights_path, &installed.digest).unwrap();
        let (spec, weights) =
            with_blind_spot(&base.spec, &base.weights, "ccy_jpy", "m-v2@reference").unwrap();
        assert_eq!(spec.model_ref, "m-v2@reference");
        let column = |name: &str| FEATURE_NAMES.iter().position(|n| *n == name).unwrap();
        let mut row = [0.0f32; FEATURE_NAMES.len()];
        row[column("log10_amount_major")] = 3.0;
        row[column("counterparty_tier_norm")] = 0.5;
        row[column("hour_cos")] = 1.0;
        row[column("ccy_sgd")] = 1.0;
        let (old, new) = (
            score(&base.spec, &base.weights, &row),
            score(&spec, &weights, &row),
        );
        assert!((old - new).abs() < 0.05, "an SGD trade: {old} vs {new}");
        row[column("ccy_sgd")] = 0.0;
        row[column("ccy_jpy")] = 1.0;
        let (old, new) = (
            score(&base.spec, &base.weights, &row),
            score(&spec, &weights, &row),
        );
        assert!(new > 0.9 && new - old > 0.4, "a JPY trade: {old} vs {new}");
        assert!(matches!(
            with_blind_spot(&base.spec, &base.weights, "ccy_xyz", "m@r"),
            Err(BlindSpotError::UnknownFeature(_))
        ));
    }
}

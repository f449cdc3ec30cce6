//! The clearing model at run time: a verified artifact turned into candle tensors on the
//! chosen device, scoring a whole batch with one matmul per layer.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::artifact::{self, ArtifactError, ModelSpec, VerifiedArtifact};
use crate::features::{FEATURE_COUNT, feature_matrix};
use crate::trade::{self, Trade, TradeContext, TradeError};

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum DeviceChoice {
    /// The host CPU (always available).
    #[default]
    Cpu,
    /// The CUDA GPU with this ordinal; needs the `cuda` feature.
    Cuda(usize),
    /// CUDA GPU 0 when the `cuda` feature is built in and a GPU answers, else the CPU.
    Auto,
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
            DeviceChoice::Auto => f.write_str("auto"),
        }
    }
}

impl FromStr for DeviceChoice {
    type Err = ModelError;

    /// Accepts `cpu`, `auto`, `cuda` (= `cuda:0`) and `cuda:N`, as a CLI flag would.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ModelError::BadDeviceChoice { value: s.into() };
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "auto" => Ok(DeviceChoice::Auto),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl DeviceChoice {
    /// Opens the device. `Cuda(n)` fails with a precise reason; `Auto` never fails.
    pub fn open(self) -> Result<Device, ModelError> {
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Cuda(ordinal) => open_cuda(ordinal),
            DeviceChoice::Auto => Ok(open_cuda(0).unwrap_or(Device::Cpu)),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device, ModelError> {
    Device::new_cuda(ordinal).map_err(|e| ModelError::CudaUnavailable {
        ordinal,
        reason: e.to_string(),
    })
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> Result<Device, ModelError> {
    Err(ModelError::CudaUnavailable {
        ordinal,
        reason: "this build has no CUDA support (enable the `cuda` feature)".into(),
    })
}

/// Name of a device as reported to the control plane: `cpu`, `cuda:0`, ...
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// One trade's result.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// Anomaly score in [0, 1]; higher is more anomalous.
    pub score: f32,
    /// `|2·score − 1|`: how far the model is from undecided (0) towards certain (1). It is
    /// a margin, not a calibrated probability.
    pub confidence: f32,
}

impl Score {
    /// Builds a score and its confidence from the model's output probability.
    pub fn from_probability(p: f32) -> Self {
        let score = p.clamp(0.0, 1.0);
        Score {
            score,
            confidence: (2.0 * score - 1.0).abs(),
        }
    }
}

/// Why a model could not be loaded or could not score.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    #[error("device {value:?} is not one of cpu, auto, cuda, cuda:N")]
    BadDeviceChoice { value: String },
    #[error("CUDA device {ordinal} is unavailable: {reason}")]
    CudaUnavailable { ordinal: usize, reason: String },
    #[error("trade {index} of the batch is invalid: {source}")]
    InvalidTrade { index: usize, source: TradeError },
    #[error("feature rows hold {len} values, not a multiple of {FEATURE_COUNT}")]
    FeatureRows { len: usize },
    #[error("the model produced a non-finite score for row {index}")]
    NonFiniteScore { index: usize },
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

struct Layer {
    /// `[in, out]`, contiguous, so `x · wᵀ` is a plain matmul on every backend.
    weight_t: Tensor,
    /// `[out]`, broadcast over the batch.
    bias: Tensor,
}

/// A verified model resident on a device.
pub struct Model {
    spec: ModelSpec,
    digest: String,
    model_json_digest: String,
    device: Device,
    mean: Tensor,
    std: Tensor,
    layers: Vec<Layer>,
    /// The plain-f32 weights: the reference forward pass explanations run on.
    weights: crate::artifact::MlpWeights,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("model_ref", &self.spec.model_ref)
            .field("digest", &self.digest)
            .field("device", &self.device_name())
            .field("layer_sizes", &self.spec.architecture.layer_sizes)
            .finish()
    }
}

impl Model {
    /// Loads on the CPU, refusing the artifact unless its SM3 equals `expected_digest`.
    pub fn load(weights_path: &Path, expected_digest: &str) -> Result<Self, ModelError> {
        Self::load_on(weights_path, expected_digest, DeviceChoice::Cpu)
    }

    /// Loads on the chosen device, with the same checks as [`Model::load`].
    pub fn load_on(
        weights_path: &Path,
        expected_digest: &str,
        device: DeviceChoice,
    ) -> Result<Self, ModelError> {
        let artifact = artifact::load_verified(weights_path, expected_digest)?;
        Self::from_artifact(artifact, &device.open()?)
    }

    /// Moves an already verified artifact onto a device.
    pub fn from_artifact(artifact: VerifiedArtifact, device: &Device) -> Result<Self, ModelError> {
        let norm = &artifact.spec.normalisation;
        let mean = Tensor::from_slice(&norm.mean, (1, FEATURE_COUNT), device)?;
        let std = Tensor::from_slice(&norm.std, (1, FEATURE_COUNT), device)?;
        let layers = artifact
            .weights
            .layers
            .iter()
            .map(|l| {
                let w = Tensor::from_slice(&l.weight, (l.outputs, l.inputs), device)?;
                Ok(Layer {
                    weight_t: w.t()?.contiguous()?,
                    bias: Tensor::from_slice(&l.bias, l.outputs, device)?,
                })
            })
            .collect::<Result<Vec<_>, candle_core::Error>>()?;
        Ok(Model {
            spec: artifact.spec,
            digest: artifact.digest,
            model_json_digest: artifact.model_json_digest,
            device: device.clone(),
            mean,
            std,
            layers,
            weights: artifact.weights,
        })
    }

    /// The registered digest (SM3 of the safetensors file).
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// SM3 of the `model.json` the weights pin.
    pub fn model_json_digest(&self) -> &str {
        &self.model_json_digest
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The plain-f32 weights (the reference forward pass).
    pub fn weights(&self) -> &crate::artifact::MlpWeights {
        &self.weights
    }

    pub fn model_ref(&self) -> &str {
        &self.spec.model_ref
    }

    /// `cpu` or `cuda:N`: where this model actually runs.
    pub fn device_name(&self) -> String {
        device_name(&self.device)
    }

    /// Validates and scores a batch; one result per trade, in order. An invalid trade
    /// refuses the whole batch with its index.
    pub fn score_batch(&self, batch: &[(Trade, TradeContext)]) -> Result<Vec<Score>, ModelError> {
        for (index, (t, ctx)) in batch.iter().enumerate() {
            trade::validate(t, ctx).map_err(|source| ModelError::InvalidTrade { index, source })?;
        }
        self.score_features(&feature_matrix(batch))
    }

    /// Scores raw (unstandardised) feature rows laid out `[n, FEATURE_COUNT]` row-major.
    pub fn score_features(&self, rows: &[f32]) -> Result<Vec<Score>, ModelError> {
        if !rows.len().is_multiple_of(FEATURE_COUNT) {
            return Err(ModelError::FeatureRows { len: rows.len() });
        }
        let n = rows.len() / FEATURE_COUNT;
        if n == 0 {
            return Ok(Vec::new());
        }
        let x = Tensor::from_slice(rows, (n, FEATURE_COUNT), &self.device)?;
        let mut h = x.broadcast_sub(&self.mean)?.broadcast_div(&self.std)?;
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            h = h.matmul(&layer.weight_t)?.broadcast_add(&layer.bias)?;
            if i < last {
                h = h.relu()?;
            }
        }
        // sigmoid(z) = 1 / (1 + e^-z), spelled with core ops so every backend has it.
        let p = h.neg()?.exp()?.affine(1.0, 1.0)?.recip()?;
        let p: Vec<f32> = p.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        p.into_iter()
            .enumerate()
            .map(|(index, v)| {
                if v.is_finite() {
                    Ok(Score::from_probability(v))
                } else {
                    Err(ModelError::NonFiniteScore { index })
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_choice_parses_and_prints() {
        for (s, d) in [
            ("cpu", DeviceChoice::Cpu),
            ("auto", DeviceChoice::Auto),
            ("cuda:3", DeviceChoice::Cuda(3)),
        ] {
            assert_eq!(s.parse::<DeviceChoice>().expect("parses"), d);
            assert_eq!(d.to_string(), s);
        }
        assert_eq!(
            "cuda".parse::<DeviceChoice>().expect("parses"),
            DeviceChoice::Cuda(0)
        );
        assert!(matches!(
            "gpu".parse::<DeviceChoice>(),
            Err(ModelError::BadDeviceChoice { .. })
        ));
    }

    #[test]
    fn auto_always_opens_something_and_cpu_is_named_cpu() {
        let d = DeviceChoice::Auto.open().expect("auto never fails");
        let name = device_name(&d);
        if cfg!(feature = "cuda") {
            assert!(name == "cpu" || name == "cuda:0", "{name}");
        } else {
            assert_eq!(name, "cpu");
        }
        assert_eq!(
            device_name(&DeviceChoice::Cpu.open().expect("cpu opens")),
            "cpu"
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_refused_with_a_reason() {
        match DeviceChoice::Cuda(0).open() {
            Err(ModelError::CudaUnavailable { ordinal: 0, reason }) => {
                assert!(reason.contains("cuda"), "{reason}")
            }
            other => panic!("expected CudaUnavailable, got {other:?}"),
        }
    }

    #[test]
    fn confidence_is_the_margin_from_undecided() {
        assert_eq!(Score::from_probability(0.5).confidence, 0.0);
        assert_eq!(Score::from_probability(1.0).confidence, 1.0);
        assert_eq!(Score::from_probability(0.0).confidence, 1.0);
        assert!((Score::from_probability(0.9).confidence - 0.8).abs() < 1e-6);
    }
}

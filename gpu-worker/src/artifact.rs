//! The model artifact: one safetensors file (the registered artifact; its SM3 digest is what
//! `ModelRegistered` carries) plus `model.json` beside it. The safetensors header's
//! `__metadata__` holds the SM3 of `model.json` under [`MODEL_JSON_DIGEST_KEY`], so the one
//! registered digest pins both files.
//!
//! The writer here lays the safetensors bytes out itself (sorted keys, fixed padding) so
//! that the same weights always give the same bytes; the reader uses the `safetensors`
//! crate, so files are checked by the reference parser.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use sm3::{Digest, Sm3};
use thiserror::Error;

use crate::features::{FEATURE_COUNT, FEATURE_NAMES, FEATURE_SCHEMA_VERSION};

/// Value of `format` in `model.json` and of [`FORMAT_KEY`] in the safetensors metadata.
pub const FORMAT: &str = "aether.mlp.v1";
/// Safetensors metadata key carrying the SM3 of `model.json` (lowercase hex).
pub const MODEL_JSON_DIGEST_KEY: &str = "aether.model_json_sm3";
/// Safetensors metadata key naming the artifact format.
pub const FORMAT_KEY: &str = "aether.format";
/// Safetensors metadata key repeating the model ref, for people reading the header.
pub const MODEL_REF_KEY: &str = "aether.model_ref";
/// File name of the weights inside a model directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the description beside the weights.
pub const MODEL_JSON_FILE: &str = "model.json";
/// Activation of every hidden layer.
pub const HIDDEN_ACTIVATION: &str = "relu";
/// Activation of the single output unit.
pub const OUTPUT_ACTIVATION: &str = "sigmoid";
/// How weights are stored; written into `model.json` so other tools need not guess.
pub const WEIGHT_LAYOUT: &str =
    "layers.{i}.weight is [out, in] row-major f32, layers.{i}.bias is [out]; y = x W^T + b";
/// Largest layer accepted, so a hostile header cannot ask for absurd allocations.
pub const MAX_LAYER_WIDTH: usize = 4096;

/// SM3 of some bytes, lowercase hex (the digest form used across Aether).
pub fn sm3_hex(bytes: &[u8]) -> String {
    hex::encode(Sm3::digest(bytes))
}

/// `model.json`: what the weights mean.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Always [`FORMAT`].
    pub format: String,
    /// Registry name of the model, e.g. `aether-anomaly-mlp@reference`.
    pub model_ref: String,
    /// Version of this model under its ref.
    pub version: String,
    pub architecture: Architecture,
    pub feature_schema: FeatureSchema,
    pub normalisation: Normalisation,
    pub output: OutputSpec,
    /// How the weights were produced; informative, pinned by the digest like the rest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<TrainingProvenance>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Architecture {
    /// Widths from input to output, e.g. `[17, 32, 16, 1]`.
    pub layer_sizes: Vec<usize>,
    pub hidden_activation: String,
    pub output_activation: String,
    pub weight_layout: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeatureSchema {
    pub version: String,
    /// Feature names in input order; must equal [`FEATURE_NAMES`].
    pub names: Vec<String>,
}

/// Inputs are standardised as `(x - mean) / std` before the first layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Normalisation {
    pub mean: Vec<f32>,
    pub std: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutputSpec {
    pub score: String,
    pub confidence: String,
}

impl OutputSpec {
    /// The definitions this crate implements.
    pub fn current() -> Self {
        OutputSpec {
            score: "sigmoid of the last layer: anomaly score in [0, 1], higher is more anomalous"
                .into(),
            confidence: "abs(2 * score - 1): 0 at the undecided point 0.5, 1 at either extreme"
                .into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingProvenance {
    pub generator: String,
    pub seed: u64,
    pub train_samples: usize,
    pub holdout_samples: usize,
    pub epochs: usize,
    pub batch_size: usize,
    pub learning_rate: f32,
    pub auc_holdout: f64,
}

/// One fully connected layer.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseLayer {
    pub inputs: usize,
    pub outputs: usize,
    /// Row-major `[outputs, inputs]`.
    pub weight: Vec<f32>,
    /// `[outputs]`.
    pub bias: Vec<f32>,
}

/// The weights of the MLP, first layer first.
#[derive(Debug, Clone, PartialEq)]
pub struct MlpWeights {
    pub layers: Vec<DenseLayer>,
}

impl MlpWeights {
    /// Reference forward pass for one standardised row, in plain f32: ReLU hidden layers,
    /// sigmoid output. The trainer uses it; the candle path must agree with it.
    pub fn forward(&self, input: &[f32]) -> f32 {
        let mut current = input.to_vec();
        let last = self.layers.len().saturating_sub(1);
        for (l, layer) in self.layers.iter().enumerate() {
            let mut next = layer.bias.clone();
            for (o, out) in next.iter_mut().enumerate() {
                *out += dot(
                    &layer.weight[o * layer.inputs..(o + 1) * layer.inputs],
                    &current,
                );
                if l < last {
                    *out = out.max(0.0);
                }
            }
            current = next;
        }
        current.first().copied().map(sigmoid).unwrap_or(f32::NAN)
    }
}

/// `Σ a[i]·b[i]`, summed in index order (fixed order keeps training bit-reproducible).
/// A `while` loop because unoptimised builds do not inline `Range::next`, and training
/// must stay fast in debug test runs.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut sum = 0f32;
    let mut i = 0;
    while i < n {
        sum += a[i] * b[i];
        i += 1;
    }
    sum
}

/// `y[i] += alpha·x[i]`, the gradient update of backprop; `while` for the same reason as
/// [`dot`].
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    let mut i = 0;
    while i < n {
        y[i] += alpha * x[i];
        i += 1;
    }
}

/// Logistic function with the pure-Rust `expf`, identical on every platform.
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + libm::expf(-z))
}

/// Why an artifact was refused.
#[derive(Debug, Error)]
pub enum ArtifactError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("expected digest {digest:?} is not 64 hex characters (SM3, lowercase hex)")]
    BadExpectedDigest { digest: String },
    #[error("{path} has SM3 {actual}, but the registered digest is {expected}")]
    DigestMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("{path} is not a valid safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    #[error("{path}: safetensors metadata lacks {key:?}")]
    MissingMetadata { path: PathBuf, key: &'static str },
    #[error("{path} has SM3 {actual}, but the weights file pins {expected}")]
    ModelJsonDigestMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("{path} is not a valid model description: {source}")]
    ModelJson {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("unsupported artifact format {found:?}, this worker reads {expected:?}", expected = FORMAT)]
    Format { found: String },
    #[error("feature schema {found:?} differs from this worker's {expected:?}", expected = FEATURE_SCHEMA_VERSION)]
    FeatureSchemaVersion { found: String },
    #[error("model expects {found} features, this worker computes {expected}", expected = FEATURE_COUNT)]
    FeatureCount { found: usize },
    #[error("feature {index} is {found:?} in the model but {expected:?} in this worker")]
    FeatureName {
        index: usize,
        expected: &'static str,
        found: String,
    },
    #[error("unsupported architecture: {reason}")]
    Architecture { reason: String },
    #[error("bad normalisation: {reason}")]
    Normalisation { reason: String },
    #[error("tensor {name:?} is missing")]
    MissingTensor { name: String },
    #[error("tensor {name:?} is not part of this architecture")]
    UnexpectedTensor { name: String },
    #[error("tensor {name:?} has dtype {found}, expected F32")]
    TensorDtype { name: String, found: String },
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {name:?} holds a non-finite value ({value}) at element {index}")]
    NonFinite {
        name: String,
        index: usize,
        value: f32,
    },
}

/// A model read from disk and checked against its registered digest.
#[derive(Debug, Clone)]
pub struct VerifiedArtifact {
    pub spec: ModelSpec,
    pub weights: MlpWeights,
    /// SM3 of the safetensors file (the registered digest).
    pub digest: String,
    /// SM3 of `model.json`.
    pub model_json_digest: String,
    pub weights_path: PathBuf,
    pub model_json_path: PathBuf,
}

/// Where a saved model's files went, and the digest to register.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedArtifact {
    pub weights_path: PathBuf,
    pub model_json_path: PathBuf,
    /// SM3 of the safetensors file, lowercase hex.
    pub digest: String,
    pub model_json_digest: String,
}

fn weight_name(layer: usize) -> String {
    format!("layers.{layer}.weight")
}

fn bias_name(layer: usize) -> String {
    format!("layers.{layer}.bias")
}

/// Serialises the spec and weights: `(safetensors bytes, model.json bytes)`. Deterministic:
/// equal inputs give equal bytes.
pub fn encode(spec: &ModelSpec, weights: &MlpWeights) -> Result<(Vec<u8>, Vec<u8>), ArtifactError> {
    let mut json = serde_json::to_vec_pretty(spec).map_err(|source| ArtifactError::ModelJson {
        path: PathBuf::from(MODEL_JSON_FILE),
        source,
    })?;
    json.push(b'\n');

    let metadata: BTreeMap<&str, String> = [
        (FORMAT_KEY, FORMAT.to_string()),
        (MODEL_JSON_DIGEST_KEY, sm3_hex(&json)),
        (MODEL_REF_KEY, spec.model_ref.clone()),
    ]
    .into_iter()
    .collect();

    let mut tensors: BTreeMap<String, (Vec<usize>, &[f32])> = BTreeMap::new();
    for (i, layer) in weights.layers.iter().enumerate() {
        tensors.insert(
            weight_name(i),
            (vec![layer.outputs, layer.inputs], &layer.weight),
        );
        tensors.insert(bias_name(i), (vec![layer.outputs], &layer.bias));
    }

    // Keys are inserted in sorted order, so the header is the same whether serde_json's map
    // is ordered by key or by insertion (its `preserve_order` feature).
    let mut header = serde_json::Map::new();
    let meta: serde_json::Map<String, serde_json::Value> = metadata
        .iter()
        .map(|(k, v)| ((*k).to_string(), serde_json::Value::String(v.clone())))
        .collect();
    header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut offset = 0usize;
    for (name, (shape, data)) in &tensors {
        let end = offset + data.len() * 4;
        let mut entry = serde_json::Map::new();
        entry.insert("data_offsets".into(), serde_json::json!([offset, end]));
        entry.insert("dtype".into(), serde_json::json!("F32"));
        entry.insert("shape".into(), serde_json::json!(shape));
        header.insert(name.clone(), serde_json::Value::Object(entry));
        offset = end;
    }
    let mut header_bytes =
        serde_json::to_vec(&header).map_err(|source| ArtifactError::ModelJson {
            path: PathBuf::from(WEIGHTS_FILE),
            source,
        })?;
    // The safetensors convention: pad the header with spaces to a multiple of 8 bytes.
    header_bytes.resize(header_bytes.len().next_multiple_of(8), b' ');

    let mut out = Vec::with_capacity(8 + header_bytes.len() + offset);
    out.extend_from_slice(&(header_bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&header_bytes);
    for (_, data) in tensors.values() {
        for v in *data {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    Ok((out, json))
}

/// Writes `model.safetensors` and `model.json` into `dir` (created if missing).
pub fn save(
    dir: &Path,
    spec: &ModelSpec,
    weights: &MlpWeights,
) -> Result<SavedArtifact, ArtifactError> {
    let (weights_bytes, json) = encode(spec, weights)?;
    std::fs::create_dir_all(dir).map_err(|source| ArtifactError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let weights_path = dir.join(WEIGHTS_FILE);
    let model_json_path = dir.join(MODEL_JSON_FILE);
    // model.json first: a reader that finds the weights finds the description they pin.
    for (path, bytes) in [(&model_json_path, &json), (&weights_path, &weights_bytes)] {
        std::fs::write(path, bytes).map_err(|source| ArtifactError::Write {
            path: path.clone(),
            source,
        })?;
    }
    Ok(SavedArtifact {
        weights_path,
        model_json_path,
        digest: sm3_hex(&weights_bytes),
        model_json_digest: sm3_hex(&json),
    })
}

/// Normalises a registered digest to lowercase, refusing anything that is not 64 hex digits.
pub fn parse_digest(digest: &str) -> Result<String, ArtifactError> {
    if digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(digest.to_ascii_lowercase())
    } else {
        Err(ArtifactError::BadExpectedDigest {
            digest: digest.to_string(),
        })
    }
}

/// Reads a model, refusing it unless the weights file has `expected_digest`, the
/// `model.json` beside it has the digest the weights pin, and both describe a model this
/// worker can run (feature schema, shapes, finite values).
pub fn load_verified(
    weights_path: &Path,
    expected_digest: &str,
) -> Result<VerifiedArtifact, ArtifactError> {
    let expected = parse_digest(expected_digest)?;
    let bytes = std::fs::read(weights_path).map_err(|source| ArtifactError::Read {
        path: weights_path.to_path_buf(),
        source,
    })?;
    let digest = sm3_hex(&bytes);
    if digest != expected {
        return Err(ArtifactError::DigestMismatch {
            path: weights_path.to_path_buf(),
            expected,
            actual: digest,
        });
    }

    let bad_file = |reason: String| ArtifactError::Safetensors {
        path: weights_path.to_path_buf(),
        reason,
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| bad_file(e.to_string()))?;
    let tensors = SafeTensors::deserialize(&bytes).map_err(|e| bad_file(e.to_string()))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let meta = |key: &'static str| {
        metadata
            .get(key)
            .cloned()
            .ok_or_else(|| ArtifactError::MissingMetadata {
                path: weights_path.to_path_buf(),
                key,
            })
    };
    let format = meta(FORMAT_KEY)?;
    if format != FORMAT {
        return Err(ArtifactError::Format { found: format });
    }
    let pinned_json_digest = meta(MODEL_JSON_DIGEST_KEY)?.to_ascii_lowercase();

    let model_json_path = weights_path
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join(MODEL_JSON_FILE);
    let json = std::fs::read(&model_json_path).map_err(|source| ArtifactError::Read {
        path: model_json_path.clone(),
        source,
    })?;
    let model_json_digest = sm3_hex(&json);
    if model_json_digest != pinned_json_digest {
        return Err(ArtifactError::ModelJsonDigestMismatch {
            path: model_json_path,
            expected: pinned_json_digest,
            actual: model_json_digest,
        });
    }
    let spec: ModelSpec =
        serde_json::from_slice(&json).map_err(|source| ArtifactError::ModelJson {
            path: model_json_path.clone(),
            source,
        })?;
    check_spec(&spec)?;
    let weights = read_weights(&spec, &tensors)?;

    Ok(VerifiedArtifact {
        spec,
        weights,
        digest,
        model_json_digest,
        weights_path: weights_path.to_path_buf(),
        model_json_path,
    })
}

/// Checks that a description matches what this worker computes and can run.
pub fn check_spec(spec: &ModelSpec) -> Result<(), ArtifactError> {
    if spec.format != FORMAT {
        return Err(ArtifactError::Format {
            found: spec.format.clone(),
        });
    }
    let schema = &spec.feature_schema;
    if schema.version != FEATURE_SCHEMA_VERSION {
        return Err(ArtifactError::FeatureSchemaVersion {
            found: schema.version.clone(),
        });
    }
    if schema.names.len() != FEATURE_COUNT {
        return Err(ArtifactError::FeatureCount {
            found: schema.names.len(),
        });
    }
    if let Some((index, (expected, found))) = FEATURE_NAMES
        .iter()
        .zip(&schema.names)
        .enumerate()
        .find(|(_, (e, f))| **e != f.as_str())
    {
        return Err(ArtifactError::FeatureName {
            index,
            expected,
            found: found.clone(),
        });
    }

    let arch = &spec.architecture;
    let sizes = &arch.layer_sizes;
    let arch_err = |reason: String| Err(ArtifactError::Architecture { reason });
    if sizes.len() < 2 {
        return arch_err(format!(
            "layer_sizes {sizes:?} needs at least input and output"
        ));
    }
    if sizes[0] != FEATURE_COUNT {
        return Err(ArtifactError::FeatureCount { found: sizes[0] });
    }
    if sizes[sizes.len() - 1] != 1 {
        return arch_err(format!("layer_sizes {sizes:?} must end in one output"));
    }
    if let Some(w) = sizes.iter().find(|w| **w == 0 || **w > MAX_LAYER_WIDTH) {
        return arch_err(format!(
            "layer width {w} outside 1..={MAX_LAYER_WIDTH} in {sizes:?}"
        ));
    }
    if arch.hidden_activation != HIDDEN_ACTIVATION {
        return arch_err(format!(
            "hidden activation {:?}, only {HIDDEN_ACTIVATION:?} is supported",
            arch.hidden_activation
        ));
    }
    if arch.output_activation != OUTPUT_ACTIVATION {
        return arch_err(format!(
            "output activation {:?}, only {OUTPUT_ACTIVATION:?} is supported",
            arch.output_activation
        ));
    }

    let norm = &spec.normalisation;
    for (what, values) in [("mean", &norm.mean), ("std", &norm.std)] {
        if values.len() != FEATURE_COUNT {
            return Err(ArtifactError::Normalisation {
                reason: format!(
                    "{what} has {} entries, expected {FEATURE_COUNT}",
                    values.len()
                ),
            });
        }
    }
    if let Some(i) = norm.mean.iter().position(|m| !m.is_finite()) {
        return Err(ArtifactError::Normalisation {
            reason: format!("mean of {} is not finite", FEATURE_NAMES[i]),
        });
    }
    if let Some(i) = norm.std.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(ArtifactError::Normalisation {
            reason: format!(
                "std of {} is {}, it must be finite and positive",
                FEATURE_NAMES[i], norm.std[i]
            ),
        });
    }
    Ok(())
}

fn read_weights(spec: &ModelSpec, tensors: &SafeTensors<'_>) -> Result<MlpWeights, ArtifactError> {
    let sizes = &spec.architecture.layer_sizes;
    let mut expected_names = Vec::new();
    let mut layers = Vec::with_capacity(sizes.len() - 1);
    for (i, pair) in sizes.windows(2).enumerate() {
        let (inputs, outputs) = (pair[0], pair[1]);
        let weight = read_tensor(tensors, &weight_name(i), &[outputs, inputs])?;
        let bias = read_tensor(tensors, &bias_name(i), &[outputs])?;
        expected_names.push(weight_name(i));
        expected_names.push(bias_name(i));
        layers.push(DenseLayer {
            inputs,
            outputs,
            weight,
            bias,
        });
    }
    let mut present: Vec<&str> = tensors.names();
    present.sort_unstable();
    if let Some(extra) = present
        .iter()
        .find(|n| !expected_names.iter().any(|e| e == *n))
    {
        return Err(ArtifactError::UnexpectedTensor {
            name: (*extra).to_string(),
        });
    }
    Ok(MlpWeights { layers })
}

fn read_tensor(
    tensors: &SafeTensors<'_>,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>, ArtifactError> {
    let view = tensors
        .tensor(name)
        .map_err(|_| ArtifactError::MissingTensor { name: name.into() })?;
    if view.dtype() != Dtype::F32 {
        return Err(ArtifactError::TensorDtype {
            name: name.into(),
            found: format!("{:?}", view.dtype()),
        });
    }
    if view.shape() != shape {
        return Err(ArtifactError::TensorShape {
            name: name.into(),
            expected: shape.to_vec(),
            found: view.shape().to_vec(),
        });
    }
    let values: Vec<f32> = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    if let Some((index, value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(ArtifactError::NonFinite {
            name: name.into(),
            index,
            value: *value,
        });
    }
    Ok(values)
}

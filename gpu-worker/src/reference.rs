//! The shipped reference model (`gpu-worker/model/reference/`), embedded so that any binary
//! can install and register it without the source tree: demos, smoke tests, first start.
//! Regenerate with `cargo run -p aether-gpu-worker --example train_reference`, then update
//! [`REFERENCE_MODEL_DIGEST`] and README.md (a test fails until both agree).

use std::path::Path;

use crate::artifact::{self, ArtifactError, SavedArtifact};

/// SM3 of `model/reference/model.safetensors`: the digest to register.
pub const REFERENCE_MODEL_DIGEST: &str =
    "4e312194c616577c2e2302a50269f8ae179d64c94a22af7c020da5090d812c77";

/// Model ref of the reference model.
pub const REFERENCE_MODEL_REF: &str = "aether-anomaly-mlp@reference";

/// The reference weights file, byte for byte.
pub const REFERENCE_WEIGHTS: &[u8] = include_bytes!("../model/reference/model.safetensors");

/// The reference `model.json`, byte for byte.
pub const REFERENCE_MODEL_JSON: &[u8] = include_bytes!("../model/reference/model.json");

/// Writes the reference model into `dir` and returns where it went and its digest.
pub fn install(dir: &Path) -> Result<SavedArtifact, ArtifactError> {
    std::fs::create_dir_all(dir).map_err(|source| ArtifactError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let weights_path = dir.join(artifact::WEIGHTS_FILE);
    let model_json_path = dir.join(artifact::MODEL_JSON_FILE);
    for (path, bytes) in [
        (&model_json_path, REFERENCE_MODEL_JSON),
        (&weights_path, REFERENCE_WEIGHTS),
    ] {
        std::fs::write(path, bytes).map_err(|source| ArtifactError::Write {
            path: path.clone(),
            source,
        })?;
    }
    Ok(SavedArtifact {
        weights_path,
        model_json_path,
        digest: artifact::sm3_hex(REFERENCE_WEIGHTS),
        model_json_digest: artifact::sm3_hex(REFERENCE_MODEL_JSON),
    })
}

//! Aether's clearing model runtime: scores trades with a small MLP (candle; CPU by default,
//! CUDA behind the `cuda` feature and a runtime [`DeviceChoice`]) and nets each batch
//! multilaterally in exact integer arithmetic.
//!
//! Invariant: this crate computes and reports. It reads model files and writes them when
//! training; it never touches a database or the network. The gRPC worker loop lives in
//! another crate and calls [`ClearingModel::score_and_net`].

pub mod artifact;
pub mod blind_spot;
pub mod features;
pub mod model;
pub mod netting;
pub mod reference;
pub mod trade;
pub mod train;

use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use artifact::{ArtifactError, ModelSpec, SavedArtifact};
pub use features::{FEATURE_COUNT, FEATURE_NAMES, FEATURE_SCHEMA_VERSION, features};
pub use model::{DeviceChoice, Model, ModelError, Score};
pub use netting::{NetPosition, Netting, NettingError, net};
pub use reference::{REFERENCE_MODEL_DIGEST, REFERENCE_MODEL_REF};
pub use trade::{Trade, TradeContext, TradeError};
pub use train::{TrainConfig, TrainError, TrainReport, TrainedModel, train};

/// What a worker reports for one batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchResult {
    /// One score per trade, in batch order.
    pub scores: Vec<Score>,
    pub netting: Netting,
    /// Where the scores were computed: `cpu` or `cuda:N`.
    pub device: String,
    /// The registered digest of the model that scored (SM3 of its safetensors file).
    pub model_digest: String,
    pub model_ref: String,
    /// Validation, scoring and netting together.
    pub elapsed: Duration,
    pub scoring_elapsed: Duration,
    pub netting_elapsed: Duration,
}

/// Why a batch was refused. Nothing is reported for a refused batch.
#[derive(Debug, Error)]
pub enum ClearingError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Netting(#[from] NettingError),
}

/// The worker-side entry point: a verified model plus netting.
#[derive(Debug)]
pub struct ClearingModel {
    model: Model,
}

impl ClearingModel {
    /// Loads the registered artifact onto `device`; see [`Model::load_on`] for the checks.
    pub fn load(
        weights_path: &Path,
        expected_digest: &str,
        device: DeviceChoice,
    ) -> Result<Self, ClearingError> {
        Ok(ClearingModel {
            model: Model::load_on(weights_path, expected_digest, device)?,
        })
    }

    pub fn from_model(model: Model) -> Self {
        ClearingModel { model }
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// `cpu` or `cuda:N`.
    pub fn device_name(&self) -> String {
        self.model.device_name()
    }

    /// Scores every trade and nets the batch. The whole batch is refused, with the index
    /// of the first bad trade, if any trade is invalid.
    pub fn score_and_net(
        &self,
        batch: &[(Trade, TradeContext)],
    ) -> Result<BatchResult, ClearingError> {
        let started = Instant::now();
        let scores = self.model.score_batch(batch)?;
        let scored = Instant::now();
        let netting = net(batch.iter().map(|(t, _)| t))?;
        let netted = Instant::now();
        Ok(BatchResult {
            scores,
            netting,
            device: self.model.device_name(),
            model_digest: self.model.digest().to_string(),
            model_ref: self.model.model_ref().to_string(),
            elapsed: netted - started,
            scoring_elapsed: scored - started,
            netting_elapsed: netted - scored,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gRPC worker shares one loaded model across tasks and sends errors across them.
    #[test]
    fn the_worker_api_can_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<ClearingModel>();
        send_sync::<BatchResult>();
        send_sync::<ClearingError>();
        send_sync::<TrainError>();
    }
}

//! Aether's clearing model runtime: scores trades with a small MLP (candle; CPU by default,
//! CUDA behind the `cuda` feature and a runtime [`DeviceChoice`]) and nets each batch
//! multilaterally in exact integer arithmetic.
//!
//! Invariant: this crate computes and reports. It reads model files and writes them when
//! training; it never touches a database or the network. The gRPC worker loop lives in
//! another crate and calls [`ClearingModel::score_and_net`].

pub mod artifact;
pub mod blind_spot;
pub mod explain;
pub mod features;
pub mod model;
pub mod netting;
pub mod reference;
pub mod sigmoid8;
pub mod trade;
pub mod train;

use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use artifact::{ArtifactError, ModelSpec, SavedArtifact};
pub use explain::{ExplainError, ExplainSettings, Explanation, ExplanationStatus};
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
    /// Per trade, in batch order: `None` when none was asked for, else the explanation
    /// or why there is none.
    #[serde(skip)]
    pub explanations: Vec<Option<Result<Explanation, ExplainError>>>,
}

/// Which trades of a batch to explain: those marked (the rules already hold or reject
/// them, or they were sampled) and those scoring at or above the hold threshold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExplainPlan {
    /// Per trade, in batch order; missing entries count as not marked.
    pub marked: Vec<bool>,
    pub at_or_above: Option<f32>,
}

impl ExplainPlan {
    fn wants(&self, index: usize, score: f32) -> bool {
        self.marked.get(index).copied().unwrap_or(false)
            || self.at_or_above.is_some_and(|t| score >= t)
    }
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
    explain: ExplainSettings,
    /// Drawn once, at the first explanation.
    background: std::sync::OnceLock<Result<explain::Background, ExplainError>>,
}

impl ClearingModel {
    /// Loads the registered artifact onto `device`; see [`Model::load_on`] for the checks.
    pub fn load(
        weights_path: &Path,
        expected_digest: &str,
        device: DeviceChoice,
    ) -> Result<Self, ClearingError> {
        Ok(ClearingModel::from_model(Model::load_on(
            weights_path,
            expected_digest,
            device,
        )?))
    }

    pub fn from_model(model: Model) -> Self {
        ClearingModel {
            model,
            explain: ExplainSettings::default(),
            background: std::sync::OnceLock::new(),
        }
    }

    /// Explains one raw feature row, seeded from `request_id`.
    pub fn explain(
        &self,
        request_id: &str,
        row: &[f32; FEATURE_COUNT],
    ) -> Result<Explanation, ExplainError> {
        let background = self
            .background
            .get_or_init(|| {
                explain::Background::of_model(self.model.spec(), self.explain.background_size)
            })
            .as_ref()
            .map_err(Clone::clone)?;
        explain::Explainer {
            weights: self.model.weights(),
            spec: self.model.spec(),
            background,
            settings: &self.explain,
        }
        .explain(row, explain::seed_for(request_id))
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
        self.score_net_and_explain(batch, &ExplainPlan::default())
    }

    /// [`ClearingModel::score_and_net`], then explains the trades `plan` asks for.
    pub fn score_net_and_explain(
        &self,
        batch: &[(Trade, TradeContext)],
        plan: &ExplainPlan,
    ) -> Result<BatchResult, ClearingError> {
        let started = Instant::now();
        let scores = stage_span("worker.scoring").in_scope(|| self.model.score_batch(batch))?;
        let scored = Instant::now();
        let netting =
            stage_span("worker.netting").in_scope(|| net(batch.iter().map(|(t, _)| t)))?;
        let netted = Instant::now();
        let explanations = stage_span("worker.explain").in_scope(|| {
            batch
                .iter()
                .zip(&scores)
                .enumerate()
                .map(|(i, ((trade, ctx), score))| {
                    plan.wants(i, score.score)
                        .then(|| self.explain(&trade.request_id, &features(trade, ctx)))
                })
                .collect()
        });
        Ok(BatchResult {
            scores,
            netting,
            device: self.model.device_name(),
            model_digest: self.model.digest().to_string(),
            model_ref: self.model.model_ref().to_string(),
            elapsed: netted - started,
            scoring_elapsed: scored - started,
            netting_elapsed: netted - scored,
            explanations,
        })
    }
}

/// A stage of a traced batch, as a child of the batch's span (the worker's, or the
/// gateway's when it scores in process); no span when the batch is not traced, so an
/// untraced batch costs a check of the current span and nothing more.
fn stage_span(name: &'static str) -> tracing::Span {
    if tracing::Span::current().is_disabled() {
        tracing::Span::none()
    } else {
        tracing::debug_span!("worker.stage", otel.name = name)
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

//! `aether model train`: trains the clearing MLP on the documented synthetic dataset
//! (gpu-worker/README.md) and writes a registrable artifact.

use std::path::PathBuf;
use std::time::Instant;

use aether_gpu_worker::{TrainConfig, train};
use anyhow::Context;
use clap::Args;

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Where to write `model.safetensors` and `model.json`.
    #[arg(long, default_value = "./aether-data/models/trained")]
    pub out: PathBuf,
    /// RNG seed of the dataset and the initial weights (default: the reference model's).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Trades generated (train + held out).
    #[arg(long)]
    pub samples: Option<usize>,
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Model reference recorded in `model.json`, e.g. `finmoe-lite-v2@sgp-region`.
    #[arg(long)]
    pub model_ref: Option<String>,
}

pub fn train_command(args: TrainArgs) -> anyhow::Result<()> {
    let mut config = TrainConfig::default();
    if let Some(seed) = args.seed {
        config.seed = seed;
    }
    if let Some(samples) = args.samples {
        config.samples = samples;
    }
    if let Some(epochs) = args.epochs {
        config.epochs = epochs;
    }
    if let Some(model_ref) = args.model_ref {
        config.model_ref = model_ref;
    }
    let started = Instant::now();
    let (model, report) = train(&config).context("training failed")?;
    let elapsed = started.elapsed();
    let saved = model
        .save(&args.out)
        .with_context(|| format!("cannot write the model into {}", args.out.display()))?;
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "report": report,
            "trained_in_s": elapsed.as_secs_f64(),
            "weights": saved.weights_path,
            "digest": saved.digest,
            "model_json_sm3": saved.model_json_digest,
            "register_with": {
                "ref": config.model_ref,
                "uri": saved.weights_path,
                "digest": saved.digest,
                "feature_schema": {"schema": aether_gpu_worker::FEATURE_SCHEMA_VERSION},
            },
        }))?
    );
    Ok(())
}

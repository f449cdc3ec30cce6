//! Retrains the shipped reference model and writes it (default: `gpu-worker/model/reference`).
//!
//! `cargo run -p aether-gpu-worker --example train_reference [-- DIR]`

use std::path::PathBuf;
use std::time::Instant;

use aether_gpu_worker::{TrainConfig, train};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("model/reference"));
    let started = Instant::now();
    let (model, report) = train(&TrainConfig::default())?;
    let trained_in = started.elapsed();
    let saved = model.save(&dir)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    println!("trained in {trained_in:.2?}");
    println!("weights   {}", saved.weights_path.display());
    println!("digest    {}", saved.digest);
    println!("model.json sm3 {}", saved.model_json_digest);
    Ok(())
}

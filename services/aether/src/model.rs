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

/// `aether model explain`: recomputes a recorded explanation from the ledger and the
/// model artifact, and says whether it matches bit for bit.
#[derive(Args, Debug)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub ledger: crate::LedgerArgs,
    /// The decision's request id.
    #[arg(long)]
    pub request_id: String,
    /// The submitting member, when several members used the request id.
    #[arg(long)]
    pub member: Option<String>,
    /// The model artifact (`model.safetensors`); it must have the digest the decision
    /// records. Default: the shipped reference model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Print the recomputed explanation as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Exit 0: recomputed bit for bit; 1: it differs (the differing members are printed);
/// an error: the decision, its explanation or the artifact cannot be had.
pub async fn explain_command(args: ExplainArgs) -> anyhow::Result<std::process::ExitCode> {
    use aether_gpu_worker::explain::{Background, Explainer};
    use aether_gpu_worker::features::FEATURE_COUNT;
    use aether_gpu_worker::{ClearingModel, DeviceChoice, Explanation, reference};
    use aether_ledger::{EventStore, StoreConfig};
    use serde_json::Value;

    let store = EventStore::connect(&args.ledger.url(), StoreConfig::default())
        .await
        .with_context(|| format!("cannot open the ledger at {}", args.ledger.describe()))?;
    let found = store
        .find_by_metadata(
            "request_id",
            std::slice::from_ref(&args.request_id),
            aether_gateway::clearing::CLEARING_DECIDED,
        )
        .await?;
    let payloads: Vec<Value> = found
        .iter()
        .map(|e| serde_json::from_str::<Value>(e.payload.get()))
        .collect::<Result<_, _>>()?;
    let mut decisions: Vec<&Value> = payloads
        .iter()
        .filter(|p| args.member.as_deref().is_none_or(|m| p["member"] == m))
        .collect();
    let decision = match decisions.len() {
        0 => anyhow::bail!("no decision for request id {:?}", args.request_id),
        1 => decisions.remove(0),
        n => anyhow::bail!(
            "{n} members decided request id {:?}: name one with --member",
            args.request_id
        ),
    };
    let recorded = decision.get("explanation").cloned().unwrap_or(Value::Null);
    if recorded.is_null() {
        anyhow::bail!(
            "decision {:?} was not explained (cleared, and not in the sample of cleared trades)",
            args.request_id
        );
    }
    let explanation: Explanation = serde_json::from_value(recorded.clone())
        .with_context(|| format!("the recorded explanation is not one ({recorded})"))?;
    let digest = decision["model_digest"].as_str().unwrap_or_default();
    let dir = tempfile::tempdir()?;
    let path = match args.model {
        Some(path) => path,
        None => reference::install(dir.path())?.weights_path,
    };
    let model = ClearingModel::load(&path, digest, DeviceChoice::Cpu).with_context(|| {
        format!(
            "{} is not the artifact the decision names ({digest})",
            path.display()
        )
    })?;
    let spec = model.model().spec();
    let background = Background::of_model(spec, explanation.background.size)?;
    let row: [f32; FEATURE_COUNT] = explanation
        .features
        .as_slice()
        .try_into()
        .context("the recorded feature row is not 17 values")?;
    let seed = u64::from_str_radix(&explanation.seed, 16).context("the recorded seed")?;
    let recomputed = Explainer {
        weights: model.model().weights(),
        spec,
        background: &background,
        settings: &explanation.settings,
    }
    .explain(&row, seed)?;
    // Compared as values of the type, not as JSON: the ledger's canonical form writes 2.0
    // as 2, and an f32 feature is stored as its shortest decimal.
    let ours = serde_json::to_value(&recomputed)?;
    let theirs = serde_json::to_value(&explanation)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&ours)?);
    }
    let differing: Vec<&String> = ours
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| theirs.get(k.as_str()) != Some(v))
        .map(|(k, _)| k)
        .collect();
    if recomputed == explanation {
        println!(
            "MATCH: the explanation of {} ({:?}, seed {}) recomputed bit for bit from model {digest}",
            args.request_id, explanation.status, explanation.seed
        );
        Ok(std::process::ExitCode::SUCCESS)
    } else {
        println!(
            "DIFFERS: the explanation of {} recomputed from model {digest} differs in {differing:?}",
            args.request_id
        );
        Ok(std::process::ExitCode::from(1))
    }
}

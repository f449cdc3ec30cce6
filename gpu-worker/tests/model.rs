//! The clearing model as the control plane and the gateway use it: the shipped reference
//! artifact, its digest pinning, the checks that refuse a bad artifact, training
//! reproducibility, and `score_and_net`.

mod common;

use std::path::{Path, PathBuf};

use aether_gpu_worker::artifact::{
    self, ArtifactError, FORMAT, FORMAT_KEY, MODEL_JSON_DIGEST_KEY, MlpWeights, ModelSpec,
    VerifiedArtifact,
};
use aether_gpu_worker::features::{FEATURE_COUNT, FEATURE_NAMES, feature_matrix};
use aether_gpu_worker::reference::{self, REFERENCE_MODEL_JSON, REFERENCE_WEIGHTS};
use aether_gpu_worker::train::{TrainConfig, generate, roc_auc};
use aether_gpu_worker::{
    ClearingError, ClearingModel, DeviceChoice, Model, ModelError, REFERENCE_MODEL_DIGEST,
    TradeError, train,
};
use common::{high_risk_low_tier, odd_hour_huge, ordinary, structuring};

fn reference_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("model/reference/model.safetensors")
}

fn reference_artifact() -> VerifiedArtifact {
    artifact::load_verified(&reference_path(), REFERENCE_MODEL_DIGEST).expect("reference loads")
}

fn reference_model() -> Model {
    Model::load(&reference_path(), REFERENCE_MODEL_DIGEST).expect("reference loads")
}

/// Saves an edited artifact and returns the error loading it with its own (correct)
/// digest, so only the content checks can refuse it.
fn refusal(spec: &ModelSpec, weights: &MlpWeights) -> ArtifactError {
    let dir = tempfile::tempdir().expect("tempdir");
    let saved = artifact::save(dir.path(), spec, weights).expect("saves");
    match artifact::load_verified(&saved.weights_path, &saved.digest) {
        Ok(_) => panic!("an edited artifact was accepted"),
        Err(e) => e,
    }
}

#[test]
fn reference_model_loads_with_its_documented_digest_and_flags_each_planted_anomaly() {
    let model = reference_model();
    assert_eq!(model.digest(), REFERENCE_MODEL_DIGEST);
    assert_eq!(model.model_ref(), reference::REFERENCE_MODEL_REF);
    assert_eq!(model.device_name(), "cpu");

    let scores = model
        .score_batch(&[
            ordinary(),
            structuring(),
            high_risk_low_tier(),
            odd_hour_huge(),
        ])
        .expect("scores");
    let normal = scores[0].score;
    assert!(normal < 0.1, "ordinary trade scored {normal}");
    for (kind, s) in ["structuring", "high-risk/low-tier", "odd-hour/huge"]
        .iter()
        .zip(&scores[1..])
    {
        assert!(
            s.score > 0.5 && s.score > normal,
            "{kind} scored {} vs normal {normal}",
            s.score
        );
    }
    for s in &scores {
        assert!((0.0..=1.0).contains(&s.score));
        assert!((s.confidence - (2.0 * s.score - 1.0).abs()).abs() < 1e-6);
    }
}

#[test]
fn readme_states_the_reference_digest_auc_and_feature_table() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    assert!(
        readme.contains(REFERENCE_MODEL_DIGEST),
        "README.md must carry the reference digest"
    );
    let auc = reference_artifact()
        .spec
        .training
        .expect("provenance")
        .auc_holdout;
    assert!(
        readme.contains(&format!("{auc:.4}")),
        "README.md must state the held-out AUC {auc:.4}"
    );
    for (i, name) in FEATURE_NAMES.iter().enumerate() {
        assert!(
            readme.contains(&format!("| {i} | `{name}` |")),
            "README.md feature table lacks row {i} `{name}`"
        );
    }
}

#[test]
fn retraining_with_the_reference_seed_reproduces_the_shipped_bytes_and_clears_the_auc_floor() {
    let (model, report) = train(&TrainConfig::default()).expect("trains");
    assert!(
        report.auc_holdout >= 0.95,
        "held-out AUC {}",
        report.auc_holdout
    );
    assert_eq!(report.auc_holdout_by_kind.len(), 3);
    for k in &report.auc_holdout_by_kind {
        assert!(
            k.auc >= 0.9 && k.holdout_count > 30,
            "{:?}: AUC {} over {}",
            k.kind,
            k.auc,
            k.holdout_count
        );
    }
    let (weights, json) = model.encode().expect("encodes");
    assert!(
        json == REFERENCE_MODEL_JSON,
        "model.json differs from the shipped reference: training is not reproducible, or the reference is stale"
    );
    assert!(
        weights == REFERENCE_WEIGHTS,
        "model.safetensors differs from the shipped reference: training is not reproducible, or the reference is stale"
    );
}

#[test]
fn the_same_seed_gives_the_same_bytes_and_another_seed_does_not() {
    let small = TrainConfig {
        samples: 1_500,
        epochs: 2,
        ..TrainConfig::default()
    };
    let a = train(&small).expect("trains").0.encode().expect("encodes");
    let b = train(&small).expect("trains").0.encode().expect("encodes");
    assert_eq!(a, b);
    let other = TrainConfig {
        seed: small.seed + 1,
        ..small
    };
    let c = train(&other).expect("trains").0.encode().expect("encodes");
    assert_ne!(a.0, c.0);
}

#[test]
fn candle_scores_agree_with_the_plain_reference_forward_pass() {
    let art = reference_artifact();
    let model = reference_model();
    let book = generate(99, 400, 0.2);
    let batch: Vec<_> = book.iter().map(|l| (l.trade.clone(), l.context)).collect();
    let rows = feature_matrix(&batch);
    let candle = model.score_features(&rows).expect("scores");
    let norm = &art.spec.normalisation;
    let mut labels = Vec::new();
    let mut plain = Vec::new();
    for (row, l) in rows.chunks(FEATURE_COUNT).zip(&book) {
        let x: Vec<f32> = row
            .iter()
            .zip(norm.mean.iter().zip(&norm.std))
            .map(|(x, (m, s))| (x - m) / s)
            .collect();
        plain.push(art.weights.forward(&x));
        labels.push(l.anomaly.is_some());
    }
    for (i, (c, p)) in candle.iter().zip(&plain).enumerate() {
        assert!(
            (c.score - p).abs() < 1e-5,
            "row {i}: candle {} vs plain {p}",
            c.score
        );
    }
    // A fresh book the model never saw is still ranked well.
    let scores: Vec<f32> = candle.iter().map(|s| s.score).collect();
    let auc = roc_auc(&scores, &labels).expect("both classes");
    assert!(auc > 0.95, "AUC on a fresh book {auc}");
}

#[test]
fn a_batch_is_scored_as_each_trade_alone_would_be() {
    let model = reference_model();
    let batch = vec![
        ordinary(),
        structuring(),
        high_risk_low_tier(),
        odd_hour_huge(),
    ];
    let together = model.score_batch(&batch).expect("scores");
    for (i, item) in batch.iter().enumerate() {
        let alone = model
            .score_batch(std::slice::from_ref(item))
            .expect("scores");
        assert!((alone[0].score - together[i].score).abs() < 1e-6);
    }
    assert!(model.score_batch(&[]).expect("empty is fine").is_empty());
    assert!(matches!(
        model.score_features(&[0.0; FEATURE_COUNT + 1]),
        Err(ModelError::FeatureRows { len }) if len == FEATURE_COUNT + 1
    ));
}

#[test]
fn a_digest_that_differs_is_refused_and_one_in_upper_case_is_accepted() {
    let wrong = "0".repeat(64);
    match Model::load(&reference_path(), &wrong) {
        Err(ModelError::Artifact(ArtifactError::DigestMismatch {
            expected, actual, ..
        })) => {
            assert_eq!(expected, wrong);
            assert_eq!(actual, REFERENCE_MODEL_DIGEST);
        }
        other => panic!("expected DigestMismatch, got {other:?}"),
    }
    for bad in [
        "",
        "abc",
        &"g".repeat(64),
        &format!("{REFERENCE_MODEL_DIGEST}00"),
    ] {
        assert!(matches!(
            Model::load(&reference_path(), bad),
            Err(ModelError::Artifact(
                ArtifactError::BadExpectedDigest { .. }
            ))
        ));
    }
    Model::load(&reference_path(), &REFERENCE_MODEL_DIGEST.to_uppercase())
        .expect("digest case does not matter");
}

#[test]
fn an_edited_or_missing_model_json_is_refused_by_the_pinned_digest() {
    let dir = tempfile::tempdir().expect("tempdir");
    let saved = reference::install(dir.path()).expect("installs");
    assert_eq!(saved.digest, REFERENCE_MODEL_DIGEST);
    artifact::load_verified(&saved.weights_path, &saved.digest).expect("installed copy loads");

    let mut json = std::fs::read(&saved.model_json_path).expect("reads");
    json.extend_from_slice(b" ");
    std::fs::write(&saved.model_json_path, &json).expect("writes");
    match artifact::load_verified(&saved.weights_path, &saved.digest) {
        Err(ArtifactError::ModelJsonDigestMismatch {
            expected, actual, ..
        }) => {
            assert_eq!(expected, saved.model_json_digest);
            assert_ne!(actual, expected);
        }
        other => panic!("expected ModelJsonDigestMismatch, got {other:?}"),
    }

    std::fs::remove_file(&saved.model_json_path).expect("removes");
    assert!(matches!(
        artifact::load_verified(&saved.weights_path, &saved.digest),
        Err(ArtifactError::Read { path, .. }) if path == saved.model_json_path
    ));
    assert!(matches!(
        artifact::load_verified(&dir.path().join("nope.safetensors"), &saved.digest),
        Err(ArtifactError::Read { .. })
    ));
}

#[test]
fn a_model_built_on_another_feature_schema_is_refused() {
    let art = reference_artifact();

    let mut spec = art.spec.clone();
    spec.feature_schema.names[3] = "ccy_euro".into();
    match refusal(&spec, &art.weights) {
        ArtifactError::FeatureName {
            index,
            expected,
            found,
        } => assert_eq!(
            (index, expected, found.as_str()),
            (3, "ccy_eur", "ccy_euro")
        ),
        other => panic!("expected FeatureName, got {other:?}"),
    }

    let mut spec = art.spec.clone();
    spec.feature_schema.version = "aether.features.v0".into();
    assert!(matches!(
        refusal(&spec, &art.weights),
        ArtifactError::FeatureSchemaVersion { found } if found == "aether.features.v0"
    ));

    let mut spec = art.spec.clone();
    spec.feature_schema.names.pop();
    assert!(matches!(
        refusal(&spec, &art.weights),
        ArtifactError::FeatureCount { found } if found == FEATURE_COUNT - 1
    ));

    let mut spec = art.spec.clone();
    spec.format = "aether.mlp.v9".into();
    assert!(matches!(
        refusal(&spec, &art.weights),
        ArtifactError::Format { found } if found == "aether.mlp.v9"
    ));
}

#[test]
fn wrong_shapes_extra_tensors_and_non_finite_weights_are_refused() {
    let art = reference_artifact();

    let mut weights = art.weights.clone();
    let l1 = &mut weights.layers[1];
    l1.outputs = 8;
    l1.weight.truncate(8 * l1.inputs);
    l1.bias.truncate(8);
    match refusal(&art.spec, &weights) {
        ArtifactError::TensorShape {
            name,
            expected,
            found,
        } => {
            assert_eq!(name, "layers.1.weight");
            assert_eq!(expected, vec![16, 32]);
            assert_eq!(found, vec![8, 32]);
        }
        other => panic!("expected TensorShape, got {other:?}"),
    }

    let mut weights = art.weights.clone();
    weights.layers[0].weight[5] = f32::NAN;
    assert!(matches!(
        refusal(&art.spec, &weights),
        ArtifactError::NonFinite { name, index: 5, .. } if name == "layers.0.weight"
    ));
    let mut weights = art.weights.clone();
    weights.layers[2].bias[0] = f32::INFINITY;
    assert!(matches!(
        refusal(&art.spec, &weights),
        ArtifactError::NonFinite { name, index: 0, .. } if name == "layers.2.bias"
    ));

    let mut weights = art.weights.clone();
    weights.layers.push(weights.layers[2].clone());
    assert!(matches!(
        refusal(&art.spec, &weights),
        ArtifactError::UnexpectedTensor { name } if name == "layers.3.bias"
    ));

    let mut weights = art.weights.clone();
    weights.layers.pop();
    assert!(matches!(
        refusal(&art.spec, &weights),
        ArtifactError::MissingTensor { name } if name == "layers.2.weight"
    ));
}

#[test]
fn unsupported_architectures_and_bad_normalisation_are_refused() {
    let art = reference_artifact();

    let mut spec = art.spec.clone();
    spec.architecture.hidden_activation = "tanh".into();
    assert!(matches!(
        refusal(&spec, &art.weights),
        ArtifactError::Architecture { reason } if reason.contains("tanh")
    ));

    let mut spec = art.spec.clone();
    spec.architecture.layer_sizes = vec![FEATURE_COUNT, 32, 16, 2];
    assert!(matches!(
        refusal(&spec, &art.weights),
        ArtifactError::Architecture { .. }
    ));

    let mut spec = art.spec.clone();
    spec.normalisation.std[4] = 0.0;
    assert!(matches!(
        refusal(&spec, &art.weights),
        ArtifactError::Normalisation { reason } if reason.contains("ccy_gbp")
    ));

    let mut spec = art.spec.clone();
    spec.normalisation.mean.push(0.0);
    assert!(matches!(
        refusal(&spec, &art.weights),
        ArtifactError::Normalisation { .. }
    ));
}

#[test]
fn files_that_are_not_aether_artifacts_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.safetensors");
    let write = |bytes: &[u8]| {
        std::fs::write(&path, bytes).expect("writes");
        artifact::sm3_hex(bytes)
    };
    std::fs::write(dir.path().join("model.json"), REFERENCE_MODEL_JSON).expect("writes");
    let json_digest = artifact::sm3_hex(REFERENCE_MODEL_JSON);

    let digest = write(b"not a safetensors file at all");
    assert!(matches!(
        artifact::load_verified(&path, &digest),
        Err(ArtifactError::Safetensors { .. })
    ));

    // A valid safetensors file without Aether's metadata.
    let view = |dtype, shape: Vec<usize>, bytes: &'static [u8]| {
        safetensors::tensor::TensorView::new(dtype, shape, bytes).expect("view")
    };
    let plain = safetensors::serialize(
        [("x", view(safetensors::Dtype::F32, vec![1], &[0u8; 4]))],
        None,
    )
    .expect("serialises");
    let digest = write(&plain);
    assert!(matches!(
        artifact::load_verified(&path, &digest),
        Err(ArtifactError::MissingMetadata { key, .. }) if key == FORMAT_KEY
    ));

    // Aether metadata, the right model.json, but f64 weights.
    let meta: std::collections::HashMap<String, String> = [
        (FORMAT_KEY.to_string(), FORMAT.to_string()),
        (MODEL_JSON_DIGEST_KEY.to_string(), json_digest),
    ]
    .into_iter()
    .collect();
    let f64_bytes: &'static [u8] = Box::leak(vec![0u8; 8 * 32 * FEATURE_COUNT].into_boxed_slice());
    let wrong_dtype = safetensors::serialize(
        [(
            "layers.0.weight",
            view(safetensors::Dtype::F64, vec![32, FEATURE_COUNT], f64_bytes),
        )],
        Some(meta),
    )
    .expect("serialises");
    let digest = write(&wrong_dtype);
    assert!(matches!(
        artifact::load_verified(&path, &digest),
        Err(ArtifactError::TensorDtype { name, .. }) if name == "layers.0.weight"
    ));
}

#[test]
fn score_and_net_reports_scores_netting_device_and_digest() {
    let clearing = ClearingModel::load(
        &reference_path(),
        REFERENCE_MODEL_DIGEST,
        DeviceChoice::Auto,
    )
    .expect("loads");
    let mut batch = vec![
        ordinary(),
        structuring(),
        high_risk_low_tier(),
        odd_hour_huge(),
    ];
    // broker-b pays part of it back in EUR.
    let (mut back, ctx) = ordinary();
    back.request_id = "req-back".into();
    back.member_id = "broker-b".into();
    back.buyer = "broker-b".into();
    back.seller = "bank-a".into();
    back.currency = "EUR".into();
    back.amount_minor = 500;
    batch.push((back, ctx));

    let result = clearing.score_and_net(&batch).expect("clears");
    assert_eq!(result.scores.len(), batch.len());
    assert_eq!(result.model_digest, REFERENCE_MODEL_DIGEST);
    assert_eq!(result.model_ref, reference::REFERENCE_MODEL_REF);
    assert_eq!(result.device, clearing.device_name());
    assert!(result.elapsed >= result.scoring_elapsed);
    assert!(result.scores[1].score > result.scores[0].score);

    let usd_paid: i64 = batch[..4].iter().map(|(t, _)| t.amount_minor).sum();
    let pos = |party: &str, ccy: &str| {
        result
            .netting
            .positions
            .iter()
            .find(|p| p.party == party && p.currency == ccy)
            .map(|p| p.net_minor)
    };
    assert_eq!(pos("bank-a", "USD"), Some(-i128::from(usd_paid)));
    assert_eq!(pos("broker-b", "USD"), Some(i128::from(usd_paid)));
    assert_eq!(pos("bank-a", "EUR"), Some(500));
    assert_eq!(pos("broker-b", "EUR"), Some(-500));

    let json = serde_json::to_value(&result).expect("serialises for the worker report");
    assert_eq!(json["device"], clearing.device_name().as_str());
    // `auto` is the CPU unless this is a CUDA build on a machine with a GPU (there it is
    // `cuda:0`, as seen on an H200).
    if !cfg!(feature = "cuda") {
        assert_eq!(json["device"], "cpu");
    }
}

#[test]
fn score_and_net_refuses_a_batch_with_an_invalid_trade_by_index() {
    let clearing =
        ClearingModel::load(&reference_path(), REFERENCE_MODEL_DIGEST, DeviceChoice::Cpu)
            .expect("loads");
    let mut bad = ordinary();
    bad.0.currency = "usd".into();
    match clearing.score_and_net(&[ordinary(), ordinary(), bad]) {
        Err(ClearingError::Model(ModelError::InvalidTrade { index, source })) => {
            assert_eq!(index, 2);
            assert_eq!(
                source,
                TradeError::Currency {
                    value: "usd".into()
                }
            );
        }
        other => panic!("expected InvalidTrade, got {other:?}"),
    }
    let mut bad_ctx = ordinary();
    bad_ctx.1.hour_utc = 24;
    assert!(matches!(
        clearing.score_and_net(&[bad_ctx]),
        Err(ClearingError::Model(ModelError::InvalidTrade {
            index: 0,
            source: TradeError::Hour { value: 24 }
        }))
    ));
    let empty = clearing.score_and_net(&[]).expect("an empty batch is fine");
    assert!(empty.scores.is_empty() && empty.netting.positions.is_empty());
}

/// CPU and CUDA must give the same scores, or a rollout across worker kinds would change
/// decisions. Runs only in a build with the `cuda` feature, on a machine with a GPU:
/// `cargo test -p aether-gpu-worker --features cuda -- cpu_cuda_parity`.
#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the `cuda` feature and an NVIDIA GPU"
)]
fn cpu_cuda_parity() {
    let cpu = Model::load_on(&reference_path(), REFERENCE_MODEL_DIGEST, DeviceChoice::Cpu)
        .expect("loads on cpu");
    let gpu = Model::load_on(
        &reference_path(),
        REFERENCE_MODEL_DIGEST,
        DeviceChoice::Cuda(0),
    )
    .expect("loads on cuda:0 (is there a GPU?)");
    assert_eq!(gpu.device_name(), "cuda:0");
    let book = generate(4242, 4096, 0.1);
    let batch: Vec<_> = book.iter().map(|l| (l.trade.clone(), l.context)).collect();
    let a = cpu.score_batch(&batch).expect("cpu scores");
    let b = gpu.score_batch(&batch).expect("cuda scores");
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x.score - y.score).abs())
        .fold(0f32, f32::max);
    eprintln!(
        "largest CPU/CUDA score difference over {} trades: {worst:e}",
        a.len()
    );
    assert!(worst <= 1e-4, "largest CPU/CUDA score difference {worst}");
}

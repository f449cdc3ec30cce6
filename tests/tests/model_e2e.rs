//! `aether model train` as a user runs it: a registrable artifact whose printed digest is
//! the SM3 of the written file, with its held-out AUC.

use serde_json::Value;

#[test]
fn training_writes_an_artifact_with_its_digest_and_holdout_auc() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    let run = aether_e2e::run_aether(
        &[
            "model",
            "train",
            "--out",
            out.to_str().unwrap(),
            "--seed",
            "7",
            "--samples",
            "4000",
            "--model-ref",
            "finmoe-lite@sgp-region",
        ],
        &[],
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let printed: Value = serde_json::from_slice(&run.stdout).unwrap();
    let weights = std::fs::read(out.join("model.safetensors")).unwrap();
    let digest = hex::encode(aether_ledger::hashing::sm3(&weights));
    assert_eq!(printed["digest"], digest.as_str());
    assert_eq!(printed["register_with"]["ref"], "finmoe-lite@sgp-region");
    let auc = printed["report"]["auc_holdout"].as_f64().unwrap();
    assert!(auc > 0.8, "held-out AUC {auc}");
    assert!(out.join("model.json").exists());

    // A bad output location is refused with a message naming it.
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let run = aether_e2e::run_aether(
        &[
            "model",
            "train",
            "--out",
            blocker.join("sub").to_str().unwrap(),
            "--samples",
            "500",
            "--epochs",
            "1",
        ],
        &[],
    );
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("cannot write the model"));
}

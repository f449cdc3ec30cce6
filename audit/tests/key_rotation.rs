//! Bundles of a ledger whose checkpoint key was rotated: the chain of keys from the
//! bundle's `public_key` to the anchor's signer, checked by the offline verifier and by the
//! independent Python verifier written from BUNDLE.md.

mod common;

use aether_audit::{Bundle, ProblemKind, verify_bundle};
use aether_ledger::CheckpointSigner;
use aether_ledger::key_rotation::KeyRotation;
use common::{ledger, t0};
use serde_json::json;

struct Rotated {
    first: CheckpointSigner,
    second: CheckpointSigner,
    bundle: Bundle,
}

/// 20 events; checkpoints at 7 (first key) and 13, 20 (second key); the rotation at 9.
fn rotated() -> Rotated {
    let full = ledger(20);
    let first = CheckpointSigner::generate().unwrap();
    let second = CheckpointSigner::generate().unwrap();
    let at = |size: u64| t0() + common::micros(size * 1000 + 1);
    let sign = |signer: &CheckpointSigner, size| {
        signer.sign(size, full.tree.root_at(size).unwrap(), at(size))
    };
    let rotation = KeyRotation::sign(&first, &second, 9, full.tree.root_at(9).unwrap(), at(9));
    let checkpoints = vec![sign(&first, 7), sign(&second, 13), sign(&second, 20)];
    let bundle = Bundle::build_rotated(
        full.select(&[2, 8, 10, 19]),
        &full.tree,
        checkpoints,
        vec![rotation],
        json!({}),
        at(30),
    )
    .unwrap();
    Rotated {
        first,
        second,
        bundle,
    }
}

#[test]
fn a_bundle_across_a_key_rotation_verifies_from_either_key() {
    let r = rotated();
    assert_eq!(r.bundle.public_key, r.first.public_key_hex());
    let text = r.bundle.to_vec().unwrap();
    let read = Bundle::from_slice(&text).unwrap();
    assert_eq!(read, r.bundle);
    for trusted in [&r.first, &r.second] {
        let verdict = verify_bundle(&read, Some(&trusted.verifier()));
        assert!(verdict.ok, "{verdict}");
        assert!(verdict.signer_trusted);
        assert_eq!(verdict.key_rotations_checked, 1);
    }
    let stranger = CheckpointSigner::generate().unwrap();
    let verdict = verify_bundle(&read, Some(&stranger.verifier()));
    assert!(!verdict.ok);

    // Without the rotation the later checkpoints are another signer's.
    let mut cut = read.clone();
    cut.key_rotations.clear();
    let verdict = verify_bundle(&cut, Some(&r.first.verifier()));
    let kinds: Vec<ProblemKind> = verdict.problems.iter().map(|p| p.kind).collect();
    assert_eq!(kinds, [ProblemKind::Checkpoint, ProblemKind::Checkpoint]);

    // A rotation to another key, or one not signed by the key it hands over from.
    let stranger_key = stranger.public_key_hex();
    let mut hijacked = read.clone();
    hijacked.key_rotations[0].new_key = stranger_key.clone();
    let verdict = verify_bundle(&hijacked, Some(&r.first.verifier()));
    assert!(
        verdict
            .problems
            .iter()
            .any(|p| p.kind == ProblemKind::KeyRotation),
        "{verdict}"
    );
    let full = ledger(20);
    let mut forged = read.clone();
    forged.key_rotations[0] =
        KeyRotation::sign(&stranger, &r.second, 9, full.tree.root_at(9).unwrap(), t0());
    let verdict = verify_bundle(&forged, Some(&r.first.verifier()));
    assert!(
        verdict
            .problems
            .iter()
            .any(|p| p.kind == ProblemKind::KeyRotation
                && p.what.contains("hands over from key fingerprint")),
        "{verdict}"
    );
    // A rotation at or past the anchor does not belong in the bundle.
    let mut late = read.clone();
    late.key_rotations[0].tree_size = 20;
    assert!(!verify_bundle(&late, Some(&r.first.verifier())).ok);
}

/// The independent verifier (Python and OpenSSL, written from BUNDLE.md) agrees: the
/// rotated bundle verifies from the first key and from the second, and fails without its
/// rotation or with a stranger's key trusted.
#[test]
fn the_independent_verifier_follows_the_key_rotation_too() {
    let r = rotated();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, bundle: &Bundle| {
        let path = dir.path().join(name);
        std::fs::write(&path, bundle.to_vec_pretty().unwrap()).unwrap();
        path
    };
    let good = write("rotated.json", &r.bundle);
    let mut cut = r.bundle.clone();
    cut.key_rotations.clear();
    let cut = write("cut.json", &cut);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("independent")
        .join("verify_bundle.py");
    let run = |bundle: &std::path::Path, key: &str| {
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg(bundle)
            .arg(key)
            .output()
            .expect("python3 runs (the test machine has it)");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let stranger = CheckpointSigner::generate().unwrap();
    let (ok, out) = run(&good, &r.first.public_key_hex());
    assert!(ok, "{out}");
    let (ok, out) = run(&good, &r.second.public_key_hex());
    assert!(ok, "{out}");
    let (ok, out) = run(&cut, &r.first.public_key_hex());
    assert!(!ok && out.contains("checkpoint 1 signature"), "{out}");
    let (ok, out) = run(&good, &stranger.public_key_hex());
    assert!(!ok && out.contains("bundle names another key"), "{out}");
}

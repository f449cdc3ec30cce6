//! The worked example of `BUNDLE.md`: a five-event ledger, two checkpoints, a bundle of
//! three events. Generated deterministically from the test key in `tests/data/` (SM2
//! signatures here use RFC 6979 nonces), compared byte for byte with the checked-in file,
//! verified, and every value the document quotes is recomputed here.
//!
//! To regenerate after a deliberate format change: `AETHER_REGENERATE_EXAMPLE=1 cargo test
//! -p aether-audit --test example`, then update the quoted values in `BUNDLE.md`.

mod common;

use std::path::{Path, PathBuf};

use aether_audit::{Bundle, ReadLimits, key_fingerprint, verify_bundle, verify_bundle_file};
use aether_ledger::checkpoint::statement;
use aether_ledger::hashing::{Hash, canonical_event_bytes, hex_hash};
use aether_ledger::merkle::{leaf_hash, node_hash};
use aether_ledger::{CheckpointSigner, CheckpointVerifier, SignedCheckpoint};
use chrono::{DateTime, TimeZone, Utc};
use common::Ledger;
use serde_json::json;
use uuid::Uuid;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn at(h: u32, m: u32, s: u32, micros: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 30, h, m, s).unwrap()
        + chrono::Duration::microseconds(i64::from(micros))
}

fn id(s: &str) -> Uuid {
    Uuid::parse_str(s).unwrap()
}

struct Example {
    ledger: Ledger,
    checkpoints: Vec<SignedCheckpoint>,
    bundle: Bundle,
}

fn example() -> Example {
    let signer = CheckpointSigner::from_pem_file(&data("example-signer.TEST-ONLY.pem")).unwrap();
    let mut ledger = Ledger::new();
    // Seq 1 is worked example 1 of HASHING.md.
    ledger.append(
        "engine/sgp-region",
        "EngineActivationRequested",
        json!({"traffic_weight": 0.1, "model_ref": "finmoe-7b-v3@sgp-region", "policy_hooks": ["aml_v2", "basel3_delta"]}),
        json!({"actor": "operator:alice", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"}),
        id("01938a5c-7b2e-7c3d-8e4f-5a6b7c8d9e0f"),
        at(9, 30, 0, 123_456),
    );
    ledger.append(
        "clearing/member-042",
        "ClearingDecided",
        json!({"amount_minor": 125_000_000, "currency": "SGD", "decision": "accept", "score": 0.12}),
        json!({"actor": "gateway", "trace_id": "0af7651916cd43dd8448eb211c80319c"}),
        id("01938a5c-7b2f-7000-8000-000000000002"),
        at(9, 30, 1, 0),
    );
    ledger.append(
        "clearing/member-042",
        "ClearingDecided",
        json!({"amount_minor": 98_000, "currency": "SGD", "decision": "refer", "reason": "limit \"soft\" breach"}),
        json!({"actor": "gateway", "trace_id": "b7ad6b7169203331b7ad6b7169203331"}),
        id("01938a5c-7b2f-7000-8000-000000000003"),
        at(9, 30, 2, 500_000),
    );
    let first = signer.sign(3, ledger.tree.root_at(3).unwrap(), at(9, 30, 3, 0));
    // Seq 4 records that checkpoint, as the ledger's checkpointer does.
    let event = first.to_event();
    ledger.append(
        aether_ledger::checkpoint::CHECKPOINT_STREAM,
        &event.event_type,
        event.payload,
        event.metadata,
        id("01938a5c-7b30-7000-8000-000000000004"),
        at(9, 30, 3, 1),
    );
    ledger.append(
        "clearing/member-042",
        "ClearingSettled",
        json!({"amount_minor": 125_000_000, "currency": "SGD", "settlement_ref": "SGX-2026-11-30-0001"}),
        json!({"actor": "settlement"}),
        id("01938a5c-7b31-7000-8000-000000000005"),
        at(9, 30, 5, 250_000),
    );
    let second = signer.sign(5, ledger.tree.root_at(5).unwrap(), at(9, 30, 6, 0));
    let checkpoints = vec![first, second];
    let bundle = Bundle::build(
        ledger.select(&[2, 3, 5]),
        &ledger.tree,
        checkpoints.clone(),
        json!({"stream_id": "clearing/member-042", "from": "2026-11-30T00:00:00Z"}),
        at(10, 0, 0, 0),
    )
    .unwrap();
    Example {
        ledger,
        checkpoints,
        bundle,
    }
}

#[test]
fn the_checked_in_example_is_reproduced_byte_for_byte_and_verifies() {
    let ex = example();
    let path = data("example-bundle.json");
    let generated = ex.bundle.to_vec_pretty().unwrap();
    if std::env::var_os("AETHER_REGENERATE_EXAMPLE").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let stored = std::fs::read(&path).unwrap();
    assert!(
        stored == generated,
        "tests/data/example-bundle.json differs from the generated example:\n{}",
        String::from_utf8_lossy(&generated)
    );

    let trusted = CheckpointVerifier::from_pem_file(&data("example-signer.pub.pem")).unwrap();
    let verdict = verify_bundle_file(&path, Some(&trusted), |_, _| {}).unwrap();
    assert!(verdict.ok, "{verdict}");
    assert_eq!(verdict.events_checked, 3);
    assert_eq!(verdict.checkpoints_checked, 2);
    assert_eq!(verdict.anchor_tree_size, Some(5));
    assert!(verdict.signer_trusted);

    let parsed = Bundle::read_file(&path, &ReadLimits::default()).unwrap();
    assert_eq!(parsed, ex.bundle);
    // Compact form verifies too.
    assert!(
        verify_bundle(
            &Bundle::from_slice(&ex.bundle.to_vec().unwrap()).unwrap(),
            None
        )
        .ok
    );
}

/// Every value `BUNDLE.md` quotes, in the order it quotes them.
fn quoted_values(ex: &Example) -> Vec<(&'static str, String)> {
    let hashes: Vec<Hash> = ex.ledger.events.iter().map(|e| e.hash).collect();
    let leaf: Vec<Hash> = hashes.iter().map(leaf_hash).collect();
    let n01 = node_hash(&leaf[0], &leaf[1]);
    let n23 = node_hash(&leaf[2], &leaf[3]);
    let root3 = node_hash(&n01, &leaf[2]);
    let root4 = node_hash(&n01, &n23);
    let root5 = node_hash(&root4, &leaf[4]);
    assert_eq!(ex.ledger.tree.root_at(3).unwrap(), root3);
    assert_eq!(ex.ledger.tree.root_at(5).unwrap(), root5);
    let hex = hex::encode;
    let seq3 = &ex.ledger.events[2];
    let anchor = &ex.checkpoints[1];
    vec![
        ("seq 1 hash (HASHING.md example 1)", hex(hashes[0])),
        ("seq 2 hash", hex(hashes[1])),
        ("seq 3 hash", hex(hashes[2])),
        ("seq 4 hash", hex(hashes[3])),
        ("seq 5 hash", hex(hashes[4])),
        ("root at size 3", hex(root3)),
        ("root at size 5", hex(root5)),
        ("public key", ex.bundle.public_key.clone()),
        (
            "key fingerprint",
            key_fingerprint(&ex.bundle.public_key).unwrap(),
        ),
        (
            "anchor statement",
            String::from_utf8(statement(
                anchor.tree_size,
                &anchor.root_hash,
                &anchor.signed_at,
            ))
            .unwrap(),
        ),
        ("anchor signature", anchor.signature.clone()),
        ("consistency c0 = leaf 2", hex(leaf[2])),
        ("consistency c1 = leaf 3", hex(leaf[3])),
        ("consistency sr after c1", hex(n23)),
        ("consistency c2 = node(0,1)", hex(n01)),
        ("consistency fr after c2 = root 3", hex(root3)),
        ("consistency sr after c2", hex(root4)),
        ("consistency c3 = leaf 4", hex(leaf[4])),
        ("consistency sr after c3 = root 5", hex(root5)),
        (
            "seq 3 canonical bytes",
            String::from_utf8(canonical_event_bytes(&seq3.hashed_fields())).unwrap(),
        ),
        ("seq 3 prev_hash", hex(seq3.prev_hash)),
        ("seq 3 hash", hex(seq3.hash)),
        ("inclusion start: leaf 2", hex(leaf[2])),
        ("inclusion p1 = leaf 3", hex(leaf[3])),
        ("inclusion r after p1", hex(n23)),
        ("inclusion p2 = node(0,1)", hex(n01)),
        ("inclusion r after p2", hex(root4)),
        ("inclusion p3 = leaf 4", hex(leaf[4])),
        ("inclusion r after p3 = root", hex(root5)),
    ]
}

#[test]
fn bundle_md_quotes_the_example_exactly() {
    let ex = example();
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("BUNDLE.md")).unwrap();
    let file = String::from_utf8(ex.bundle.to_vec_pretty().unwrap()).unwrap();
    assert!(
        doc.contains(&format!("```json\n{file}```")),
        "BUNDLE.md does not contain the example bundle verbatim"
    );
    // Seq 1 is HASHING.md's worked example 1.
    assert_eq!(
        ex.ledger.events[0].hash,
        hex_hash::parse("e979426a7ac2cf7d93df8a275b02e210aee6630aae23ee13fb46ac269eb2e16e")
            .unwrap()
    );
    // The walkthrough quotes each value after the previous one (the full bundle comes
    // first, so the search starts after it).
    let mut from = doc.find(&file).unwrap() + file.len();
    for (what, value) in quoted_values(&ex) {
        match doc[from..].find(&value) {
            Some(at) => from += at + value.len(),
            None => panic!("BUNDLE.md lacks {what} = {value} (after byte {from})"),
        }
    }
}

#[test]
#[ignore = "prints the values BUNDLE.md quotes; run with --ignored --nocapture"]
fn print_quoted_values() {
    let ex = example();
    for (what, value) in quoted_values(&ex) {
        println!("{what}: {value}");
    }
    let ev = &ex.ledger.events[2];
    println!("seq 3 fields: {}", serde_json::to_string(ev).unwrap());
    println!(
        "statement:\n{}",
        String::from_utf8(statement(
            ex.checkpoints[1].tree_size,
            &ex.checkpoints[1].root_hash,
            &ex.checkpoints[1].signed_at
        ))
        .unwrap()
    );
}

//! Evidence bundles: building, reading, writing and offline verification, including forged
//! and corrupted bundles.

mod common;

use std::sync::OnceLock;

use aether_audit::{
    Bundle, BundleError, FORMAT, ProblemKind, ReadLimits, Verdict, key_fingerprint, verify_bundle,
    verify_bundle_file,
};
use aether_ledger::hashing::{GENESIS_PREV_HASH, event_hash, format_timestamp};
use aether_ledger::merkle::MerkleTree;
use aether_ledger::{CheckpointSigner, CheckpointVerifier, RecordedEvent, SignedCheckpoint};
use common::{Ledger, ledger, t0};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::json;

/// Seqs exported by the fixture: 1 (genesis link), consecutive runs (2–3, 8–9, 17–18),
/// the last event of each checkpoint (13, 20) and isolated ones.
const SEQS: &[u64] = &[1, 2, 3, 5, 8, 9, 13, 17, 18, 20];
/// Tree sizes of the fixture's checkpoints; the last is the anchor.
const CHECKPOINT_SIZES: &[u64] = &[7, 13, 20];

struct Fixture {
    ledger: Ledger,
    signer: CheckpointSigner,
    checkpoints: Vec<SignedCheckpoint>,
    bundle: Bundle,
}

fn fixture() -> Fixture {
    let full = ledger(20);
    let signer = CheckpointSigner::generate().unwrap();
    let checkpoints = CHECKPOINT_SIZES
        .iter()
        .map(|&size| {
            signer.sign(
                size,
                full.tree.root_at(size).unwrap(),
                t0() + common::micros(size * 1000 + 1),
            )
        })
        .collect::<Vec<_>>();
    let bundle = Bundle::build(
        full.select(SEQS),
        &full.tree,
        checkpoints.clone(),
        json!({"stream_id": "clearing/*", "from": "2026-11-30"}),
        t0() + common::micros(60_000_000),
    )
    .unwrap();
    Fixture {
        ledger: full,
        signer,
        checkpoints,
        bundle,
    }
}

/// One shared fixture for the property tests (built once).
fn shared() -> &'static (Bundle, CheckpointVerifier) {
    static SHARED: OnceLock<(Bundle, CheckpointVerifier)> = OnceLock::new();
    SHARED.get_or_init(|| {
        let f = fixture();
        (f.bundle, f.signer.verifier())
    })
}

/// `(kind, seq)` of every problem, for precise assertions.
fn found(verdict: &Verdict) -> Vec<(ProblemKind, Option<u64>)> {
    verdict.problems.iter().map(|p| (p.kind, p.seq)).collect()
}

fn event_mut(bundle: &mut Bundle, seq: u64) -> &mut aether_audit::BundleEvent {
    bundle.events.iter_mut().find(|e| e.seq == seq).unwrap()
}

fn verify_trusted(f: &Fixture, bundle: &Bundle) -> Verdict {
    verify_bundle(bundle, Some(&f.signer.verifier()))
}

// ------------------------------------------------------------------ happy path

#[test]
fn a_bundle_from_a_real_chain_survives_serialization_and_verifies() {
    let f = fixture();
    assert_eq!(f.bundle.format, FORMAT);
    assert_eq!(f.bundle.events.len(), SEQS.len());
    assert_eq!(f.bundle.consistency.len(), CHECKPOINT_SIZES.len() - 1);
    assert_eq!(f.bundle.public_key, f.signer.public_key_hex());
    for pretty in [false, true] {
        let bytes = if pretty {
            f.bundle.to_vec_pretty().unwrap()
        } else {
            f.bundle.to_vec().unwrap()
        };
        let parsed = Bundle::from_slice(&bytes).unwrap();
        assert_eq!(parsed, f.bundle);

        let verdict = verify_trusted(&f, &parsed);
        assert!(verdict.ok, "{verdict}");
        assert!(verdict.problems.is_empty());
        assert_eq!(verdict.events_checked, SEQS.len() as u64);
        assert_eq!(verdict.checkpoints_checked, CHECKPOINT_SIZES.len() as u64);
        assert_eq!(verdict.anchor_tree_size, Some(20));
        assert_eq!(
            verdict.anchor_root_hash,
            Some(hex::encode(f.ledger.tree.root_at(20).unwrap()))
        );
        assert!(verdict.signer_trusted);
        assert_eq!(
            verdict.key_fingerprint,
            key_fingerprint(&f.signer.public_key_hex())
        );
    }
    // The bundle's events are the ledger's, field for field.
    for (event, seq) in f.bundle.events.iter().zip(SEQS) {
        let recorded = &f.ledger.events[*seq as usize - 1];
        assert_eq!(event.seq, *seq);
        assert_eq!(event.hash, recorded.hash);
        assert_eq!(event.payload, recorded.payload.get());
        assert_eq!(event.recorded_at, format_timestamp(&recorded.recorded_at));
        assert_eq!(event.event_id, recorded.event_id.to_string());
    }
}

#[test]
fn without_a_trusted_key_the_verdict_says_the_signer_is_not_trusted() {
    let f = fixture();
    let verdict = verify_bundle(&f.bundle, None);
    assert!(verdict.ok, "{verdict}");
    assert!(!verdict.signer_trusted);
    let fingerprint = key_fingerprint(&f.signer.public_key_hex()).unwrap();
    assert_eq!(
        verdict.key_fingerprint.as_deref(),
        Some(fingerprint.as_str())
    );
    let text = verdict.to_string();
    assert!(text.contains("NOT independently trusted"), "{text}");
    assert!(text.contains(&fingerprint), "{text}");
    // The fingerprint is SM3 over the SEC1 key bytes.
    assert_eq!(
        fingerprint,
        hex::encode(aether_ledger::hashing::sm3(
            &hex::decode(f.signer.public_key_hex()).unwrap()
        ))
    );
}

#[test]
fn a_single_checkpoint_and_the_whole_log_verify() {
    let full = ledger(9);
    let signer = CheckpointSigner::generate().unwrap();
    let events = full.events.clone();
    let bundle = Bundle::build(
        events,
        &full.tree,
        vec![full.checkpoint(&signer)],
        json!({}),
        t0(),
    )
    .unwrap();
    assert!(bundle.consistency.is_empty());
    let verdict = verify_bundle(&bundle, Some(&signer.verifier()));
    assert!(verdict.ok, "{verdict}");
    // A bundle of no events still proves the checkpoints.
    let empty = Bundle::build(
        vec![],
        &full.tree,
        vec![full.checkpoint(&signer)],
        json!({}),
        t0(),
    )
    .unwrap();
    assert!(verify_bundle(&empty, Some(&signer.verifier())).ok);
}

#[test]
fn files_round_trip_and_progress_reaches_the_total() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bundle.json");
    f.bundle.write_file(&path, true).unwrap();
    let mut calls = Vec::new();
    let verdict = verify_bundle_file(&path, Some(&f.signer.verifier()), |done, total| {
        calls.push((done, total))
    })
    .unwrap();
    assert!(verdict.ok, "{verdict}");
    let total = (SEQS.len() + CHECKPOINT_SIZES.len()) as u64;
    assert_eq!(calls.first(), Some(&(0, total)));
    assert_eq!(calls.last(), Some(&(total, total)));
    assert!(calls.windows(2).all(|w| w[0].0 < w[1].0));

    let missing = verify_bundle_file(&dir.path().join("nope.json"), None, |_, _| {});
    assert!(
        matches!(&missing, Err(BundleError::File { action: "read", .. })),
        "{missing:?}"
    );
    let read = Bundle::read_file(&path, &ReadLimits::default()).unwrap();
    assert_eq!(read, f.bundle);
}

// ------------------------------------------------------------------ events tampered with

#[test]
fn an_altered_payload_is_a_hash_mismatch_at_its_seq() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    event_mut(&mut bundle, 8).payload = event_mut(&mut bundle, 8)
        .payload
        .replace("\"amount_minor\":10000", "\"amount_minor\":99999");
    assert_ne!(bundle, f.bundle);
    let verdict = verify_trusted(&f, &bundle);
    assert!(!verdict.ok);
    // The payload is still canonical and the stated hash still included: only the hash check fails.
    assert_eq!(found(&verdict), vec![(ProblemKind::HashMismatch, Some(8))]);
    assert!(
        verdict.problems[0]
            .what
            .contains(&hex::encode(f.ledger.events[7].hash))
    );
    assert!(verdict.to_string().contains("seq 8: hash is"));
}

#[test]
fn an_altered_hash_fails_recomputation_inclusion_and_the_next_link() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    event_mut(&mut bundle, 2).hash[5] ^= 0x40;
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(
        found(&verdict),
        vec![
            (ProblemKind::HashMismatch, Some(2)),
            (ProblemKind::Inclusion, Some(2)),
            (ProblemKind::BrokenLink, Some(3)),
        ]
    );

    // An attacker who alters a payload, recomputes the hash and the chain after it, and
    // brings inclusion proofs from a tree over the forged hashes: the proofs lead to a root
    // nobody signed.
    let mut forged = f.ledger.events.clone();
    let payload =
        serde_json::value::RawValue::from_string(r#"{"amount_minor":1,"i":9}"#.into()).unwrap();
    forged[8].payload = payload;
    rechain(&mut forged, 9);
    let forged_tree =
        MerkleTree::from_event_hashes(&forged.iter().map(|e| e.hash).collect::<Vec<_>>());
    let mut bundle = f.bundle.clone();
    for event in bundle.events.iter_mut().filter(|e| e.seq >= 9) {
        let source = &forged[event.seq as usize - 1];
        event.payload = source.payload.get().to_owned();
        event.prev_hash = source.prev_hash;
        event.hash = source.hash;
        event.inclusion_proof = forged_tree.inclusion_proof(event.seq - 1, 20).unwrap();
    }
    let verdict = verify_trusted(&f, &bundle);
    let problems = found(&verdict);
    assert!(!verdict.ok);
    // Every event from 9 on fails inclusion against the signed anchor; nothing else fails.
    assert_eq!(
        problems,
        [9, 13, 17, 18, 20]
            .iter()
            .map(|s| (ProblemKind::Inclusion, Some(*s)))
            .collect::<Vec<_>>()
    );
    assert!(
        verdict.problems[0]
            .what
            .contains("does not lead to the given root")
    );
}

/// Recomputes hashes and links of `events` from seq `from` on (they keep their fields).
fn rechain(events: &mut [RecordedEvent], from: u64) {
    for i in (from as usize - 1)..events.len() {
        let prev = if i == 0 {
            GENESIS_PREV_HASH
        } else {
            events[i - 1].hash
        };
        events[i].prev_hash = prev;
        events[i].hash = event_hash(&prev, &events[i].hashed_fields());
    }
}

#[test]
fn a_proof_for_another_leaf_fails_inclusion() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    // Seq 5 carries the proof of seq 8 (same length at tree size 20).
    let other = event_mut(&mut bundle, 8).inclusion_proof.clone();
    assert_eq!(other.len(), event_mut(&mut bundle, 5).inclusion_proof.len());
    event_mut(&mut bundle, 5).inclusion_proof = other;
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::Inclusion, Some(5))]);

    // Seq 5 claims to be seq 8's leaf: its own hash with seq 8's index does not verify either.
    let mut bundle = f.bundle.clone();
    let eight = event_mut(&mut bundle, 8).clone();
    let five = event_mut(&mut bundle, 5);
    five.hash = eight.hash;
    five.inclusion_proof = eight.inclusion_proof;
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(
        found(&verdict),
        vec![
            (ProblemKind::HashMismatch, Some(5)),
            (ProblemKind::Inclusion, Some(5))
        ]
    );
}

#[test]
fn truncated_and_extended_proofs_fail_with_the_lengths() {
    let f = fixture();
    let expected = event_mut(&mut f.bundle.clone(), 13).inclusion_proof.len();
    for change in ["pop", "push", "drop-first", "empty"] {
        let mut bundle = f.bundle.clone();
        let proof = &mut event_mut(&mut bundle, 13).inclusion_proof;
        match change {
            "pop" => {
                proof.pop();
            }
            "push" => proof.push([0xab; 32]),
            "drop-first" => {
                proof.remove(0);
            }
            _ => proof.clear(),
        }
        let actual = proof.len();
        let verdict = verify_trusted(&f, &bundle);
        assert_eq!(
            found(&verdict),
            vec![(ProblemKind::Inclusion, Some(13))],
            "{change}"
        );
        assert!(
            verdict.problems[0].what.contains(&format!(
                "proof has {actual} hashes but {expected} were expected"
            )),
            "{change}: {}",
            verdict.problems[0].what
        );
    }
}

#[test]
fn a_broken_link_between_consecutive_events_names_the_later_seq() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    // Seq 18's prev_hash no longer points at seq 17 (and its own hash no longer matches).
    event_mut(&mut bundle, 18).prev_hash = event_mut(&mut bundle, 9).hash;
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(
        found(&verdict),
        vec![
            (ProblemKind::HashMismatch, Some(18)),
            (ProblemKind::BrokenLink, Some(18))
        ]
    );
    let link = &verdict.problems[1].what;
    assert!(link.contains("hash of seq 17"), "{link}");

    // Seq 1 must point at 32 zero bytes.
    let mut bundle = f.bundle.clone();
    event_mut(&mut bundle, 1).prev_hash[0] = 1;
    let verdict = verify_trusted(&f, &bundle);
    assert!(found(&verdict).contains(&(ProblemKind::BrokenLink, Some(1))));
}

#[test]
fn non_canonical_payload_text_is_reported_even_when_it_means_the_same() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    let event = event_mut(&mut bundle, 3);
    let value: serde_json::Value = serde_json::from_str(&event.payload).unwrap();
    event.payload = serde_json::to_string_pretty(&value).unwrap();
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(
        found(&verdict),
        vec![
            (ProblemKind::NonCanonicalJson, Some(3)),
            (ProblemKind::HashMismatch, Some(3))
        ]
    );
    assert!(
        verdict.problems[0]
            .what
            .starts_with("payload is not in RFC 8785 canonical form")
    );

    // Non-objects and non-JSON in either field.
    for (field, text, what) in [
        ("metadata", "[1,2]", "metadata is not a JSON object"),
        ("payload", "{\"a\":1", "payload is not JSON"),
        ("payload", "{\"a\":1.0}", "payload is not in RFC 8785"),
        ("payload", "{\"b\":1,\"a\":2}", "payload is not in RFC 8785"),
    ] {
        let mut bundle = f.bundle.clone();
        let event = event_mut(&mut bundle, 17);
        if field == "payload" {
            event.payload = text.into();
        } else {
            event.metadata = text.into();
        }
        let verdict = verify_trusted(&f, &bundle);
        assert_eq!(
            verdict.problems[0].kind,
            ProblemKind::NonCanonicalJson,
            "{text}"
        );
        assert_eq!(verdict.problems[0].seq, Some(17));
        assert!(
            verdict.problems[0].what.starts_with(what),
            "{}",
            verdict.problems[0].what
        );
    }
}

#[test]
fn event_ids_and_times_must_be_written_as_hashed() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    let event = event_mut(&mut bundle, 5);
    event.event_id = event.event_id.to_uppercase();
    let verdict = verify_trusted(&f, &bundle);
    // The same UUID hashes the same, but the text is not what an independent verifier hashes.
    assert_eq!(found(&verdict), vec![(ProblemKind::EventField, Some(5))]);

    let mut bundle = f.bundle.clone();
    let event = event_mut(&mut bundle, 5);
    event.recorded_at = event.recorded_at.replace('Z', "+00:00");
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::EventField, Some(5))]);

    let mut bundle = f.bundle.clone();
    event_mut(&mut bundle, 5).event_id = "not-a-uuid".into();
    event_mut(&mut bundle, 8).recorded_at = "yesterday".into();
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(
        found(&verdict),
        vec![
            (ProblemKind::EventField, Some(5)),
            (ProblemKind::EventField, Some(8))
        ]
    );
}

#[test]
fn order_time_and_stream_versions_are_checked_across_events() {
    let f = fixture();
    // Out of order and duplicated seqs.
    let mut bundle = f.bundle.clone();
    bundle.events.swap(3, 4); // 5 and 8
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::EventOrder, Some(5))]);
    let mut bundle = f.bundle.clone();
    let dup = bundle.events[2].clone();
    bundle.events.insert(3, dup);
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::EventOrder, Some(3))]);

    // Beyond the anchor, and seq 0.
    let mut bundle = f.bundle.clone();
    bundle.events.last_mut().unwrap().seq = 21;
    let problems = found(&verify_trusted(&f, &bundle));
    assert!(
        problems.contains(&(ProblemKind::Inclusion, Some(21))),
        "{problems:?}"
    );
    let mut bundle = f.bundle.clone();
    bundle.events[0].seq = 0;
    let problems = found(&verify_trusted(&f, &bundle));
    assert!(
        problems.contains(&(ProblemKind::EventOrder, Some(0))),
        "{problems:?}"
    );

    // Time and stream versions (self-consistent forgeries would also fail inclusion; the
    // point here is that each rule is checked).
    let mut bundle = f.bundle.clone();
    event_mut(&mut bundle, 9).recorded_at = "2026-11-30T09:29:59.000000Z".into();
    let problems = found(&verify_trusted(&f, &bundle));
    assert!(
        problems.contains(&(ProblemKind::TimeWentBackwards, Some(9))),
        "{problems:?}"
    );
    let mut bundle = f.bundle.clone();
    // Seqs 17 and 20 are in the same stream, three seqs apart: at most three versions apart.
    event_mut(&mut bundle, 20).stream_version += 5;
    let problems = found(&verify_trusted(&f, &bundle));
    assert!(
        problems.contains(&(ProblemKind::StreamVersion, Some(20))),
        "{problems:?}"
    );
}

#[test]
fn format_tag_and_filters_are_checked_on_bundles_built_in_memory() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    bundle.format = "aether.evidence-bundle.v0".into();
    bundle.filters = json!("everything");
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(
        found(&verdict),
        vec![(ProblemKind::Format, None), (ProblemKind::Format, None)]
    );
    assert!(
        verdict.problems[0]
            .what
            .contains("aether.evidence-bundle.v0")
    );
    assert_eq!(verdict.problems[1].what, "filters is not a JSON object");

    // An unusable key in the bundle, with no trusted key: nothing can be checked.
    let mut bundle = f.bundle.clone();
    bundle.public_key = "04abcd".into();
    let verdict = verify_bundle(&bundle, None);
    assert!(!verdict.ok);
    assert_eq!(found(&verdict), vec![(ProblemKind::Format, None)]);
    assert!(
        verdict.problems[0]
            .what
            .starts_with("public_key is unusable")
    );
}

// ------------------------------------------------------------------ checkpoints and signers

#[test]
fn a_checkpoint_signed_by_another_key_fails_when_a_key_is_trusted() {
    let f = fixture();
    let stranger = CheckpointSigner::generate().unwrap();
    let mut bundle = f.bundle.clone();
    let middle = &bundle.checkpoints[1];
    bundle.checkpoints[1] = stranger.sign(middle.tree_size, middle.root_hash, t0());
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::Checkpoint, None)]);
    let what = &verdict.problems[0].what;
    assert!(what.starts_with("checkpoint 1 (tree size 13):"), "{what}");
    assert!(what.contains("not the trusted key"), "{what}");

    // Without a trusted key, the bundle's own key is the reference: still caught.
    let verdict = verify_bundle(&bundle, None);
    assert_eq!(found(&verdict), vec![(ProblemKind::Checkpoint, None)]);
}

#[test]
fn a_checkpoint_with_a_tampered_root_fails_its_signature_and_what_hangs_on_it() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    bundle.checkpoints[0].root_hash[31] ^= 1;
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(
        found(&verdict),
        vec![
            (ProblemKind::Checkpoint, None),
            (ProblemKind::Consistency, None)
        ]
    );
    assert!(
        verdict.problems[0]
            .what
            .contains("signature does not verify")
    );
    assert!(
        verdict.problems[1]
            .what
            .starts_with("consistency proof 0 from tree size 7 to 13")
    );

    // The anchor's root: every inclusion proof fails too, each naming its seq.
    let mut bundle = f.bundle.clone();
    bundle.checkpoints[2].root_hash[0] ^= 0x80;
    let verdict = verify_trusted(&f, &bundle);
    let mut expected = vec![
        (ProblemKind::Checkpoint, None),
        (ProblemKind::Consistency, None),
    ];
    expected.extend(SEQS.iter().map(|s| (ProblemKind::Inclusion, Some(*s))));
    assert_eq!(found(&verdict), expected);
}

#[test]
fn wrong_consistency_proofs_are_reported() {
    let f = fixture();
    // A flipped element.
    let mut bundle = f.bundle.clone();
    bundle.consistency[1].proof[0][3] ^= 4;
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::Consistency, None)]);
    assert!(
        verdict.problems[0]
            .what
            .starts_with("consistency proof 1 from tree size 13 to 20:")
    );

    // The proof for other sizes (labels changed to match: the path still fails).
    let mut bundle = f.bundle.clone();
    bundle.consistency[1].proof = f.ledger.tree.consistency_proof(12, 20).unwrap();
    assert_eq!(
        found(&verify_trusted(&f, &bundle)),
        vec![(ProblemKind::Consistency, None)]
    );

    // Labels that do not match the checkpoints.
    let mut bundle = f.bundle.clone();
    bundle.consistency[0].old_size = 6;
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::Consistency, None)]);
    assert!(verdict.problems[0].what.contains("from size 6 to 13"));

    // Missing proof.
    let mut bundle = f.bundle.clone();
    bundle.consistency.pop();
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::Consistency, None)]);

    // A forked history: checkpoint 0 signed over different first events. The consistency
    // proof from the honest tree cannot link the fork's root to the honest anchor.
    let mut forked = f.ledger.events.clone();
    forked[2].event_type = "Rewritten".into();
    rechain(&mut forked, 3);
    let fork_tree =
        MerkleTree::from_event_hashes(&forked.iter().map(|e| e.hash).collect::<Vec<_>>());
    let mut bundle = f.bundle.clone();
    bundle.checkpoints[0] = f.signer.sign(7, fork_tree.root_at(7).unwrap(), t0());
    bundle.consistency[0].proof = fork_tree.consistency_proof(7, 13).unwrap();
    let verdict = verify_trusted(&f, &bundle);
    assert_eq!(found(&verdict), vec![(ProblemKind::Consistency, None)]);
}

#[test]
fn checkpoints_must_ascend_and_exist() {
    let f = fixture();
    let mut bundle = f.bundle.clone();
    bundle.checkpoints.swap(0, 1);
    let problems = found(&verify_trusted(&f, &bundle));
    assert!(
        problems.contains(&(ProblemKind::CheckpointOrder, None)),
        "{problems:?}"
    );

    let mut bundle = f.bundle.clone();
    bundle.checkpoints.clear();
    bundle.consistency.clear();
    let verdict = verify_trusted(&f, &bundle);
    assert!(!verdict.ok);
    assert_eq!(verdict.anchor_tree_size, None);
    assert_eq!(found(&verdict), vec![(ProblemKind::Checkpoint, None)]);
}

/// In the spirit of immudb GHSA-672p-m5jq-mrh8 (a verifier that trusted state supplied by
/// the party being verified): the attacker rewrites events, recomputes every hash, proof
/// and root consistently, and only lacks the operator's signing key.
#[test]
fn a_consistently_forged_bundle_fails_against_the_trusted_key() {
    let f = fixture();
    let mut forged_ledger = f.ledger.events.clone();
    for event in &mut forged_ledger {
        if event.seq == 8 {
            event.payload =
                serde_json::value::RawValue::from_string(r#"{"amount_minor":0,"i":8}"#.into())
                    .unwrap();
        }
    }
    rechain(&mut forged_ledger, 8);
    let tree =
        MerkleTree::from_event_hashes(&forged_ledger.iter().map(|e| e.hash).collect::<Vec<_>>());

    // (1) New roots with the old signatures.
    let resigned_old: Vec<SignedCheckpoint> = f
        .checkpoints
        .iter()
        .map(|c| SignedCheckpoint {
            root_hash: tree.root_at(c.tree_size).unwrap(),
            ..c.clone()
        })
        .collect();
    let bundle = forge(&forged_ledger, &tree, resigned_old);
    let verdict = verify_trusted(&f, &bundle);
    assert!(!verdict.ok);
    assert_eq!(
        found(&verdict),
        vec![
            (ProblemKind::Checkpoint, None),
            (ProblemKind::Checkpoint, None)
        ],
        "checkpoints 1 and 2 cover the forged event; {verdict}"
    );
    assert!(!verify_bundle(&bundle, None).ok);

    // (2) The attacker signs with their own key and names it in the bundle: internally
    // consistent, so only the trusted key tells.
    let attacker = CheckpointSigner::generate().unwrap();
    let own: Vec<SignedCheckpoint> = f
        .checkpoints
        .iter()
        .map(|c| attacker.sign(c.tree_size, tree.root_at(c.tree_size).unwrap(), t0()))
        .collect();
    let bundle = forge(&forged_ledger, &tree, own);
    let verdict = verify_trusted(&f, &bundle);
    assert!(!verdict.ok);
    assert!(verdict.signer_trusted);
    let problems = found(&verdict);
    assert_eq!(problems[0], (ProblemKind::Format, None), "{verdict}");
    assert_eq!(
        &problems[1..],
        &[(ProblemKind::Checkpoint, None); 3],
        "every checkpoint is signed by an untrusted key; {verdict}"
    );

    let verdict = verify_bundle(&bundle, None);
    assert!(verdict.ok, "{verdict}");
    assert!(!verdict.signer_trusted);
    assert_eq!(
        verdict.key_fingerprint,
        key_fingerprint(&attacker.public_key_hex())
    );
    assert_ne!(
        verdict.key_fingerprint,
        key_fingerprint(&f.signer.public_key_hex())
    );
    assert!(verdict.to_string().contains("NOT independently trusted"));
}

fn forge(
    events: &[RecordedEvent],
    tree: &MerkleTree,
    checkpoints: Vec<SignedCheckpoint>,
) -> Bundle {
    let selected = SEQS
        .iter()
        .map(|s| events[*s as usize - 1].clone())
        .collect();
    // The builder checks roots against the tree, which the forger controls.
    Bundle::build(selected, tree, checkpoints, json!({}), t0()).unwrap()
}

// ------------------------------------------------------------------ builder errors

#[test]
fn the_builder_refuses_what_cannot_be_proven() {
    let f = fixture();
    let build = |events: Vec<RecordedEvent>, checkpoints: Vec<SignedCheckpoint>, filters| {
        Bundle::build(events, &f.ledger.tree, checkpoints, filters, t0())
    };
    let cps = f.checkpoints.clone();
    assert!(matches!(
        build(f.ledger.select(&[1]), vec![], json!({})),
        Err(BundleError::NoCheckpoints)
    ));
    assert!(matches!(
        build(
            f.ledger.select(&[1]),
            vec![cps[1].clone(), cps[0].clone()],
            json!({})
        ),
        Err(BundleError::CheckpointsNotAscending {
            index: 1,
            previous: 13,
            tree_size: 7
        })
    ));
    assert!(matches!(
        build(
            f.ledger.select(&[1]),
            vec![cps[0].clone(), cps[0].clone()],
            json!({})
        ),
        Err(BundleError::CheckpointsNotAscending { .. })
    ));
    assert!(matches!(
        build(f.ledger.select(&[8]), vec![cps[0].clone()], json!({})),
        Err(BundleError::EventBeyondAnchor {
            seq: 8,
            anchor_tree_size: 7
        })
    ));
    assert!(matches!(
        build(f.ledger.select(&[2, 2]), cps.clone(), json!({})),
        Err(BundleError::DuplicateEvent { seq: 2 })
    ));
    assert!(matches!(
        build(
            f.ledger.select(&[2]),
            cps.clone(),
            json!(["not", "an", "object"])
        ),
        Err(BundleError::FiltersNotObject)
    ));
    let mut wrong_root = cps.clone();
    wrong_root[1].root_hash = wrong_root[0].root_hash;
    assert!(matches!(
        build(f.ledger.select(&[2]), wrong_root, json!({})),
        Err(BundleError::CheckpointRootMismatch { tree_size: 13, .. })
    ));
    let stranger = CheckpointSigner::generate().unwrap();
    let mut mixed = cps.clone();
    mixed[0] = stranger.sign(7, f.ledger.tree.root_at(7).unwrap(), t0());
    assert!(matches!(
        build(f.ledger.select(&[2]), mixed, json!({})),
        Err(BundleError::MixedSigners { index: 0, .. })
    ));
    let small = ledger(5);
    assert!(matches!(
        Bundle::build(vec![], &small.tree, cps, json!({}), t0()),
        Err(BundleError::Proof(_))
    ));
    // Events in any order come out sorted.
    let bundle = build(
        f.ledger.select(&[9, 1, 5]),
        f.checkpoints.clone(),
        json!({}),
    )
    .unwrap();
    assert_eq!(
        bundle.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1, 5, 9]
    );
}

// ------------------------------------------------------------------ streamed bundles

/// A bundle written piece by piece (as `POST /v1/audit/exports` streams it) is the bundle
/// built whole, byte for byte, with zero, one or many events; the writer refuses events
/// out of order, twice or past the anchor, and appends nothing for them.
#[test]
fn a_streamed_bundle_is_the_built_bundle_byte_for_byte() {
    let f = fixture();
    let filters = json!({"event_type": "ClearingDecided"});
    for seqs in [&[][..], &[4][..], SEQS] {
        let whole = Bundle::build(
            f.ledger.select(seqs),
            &f.ledger.tree,
            f.checkpoints.clone(),
            filters.clone(),
            t0(),
        )
        .unwrap()
        .to_vec()
        .unwrap();
        let (mut streamed, mut writer) = Bundle::begin_rotated(
            &f.ledger.tree,
            f.checkpoints.clone(),
            vec![],
            filters.clone(),
            t0(),
        )
        .unwrap();
        for event in f.ledger.select(seqs) {
            writer.write(&event, &f.ledger.tree, &mut streamed).unwrap();
        }
        assert_eq!(writer.written(), seqs.len() as u64);
        streamed.extend_from_slice(writer.finish());
        assert_eq!(
            String::from_utf8(streamed.clone()).unwrap(),
            String::from_utf8(whole).unwrap()
        );
        let verdict = verify_trusted(&f, &Bundle::from_slice(&streamed).unwrap());
        assert!(verdict.ok, "{verdict}");
    }

    let (_, mut writer) = Bundle::begin_rotated(
        &f.ledger.tree,
        f.checkpoints.clone(),
        vec![],
        json!({}),
        t0(),
    )
    .unwrap();
    let mut out = Vec::new();
    let events = f.ledger.select(&[5, 3]);
    writer.write(&events[0], &f.ledger.tree, &mut out).unwrap();
    let before = out.len();
    assert!(matches!(
        writer.write(&events[0], &f.ledger.tree, &mut out),
        Err(BundleError::DuplicateEvent { seq: 5 })
    ));
    assert!(matches!(
        writer.write(&events[1], &f.ledger.tree, &mut out),
        Err(BundleError::EventsNotAscending {
            previous: 5,
            seq: 3
        })
    ));
    assert_eq!(out.len(), before, "a refused event appends nothing");
    assert_eq!(writer.written(), 1);
    let (_, mut short) = Bundle::begin_rotated(
        &f.ledger.tree,
        vec![f.checkpoints[0].clone()],
        vec![],
        json!({}),
        t0(),
    )
    .unwrap();
    assert!(matches!(
        short.write(&f.ledger.select(&[8])[0], &f.ledger.tree, &mut out),
        Err(BundleError::EventBeyondAnchor {
            seq: 8,
            anchor_tree_size: 7
        })
    ));
    // The head is checked as a whole build is.
    assert!(matches!(
        Bundle::begin_rotated(&f.ledger.tree, vec![], vec![], json!({}), t0()),
        Err(BundleError::NoCheckpoints)
    ));
}

// ------------------------------------------------------------------ parsing

#[test]
fn the_parser_is_strict_and_bounded() {
    let f = fixture();
    let text = String::from_utf8(f.bundle.to_vec().unwrap()).unwrap();

    // Unknown members, at the top and in an event.
    let extra = text.replacen("{\"format\"", "{\"verified\":true,\"format\"", 1);
    assert!(matches!(
        Bundle::from_slice(extra.as_bytes()),
        Err(BundleError::Json(_))
    ));
    let extra = text.replacen("\"seq\":1,", "\"seq\":1,\"trusted\":true,", 1);
    assert!(matches!(
        Bundle::from_slice(extra.as_bytes()),
        Err(BundleError::Json(_))
    ));

    // Uppercase hex in a hash, a proof, a checkpoint root or the key.
    let hash = hex::encode(f.bundle.events[0].hash);
    for needle in [
        hash.clone(),
        hex::encode(f.bundle.events[0].inclusion_proof[0]),
        hex::encode(f.bundle.checkpoints[0].root_hash),
        f.bundle.public_key.clone(),
    ] {
        assert!(needle.chars().any(|c| c.is_ascii_lowercase()));
        let upper = text.replacen(&needle, &needle.to_uppercase(), 1);
        assert!(
            matches!(
                Bundle::from_slice(upper.as_bytes()),
                Err(BundleError::Json(_))
            ),
            "{needle}"
        );
    }
    // A short hash.
    let short = text.replacen(&hash, &hash[2..], 1);
    assert!(matches!(
        Bundle::from_slice(short.as_bytes()),
        Err(BundleError::Json(_))
    ));

    // Another format.
    let v2 = text.replacen(FORMAT, "aether.evidence-bundle.v2", 1);
    assert!(matches!(
        Bundle::from_slice(v2.as_bytes()),
        Err(BundleError::UnsupportedFormat { found }) if found == "aether.evidence-bundle.v2"
    ));
    let v2_new_member = v2.replacen("{\"format\"", "{\"signatures\":[],\"format\"", 1);
    assert!(matches!(
        Bundle::from_slice(v2_new_member.as_bytes()),
        Err(BundleError::UnsupportedFormat { .. })
    ));

    // Limits.
    let tight = ReadLimits {
        max_bytes: text.len() as u64 - 1,
        ..ReadLimits::default()
    };
    assert!(matches!(
        Bundle::from_slice_with_limits(text.as_bytes(), &tight),
        Err(BundleError::TooLarge { .. })
    ));
    assert!(matches!(
        Bundle::from_reader(text.as_bytes(), &tight),
        Err(BundleError::TooLarge { .. })
    ));
    let few = ReadLimits {
        max_events: 3,
        ..ReadLimits::default()
    };
    assert!(matches!(
        Bundle::from_slice_with_limits(text.as_bytes(), &few),
        Err(BundleError::TooManyRecords {
            what: "events",
            count: 10,
            limit: 3
        })
    ));
    let few = ReadLimits {
        max_checkpoints: 2,
        ..ReadLimits::default()
    };
    assert!(matches!(
        Bundle::from_slice_with_limits(text.as_bytes(), &few),
        Err(BundleError::TooManyRecords {
            what: "checkpoints",
            ..
        })
    ));
    let exact = ReadLimits {
        max_bytes: text.len() as u64,
        ..ReadLimits::default()
    };
    assert!(Bundle::from_reader(text.as_bytes(), &exact).is_ok());

    // Lineage is optional and opaque.
    let with_lineage = f.bundle.clone().with_lineage(vec![
        json!({"seq": 8, "run_id": "r-1", "delta_version": 3})
            .as_object()
            .unwrap()
            .clone(),
    ]);
    let parsed = Bundle::from_slice(&with_lineage.to_vec().unwrap()).unwrap();
    assert_eq!(parsed, with_lineage);
    assert!(!text.contains("\"lineage\""));
}

// ------------------------------------------------------------------ properties

/// Every 32-byte value of a bundle that is covered by the checks, as a mutable reference.
fn hashes_mut(bundle: &mut Bundle) -> Vec<(Option<u64>, &mut [u8; 32])> {
    let mut out: Vec<(Option<u64>, &mut [u8; 32])> = Vec::new();
    for checkpoint in &mut bundle.checkpoints {
        out.push((None, &mut checkpoint.root_hash));
    }
    for proof in &mut bundle.consistency {
        out.extend(proof.proof.iter_mut().map(|h| (None, h)));
    }
    for event in &mut bundle.events {
        let seq = Some(event.seq);
        out.push((seq, &mut event.prev_hash));
        out.push((seq, &mut event.hash));
        out.extend(event.inclusion_proof.iter_mut().map(|h| (seq, h)));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Arbitrary bytes never make the parser panic.
    #[test]
    fn arbitrary_bytes_never_panic_the_parser(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Bundle::from_slice(&bytes);
    }

    /// A valid bundle with random bytes overwritten never panics the parser or the verifier.
    #[test]
    fn corrupted_bundles_never_panic(
        edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..8),
    ) {
        let (bundle, key) = shared();
        let mut bytes = bundle.to_vec().unwrap();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if let Ok(parsed) = Bundle::from_slice(&bytes) {
            let _ = verify_bundle(&parsed, Some(key));
            let _ = verify_bundle(&parsed, None);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Any single-bit flip in any checkpoint root, consistency proof, event hash, prev_hash
    /// or inclusion proof element is detected, and an event's flip is reported at its seq.
    #[test]
    fn single_bit_flips_in_hashes_and_proofs_are_detected(target in any::<Index>(), bit in 0usize..256) {
        let (bundle, key) = shared();
        let mut bundle = bundle.clone();
        let mut targets = hashes_mut(&mut bundle);
        let n = targets.len();
        let (seq, hash) = &mut targets[target.index(n)];
        let seq = *seq;
        hash[bit / 8] ^= 1 << (bit % 8);
        let verdict = verify_bundle(&bundle, Some(key));
        prop_assert!(!verdict.ok);
        if seq.is_some() {
            prop_assert!(verdict.problems.iter().any(|p| p.seq == seq), "{}", verdict);
        }
    }

    /// The same in the serialized text: a flipped bit inside the hex of an event's hash,
    /// prev_hash or proof either makes the document unreadable or fails verification.
    #[test]
    fn single_bit_flips_in_the_hex_text_are_detected(pick in any::<Index>(), bit in 0u8..8) {
        let (bundle, key) = shared();
        let text = bundle.to_vec().unwrap();
        let mut spans = Vec::new();
        let mut hexes: Vec<String> = Vec::new();
        for event in &bundle.events {
            hexes.push(hex::encode(event.hash));
            hexes.push(hex::encode(event.prev_hash));
            hexes.extend(event.inclusion_proof.iter().map(hex::encode));
        }
        let haystack = String::from_utf8(text.clone()).unwrap();
        for h in &hexes {
            let needle = format!("\"{h}\"");
            let mut from = 0;
            while let Some(at) = haystack[from..].find(&needle) {
                spans.push(from + at + 1..from + at + 1 + 64);
                from += at + needle.len();
            }
        }
        let positions: Vec<usize> = spans.into_iter().flatten().collect();
        let at = positions[pick.index(positions.len())];
        let mut bytes = text;
        bytes[at] ^= 1 << bit;
        match Bundle::from_slice(&bytes) {
            Err(_) => {}
            Ok(parsed) => prop_assert!(!verify_bundle(&parsed, Some(key)).ok),
        }
    }
}

/// As strict as BUNDLE.md: `lineage` is an array of objects (`[1, 2]` is refused when the
/// bundle is read), `recorded_at` never names a leap second, and a checkpoint's `signed_at`
/// in another form is reported as malformed (not merely as a bad signature).
#[test]
fn lineage_records_times_and_signed_at_follow_the_documented_forms() {
    let f = fixture();
    let mut doc: serde_json::Value = serde_json::from_slice(&f.bundle.to_vec().unwrap()).unwrap();
    doc["lineage"] = json!([1, 2]);
    match Bundle::from_slice(&serde_json::to_vec(&doc).unwrap()) {
        Err(BundleError::Json(_)) => {}
        other => panic!("lineage [1, 2] was accepted: {other:?}"),
    }

    let mut bundle = f.bundle.clone();
    event_mut(&mut bundle, 8).recorded_at = "2016-12-31T23:59:60.000000Z".into();
    let verdict = verify_trusted(&f, &bundle);
    assert!(!verdict.ok);
    assert!(
        verdict.problems.iter().any(|p| p.seq == Some(8)
            && p.kind == ProblemKind::EventField
            && p.what.contains("no leap second")),
        "{verdict}"
    );

    let mut bundle = f.bundle.clone();
    bundle.checkpoints[0].signed_at = "2026-11-30T09:30:02Z".into();
    let verdict = verify_trusted(&f, &bundle);
    assert!(!verdict.ok);
    assert!(verdict.to_string().contains("signed_at"), "{verdict}");
}

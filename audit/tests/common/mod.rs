//! A tiny in-memory ledger for tests: events chained with the ledger's own `event_hash`,
//! its Merkle tree, and checkpoints signed with the ledger's signer.

#![allow(dead_code)]

use std::collections::HashMap;

use aether_ledger::hashing::{GENESIS_PREV_HASH, canonical_json, event_hash};
use aether_ledger::merkle::MerkleTree;
use aether_ledger::{CheckpointSigner, RecordedEvent, SignedCheckpoint};
use chrono::{DateTime, TimeZone, Utc};
use serde_json::value::RawValue;
use uuid::Uuid;

pub struct Ledger {
    pub events: Vec<RecordedEvent>,
    pub tree: MerkleTree,
    versions: HashMap<String, u64>,
}

impl Ledger {
    pub fn new() -> Self {
        Ledger {
            events: Vec::new(),
            tree: MerkleTree::new(),
            versions: HashMap::new(),
        }
    }

    pub fn len(&self) -> u64 {
        self.events.len() as u64
    }

    /// Appends one event, chaining it to the last.
    pub fn append(
        &mut self,
        stream_id: &str,
        event_type: &str,
        payload: serde_json::Value,
        metadata: serde_json::Value,
        event_id: Uuid,
        recorded_at: DateTime<Utc>,
    ) -> &RecordedEvent {
        let seq = self.len() + 1;
        let version = self.versions.entry(stream_id.to_owned()).or_insert(0);
        *version += 1;
        let prev_hash = self.events.last().map_or(GENESIS_PREV_HASH, |e| e.hash);
        let raw =
            |v: &serde_json::Value| RawValue::from_string(canonical_json(v).unwrap()).unwrap();
        let mut event = RecordedEvent {
            seq,
            stream_id: stream_id.to_owned(),
            stream_version: *version,
            event_id,
            event_type: event_type.to_owned(),
            schema_version: 1,
            payload: raw(&payload),
            metadata: raw(&metadata),
            recorded_at,
            prev_hash,
            hash: [0; 32],
        };
        event.hash = event_hash(&prev_hash, &event.hashed_fields());
        self.tree.push(&event.hash);
        self.events.push(event);
        self.events.last().unwrap()
    }

    /// Signs the current tree head.
    pub fn checkpoint(&self, signer: &CheckpointSigner) -> SignedCheckpoint {
        let size = self.len();
        signer.sign(
            size,
            self.tree.root_at(size).unwrap(),
            t0() + micros(size * 1000 + 500),
        )
    }

    pub fn select(&self, seqs: &[u64]) -> Vec<RecordedEvent> {
        seqs.iter()
            .map(|s| self.events[*s as usize - 1].clone())
            .collect()
    }
}

pub fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 30, 9, 30, 0).unwrap()
}

pub fn micros(n: u64) -> chrono::Duration {
    chrono::Duration::microseconds(n as i64)
}

/// `n` events over three streams, deterministic apart from nothing: ids and times are fixed.
pub fn ledger(n: u64) -> Ledger {
    let mut ledger = Ledger::new();
    let streams = [
        "engine/sgp-region",
        "clearing/member-042",
        "clearing/member-7",
    ];
    for i in 1..=n {
        let stream = streams[(i % 3) as usize];
        ledger.append(
            stream,
            "ClearingDecided",
            serde_json::json!({"i": i, "amount_minor": i * 1250, "note": format!("décision {i}\n"), "score": 0.5}),
            serde_json::json!({"actor": "operator:alice"}),
            Uuid::from_u128(0x0193_8a5c_7b2e_7000_8000_0000_0000_0000 + u128::from(i)),
            t0() + micros(i * 1000),
        );
    }
    ledger
}

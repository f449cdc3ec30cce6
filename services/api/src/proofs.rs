//! Inclusion proofs against the newest signed checkpoint, one shape for every audit answer
//! that proves an event; a block of the Merkle log found damaged is repaired from the ledger.

use aether_ledger::Direction;
use aether_ledger::MerkleLog;
use aether_ledger::checkpoint::{CHECKPOINT_STREAM, SignedCheckpoint};
use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::problem::Problem;
use crate::state::AppState;

/// The newest checkpoint in the ledger, if any.
pub async fn latest_checkpoint(
    state: &AppState,
) -> Result<Option<(u64, SignedCheckpoint)>, Problem> {
    let last = state
        .store
        .read_stream(CHECKPOINT_STREAM, u64::MAX, Direction::Backward, 1)
        .await?;
    Ok(last.first().and_then(|e| {
        SignedCheckpoint::from_event(e)
            .and_then(Result::ok)
            .map(|c| (e.seq, c))
    }))
}

pub fn hex_list(hashes: &[[u8; 32]]) -> Vec<String> {
    hashes.iter().map(hex::encode).collect()
}

/// A proof the request cannot have (sizes, indexes) is the caller's 422; a log that cannot
/// give one (its file unreadable or changed, a missing node) is the service's 500.
pub fn proof_problem(e: aether_ledger::merkle::ProofError) -> Problem {
    use aether_ledger::merkle::ProofError;
    match e {
        ProofError::LeafFile { .. } | ProofError::MissingNode { .. } => {
            tracing::error!(error = %e, "the Merkle log cannot give a proof");
            Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Proof unavailable",
                e.to_string(),
            )
        }
        _ => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "No such proof",
            e.to_string(),
        ),
    }
}

/// Blocks of the Merkle log's file a single answer may repair: a proof touches at most
/// two, a consistency proof's pair of roots a few more.
pub const MAX_REPAIRS: usize = 4;

/// Asks the Merkle log for a proof; a block of its file found changed or unreadable is
/// rewritten from the ledger (`MerkleLog::repair`) and the proof asked again.
pub async fn proven<T>(
    state: &AppState,
    ask: impl Fn(&MerkleLog) -> Result<T, aether_ledger::merkle::ProofError>,
) -> Result<T, Problem> {
    let mut repairs = 0;
    loop {
        match ask(&state.merkle) {
            Ok(answer) => return Ok(answer),
            Err(e) => {
                if repairs < MAX_REPAIRS && state.merkle.repair(&state.store, &e).await? {
                    repairs += 1;
                    continue;
                }
                return Err(proof_problem(e));
            }
        }
    }
}

/// The inclusion proof of event `seq` against the latest signed checkpoint, or null while
/// no checkpoint covers it: one shape for every audit answer that proves an event.
pub async fn inclusion_against_latest(state: &AppState, seq: u64) -> Result<Value, Problem> {
    let Some((checkpoint_seq, cp)) = latest_checkpoint(state).await? else {
        return Ok(Value::Null);
    };
    if cp.tree_size < seq {
        return Ok(Value::Null);
    }
    // The follower may be a moment behind the newest checkpoint.
    if state.merkle.len() < cp.tree_size {
        state.merkle.catch_up(&state.store).await?;
    }
    let hashes = proven(state, |log| log.inclusion_proof(seq, cp.tree_size)).await?;
    Ok(json!({
        "leaf_index": seq - 1,
        "tree_size": cp.tree_size,
        "hashes": hex_list(&hashes),
        "checkpoint": cp,
        "checkpoint_seq": checkpoint_seq,
    }))
}

pub fn proof_note(proof: &Value) -> &'static str {
    if proof.is_null() {
        "not yet covered by a signed checkpoint; ask again after the next one"
    } else {
        "verify with RFC 9162 inclusion over SM3 against checkpoint.root_hash (see HASHING.md)"
    }
}

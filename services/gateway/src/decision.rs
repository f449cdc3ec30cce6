//! A clearing decision as the ledger records it and the member is answered: its event type
//! and stream, the answer with its receipt, why a submission got none, and how a recorded
//! `ClearingDecided` reads back as its answer (for repeats of a request id).

use aether_ledger::RecordedEvent;
use serde::Serialize;
use serde_json::Value;

/// Event type of a decision.
pub const CLEARING_DECIDED: &str = "ClearingDecided";

/// The stream of one member's decisions.
pub fn clearing_stream(member: &str) -> String {
    format!("clearing/{member}")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Cleared,
    HeldForReview,
    Rejected,
}

/// Where the decision is on the ledger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Receipt {
    pub seq: u64,
    pub event_hash: String,
    pub snapshot_id: String,
    pub trace_id: String,
}

/// The decision as answered to the member.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Answer {
    pub request_id: String,
    pub decision: Decision,
    pub score: f64,
    pub confidence: f64,
    pub rules_fired: Vec<String>,
    pub cited_clauses: Vec<String>,
    pub model_ref: String,
    pub model_stage: String,
    pub receipt: Receipt,
    /// True when this is the answer to an earlier submission with the same request id.
    pub replayed: bool,
    /// [`trade_digest`] of the trade this answer decided (empty for decisions recorded
    /// before digests were): a repeat of the request id must carry the same trade.
    pub trade_digest: String,
}

/// Why a submission got no decision; nothing was recorded for it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClearError {
    #[error("invalid trade: {0}")]
    InvalidTrade(String),
    #[error("invalid traffic colouring: {0}")]
    InvalidColouring(String),
    #[error("no engine can clear this trade: {0}")]
    NoEngine(String),
    #[error("{0}")]
    Overloaded(String),
    #[error("the clearing worker failed: {0}")]
    Worker(String),
    #[error("the ledger refused the decision: {0}")]
    Ledger(String),
    #[error(
        "request id {request_id:?} was already decided (ledger seq {seq}) for a different trade: that trade's digest is {original}, this one's {submitted}; nothing was recorded. Use a new request id for a new trade"
    )]
    RequestIdReused {
        request_id: String,
        seq: u64,
        original: String,
        submitted: String,
    },
}

/// The answer a recorded `ClearingDecided` event gave.
pub fn answer_of(event: &RecordedEvent) -> Option<Answer> {
    let p = event.payload_value().ok()?;
    let decision = match p["decision"].as_str()? {
        "cleared" => Decision::Cleared,
        "held_for_review" => Decision::HeldForReview,
        "rejected" => Decision::Rejected,
        _ => return None,
    };
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let meta = event.metadata_value().ok()?;
    Some(Answer {
        request_id: p["request_id"].as_str()?.to_owned(),
        decision,
        score: p["score"].as_f64()?,
        confidence: p["confidence"].as_f64()?,
        rules_fired: strings(&p["rules_fired"]),
        cited_clauses: strings(&p["cited_clauses"]),
        model_ref: p["model_ref"].as_str()?.to_owned(),
        model_stage: p["model_stage"].as_str().unwrap_or_default().to_owned(),
        receipt: Receipt {
            seq: event.seq,
            event_hash: hex::encode(event.hash),
            snapshot_id: p["snapshot_id"].as_str().unwrap_or_default().to_owned(),
            trace_id: meta["trace_id"].as_str().unwrap_or_default().to_owned(),
        },
        replayed: false,
        trade_digest: p["trade_digest"].as_str().unwrap_or_default().to_owned(),
    })
}

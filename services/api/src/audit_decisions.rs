//! `GET /v1/audit/decisions/{request_id}`: the whole why of one clearing decision — the
//! trade, the model (ref, digest, stage), the policy versions and rules that fired, the
//! cited clauses' text from the corpus version in force, the worker and batch, the
//! snapshot, the event with its lineage records and an inclusion proof. Personal fields of
//! the request are shown per the redaction policy (`audit/REDACTION.md`).

use std::sync::Arc;

use aether_audit::redaction::{Erasure, Presented, RedactionPolicy, present};
use aether_ledger::personal::{REDACTION_EVENT_TYPE, REDACTION_STREAM};
use aether_ledger::{EventFilter, RecordedEvent};
use axum::Extension;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::access::{Auditor, record_access};
use crate::problem::Problem;
use crate::proofs::{inclusion_against_latest, proof_note};
use crate::state::AppState;

/// Most decisions sharing one request id that are looked at (one per member).
const MAX_MATCHES: u32 = 100;
/// Redaction events read per page when looking for an event's erasures.
const REDACTION_PAGE: u32 = 1000;

/// The policy in force: the one `serve` installed, else the default.
pub type Policy = Option<Extension<Arc<RedactionPolicy>>>;

pub fn policy_of(policy: Policy) -> Arc<RedactionPolicy> {
    policy.map(|Extension(p)| p).unwrap_or_default()
}

/// `event`'s payload as a regulator may see it: personal fields revealed, withheld or
/// marked erased by `policy`.
pub async fn presented(
    state: &AppState,
    event: &RecordedEvent,
    policy: &RedactionPolicy,
) -> Result<(Presented, Vec<aether_ledger::personal::PersonalField>), Problem> {
    let payload = event.payload_value().unwrap_or_default();
    let held = state.store.personal_fields(event).await?;
    let erasures = erasures(state, event).await?;
    Ok((present(&payload, &held, &erasures, policy), held))
}

/// The recorded erasures of `event`'s personal fields (the `ledger/redactions` stream is
/// read whole: erasures are rare).
async fn erasures(state: &AppState, event: &RecordedEvent) -> Result<Vec<Erasure>, Problem> {
    let filter = EventFilter {
        event_type: Some(REDACTION_EVENT_TYPE.to_owned()),
        stream_prefix: Some(REDACTION_STREAM.to_owned()),
        ..EventFilter::default()
    };
    let id = event.event_id.to_string();
    let mut found = Vec::new();
    let mut after = 0;
    loop {
        let page = state.store.query(&filter, after, REDACTION_PAGE).await?;
        let Some(last) = page.last() else {
            return Ok(found);
        };
        after = last.seq;
        for r in &page {
            let p = r.payload_value().unwrap_or_default();
            if p["event_id"].as_str() != Some(id.as_str()) {
                continue;
            }
            if let Some(member) = p["member"].as_str() {
                found.push(Erasure {
                    member: member.to_owned(),
                    seq: r.seq,
                    reason: p["reason"].as_str().unwrap_or_default().to_owned(),
                    recorded_at: r.recorded_at.to_rfc3339(),
                });
            }
        }
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionQuery {
    /// The member, when several used the same request id.
    member: Option<String>,
}

#[utoipa::path(get, path = "/v1/audit/decisions/{request_id}", tag = "audit",
    description = "The whole why of a clearing decision: the request (personal fields per the redaction policy), model ref, digest and stage, policy versions, rules fired, cited clauses with their text, worker and batch, snapshot, the event, its lineage records and proof. Role: regulator.",
    params(("request_id" = String, Path, description = "The member's request id"),
           ("member" = Option<String>, Query, description = "The member, when several used the same request id")),
    responses((status = 200, description = "The explanation", body = serde_json::Value),
              (status = 404, description = "No decision of that request id")))]
pub async fn decision(
    State(state): State<AppState>,
    auditor: Auditor,
    policy: Policy,
    Path(request_id): Path<String>,
    query: Result<Query<DecisionQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, Problem> {
    let Query(query) = query.map_err(|e| Problem::bad_request(e.body_text()))?;
    if request_id.is_empty() || request_id.len() > 256 {
        return Err(Problem::bad_request(
            "request_id must be 1 to 256 characters",
        ));
    }
    record_access(
        &state,
        &auditor,
        "decision",
        json!({ "request_id": request_id, "member": query.member }),
    )
    .await?;
    let mut metadata = vec![("request_id".to_owned(), request_id.clone())];
    if let Some(member) = &query.member {
        metadata.push(("member".to_owned(), member.clone()));
    }
    // Only metadata: the request-id index alone answers it (see the gateway's lookup).
    let filter = EventFilter {
        metadata,
        ..EventFilter::default()
    };
    let found: Vec<RecordedEvent> = state
        .store
        .query(&filter, 0, MAX_MATCHES)
        .await?
        .into_iter()
        .filter(|e| e.event_type == "ClearingDecided" && e.stream_id.starts_with("clearing/"))
        .collect();
    let event = match found.as_slice() {
        [one] => one.clone(),
        [] => {
            return Err(Problem::new(
                StatusCode::NOT_FOUND,
                "Not found",
                format!("no clearing decision for request id {request_id:?}"),
            ));
        }
        many => {
            let members: Vec<String> = many
                .iter()
                .map(|e| e.stream_id.trim_start_matches("clearing/").to_owned())
                .collect();
            return Err(Problem::new(
                StatusCode::CONFLICT,
                "Ambiguous request id",
                format!(
                    "members {} each used request id {request_id:?}; add ?member=",
                    members.join(", ")
                ),
            )
            .with("members", json!(members)));
        }
    };
    let proof = inclusion_against_latest(&state, event.seq).await?;
    let lineage = aether_lineage::relay::record(&state.store, event.seq)
        .await
        .ok()
        .flatten();
    let policy = policy_of(policy);
    let (shown, _) = presented(&state, &event, &policy).await?;
    let mut why = explain(&state, &event, lineage, proof);
    if why["worker"]["netting_seq"].is_null() {
        let batch_id = why["worker"]["batch_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        why["worker"]["netting_seq"] = json!(batch_netting(&state, event.seq, &batch_id).await?);
    }
    why["trade"] = shown.payload["trade"].clone();
    why["personal_fields"] = json!(shown.fields);
    why["redaction_policy"] = json!(policy.to_string());
    Ok(axum::Json(why).into_response())
}

/// The seq of the `NettingComputed` of a decision's batch. A decision is committed in one
/// append with its batch's netting, which comes first, so it is the last netting before the
/// decision; its batch id must match. (Decisions recorded before the two shared an append
/// name `netting_seq` in their payload.)
async fn batch_netting(
    state: &AppState,
    decision_seq: u64,
    batch_id: &str,
) -> Result<Option<u64>, Problem> {
    let filter = EventFilter {
        event_type: Some(aether_gateway::batcher::NETTING_COMPUTED.to_owned()),
        ..EventFilter::default()
    };
    let netting = state.store.query_backward(&filter, decision_seq, 1).await?;
    Ok(netting
        .into_iter()
        .find(|n| {
            n.payload_value()
                .is_ok_and(|p| p["batch_id"].as_str() == Some(batch_id))
        })
        .map(|n| n.seq))
}

/// The explanation document of one `ClearingDecided` event; its `trade` still holds the
/// personal placeholders (the caller applies the redaction policy).
fn explain(
    state: &AppState,
    event: &RecordedEvent,
    lineage: Option<aether_lineage::relay::LineageRecord>,
    proof: Value,
) -> Value {
    let p = event.payload_value().unwrap_or_default();
    let corpora = &p["snapshot"]["corpora"];
    // Each cited clause with its text from the corpus version the decision was made under.
    let clauses: Vec<Value> = p["cited_clauses"]
        .as_array()
        .map(|ids| {
            ids.iter()
                .filter_map(Value::as_str)
                .map(|cited| {
                    let (corpus, id) = cited.split_once(':').unwrap_or(("", cited));
                    let clause = corpora[corpus]
                        .as_str()
                        .and_then(|d| d.parse::<aether_rag::CorpusDigest>().ok())
                        .and_then(|digest| {
                            state
                                .control
                                .corpora
                                .corpus(corpus)
                                .and_then(|c| c.get(&digest))
                        })
                        .and_then(|version| version.clause(id).cloned());
                    json!({
                        "cited": cited,
                        "corpus": corpus,
                        "corpus_version": corpora[corpus],
                        "clause": clause,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let policies: std::collections::BTreeMap<String, Value> = p["rules"]
        .as_array()
        .map(|rules| {
            rules
                .iter()
                .filter_map(|r| {
                    Some((
                        r["policy"].as_str()?.to_owned(),
                        r["policy_version"].clone(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    json!({
        "request_id": p["request_id"],
        "member": p["member"],
        "decision": p["decision"],
        "score": p["score"],
        "confidence": p["confidence"],
        "trade": p["trade"],
        "model": {
            "ref": p["model_ref"],
            "digest": p["model_digest"],
            "stage": p["model_stage"],
            "rollout": p["rollout"],
        },
        "policies": policies,
        "rules_fired": p["rules"],
        "rule_errors": p["rule_errors"],
        "cited_clauses": clauses,
        "worker": {
            "id": p["worker"],
            "device": p["device"],
            "batch_id": p["batch_id"],
            "batch_size": p["batch_size"],
            "netting_seq": p["netting_seq"],
        },
        "snapshot": {
            "id": p["snapshot_id"],
            "rules_digest": p["snapshot"]["rules_digest"],
            "corpora": corpora,
        },
        "latency_us": p["latency_us"],
        // Why the model scored what it did (held and rejected decisions, and a sample
        // of cleared ones): attributions, intervals and the audit's verdict.
        "explanation": p.get("explanation").cloned().unwrap_or(Value::Null),
        "event": event,
        "lineage": lineage,
        "note": proof_note(&proof),
        "inclusion_proof": proof,
    })
}

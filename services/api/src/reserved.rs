//! The ledger's namespaces that belong to Aether's own components. The generic append
//! (`POST /v1/events`) refuses them: a junk `CheckpointSigned` would break `verify` for ever,
//! a forged `AuditQueried` would put words in a regulator's mouth, a forged
//! `ClearingDecided` would give one request id two decisions. Each component writes its own
//! streams through its own API, which checks what it writes.

use aether_control::{
    corpora, engines, handoff, models, policies, projection, rollout_controller, rollouts, snapshot,
};

/// Stream categories (a stream id equal to the name, or starting with the name and `/`) and
/// the component that owns each.
pub const RESERVED_STREAMS: &[(&str, &str)] = &[
    (
        "ledger",
        "the ledger (signed checkpoints, key rotations, redactions)",
    ),
    ("access", "the audit API (regulators' access records)"),
    ("clearing", "the clearing gateway (decisions)"),
    ("netting", "the clearing gateway (netting)"),
    ("worker", "the clearing gateway (workers)"),
    ("engine", "the control plane (engines)"),
    ("model", "the control plane (models)"),
    ("policy", "the control plane (policies)"),
    ("policy-rejections", "the control plane (refused policies)"),
    ("corpus", "the control plane (corpora)"),
    ("corpus-rejections", "the control plane (refused corpora)"),
    ("rollout", "the control plane (rollouts)"),
    ("analysis", "the rollout controller (analysis)"),
    ("snapshot", "the snapshot coordinator"),
    ("lineage", "the lineage relays"),
    ("cluster", "the cluster's duties"),
    (
        "handoff",
        "the drift hand-offs (webhook deliveries, retraining runs)",
    ),
];

/// Event types only Aether's components write, on any stream.
pub const RESERVED_EVENT_TYPES: &[&str] = &[
    aether_ledger::checkpoint::CHECKPOINT_EVENT_TYPE,
    aether_ledger::key_rotation::KEY_ROTATION_EVENT_TYPE,
    aether_ledger::personal::REDACTION_EVENT_TYPE,
    crate::access::ACCESS_EVENT_TYPE,
    aether_gateway::clearing::CLEARING_DECIDED,
    aether_gateway::batcher::NETTING_COMPUTED,
    aether_gateway::breaker::SCORING_DEGRADED,
    aether_gateway::breaker::SCORING_RESTORED,
    engines::ACTIVATION_REQUESTED,
    engines::MODEL_VERIFIED,
    engines::POLICIES_BOUND,
    engines::BREAKER_REGISTERED,
    engines::ACTIVATED,
    engines::ACTIVATION_FAILED,
    "EngineDeactivated",
    models::MODEL_REGISTERED,
    policies::POLICY_INGESTED,
    policies::POLICY_INGEST_REJECTED,
    corpora::CORPUS_INGESTED,
    corpora::CORPUS_INGEST_REJECTED,
    rollouts::STARTED,
    rollouts::STEPPED,
    rollouts::PAUSED,
    rollouts::RESUMED,
    rollouts::PROMOTED,
    rollouts::ABORTED,
    rollouts::WEIGHT_SET,
    rollouts::FALLBACK_SET,
    projection::SNAPSHOT_COMMITTED,
    snapshot::SNAPSHOT_ABORTED,
    snapshot::ROLLED_BACK,
    rollout_controller::CHECKED,
    rollout_controller::ASSESSED,
    rollout_controller::INCONCLUSIVE,
    rollout_controller::PAUSE_DECIDED,
    rollout_controller::DRIFT_ASSESSED,
    rollout_controller::RETRAIN_REQUESTED,
    rollout_controller::REVIEW_OPENED,
    rollout_controller::TRANSITIONED,
    rollout_controller::WEIGHT_DECIDED,
    rollout_controller::ROLLBACK_DECIDED,
    rollout_controller::PROMOTION_DECIDED,
    rollout_controller::REFERENCE_FIXED,
    rollout_controller::STEP_SNAPSHOT,
    rollout_controller::PROMOTION_WITHHELD,
    rollout_controller::DRIFT_ESCALATED,
    rollout_controller::REVIEW_OVERDUE,
    rollout_controller::FEATURE_HEALTH,
    rollouts::REVIEW_CLOSED,
    handoff::DELIVERED,
    handoff::DELIVERY_FAILED,
    handoff::RETRAIN_STARTED,
    handoff::RETRAIN_FINISHED,
    handoff::RETRAIN_FAILED,
    "WorkerRegistered",
    "WorkerDrained",
];

/// Why the generic append may not write `event_type` to `stream_id`, if it may not.
pub fn refusal(stream_id: &str, event_type: &str) -> Option<String> {
    if let Some((name, owner)) = RESERVED_STREAMS.iter().find(|(name, _)| {
        stream_id == *name
            || stream_id
                .strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('/'))
    }) {
        return Some(format!(
            "stream {stream_id:?} is in the reserved namespace {name:?}, written only by {owner}; \
             the generic append writes other streams"
        ));
    }
    RESERVED_EVENT_TYPES.contains(&event_type).then(|| {
        format!(
            "event type {event_type:?} is reserved to Aether's own components; \
                 the generic append writes other types"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_names_and_their_neighbours() {
        for stream in [
            "ledger/checkpoints",
            "access/audit",
            "clearing/m-1",
            "snapshot",
            "engine/sgp",
            "analysis/r-1",
        ] {
            assert!(refusal(stream, "Note").is_some(), "{stream}");
        }
        for stream in [
            "ledgers/x",
            "engineering/x",
            "snapshots",
            "notes/a",
            "Clearing-like/x",
            "trades/m-1",
        ] {
            assert_eq!(refusal(stream, "Note"), None, "{stream}");
        }
        let why = refusal("notes/a", "CheckpointSigned").unwrap();
        assert!(why.contains("\"CheckpointSigned\" is reserved"), "{why}");
        let why = refusal("ledger/checkpoints", "Note").unwrap();
        assert!(why.contains("written only by the ledger"), "{why}");
    }
}

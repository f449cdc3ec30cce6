//! One OpenLineage job per kind of change, and the run state each event type reports.
//!
//! | event type | job | event type in OpenLineage |
//! |---|---|---|
//! | `EngineActivationRequested` | `engine.activate` | START |
//! | `EngineModelVerified`, `EnginePoliciesBound`, `CircuitBreakerRegistered` | `engine.activate` | RUNNING |
//! | `EngineActivated` | `engine.activate` | COMPLETE |
//! | `EngineActivationFailed` | `engine.activate` | FAIL |
//! | `EngineDeactivated` | `engine.deactivate` | COMPLETE |
//! | `ModelRegistered` | `model.register` | COMPLETE |
//! | `PolicyIngested` | `policy.ingest` | COMPLETE |
//! | `PolicyIngestRejected` | `policy.ingest` | FAIL |
//! | `CorpusIngested` | `corpus.ingest` | COMPLETE |
//! | `RolloutStarted`, `RolloutStepped`, `RolloutPaused`, `RolloutResumed`, `RolloutPromoted`, `RolloutAborted`, `RolloutWeightSet`, `RolloutFallbackSet` | `rollout.step` | COMPLETE |
//! | the rollout controller's `analysis/{rollout}` events (`RolloutChecked`, `RolloutAssessed`, `DriftAssessed`, `ControllerTransitioned`, …) | `rollout.analysis` | COMPLETE |
//! | `RolledBack` | `rollout.rollback` | COMPLETE |
//! | `SnapshotCommitted` | `snapshot.commit` | COMPLETE |
//! | `SnapshotAborted` | `snapshot.commit` | ABORT |
//! | `ClearingDecided`, `NettingComputed` | `clearing.batch` | COMPLETE |
//! | `ScoringDegraded`, `ScoringRestored` (the scoring breaker's switches) | `clearing.breaker` | COMPLETE |
//! | `CheckpointSigned` | `ledger.checkpoint` | COMPLETE |
//! | `RedactionApplied` | `ledger.redaction` | COMPLETE |
//! | `AuditQueried` | `audit.access` | COMPLETE |
//! | any other | `ledger.event` | COMPLETE |
//!
//! All jobs live in the namespace [`JOB_NAMESPACE`]. An event type this table does not know
//! (a new domain event, `WorkerRegistered`, ...) is never dropped: it becomes a completed run
//! of the generic job `ledger.event`, with the same datasets and `aether_ledger` facet as any
//! other, so lineage stays complete while the table catches up.
//!
//! Only an engine activation spans several ledger events (requested; the model verified, the
//! policies bound, the circuit breaker registered; then activated or failed), so only
//! `engine.activate` runs have a START and RUNNING events; every other event is a run of its
//! own that starts and ends at once, reported by its terminal event alone.

use aether_ledger::checkpoint::CHECKPOINT_EVENT_TYPE;
use aether_ledger::personal::REDACTION_EVENT_TYPE;
use openlineage_client::RunEventType;

/// Namespace of every Aether job.
pub const JOB_NAMESPACE: &str = "aether";

pub const ENGINE_ACTIVATE: &str = "engine.activate";
pub const ENGINE_DEACTIVATE: &str = "engine.deactivate";
pub const MODEL_REGISTER: &str = "model.register";
pub const POLICY_INGEST: &str = "policy.ingest";
pub const CORPUS_INGEST: &str = "corpus.ingest";
pub const ROLLOUT_STEP: &str = "rollout.step";
pub const ROLLOUT_ROLLBACK: &str = "rollout.rollback";
pub const ROLLOUT_ANALYSIS: &str = "rollout.analysis";
pub const SNAPSHOT_COMMIT: &str = "snapshot.commit";
pub const CLEARING_BATCH: &str = "clearing.batch";
/// A switch of the scoring breaker (to in-process scoring and back).
pub const CLEARING_BREAKER: &str = "clearing.breaker";
pub const LEDGER_CHECKPOINT: &str = "ledger.checkpoint";
pub const LEDGER_REDACTION: &str = "ledger.redaction";
pub const AUDIT_ACCESS: &str = "audit.access";
/// A retraining run a drift retrain request started (the configured command).
pub const MODEL_RETRAIN: &str = "model.retrain";
/// A drift hand-off to the operators' webhook.
pub const DRIFT_HANDOFF: &str = "drift.handoff";
/// The job of any event type without a job of its own.
pub const LEDGER_EVENT: &str = "ledger.event";

/// `processingType` of every Aether job: each run is finite and ends with a terminal event
/// (COMPLETE, FAIL or ABORT), which is what the `jobType` facet calls BATCH; a clearing
/// batch is a micro-batch of the request stream, but its run still completes.
pub const PROCESSING_TYPE: &str = "BATCH";
/// `integration` of every Aether job.
pub const INTEGRATION: &str = "AETHER";
/// `jobType` of every Aether job: each run records one ledger event.
pub const JOB_TYPE: &str = "LEDGER_EVENT";

/// The OpenLineage job and run state of one ledger event type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Change {
    pub job: &'static str,
    pub state: RunEventType,
}

impl Change {
    pub fn of(event_type: &str) -> Change {
        use RunEventType::{Abort, Complete, Fail, Running, Start};
        let (job, state) = match event_type {
            "EngineActivationRequested" => (ENGINE_ACTIVATE, Start),
            "EngineModelVerified" | "EnginePoliciesBound" | "CircuitBreakerRegistered" => {
                (ENGINE_ACTIVATE, Running)
            }
            "EngineActivated" => (ENGINE_ACTIVATE, Complete),
            "EngineActivationFailed" => (ENGINE_ACTIVATE, Fail),
            "EngineDeactivated" => (ENGINE_DEACTIVATE, Complete),
            "ModelRegistered" => (MODEL_REGISTER, Complete),
            "PolicyIngested" => (POLICY_INGEST, Complete),
            "PolicyIngestRejected" => (POLICY_INGEST, Fail),
            "CorpusIngested" => (CORPUS_INGEST, Complete),
            "RolloutStarted" | "RolloutStepped" | "RolloutPaused" | "RolloutResumed"
            | "RolloutPromoted" | "RolloutAborted" | "RolloutWeightSet" | "RolloutFallbackSet"
            | "ReviewTicketClosed" => (ROLLOUT_STEP, Complete),
            "RolloutChecked"
            | "RolloutAssessed"
            | "AnalysisInconclusive"
            | "AnalysisPaused"
            | "DriftAssessed"
            | "RetrainRequested"
            | "ReviewTicketOpened"
            | "ControllerTransitioned"
            | "WeightDecided"
            | "SemanticRollbackDecided"
            | "PromotionDecided"
            | "PromotionWithheld"
            | "DriftEscalated"
            | "ReviewTicketOverdue"
            | "FeatureHealthSnapshot"
            | "DriftReferenceFixed"
            | "StepSnapshotTaken" => (ROLLOUT_ANALYSIS, Complete),
            "RolledBack" => (ROLLOUT_ROLLBACK, Complete),
            "RetrainStarted" => (MODEL_RETRAIN, Start),
            "RetrainFinished" => (MODEL_RETRAIN, Complete),
            "RetrainFailed" => (MODEL_RETRAIN, Fail),
            "HandoffDelivered" => (DRIFT_HANDOFF, Complete),
            "HandoffFailed" => (DRIFT_HANDOFF, Fail),
            "SnapshotCommitted" => (SNAPSHOT_COMMIT, Complete),
            "SnapshotAborted" => (SNAPSHOT_COMMIT, Abort),
            "ClearingDecided" | "NettingComputed" => (CLEARING_BATCH, Complete),
            "ScoringDegraded" | "ScoringRestored" => (CLEARING_BREAKER, Complete),
            CHECKPOINT_EVENT_TYPE => (LEDGER_CHECKPOINT, Complete),
            REDACTION_EVENT_TYPE => (LEDGER_REDACTION, Complete),
            "AuditQueried" => (AUDIT_ACCESS, Complete),
            _ => (LEDGER_EVENT, Complete),
        };
        Change { job, state }
    }
}

/// The event types with a job of their own (the table above), for finding them by name.
pub const EVENT_TYPES: &[&str] = &[
    "EngineActivationRequested",
    "EngineModelVerified",
    "EnginePoliciesBound",
    "CircuitBreakerRegistered",
    "EngineActivated",
    "EngineActivationFailed",
    "EngineDeactivated",
    "ModelRegistered",
    "PolicyIngested",
    "PolicyIngestRejected",
    "CorpusIngested",
    "RolloutStarted",
    "RolloutStepped",
    "RolloutPaused",
    "RolloutResumed",
    "RolloutPromoted",
    "RolloutAborted",
    "RolloutWeightSet",
    "RolloutFallbackSet",
    "ReviewTicketClosed",
    "RolloutChecked",
    "RolloutAssessed",
    "AnalysisInconclusive",
    "AnalysisPaused",
    "DriftAssessed",
    "RetrainRequested",
    "ReviewTicketOpened",
    "ControllerTransitioned",
    "WeightDecided",
    "SemanticRollbackDecided",
    "PromotionDecided",
    "PromotionWithheld",
    "DriftEscalated",
    "ReviewTicketOverdue",
    "FeatureHealthSnapshot",
    "DriftReferenceFixed",
    "StepSnapshotTaken",
    "RolledBack",
    "RetrainStarted",
    "RetrainFinished",
    "RetrainFailed",
    "HandoffDelivered",
    "HandoffFailed",
    "SnapshotCommitted",
    "SnapshotAborted",
    "ClearingDecided",
    "NettingComputed",
    "ScoringDegraded",
    "ScoringRestored",
    CHECKPOINT_EVENT_TYPE,
    REDACTION_EVENT_TYPE,
    "AuditQueried",
];

/// The OpenLineage job (in [`JOB_NAMESPACE`]) of a ledger event type; `ledger.event` for
/// types without a job of their own.
pub fn job_name(event_type: &str) -> &'static str {
    Change::of(event_type).job
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_event_type_has_a_job_of_its_own() {
        for event_type in EVENT_TYPES {
            assert_ne!(job_name(event_type), LEDGER_EVENT, "{event_type}");
        }
        assert_eq!(job_name("SomethingNew"), LEDGER_EVENT);
    }
}

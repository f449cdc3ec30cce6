//! Aether's control plane: every change to the clearing engine is an event on the ledger,
//! and the live state is a projection of those events, rebuilt at start.
//!
//! Built so far: policies, models, corpora, engines, rollouts, and the consistent-snapshot
//! coordinator with rollback.

pub mod analysis;
pub mod corpora;
pub mod engines;
pub mod handoff;
pub mod models;
pub mod origin;
pub mod policies;
pub mod projection;
mod replay;
pub mod rollout_controller;
pub mod rollout_windows;
pub mod rollouts;
pub mod routing;
pub mod snapshot;

pub use corpora::{CorpusError, CorpusIngest, CorpusRecord, CorpusRegistry};
pub use engines::{ActivationRequest, EngineError, EngineRegistry, EngineState, EngineStatus};
pub use models::{ModelError, ModelRegistry, ModelSpec};
pub use origin::{ColouringError, Origin};
pub use policies::{IngestError, PolicyRecord, PolicyRegistry};
pub use projection::{ControlState, SNAPSHOT_COMMITTED, SNAPSHOT_STREAM, StateAsOf};
pub use rollout_controller::{ControllerError, RolloutController};
pub use rollouts::{
    Command, RolloutError, RolloutPhase, RolloutRegistry, RolloutRequest, RolloutState,
};
pub use routing::RoutingTable;
pub use snapshot::{
    ParticipantError, Pinned, SnapshotCoordinator, SnapshotError, SnapshotParticipant,
    SnapshotRecord,
};

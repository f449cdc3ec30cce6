//! The names of what the drift tiers' hand-offs record: where a webhook delivery and a
//! retraining run are written, and their event types. The hand-offs themselves run in the
//! service; the names live here, beside the tiers' own events, so that the API's reserved
//! namespaces and the ledger's readers share them.

/// Where webhook deliveries are recorded.
pub const WEBHOOK_STREAM: &str = "handoff/webhook";
/// Where retraining runs are recorded.
pub const RETRAIN_STREAM: &str = "handoff/retrain";
/// A webhook answered 2xx.
pub const DELIVERED: &str = "HandoffDelivered";
/// A webhook delivery gave up after its tries.
pub const DELIVERY_FAILED: &str = "HandoffFailed";
/// The retraining command started.
pub const RETRAIN_STARTED: &str = "RetrainStarted";
/// The retraining command exited 0.
pub const RETRAIN_FINISHED: &str = "RetrainFinished";
/// The retraining command failed, timed out or could not start.
pub const RETRAIN_FAILED: &str = "RetrainFailed";

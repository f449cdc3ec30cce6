//! Progressive rollouts as events on `rollout/{id}`, with the state machine enforced:
//! `RolloutStarted` → `RolloutStepped`* (weights from the step list) → `RolloutPromoted`
//! (candidate at 100 %) or `RolloutAborted` (candidate at 0 %), with `RolloutPaused` /
//! `RolloutResumed` between steps. A promotion also moves the region's engine to the
//! candidate; a rollback (`RolledBack` on stream `snapshot`) restores the step, weight and
//! phase a snapshot pinned, and ends rollouts started after it. Each command is checked against the stream's version,
//! so two conflicting commands cannot both land: the second is told what changed.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use aether_ledger::{
    Committed, EventFilter, EventStore, ExpectedVersion, LedgerError, NewEvent, RecordedEvent,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::engines::EngineRegistry;
use crate::models::{ModelError, ModelRegistry, region_of};
use crate::origin::Origin;
use crate::replay::merged;
use crate::routing::{RolloutRoute, RoutingTable};
use crate::snapshot::ROLLED_BACK;

pub const STARTED: &str = "RolloutStarted";
pub const STEPPED: &str = "RolloutStepped";
pub const PAUSED: &str = "RolloutPaused";
pub const RESUMED: &str = "RolloutResumed";
pub use crate::engines::PROMOTED;
pub const ABORTED: &str = "RolloutAborted";
/// The rollout controller set the candidate's weight between (or below) the steps.
pub const WEIGHT_SET: &str = "RolloutWeightSet";
/// The rollout controller turned the candidate's fallback path on or off.
pub const FALLBACK_SET: &str = "RolloutFallbackSet";
/// An operator closed the drift review of a frozen candidate (its freeze is released).
pub const REVIEW_CLOSED: &str = "ReviewTicketClosed";

/// Default traffic steps for the candidate, in percent.
pub const DEFAULT_STEPS: [u32; 7] = [1, 2, 5, 10, 25, 50, 100];

/// What an operator asks for.
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutRequest {
    pub baseline: String,
    pub candidate: String,
    #[serde(default = "default_steps")]
    pub steps: Vec<u32>,
    /// Analysis settings, kept as given for the rollout controller (issue 7).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub analysis: serde_json::Map<String, serde_json::Value>,
    /// Hand the rollout to the rollout controller, which widens, holds, fuses, promotes
    /// and rolls back from the gateway's observations; operators keep pause, resume,
    /// promote and abort. Off: every step is an operator's.
    #[serde(default)]
    pub automated: bool,
}

fn default_steps() -> Vec<u32> {
    DEFAULT_STEPS.to_vec()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutPhase {
    Progressing,
    Paused,
    Promoted,
    Aborted,
    /// Ended by a rollback to a snapshot taken before it started: no traffic.
    RolledBack,
}

/// A rollout as the projection sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RolloutState {
    pub id: String,
    pub region: String,
    pub baseline: String,
    pub candidate: String,
    pub steps: Vec<u32>,
    /// Index into `steps` of the current weight; `None` before the first step.
    pub step_index: Option<usize>,
    /// The candidate's share of traffic, in percent.
    pub candidate_weight: u32,
    pub phase: RolloutPhase,
    pub version: u64,
    /// Event id of `RolloutStarted` (parent of every step in lineage).
    pub started_event_id: String,
    /// When `RolloutStarted` was recorded (the analysis windows start there).
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// The analysis settings as given (overrides of the defaults).
    pub analysis: serde_json::Map<String, serde_json::Value>,
    /// Driven by the rollout controller.
    pub automated: bool,
    /// A pause with a duration ends here (resumed by [`RolloutRegistry::resume_due`]).
    pub resume_at: Option<chrono::DateTime<chrono::Utc>>,
    /// A request the candidate fails is decided by the baseline instead (the controller
    /// is degraded or fused).
    pub fallback: bool,
    /// Drift reviews an operator closed (`ReviewTicketClosed`); the controller releases
    /// a freeze when this passes the count it has applied.
    pub reviews_closed: u64,
}

/// A command on a running rollout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Step,
    Pause,
    Resume,
    Promote,
    Abort,
}

impl std::str::FromStr for Command {
    type Err = RolloutError;
    fn from_str(s: &str) -> Result<Command, RolloutError> {
        Ok(match s {
            "step" => Command::Step,
            "pause" => Command::Pause,
            "resume" => Command::Resume,
            "promote" => Command::Promote,
            "abort" => Command::Abort,
            other => return Err(RolloutError::UnknownCommand(other.to_owned())),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("model {0:?} is not registered")]
    UnknownModel(String),
    #[error(
        "baseline and candidate must be different models of one region, got {baseline:?} and {candidate:?}"
    )]
    BadPair { baseline: String, candidate: String },
    #[error("steps must rise strictly within 1..=100 and end at 100, got {0:?}")]
    BadSteps(Vec<u32>),
    #[error("analysis settings: {0}")]
    BadAnalysis(String),
    #[error("weight must be at most 100 %, got {0}")]
    BadWeight(u32),
    #[error("region {region} already has rollout {id} in progress; promote or abort it first")]
    RegionBusy { region: String, id: String },
    #[error("no rollout {0:?}")]
    NotFound(String),
    #[error("unknown rollout command {0:?}: expected step, pause, resume, promote or abort")]
    UnknownCommand(String),
    #[error("cannot {command} rollout {id}: it is {phase}")]
    InvalidTransition {
        id: String,
        command: &'static str,
        phase: &'static str,
    },
    #[error(
        "rollout {id} is at version {actual}, not the expected {expected}; reload it and retry"
    )]
    Stale {
        id: String,
        expected: u64,
        actual: u64,
    },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

impl RolloutPhase {
    fn name(self) -> &'static str {
        match self {
            RolloutPhase::Progressing => "progressing",
            RolloutPhase::Paused => "paused",
            RolloutPhase::Promoted => "promoted",
            RolloutPhase::Aborted => "aborted",
            RolloutPhase::RolledBack => "rolled back",
        }
    }

    /// Whether a rollout in this phase still splits its region's traffic.
    pub fn routes(self) -> bool {
        matches!(self, RolloutPhase::Progressing | RolloutPhase::Paused)
    }
}

impl Command {
    fn name(self) -> &'static str {
        match self {
            Command::Step => "step",
            Command::Pause => "pause",
            Command::Resume => "resume",
            Command::Promote => "promote",
            Command::Abort => "abort",
        }
    }
}

/// Rollouts by id, rebuilt from the ledger.
#[derive(Clone)]
pub struct RolloutRegistry {
    store: EventStore,
    models: ModelRegistry,
    /// Told of promotions: a promoted candidate becomes its region's model.
    engines: EngineRegistry,
    rollouts: Arc<RwLock<BTreeMap<String, RolloutState>>>,
}

impl RolloutRegistry {
    pub async fn load(
        store: EventStore,
        models: ModelRegistry,
        engines: EngineRegistry,
    ) -> Result<Self, LedgerError> {
        Self::load_until(store, models, engines, None).await
    }

    /// [`Self::load`] from the events with seq ≤ `upto_seq` only.
    pub(crate) async fn load_until(
        store: EventStore,
        models: ModelRegistry,
        engines: EngineRegistry,
        upto_seq: Option<u64>,
    ) -> Result<Self, LedgerError> {
        let registry = RolloutRegistry {
            store,
            models,
            engines,
            rollouts: Arc::default(),
        };
        let own = EventFilter {
            stream_prefix: Some("rollout/".into()),
            max_seq: upto_seq,
            ..EventFilter::default()
        };
        // A rollback restores the rollouts' routing of a snapshot from stream `snapshot`.
        let rollbacks = EventFilter {
            event_type: Some(ROLLED_BACK.into()),
            stream_prefix: Some(crate::SNAPSHOT_STREAM.into()),
            max_seq: upto_seq,
            ..EventFilter::default()
        };
        merged(&registry.store, &own, &[rollbacks], |e| registry.apply(e)).await?;
        Ok(registry)
    }

    pub fn get(&self, id: &str) -> Option<RolloutState> {
        self.rollouts.read().ok()?.get(id).cloned()
    }

    pub fn all(&self) -> Vec<RolloutState> {
        self.rollouts
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Ids of the automated rollouts that route traffic: those under analysis.
    pub fn analysed(&self) -> Vec<String> {
        self.all()
            .into_iter()
            .filter(|r| r.automated && r.phase.routes())
            .map(|r| r.id)
            .collect()
    }

    /// Where following other nodes' rollout events starts.
    pub(crate) fn following(&self) -> crate::replay::After {
        crate::replay::After::new(EventFilter {
            stream_prefix: Some("rollout/".into()),
            ..EventFilter::default()
        })
    }

    /// Applies rollout events recorded through another node (a start, a step, a weight, a
    /// pause, a promotion …); events already applied here (this node's own, or read before)
    /// are recognised by their stream version and change nothing. (The engines follow a
    /// promotion themselves.)
    pub(crate) async fn follow_step(
        &self,
        after: &mut crate::replay::After,
    ) -> Result<(), LedgerError> {
        while let Some(page) = after.next(&self.store).await? {
            for event in &page {
                let Some(id) = event.stream_id.strip_prefix("rollout/") else {
                    continue;
                };
                let known = self
                    .rollouts
                    .read()
                    .ok()
                    .and_then(|m| m.get(id).map(|r| r.version));
                if known.is_some_and(|v| event.stream_version <= v)
                    || (known.is_none() && event.event_type != STARTED)
                {
                    continue;
                }
                self.apply(event);
            }
        }
        Ok(())
    }

    /// Puts a rollback's rollout routing in force (a rollback another node recorded).
    pub(crate) fn apply_rollback(&self, event: &RecordedEvent) {
        if event.event_type == ROLLED_BACK {
            self.apply(event);
        }
    }

    fn apply(&self, event: &RecordedEvent) {
        if event.event_type == ROLLED_BACK {
            let payload = event.payload_value().unwrap_or_default();
            if let Some(version) = payload["routing_version"].as_str() {
                match RoutingTable::parse(version) {
                    Ok(table) => self.restore_routing(&table.rollouts),
                    Err(e) => tracing::error!(seq = event.seq, error = %e, "rollback routing"),
                }
            }
            return;
        }
        let Some(id) = event.stream_id.strip_prefix("rollout/") else {
            return;
        };
        let p = event.payload_value().unwrap_or_default();
        let Ok(mut map) = self.rollouts.write() else {
            return;
        };
        if event.event_type == STARTED {
            let request: Option<RolloutRequest> = serde_json::from_value(p["request"].clone()).ok();
            if let Some(r) = request {
                map.insert(
                    id.to_owned(),
                    RolloutState {
                        id: id.to_owned(),
                        region: p["region"].as_str().unwrap_or_default().to_owned(),
                        baseline: r.baseline,
                        candidate: r.candidate,
                        steps: r.steps,
                        step_index: None,
                        candidate_weight: 0,
                        phase: RolloutPhase::Progressing,
                        version: event.stream_version,
                        started_event_id: event.event_id.to_string(),
                        started_at: event.recorded_at,
                        analysis: r.analysis,
                        automated: r.automated,
                        resume_at: None,
                        fallback: false,
                        reviews_closed: 0,
                    },
                );
            }
            return;
        }
        let Some(state) = map.get_mut(id) else { return };
        state.version = event.stream_version;
        match event.event_type.as_str() {
            STEPPED => {
                state.step_index = p["step_index"].as_u64().map(|i| i as usize);
                state.candidate_weight = p["to_weight"].as_u64().unwrap_or(0) as u32;
            }
            WEIGHT_SET => {
                let to = p["to_weight"].as_u64().unwrap_or(0).min(100) as u32;
                state.candidate_weight = to;
                state.step_index = state.steps.iter().rposition(|&s| s <= to);
            }
            FALLBACK_SET => state.fallback = p["on"].as_bool().unwrap_or(false),
            REVIEW_CLOSED => state.reviews_closed += 1,
            PAUSED => {
                state.phase = RolloutPhase::Paused;
                state.resume_at = serde_json::from_value(p["resume_at"].clone()).ok();
            }
            RESUMED => {
                state.phase = RolloutPhase::Progressing;
                state.resume_at = None;
            }
            PROMOTED => {
                state.phase = RolloutPhase::Promoted;
                state.candidate_weight = 100;
            }
            ABORTED => {
                state.phase = RolloutPhase::Aborted;
                state.candidate_weight = 0;
            }
            _ => {}
        }
    }

    /// Makes `routes` the rollouts' routing: each named rollout returns to its recorded
    /// step and phase, and to its recorded weight unless it has less now (a rollback never
    /// raises a candidate's exposure); every other rollout still routing ends as rolled back.
    pub(crate) fn restore_routing(&self, routes: &BTreeMap<String, RolloutRoute>) {
        let Ok(mut map) = self.rollouts.write() else {
            return;
        };
        for (id, rollout) in map.iter_mut() {
            match routes.get(id) {
                Some(route) => {
                    rollout.step_index = route.step_index;
                    // A rollback never raises a candidate's exposure: restoring a snapshot
                    // taken at a wider step keeps the weight it has now (0 after the
                    // controller froze it), as Argo Rollouts' abort takes it to 0.
                    rollout.candidate_weight = route.candidate_weight.min(rollout.candidate_weight);
                    rollout.phase = route.phase;
                }
                None if rollout.phase.routes() => {
                    rollout.phase = RolloutPhase::RolledBack;
                    rollout.candidate_weight = 0;
                }
                None => {}
            }
        }
    }

    /// Starts a rollout after checking both models, the region and the steps.
    pub async fn start(
        &self,
        request: RolloutRequest,
        origin: &Origin,
    ) -> Result<(RolloutState, Committed), RolloutError> {
        let region = region_of(&request.baseline)?.to_owned();
        let candidate_region = region_of(&request.candidate)?;
        if candidate_region != region || request.baseline == request.candidate {
            return Err(RolloutError::BadPair {
                baseline: request.baseline,
                candidate: request.candidate,
            });
        }
        for model in [&request.baseline, &request.candidate] {
            if self.models.get(model).is_none() {
                return Err(RolloutError::UnknownModel(model.clone()));
            }
        }
        let steps_ok = !request.steps.is_empty()
            && request.steps.windows(2).all(|w| w[0] < w[1])
            && request.steps.first().is_some_and(|s| *s >= 1)
            && request.steps.last() == Some(&100);
        if !steps_ok {
            return Err(RolloutError::BadSteps(request.steps));
        }
        // The controller reads these at every check: refuse what it could not use.
        let settings: crate::analysis::AnalysisSettings =
            serde_json::from_value(serde_json::Value::Object(request.analysis.clone()))
                .map_err(|e| RolloutError::BadAnalysis(e.to_string()))?;
        settings
            .validate()
            .map_err(|e| RolloutError::BadAnalysis(e.to_string()))?;
        if let Some(busy) = self.all().into_iter().find(|r| {
            r.region == region
                && matches!(r.phase, RolloutPhase::Progressing | RolloutPhase::Paused)
        }) {
            return Err(RolloutError::RegionBusy {
                region,
                id: busy.id,
            });
        }
        let id = uuid::Uuid::now_v7().simple().to_string();
        let event = NewEvent::new(
            STARTED,
            json!({ "rollout_id": id, "region": region, "request": request }),
        )
        .with_metadata(origin.metadata(json!({})));
        let committed = self.append(&id, ExpectedVersion::NoStream, event).await?;
        let state = self
            .get(&id)
            .ok_or_else(|| RolloutError::NotFound(id.clone()))?;
        Ok((state, committed))
    }

    /// Applies `command` if the state machine allows it and the rollout is still at
    /// `expected_version` (when given).
    pub async fn command(
        &self,
        id: &str,
        command: Command,
        expected_version: Option<u64>,
        reason: Option<&str>,
        origin: &Origin,
    ) -> Result<(RolloutState, Committed), RolloutError> {
        self.command_until(id, command, expected_version, reason, None, origin)
            .await
    }

    /// A pause that ends by itself at `until` (Argo's pause with a duration); the
    /// rollout controller's supervisor resumes it through [`Self::resume_due`].
    pub async fn pause_until(
        &self,
        id: &str,
        until: chrono::DateTime<chrono::Utc>,
        expected_version: Option<u64>,
        reason: Option<&str>,
        origin: &Origin,
    ) -> Result<(RolloutState, Committed), RolloutError> {
        self.command_until(
            id,
            Command::Pause,
            expected_version,
            reason,
            Some(until),
            origin,
        )
        .await
    }

    /// Resumes every pause whose duration has run out by `now`; returns their ids.
    pub async fn resume_due(
        &self,
        now: chrono::DateTime<chrono::Utc>,
        origin: &Origin,
    ) -> Result<Vec<String>, RolloutError> {
        let due: Vec<RolloutState> = self
            .all()
            .into_iter()
            .filter(|r| r.phase == RolloutPhase::Paused && r.resume_at.is_some_and(|at| at <= now))
            .collect();
        let mut resumed = Vec::new();
        for r in due {
            let reason = Some("the pause's duration ran out");
            match self
                .command_until(
                    &r.id,
                    Command::Resume,
                    Some(r.version),
                    reason,
                    None,
                    origin,
                )
                .await
            {
                Ok(_) => resumed.push(r.id),
                // Someone else moved it first: their command stands.
                Err(RolloutError::Stale { .. } | RolloutError::InvalidTransition { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(resumed)
    }

    async fn command_until(
        &self,
        id: &str,
        command: Command,
        expected_version: Option<u64>,
        reason: Option<&str>,
        until: Option<chrono::DateTime<chrono::Utc>>,
        origin: &Origin,
    ) -> Result<(RolloutState, Committed), RolloutError> {
        let state = self
            .get(id)
            .ok_or_else(|| RolloutError::NotFound(id.to_owned()))?;
        if let Some(expected) = expected_version
            && expected != state.version
        {
            return Err(RolloutError::Stale {
                id: id.to_owned(),
                expected,
                actual: state.version,
            });
        }
        let invalid = || RolloutError::InvalidTransition {
            id: id.to_owned(),
            command: command.name(),
            phase: state.phase.name(),
        };
        let (kind, payload) = match (command, state.phase) {
            (Command::Step, RolloutPhase::Progressing) => {
                let next = state.step_index.map_or(0, |i| i + 1);
                let Some(&to) = state.steps.get(next) else {
                    return Err(RolloutError::InvalidTransition {
                        id: id.to_owned(),
                        command: "step",
                        phase: "at its last step (promote it)",
                    });
                };
                (
                    STEPPED,
                    json!({"step_index": next, "from_weight": state.candidate_weight, "to_weight": to,
                           "rollout_event_id": state.started_event_id}),
                )
            }
            (Command::Pause, RolloutPhase::Progressing) => (
                PAUSED,
                json!({"reason": reason, "weight": state.candidate_weight, "rollout_event_id": state.started_event_id,
                       "resume_at": until}),
            ),
            (Command::Resume, RolloutPhase::Paused) => (
                RESUMED,
                json!({"weight": state.candidate_weight, "rollout_event_id": state.started_event_id,
                       "reason": reason}),
            ),
            (Command::Promote, RolloutPhase::Progressing | RolloutPhase::Paused) => (
                PROMOTED,
                json!({"from_weight": state.candidate_weight, "to_weight": 100, "rollout_event_id": state.started_event_id,
                       "region": state.region, "candidate": state.candidate}),
            ),
            (Command::Abort, RolloutPhase::Progressing | RolloutPhase::Paused) => (
                ABORTED,
                json!({"reason": reason, "from_weight": state.candidate_weight, "to_weight": 0,
                       "rollout_event_id": state.started_event_id}),
            ),
            _ => return Err(invalid()),
        };
        let event = NewEvent::new(kind, payload)
            .with_metadata(origin.metadata(json!({"correlation_id": state.started_event_id})));
        let committed = self
            .append(id, ExpectedVersion::Exact(state.version), event)
            .await?;
        let state = self
            .get(id)
            .ok_or_else(|| RolloutError::NotFound(id.to_owned()))?;
        Ok((state, committed))
    }

    /// The rollout controller's weight change (`reason`: increase, fuse, drift_freeze),
    /// allowed while the rollout routes traffic; `cause` is the analysis event behind it.
    pub async fn set_weight(
        &self,
        id: &str,
        to: u32,
        reason: &str,
        cause: &str,
        origin: &Origin,
    ) -> Result<(RolloutState, Committed), RolloutError> {
        let state = self
            .get(id)
            .ok_or_else(|| RolloutError::NotFound(id.to_owned()))?;
        if to > 100 {
            return Err(RolloutError::BadWeight(to));
        }
        if !state.phase.routes() {
            return Err(RolloutError::InvalidTransition {
                id: id.to_owned(),
                command: "set the weight of",
                phase: state.phase.name(),
            });
        }
        let payload = json!({"from_weight": state.candidate_weight, "to_weight": to,
                             "reason": reason, "rollout_event_id": state.started_event_id});
        self.append_caused(&state, WEIGHT_SET, payload, Some(cause), origin)
            .await
    }

    /// The rollout controller's fallback path for the candidate (on while it is degraded
    /// or fused); `cause` is the transition event behind it.
    pub async fn set_fallback(
        &self,
        id: &str,
        on: bool,
        cause: &str,
        origin: &Origin,
    ) -> Result<(RolloutState, Committed), RolloutError> {
        let state = self
            .get(id)
            .ok_or_else(|| RolloutError::NotFound(id.to_owned()))?;
        let payload = json!({"on": on, "rollout_event_id": state.started_event_id});
        self.append_caused(&state, FALLBACK_SET, payload, Some(cause), origin)
            .await
    }

    /// The operator closes the drift review `ticket` (`ReviewTicketClosed`); the rollout
    /// controller then releases the freeze and the candidate starts again from its first
    /// step. The caller checks that the ticket is the rollout's open one.
    pub async fn close_review(
        &self,
        id: &str,
        ticket: &str,
        resolution: &str,
        origin: &Origin,
    ) -> Result<(RolloutState, Committed), RolloutError> {
        let state = self
            .get(id)
            .ok_or_else(|| RolloutError::NotFound(id.to_owned()))?;
        let payload = json!({
            "ticket": ticket,
            "resolution": resolution,
            "rollout_event_id": state.started_event_id,
        });
        self.append_caused(&state, REVIEW_CLOSED, payload, None, origin)
            .await
    }

    /// One event on a rollout at its current version, in the rollout's correlation and
    /// naming its cause when it has one (the analysis event behind a controller's change).
    async fn append_caused(
        &self,
        state: &RolloutState,
        kind: &str,
        payload: serde_json::Value,
        cause: Option<&str>,
        origin: &Origin,
    ) -> Result<(RolloutState, Committed), RolloutError> {
        let mut metadata = json!({"correlation_id": state.started_event_id});
        if let Some(cause) = cause {
            metadata["causation_id"] = json!(cause);
        }
        let event = NewEvent::new(kind, payload).with_metadata(origin.metadata(metadata));
        let committed = self
            .append(&state.id, ExpectedVersion::Exact(state.version), event)
            .await?;
        let state = self
            .get(&state.id)
            .ok_or_else(|| RolloutError::NotFound(state.id.clone()))?;
        Ok((state, committed))
    }

    async fn append(
        &self,
        id: &str,
        expected: ExpectedVersion,
        event: NewEvent,
    ) -> Result<Committed, RolloutError> {
        let committed = match self
            .store
            .append(&format!("rollout/{id}"), expected, vec![event])
            .await
        {
            Ok(mut c) => c.remove(0),
            Err(LedgerError::WrongExpectedVersion { actual, .. }) => {
                return Err(RolloutError::Stale {
                    id: id.to_owned(),
                    expected: match expected {
                        ExpectedVersion::Exact(v) => v,
                        _ => 0,
                    },
                    actual,
                });
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(e) = self
            .store
            .read_all(committed.seq, 1)
            .await?
            .into_iter()
            .next()
        {
            self.apply(&e);
            if e.event_type == PROMOTED {
                self.engines.apply(&e);
            }
        }
        Ok(committed)
    }
}

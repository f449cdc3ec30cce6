//! Each node's share of a rollout's evidence, on the ledger.
//!
//! Every node's gateway sees only the requests sent to it. So every node cuts its own
//! observations of each automated rollout into the rollout's windows (aligned on the
//! rollout's start, the same grid on every node) and appends one `RolloutWindowObserved`
//! per closed window to `analysis/{rollout}/windows`, an empty one too (the node was there
//! and saw nothing). The controller, on whichever node holds its lease, merges the windows
//! of all nodes before it checks one, waiting a grace period for nodes that have not
//! reported; what it had and what was missing goes into its `RolloutChecked`. The evidence
//! behind every decision is then on the ledger, whoever made it.

use std::collections::HashMap;

use aether_ledger::{EventStore, ExpectedVersion, LedgerError, NewEvent};
use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::ControlState;
use crate::analysis::{
    AnalysisSettings, BatchReport, ObservationError, RequestObservation, WindowAggregator,
    WindowSamples,
};

/// What the gateway reports about the traffic of a rollout under analysis.
#[derive(Clone, Debug)]
pub enum RolloutObservation {
    /// One request as one stage scored it (live, or shadow on a sample).
    Request {
        rollout_id: String,
        observation: RequestObservation,
    },
    /// One batch a worker ran for one stage.
    Batch {
        rollout_id: String,
        report: BatchReport,
    },
}

/// The gateway's side of the channel to the rollout supervisor. Bounded: the gateway
/// never waits on analysis; an observation that does not fit is counted as dropped.
pub type ObservationSender = tokio::sync::mpsc::Sender<RolloutObservation>;

/// Event type of one node's window.
pub const WINDOW_OBSERVED: &str = "RolloutWindowObserved";

/// Values kept per series (and request ids per stage) in one node's window event, so that
/// the event stays far below the ledger's 1 MiB payload limit at any traffic.
pub const MAX_WINDOW_VALUES: usize = 2_000;

/// The stream of all nodes' windows of a rollout.
pub fn windows_stream(rollout_id: &str) -> String {
    format!("analysis/{rollout_id}/windows")
}

/// The payload of a `RolloutWindowObserved`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeWindow {
    pub node: String,
    /// Its samples; `start`/`end` may span several empty windows (a quiet node).
    pub samples: WindowSamples,
    /// Whether the samples were thinned to [`MAX_WINDOW_VALUES`] (counts are exact).
    #[serde(default)]
    pub thinned: bool,
}

/// Cuts this node's observations into windows and records each closed window.
pub struct WindowRecorder {
    store: EventStore,
    node: String,
    open: HashMap<String, WindowAggregator>,
    /// Closed windows the ledger did not take yet (the database was unreachable), by
    /// rollout: appended again, first, at the next flush.
    unrecorded: HashMap<String, Vec<NewEvent>>,
}

/// Most windows kept per rollout while the ledger cannot take them (the oldest go first).
const MAX_UNRECORDED: usize = 1_000;

impl WindowRecorder {
    pub fn new(store: EventStore, node: &str) -> WindowRecorder {
        WindowRecorder {
            store,
            node: node.to_owned(),
            open: HashMap::new(),
            unrecorded: HashMap::new(),
        }
    }

    /// Files one observation of the gateway. A rollout not under automated analysis (or
    /// unknown) is ignored; an invalid or late observation is refused, recording nothing.
    pub fn observe(
        &mut self,
        control: &ControlState,
        observation: RolloutObservation,
        now: DateTime<Utc>,
    ) -> Result<bool, ObservationError> {
        let id = match &observation {
            RolloutObservation::Request { rollout_id, .. }
            | RolloutObservation::Batch { rollout_id, .. } => rollout_id.clone(),
        };
        let Some(windows) = self.aggregator(control, &id, now) else {
            return Ok(false);
        };
        match observation {
            RolloutObservation::Request { observation, .. } => windows.observe(observation)?,
            RolloutObservation::Batch { report, .. } => windows.report(report)?,
        }
        Ok(true)
    }

    /// The aggregator of an automated rollout that routes traffic, opened at the start of
    /// the window `now` falls in.
    fn aggregator(
        &mut self,
        control: &ControlState,
        rollout_id: &str,
        now: DateTime<Utc>,
    ) -> Option<&mut WindowAggregator> {
        if !self.open.contains_key(rollout_id) {
            let rollout = control
                .rollouts
                .get(rollout_id)
                .filter(|r| r.automated && r.phase.routes())?;
            let settings: AnalysisSettings =
                serde_json::from_value(Value::Object(rollout.analysis.clone())).ok()?;
            let length_ms = i64::try_from(settings.window.length_ms).ok()?.max(1);
            let elapsed = (now - rollout.started_at).num_milliseconds().max(0);
            let origin = rollout.started_at
                + TimeDelta::try_milliseconds((elapsed / length_ms).saturating_mul(length_ms))?;
            let windows = WindowAggregator::new(origin, &settings.window).ok()?;
            self.open.insert(rollout_id.to_owned(), windows);
        }
        self.open.get_mut(rollout_id)
    }

    /// Appends every window that ended by `now`, for every automated rollout that routes
    /// traffic (empty windows too), and forgets rollouts that ended. Returns how many
    /// window events were appended. Windows the ledger refuses (the database unreachable)
    /// are kept and appended first at the next flush; the first such error is returned
    /// after every rollout was tried.
    pub async fn flush(
        &mut self,
        control: &ControlState,
        now: DateTime<Utc>,
    ) -> Result<usize, LedgerError> {
        let live = control.rollouts.analysed();
        self.open.retain(|id, _| live.contains(id));
        self.unrecorded.retain(|id, _| live.contains(id));
        let mut appended = 0;
        let mut failure = None;
        for id in live {
            let Some(windows) = self.aggregator(control, &id, now) else {
                continue;
            };
            let closed = windows.close_until(now);
            let mut events = self.unrecorded.remove(&id).unwrap_or_default();
            if closed.is_empty() && events.is_empty() {
                continue;
            }
            events.extend(closed.into_iter().map(|mut samples| {
                let thinned = samples.thin(MAX_WINDOW_VALUES);
                let window = NodeWindow {
                    node: self.node.clone(),
                    samples,
                    thinned,
                };
                NewEvent::new(
                    WINDOW_OBSERVED,
                    serde_json::to_value(&window).unwrap_or(Value::Null),
                )
                .with_metadata(json!({"actor": "aether:gateway", "node": self.node}))
            }));
            let count = events.len();
            match self
                .store
                .append(&windows_stream(&id), ExpectedVersion::Any, events.clone())
                .await
            {
                Ok(_) => appended += count,
                Err(e) => {
                    let dropped = count.saturating_sub(MAX_UNRECORDED);
                    events.drain(..dropped);
                    self.unrecorded.insert(id, events);
                    failure.get_or_insert(e);
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(appended),
        }
    }
}

//! The rollout controller: feeds one rollout's observations through the pure
//! [`analysis`](crate::analysis) core window by window, records every conclusion on stream
//! `analysis/{rollout}` and then carries it out — the candidate's weight, a pause, a
//! promotion, or a rollback to the snapshot before the offending step.
//!
//! Each closed window is recorded as one atomic append: an event per outcome (assessed,
//! inconclusive, drift with a retrain request or a review ticket, controller transition,
//! weight decided, semantic rollback decided, promotion decided) and a closing
//! `RolloutChecked` that carries the analyzer's whole state. The actions follow, each
//! naming the analysis event behind it as `causation_id`; a transition to degraded or fused
//! turns the candidate's fallback path on (`RolloutFallbackSet`), back to normal off. A controller started again reads
//! that stream back, resumes from the last `RolloutChecked` and first carries out what the
//! last check decided but the rollout does not show yet, so a crash between the record and
//! the action neither repeats nor skips a step.

use std::collections::BTreeMap;
use std::time::Duration;

use aether_ledger::cluster::Fence;
use aether_ledger::{Direction, EventStore, ExpectedVersion, LedgerError, NewEvent, RecordedEvent};
use chrono::{DateTime, TimeDelta, Utc};
use serde::Serialize;
use serde_json::{Value, json};

use crate::analysis::{
    AnalysisError, AnalysisOutcome, AnalysisSettings, Analyzer, AnalyzerState, BatchReport, Check,
    CommittedSnapshot, DriftResponse, Finish, ObservationError, ReferenceSample,
    RequestObservation, WeightReason, WindowAggregator, WindowSamples,
};
pub use crate::rollout_windows::{ObservationSender, RolloutObservation};
use crate::rollouts::{Command, RolloutError, RolloutPhase, RolloutState};
use crate::snapshot::SnapshotError;
use crate::{ControlState, Origin};

pub const CHECKED: &str = "RolloutChecked";
pub const ASSESSED: &str = "RolloutAssessed";
pub const INCONCLUSIVE: &str = "AnalysisInconclusive";
pub const PAUSE_DECIDED: &str = "AnalysisPaused";
pub const DRIFT_ASSESSED: &str = "DriftAssessed";
pub const RETRAIN_REQUESTED: &str = "RetrainRequested";
pub const REVIEW_OPENED: &str = "ReviewTicketOpened";
pub const TRANSITIONED: &str = "ControllerTransitioned";
pub const WEIGHT_DECIDED: &str = "WeightDecided";
pub const ROLLBACK_DECIDED: &str = "SemanticRollbackDecided";
pub const PROMOTION_DECIDED: &str = "PromotionDecided";
pub const PROMOTION_WITHHELD: &str = "PromotionWithheld";
pub const DRIFT_ESCALATED: &str = "DriftEscalated";
pub const REVIEW_OVERDUE: &str = "ReviewTicketOverdue";
pub const FEATURE_HEALTH: &str = "FeatureHealthSnapshot";
/// The reference window drift is measured against, fixed once per rollout.
pub const REFERENCE_FIXED: &str = "DriftReferenceFixed";
/// A snapshot the controller took after a step, the target of a later rollback.
pub const STEP_SNAPSHOT: &str = "StepSnapshotTaken";

/// Values kept per reference series: enough for KS and Wasserstein at the tiers' precision,
/// small enough for one event.
const REFERENCE_POINTS: usize = 1000;

/// The stream a rollout's analysis is recorded on.
pub fn stream(rollout_id: &str) -> String {
    format!("analysis/{rollout_id}")
}

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("no rollout {0:?}")]
    NotFound(String),
    #[error("rollout {0}: analysis settings: {1}")]
    Settings(String, String),
    #[error("rollout {id}'s analysis record is unreadable at seq {seq}: {reason}")]
    Corrupt {
        id: String,
        seq: u64,
        reason: String,
    },
    #[error(transparent)]
    Analysis(#[from] AnalysisError),
    #[error(transparent)]
    Observation(#[from] ObservationError),
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

impl ControllerError {
    /// The database refused a write because the lease it was made under has moved to
    /// another node: not a failure of the rollout, the end of this node's turn.
    pub fn is_fenced(&self) -> bool {
        matches!(
            self,
            ControllerError::Ledger(LedgerError::Fenced(_))
                | ControllerError::Rollout(RolloutError::Ledger(LedgerError::Fenced(_)))
                | ControllerError::Snapshot(SnapshotError::Ledger(LedgerError::Fenced(_)))
        )
    }
}

/// How long a step snapshot waits for another node's snapshot or rollback to finish.
const STEP_SNAPSHOT_PATIENCE: Duration = Duration::from_secs(10);

/// What the last recorded check left to carry out, read back at start.
#[derive(Default)]
struct History {
    state: Option<AnalyzerState>,
    window_end: Option<DateTime<Utc>>,
    step: u64,
    snapshots: Vec<CommittedSnapshot>,
    reference: Option<ReferenceSample>,
    /// The last semantic rollback decided: (its seq, target snapshot, reason).
    rollback: Option<(u64, Option<String>, String)>,
    version: u64,
}

/// One rollout under analysis.
pub struct RolloutController {
    store: EventStore,
    control: ControlState,
    rollout_id: String,
    analyzer: Analyzer,
    windows: WindowAggregator,
    /// Increases carried out so far: the analysis's step numbering for snapshots.
    step: u64,
    snapshots: Vec<CommittedSnapshot>,
    /// Version of the analysis stream, so that two controllers cannot both record.
    version: u64,
    /// The lease it acts under in a cluster: every record and action carries it.
    fence: Option<Fence>,
    /// Stream version of `analysis/{rollout}/windows` read so far.
    windows_read: u64,
    /// Nodes' windows not yet checked, by start: their samples and whether thinned.
    pending: BTreeMap<DateTime<Utc>, Vec<(WindowSamples, bool)>>,
    /// Which node reported which span of time (empty windows included).
    spans: Vec<(String, DateTime<Utc>, DateTime<Utc>)>,
}

/// How much evidence a check of merged windows had: the nodes whose windows it merged and
/// the live nodes that had not reported when it was made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Evidence {
    pub nodes: Vec<String>,
    pub missing: Vec<String>,
    /// Some node's samples were thinned (counts are exact).
    pub thinned: bool,
}

impl RolloutController {
    /// Takes over a rollout: resumes from its analysis record when there is one, takes the
    /// step-0 snapshot when there is none, and carries out what the last check decided.
    pub async fn start(
        store: &EventStore,
        control: &ControlState,
        rollout_id: &str,
    ) -> Result<RolloutController, ControllerError> {
        Self::start_fenced(store, control, rollout_id, None).await
    }

    /// [`start`](Self::start) under a lease: every event it records or causes (analysis,
    /// weights, pauses, snapshots, rollbacks, promotion) carries `fence`, so once another
    /// node has taken the lease the database refuses this controller's writes.
    pub async fn start_fenced(
        store: &EventStore,
        control: &ControlState,
        rollout_id: &str,
        fence: Option<Fence>,
    ) -> Result<RolloutController, ControllerError> {
        let rollout = control
            .rollouts
            .get(rollout_id)
            .ok_or_else(|| ControllerError::NotFound(rollout_id.to_owned()))?;
        let settings: AnalysisSettings =
            serde_json::from_value(Value::Object(rollout.analysis.clone()))
                .map_err(|e| ControllerError::Settings(rollout_id.to_owned(), e.to_string()))?;
        let history = read_history(store, rollout_id).await?;
        let mut analyzer = match history.state {
            Some(state) => Analyzer::from_state(settings.clone(), rollout.steps.clone(), state)?,
            None => Analyzer::new(
                settings.clone(),
                rollout.steps.clone(),
                rollout.candidate_weight,
            )?,
        };
        if history.reference.is_some() {
            analyzer.set_reference(history.reference);
        }
        let windows = WindowAggregator::new(
            history.window_end.unwrap_or(rollout.started_at),
            &settings.window,
        )?;
        let mut controller = RolloutController {
            store: store.clone(),
            control: control.clone(),
            rollout_id: rollout_id.to_owned(),
            analyzer,
            windows,
            step: history.step,
            snapshots: history.snapshots,
            version: history.version,
            fence,
            windows_read: 0,
            pending: BTreeMap::new(),
            spans: Vec::new(),
        };
        // Step 0's snapshot, or the one a crash kept a step from taking.
        if controller
            .snapshots
            .last()
            .is_none_or(|s| s.step < controller.step)
        {
            controller.snapshot_step(None).await?;
        }
        controller.catch_up(history.rollback).await?;
        Ok(controller)
    }

    pub fn rollout_id(&self) -> &str {
        &self.rollout_id
    }

    /// The analyzer's state (what `RolloutChecked` records).
    pub fn state(&self) -> &AnalyzerState {
        self.analyzer.state()
    }

    /// Whether the analysis has ended (promoted or rolled back).
    pub fn finished(&self) -> Option<Finish> {
        self.analyzer.state().finished
    }

    /// One request as a stage scored it (live or shadow).
    pub fn observe(&mut self, observation: RequestObservation) -> Result<(), ObservationError> {
        self.windows.observe(observation)
    }

    /// One batch as a worker reported it.
    pub fn report(&mut self, batch: BatchReport) -> Result<(), ObservationError> {
        self.windows.report(batch)
    }

    /// Checks every window that ended by `now`: records each check, then acts on it.
    /// Returns the outcomes in order.
    pub async fn tick(
        &mut self,
        now: DateTime<Utc>,
    ) -> Result<Vec<AnalysisOutcome>, ControllerError> {
        let mut all = Vec::new();
        for window in self.windows.close_until(now) {
            if self.finished().is_some() {
                break;
            }
            all.extend(self.check(&window, None).await?);
        }
        Ok(all)
    }

    /// Checks every window that ended by `now` from the windows all nodes recorded on the
    /// ledger (`crate::rollout_windows`), merged. A window waits for the `expected` nodes
    /// until `grace` after its end; then it is checked with what there is, the missing
    /// nodes named in its `RolloutChecked`. A run of windows no node saw any traffic in is
    /// one check. Returns the outcomes in order.
    pub async fn tick_from_ledger(
        &mut self,
        now: DateTime<Utc>,
        expected: &[String],
        grace: TimeDelta,
    ) -> Result<Vec<AnalysisOutcome>, ControllerError> {
        self.read_windows().await?;
        let length = self.windows.length();
        let mut all = Vec::new();
        while self.finished().is_none() {
            let start = self.windows.next_start();
            let mut end = start + length;
            if end > now {
                break;
            }
            let nodes = self.reported(start, end);
            let missing: Vec<String> = expected
                .iter()
                .filter(|n| !nodes.contains(*n))
                .cloned()
                .collect();
            if !missing.is_empty() && now < end + grace {
                break;
            }
            let mut window = WindowSamples::new(start, end);
            let mut thinned = false;
            match self.pending.remove(&start) {
                Some(parts) => {
                    for (samples, t) in parts {
                        window.merge(samples);
                        thinned |= t;
                    }
                }
                None => {
                    // Quiet everywhere: one check up to the next window anyone saw traffic in.
                    while end + length + grace <= now
                        && !self.pending.range(..end + length).any(|_| true)
                    {
                        end += length;
                    }
                    window.end = end;
                }
            }
            self.windows.skip_to(end);
            self.spans.retain(|(_, _, until)| *until > end);
            let evidence = Evidence {
                nodes,
                missing,
                thinned,
            };
            all.extend(self.check(&window, Some(evidence)).await?);
        }
        Ok(all)
    }

    /// Reads the nodes' windows recorded since the last read.
    async fn read_windows(&mut self) -> Result<(), ControllerError> {
        let stream = crate::rollout_windows::windows_stream(&self.rollout_id);
        let checked_until = self.windows.next_start();
        loop {
            let page = self
                .store
                .read_stream(&stream, self.windows_read + 1, Direction::Forward, 1000)
                .await?;
            for event in &page {
                self.windows_read = event.stream_version;
                if event.event_type != crate::rollout_windows::WINDOW_OBSERVED {
                    continue;
                }
                let window: crate::rollout_windows::NodeWindow =
                    serde_json::from_str(event.payload.get()).map_err(|e| {
                        ControllerError::Corrupt {
                            id: self.rollout_id.clone(),
                            seq: event.seq,
                            reason: e.to_string(),
                        }
                    })?;
                let (start, end) = (window.samples.start, window.samples.end);
                if end <= checked_until {
                    continue;
                }
                self.spans.push((window.node, start, end));
                let seen = window.samples.baseline.requests
                    + window.samples.candidate.requests
                    + (window.samples.baseline.batches.len()
                        + window.samples.candidate.batches.len()) as u64;
                if seen > 0 {
                    self.pending
                        .entry(start)
                        .or_default()
                        .push((window.samples, window.thinned));
                }
            }
            if page.len() < 1000 {
                return Ok(());
            }
        }
    }

    /// The nodes whose recorded windows cover `[start, end)`.
    fn reported(&self, start: DateTime<Utc>, end: DateTime<Utc>) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .spans
            .iter()
            .filter(|(_, from, until)| *from <= start && *until >= end)
            .map(|(node, _, _)| node.clone())
            .collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }

    /// One analysis window: a span of its own when traces are exported (`rollout.check`).
    #[tracing::instrument(
        level = "debug",
        name = "rollout.check",
        skip_all,
        fields(aether.rollout = %self.rollout_id, aether.step = self.step)
    )]
    async fn check(
        &mut self,
        window: &WindowSamples,
        evidence: Option<Evidence>,
    ) -> Result<Vec<AnalysisOutcome>, ControllerError> {
        let rollout = self.rollout()?;
        // Manual gates: an operator's pause holds the analysis, their resume opens it.
        match rollout.phase {
            RolloutPhase::Paused => {
                self.analyzer.hold();
            }
            RolloutPhase::Progressing => {
                self.analyzer.resume();
            }
            _ => {}
        }
        // An operator closed the drift review: the freeze is released.
        self.analyzer.close_reviews(rollout.reviews_closed);
        let had_reference = self.analyzer.state().reference.is_some();
        let outcomes = self.analyzer.check(Check {
            window,
            step: self.step,
            snapshots: &self.snapshots,
        })?;
        let mut events = Vec::new();
        if !had_reference && let Some(reference) = self.analyzer.state().reference.clone() {
            // Thinned before anything uses it, so that a resumed controller holds exactly
            // what this one does.
            let thinned = thin_reference(&reference);
            self.analyzer.set_reference(Some(thinned.clone()));
            events.push(NewEvent::new(
                REFERENCE_FIXED,
                json!({"window_end": window.end, "reference": thinned}),
            ));
        }
        let increases = outcomes
            .iter()
            .filter(|o| {
                matches!(o, AnalysisOutcome::WeightChange(w) if w.reason == WeightReason::Increase)
            })
            .count() as u64;
        let sla_ms = self.analyzer.settings().review.sla_ms;
        for outcome in &outcomes {
            events.extend(outcome_events(&rollout, window, sla_ms, outcome));
        }
        let mut state = self.analyzer.state().clone();
        state.reference = None; // recorded once, in DriftReferenceFixed
        let mut checked = json!({
            "window_start": window.start,
            "window_end": window.end,
            "step": self.step + increases,
            "state": state,
        });
        if let Some(evidence) = evidence {
            checked["evidence"] = json!(evidence);
        }
        if let Some(significance) = outcomes.iter().find_map(|o| match o {
            AnalysisOutcome::Assessed { significance, .. } => Some(significance),
            _ => None,
        }) {
            checked["significance"] = json!(significance);
        }
        events.push(NewEvent::new(CHECKED, checked));
        let committed = self.record(events).await?;
        // Each action names the decision event behind it.
        let cause_of = |kind: &str| {
            committed
                .iter()
                .rev()
                .find(|r| r.kind == kind)
                .map(|r| r.event_id.to_string())
                .unwrap_or_default()
        };
        for outcome in &outcomes {
            match outcome {
                AnalysisOutcome::WeightChange(w) if w.reason != WeightReason::Rollback => {
                    let reason = weight_reason(w.reason);
                    self.control
                        .rollouts
                        .set_weight(
                            &self.rollout_id,
                            w.to,
                            reason,
                            &cause_of(WEIGHT_DECIDED),
                            &self.origin(),
                        )
                        .await?;
                    if w.reason == WeightReason::Increase {
                        self.step += 1;
                        self.snapshot_step(Some(cause_of(WEIGHT_DECIDED))).await?;
                    }
                }
                AnalysisOutcome::Paused { reason, .. } => {
                    let reason = serde_json::to_value(reason)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default();
                    self.pause(&format!("analysis: {reason}")).await?;
                }
                AnalysisOutcome::Rollback(decision) => {
                    let target = decision.target.as_ref().map(|t| t.snapshot_id.clone());
                    self.roll_back(target, &decision.reason).await?;
                }
                AnalysisOutcome::Promote { .. } => {
                    self.command(Command::Promote, None).await?;
                }
                AnalysisOutcome::Transition(t)
                    if t.to.fallback_path() != self.rollout()?.fallback =>
                {
                    self.control
                        .rollouts
                        .set_fallback(
                            &self.rollout_id,
                            t.to.fallback_path(),
                            &cause_of(TRANSITIONED),
                            &self.origin(),
                        )
                        .await?;
                }
                _ => {}
            }
        }
        Ok(outcomes)
    }

    fn rollout(&self) -> Result<RolloutState, ControllerError> {
        self.control
            .rollouts
            .get(&self.rollout_id)
            .ok_or_else(|| ControllerError::NotFound(self.rollout_id.clone()))
    }

    fn origin(&self) -> Origin {
        let mut origin = self
            .control
            .under_snapshot(Origin::from("aether:rollout-controller"));
        origin.fence = self.fence.clone();
        origin
    }

    async fn record(&mut self, events: Vec<NewEvent>) -> Result<Vec<Recorded>, ControllerError> {
        let origin = self.origin();
        let kinds: Vec<String> = events.iter().map(|e| e.event_type.clone()).collect();
        let events = events
            .into_iter()
            .map(|e| e.with_metadata(origin.metadata(json!({}))))
            .collect();
        let expected = if self.version == 0 {
            ExpectedVersion::NoStream
        } else {
            ExpectedVersion::Exact(self.version)
        };
        let committed = self
            .store
            .append(&stream(&self.rollout_id), expected, events)
            .await?;
        if let Some(last) = committed.last() {
            self.version = last.stream_version;
        }
        Ok(committed
            .into_iter()
            .zip(kinds)
            .map(|(c, kind)| Recorded {
                event_id: c.event_id,
                kind,
            })
            .collect())
    }

    /// Takes a consistent snapshot and records it as this step's.
    async fn snapshot_step(&mut self, cause: Option<String>) -> Result<(), ControllerError> {
        let participants = self.control.participants();
        // Another node taking a snapshot or rolling back holds the coordinator lease for a
        // moment: wait for it rather than fail the step.
        let patience = tokio::time::Instant::now() + STEP_SNAPSHOT_PATIENCE;
        let snapshot = loop {
            match self
                .control
                .snapshots
                .take(&participants, crate::snapshot::DEFAULT_TTL, &self.origin())
                .await
            {
                Err(SnapshotError::Busy { .. }) if tokio::time::Instant::now() < patience => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => break other?,
            }
        };
        self.record(vec![NewEvent::new(
            STEP_SNAPSHOT,
            json!({"step": self.step, "snapshot_id": snapshot.id, "cause": cause}),
        )])
        .await?;
        self.snapshots.push(CommittedSnapshot {
            step: self.step,
            snapshot_id: snapshot.id,
        });
        Ok(())
    }

    async fn pause(&self, reason: &str) -> Result<(), ControllerError> {
        if self.rollout()?.phase == RolloutPhase::Progressing {
            self.command(Command::Pause, Some(reason)).await?;
        }
        Ok(())
    }

    async fn command(&self, command: Command, reason: Option<&str>) -> Result<(), ControllerError> {
        self.control
            .rollouts
            .command(&self.rollout_id, command, None, reason, &self.origin())
            .await?;
        Ok(())
    }

    /// Restores the target snapshot in one `RolledBack`, then holds the rollout for an
    /// operator; without a target the candidate is taken to 0 and the rollout aborted.
    async fn roll_back(&self, target: Option<String>, reason: &str) -> Result<(), ControllerError> {
        match target {
            Some(id) => {
                let participants = self.control.participants();
                self.control
                    .snapshots
                    .rollback(&participants, &id, reason, &self.origin())
                    .await?;
                self.pause("semantic rollback").await
            }
            None => {
                if self.rollout()?.phase.routes() {
                    self.command(Command::Abort, Some(reason)).await?;
                }
                Ok(())
            }
        }
    }

    /// After a restart: carries out what the last recorded check decided but the rollout
    /// does not show (a crash came between the record and the action).
    async fn catch_up(
        &mut self,
        rollback: Option<(u64, Option<String>, String)>,
    ) -> Result<(), ControllerError> {
        let rollout = self.rollout()?;
        let state = self.analyzer.state().clone();
        match state.finished {
            Some(Finish::Promoted) if rollout.phase.routes() => {
                self.command(Command::Promote, None).await?;
            }
            Some(Finish::RolledBack) => {
                if let Some((seq, target, reason)) = rollback {
                    let done = self
                        .control
                        .snapshots
                        .rollbacks()
                        .iter()
                        .any(|r| r.seq > seq);
                    if !done && rollout.phase.routes() {
                        self.roll_back(target, &reason).await?;
                    }
                }
            }
            None if rollout.phase.routes()
                && rollout.fallback != state.controller.mode.fallback_path() =>
            {
                let on = state.controller.mode.fallback_path();
                self.control
                    .rollouts
                    .set_fallback(&self.rollout_id, on, "", &self.origin())
                    .await?;
            }
            None if rollout.phase.routes() && rollout.candidate_weight != state.weight => {
                let reason = "resume: the last check's weight";
                self.control
                    .rollouts
                    .set_weight(&self.rollout_id, state.weight, reason, "", &self.origin())
                    .await?;
            }
            _ => {}
        }
        Ok(())
    }
}

/// A committed analysis event's id and type.
struct Recorded {
    event_id: uuid::Uuid,
    kind: String,
}

fn weight_reason(reason: WeightReason) -> &'static str {
    match reason {
        WeightReason::Increase => "increase",
        WeightReason::Fuse => "fuse",
        WeightReason::DriftFreeze => "drift_freeze",
        WeightReason::Rollback => "rollback",
    }
}

/// The events that record one outcome.
fn outcome_events(
    rollout: &RolloutState,
    window: &WindowSamples,
    sla_ms: u64,
    outcome: &AnalysisOutcome,
) -> Vec<NewEvent> {
    let mut body = serde_json::to_value(outcome).unwrap_or_default();
    if let AnalysisOutcome::ReviewOverdue { opened_at, .. } = outcome {
        body["ticket"] = json!(ticket_name(&rollout.id, *opened_at));
        body["candidate"] = json!(rollout.candidate);
    }
    let kind = match outcome {
        AnalysisOutcome::Inconclusive { .. } => INCONCLUSIVE,
        AnalysisOutcome::Paused { .. } => PAUSE_DECIDED,
        AnalysisOutcome::Assessed { .. } => ASSESSED,
        AnalysisOutcome::Drift(_) => DRIFT_ASSESSED,
        AnalysisOutcome::Transition(_) => TRANSITIONED,
        AnalysisOutcome::WeightChange(_) => WEIGHT_DECIDED,
        AnalysisOutcome::Rollback(_) => ROLLBACK_DECIDED,
        AnalysisOutcome::Promote { .. } => PROMOTION_DECIDED,
        AnalysisOutcome::PromotionWithheld { .. } => PROMOTION_WITHHELD,
        AnalysisOutcome::DriftEscalated(_) => DRIFT_ESCALATED,
        AnalysisOutcome::ReviewOverdue { .. } => REVIEW_OVERDUE,
        AnalysisOutcome::FeatureHealth { .. } => FEATURE_HEALTH,
    };
    let mut events = vec![NewEvent::new(kind, body)];
    if let AnalysisOutcome::Drift(d) = outcome {
        // The features whose KS test was significant, and the composite's drifted series.
        let mut drifted: Vec<String> = d
            .report
            .features
            .iter()
            .filter(|(_, f)| f.significant)
            .map(|(name, _)| name.clone())
            .collect();
        if let Some(c) = &d.report.composite {
            for (series, s) in &c.series {
                if let Some(name) = series.strip_prefix("feature:")
                    && s.composite > 0.5
                    && !drifted.iter().any(|n| n == name)
                {
                    drifted.push(name.to_owned());
                }
            }
        }
        let request = json!({
            "candidate": rollout.candidate,
            "baseline": rollout.baseline,
            "tier": d.tier,
            "drift_score": d.report.score,
            "composite_score": d.report.composite.as_ref().map(|c| c.score),
            "at": d.at,
            "window": {"start": window.start, "end": window.end},
            "features": drifted,
            // What to retrain on: everything the candidate has seen in this rollout.
            "data_range": {"from": rollout.started_at, "to": window.end},
        });
        match d.response {
            DriftResponse::PauseAndRequestRetrain => {
                events.push(NewEvent::new(RETRAIN_REQUESTED, request));
            }
            DriftResponse::FreezeAndOpenReview => {
                let ticket = ticket_name(&rollout.id, d.at);
                let mut body = request;
                body["ticket"] = json!(ticket);
                body["sla_ms"] = json!(sla_ms);
                body["deadline"] = json!(d.at + TimeDelta::milliseconds(sla_ms as i64));
                events.push(NewEvent::new(REVIEW_OPENED, body));
            }
            DriftResponse::Record => {}
        }
    }
    events
}

/// A review ticket's name: the rollout and the time its freeze was decided.
pub fn ticket_name(rollout_id: &str, opened_at: DateTime<Utc>) -> String {
    format!("review-{rollout_id}-{}", opened_at.timestamp_millis())
}

/// Keeps at most [`REFERENCE_POINTS`] evenly spaced order statistics of each series: the
/// same distribution for KS and Wasserstein, a bounded event.
fn thin_reference(reference: &ReferenceSample) -> ReferenceSample {
    ReferenceSample {
        scores: thin(&reference.scores),
        features: reference
            .features
            .iter()
            .map(|(name, values)| (name.clone(), thin(values)))
            .collect::<BTreeMap<_, _>>(),
    }
}

fn thin(values: &[f64]) -> Vec<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.len() <= REFERENCE_POINTS {
        return sorted;
    }
    let n = sorted.len();
    (0..REFERENCE_POINTS)
        .map(|i| sorted[i * (n - 1) / (REFERENCE_POINTS - 1)])
        .collect()
}

/// Reads a rollout's analysis stream back.
async fn read_history(store: &EventStore, rollout_id: &str) -> Result<History, ControllerError> {
    let mut history = History::default();
    let stream = stream(rollout_id);
    let mut from = 0;
    loop {
        let page = store
            .read_stream(&stream, from, Direction::Forward, 500)
            .await?;
        let full = page.len() == 500;
        for event in &page {
            apply_history(&mut history, rollout_id, event)?;
        }
        match page.last() {
            Some(last) if full => from = last.stream_version + 1,
            _ => break,
        }
    }
    Ok(history)
}

fn apply_history(
    history: &mut History,
    rollout_id: &str,
    event: &RecordedEvent,
) -> Result<(), ControllerError> {
    let corrupt = |reason: String| ControllerError::Corrupt {
        id: rollout_id.to_owned(),
        seq: event.seq,
        reason,
    };
    history.version = event.stream_version;
    let p = event.payload_value().map_err(|e| corrupt(e.to_string()))?;
    match event.event_type.as_str() {
        CHECKED => {
            history.state = Some(
                serde_json::from_value(p["state"].clone()).map_err(|e| corrupt(e.to_string()))?,
            );
            history.window_end = Some(
                serde_json::from_value(p["window_end"].clone())
                    .map_err(|e| corrupt(e.to_string()))?,
            );
            history.step = p["step"].as_u64().unwrap_or(history.step);
        }
        STEP_SNAPSHOT => history.snapshots.push(CommittedSnapshot {
            step: p["step"].as_u64().unwrap_or(0),
            snapshot_id: p["snapshot_id"].as_str().unwrap_or_default().to_owned(),
        }),
        REFERENCE_FIXED => {
            history.reference = Some(
                serde_json::from_value(p["reference"].clone())
                    .map_err(|e| corrupt(e.to_string()))?,
            );
        }
        ROLLBACK_DECIDED => {
            let target = p["target"]["snapshot_id"].as_str().map(str::to_owned);
            let reason = p["reason"].as_str().unwrap_or_default().to_owned();
            history.rollback = Some((event.seq, target, reason));
        }
        _ => {}
    }
    Ok(())
}

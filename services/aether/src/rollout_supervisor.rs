//! Records this node's share of every automated rollout's evidence (the gateway's
//! observations cut into windows, on the ledger: `aether_control::rollout_windows`) and,
//! on the node holding the `rollout-controller` lease, runs a [`RolloutController`] for
//! every automated rollout that is progressing or paused over the windows of all nodes,
//! ticked on wall-clock time; and ends every pause with a duration (any rollout) when it
//! runs out.
//!
//! A controller that fails (the ledger refused a record, a rollout command conflicted) is
//! dropped and started again from the ledger on a later tick, which carries out whatever
//! its last recorded check decided; the supervisor itself never stops the service.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use aether_control::rollout_controller::{ObservationSender, RolloutObservation};
use aether_control::rollout_windows::WindowRecorder;
use aether_control::{ControlState, RolloutController};
use aether_ledger::EventStore;
use tokio::sync::{mpsc, watch};

/// Observations buffered between the gateway and the supervisor.
const CHANNEL: usize = 65_536;
/// How often windows are closed and rollouts looked for.
const TICK: Duration = Duration::from_millis(250);
/// How long a rollout whose controller failed to start waits before the next try.
const RETRY: Duration = Duration::from_secs(5);
/// How long after a window's end the controller waits for a live node's window before it
/// checks without it (and says so).
const GRACE_MS: i64 = 2_000;
/// How often the live nodes (whose windows are waited for) are read.
const NODES_EVERY: Duration = Duration::from_secs(1);

/// The gateway's sender and the supervisor's receiver.
pub fn channel() -> (ObservationSender, mpsc::Receiver<RolloutObservation>) {
    mpsc::channel(CHANNEL)
}

/// The lease under which one node of a cluster runs the rollout controllers.
pub const ROLLOUT_LEASE: &str = "rollout-controller";

/// Records this node's windows, and supervises the controllers while this node holds
/// `lease` (on SQLite: always): one node decides for each rollout, so two controllers never
/// race to step or roll back the same one, and it decides on every node's evidence.
pub async fn run(
    store: EventStore,
    control: ControlState,
    mut observations: mpsc::Receiver<RolloutObservation>,
    lease: aether_ledger::cluster::HeldLease,
    node_id: String,
    mut stop: watch::Receiver<bool>,
) {
    let mut recorder = WindowRecorder::new(store.clone(), &node_id);
    let mut expected = vec![node_id.clone()];
    let mut nodes_read: Option<tokio::time::Instant> = None;
    let mut running: HashMap<String, RolloutController> = HashMap::new();
    // Finished analyses (not restarted) and failed starts (retried after RETRY).
    let mut finished: HashSet<String> = HashSet::new();
    let mut failed: HashMap<String, tokio::time::Instant> = HashMap::new();
    // The token the running controllers were started under: a new one means another node
    // held the lease in between, so they start again from what the ledger now says.
    let mut started_under: Option<u64> = None;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            Some(observation) = observations.recv() => record(&mut recorder, &control, observation),
            _ = tick.tick() => {
                if let Err(e) = recorder.flush(&control, chrono::Utc::now()).await {
                    tracing::warn!(error = %e, "cannot record this node's rollout windows; the controller will count them missing");
                    metrics::counter!("aether_rollout_windows_unrecorded_total").increment(1);
                }
                let Some(token) = lease.token() else {
                    if !running.is_empty() {
                        tracing::info!("another node runs the rollout controllers now");
                        running.clear();
                        failed.clear();
                    }
                    started_under = None;
                    continue;
                };
                if started_under.is_some_and(|t| t != token) {
                    running.clear();
                    failed.clear();
                }
                started_under = Some(token);
                let fence = lease.fence_for(token);
                let mut origin = control.under_snapshot(aether_control::Origin::from("aether:rollout-controller"));
                origin.fence = fence.clone();
                if let Err(e) = control.rollouts.resume_due(chrono::Utc::now(), &origin).await {
                    tracing::error!(error = %e, "cannot resume a timed pause");
                }
                adopt(&store, &control, &mut running, &finished, &mut failed, fence).await;
                if nodes_read.is_none_or(|at| at.elapsed() >= NODES_EVERY) {
                    nodes_read = Some(tokio::time::Instant::now());
                    match crate::cluster::live_others(&store, &node_id).await {
                        Ok(others) => {
                            expected = std::iter::once(node_id.clone()).chain(others).collect();
                            expected.sort();
                        }
                        Err(e) => tracing::debug!(error = %e, "cannot read the live nodes"),
                    }
                }
                let now = chrono::Utc::now();
                let grace = chrono::TimeDelta::milliseconds(GRACE_MS);
                let mut drop = Vec::new();
                for (id, controller) in running.iter_mut() {
                    match controller.tick_from_ledger(now, &expected, grace).await {
                        Ok(_) if controller.finished().is_some() => {
                            tracing::info!(rollout = %id, finished = ?controller.finished(), "rollout analysis finished");
                            finished.insert(id.clone());
                            drop.push(id.clone());
                        }
                        Ok(_) => {}
                        Err(e) if e.is_fenced() => {
                            tracing::info!(rollout = %id, error = %e, "the rollout-controller lease moved to another node; this node's decision was refused");
                            drop.push(id.clone());
                        }
                        Err(e) => {
                            tracing::error!(rollout = %id, error = %e, "rollout controller failed; restarting it from the ledger");
                            metrics::counter!("aether_rollout_controller_failures_total").increment(1);
                            drop.push(id.clone());
                        }
                    }
                }
                for id in drop {
                    running.remove(&id);
                }
            }
        }
    }
}

/// Starts controllers for automated rollouts that route traffic or are paused, and stops
/// those whose rollout ended some other way (an operator's promote or abort).
async fn adopt(
    store: &EventStore,
    control: &ControlState,
    running: &mut HashMap<String, RolloutController>,
    finished: &HashSet<String>,
    failed: &mut HashMap<String, tokio::time::Instant>,
    fence: Option<aether_ledger::cluster::Fence>,
) {
    let live = control.rollouts.analysed();
    running.retain(|id, _| live.contains(id));
    let now = tokio::time::Instant::now();
    for id in live {
        if running.contains_key(&id)
            || finished.contains(&id)
            || failed.get(&id).is_some_and(|at| now < *at + RETRY)
        {
            continue;
        }
        match RolloutController::start_fenced(store, control, &id, fence.clone()).await {
            Ok(controller) => {
                failed.remove(&id);
                if controller.finished().is_none() {
                    tracing::info!(rollout = %id, "rollout controller started");
                    running.insert(id, controller);
                }
            }
            Err(e) => {
                tracing::error!(rollout = %id, error = %e, "cannot start the rollout controller");
                failed.insert(id, now);
            }
        }
    }
}

/// Files one of the gateway's observations in this node's windows.
fn record(recorder: &mut WindowRecorder, control: &ControlState, observation: RolloutObservation) {
    match recorder.observe(control, observation, chrono::Utc::now()) {
        Ok(true) => {}
        Ok(false) => metrics::counter!("aether_rollout_observations_unanalysed_total").increment(1),
        Err(e) => {
            tracing::debug!(error = %e, "observation refused");
            metrics::counter!("aether_rollout_observations_refused_total").increment(1);
        }
    }
}

//! The breaker on the scoring stage. The interface design gives the batch subsystem 100 ms
//! of a request's 200 ms and asks for a breaker once the workers' batch p99 passes 85 ms,
//! with a compensation path and retries backed off 10, 30 and 80 ms.
//!
//! How it works here:
//!
//! * **Closed** (normal): batches go to remote workers; each batch's round trip (dispatch to
//!   result, a timed-out dispatch counted at its timeout) is kept for `window`.
//! * It **opens** when at least `min_batches` batches in the window have a p99 above
//!   `threshold`. The compensation path is the gateway's own CPU: batches are scored in
//!   process (same model, checked by the same digest), so a slow worker fleet costs
//!   latency budget no longer. A gateway that may not score in process (`--no-local-workers`,
//!   or a model it has not loaded) has no compensation path: the breaker does not open
//!   there, and the stage's budget burn (`aether_clearing_budget_burn_total{stage="batch"}`)
//!   is what shows the trouble.
//! * **Probing** (open): `probe_after` after opening, and again that long after each slow
//!   probe, one batch goes to the remote workers while the others stay in process. After
//!   `probes_to_close` consecutive probes within the threshold it **closes**: batches go
//!   remote again and the window starts empty.
//!
//! Each switch is an event on the ledger (`ScoringDegraded` / `ScoringRestored` on
//! [`BREAKER_STREAM`]) with the figures that decided it, and the state is the gauge
//! `aether_clearing_breaker_open`.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use aether_ledger::{EventStore, ExpectedVersion, NewEvent};
use serde_json::{Value, json};

/// The stream the breaker's switches are recorded on.
pub const BREAKER_STREAM: &str = "worker/breaker";
/// The breaker opened: batches are scored in process.
pub const SCORING_DEGRADED: &str = "ScoringDegraded";
/// The breaker closed: batches go to the remote workers again.
pub const SCORING_RESTORED: &str = "ScoringRestored";

/// Waits between remote attempts of one batch: the design's 10, 30 and 80 ms (the last
/// repeated for any further attempt).
pub const RETRY_BACKOFF: [Duration; 3] = [
    Duration::from_millis(10),
    Duration::from_millis(30),
    Duration::from_millis(80),
];

/// The pause before remote attempt `attempt` (0 for the first, which does not wait).
pub fn backoff_before(attempt: usize) -> Duration {
    match attempt {
        0 => Duration::ZERO,
        n => RETRY_BACKOFF[(n - 1).min(RETRY_BACKOFF.len() - 1)],
    }
}

/// When the breaker opens and closes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Remote batches' p99 above this opens the breaker (the design's 85 ms).
    pub threshold: Duration,
    /// How long a remote batch's time counts.
    pub window: Duration,
    /// Batches the window must hold before its p99 is trusted.
    pub min_batches: usize,
    /// How long after opening (and after a slow probe) the next probe goes out.
    pub probe_after: Duration,
    /// Consecutive probes within the threshold that close the breaker.
    pub probes_to_close: usize,
}

impl Default for BreakerConfig {
    /// 85 ms over 10 s with at least 20 batches; a probe a second; 3 good probes close.
    fn default() -> Self {
        BreakerConfig {
            threshold: Duration::from_millis(85),
            window: Duration::from_secs(10),
            min_batches: 20,
            probe_after: Duration::from_secs(1),
            probes_to_close: 3,
        }
    }
}

/// Where a batch is scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// On a remote worker, as usual.
    Remote,
    /// On a remote worker, to see whether the workers have recovered.
    Probe,
    /// In process: the compensation path while the breaker is open.
    InProcess,
}

/// A change of state, with what decided it.
#[derive(Clone, Debug, PartialEq)]
pub enum Switch {
    /// p99 of `batches` remote batches over the window was `p99`.
    Opened { p99: Duration, batches: usize },
    /// The last probes took these times; the breaker was open for `open_for`, in which
    /// `in_process` batches were scored in process.
    Closed {
        probes: Vec<Duration>,
        open_for: Duration,
        in_process: u64,
    },
}

#[derive(Debug)]
struct Open {
    since: Instant,
    next_probe: Instant,
    probing: bool,
    good_probes: Vec<Duration>,
    in_process: u64,
}

#[derive(Debug, Default)]
struct State {
    samples: VecDeque<(Instant, Duration)>,
    open: Option<Open>,
}

/// The breaker's state and its rule; what it decides is recorded by [`Breaker`].
#[derive(Debug)]
pub struct BreakerRule {
    config: BreakerConfig,
    state: Mutex<State>,
}

impl BreakerRule {
    pub fn new(config: BreakerConfig) -> Self {
        BreakerRule {
            config,
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Where the next batch goes, given whether it could be scored in process.
    pub fn route(&self, in_process_possible: bool, now: Instant) -> Route {
        let mut state = self.state();
        let Some(open) = state.open.as_mut() else {
            return Route::Remote;
        };
        if !in_process_possible {
            return Route::Remote;
        }
        if !open.probing && now >= open.next_probe {
            open.probing = true;
            return Route::Probe;
        }
        open.in_process += 1;
        Route::InProcess
    }

    /// A remote batch took `took`; `probe` when it was sent as one. Says when this switched
    /// the breaker. `in_process_possible` as for [`route`](Self::route): without a
    /// compensation path the breaker does not open.
    pub fn observe(
        &self,
        took: Duration,
        probe: bool,
        in_process_possible: bool,
        now: Instant,
    ) -> Option<Switch> {
        let config = &self.config;
        let mut state = self.state();
        if let Some(open) = state.open.as_mut() {
            if !probe {
                return None;
            }
            open.probing = false;
            if took > config.threshold {
                open.good_probes.clear();
                open.next_probe = now + config.probe_after;
                return None;
            }
            open.good_probes.push(took);
            // A good probe is followed by the next batch's, so recovery takes a few batches.
            open.next_probe = now;
            if open.good_probes.len() < config.probes_to_close.max(1) {
                return None;
            }
            let switch = Switch::Closed {
                probes: std::mem::take(&mut open.good_probes),
                open_for: now.saturating_duration_since(open.since),
                in_process: open.in_process,
            };
            state.open = None;
            state.samples.clear();
            return Some(switch);
        }
        state.samples.push_back((now, took));
        while state
            .samples
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > config.window)
        {
            state.samples.pop_front();
        }
        if !in_process_possible || state.samples.len() < config.min_batches.max(1) {
            return None;
        }
        let mut times: Vec<Duration> = state.samples.iter().map(|(_, t)| *t).collect();
        times.sort_unstable();
        let p99 = times[(times.len() * 99).div_ceil(100).saturating_sub(1)];
        if p99 <= config.threshold {
            return None;
        }
        let batches = times.len();
        state.open = Some(Open {
            since: now,
            next_probe: now + config.probe_after,
            probing: false,
            good_probes: Vec::new(),
            in_process: 0,
        });
        Some(Switch::Opened { p99, batches })
    }

    /// A probe found no worker to answer it (none connected, or lost): the next one is
    /// sent `probe_after` from now.
    pub fn probe_unanswered(&self, now: Instant) {
        if let Some(open) = self.state().open.as_mut() {
            open.probing = false;
            open.next_probe = now + self.config.probe_after;
        }
    }

    pub fn is_open(&self) -> bool {
        self.state().open.is_some()
    }

    pub fn config(&self) -> &BreakerConfig {
        &self.config
    }
}

/// The breaker with its ledger: each switch is appended as it happens.
#[derive(Debug)]
pub struct Breaker {
    rule: BreakerRule,
    store: EventStore,
}

impl Breaker {
    pub fn new(config: BreakerConfig, store: EventStore) -> Self {
        metrics::gauge!("aether_clearing_breaker_open").set(0.0);
        Breaker {
            rule: BreakerRule::new(config),
            store,
        }
    }

    pub fn route(&self, in_process_possible: bool) -> Route {
        let route = self.rule.route(in_process_possible, Instant::now());
        if route == Route::InProcess {
            metrics::counter!("aether_clearing_batches_degraded_total").increment(1);
        }
        route
    }

    /// See [`BreakerRule::probe_unanswered`].
    pub fn probe_unanswered(&self) {
        self.rule.probe_unanswered(Instant::now());
    }

    /// Records a remote batch's time; a switch it causes is logged, counted and appended.
    pub async fn observe(&self, took: Duration, probe: bool, in_process_possible: bool) {
        let Some(switch) = self
            .rule
            .observe(took, probe, in_process_possible, Instant::now())
        else {
            return;
        };
        let (event_type, payload) = self.describe(&switch);
        let open = matches!(switch, Switch::Opened { .. });
        metrics::gauge!("aether_clearing_breaker_open").set(if open { 1.0 } else { 0.0 });
        metrics::counter!("aether_clearing_breaker_switches_total", "to" => if open { "in-process" } else { "remote" })
            .increment(1);
        if open {
            tracing::warn!(%payload, "remote scoring is slow: batches are scored in process");
        } else {
            tracing::info!(%payload, "remote scoring has recovered");
        }
        let event = NewEvent::new(event_type, payload);
        if let Err(e) = self
            .store
            .append(BREAKER_STREAM, ExpectedVersion::Any, vec![event])
            .await
        {
            // The switch itself stands: scoring must not wait for the ledger.
            tracing::error!(error = %e, event_type, "cannot record the breaker's switch");
        }
    }

    fn describe(&self, switch: &Switch) -> (&'static str, Value) {
        let config = self.rule.config();
        let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
        match switch {
            Switch::Opened { p99, batches } => (
                SCORING_DEGRADED,
                json!({
                    "stage": "batch",
                    "path": "in-process",
                    "p99_ms": ms(p99),
                    "threshold_ms": ms(&config.threshold),
                    "batches": batches,
                    "window_ms": ms(&config.window),
                }),
            ),
            Switch::Closed {
                probes,
                open_for,
                in_process,
            } => (
                SCORING_RESTORED,
                json!({
                    "stage": "batch",
                    "path": "remote",
                    "probe_ms": probes.iter().map(ms).collect::<Vec<_>>(),
                    "threshold_ms": ms(&config.threshold),
                    "degraded_ms": ms(open_for),
                    "batches_in_process": in_process,
                }),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule() -> BreakerRule {
        BreakerRule::new(BreakerConfig {
            threshold: Duration::from_millis(85),
            window: Duration::from_secs(10),
            min_batches: 5,
            probe_after: Duration::from_secs(1),
            probes_to_close: 3,
        })
    }

    const FAST: Duration = Duration::from_millis(20);
    const SLOW: Duration = Duration::from_millis(150);

    #[test]
    fn slow_batches_open_it_and_good_probes_close_it() {
        let rule = rule();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Fast batches keep it closed, however many.
        for i in 0..200 {
            assert_eq!(rule.observe(FAST, false, true, at(i / 100)), None);
        }
        assert_eq!(rule.route(true, at(50)), Route::Remote);
        // Two slow batches in 202 are within the p99 (nearest rank); a third is not.
        assert_eq!(rule.observe(SLOW, false, true, at(51)), None);
        assert_eq!(rule.observe(SLOW, false, true, at(52)), None);
        assert_eq!(
            rule.observe(SLOW, false, true, at(53)),
            Some(Switch::Opened {
                p99: SLOW,
                batches: 203
            })
        );
        // Open: batches in process until the probe is due, one probe at a time.
        assert_eq!(rule.route(true, at(100)), Route::InProcess);
        assert_eq!(rule.route(true, at(1100)), Route::Probe);
        assert_eq!(rule.route(true, at(1101)), Route::InProcess);
        // A slow probe puts the next one off by `probe_after`.
        assert_eq!(rule.observe(SLOW, true, true, at(1200)), None);
        assert_eq!(rule.route(true, at(1300)), Route::InProcess);
        assert_eq!(rule.route(true, at(2200)), Route::Probe);
        // Three good probes in a row close it; what decided it is reported.
        assert_eq!(rule.observe(FAST, true, true, at(2220)), None);
        assert_eq!(rule.route(true, at(2221)), Route::Probe);
        assert_eq!(rule.observe(FAST, true, true, at(2240)), None);
        assert_eq!(rule.route(true, at(2241)), Route::Probe);
        let closed = rule.observe(FAST, true, true, at(2260));
        match closed {
            Some(Switch::Closed {
                probes,
                open_for,
                in_process,
            }) => {
                assert_eq!(probes, vec![FAST; 3]);
                assert!(open_for >= Duration::from_secs(2));
                assert_eq!(in_process, 3);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(rule.route(true, at(2300)), Route::Remote);
        // The window started empty: fewer than `min_batches` slow ones do not reopen it.
        for i in 0..4 {
            assert_eq!(rule.observe(SLOW, false, true, at(2400 + i)), None);
        }
    }

    #[test]
    fn old_batches_leave_the_window_and_too_few_are_not_trusted() {
        let rule = rule();
        let t0 = Instant::now();
        for i in 0..4 {
            assert_eq!(
                rule.observe(SLOW, false, true, t0 + Duration::from_millis(i)),
                None
            );
        }
        // Eleven seconds on, the four slow ones have left the window.
        let later = t0 + Duration::from_secs(11);
        assert_eq!(rule.observe(SLOW, false, true, later), None);
        assert!(!rule.is_open());
    }

    #[test]
    fn without_a_compensation_path_it_stays_closed() {
        let rule = rule();
        let t0 = Instant::now();
        for i in 0..20 {
            assert_eq!(
                rule.observe(SLOW, false, false, t0 + Duration::from_millis(i)),
                None
            );
        }
        assert_eq!(rule.route(false, t0), Route::Remote);
    }

    #[test]
    fn retries_back_off_as_the_design_says() {
        let waits: Vec<u64> = (0..5)
            .map(|a| backoff_before(a).as_millis() as u64)
            .collect();
        assert_eq!(waits, [0, 10, 30, 80, 80]);
    }
}

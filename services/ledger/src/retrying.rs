//! The failure state of a background task that follows the ledger (the checkpointer, the
//! Merkle log follower): such a task retries rather than ends, since `serve` looks at its
//! result only at shutdown. Its first failure and its recovery are logged once each, and a
//! gauge (1 while failing) is what an operator alerts on.

use std::time::Duration;

use tokio::sync::watch;

use crate::error::LedgerError;

/// How long a failing task waits before it tries again.
pub(crate) const RETRY_EVERY: Duration = Duration::from_secs(1);

pub(crate) struct Retrying {
    task: &'static str,
    failing: bool,
    gauge: metrics::Gauge,
}

impl Retrying {
    /// `gauge` is the metric's name; it starts at 0.
    pub(crate) fn new(task: &'static str, gauge: &'static str) -> Self {
        let gauge = metrics::gauge!(gauge);
        gauge.set(0.0);
        Retrying {
            task,
            failing: false,
            gauge,
        }
    }

    pub(crate) fn is_failing(&self) -> bool {
        self.failing
    }

    /// A step succeeded; `events` is how far the task has read.
    pub(crate) fn succeeded(&mut self, events: u64) {
        if self.failing {
            tracing::info!(task = self.task, events, "{} caught up again", self.task);
            self.failing = false;
            self.gauge.set(0.0);
        }
    }

    pub(crate) fn failed(&mut self, error: &LedgerError) {
        if !self.failing {
            tracing::warn!(
                task = self.task,
                error = %error,
                "{} cannot read or write; retrying every second",
                self.task
            );
        }
        self.failing = true;
        self.gauge.set(1.0);
    }

    /// Waits [`RETRY_EVERY`], or less if `stop` changes.
    pub(crate) async fn wait(stop: &mut watch::Receiver<bool>) {
        tokio::select! {
            _ = tokio::time::sleep(RETRY_EVERY) => {}
            _ = stop.changed() => {}
        }
    }
}

//! The clearing request's latency budget, split by stage as the interface design splits its
//! 200 ms: the gateway (envelope open, validation, answer sealing) 30 ms, orchestration
//! (routing, rules, RAG citations) 50 ms, the batch subsystem (queue wait and worker
//! scoring, a fallback included) 100 ms, and the asynchronous trigger (the ledger commit
//! that every lineage record follows) 20 ms. Each stage's time is a histogram
//! (`aether_clearing_stage_seconds{stage}`), each time over budget a count
//! (`aether_clearing_budget_burn_total{stage}`), and the budgets themselves gauges
//! (`aether_clearing_stage_budget_seconds{stage}`), so an operator can see which stage eats
//! the budget and alert on the burn rate.

use std::time::Duration;

/// A stage of a clearing request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Gateway,
    Orchestration,
    Batch,
    Commit,
}

impl Stage {
    pub const ALL: [Stage; 4] = [
        Stage::Gateway,
        Stage::Orchestration,
        Stage::Batch,
        Stage::Commit,
    ];

    /// The `stage` label.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Gateway => "gateway",
            Stage::Orchestration => "orchestration",
            Stage::Batch => "batch",
            Stage::Commit => "commit",
        }
    }
}

/// Each stage's budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageBudgets {
    pub gateway: Duration,
    pub orchestration: Duration,
    pub batch: Duration,
    pub commit: Duration,
}

impl Default for StageBudgets {
    /// The interface design's split.
    fn default() -> Self {
        StageBudgets {
            gateway: Duration::from_millis(30),
            orchestration: Duration::from_millis(50),
            batch: Duration::from_millis(100),
            commit: Duration::from_millis(20),
        }
    }
}

impl StageBudgets {
    pub fn of(&self, stage: Stage) -> Duration {
        match stage {
            Stage::Gateway => self.gateway,
            Stage::Orchestration => self.orchestration,
            Stage::Batch => self.batch,
            Stage::Commit => self.commit,
        }
    }

    /// Publishes the budgets as gauges (once, at start).
    pub fn publish(&self) {
        for stage in Stage::ALL {
            metrics::gauge!("aether_clearing_stage_budget_seconds", "stage" => stage.name())
                .set(self.of(stage).as_secs_f64());
        }
    }

    /// Records that `stage` took `took`; counts a burn when that is over its budget.
    pub fn record(&self, stage: Stage, took: Duration) {
        metrics::histogram!("aether_clearing_stage_seconds", "stage" => stage.name())
            .record(took.as_secs_f64());
        if took > self.of(stage) {
            metrics::counter!("aether_clearing_budget_burn_total", "stage" => stage.name())
                .increment(1);
        }
    }
}

//! The rule engine: the active [`RuleSet`] behind an atomic pointer, swapped whole.

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::compile::CompiledPolicy;
use crate::error::EvaluationError;
use crate::rule_set::{Evaluation, RuleSet};

/// Holds the active rule set. Changes build a new immutable [`RuleSet`] and swap it in
/// atomically; an evaluation loads one snapshot and runs entirely against it, so an
/// evaluation in flight during a swap finishes on the set it started with, and none
/// ever sees part of one set and part of another. Evaluations take no lock and never
/// wait for a swap.
#[derive(Debug)]
pub struct RuleEngine {
    active: ArcSwap<RuleSet>,
}

impl Default for RuleEngine {
    fn default() -> Self {
        RuleEngine::new()
    }
}

impl RuleEngine {
    /// An engine with the empty rule set.
    pub fn new() -> RuleEngine {
        RuleEngine::with_rule_set(RuleSet::empty())
    }

    pub fn with_rule_set(rule_set: RuleSet) -> RuleEngine {
        RuleEngine {
            active: ArcSwap::from_pointee(rule_set),
        }
    }

    /// The active rule set now. Holding it keeps it alive and unchanged.
    pub fn snapshot(&self) -> Arc<RuleSet> {
        self.active.load_full()
    }

    /// Installs `policy`, replacing any version of the same name, and returns the set
    /// now active. Concurrent installs and removals are all applied (compare-and-swap,
    /// retried on conflict).
    pub fn install(&self, policy: impl Into<Arc<CompiledPolicy>>) -> Arc<RuleSet> {
        let policy = policy.into();
        self.update(|current| Some(current.with_policy(policy.clone())))
            .unwrap_or_else(|| self.snapshot())
    }

    /// Removes the policy named `name`, returning the set now active, or `None` (and
    /// nothing changes) when no such policy is installed.
    pub fn remove(&self, name: &str) -> Option<Arc<RuleSet>> {
        self.update(|current| current.without_policy(name))
    }

    /// Makes `rule_set` active as a whole (several policies at once, or a rollback to an
    /// earlier set) and returns the set it replaced.
    pub fn replace(&self, rule_set: impl Into<Arc<RuleSet>>) -> Arc<RuleSet> {
        self.active.swap(rule_set.into())
    }

    /// Evaluates against one snapshot; see [`RuleSet::evaluate`].
    pub fn evaluate(
        &self,
        request: &serde_json::Value,
        context: &serde_json::Value,
        hooks: &[&str],
    ) -> Result<Evaluation, EvaluationError> {
        self.active.load().evaluate(request, context, hooks)
    }

    /// Read-modify-write of the active set. `change` returns the new set, or `None` for
    /// no change; it may run more than once when another change lands in between.
    fn update(&self, mut change: impl FnMut(&RuleSet) -> Option<RuleSet>) -> Option<Arc<RuleSet>> {
        let mut installed: Option<Arc<RuleSet>> = None;
        self.active.rcu(|current| match change(current) {
            Some(next) => {
                let next = Arc::new(next);
                installed = Some(next.clone());
                next
            }
            None => {
                installed = None;
                current.clone()
            }
        });
        installed
    }
}

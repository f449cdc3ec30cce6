//! An immutable set of compiled policies, its digest, and evaluation against it.

use std::collections::BTreeMap;
use std::sync::Arc;

use aether_ledger::hashing::{Hash, hex_hash, sm3};
use serde::{Deserialize, Serialize};

use crate::compile::{CompiledPolicy, hex};
use crate::error::{EvaluationError, RuleSetError};
use crate::lazy::{Bindings, Members};
use crate::policy::{Action, Severity};
use crate::value::{MAX_INPUT_DEPTH, json_type_name};

/// The policies in force, by name: at most one version of each. Immutable; a change
/// makes a new set (see [`crate::RuleEngine`]).
#[derive(Clone, Debug)]
pub struct RuleSet {
    policies: BTreeMap<String, Arc<CompiledPolicy>>,
    digest: Hash,
}

impl Default for RuleSet {
    fn default() -> Self {
        RuleSet::empty()
    }
}

/// A rule that fired.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FiredRule {
    pub policy: String,
    pub policy_version: String,
    pub rule_id: String,
    pub action: Action,
    pub severity: Severity,
    pub cites: Vec<String>,
}

/// A rule that could not be evaluated (a missing field, a type mismatch, an overflow, a
/// result that is not a bool). It counts as `hold`: a check that could not be made is
/// never taken as passed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleError {
    pub policy: String,
    pub policy_version: String,
    pub rule_id: String,
    /// The action the rule would have asked for had it fired.
    pub action: Action,
    pub message: String,
}

/// The outcome of evaluating one request against one rule set.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Evaluation {
    /// The strictest action among the fired rules (deny > hold > allow), at least `hold`
    /// when any rule failed, `allow` when nothing fired or failed.
    pub decision: Action,
    /// Fired rules, in hook order, then document order.
    pub fired: Vec<FiredRule>,
    /// Rules that could not be evaluated, in the same order.
    pub errors: Vec<RuleError>,
    /// [`RuleSet::digest`] of the set this evaluation ran against, entirely.
    #[serde(with = "hex_hash")]
    pub rules_digest: Hash,
}

impl Evaluation {
    /// Clause ids cited by the fired rules, sorted, each once.
    pub fn cited_clauses(&self) -> Vec<&str> {
        let mut cites: Vec<&str> = self
            .fired
            .iter()
            .flat_map(|f| f.cites.iter().map(String::as_str))
            .collect();
        cites.sort_unstable();
        cites.dedup();
        cites
    }
}

impl RuleSet {
    /// The set with no policies.
    pub fn empty() -> RuleSet {
        RuleSet::from_map(BTreeMap::new())
    }

    /// A set of the given policies; two with the same name are an error.
    pub fn new(
        policies: impl IntoIterator<Item = Arc<CompiledPolicy>>,
    ) -> Result<RuleSet, RuleSetError> {
        let mut map = BTreeMap::new();
        for policy in policies {
            let name = policy.name().to_string();
            if map.insert(name.clone(), policy).is_some() {
                return Err(RuleSetError::DuplicatePolicy { name });
            }
        }
        Ok(RuleSet::from_map(map))
    }

    fn from_map(policies: BTreeMap<String, Arc<CompiledPolicy>>) -> RuleSet {
        // The RFC 8785 text of the list of {digest, name, version} sorted by name: the
        // entries are canonical already and JCS writes an array as `[` entries joined by
        // `,` `]`, so the list's canonical text is assembled without parsing them again.
        let mut text = String::from("[");
        for (i, policy) in policies.values().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(policy.rule_set_entry());
        }
        text.push(']');
        RuleSet {
            digest: sm3(text.as_bytes()),
            policies,
        }
    }

    /// This set plus `policy`, replacing any installed version of the same name.
    pub fn with_policy(&self, policy: Arc<CompiledPolicy>) -> RuleSet {
        let mut policies = self.policies.clone();
        policies.insert(policy.name().to_string(), policy);
        RuleSet::from_map(policies)
    }

    /// This set less the policy named `name`, or `None` when it has none of that name.
    pub fn without_policy(&self, name: &str) -> Option<RuleSet> {
        if !self.policies.contains_key(name) {
            return None;
        }
        let mut policies = self.policies.clone();
        policies.remove(name);
        Some(RuleSet::from_map(policies))
    }

    /// SM3 of the RFC 8785 JSON list of `{"digest": policy digest (hex), "name",
    /// "version"}`, one per policy, sorted by name. The empty set's is SM3 of `[]`.
    pub fn digest(&self) -> Hash {
        self.digest
    }

    /// [`Self::digest`] as 64 lowercase hex digits.
    pub fn digest_hex(&self) -> String {
        hex(&self.digest)
    }

    pub fn get(&self, name: &str) -> Option<&Arc<CompiledPolicy>> {
        self.policies.get(name)
    }

    /// The policies, sorted by name.
    pub fn policies(&self) -> impl Iterator<Item = &Arc<CompiledPolicy>> {
        self.policies.values()
    }

    pub fn len(&self) -> usize {
        self.policies.len()
    }

    pub fn is_empty(&self) -> bool {
        self.policies.is_empty()
    }

    /// Evaluates `request` and `context` (JSON objects; schema in the crate README) against
    /// the policies named by `hooks`, in that order, every rule of each in document order.
    ///
    /// An unknown or repeated hook, or input that is not an object, is an error and
    /// nothing is evaluated. A rule that fails at run time is reported in
    /// [`Evaluation::errors`] and makes the decision at least `hold` (fail safe).
    pub fn evaluate(
        &self,
        request: &serde_json::Value,
        context: &serde_json::Value,
        hooks: &[&str],
    ) -> Result<Evaluation, EvaluationError> {
        let request = object("request", request)?;
        let context = object("context", context)?;
        self.evaluate_members(request, context, hooks)
    }

    /// [`Self::evaluate`] with `request` and `context` given member by member: a member is
    /// produced and converted only if a rule reads it (see [`crate::lazy`]). A member that
    /// cannot be converted fails the rules that read it (counted as `hold`).
    pub fn evaluate_members(
        &self,
        request: &dyn Members,
        context: &dyn Members,
        hooks: &[&str],
    ) -> Result<Evaluation, EvaluationError> {
        let mut policies = Vec::with_capacity(hooks.len());
        for (i, hook) in hooks.iter().enumerate() {
            if hooks[..i].contains(hook) {
                return Err(EvaluationError::DuplicateHook {
                    hook: hook.to_string(),
                });
            }
            let policy = self
                .policies
                .get(*hook)
                .ok_or_else(|| EvaluationError::UnknownHook {
                    hook: hook.to_string(),
                    installed: self.installed_names(),
                })?;
            policies.push(policy);
        }
        let bindings = Bindings::new(request, context);
        let ctx = bindings.cel_context();

        let mut fired = Vec::new();
        let mut errors = Vec::new();
        let mut decision = Action::Allow;
        for policy in policies {
            for rule in policy.rules() {
                let spec = rule.spec();
                match rule.run(&ctx) {
                    Ok(false) => {}
                    Ok(true) => {
                        decision = decision.max(spec.action);
                        fired.push(FiredRule {
                            policy: policy.name().to_string(),
                            policy_version: policy.version().to_string(),
                            rule_id: spec.id.clone(),
                            action: spec.action,
                            severity: spec.severity,
                            cites: spec.cites.clone(),
                        });
                    }
                    Err(fault) => {
                        decision = decision.max(Action::Hold);
                        // A variable that could not be bound reads as "undeclared" to
                        // CEL; say what really happened.
                        let message = bindings
                            .failure()
                            .map_or_else(|| fault.to_string(), str::to_owned);
                        errors.push(RuleError {
                            policy: policy.name().to_string(),
                            policy_version: policy.version().to_string(),
                            rule_id: spec.id.clone(),
                            action: spec.action,
                            message,
                        });
                    }
                }
            }
        }
        Ok(Evaluation {
            decision,
            fired,
            errors,
            rules_digest: self.digest,
        })
    }

    fn installed_names(&self) -> String {
        if self.policies.is_empty() {
            return "none".to_string();
        }
        self.policies
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `value` as an object no deeper than [`MAX_INPUT_DEPTH`], or why not.
fn object<'v>(
    variable: &'static str,
    value: &'v serde_json::Value,
) -> Result<&'v serde_json::Map<String, serde_json::Value>, EvaluationError> {
    let Some(members) = value.as_object() else {
        return Err(EvaluationError::NotAnObject {
            variable,
            found: json_type_name(value),
        });
    };
    if !within_depth(value, 0) {
        return Err(EvaluationError::InputTooDeep {
            variable,
            max: MAX_INPUT_DEPTH,
        });
    }
    Ok(members)
}

/// Whether `value` nests no deeper than [`MAX_INPUT_DEPTH`] (as [`crate::value`] counts).
fn within_depth(value: &serde_json::Value, depth: usize) -> bool {
    if depth > MAX_INPUT_DEPTH {
        return false;
    }
    match value {
        serde_json::Value::Array(items) => items.iter().all(|v| within_depth(v, depth + 1)),
        serde_json::Value::Object(members) => members.values().all(|v| within_depth(v, depth + 1)),
        _ => true,
    }
}

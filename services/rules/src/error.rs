//! Errors: why a policy was rejected on ingest, and why an evaluation could not run.

use std::fmt;

/// A place in a rule's expression: 1-based line and column, columns counted in characters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}, column {}", self.line, self.column)
    }
}

/// Formats an optional position ("line 2, column 7", or "an unknown position" where the
/// CEL parser gave none, as it does for a few errors such as its recursion limit).
fn at(position: &Option<Position>) -> String {
    match position {
        Some(p) => p.to_string(),
        None => "an unknown position".to_string(),
    }
}

/// Why a policy document was rejected. Nothing is installed when one of these is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    #[error("cannot read policy file {path}: {message}")]
    Read { path: String, message: String },

    #[error("policy file {path} has no known format: its name must end in .json, .yaml or .yml")]
    UnknownFormat { path: String },

    #[error("policy document is not a valid JSON policy: {message}")]
    Json { message: String },

    #[error("policy document is not a valid YAML policy: {message}")]
    Yaml { message: String },

    #[error("policy name is empty")]
    EmptyName,

    #[error(
        "policy name {name:?} is invalid: use at most {max} ASCII letters, digits, '_', '-' or '.', starting with a letter or digit"
    )]
    InvalidName { name: String, max: usize },

    #[error(
        "policy {name:?}: version {version:?} is invalid: expected MAJOR.MINOR.PATCH in decimal without leading zeros, e.g. \"2.0.0\""
    )]
    InvalidVersion { name: String, version: String },

    #[error("policy {name:?} has no rules")]
    NoRules { name: String },

    #[error("policy {name:?} has {count} rules, more than the limit of {max}")]
    TooManyRules {
        name: String,
        count: usize,
        max: usize,
    },

    /// `index` is 1-based, in document order.
    #[error("policy {name:?}: rule #{index} has an empty id")]
    EmptyRuleId { name: String, index: usize },

    /// `first` and `second` are 1-based, in document order.
    #[error("policy {name:?}: rule id {rule_id:?} is used twice (rules #{first} and #{second})")]
    DuplicateRuleId {
        name: String,
        rule_id: String,
        first: usize,
        second: usize,
    },

    #[error("rule {rule_id:?}: cites an empty clause id")]
    EmptyCite { rule_id: String },

    #[error("rule {rule_id:?}: expression is empty")]
    EmptyExpression { rule_id: String },

    #[error("rule {rule_id:?}: expression is {len} bytes long, more than the limit of {max}")]
    ExpressionTooLong {
        rule_id: String,
        len: usize,
        max: usize,
    },

    /// A CEL syntax error; `position` is within the expression, not the policy file.
    #[error("rule {rule_id:?}: syntax error at {}: {message}", at(.position))]
    Syntax {
        rule_id: String,
        position: Option<Position>,
        message: String,
    },

    /// The expression names a variable other than `request` and `context` (and the
    /// variables its own macros bind, such as `t` in `context.recent.exists(t, ...)`).
    #[error(
        "rule {rule_id:?}: unknown identifier {identifier:?} at {}: expressions may only use `request` and `context`",
        at(.position)
    )]
    UnknownIdentifier {
        rule_id: String,
        identifier: String,
        position: Option<Position>,
    },

    #[error("rule {rule_id:?}: expression nests {depth} levels deep, more than the limit of {max}")]
    TooDeep {
        rule_id: String,
        depth: usize,
        max: usize,
    },

    /// The trial on the built-in sample took longer than a rule may (see
    /// `MAX_TRIAL_MILLIS`).
    #[error(
        "rule {rule_id:?}: expression took {took_ms} ms on the sample request and context, more than the limit of {max_ms} ms for one rule"
    )]
    TooSlow {
        rule_id: String,
        took_ms: u128,
        max_ms: u128,
    },

    /// The type check by trial: on the built-in sample request and context the
    /// expression returned something other than a bool.
    #[error(
        "rule {rule_id:?}: expression must evaluate to a bool, but on the sample request and context it returned {found}"
    )]
    NotBoolean { rule_id: String, found: String },

    /// The type check by trial: evaluating on the built-in sample failed, e.g. a field
    /// that the documented schema does not have, or an unknown function.
    #[error("rule {rule_id:?}: expression fails on the sample request and context: {message}")]
    TrialFailed { rule_id: String, message: String },

    /// The CEL library panicked while parsing or trying this rule. Reported, never
    /// propagated.
    #[error("rule {rule_id:?}: the CEL library crashed on this expression")]
    CompilerCrashed { rule_id: String },

    #[error("cannot compile policy: {message}")]
    CompilerUnavailable { message: String },

    #[error("policy {name:?} cannot be canonicalised for its digest: {message}")]
    Canonicalization { name: String, message: String },
}

/// Why an evaluation could not run at all. A rule that fails at run time is not one of
/// these: it is reported inside the [`crate::Evaluation`] and counts as `hold`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EvaluationError {
    #[error(
        "unknown policy hook {hook:?}: no policy of that name is installed (installed: {installed})"
    )]
    UnknownHook { hook: String, installed: String },

    #[error("policy hook {hook:?} is listed more than once")]
    DuplicateHook { hook: String },

    #[error("`{variable}` must be a JSON object, not {found}")]
    NotAnObject {
        variable: &'static str,
        found: &'static str,
    },

    #[error("`{variable}` nests deeper than {max} levels")]
    InputTooDeep { variable: &'static str, max: usize },
}

/// Why a rule set could not be assembled.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RuleSetError {
    #[error("policy {name:?} is given more than once")]
    DuplicatePolicy { name: String },
}

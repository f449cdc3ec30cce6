//! Aether's compliance rule engine: policies of CEL rules, compiled and checked on ingest,
//! digested, and hot-swapped under live evaluation.
//!
//! - [`PolicyDocument`]: a policy as written (JSON or YAML; YAML via `serde_norway`, see
//!   [`policy`]), its RFC 8785 text and SM3 [`PolicyDocument::digest`].
//! - [`CompiledPolicy`]: a policy that passed every ingest check (see [`compile`]).
//! - [`RuleSet`]: an immutable set of compiled policies, its digest, and
//!   [`RuleSet::evaluate`].
//! - [`RuleEngine`]: the active set behind an atomic pointer; `install` / `remove` /
//!   `replace` swap in a new set while evaluations in flight finish on the old one.
//!
//! This crate does no I/O except [`PolicyDocument::read`] / [`CompiledPolicy::load`],
//! which read one file. The variables a rule may use are written down in the crate's
//! README.

pub mod compile;
pub mod engine;
pub mod error;
pub mod lazy;
pub mod policy;
pub mod rule_set;
pub mod sample;
mod value;

pub use compile::{
    CompiledPolicy, CompiledRule, MAX_EXPRESSION_BYTES, MAX_EXPRESSION_DEPTH, VARIABLES,
};
pub use engine::RuleEngine;
pub use error::{EvaluationError, PolicyError, Position, RuleSetError};
pub use lazy::Members;
pub use policy::{Action, PolicyDocument, PolicyFormat, RuleSpec, Severity};
pub use rule_set::{Evaluation, FiredRule, RuleError, RuleSet};
pub use sample::{sample_context, sample_request};
pub use value::MAX_INPUT_DEPTH;

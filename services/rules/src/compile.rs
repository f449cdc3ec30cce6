//! Compiling a policy on ingest: every check that can be made before a live trade arrives.
//!
//! For each rule, in document order: the expression is parsed (a syntax error names the
//! rule, the line and column within the expression, and the parser's message); its AST is
//! walked, and any identifier other than `request`, `context`, a CEL type name (`int`,
//! `string`, ...) or a variable bound by one of its own macros is rejected, as is nesting
//! deeper than [`MAX_EXPRESSION_DEPTH`]; then it is run on the built-in sample
//! ([`crate::sample_request`], [`crate::sample_context`]) and must return a bool. That last
//! step is a type check by trial, not a type checker: a branch the sample does not reach
//! (`a || b` where `a` is true on the sample) is not tried.
//!
//! Parsing runs on a thread of its own with a large stack: the CEL parser is deeply
//! recursive (in a debug build, a few dozen nested parentheses exhaust a 2 MiB stack),
//! and a stack overflow aborts the process, which no error handling can catch. Panics in
//! the CEL library are caught and reported as [`PolicyError::CompilerCrashed`].

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};

use aether_ledger::hashing::{Hash, canonical_json};
use cel::common::ast::{EntryExpr, Expr, IdedExpr};
use cel::common::value::Val;
use cel::{Context, Env, Program, Value};

use crate::error::{PolicyError, Position};
use crate::policy::{PolicyDocument, PolicyFormat, RuleSpec};
use crate::value::{cel_type_name, to_val};

/// Longest expression accepted, in bytes.
pub const MAX_EXPRESSION_BYTES: usize = 4096;

/// Deepest expression tree accepted. Evaluation recurses once per level; this bound keeps
/// an evaluation within a 2 MiB thread stack (a Tokio worker's) even in a debug build.
pub const MAX_EXPRESSION_DEPTH: usize = 32;

/// Longest a rule may take on the built-in sample when it is compiled. A rule is evaluated
/// for every trade under the gateway's latency budget, where rules take microseconds; one
/// that takes longer on the sample (nested comprehensions, say) is refused at ingest
/// rather than met in the clearing path.
pub const MAX_TRIAL_MILLIS: u128 = 20;

/// Stack of the thread that parses and tries expressions.
const COMPILE_STACK_BYTES: usize = 64 << 20;

/// The only free variables a rule may use.
pub const VARIABLES: [&str; 2] = ["request", "context"];

/// CEL's type names, usable as values (`type(request.amount_minor) == int`).
const TYPE_NAMES: [&str; 10] = [
    "bool",
    "bytes",
    "double",
    "int",
    "list",
    "map",
    "null_type",
    "string",
    "type",
    "uint",
];

/// One rule, parsed and checked.
#[derive(Debug)]
pub struct CompiledRule {
    spec: RuleSpec,
    program: Program,
}

impl CompiledRule {
    pub fn spec(&self) -> &RuleSpec {
        &self.spec
    }

    pub fn id(&self) -> &str {
        &self.spec.id
    }

    /// Runs the rule: `Ok(true)` when it fires, `Ok(false)` when it does not, and a
    /// [`RuleFault`] when it cannot tell.
    pub(crate) fn run(&self, ctx: &Context<'_, '_>) -> Result<bool, RuleFault> {
        match catch_unwind(AssertUnwindSafe(|| self.program.execute(ctx))) {
            Ok(Ok(Value::Bool(fired))) => Ok(fired),
            Ok(Ok(other)) => Err(RuleFault::NotBool {
                found: cel_type_name(&other),
            }),
            Ok(Err(e)) => Err(RuleFault::Failed(e.to_string())),
            Err(_) => Err(RuleFault::Crashed),
        }
    }
}

/// Why a rule could not tell whether it fires.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RuleFault {
    NotBool { found: String },
    Failed(String),
    Crashed,
}

impl std::fmt::Display for RuleFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RuleFault::NotBool { found } => write!(f, "returned {found}, not a bool"),
            RuleFault::Failed(message) => f.write_str(message),
            RuleFault::Crashed => f.write_str("the CEL interpreter crashed on this rule"),
        }
    }
}

/// A policy that passed every ingest check, with its digest. Immutable; shared by rule
/// sets through `Arc`.
#[derive(Debug)]
pub struct CompiledPolicy {
    document: PolicyDocument,
    digest: Hash,
    rules: Vec<CompiledRule>,
    /// RFC 8785 text of `{"digest": hex, "name": .., "version": ..}`: this policy's entry
    /// in a rule set's digest.
    rule_set_entry: String,
}

impl CompiledPolicy {
    /// Checks and compiles a parsed document. Blocks while the expressions are parsed and
    /// tried (CPU only, no I/O).
    pub fn compile(document: PolicyDocument) -> Result<CompiledPolicy, PolicyError> {
        document.check_outline()?;
        for rule in &document.rules {
            if rule.expression.trim().is_empty() {
                return Err(PolicyError::EmptyExpression {
                    rule_id: rule.id.clone(),
                });
            }
            if rule.expression.len() > MAX_EXPRESSION_BYTES {
                return Err(PolicyError::ExpressionTooLong {
                    rule_id: rule.id.clone(),
                    len: rule.expression.len(),
                    max: MAX_EXPRESSION_BYTES,
                });
            }
        }
        let digest = document.digest()?;
        let entry = serde_json::json!({
            "digest": hex(&digest),
            "name": document.name,
            "version": document.version,
        });
        let rule_set_entry = canonical_json(&entry).map_err(|e| PolicyError::Canonicalization {
            name: document.name.clone(),
            message: e.to_string(),
        })?;

        let specs = document.rules.clone();
        let rules = std::thread::Builder::new()
            .name("aether-rules-compile".into())
            .stack_size(COMPILE_STACK_BYTES)
            .spawn(move || compile_rules(specs))
            .map_err(|e| PolicyError::CompilerUnavailable {
                message: format!("cannot start the compiler thread: {e}"),
            })?
            .join()
            .map_err(|_| PolicyError::CompilerUnavailable {
                message: "the compiler thread crashed".to_string(),
            })??;

        Ok(CompiledPolicy {
            document,
            digest,
            rules,
            rule_set_entry,
        })
    }

    /// Times every rule on the built-in sample and refuses one that takes longer than
    /// [`MAX_TRIAL_MILLIS`]. For new ingests only: a policy already on the ledger is never
    /// dropped at a restart because the machine is slow that day.
    pub fn check_cost(&self) -> Result<(), PolicyError> {
        let sample = match (
            to_val(&crate::sample::sample_request()),
            to_val(&crate::sample::sample_context()),
        ) {
            (Some(r), Some(c)) => cel_context(r, c),
            _ => {
                return Err(PolicyError::CompilerUnavailable {
                    message: "the built-in sample cannot be converted".to_string(),
                });
            }
        };
        for rule in &self.rules {
            let started = std::time::Instant::now();
            let _ = rule.run(&sample);
            let took = started.elapsed().as_millis();
            if took > MAX_TRIAL_MILLIS {
                return Err(PolicyError::TooSlow {
                    rule_id: rule.spec.id.clone(),
                    took_ms: took,
                    max_ms: MAX_TRIAL_MILLIS,
                });
            }
        }
        Ok(())
    }

    /// Parses a JSON document and compiles it.
    pub fn from_json(text: &str) -> Result<CompiledPolicy, PolicyError> {
        Self::compile(PolicyDocument::from_json(text)?)
    }

    /// Parses a YAML document and compiles it.
    pub fn from_yaml(text: &str) -> Result<CompiledPolicy, PolicyError> {
        Self::compile(PolicyDocument::from_yaml(text)?)
    }

    /// Parses a document in the given format and compiles it.
    pub fn parse(text: &str, format: PolicyFormat) -> Result<CompiledPolicy, PolicyError> {
        Self::compile(PolicyDocument::parse(text, format)?)
    }

    /// Reads a policy file (`.json`, `.yaml`, `.yml`) and compiles it.
    pub fn load(path: &Path) -> Result<CompiledPolicy, PolicyError> {
        Self::compile(PolicyDocument::read(path)?)
    }

    pub fn name(&self) -> &str {
        &self.document.name
    }

    pub fn version(&self) -> &str {
        &self.document.version
    }

    pub fn document(&self) -> &PolicyDocument {
        &self.document
    }

    pub fn rules(&self) -> &[CompiledRule] {
        &self.rules
    }

    /// SM3 of the policy's RFC 8785 JSON ([`PolicyDocument::canonical_json`]).
    pub fn digest(&self) -> Hash {
        self.digest
    }

    /// [`Self::digest`] as 64 lowercase hex digits.
    pub fn digest_hex(&self) -> String {
        hex(&self.digest)
    }

    pub(crate) fn rule_set_entry(&self) -> &str {
        &self.rule_set_entry
    }
}

/// Lowercase hex of a digest.
pub(crate) fn hex(hash: &Hash) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(hash.len() * 2);
    for b in hash {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// The standard CEL environment, built once.
pub(crate) fn cel_env() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| Arc::new(Env::stdlib())).clone()
}

/// A CEL context binding `request` and `context` to already converted values.
fn cel_context(request: Box<dyn Val>, context: Box<dyn Val>) -> Context<'static, 'static> {
    let mut ctx = Context::with_env(cel_env());
    ctx.add_variable_as_val("request", request);
    ctx.add_variable_as_val("context", context);
    ctx
}

/// Runs on the compiler thread: parse, walk, try, for every rule in order.
fn compile_rules(specs: Vec<RuleSpec>) -> Result<Vec<CompiledRule>, PolicyError> {
    let sample = match (
        to_val(&crate::sample::sample_request()),
        to_val(&crate::sample::sample_context()),
    ) {
        (Some(r), Some(c)) => cel_context(r, c),
        _ => {
            return Err(PolicyError::CompilerUnavailable {
                message: "the built-in sample cannot be converted".to_string(),
            });
        }
    };
    let mut rules = Vec::with_capacity(specs.len());
    for spec in specs {
        let program = compile_expression(&spec.id, &spec.expression)?;
        let rule = CompiledRule { spec, program };
        match rule.run(&sample) {
            Ok(_) => {}
            Err(RuleFault::NotBool { found }) => {
                return Err(PolicyError::NotBoolean {
                    rule_id: rule.spec.id.clone(),
                    found,
                });
            }
            Err(RuleFault::Crashed) => {
                return Err(PolicyError::CompilerCrashed {
                    rule_id: rule.spec.id.clone(),
                });
            }
            Err(RuleFault::Failed(message)) => {
                return Err(PolicyError::TrialFailed {
                    rule_id: rule.spec.id.clone(),
                    message,
                });
            }
        }
        rules.push(rule);
    }
    Ok(rules)
}

/// Parses one expression and checks its identifiers and depth.
fn compile_expression(rule_id: &str, source: &str) -> Result<Program, PolicyError> {
    let parsed =
        catch_unwind(|| Program::compile(source)).map_err(|_| PolicyError::CompilerCrashed {
            rule_id: rule_id.to_string(),
        })?;
    let program = parsed.map_err(|errors| {
        let first = errors.errors.first();
        PolicyError::Syntax {
            rule_id: rule_id.to_string(),
            position: first.and_then(|e| {
                let (line, column) = e.pos;
                match (usize::try_from(line), usize::try_from(column)) {
                    (Ok(line), Ok(column)) if line > 0 && column > 0 => {
                        Some(Position { line, column })
                    }
                    _ => None,
                }
            }),
            message: first
                .map(|e| e.msg.clone())
                .unwrap_or_else(|| "unknown syntax error".to_string()),
        }
    })?;
    check_tree(rule_id, &program)?;
    Ok(program)
}

/// Walks the AST (iteratively: its depth is not yet known to be small): rejects free
/// identifiers other than [`VARIABLES`] and [`TYPE_NAMES`], struct literals (their type
/// name is an identifier too), and trees deeper than [`MAX_EXPRESSION_DEPTH`].
fn check_tree(rule_id: &str, program: &Program) -> Result<(), PolicyError> {
    // (node, depth, names bound by enclosing comprehensions)
    let mut stack: Vec<(&IdedExpr, usize, Rc<Vec<&str>>)> =
        vec![(program.expression(), 1, Rc::new(Vec::new()))];
    // (byte offset, id, name) of every unknown identifier, to report the first in the source.
    let mut unknown: Vec<(u32, u64, &str)> = Vec::new();
    let mut deepest = 0;
    while let Some((node, depth, bound)) = stack.pop() {
        deepest = deepest.max(depth);
        let child = depth + 1;
        match &node.expr {
            Expr::Ident(name) => {
                let known = VARIABLES.contains(&name.as_str())
                    || TYPE_NAMES.contains(&name.as_str())
                    || bound.contains(&name.as_str());
                if !known {
                    unknown.push((offset_of(program, node.id), node.id, name));
                }
            }
            Expr::Select(select) => stack.push((&select.operand, child, bound.clone())),
            Expr::Call(call) => {
                if let Some(target) = &call.target {
                    stack.push((target, child, bound.clone()));
                }
                for arg in &call.args {
                    stack.push((arg, child, bound.clone()));
                }
            }
            Expr::List(list) => {
                for element in &list.elements {
                    stack.push((element, child, bound.clone()));
                }
            }
            Expr::Map(map) => {
                for entry in &map.entries {
                    match &entry.expr {
                        EntryExpr::MapEntry(e) => {
                            stack.push((&e.key, child, bound.clone()));
                            stack.push((&e.value, child, bound.clone()));
                        }
                        EntryExpr::StructField(f) => stack.push((&f.value, child, bound.clone())),
                    }
                }
            }
            Expr::Struct(s) => {
                unknown.push((offset_of(program, node.id), node.id, &s.type_name));
            }
            Expr::Comprehension(c) => {
                stack.push((&c.iter_range, child, bound.clone()));
                stack.push((&c.accu_init, child, bound.clone()));
                let mut in_loop = (*bound).clone();
                in_loop.push(&c.iter_var);
                if let Some(v) = &c.iter_var2 {
                    in_loop.push(v);
                }
                in_loop.push(&c.accu_var);
                let in_loop = Rc::new(in_loop);
                stack.push((&c.loop_cond, child, in_loop.clone()));
                stack.push((&c.loop_step, child, in_loop));
                let mut in_result = (*bound).clone();
                in_result.push(&c.accu_var);
                stack.push((&c.result, child, Rc::new(in_result)));
            }
            Expr::Literal(_) | Expr::Unspecified => {}
        }
    }
    if deepest > MAX_EXPRESSION_DEPTH {
        return Err(PolicyError::TooDeep {
            rule_id: rule_id.to_string(),
            depth: deepest,
            max: MAX_EXPRESSION_DEPTH,
        });
    }
    if let Some((_, id, name)) = unknown
        .into_iter()
        .min_by_key(|(offset, id, _)| (*offset, *id))
    {
        return Err(PolicyError::UnknownIdentifier {
            rule_id: rule_id.to_string(),
            identifier: name.to_string(),
            position: position_of(program, id),
        });
    }
    Ok(())
}

fn offset_of(program: &Program, id: u64) -> u32 {
    program
        .source_info()
        .offset_for(id)
        .map(|(start, _)| start)
        .unwrap_or(u32::MAX)
}

/// Line and column (1-based, columns in characters) of an AST node; the parser records
/// byte offsets.
fn position_of(program: &Program, id: u64) -> Option<Position> {
    let (start, _) = program.source_info().offset_for(id)?;
    let source = &program.source_info().source;
    let before = source.get(..usize::try_from(start).ok()?)?;
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    let column = before.get(line_start..)?.chars().count() + 1;
    Some(Position { line, column })
}

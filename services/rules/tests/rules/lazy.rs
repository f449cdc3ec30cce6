//! Members bound on demand: a member no rule reads is never produced, one read by several
//! rules is produced once, and the results equal those of the whole JSON objects.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Mutex;

use aether_rules::{Action, CompiledPolicy, Evaluation, Members, RuleSet};
use serde_json::{Value, json};

use crate::{clean_context, clean_request, document, rule, shipped_policies, with};

/// A JSON object that counts how often each member is produced.
struct Counting {
    object: serde_json::Map<String, Value>,
    produced: Mutex<BTreeMap<String, usize>>,
}

impl Counting {
    fn new(value: Value) -> Self {
        Counting {
            object: value.as_object().expect("an object").clone(),
            produced: Mutex::default(),
        }
    }

    fn times(&self, member: &str) -> usize {
        self.produced
            .lock()
            .expect("not poisoned")
            .get(member)
            .copied()
            .unwrap_or(0)
    }
}

impl Members for Counting {
    fn names(&self) -> Vec<Cow<'_, str>> {
        self.object
            .keys()
            .map(|k| Cow::Borrowed(k.as_str()))
            .collect()
    }

    fn member(&self, name: &str) -> Option<Cow<'_, Value>> {
        *self
            .produced
            .lock()
            .expect("not poisoned")
            .entry(name.to_owned())
            .or_default() += 1;
        self.object.get(name).map(Cow::Borrowed)
    }
}

fn set_of(rules: Vec<aether_rules::RuleSpec>) -> RuleSet {
    let policy = CompiledPolicy::compile(document("p", rules)).expect("compiles");
    RuleSet::new([std::sync::Arc::new(policy)]).expect("set")
}

/// `set`'s policy `p` against counted `request` and `context`.
fn evaluate(set: &RuleSet, request: &Counting, context: &Counting) -> Evaluation {
    set.evaluate_members(request, context, &["p"])
        .expect("runs")
}

/// The clean request and context of the suite, counted.
fn clean() -> (Counting, Counting) {
    (
        Counting::new(clean_request()),
        Counting::new(clean_context()),
    )
}

fn fired(e: &Evaluation) -> Vec<&str> {
    e.fired.iter().map(|f| f.rule_id.as_str()).collect()
}

#[test]
fn a_member_no_rule_reads_is_never_produced() {
    let set = set_of(vec![
        rule(
            "big",
            "request.amount_minor >= context.reporting_threshold_minor",
        ),
        rule(
            "listed",
            "request.jurisdiction in context.high_risk_jurisdictions",
        ),
    ]);
    let (request, context) = clean();
    let e = evaluate(&set, &request, &context);
    assert_eq!(e.decision, Action::Allow);
    assert_eq!(context.times("recent"), 0, "nothing reads `recent`");
    assert_eq!(context.times("limits"), 0);
    assert_eq!(context.times("reporting_threshold_minor"), 1);
    assert_eq!(request.times("buyer"), 0);
}

#[test]
fn a_member_read_by_several_rules_is_produced_once() {
    let set = set_of(vec![
        rule("some", "context.recent.size() > 0"),
        rule("large", "context.recent.exists(t, t.amount_minor > 900000)"),
        rule(
            "short",
            "request.amount_minor > 0 && context.recent.size() < 2",
        ),
    ]);
    let (request, context) = clean();
    let e = evaluate(&set, &request, &context);
    assert_eq!(fired(&e), ["some", "large"]);
    assert_eq!(context.times("recent"), 1);
    assert_eq!(request.times("amount_minor"), 1);
}

#[test]
fn a_rule_that_reads_a_variable_whole_sees_every_member() {
    let set = set_of(vec![
        rule(
            "has",
            "has(request.counterparty_jurisdiction) && has(context.limits)",
        ),
        rule(
            "index",
            "context['limits']['bank-b'] > context.exposure['bank-b']",
        ),
        rule("missing", "has(context.not_there)"),
    ]);
    let (request, context) = clean();
    let e = evaluate(&set, &request, &context);
    assert_eq!(fired(&e), ["has", "index"]);
    assert!(e.errors.is_empty(), "{:?}", e.errors);
}

#[test]
fn members_give_the_same_evaluation_as_whole_objects() {
    let (aml, basel) = shipped_policies();
    let set = RuleSet::new([aml, basel]).expect("set");
    let hooks = ["aml_v2", "basel3_delta"];
    let cases = [
        (clean_request(), clean_context()),
        (
            with(clean_request(), json!({"amount_minor": 950_000})),
            with(
                clean_context(),
                json!({"recent": [
                    {"amount_minor": 960_000, "age_seconds": 10},
                    {"amount_minor": 970_000, "age_seconds": 20},
                ]}),
            ),
        ),
        (
            with(clean_request(), json!({"jurisdiction": "XX"})),
            clean_context(),
        ),
        (
            with(clean_request(), json!({"amount_minor": "not a number"})),
            clean_context(),
        ),
    ];
    for (request, context) in cases {
        let whole = set.evaluate(&request, &context, &hooks).expect("runs");
        let lazy = set
            .evaluate_members(&Counting::new(request), &Counting::new(context), &hooks)
            .expect("runs");
        assert_eq!(lazy, whole);
    }
}

#[test]
fn a_member_that_cannot_be_bound_fails_only_the_rules_that_read_it() {
    let mut deep = json!(1);
    for _ in 0..=aether_rules::MAX_INPUT_DEPTH {
        deep = json!([deep]);
    }
    let set = set_of(vec![
        rule("deep", "size(context.limits) > 0"),
        rule("fine", "request.amount_minor > 0"),
    ]);
    let context = Counting::new(with(clean_context(), json!({ "limits": deep })));
    let e = evaluate(&set, &Counting::new(clean_request()), &context);
    assert_eq!(e.decision, Action::Hold, "a rule that cannot run holds");
    assert_eq!(fired(&e), ["fine"]);
    assert_eq!(e.errors.len(), 1);
    assert_eq!(e.errors[0].rule_id, "deep");
    assert!(
        e.errors[0].message.contains("cannot bind `context.limits`"),
        "{}",
        e.errors[0].message
    );
}

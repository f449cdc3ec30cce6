//! Decisions, fail-safe handling of rule errors, and bad calls.

use aether_rules::{Action, CompiledPolicy, EvaluationError, RuleEngine, RuleSpec, Severity};
use serde_json::json;

use crate::{clean_context, clean_request, document, rule, shipped_policies, with};

fn with_action(mut r: RuleSpec, action: Action) -> RuleSpec {
    r.action = action;
    r
}

fn engine_with(name: &str, rules: Vec<RuleSpec>) -> RuleEngine {
    let engine = RuleEngine::new();
    engine.install(CompiledPolicy::compile(document(name, rules)).expect("compiles"));
    engine
}

#[test]
fn decision_is_the_strictest_action_that_fired() {
    let always = |id: &str, action| with_action(rule(id, "request.amount_minor >= 0"), action);
    let never = |id: &str, action| with_action(rule(id, "request.amount_minor < 0"), action);
    let cases = [
        (
            vec![
                always("a", Action::Allow),
                always("h", Action::Hold),
                always("d", Action::Deny),
            ],
            Action::Deny,
        ),
        (
            vec![always("d", Action::Deny), always("a", Action::Allow)],
            Action::Deny,
        ),
        (
            vec![
                always("a", Action::Allow),
                always("h", Action::Hold),
                never("d", Action::Deny),
            ],
            Action::Hold,
        ),
        (
            vec![always("a", Action::Allow), never("h", Action::Hold)],
            Action::Allow,
        ),
        (
            vec![never("h", Action::Hold), never("d", Action::Deny)],
            Action::Allow,
        ),
    ];
    for (rules, expected) in cases {
        let ids: Vec<String> = rules.iter().map(|r| r.id.clone()).collect();
        let e = engine_with("p", rules)
            .evaluate(&clean_request(), &clean_context(), &["p"])
            .expect("runs");
        assert_eq!(e.decision, expected, "rules {ids:?}");
    }
    // An `allow` rule that fires is still reported.
    let e = engine_with("p", vec![always("a", Action::Allow)])
        .evaluate(&clean_request(), &clean_context(), &["p"])
        .expect("runs");
    assert_eq!(e.decision, Action::Allow);
    assert_eq!(e.fired.len(), 1);
}

#[test]
fn a_rule_that_fails_at_run_time_is_reported_and_holds() {
    // Passes the trial (the sample's counterparty has a limit), fails on a trade whose
    // counterparty has none.
    let mut r = rule(
        "limit-check",
        "context.limits[request.counterparty] < request.amount_minor",
    );
    r.action = Action::Deny;
    r.severity = Severity::Critical;
    let engine = engine_with("p", vec![r, rule("fires", "request.amount_minor > 0")]);
    let request = with(clean_request(), json!({ "counterparty": "bank-z" }));
    let e = engine
        .evaluate(&request, &clean_context(), &["p"])
        .expect("runs");
    assert_eq!(e.decision, Action::Hold);
    assert_eq!(e.errors.len(), 1);
    let error = &e.errors[0];
    assert_eq!(
        (error.policy.as_str(), error.rule_id.as_str()),
        ("p", "limit-check")
    );
    assert_eq!(error.policy_version, "1.0.0");
    assert_eq!(error.action, Action::Deny);
    assert!(error.message.contains("bank-z"), "{}", error.message);
    // The other rule still ran.
    assert_eq!(e.fired.len(), 1);
    assert_eq!(e.fired[0].rule_id, "fires");
}

#[test]
fn an_allow_rule_that_fails_still_holds() {
    let mut r = rule("ratio", "request.amount_minor / request.quantity > 10");
    r.action = Action::Allow;
    let engine = engine_with("p", vec![r]);
    let request = with(clean_request(), json!({ "quantity": 0 }));
    let e = engine
        .evaluate(&request, &clean_context(), &["p"])
        .expect("runs");
    assert_eq!(e.decision, Action::Hold);
    assert!(
        e.errors[0].message.to_lowercase().contains("zero"),
        "{:?}",
        e.errors
    );
}

#[test]
fn a_result_that_is_not_a_bool_at_run_time_holds() {
    // A bool on the sample, where `flag` is absent; a string on this trade.
    let engine = engine_with(
        "p",
        vec![rule("flag", "has(request.flag) ? request.flag : false")],
    );
    let request = with(clean_request(), json!({ "flag": "yes" }));
    let e = engine
        .evaluate(&request, &clean_context(), &["p"])
        .expect("runs");
    assert_eq!(e.decision, Action::Hold);
    assert!(e.errors[0].message.contains("not a bool"), "{:?}", e.errors);
    // And a real bool fires normally.
    let request = with(clean_request(), json!({ "flag": true }));
    let e = engine
        .evaluate(&request, &clean_context(), &["p"])
        .expect("runs");
    assert!(e.errors.is_empty());
    assert_eq!(e.fired.len(), 1);
}

#[test]
fn a_trade_missing_a_field_is_held_by_the_shipped_policies() {
    let (aml, basel) = shipped_policies();
    let engine = RuleEngine::new();
    engine.install(aml);
    engine.install(basel);
    let mut request = clean_request();
    request
        .as_object_mut()
        .expect("object")
        .remove("amount_minor");
    let e = engine
        .evaluate(&request, &clean_context(), &["aml_v2", "basel3_delta"])
        .expect("runs");
    assert_eq!(e.decision, Action::Hold);
    assert!(
        e.errors.iter().any(|r| r.rule_id == "reporting-threshold"),
        "{:?}",
        e.errors
    );
    assert!(
        e.errors.iter().all(|r| r.message.contains("amount_minor")),
        "{:?}",
        e.errors
    );
}

#[test]
fn unknown_or_repeated_hooks_are_errors() {
    let engine = engine_with("aml_v2", vec![rule("r", "true")]);
    let err = engine
        .evaluate(
            &clean_request(),
            &clean_context(),
            &["aml_v2", "basel3_delta"],
        )
        .expect_err("unknown hook");
    assert_eq!(
        err,
        EvaluationError::UnknownHook {
            hook: "basel3_delta".into(),
            installed: "aml_v2".into()
        }
    );
    assert!(err.to_string().contains("basel3_delta"));
    let err = engine
        .evaluate(&clean_request(), &clean_context(), &["aml_v2", "aml_v2"])
        .expect_err("repeated hook");
    assert_eq!(
        err,
        EvaluationError::DuplicateHook {
            hook: "aml_v2".into()
        }
    );
    let err = RuleEngine::new()
        .evaluate(&clean_request(), &clean_context(), &["aml_v2"])
        .expect_err("nothing installed");
    assert!(err.to_string().contains("installed: none"), "{err}");
}

#[test]
fn inputs_must_be_objects() {
    let engine = engine_with("p", vec![rule("r", "true")]);
    let err = engine
        .evaluate(&json!([1]), &clean_context(), &["p"])
        .expect_err("not an object");
    assert_eq!(
        err,
        EvaluationError::NotAnObject {
            variable: "request",
            found: "an array"
        }
    );
    let err = engine
        .evaluate(&clean_request(), &json!(null), &["p"])
        .expect_err("not an object");
    assert_eq!(
        err,
        EvaluationError::NotAnObject {
            variable: "context",
            found: "null"
        }
    );
    let mut deep = json!(1);
    for _ in 0..200 {
        deep = json!({ "x": deep });
    }
    let err = engine
        .evaluate(
            &with(clean_request(), json!({ "extra": deep })),
            &clean_context(),
            &["p"],
        )
        .expect_err("too deep");
    assert!(matches!(
        err,
        EvaluationError::InputTooDeep {
            variable: "request",
            ..
        }
    ));
}

#[test]
fn removing_a_policy_unhooks_it() {
    let engine = engine_with("p", vec![rule("r", "true")]);
    let before = engine.snapshot();
    let after = engine.remove("p").expect("was installed");
    assert!(after.is_empty());
    assert_ne!(before.digest(), after.digest());
    assert!(engine.remove("p").is_none());
    assert!(matches!(
        engine.evaluate(&clean_request(), &clean_context(), &["p"]),
        Err(EvaluationError::UnknownHook { .. })
    ));
    // The snapshot taken before still evaluates the removed policy.
    assert_eq!(
        before
            .evaluate(&clean_request(), &clean_context(), &["p"])
            .expect("runs")
            .decision,
        Action::Hold
    );
}

#[test]
fn evaluation_serialises_for_the_decision_event() {
    let engine = engine_with("p", vec![rule("r", "true")]);
    let e = engine
        .evaluate(&clean_request(), &clean_context(), &["p"])
        .expect("runs");
    let value = serde_json::to_value(&e).expect("serialises");
    assert_eq!(value["decision"], "hold");
    assert_eq!(value["fired"][0]["severity"], "low");
    assert_eq!(value["rules_digest"], engine.snapshot().digest_hex());
    let back: aether_rules::Evaluation = serde_json::from_value(value).expect("reads back");
    assert_eq!(back, e);
}

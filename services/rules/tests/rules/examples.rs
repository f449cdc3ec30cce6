//! The shipped policies, loaded from their files, on crafted trades.

use aether_rules::{Action, Evaluation, RuleEngine, Severity};
use serde_json::{Value, json};

use crate::{clean_context, clean_request, shipped_policies, with};

const HOOKS: [&str; 2] = ["aml_v2", "basel3_delta"];

fn engine() -> RuleEngine {
    let (aml, basel) = shipped_policies();
    let engine = RuleEngine::new();
    engine.install(aml);
    engine.install(basel);
    engine
}

fn evaluate(request: &Value, context: &Value) -> Evaluation {
    engine()
        .evaluate(request, context, &HOOKS)
        .expect("evaluation runs")
}

fn fired_ids(e: &Evaluation) -> Vec<String> {
    e.fired
        .iter()
        .map(|f| format!("{}/{}", f.policy, f.rule_id))
        .collect()
}

#[test]
fn shipped_policies_load_with_their_names_and_versions() {
    let (aml, basel) = shipped_policies();
    assert_eq!((aml.name(), aml.version()), ("aml_v2", "2.0.0"));
    assert_eq!((basel.name(), basel.version()), ("basel3_delta", "1.0.0"));
    assert_eq!(aml.rules().len(), 3);
    assert_eq!(basel.rules().len(), 3);
}

#[test]
fn clean_trade_is_allowed_and_nothing_fires() {
    let e = evaluate(&clean_request(), &clean_context());
    assert_eq!(e.decision, Action::Allow);
    assert!(e.fired.is_empty(), "fired: {:?}", e.fired);
    assert!(e.errors.is_empty(), "errors: {:?}", e.errors);
}

#[test]
fn trade_above_reporting_threshold_is_held_citing_the_threshold_clause() {
    for amount in [1_000_000, 1_500_000] {
        let e = evaluate(
            &with(clean_request(), json!({ "amount_minor": amount })),
            &clean_context(),
        );
        assert_eq!(e.decision, Action::Hold, "amount {amount}");
        assert_eq!(fired_ids(&e), ["aml_v2/reporting-threshold"]);
        let fired = &e.fired[0];
        assert_eq!(fired.cites, ["rep-threshold-1"]);
        assert_eq!(fired.policy_version, "2.0.0");
        assert_eq!(fired.action, Action::Hold);
        assert_eq!(fired.severity, Severity::Medium);
        assert_eq!(e.cited_clauses(), ["rep-threshold-1"]);
    }
    // One minor unit below the threshold, with no structuring history: nothing fires.
    let e = evaluate(
        &with(clean_request(), json!({ "amount_minor": 999_999 })),
        &with(clean_context(), json!({ "recent": [] })),
    );
    assert_eq!(e.decision, Action::Allow, "fired: {:?}", e.fired);
}

#[test]
fn high_risk_jurisdiction_is_held() {
    let e = evaluate(
        &with(clean_request(), json!({ "jurisdiction": "XX" })),
        &clean_context(),
    );
    assert_eq!(e.decision, Action::Hold);
    assert_eq!(fired_ids(&e), ["aml_v2/high-risk-jurisdiction"]);
    assert_eq!(e.fired[0].severity, Severity::High);
    assert_eq!(
        e.fired[0].cites,
        ["high-risk-jurisdiction-1", "cdd-enhanced-3"]
    );

    // The counterparty's jurisdiction counts too; a trade without that optional field
    // is judged on its own jurisdiction alone.
    let e = evaluate(
        &with(
            clean_request(),
            json!({ "counterparty_jurisdiction": "YY" }),
        ),
        &clean_context(),
    );
    assert_eq!(fired_ids(&e), ["aml_v2/high-risk-jurisdiction"]);
    let mut request = clean_request();
    request
        .as_object_mut()
        .expect("object")
        .remove("counterparty_jurisdiction");
    let e = evaluate(&request, &clean_context());
    assert_eq!(e.decision, Action::Allow);
    assert!(e.errors.is_empty(), "{:?}", e.errors);
}

#[test]
fn structuring_just_below_threshold_is_held() {
    let just_below = |amount: i64, age: i64| json!({ "amount_minor": amount, "age_seconds": age });
    let request = with(clean_request(), json!({ "amount_minor": 950_000 }));

    // This trade and two recent ones, all within 90-100 % of the threshold, in 24 h.
    let context = with(
        clean_context(),
        json!({ "recent": [just_below(920_000, 600), just_below(999_000, 80_000), just_below(5_000, 10)] }),
    );
    let e = evaluate(&request, &context);
    assert_eq!(e.decision, Action::Hold);
    assert_eq!(fired_ids(&e), ["aml_v2/structuring"]);
    assert_eq!(e.fired[0].cites, ["structuring-1", "rep-threshold-2"]);

    // Only one recent just-below trade within 24 h (the other is two days old): no.
    let context = with(
        clean_context(),
        json!({ "recent": [just_below(920_000, 600), just_below(999_000, 172_800)] }),
    );
    let e = evaluate(&request, &context);
    assert_eq!(e.decision, Action::Allow, "fired: {:?}", e.fired);

    // Recent trades at or above the threshold are reported anyway, not structuring.
    let context = with(
        clean_context(),
        json!({ "recent": [just_below(1_000_000, 600), just_below(2_000_000, 600)] }),
    );
    assert_eq!(evaluate(&request, &context).decision, Action::Allow);

    // A small trade after just-below ones is not itself structuring.
    let context = with(
        clean_context(),
        json!({ "recent": [just_below(920_000, 600), just_below(930_000, 700)] }),
    );
    let e = evaluate(
        &with(clean_request(), json!({ "amount_minor": 400_000 })),
        &context,
    );
    assert_eq!(e.decision, Action::Allow);
}

#[test]
fn exposure_over_limit_is_denied() {
    // 95M already out + 6M > 100M limit.
    let context = with(
        clean_context(),
        json!({ "exposure": { "bank-b": 95_000_000 } }),
    );
    let request = with(clean_request(), json!({ "amount_minor": 6_000_000 }));
    let e = evaluate(&request, &context);
    assert_eq!(e.decision, Action::Deny);
    // Also above the reporting threshold; the strictest action wins.
    assert_eq!(
        fired_ids(&e),
        [
            "aml_v2/reporting-threshold",
            "basel3_delta/exposure-over-limit"
        ]
    );
    let deny = &e.fired[1];
    assert_eq!(deny.cites, ["large-exposure-2"]);
    assert_eq!(deny.severity, Severity::Critical);
    assert_eq!(e.cited_clauses(), ["large-exposure-2", "rep-threshold-1"]);

    // Exactly at the limit is not over it (but is near it).
    let request = with(clean_request(), json!({ "amount_minor": 5_000_000 }));
    let e = evaluate(&request, &context);
    assert_ne!(e.decision, Action::Deny);
}

#[test]
fn exposure_near_limit_is_held() {
    // 85M + 6M = 91M: over 90 % of 100M, within the limit.
    let context = with(
        clean_context(),
        json!({ "exposure": { "bank-b": 85_000_000 } }),
    );
    let request = with(clean_request(), json!({ "amount_minor": 6_000_000 }));
    let e = engine()
        .evaluate(&request, &context, &["basel3_delta"])
        .expect("runs");
    assert_eq!(e.decision, Action::Hold);
    assert_eq!(fired_ids(&e), ["basel3_delta/exposure-near-limit"]);
    assert_eq!(e.fired[0].cites, ["large-exposure-3"]);

    // 85M + 4M = 89M: under 90 %.
    let request = with(clean_request(), json!({ "amount_minor": 4_000_000 }));
    let e = engine()
        .evaluate(&request, &context, &["basel3_delta"])
        .expect("runs");
    assert_eq!(e.decision, Action::Allow, "fired: {:?}", e.fired);
}

#[test]
fn counterparty_without_exposure_starts_from_zero_and_without_limit_is_held() {
    // bank-c has a 5M limit and no exposure entry: 4.6M is near, 5.1M is over.
    let near = with(
        clean_request(),
        json!({ "counterparty": "bank-c", "amount_minor": 4_600_000 }),
    );
    let e = engine()
        .evaluate(&near, &clean_context(), &["basel3_delta"])
        .expect("runs");
    assert_eq!(fired_ids(&e), ["basel3_delta/exposure-near-limit"]);
    let over = with(
        clean_request(),
        json!({ "counterparty": "bank-c", "amount_minor": 5_100_000 }),
    );
    let e = engine()
        .evaluate(&over, &clean_context(), &["basel3_delta"])
        .expect("runs");
    assert_eq!(e.decision, Action::Deny);

    let unknown = with(clean_request(), json!({ "counterparty": "bank-z" }));
    let e = engine()
        .evaluate(&unknown, &clean_context(), &["basel3_delta"])
        .expect("runs");
    assert_eq!(e.decision, Action::Hold);
    assert_eq!(fired_ids(&e), ["basel3_delta/no-limit-on-record"]);
    assert!(e.errors.is_empty(), "{:?}", e.errors);
}

#[test]
fn only_the_hooked_policies_run() {
    let request = with(clean_request(), json!({ "amount_minor": 1_500_000 }));
    let e = engine()
        .evaluate(&request, &clean_context(), &["basel3_delta"])
        .expect("runs");
    assert_eq!(e.decision, Action::Allow);
    let e = engine()
        .evaluate(&request, &clean_context(), &[])
        .expect("runs");
    assert_eq!(e.decision, Action::Allow);
    assert!(e.fired.is_empty());
}

#[test]
fn shipped_policies_read_the_same_from_json() {
    // The YAML files, re-serialised as JSON, compile to the same digest.
    let (aml, _) = shipped_policies();
    let json = serde_json::to_string_pretty(aml.document()).expect("serialises");
    let again = aether_rules::CompiledPolicy::from_json(&json).expect("compiles");
    assert_eq!(again.digest(), aml.digest());
}

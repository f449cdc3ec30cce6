//! Policy and rule-set digests: SM3 of RFC 8785 JSON, independent of the source format
//! and key order, sensitive to every rule.

use std::sync::Arc;

use aether_ledger::hashing::{canonical_json, sm3};
use aether_rules::{Action, CompiledPolicy, PolicyDocument, RuleSet, Severity};
use serde_json::json;

const YAML: &str = r#"
name: aml_v2
version: 2.0.0
description: Reporting threshold.
rules:
  - id: reporting-threshold
    expression: request.amount_minor >= context.reporting_threshold_minor
    action: hold
    severity: medium
    cites: [rep-threshold-1]
  - id: high-risk
    expression: request.jurisdiction in context.high_risk_jurisdictions
    action: deny
    severity: high
    cites:
      - hrj-1
      - hrj-2
"#;

const JSON: &str = r#"{
  "name": "aml_v2",
  "version": "2.0.0",
  "description": "Reporting threshold.",
  "rules": [
    {"id": "reporting-threshold",
     "expression": "request.amount_minor >= context.reporting_threshold_minor",
     "action": "hold", "severity": "medium", "cites": ["rep-threshold-1"]},
    {"id": "high-risk",
     "expression": "request.jurisdiction in context.high_risk_jurisdictions",
     "action": "deny", "severity": "high", "cites": ["hrj-1", "hrj-2"]}
  ]
}"#;

const JSON_REORDERED: &str = r#"{"rules": [
    {"severity": "medium", "cites": ["rep-threshold-1"], "action": "hold",
     "expression": "request.amount_minor >= context.reporting_threshold_minor",
     "id": "reporting-threshold"},
    {"cites": ["hrj-1", "hrj-2"], "severity": "high", "action": "deny",
     "expression": "request.jurisdiction in context.high_risk_jurisdictions", "id": "high-risk"}],
  "description": "Reporting threshold.", "version": "2.0.0", "name": "aml_v2"}"#;

#[test]
fn same_policy_in_json_yaml_or_any_key_order_has_one_digest() {
    let from_yaml = CompiledPolicy::from_yaml(YAML).expect("yaml");
    let from_json = CompiledPolicy::from_json(JSON).expect("json");
    let reordered = CompiledPolicy::from_json(JSON_REORDERED).expect("reordered");
    assert_eq!(from_yaml.digest(), from_json.digest());
    assert_eq!(from_yaml.digest(), reordered.digest());
    assert_eq!(from_yaml.digest_hex().len(), 64);
}

#[test]
fn digest_is_sm3_of_the_rfc8785_text_of_the_policy() {
    // Computed independently from the JSON text itself.
    let value: serde_json::Value = serde_json::from_str(JSON).expect("json");
    let expected = sm3(canonical_json(&value).expect("jcs").as_bytes());
    let policy = CompiledPolicy::from_json(JSON).expect("compiles");
    assert_eq!(policy.digest(), expected);
    assert_eq!(
        policy.document().canonical_json().expect("jcs"),
        canonical_json(&value).expect("jcs")
    );
    // `cites` left out means an empty list, as written out.
    let without = r#"{"name":"p","version":"1.0.0","rules":[{"id":"r","expression":"true","action":"hold","severity":"low"}]}"#;
    let with_empty = r#"{"name":"p","version":"1.0.0","rules":[{"id":"r","expression":"true","action":"hold","severity":"low","cites":[]}]}"#;
    assert_eq!(
        CompiledPolicy::from_json(without).expect("ok").digest(),
        CompiledPolicy::from_json(with_empty).expect("ok").digest()
    );
}

/// An edit of a policy document.
type Change = fn(&mut PolicyDocument);

#[test]
fn any_change_to_a_rule_changes_the_digest() {
    let base = PolicyDocument::from_json(JSON).expect("json");
    let digest = base.digest().expect("digest");
    let changes: Vec<(&str, Change)> = vec![
        ("name", |d| d.name = "aml_v3".into()),
        ("version", |d| d.version = "2.0.1".into()),
        ("description", |d| d.description = None),
        ("rule id", |d| d.rules[1].id = "high-risk-2".into()),
        ("expression", |d| d.rules[0].expression.push(' ')),
        ("action", |d| d.rules[1].action = Action::Hold),
        ("severity", |d| d.rules[1].severity = Severity::Critical),
        ("cite", |d| d.rules[0].cites[0] = "rep-threshold-2".into()),
        ("cite order", |d| d.rules[1].cites.reverse()),
        ("rule order", |d| d.rules.reverse()),
        ("rule removed", |d| {
            d.rules.pop();
        }),
    ];
    for (what, change) in changes {
        let mut changed = base.clone();
        change(&mut changed);
        assert_ne!(changed.digest().expect("digest"), digest, "{what}");
    }
}

#[test]
fn rule_set_digest_covers_names_versions_and_policy_digests() {
    let p = |name: &str, version: &str, expression: &str| {
        let mut d = crate::document(name, vec![crate::rule("r", expression)]);
        d.version = version.into();
        Arc::new(CompiledPolicy::compile(d).expect("compiles"))
    };
    let a = p("alpha", "1.0.0", "true");
    let b = p("beta", "2.1.0", "false");

    // Independent of the order the policies are given in.
    let ab = RuleSet::new([a.clone(), b.clone()]).expect("set");
    let ba = RuleSet::new([b.clone(), a.clone()]).expect("set");
    assert_eq!(ab.digest(), ba.digest());

    // Exactly SM3 of the RFC 8785 list of {digest, name, version} sorted by name.
    let list = json!([
        { "name": "alpha", "version": "1.0.0", "digest": a.digest_hex() },
        { "name": "beta", "version": "2.1.0", "digest": b.digest_hex() },
    ]);
    assert_eq!(
        ab.digest(),
        sm3(canonical_json(&list).expect("jcs").as_bytes())
    );
    assert_eq!(RuleSet::empty().digest(), sm3(b"[]"));

    // A new version of one policy, or a changed rule under the same version, changes it.
    let b2 = p("beta", "2.2.0", "false");
    assert_ne!(ab.with_policy(b2).digest(), ab.digest());
    let b_edited = p("beta", "2.1.0", "true");
    assert_ne!(ab.with_policy(b_edited).digest(), ab.digest());
    // Removing and re-adding gives the same digest back.
    let without = ab.without_policy("beta").expect("present");
    assert_ne!(without.digest(), ab.digest());
    assert_eq!(without.with_policy(b).digest(), ab.digest());
    assert!(ab.without_policy("gamma").is_none());

    // Two policies of one name cannot form a set.
    assert!(RuleSet::new([a.clone(), a]).is_err());
}

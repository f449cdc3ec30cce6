//! Arbitrary input never panics: documents, expressions, and evaluation of whatever
//! compiles.

use aether_rules::{CompiledPolicy, PolicyDocument, RuleEngine};
use proptest::prelude::*;

use crate::{clean_context, clean_request, document, rule};

/// Fragments of CEL, so that generated expressions get past the lexer and reach the
/// parser, the AST walk and the evaluator, not only the first error.
fn cel_soup() -> impl Strategy<Value = String> {
    let token = prop::sample::select(vec![
        "request",
        "context",
        ".",
        "amount_minor",
        "limits",
        "recent",
        "counterparty",
        "high_risk_jurisdictions",
        "[",
        "]",
        "(",
        ")",
        "{",
        "}",
        ",",
        ":",
        "?",
        "&&",
        "||",
        "!",
        "-",
        "+",
        "*",
        "/",
        "%",
        "<",
        "<=",
        ">",
        ">=",
        "==",
        "!=",
        " in ",
        "1",
        "0",
        "1u",
        "2.5",
        "-9223372036854775808",
        "9223372036854775807",
        "'EUR'",
        "b'x'",
        "true",
        "false",
        "null",
        "has(",
        "size(",
        "int(",
        "string(",
        "type(",
        ".exists(t,",
        ".all(t,",
        ".map(t,",
        ".filter(t,",
        ".exists_one(t,",
        "t",
        "x",
        "int",
        "\n",
        " ",
        "matches(",
        "'^a+$'",
        "duration('1s')",
        "timestamp('2026-01-01T00:00:00Z')",
    ]);
    prop::collection::vec(token, 0..40).prop_map(|tokens| tokens.concat())
}

fn check_expression(expression: &str) {
    if let Ok(policy) = CompiledPolicy::compile(document("p", vec![rule("r", expression)])) {
        let engine = RuleEngine::new();
        engine.install(policy);
        for (request, context) in [
            (clean_request(), clean_context()),
            (serde_json::json!({}), serde_json::json!({})),
        ] {
            let e = engine
                .evaluate(&request, &context, &["p"])
                .expect("hook exists");
            // Whatever happened, a rule either fired, did not, or is reported.
            assert!(e.fired.len() + e.errors.len() <= 1);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn any_string_as_a_json_policy(text in any::<String>()) {
        let _ = PolicyDocument::from_json(&text);
        let _ = CompiledPolicy::from_json(&text);
    }

    #[test]
    fn any_string_as_a_yaml_policy(text in any::<String>()) {
        let _ = CompiledPolicy::from_yaml(&text);
    }

    #[test]
    fn yaml_like_text_as_a_policy(text in "(name|version|rules|id|expression|action|severity|cites|hold|deny|- |: |\\n|  |\\[|\\]|\\{|\\}|'|\"|1\\.0\\.0|true|&|\\*|!|#|>|\\|)*") {
        let _ = CompiledPolicy::from_yaml(&text);
    }

    #[test]
    fn any_string_as_an_expression(expression in any::<String>()) {
        check_expression(&expression);
    }

    #[test]
    fn cel_like_text_as_an_expression(expression in cel_soup()) {
        check_expression(&expression);
    }
}

//! Compile and check on ingest: every rejection names what is wrong and where.

use aether_rules::{
    CompiledPolicy, MAX_EXPRESSION_BYTES, MAX_EXPRESSION_DEPTH, PolicyError, Position,
};

use crate::{document, rule};

fn compile_one(expression: &str) -> Result<CompiledPolicy, PolicyError> {
    CompiledPolicy::compile(document("p", vec![rule("the-rule", expression)]))
}

#[test]
fn syntax_error_names_rule_line_and_column() {
    let doc = document(
        "p",
        vec![
            rule("fine", "request.amount_minor > 0"),
            rule(
                "bad-rule",
                "request.amount_minor > 0 &&\n  request.currency = 'EUR'",
            ),
        ],
    );
    let err = CompiledPolicy::compile(doc).expect_err("syntax error");
    match &err {
        PolicyError::Syntax {
            rule_id,
            position,
            message,
        } => {
            assert_eq!(rule_id, "bad-rule");
            assert_eq!(
                *position,
                Some(Position {
                    line: 2,
                    column: 20
                })
            );
            assert!(message.contains('='), "{message}");
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains("\"bad-rule\""), "{text}");
    assert!(text.contains("line 2, column 20"), "{text}");

    // Unexpected end of input: the column just past the last character.
    let err = compile_one("request.amount_minor >").expect_err("syntax error");
    assert!(
        matches!(
            &err,
            PolicyError::Syntax {
                position: Some(Position {
                    line: 1,
                    column: 23
                }),
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn columns_count_characters_not_bytes() {
    let err = compile_one("request.member == 'é' && amount > 1").expect_err("unknown");
    assert_eq!(
        err,
        PolicyError::UnknownIdentifier {
            rule_id: "the-rule".into(),
            identifier: "amount".into(),
            position: Some(Position {
                line: 1,
                column: 26
            }),
        }
    );
}

#[test]
fn unknown_identifier_is_rejected_with_its_position() {
    let err = compile_one("amount_minor > 100").expect_err("unknown identifier");
    assert_eq!(
        err,
        PolicyError::UnknownIdentifier {
            rule_id: "the-rule".into(),
            identifier: "amount_minor".into(),
            position: Some(Position { line: 1, column: 1 }),
        }
    );
    assert!(
        err.to_string()
            .contains("may only use `request` and `context`")
    );

    let err = compile_one("request.amount_minor > 0 &&\n  request.amount_minor < limit")
        .expect_err("unknown identifier");
    assert!(
        matches!(&err, PolicyError::UnknownIdentifier { identifier, position: Some(Position { line: 2, column: 26 }), .. } if identifier == "limit"),
        "{err:?}"
    );
}

#[test]
fn macro_variables_are_bound_only_inside_their_macro() {
    assert!(compile_one("context.recent.exists(t, t.amount_minor > 0)").is_ok());
    assert!(
        compile_one(
            "context.recent.all(t, context.recent.exists(u, u.amount_minor >= t.amount_minor))"
        )
        .is_ok()
    );
    assert!(compile_one("type(request.amount_minor) == int").is_ok());
    let err = compile_one("context.recent.exists(t, t.amount_minor > 0) || t.amount_minor > 0")
        .expect_err("t is out of scope");
    assert!(
        matches!(&err, PolicyError::UnknownIdentifier { identifier, .. } if identifier == "t"),
        "{err:?}"
    );
}

#[test]
fn struct_literals_are_unknown_identifiers() {
    let err = compile_one("Trade{amount: 1} == request").expect_err("struct");
    assert!(
        matches!(&err, PolicyError::UnknownIdentifier { identifier, .. } if identifier == "Trade"),
        "{err:?}"
    );
}

#[test]
fn non_bool_rule_is_rejected() {
    let err = compile_one("request.amount_minor + 1").expect_err("not a bool");
    assert_eq!(
        err,
        PolicyError::NotBoolean {
            rule_id: "the-rule".into(),
            found: "int (1250001)".into(),
        }
    );
    for expression in [
        "request.currency",
        "context.limits",
        "context.recent",
        "null",
    ] {
        let err = compile_one(expression).expect_err(expression);
        assert!(
            matches!(err, PolicyError::NotBoolean { .. }),
            "{expression}: {err:?}"
        );
    }
}

#[test]
fn rule_failing_on_the_sample_is_rejected() {
    // A misspelt field: the documented schema has no `amount_minr`.
    let err = compile_one("request.amount_minr > 0").expect_err("typo");
    match &err {
        PolicyError::TrialFailed { rule_id, message } => {
            assert_eq!(rule_id, "the-rule");
            assert!(message.contains("amount_minr"), "{message}");
        }
        other => panic!("expected a trial failure, got {other:?}"),
    }
    // An unknown function.
    let err = compile_one("sanctioned(request.counterparty)").expect_err("unknown function");
    assert!(matches!(err, PolicyError::TrialFailed { .. }), "{err:?}");
    // A type error: string compared with int.
    let err = compile_one("request.currency > 1").expect_err("type error");
    assert!(matches!(err, PolicyError::TrialFailed { .. }), "{err:?}");
}

#[test]
fn duplicate_rule_ids_are_rejected() {
    let doc = document(
        "p",
        vec![
            rule("a", "true"),
            rule("b", "false"),
            rule("a", "request.amount_minor > 0"),
        ],
    );
    let err = CompiledPolicy::compile(doc).expect_err("duplicate");
    assert_eq!(
        err,
        PolicyError::DuplicateRuleId {
            name: "p".into(),
            rule_id: "a".into(),
            first: 1,
            second: 3,
        }
    );
    assert_eq!(
        err.to_string(),
        "policy \"p\": rule id \"a\" is used twice (rules #1 and #3)"
    );
}

#[test]
fn names_versions_and_outline_are_checked() {
    let ok = || document("aml_v2", vec![rule("r", "true")]);

    let mut d = ok();
    d.name = String::new();
    assert_eq!(
        CompiledPolicy::compile(d).unwrap_err(),
        PolicyError::EmptyName
    );

    let mut d = ok();
    d.name = "aml v2/x".into();
    assert!(matches!(
        CompiledPolicy::compile(d),
        Err(PolicyError::InvalidName { .. })
    ));

    for version in ["", "2", "2.0", "v2.0.0", "2.0.0.1", "02.0.0", "2.0.x"] {
        let mut d = ok();
        d.version = version.into();
        assert_eq!(
            CompiledPolicy::compile(d).unwrap_err(),
            PolicyError::InvalidVersion {
                name: "aml_v2".into(),
                version: version.into()
            },
            "{version:?}"
        );
    }

    let d = document("aml_v2", vec![]);
    assert_eq!(
        CompiledPolicy::compile(d).unwrap_err(),
        PolicyError::NoRules {
            name: "aml_v2".into()
        }
    );

    let d = document("aml_v2", vec![rule("r", "true"), rule(" ", "true")]);
    assert_eq!(
        CompiledPolicy::compile(d).unwrap_err(),
        PolicyError::EmptyRuleId {
            name: "aml_v2".into(),
            index: 2
        }
    );

    let d = document("aml_v2", vec![rule("r", "  ")]);
    assert_eq!(
        CompiledPolicy::compile(d).unwrap_err(),
        PolicyError::EmptyExpression {
            rule_id: "r".into()
        }
    );

    let mut r = rule("r", "true");
    r.cites.push(String::new());
    assert_eq!(
        CompiledPolicy::compile(document("aml_v2", vec![r])).unwrap_err(),
        PolicyError::EmptyCite {
            rule_id: "r".into()
        }
    );
}

#[test]
fn malformed_documents_are_rejected_with_the_parser_message() {
    // A misspelt field is not silently ignored.
    let yaml = "name: p\nversion: 1.0.0\nrules:\n  - id: r\n    expression: 'true'\n    action: hold\n    severty: low\n";
    let err = CompiledPolicy::from_yaml(yaml).expect_err("unknown field");
    assert!(
        matches!(&err, PolicyError::Yaml { message } if message.contains("severty")),
        "{err:?}"
    );
    // An action that does not exist.
    let json = r#"{"name":"p","version":"1.0.0","rules":[{"id":"r","expression":"true","action":"block","severity":"low","cites":[]}]}"#;
    let err = CompiledPolicy::from_json(json).expect_err("bad action");
    assert!(
        matches!(&err, PolicyError::Json { message } if message.contains("block") && message.contains("line 1")),
        "{err:?}"
    );
    // A version written as a bare number is read as its text, and is not MAJOR.MINOR.PATCH.
    let err = CompiledPolicy::from_yaml("name: p\nversion: 2\nrules: []\n").expect_err("number");
    assert_eq!(
        err,
        PolicyError::InvalidVersion {
            name: "p".into(),
            version: "2".into()
        }
    );
    // Not a policy at all.
    assert!(matches!(
        CompiledPolicy::from_json("[1, 2]"),
        Err(PolicyError::Json { .. })
    ));
    assert!(matches!(
        CompiledPolicy::from_yaml("- a\n- b\n"),
        Err(PolicyError::Yaml { .. })
    ));
    // Files: unknown extension, missing file.
    let err = CompiledPolicy::load(std::path::Path::new("policies/aml_v2.txt")).expect_err("ext");
    assert!(matches!(err, PolicyError::UnknownFormat { .. }), "{err:?}");
    let err =
        CompiledPolicy::load(std::path::Path::new("/nonexistent/aml.yaml")).expect_err("missing");
    assert!(matches!(err, PolicyError::Read { .. }), "{err:?}");
}

#[test]
fn expressions_over_the_limits_are_rejected() {
    let long = format!(
        "request.amount_minor > 0{}",
        " ".repeat(MAX_EXPRESSION_BYTES)
    );
    assert!(matches!(
        compile_one(&long),
        Err(PolicyError::ExpressionTooLong {
            max: MAX_EXPRESSION_BYTES,
            ..
        })
    ));

    // `>` over a chain of `+` over `request.amount_minor`: depth = chain + 3.
    let at_depth = |depth: usize| format!("request.amount_minor{} > 0", " + 1".repeat(depth - 3));
    let deepest = compile_one(&at_depth(MAX_EXPRESSION_DEPTH)).expect("at the limit");
    assert!(matches!(
        compile_one(&at_depth(MAX_EXPRESSION_DEPTH + 1)),
        Err(PolicyError::TooDeep { depth, max: MAX_EXPRESSION_DEPTH, .. }) if depth == MAX_EXPRESSION_DEPTH + 1
    ));

    // The deepest accepted rule evaluates on a 2 MiB stack (a Tokio worker's).
    let engine = aether_rules::RuleEngine::new();
    engine.install(deepest);
    let e = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || engine.evaluate(&crate::clean_request(), &crate::clean_context(), &["p"]))
        .expect("thread")
        .join()
        .expect("no stack overflow")
        .expect("runs");
    assert_eq!(e.fired.len(), 1);
}

#[test]
fn pathological_expressions_are_errors_not_crashes() {
    // Each fits the length limit; several would overflow the stack of a test thread if
    // parsed on it.
    // (shape, must it be rejected?) Repeated `!` and `-` fold away in the CEL parser and
    // `&&` chains are balanced into a shallow tree, so those may compile; everything else
    // is unbalanced or far too deep.
    let shapes: Vec<(String, bool)> = vec![
        ("(".repeat(4000), true),
        (format!("{}1{}", "(".repeat(2000), ")".repeat(2000)), true),
        ("[".repeat(4000), true),
        (format!("{}1 > 0", "-".repeat(4000)), false),
        (format!("{}true", "!".repeat(4000)), false),
        (format!("{}a", "a.".repeat(2000)), true),
        (format!("{}1", "1+".repeat(2000)), true),
        (format!("{}1", "1<".repeat(2000)), true),
        ("f(".repeat(2000), true),
        (format!("{}1", "{1:".repeat(1300)), true),
        (format!("{}1", "1?1:".repeat(1000)), true),
        (
            format!("{}1{}", "[1].map(x,".repeat(300), ")".repeat(300)),
            true,
        ),
        (
            format!("{}true", "request.amount_minor > 0 && ".repeat(140)),
            false,
        ),
    ];
    for (shape, must_fail) in shapes {
        assert!(shape.len() <= MAX_EXPRESSION_BYTES, "{}", shape.len());
        let result = compile_one(&shape);
        if must_fail {
            assert!(result.is_err(), "accepted {:.40}...", shape);
        }
    }
}

/// A rule that takes long on the sample (here three nested comprehensions over 60 items,
/// 216,000 steps) is refused at ingest with its time and the limit; an ordinary rule
/// takes microseconds.
#[test]
fn a_rule_too_slow_on_the_sample_is_rejected() {
    let list = format!(
        "[{}]",
        (0..60).map(|n| n.to_string()).collect::<Vec<_>>().join(",")
    );
    let expression = format!("{list}.all(a, {list}.all(b, {list}.all(c, a + b + c >= 0)))");
    assert!(expression.len() <= aether_rules::MAX_EXPRESSION_BYTES);
    let compiled = compile_one(&expression).expect("it compiles (and is kept at a replay)");
    match compiled.check_cost().expect_err("too slow") {
        PolicyError::TooSlow {
            rule_id,
            took_ms,
            max_ms,
        } => {
            assert_eq!(rule_id, "the-rule");
            assert!(took_ms > max_ms);
        }
        other => panic!("expected TooSlow, got {other:?}"),
    }
    compile_one("request.amount_minor >= context.reporting_threshold_minor")
        .unwrap()
        .check_cost()
        .unwrap();
}

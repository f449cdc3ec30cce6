//! Clause ids are stable; a version is the digest of the content.

use aether_ledger::hashing::sm3;
use aether_rag::{ClauseLocation, CorpusVersion, DocumentSource, RagError, example_documents};

use crate::md;

const RULES: &str = "# Example rules\n\
Preamble.\n\
\n\
## Limits\n\
1. A limit applies to every counterparty.\n\
2. A trade over the limit is refused.\n\
\n\
## Reports {#reports}\n\
1. {#report-due} Reports are due the next day.\n\
2. Late reports are flagged.\n";

fn ids(version: &CorpusVersion) -> Vec<&str> {
    version.clauses().iter().map(|c| c.id.as_str()).collect()
}

fn with_text(text: &str) -> CorpusVersion {
    CorpusVersion::build("c", [md("rules", text)]).expect("builds")
}

#[test]
fn derived_ids_follow_document_and_heading_path_and_anchors_win() {
    let version = with_text(RULES);
    assert_eq!(
        ids(&version),
        [
            "report-due",
            "reports",
            "reports/2",
            "rules",
            "rules/limits/1",
            "rules/limits/2"
        ]
    );
    let due = version.clause("report-due").expect("anchored paragraph");
    assert!(due.explicit_id);
    assert_eq!(due.text, "Reports are due the next day.");
    assert_eq!(due.number.as_deref(), Some("1"));
    assert_eq!(due.line, 9);
    // The anchor replaced the derived id; nothing answers to the derived one.
    assert!(version.clause("reports/1").is_none());
    assert!(version.clause("rules/reports/1").is_none());
    let section = version.clause("reports").expect("anchored heading");
    assert!(section.explicit_id && section.text.is_empty());
    let limit = version.clause("rules/limits/2").expect("derived");
    assert!(!limit.explicit_id);
    assert_eq!(limit.heading, "Limits");
    assert_eq!(limit.heading_path, ["Limits"]);
    assert_eq!(
        version.clause("rules").expect("preamble").heading,
        "Example rules"
    );
    assert_eq!(
        version.document("rules").expect("doc").title,
        "Example rules"
    );
}

#[test]
fn reingesting_unchanged_text_gives_the_same_ids_and_version() {
    let first = with_text(RULES);
    let again = with_text(RULES);
    assert_eq!(first.digest(), again.digest());
    assert_eq!(ids(&first), ids(&again));
    assert_eq!(first.clauses(), again.clauses());

    let a = CorpusVersion::build("sg-clearing", example_documents()).expect("builds");
    let mut reversed = example_documents();
    reversed.reverse();
    let b = CorpusVersion::build("sg-clearing", reversed).expect("builds");
    assert_eq!(a.digest(), b.digest(), "order of ingest does not matter");
}

#[test]
fn changing_one_word_gives_a_new_version_and_keeps_every_id() {
    let before = with_text(RULES);
    let after = with_text(&RULES.replace("next day", "next week"));
    assert_ne!(before.digest(), after.digest());
    assert_eq!(ids(&before), ids(&after));
    for clause in before.clauses() {
        let other = after.clause(&clause.id).expect("same ids");
        if clause.id == "report-due" {
            assert_eq!(other.text, "Reports are due the next week.");
        } else {
            assert_eq!(clause, other);
        }
    }
    // A changed heading changes the derived ids under it, and only those.
    let renamed = with_text(&RULES.replace("## Limits", "## Exposure limits"));
    assert_eq!(
        ids(&renamed),
        [
            "report-due",
            "reports",
            "reports/2",
            "rules",
            "rules/exposure-limits/1",
            "rules/exposure-limits/2"
        ]
    );
    // White space alone is a change of the document, so a new version, same clauses.
    let spaced = with_text(&format!("{RULES}\n"));
    assert_ne!(spaced.digest(), before.digest());
    assert_eq!(spaced.clauses(), before.clauses());
}

#[test]
fn the_version_is_the_sm3_of_the_canonical_form() {
    let version = with_text(RULES);
    let canonical = version.canonical_form().expect("canonical");
    assert_eq!(version.digest().as_bytes(), &sm3(canonical.as_bytes()));
    assert!(canonical.starts_with(r#"{"clauses":[{"document_id":"rules","explicit_id":true"#));
    assert!(canonical.contains(r#""corpus":"c""#));
    assert!(canonical.ends_with(r#""format":"aether.rag.corpus.v1"}"#));
    let doc = &version.documents()[0];
    assert_eq!(doc.digest, to_hex(&sm3(RULES.as_bytes())));
    assert_eq!(doc.bytes, RULES.len());
    assert_eq!(doc.clauses, 6);

    let other_name = CorpusVersion::build("d", [md("rules", RULES)]).expect("builds");
    assert_ne!(
        other_name.digest(),
        version.digest(),
        "the name is part of the version"
    );
    let other_id = CorpusVersion::build("c", [md("rules2", RULES)]).expect("builds");
    assert_ne!(other_id.digest(), version.digest());
    let text = "Preamble.\n1. One.\n";
    let as_markdown = CorpusVersion::build("c", [md("rules", text)]).expect("builds");
    let as_plain =
        CorpusVersion::build("c", [DocumentSource::plain_text("rules", text)]).expect("builds");
    assert_eq!(as_markdown.clauses(), as_plain.clauses());
    assert_ne!(
        as_markdown.digest(),
        as_plain.digest(),
        "the format is part of the version"
    );
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn duplicate_ids_name_both_places() {
    let twice = "## A\n1. {#x} one\n\n## B\n1. {#x} two\n";
    assert_eq!(
        CorpusVersion::build("c", [md("doc", twice)]).map(|v| v.digest()),
        Err(RagError::DuplicateClauseId {
            id: "x".into(),
            first: ClauseLocation {
                document_id: "doc".into(),
                line: 2
            },
            second: ClauseLocation {
                document_id: "doc".into(),
                line: 5
            },
        })
    );
    let across = CorpusVersion::build(
        "c",
        [
            md("b-doc", "1. {#shared} b\n"),
            md("a-doc", "text\n\n3. {#shared} a\n"),
        ],
    );
    let err = across.map(|v| v.digest()).expect_err("duplicate");
    assert_eq!(
        err.to_string(),
        "clause id \"shared\" is used twice: at document a-doc, line 3 and at document b-doc, line 1"
    );
    // Two headings with the same path derive the same id.
    let same_heading = "## Definitions\ntext\n## Definitions\nmore\n";
    match CorpusVersion::build("c", [md("doc", same_heading)]) {
        Err(RagError::DuplicateClauseId { id, first, second }) => {
            assert_eq!(id, "doc/definitions");
            assert_eq!((first.line, second.line), (1, 3));
        }
        other => panic!("{other:?}"),
    }
    // An anchor may not take an id that another document derives.
    let clash = CorpusVersion::build("c", [md("a", "## B\ntext\n"), md("z", "## X {#a/b}\n")]);
    assert!(
        matches!(clash, Err(RagError::BadAnchor { .. })),
        "'/' is not allowed in anchors"
    );
}

//! Arbitrary input never panics: it is ingested or refused, and what is ingested is
//! consistent.

use aether_rag::{CorpusVersion, DocumentSource};
use proptest::prelude::*;

/// Markdown-like lines that reach the parser's corners.
fn line() -> impl Strategy<Value = String> {
    prop_oneof![
        "[#]{1,7}( [a-zA-Z ]{0,12})?( \\{#[a-z0-9 #{}-]{0,6}\\}?)?( #*)?",
        "(\\(?[0-9]{1,3}(\\.[0-9]{1,2})?[.)]?)( \\{#[a-z0-9_.-]{0,5}\\}?)?( [a-z ]{0,20})?",
        "( {0,4})(```|~~~|````)[a-z`]{0,3}",
        "[ \t]{0,5}[a-zA-Z ,.]{0,30}",
        Just(String::new()),
        any::<String>(),
    ]
}

fn check(source: DocumentSource, query: &str) -> Result<(), TestCaseError> {
    let Ok(version) = CorpusVersion::build("c", [source.clone()]) else {
        return Ok(());
    };
    let again = CorpusVersion::build("c", [source]).expect("built once, builds again");
    prop_assert_eq!(version.digest(), again.digest());
    prop_assert!(!version.clauses().is_empty());
    for clause in version.clauses() {
        prop_assert_eq!(version.clause(&clause.id), Some(clause));
    }
    let ids: Vec<&str> = version.clauses().iter().map(|c| c.id.as_str()).collect();
    prop_assert_eq!(version.cited(&ids).map(|c| c.len()), Ok(ids.len()));
    let hits = version.search(query, 5);
    prop_assert!(hits.is_ok(), "{:?}", hits);
    for hit in hits.unwrap_or_default() {
        prop_assert!(version.clause(&hit.clause_id).is_some());
        for range in hit.highlights {
            prop_assert!(hit.snippet.get(range).is_some());
        }
    }
    if let Some(first) = version.clauses().first() {
        let words: String = first.text.chars().take(40).collect();
        prop_assert!(version.search(&words, 3).is_ok());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_strings_as_markdown(text in any::<String>(), query in any::<String>()) {
        check(DocumentSource::markdown("d", text.clone()), &query)?;
        check(DocumentSource::plain_text("d", text), &query)?;
    }

    #[test]
    fn markdown_like_documents(lines in prop::collection::vec(line(), 0..24), query in "[a-z ]{0,20}") {
        check(DocumentSource::markdown("d", lines.join("\n")), &query)?;
    }

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        check(DocumentSource::markdown("d", bytes), "a")?;
    }
}

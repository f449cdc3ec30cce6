//! The shipped example corpus: it loads, and every clause the example policies cite is in it.

use std::collections::BTreeSet;
use std::path::PathBuf;

use aether_rag::{CorpusVersion, DocumentSource, EXAMPLE_CORPUS_NAME, example_documents};
use serde::Deserialize;

use crate::example_version;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[derive(Deserialize)]
struct Policy {
    rules: Vec<Rule>,
}

#[derive(Deserialize)]
struct Rule {
    #[serde(default)]
    cites: Vec<String>,
}

/// Every `cites` entry of `services/rules/policies/*.yaml`, with the file it is in.
fn policy_citations() -> Vec<(String, String)> {
    let dir = crate_dir().join("../rules/policies");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no policies in {}", dir.display());
    let mut cites = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("policy file reads");
        let policy: Policy =
            serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for rule in policy.rules {
            for id in rule.cites {
                cites.push((id, file.display().to_string()));
            }
        }
    }
    cites
}

#[test]
fn example_corpus_loads_from_its_folder_and_matches_the_compiled_in_copy() {
    let from_files = DocumentSource::read_dir(&crate_dir().join("corpus")).expect("corpus reads");
    let ids: Vec<&str> = from_files.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        ids,
        ["large-exposures", "record-keeping", "threshold-reporting"]
    );
    let from_files = CorpusVersion::build(EXAMPLE_CORPUS_NAME, from_files).expect("builds");
    let compiled_in =
        CorpusVersion::build(EXAMPLE_CORPUS_NAME, example_documents()).expect("builds");
    assert_eq!(from_files.digest(), compiled_in.digest());
    assert_eq!(from_files.documents().len(), 3);
    for doc in from_files.documents() {
        assert!(
            doc.title.starts_with("Aether example rules"),
            "{}: {}",
            doc.id,
            doc.title
        );
        assert!(doc.clauses > 3, "{}", doc.id);
    }
}

#[test]
fn every_clause_cited_by_the_example_policies_exists() {
    let version = example_version();
    let cites = policy_citations();
    let distinct: BTreeSet<&str> = cites.iter().map(|(id, _)| id.as_str()).collect();
    // The policies cite at least these; an empty extraction must not pass.
    for id in [
        "rep-threshold-1",
        "rep-threshold-2",
        "structuring-1",
        "high-risk-jurisdiction-1",
        "cdd-enhanced-3",
        "large-exposure-1",
        "large-exposure-2",
        "large-exposure-3",
    ] {
        assert!(distinct.contains(id), "policies no longer cite {id}");
    }
    let missing: Vec<String> = cites
        .iter()
        .filter(|(id, _)| version.clause(id).is_none())
        .map(|(id, file)| format!("{id} (cited in {file})"))
        .collect();
    assert!(missing.is_empty(), "not in the example corpus: {missing:?}");
    let cited = version
        .cited(&distinct.iter().copied().collect::<Vec<_>>())
        .expect("all cited");
    assert_eq!(cited.len(), distinct.len());
    assert!(cited.iter().all(|c| c.explicit_id && !c.text.is_empty()));
}

#[test]
fn example_clauses_have_the_ids_the_brief_names() {
    let version = example_version();
    for (id, document) in [
        ("rep-threshold-1", "threshold-reporting"),
        ("rep-threshold-2", "threshold-reporting"),
        ("structuring-1", "threshold-reporting"),
        ("high-risk-jurisdiction-1", "threshold-reporting"),
        ("cdd-enhanced-3", "threshold-reporting"),
        ("large-exposure-1", "large-exposures"),
        ("large-exposure-2", "large-exposures"),
        ("large-exposure-3", "large-exposures"),
        ("records-retention-1", "record-keeping"),
    ] {
        let clause = version
            .clause(id)
            .unwrap_or_else(|| panic!("no clause {id}"));
        assert_eq!(clause.document_id, document, "{id}");
    }
    let enhanced = version.clause("cdd-enhanced-3").expect("present");
    assert_eq!(enhanced.number.as_deref(), Some("3"));
    assert_eq!(enhanced.heading, "Customer due diligence");
    assert!(enhanced.text.starts_with("Enhanced due diligence"));
}

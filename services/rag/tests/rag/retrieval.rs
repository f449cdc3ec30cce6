//! BM25 search, lookup by id, and cited clauses.

use aether_rag::{CorpusVersion, MAX_HITS, MAX_QUERY_BYTES, RagError, SNIPPET_CHARS};

use crate::{example_version, hit_ids, md};

#[test]
fn large_exposure_query_ranks_the_large_exposure_clauses_first() {
    let version = example_version();
    let hits = version
        .search("large exposure limit counterparty", 10)
        .expect("search runs");
    let mut top3: Vec<&str> = hits[..3].iter().map(|h| h.clause_id.as_str()).collect();
    top3.sort();
    assert_eq!(
        top3,
        ["large-exposure-1", "large-exposure-2", "large-exposure-3"]
    );
    for hit in &hits[..3] {
        assert_eq!(hit.document_id, "large-exposures");
        assert_eq!(
            hit.document_title,
            "Aether example rules: large-exposure limits"
        );
        assert_eq!(hit.heading, "Exposure limits per counterparty");
    }
    assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
    // Nothing from the other documents before every large-exposure clause.
    let first_other = hits
        .iter()
        .position(|h| h.document_id != "large-exposures")
        .unwrap_or(hits.len());
    assert!(
        first_other >= 3,
        "{:?}",
        hit_ids(&version, "large exposure limit counterparty", 10)
    );
}

#[test]
fn retain_records_finds_record_keeping() {
    let version = example_version();
    let hits = version.search("retain records", 5).expect("search runs");
    assert_eq!(hits[0].clause_id, "records-retention-1");
    assert_eq!(hits[0].document_id, "record-keeping");
    assert!(
        hits.iter().all(|h| h.document_id == "record-keeping"),
        "{hits:?}"
    );
    // Stemming: other word forms find the same clause.
    assert_eq!(
        hit_ids(&version, "RETAINING a record", 1),
        ["records-retention-1"]
    );
    assert_eq!(
        hit_ids(&version, "structuring just below the threshold", 1),
        ["structuring-1"]
    );
    assert_eq!(
        hit_ids(&version, "enhanced due diligence high-risk jurisdiction", 1),
        ["cdd-enhanced-3"]
    );
}

#[test]
fn results_are_deterministic() {
    let one = example_version();
    let two = example_version();
    for query in [
        "large exposure limit counterparty",
        "retain records",
        "trade held review",
    ] {
        let a = one.search(query, 20).expect("search runs");
        assert_eq!(a, one.search(query, 20).expect("search runs"), "{query}");
        assert_eq!(a, two.search(query, 20).expect("search runs"), "{query}");
    }
    // Equal scores come in clause-id order.
    let tied = CorpusVersion::build(
        "c",
        [md(
            "d",
            "1. {#b} same words here\n2. {#a} same words here\n3. {#c} same words here\n",
        )],
    )
    .expect("builds");
    let hits = tied.search("words", 10).expect("search runs");
    assert_eq!(
        hits.iter()
            .map(|h| h.clause_id.as_str())
            .collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
    assert!(hits.iter().all(|h| h.score == hits[0].score));
}

#[test]
fn hits_carry_a_short_snippet_with_highlights() {
    let version = example_version();
    let hits = version.search("beneficial owner", 5).expect("search runs");
    assert!(!hits.is_empty());
    for hit in &hits {
        assert!(!hit.snippet.is_empty());
        assert!(
            hit.snippet.chars().count() <= SNIPPET_CHARS + 1,
            "{}",
            hit.snippet
        );
        assert!(
            !hit.snippet.contains('\n') && !hit.snippet.contains("  "),
            "{}",
            hit.snippet
        );
        for range in &hit.highlights {
            let word = hit.snippet[range.clone()].to_lowercase();
            assert!(
                word.starts_with("beneficial") || word.starts_with("owner"),
                "{word}"
            );
        }
    }
    assert!(hits.iter().any(|h| !h.highlights.is_empty()));
    // A clause found through its heading only gets the opening of its text.
    let heading_only = version.search("measuring", 5).expect("search runs");
    assert!(!heading_only.is_empty());
    for hit in &heading_only {
        assert_eq!(hit.heading, "Measuring exposure");
        assert!(hit.highlights.is_empty());
        let clause = version.clause(&hit.clause_id).expect("exists");
        let opening: String = hit.snippet.chars().take(20).collect();
        assert!(clause.text.starts_with(&opening), "{}", hit.snippet);
    }
}

#[test]
fn odd_queries_find_nothing_or_are_refused_precisely() {
    let version = example_version();
    for query in ["", "   ", "the of and", "?!*", "\u{0}"] {
        assert_eq!(version.search(query, 5).expect("runs"), [], "{query:?}");
    }
    assert_eq!(version.search("limit", 0).expect("runs"), []);
    // Query syntax is just text.
    for query in [
        "limit AND (",
        "\"exposure",
        "title:limit",
        "limit^2 -records +",
    ] {
        assert!(
            !version.search(query, 5).expect("runs").is_empty(),
            "{query}"
        );
    }
    let all = version.search("trade member", 10_000).expect("runs");
    assert!(all.len() <= MAX_HITS);
    let long = "a".repeat(MAX_QUERY_BYTES + 1);
    assert_eq!(
        version.search(&long, 5),
        Err(RagError::QueryTooLong {
            size: MAX_QUERY_BYTES + 1,
            limit: MAX_QUERY_BYTES
        })
    );
    assert!(
        version
            .search(&"limit ".repeat(MAX_QUERY_BYTES / 6), 5)
            .is_ok()
    );
}

#[test]
fn lookup_by_id_and_cited() {
    let version = example_version();
    let clause = version.clause("large-exposure-2").expect("exists");
    assert_eq!(clause.document_id, "large-exposures");
    assert!(clause.text.contains("must not exceed the exposure limit"));
    assert!(version.clause("large-exposure-9").is_none());
    assert!(version.clause("").is_none());

    let cited = version
        .cited(&["structuring-1", "rep-threshold-2", "structuring-1"])
        .expect("known");
    let ids: Vec<&str> = cited.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(
        ids,
        ["structuring-1", "rep-threshold-2"],
        "order asked, repeats once"
    );
    assert_eq!(version.cited::<&str>(&[]).expect("nothing asked"), []);

    let err = version
        .cited(&[
            "rep-threshold-1",
            "no-such-clause",
            "large-exposure-1",
            "also-missing",
        ])
        .expect_err("unknown ids");
    match &err {
        RagError::UnknownClauses {
            corpus,
            version: v,
            ids,
        } => {
            assert_eq!(corpus, "sg-clearing");
            assert_eq!(v, &version.digest().to_hex());
            assert_eq!(ids, &["no-such-clause", "also-missing"]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "corpus sg-clearing version {} has no clause \"no-such-clause\", \"also-missing\"",
            version.digest()
        )
    );
}

#[test]
fn highlights_point_at_the_matching_words_after_white_space_is_folded() {
    let version = CorpusVersion::build(
        "c",
        [md(
            "d",
            "1. Keep   the\n   trade\trecords   for seven\n\n   years.\n2. Other text.\n",
        )],
    )
    .expect("builds");
    let hits = version.search("records years", 5).expect("runs");
    assert_eq!(hits.len(), 1);
    let hit = &hits[0];
    assert_eq!(hit.snippet, "Keep the trade records for seven years");
    let words: Vec<&str> = hit
        .highlights
        .iter()
        .map(|r| &hit.snippet[r.clone()])
        .collect();
    assert_eq!(words, ["records", "years"]);
}

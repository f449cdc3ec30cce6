//! A corpus keeps every version; the current one is swapped whole.

use std::sync::Arc;

use aether_rag::{Corpus, CorpusDigest, CorpusVersion, RagError, example_documents};

use crate::{hit_ids, md};

const V1: &str = "# Retention\n1. {#keep} Keep trade records for five years.\n";
const V2: &str = "# Retention\n1. {#keep} Keep trade records for seven years.\n";

#[test]
fn old_versions_stay_queryable_after_a_new_ingest() {
    let corpus = Corpus::new("sg-clearing").expect("corpus");
    let empty = corpus.current();
    assert!(empty.clauses().is_empty());
    assert_eq!(empty.search("records", 5).expect("runs"), []);

    let v1 = corpus.ingest([md("retention", V1)]).expect("v1");
    let pinned = corpus.pin();
    assert_eq!(pinned.digest(), v1.digest());
    let v2 = corpus.ingest([md("retention", V2)]).expect("v2");
    assert_ne!(v1.digest(), v2.digest());
    assert_eq!(corpus.current().digest(), v2.digest());
    assert_eq!(
        corpus.versions(),
        [empty.digest(), v1.digest(), v2.digest()]
    );

    let old = corpus.get(&v1.digest()).expect("v1 kept");
    assert!(
        old.clause("keep")
            .expect("clause")
            .text
            .contains("five years")
    );
    let hits = old.search("five years", 5).expect("runs");
    assert_eq!(hits[0].clause_id, "keep");
    assert!(hits[0].snippet.contains("five"));
    assert_eq!(hit_ids(&old, "seven", 5), Vec::<String>::new());
    assert_eq!(hit_ids(&corpus.current(), "seven", 5), ["keep"]);
    assert!(pinned.clause("keep").expect("clause").text.contains("five"));
    assert_eq!(corpus.search("five", 5).expect("runs"), []);

    // Ingesting the same content again gives back the version already held.
    let again = corpus.ingest([md("retention", V2)]).expect("same");
    assert!(Arc::ptr_eq(&again, &v2));
    assert_eq!(corpus.versions().len(), 3);

    // Rollback: an earlier version becomes current again.
    let back = corpus.activate(&v1.digest()).expect("known");
    assert!(Arc::ptr_eq(&back, &old));
    assert_eq!(corpus.current().digest(), v1.digest());
    let unknown = CorpusDigest::from_bytes([7; 32]);
    assert_eq!(
        corpus.activate(&unknown).map(|v| v.digest()),
        Err(RagError::UnknownVersion {
            corpus: "sg-clearing".into(),
            version: unknown.to_hex()
        })
    );
    assert_eq!(corpus.current().digest(), v1.digest());
}

#[test]
fn ingest_adds_and_replaces_documents_replace_and_remove_set_them() {
    let corpus = Corpus::new("c").expect("corpus");
    corpus.ingest(example_documents()).expect("examples");
    let with_extra = corpus.ingest([md("retention", V1)]).expect("added");
    assert_eq!(with_extra.documents().len(), 4);
    assert!(with_extra.clause("large-exposure-1").is_some());
    assert!(with_extra.clause("keep").is_some());

    let removed = corpus.remove(&["retention"]).expect("removed");
    assert_eq!(removed.documents().len(), 3);
    assert!(removed.clause("keep").is_none());
    let examples_only = CorpusVersion::build("c", example_documents()).expect("builds");
    assert_eq!(removed.digest(), examples_only.digest());

    let before = corpus.current().digest();
    assert_eq!(
        corpus.remove(&["nope"]).map(|v| v.digest()),
        Err(RagError::UnknownDocument {
            corpus: "c".into(),
            version: before.to_hex(),
            document: "nope".into()
        })
    );
    assert_eq!(corpus.current().digest(), before);

    let only = corpus.replace([md("retention", V2)]).expect("replaced");
    assert_eq!(only.documents().len(), 1);
    assert!(only.clause("large-exposure-1").is_none());
}

#[test]
fn a_failed_ingest_changes_nothing() {
    let corpus = Corpus::new("c").expect("corpus");
    let v1 = corpus.ingest([md("retention", V1)]).expect("v1");
    let bad = corpus.ingest([md("other", "ok text\n"), md("broken", "## X {#Bad}\n")]);
    assert!(matches!(bad, Err(RagError::BadAnchor { .. })));
    // A clause id clashing with one already in the corpus is refused too.
    let clash = corpus.ingest([md("other", "1. {#keep} again\n")]);
    assert!(matches!(clash, Err(RagError::DuplicateClauseId { .. })));
    assert_eq!(corpus.current().digest(), v1.digest());
    assert_eq!(corpus.versions().len(), 2);
}

#[test]
fn digests_print_parse_and_serialise_as_hex() {
    let version = CorpusVersion::build("c", [md("d", V1)]).expect("builds");
    let digest = version.digest();
    let hex = digest.to_string();
    assert_eq!(hex.len(), 64);
    assert_eq!(hex, hex.to_lowercase());
    assert_eq!(hex.parse::<CorpusDigest>().expect("parses"), digest);
    assert_eq!(
        hex.to_uppercase().parse::<CorpusDigest>().expect("parses"),
        digest
    );
    let json = serde_json::to_string(&digest).expect("serialises");
    assert_eq!(json, format!("\"{hex}\""));
    assert_eq!(
        serde_json::from_str::<CorpusDigest>(&json).expect("parses"),
        digest
    );
    for bad in ["", "00", &"g".repeat(64), &"0".repeat(65)] {
        assert!(
            matches!(
                bad.parse::<CorpusDigest>(),
                Err(RagError::InvalidDigest { .. })
            ),
            "{bad:?}"
        );
    }
    assert!(serde_json::from_str::<CorpusDigest>("\"xyz\"").is_err());
}

#[test]
fn readers_see_whole_versions_while_ingests_run() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Corpus>();
    assert_send_sync::<CorpusVersion>();

    let corpus = Arc::new(Corpus::new("c").expect("corpus"));
    corpus.ingest([md("retention", V1)]).expect("v1");
    let reader = {
        let corpus = corpus.clone();
        std::thread::spawn(move || {
            for _ in 0..200 {
                let version = corpus.current();
                let hits = version.search("years", 5).expect("runs");
                assert_eq!(hits.len(), 1);
                let text = &version
                    .clause(&hits[0].clause_id)
                    .expect("same version")
                    .text;
                assert!(text.contains("five") || text.contains("seven"));
                assert!(corpus.get(&version.digest()).is_some());
            }
        })
    };
    for i in 0..6 {
        let text = if i % 2 == 0 { V2 } else { V1 };
        corpus.ingest([md("retention", text)]).expect("ingest");
    }
    reader.join().expect("reader did not panic");
    assert_eq!(corpus.versions().len(), 3);
}

//! Integration tests of `aether-rag`, in one binary (one link on a small machine).

mod bad_input;
mod example_corpus;
mod never_panics;
mod retrieval;
mod stable_ids;
mod versions;

use aether_rag::{CorpusVersion, DocumentSource, example_documents};

/// The example corpus as one version.
pub fn example_version() -> CorpusVersion {
    CorpusVersion::build("sg-clearing", example_documents()).expect("example corpus builds")
}

/// The ids of hits, best first.
pub fn hit_ids(version: &CorpusVersion, query: &str, limit: usize) -> Vec<String> {
    version
        .search(query, limit)
        .expect("search runs")
        .into_iter()
        .map(|h| h.clause_id)
        .collect()
}

pub fn md(id: &str, text: &str) -> DocumentSource {
    DocumentSource::markdown(id, text.as_bytes().to_vec())
}

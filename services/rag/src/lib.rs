//! Aether's versioned regulatory corpus and retrieval.
//!
//! Documents (Markdown or plain text) are split into clauses with stable ids; a
//! [`CorpusVersion`] is an immutable set of documents and clauses whose version is the SM3
//! of its canonical form; a [`Corpus`] keeps every version by digest and swaps the current
//! one atomically. Each version has its own in-memory BM25 index (tantivy) for full-text
//! search, plus exact lookup by clause id and [`CorpusVersion::cited`] for the clauses a
//! decision cites.
//!
//! No I/O apart from [`DocumentSource::read`] / [`DocumentSource::read_dir`], which read
//! files. The rules for clauses and the canonical form are in this crate's README.
//!
//! ```
//! use aether_rag::{Corpus, example_documents};
//!
//! let corpus = Corpus::new("sg-clearing")?;
//! let version = corpus.ingest(example_documents())?;
//! let hits = version.search("large exposure limit counterparty", 3)?;
//! assert!(hits[0].clause_id.starts_with("large-exposure"));
//! let cited = version.cited(&["rep-threshold-1", "large-exposure-2"])?;
//! assert_eq!(cited.len(), 2);
//! assert_eq!(corpus.get(&version.digest()).map(|v| v.digest()), Some(version.digest()));
//! # Ok::<(), aether_rag::RagError>(())
//! ```

mod corpus;
mod document;
mod error;
mod ids;
mod index;
mod parse;
mod version;

pub use corpus::Corpus;
pub use document::{
    Clause, Document, DocumentFormat, DocumentSource, EXAMPLE_CORPUS_NAME, MAX_DOCUMENT_BYTES,
    example_documents,
};
pub use error::{ClauseLocation, RagError};
pub use ids::{MAX_NAME_BYTES, validate_corpus_name, validate_document_id};
pub use index::SNIPPET_CHARS;
pub use version::{
    CORPUS_FORMAT, CorpusDigest, CorpusVersion, MAX_HITS, MAX_QUERY_BYTES, SearchHit,
};

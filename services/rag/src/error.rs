//! Why an ingest, a lookup or a search was refused. Nothing changes when one of these is
//! returned: a corpus keeps the version it had.

use std::fmt;

use serde::Serialize;

/// Where a clause starts: its document and 1-based line.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct ClauseLocation {
    pub document_id: String,
    pub line: usize,
}

impl fmt::Display for ClauseLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "document {}, line {}", self.document_id, self.line)
    }
}

/// Errors of this crate.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RagError {
    #[error("corpus name is empty")]
    EmptyCorpusName,

    #[error("corpus name {name:?} is invalid: {reason}")]
    InvalidCorpusName { name: String, reason: String },

    #[error("document id {id:?} is invalid: {reason}")]
    InvalidDocumentId { id: String, reason: String },

    #[error("a version of corpus {found:?} cannot become a version of corpus {corpus:?}")]
    WrongCorpus { corpus: String, found: String },

    #[error("document {document} is empty: it has no text")]
    EmptyDocument { document: String },

    #[error("document {document} is {size} bytes, more than the limit of {limit} bytes")]
    DocumentTooLarge {
        document: String,
        size: usize,
        limit: usize,
    },

    #[error(
        "document {document} is not valid UTF-8: bad byte sequence at byte {offset} (line {line})"
    )]
    InvalidUtf8 {
        document: String,
        offset: usize,
        line: usize,
    },

    #[error("document {document}, line {line}: bad anchor {anchor:?}: {reason}")]
    BadAnchor {
        document: String,
        line: usize,
        anchor: String,
        reason: String,
    },

    #[error("document {document} has no clauses: it has headings but no text and no anchors")]
    NoClauses { document: String },

    #[error("clause id {id:?} is used twice: at {first} and at {second}")]
    DuplicateClauseId {
        id: String,
        first: ClauseLocation,
        second: ClauseLocation,
    },

    #[error("document {document} is given more than once in one ingest")]
    DuplicateDocument { document: String },

    #[error("corpus {corpus} version {version} has no document {document}")]
    UnknownDocument {
        corpus: String,
        version: String,
        document: String,
    },

    #[error("corpus {corpus} has no version {version}")]
    UnknownVersion { corpus: String, version: String },

    #[error("corpus {corpus} version {version} has no clause {}", quoted(ids))]
    UnknownClauses {
        corpus: String,
        version: String,
        /// Every requested id that is not in the version, in the order asked.
        ids: Vec<String>,
    },

    #[error("{text:?} is not a corpus version: {reason}")]
    InvalidDigest { text: String, reason: String },

    #[error("query is {size} bytes, more than the limit of {limit} bytes")]
    QueryTooLong { size: usize, limit: usize },

    #[error("cannot read {path}: {message}")]
    Read { path: String, message: String },

    #[error("{path} is not a corpus document: its name must end in .md, .markdown or .txt")]
    UnsupportedFile { path: String },

    /// The search library failed while building or searching an in-memory index. Not
    /// expected; reported rather than turned into a panic.
    #[error("search index: {message}")]
    Index { message: String },

    #[error("canonical form of the corpus: {message}")]
    Canonical { message: String },
}

fn quoted(ids: &[String]) -> String {
    ids.iter()
        .map(|id| format!("{id:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl From<tantivy::TantivyError> for RagError {
    fn from(e: tantivy::TantivyError) -> Self {
        RagError::Index {
            message: e.to_string(),
        }
    }
}

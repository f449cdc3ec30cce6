//! `CorpusVersion`: an immutable set of documents and clauses, its SM3 digest, and its
//! search index.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use aether_ledger::hashing::{canonical_json, sm3};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::document::{Clause, Document, DocumentSource, IngestedDocument, ingest_document};
use crate::error::{ClauseLocation, RagError};
use crate::ids::validate_corpus_name;
use crate::index::{ClauseIndex, heading_text};

/// The `format` member of the canonical form; it changes if the form ever does.
pub const CORPUS_FORMAT: &str = "aether.rag.corpus.v1";

/// Longest query accepted, in bytes.
pub const MAX_QUERY_BYTES: usize = 4096;

/// Most hits one search returns; a larger `limit` is lowered to this.
pub const MAX_HITS: usize = 100;

/// A corpus version: the SM3 digest of the corpus's canonical form. Written as 64
/// lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CorpusDigest([u8; 32]);

impl CorpusDigest {
    pub fn from_bytes(bytes: [u8; 32]) -> CorpusDigest {
        CorpusDigest(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for CorpusDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for CorpusDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CorpusDigest({})", self.to_hex())
    }
}

impl FromStr for CorpusDigest {
    type Err = RagError;

    /// 64 hex digits (either case).
    fn from_str(s: &str) -> Result<CorpusDigest, RagError> {
        let invalid = |reason: String| RagError::InvalidDigest {
            text: s.chars().take(80).collect(),
            reason,
        };
        if s.len() != 64 {
            return Err(invalid(format!(
                "it is {} bytes long; a version is 64 hex digits",
                s.len()
            )));
        }
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(s, &mut bytes).map_err(|e| invalid(e.to_string()))?;
        Ok(CorpusDigest(bytes))
    }
}

impl Serialize for CorpusDigest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for CorpusDigest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<CorpusDigest, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// One search result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchHit {
    pub clause_id: String,
    pub document_id: String,
    pub document_title: String,
    /// The clause's innermost heading (the document title for a preamble).
    pub heading: String,
    /// BM25 score; higher is better.
    pub score: f32,
    /// Up to 160 characters of the clause text around the matching words, on one line.
    pub snippet: String,
    /// Byte ranges of matching words in `snippet`.
    pub highlights: Vec<Range<usize>>,
}

/// The canonical form that a version's digest is the SM3 of (as RFC 8785 text).
#[derive(Serialize)]
struct CanonicalCorpus<'a> {
    format: &'static str,
    corpus: &'a str,
    documents: &'a [Document],
    clauses: &'a [Clause],
}

/// An immutable version of a corpus: its documents (by id), their clauses (by id), its
/// digest, and its own in-memory search index. Changes make a new version; this one
/// stays as it is for as long as anyone holds it.
pub struct CorpusVersion {
    name: String,
    digest: CorpusDigest,
    /// Sorted by id.
    documents: Vec<Document>,
    /// Sorted by id.
    clauses: Vec<Clause>,
    by_id: HashMap<String, usize>,
    index: ClauseIndex,
}

impl fmt::Debug for CorpusVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CorpusVersion")
            .field("name", &self.name)
            .field("digest", &self.digest)
            .field("documents", &self.documents.len())
            .field("clauses", &self.clauses.len())
            .finish_non_exhaustive()
    }
}

impl CorpusVersion {
    /// The version of corpus `name` with no documents.
    pub fn empty(name: &str) -> Result<CorpusVersion, RagError> {
        CorpusVersion::build(name, Vec::new())
    }

    /// The version of corpus `name` holding exactly `sources`.
    pub fn build(
        name: &str,
        sources: impl IntoIterator<Item = DocumentSource>,
    ) -> Result<CorpusVersion, RagError> {
        validate_corpus_name(name)?;
        CorpusVersion::assemble(name, ingest_all(sources)?)
    }

    /// A new version: this one with `sources` added, replacing documents of the same id.
    pub fn with_documents(
        &self,
        sources: impl IntoIterator<Item = DocumentSource>,
    ) -> Result<CorpusVersion, RagError> {
        let mut documents = self.ingested();
        documents.extend(ingest_all(sources)?);
        CorpusVersion::assemble(&self.name, documents)
    }

    /// A new version: this one without the documents `ids`, each of which must exist.
    pub fn without_documents<S: AsRef<str>>(&self, ids: &[S]) -> Result<CorpusVersion, RagError> {
        let mut documents = self.ingested();
        for id in ids {
            let id = id.as_ref();
            if documents.remove(id).is_none() {
                return Err(RagError::UnknownDocument {
                    corpus: self.name.clone(),
                    version: self.digest.to_hex(),
                    document: id.to_string(),
                });
            }
        }
        CorpusVersion::assemble(&self.name, documents)
    }

    /// The documents with their clauses, as they were ingested.
    fn ingested(&self) -> BTreeMap<String, IngestedDocument> {
        let mut out: BTreeMap<String, IngestedDocument> = self
            .documents
            .iter()
            .map(|d| {
                (
                    d.id.clone(),
                    IngestedDocument {
                        document: d.clone(),
                        clauses: Vec::with_capacity(d.clauses),
                    },
                )
            })
            .collect();
        for clause in &self.clauses {
            if let Some(doc) = out.get_mut(&clause.document_id) {
                doc.clauses.push(clause.clone());
            }
        }
        for doc in out.values_mut() {
            doc.clauses.sort_by_key(|c| c.line);
        }
        out
    }

    fn assemble(
        name: &str,
        documents: BTreeMap<String, IngestedDocument>,
    ) -> Result<CorpusVersion, RagError> {
        let mut seen: HashMap<&str, ClauseLocation> = HashMap::new();
        for doc in documents.values() {
            for clause in &doc.clauses {
                let here = ClauseLocation {
                    document_id: clause.document_id.clone(),
                    line: clause.line,
                };
                if let Some(first) = seen.insert(&clause.id, here.clone()) {
                    return Err(RagError::DuplicateClauseId {
                        id: clause.id.clone(),
                        first,
                        second: here,
                    });
                }
            }
        }
        drop(seen);
        let mut docs = Vec::with_capacity(documents.len());
        let mut clauses = Vec::new();
        for (_, doc) in documents {
            docs.push(doc.document);
            clauses.extend(doc.clauses);
        }
        clauses.sort_by(|a, b| a.id.cmp(&b.id));

        let digest = CorpusDigest(sm3(canonical_text(name, &docs, &clauses)?.as_bytes()));
        let titles: HashMap<&str, &str> = docs
            .iter()
            .map(|d| (d.id.as_str(), d.title.as_str()))
            .collect();
        let index = ClauseIndex::build(clauses.iter().map(|c| {
            let title = titles.get(c.document_id.as_str()).copied().unwrap_or("");
            (c, heading_text(title, c))
        }))?;
        let by_id = clauses
            .iter()
            .enumerate()
            .map(|(i, c)| (c.id.clone(), i))
            .collect();
        Ok(CorpusVersion {
            name: name.to_string(),
            digest,
            documents: docs,
            clauses,
            by_id,
            index,
        })
    }

    /// The corpus's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The version: SM3 of [`CorpusVersion::canonical_form`].
    pub fn digest(&self) -> CorpusDigest {
        self.digest
    }

    /// The RFC 8785 text whose SM3 is the digest: `{"clauses": [...], "corpus": name,
    /// "documents": [...], "format": "aether.rag.corpus.v1"}`, documents and clauses
    /// sorted by id, each with every field of [`Document`] / [`Clause`].
    pub fn canonical_form(&self) -> Result<String, RagError> {
        canonical_text(&self.name, &self.documents, &self.clauses)
    }

    /// Documents, sorted by id.
    pub fn documents(&self) -> &[Document] {
        &self.documents
    }

    pub fn document(&self, id: &str) -> Option<&Document> {
        self.documents
            .binary_search_by(|d| d.id.as_str().cmp(id))
            .ok()
            .map(|i| &self.documents[i])
    }

    /// Clauses of all documents, sorted by id.
    pub fn clauses(&self) -> &[Clause] {
        &self.clauses
    }

    /// The clause with this id.
    pub fn clause(&self, id: &str) -> Option<&Clause> {
        self.by_id.get(id).map(|i| &self.clauses[*i])
    }

    /// The clauses a decision cites, in the order asked (a repeated id once). Every id
    /// must exist: otherwise the error lists each unknown id, and nothing is returned.
    pub fn cited<S: AsRef<str>>(&self, ids: &[S]) -> Result<Vec<Clause>, RagError> {
        let mut seen = HashSet::new();
        let mut found = Vec::with_capacity(ids.len());
        let mut unknown = Vec::new();
        for id in ids {
            let id = id.as_ref();
            if !seen.insert(id) {
                continue;
            }
            match self.clause(id) {
                Some(clause) => found.push(clause.clone()),
                None => unknown.push(id.to_string()),
            }
        }
        if unknown.is_empty() {
            Ok(found)
        } else {
            Err(RagError::UnknownClauses {
                corpus: self.name.clone(),
                version: self.digest.to_hex(),
                ids: unknown,
            })
        }
    }

    /// BM25 full-text search over clause text and headings: at most `limit` hits (at most
    /// [`MAX_HITS`]), best first, equal scores in clause-id order. A query with no
    /// searchable word (empty, only punctuation or common words) finds nothing.
    pub fn search(&self, query: &str, limit: usize) -> Result<Vec<SearchHit>, RagError> {
        if query.len() > MAX_QUERY_BYTES {
            return Err(RagError::QueryTooLong {
                size: query.len(),
                limit: MAX_QUERY_BYTES,
            });
        }
        let found = self.index.search(query, limit.min(MAX_HITS), |i| {
            self.clauses.get(i).map(|c| c.text.as_str())
        })?;
        let mut hits = Vec::with_capacity(found.len());
        for hit in found {
            let Some(clause) = self.clauses.get(hit.ordinal) else {
                continue; // The index checked every ordinal against the clause list.
            };
            hits.push(SearchHit {
                clause_id: clause.id.clone(),
                document_id: clause.document_id.clone(),
                document_title: self
                    .document(&clause.document_id)
                    .map(|d| d.title.clone())
                    .unwrap_or_default(),
                heading: clause.heading.clone(),
                score: hit.score,
                snippet: hit.snippet,
                highlights: hit.highlights,
            });
        }
        hits.sort_by(|a, b| {
            b.score
                .total_cmp(&a.score)
                .then_with(|| a.clause_id.cmp(&b.clause_id))
        });
        Ok(hits)
    }
}

fn ingest_all(
    sources: impl IntoIterator<Item = DocumentSource>,
) -> Result<BTreeMap<String, IngestedDocument>, RagError> {
    let mut out = BTreeMap::new();
    for source in sources {
        if out.contains_key(&source.id) {
            return Err(RagError::DuplicateDocument {
                document: source.id,
            });
        }
        let doc = ingest_document(&source)?;
        out.insert(source.id, doc);
    }
    Ok(out)
}

fn canonical_text(
    name: &str,
    documents: &[Document],
    clauses: &[Clause],
) -> Result<String, RagError> {
    let value = serde_json::to_value(CanonicalCorpus {
        format: CORPUS_FORMAT,
        corpus: name,
        documents,
        clauses,
    })
    .map_err(|e| RagError::Canonical {
        message: e.to_string(),
    })?;
    canonical_json(&value).map_err(|e| RagError::Canonical {
        message: e.to_string(),
    })
}

//! Regulatory corpora as events: `CorpusIngested` on stream `corpus/{name}`, one event per
//! new version, carrying the documents added (their full text) and the resulting version
//! digest, so every version can be rebuilt from the ledger and checked against the digest
//! it was recorded with. Refused ingests are recorded as `CorpusIngestRejected` on
//! `corpus-rejections`. A new version becomes current only after its event commits.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use aether_ledger::{
    Committed, EventFilter, EventStore, ExpectedVersion, LedgerError, NewEvent, RecordedEvent,
};
use aether_rag::{Corpus, CorpusVersion, DocumentFormat, DocumentSource, RagError};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::origin::Origin;
use crate::replay::{After, Pages};

/// Event type of a new corpus version.
pub const CORPUS_INGESTED: &str = "CorpusIngested";
/// Event type of a refused corpus ingest.
pub const CORPUS_INGEST_REJECTED: &str = "CorpusIngestRejected";
/// Stream of refused corpus ingests.
pub const CORPUS_REJECTIONS_STREAM: &str = "corpus-rejections";

/// The stream of one corpus's versions.
pub fn corpus_stream(name: &str) -> String {
    format!("corpus/{name}")
}

/// One document in an ingest request.
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentInput {
    pub id: String,
    /// `markdown` (default) or `text`.
    #[serde(default)]
    pub format: DocumentKind,
    pub text: String,
}

/// Document formats accepted over the API.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DocumentKind {
    #[default]
    Markdown,
    Text,
}

impl DocumentInput {
    fn source(&self) -> DocumentSource {
        match self.format {
            DocumentKind::Markdown => DocumentSource::markdown(&self.id, self.text.as_bytes()),
            DocumentKind::Text => DocumentSource::plain_text(&self.id, self.text.as_bytes()),
        }
    }

    fn from_source(source: &DocumentSource) -> Option<DocumentInput> {
        Some(DocumentInput {
            id: source.id.clone(),
            format: match source.format {
                DocumentFormat::Markdown => DocumentKind::Markdown,
                _ => DocumentKind::Text,
            },
            text: String::from_utf8(source.bytes.clone()).ok()?,
        })
    }
}

/// An ingest request: documents added to (`replace: false`, the default) or making up
/// (`replace: true`) the corpus's next version.
#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CorpusIngest {
    pub name: String,
    pub documents: Vec<DocumentInput>,
    #[serde(default)]
    pub replace: bool,
}

impl CorpusIngest {
    /// A request adding `sources` (read from files, say) to corpus `name`.
    pub fn from_sources(name: &str, sources: &[DocumentSource]) -> Option<CorpusIngest> {
        Some(CorpusIngest {
            name: name.to_owned(),
            documents: sources
                .iter()
                .map(DocumentInput::from_source)
                .collect::<Option<_>>()?,
            replace: false,
        })
    }
}

/// One version of a corpus, as the projection keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CorpusRecord {
    pub name: String,
    pub version: String,
    pub previous: Option<String>,
    pub documents: Vec<String>,
    pub clauses: usize,
    pub seq: u64,
    pub stream_version: u64,
    pub recorded_at: String,
}

/// Why an ingest was refused. Every variant except `Ledger` has been recorded as a
/// `CorpusIngestRejected` event.
#[derive(Debug, thiserror::Error)]
pub enum CorpusError {
    #[error(transparent)]
    Invalid(RagError),
    #[error("the ingest holds no documents")]
    NoDocuments,
    #[error("corpus {name:?} changed while this ingest ran (now at version {actual}); retry")]
    Conflict { name: String, actual: u64 },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

#[derive(Default)]
struct Projection {
    corpora: BTreeMap<String, Arc<Corpus>>,
    versions: BTreeMap<String, Vec<CorpusRecord>>,
}

/// Corpora on the ledger, each with every version it has had.
#[derive(Clone)]
pub struct CorpusRegistry {
    store: EventStore,
    projection: Arc<RwLock<Projection>>,
    /// Serialises ingests so a version is built on the one the ledger holds last.
    ingests: Arc<tokio::sync::Mutex<()>>,
}

impl CorpusRegistry {
    /// Rebuilds every corpus from its `CorpusIngested` events, in seq order.
    pub async fn load(store: EventStore) -> Result<Self, LedgerError> {
        Self::load_until(store, None).await
    }

    /// [`Self::load`] from the events with seq ≤ `upto_seq` only.
    pub(crate) async fn load_until(
        store: EventStore,
        upto_seq: Option<u64>,
    ) -> Result<Self, LedgerError> {
        let registry = CorpusRegistry {
            store,
            projection: Arc::default(),
            ingests: Arc::default(),
        };
        let filter = EventFilter {
            event_type: Some(CORPUS_INGESTED.into()),
            stream_prefix: Some("corpus/".into()),
            max_seq: upto_seq,
            ..EventFilter::default()
        };
        let mut pages = Pages::new(&registry.store, &filter);
        while let Some(page) = pages.next().await? {
            for event in &page {
                if let Err(e) = registry.apply(event).await {
                    // A recorded version that cannot be rebuilt must not vanish silently.
                    tracing::error!(seq = event.seq, error = %e, "stored corpus version cannot be rebuilt");
                }
            }
        }
        Ok(registry)
    }

    /// The live corpus `name`.
    pub fn corpus(&self, name: &str) -> Option<Arc<Corpus>> {
        self.projection
            .read()
            .ok()
            .and_then(|p| p.corpora.get(name).cloned())
    }

    /// Every corpus with its versions, oldest first.
    pub fn corpora(&self) -> BTreeMap<String, Vec<CorpusRecord>> {
        self.projection
            .read()
            .map(|p| p.versions.clone())
            .unwrap_or_default()
    }

    /// Current version digest per corpus: what a snapshot pins for RAG.
    pub fn current_versions(&self) -> BTreeMap<String, String> {
        self.projection
            .read()
            .map(|p| {
                p.corpora
                    .iter()
                    .map(|(n, c)| (n.clone(), c.current().digest().to_hex()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// What a follower of this registry reads: every `CorpusIngested`.
    pub(crate) fn following(&self) -> After {
        After::new(EventFilter {
            event_type: Some(CORPUS_INGESTED.into()),
            stream_prefix: Some("corpus/".into()),
            ..EventFilter::default()
        })
    }

    /// Applies the next new `CorpusIngested` events that this node has not installed
    /// (ingested through another node of the cluster).
    pub(crate) async fn follow_step(&self, after: &mut After) -> Result<(), LedgerError> {
        while let Some(page) = after.next(&self.store).await? {
            for event in &page {
                let known = self
                    .projection
                    .read()
                    .map(|p| p.versions.values().flatten().any(|r| r.seq == event.seq))
                    .unwrap_or(true);
                if known {
                    continue;
                }
                match self.apply(event).await {
                    Ok(()) => tracing::info!(
                        seq = event.seq,
                        "applied a corpus version ingested through another node"
                    ),
                    Err(e) => {
                        tracing::error!(seq = event.seq, error = %e, "a corpus version on the ledger cannot be rebuilt")
                    }
                }
            }
        }
        Ok(())
    }

    async fn apply(&self, event: &RecordedEvent) -> Result<(), String> {
        #[derive(Deserialize)]
        struct Payload {
            name: String,
            version: String,
            #[serde(default)]
            replace: bool,
            documents: Vec<DocumentInput>,
            #[serde(default)]
            previous: Option<String>,
        }
        let payload: Payload = event
            .payload_value()
            .and_then(serde_json::from_value)
            .map_err(|e| format!("malformed payload: {e}"))?;
        // Built on the version it was built on live, which after a rollback is not the
        // newest one.
        let corpus = self.corpus(&payload.name);
        let recorded = payload
            .previous
            .as_deref()
            .and_then(|p| p.parse().ok())
            .and_then(|d| corpus.as_ref().and_then(|c| c.get(&d)));
        let base = recorded.or_else(|| corpus.map(|c| c.current()));
        let next = build(&payload.name, base, payload.documents, payload.replace)
            .await
            .map_err(|e| e.to_string())?;
        if next.digest().to_hex() != payload.version {
            return Err(format!(
                "rebuilt version {} differs from the recorded {}",
                next.digest().to_hex(),
                payload.version
            ));
        }
        self.install(next, event.seq, event.stream_version, event.recorded_at)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn install(
        &self,
        next: CorpusVersion,
        seq: u64,
        stream_version: u64,
        recorded_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<CorpusRecord, RagError> {
        let name = next.name().to_owned();
        let mut p = self
            .projection
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Installed already (a node following the ledger may meet its own ingest).
        if let Some(done) = p
            .versions
            .get(&name)
            .and_then(|v| v.iter().find(|r| r.seq == seq))
        {
            return Ok(done.clone());
        }
        let previous = p.corpora.get(&name).map(|c| c.current().digest().to_hex());
        let corpus = match p.corpora.get(&name) {
            Some(c) => {
                c.adopt(next)?;
                c.clone()
            }
            None => Arc::new(Corpus::with_version(next)),
        };
        let current = corpus.current();
        let record = CorpusRecord {
            name: name.clone(),
            version: current.digest().to_hex(),
            previous,
            documents: current.documents().iter().map(|d| d.id.clone()).collect(),
            clauses: current.clauses().len(),
            seq,
            stream_version,
            recorded_at: aether_ledger::hashing::format_timestamp(&recorded_at),
        };
        p.corpora.insert(name.clone(), corpus);
        p.versions.entry(name).or_default().push(record.clone());
        Ok(record)
    }

    /// Ingests documents as the corpus's next version. The `CorpusIngested` event commits
    /// first, then the version becomes current; ingesting content that changes nothing
    /// returns the current version and writes nothing. Refusals are recorded.
    pub async fn ingest(
        &self,
        request: CorpusIngest,
        origin: &Origin,
    ) -> Result<(CorpusRecord, Option<Committed>), CorpusError> {
        let _one_at_a_time = self.ingests.lock().await;
        if request.documents.is_empty() {
            let err = CorpusError::NoDocuments;
            self.reject(&request, &err.to_string(), origin).await?;
            return Err(err);
        }
        let base = self.corpus(&request.name).map(|c| c.current());
        let next = match build(
            &request.name,
            base.clone(),
            request.documents.clone(),
            request.replace,
        )
        .await
        {
            Ok(v) => v,
            Err(e) => {
                self.reject(&request, &e.to_string(), origin).await?;
                return Err(CorpusError::Invalid(e));
            }
        };
        let existing = self
            .corpora()
            .get(&request.name)
            .cloned()
            .unwrap_or_default();
        if let (Some(base), Some(last)) = (&base, existing.last())
            && base.digest() == next.digest()
        {
            return Ok((last.clone(), None));
        }
        let event = NewEvent::new(
            CORPUS_INGESTED,
            json!({
                "name": request.name,
                "version": next.digest().to_hex(),
                "previous": base.as_ref().map(|b| b.digest().to_hex()),
                "replace": request.replace,
                "documents": request.documents,
                "clauses": next.clauses().len(),
            }),
        )
        .with_metadata(origin.metadata(json!({})));
        let expected = ExpectedVersion::Exact(existing.last().map_or(0, |r| r.stream_version));
        let committed = match self
            .store
            .append(&corpus_stream(&request.name), expected, vec![event])
            .await
        {
            Ok(mut c) => c.remove(0),
            Err(LedgerError::WrongExpectedVersion { actual, .. }) => {
                return Err(CorpusError::Conflict {
                    name: request.name,
                    actual,
                });
            }
            Err(e) => return Err(e.into()),
        };
        let record = self
            .install(
                next,
                committed.seq,
                committed.stream_version,
                committed.recorded_at,
            )
            .map_err(CorpusError::Invalid)?;
        Ok((record, Some(committed)))
    }

    async fn reject(
        &self,
        request: &CorpusIngest,
        reason: &str,
        origin: &Origin,
    ) -> Result<(), LedgerError> {
        // What was tried, bounded: the ids and sizes, not the whole text.
        let tried: Vec<_> = request
            .documents
            .iter()
            .take(100)
            .map(|d| json!({ "id": d.id.chars().take(200).collect::<String>(), "bytes": d.text.len() }))
            .collect();
        let event = NewEvent::new(
            CORPUS_INGEST_REJECTED,
            json!({
                "name": request.name.chars().take(200).collect::<String>(),
                "reason": reason,
                "documents": tried,
            }),
        )
        .with_metadata(origin.metadata(json!({})));
        self.store
            .append(CORPUS_REJECTIONS_STREAM, ExpectedVersion::Any, vec![event])
            .await
            .map(|_| ())
    }
}

/// Builds the next version (parsing and indexing) on a blocking thread.
async fn build(
    name: &str,
    base: Option<Arc<CorpusVersion>>,
    documents: Vec<DocumentInput>,
    replace: bool,
) -> Result<CorpusVersion, RagError> {
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || {
        let sources = documents.iter().map(DocumentInput::source);
        match base {
            Some(base) if !replace => base.with_documents(sources),
            _ => CorpusVersion::build(&name, sources),
        }
    })
    .await
    .unwrap_or_else(|e| {
        Err(RagError::InvalidCorpusName {
            name: String::new(),
            reason: format!("the indexing task failed: {e}"),
        })
    })
}

//! `Corpus`: a named corpus's versions, and which one is current.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use arc_swap::ArcSwap;

use crate::document::DocumentSource;
use crate::error::RagError;
use crate::version::{CorpusDigest, CorpusVersion, SearchHit};

/// A named corpus in memory: every version it has had, addressable by digest, and the
/// current one behind an atomic pointer.
///
/// Readers never wait: [`Corpus::current`] is one atomic load, and a version once
/// obtained is immutable, so a search, a lookup or a snapshot that holds it sees one
/// version throughout, whatever is ingested meanwhile. Changes (ingest, replace, remove,
/// activate) are serialised among themselves, build the new version outside any lock
/// readers take, then swap it in. A failed change leaves the corpus as it was. Versions
/// are kept for the corpus's lifetime, so a pinned digest always resolves.
pub struct Corpus {
    name: String,
    current: ArcSwap<CorpusVersion>,
    versions: RwLock<Versions>,
    changes: Mutex<()>,
}

#[derive(Default)]
struct Versions {
    by_digest: HashMap<CorpusDigest, Arc<CorpusVersion>>,
    /// Digests in the order they were first made current.
    order: Vec<CorpusDigest>,
}

impl std::fmt::Debug for Corpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corpus")
            .field("name", &self.name)
            .field("current", &self.current.load().digest())
            .field("versions", &self.versions().len())
            .finish()
    }
}

impl Corpus {
    /// A corpus whose current version is empty.
    pub fn new(name: &str) -> Result<Corpus, RagError> {
        Ok(Corpus::with_version(CorpusVersion::empty(name)?))
    }

    /// A corpus whose first and current version is `version`.
    pub fn with_version(version: CorpusVersion) -> Corpus {
        let version = Arc::new(version);
        let digest = version.digest();
        Corpus {
            name: version.name().to_string(),
            current: ArcSwap::new(version.clone()),
            versions: RwLock::new(Versions {
                by_digest: HashMap::from([(digest, version)]),
                order: vec![digest],
            }),
            changes: Mutex::new(()),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The current version.
    pub fn current(&self) -> Arc<CorpusVersion> {
        self.current.load_full()
    }

    /// The current version, for a snapshot to record: its digest is what the snapshot
    /// names, and [`Corpus::get`] resolves that digest for as long as the corpus lives.
    pub fn pin(&self) -> Arc<CorpusVersion> {
        self.current()
    }

    /// The version with this digest, current or not.
    pub fn get(&self, version: &CorpusDigest) -> Option<Arc<CorpusVersion>> {
        self.read_versions().by_digest.get(version).cloned()
    }

    /// Every version's digest, in the order each first became current.
    pub fn versions(&self) -> Vec<CorpusDigest> {
        self.read_versions().order.clone()
    }

    /// Adds `sources` to the current version (replacing documents of the same id) and
    /// makes the result current. Ingesting unchanged content gives back the same version.
    pub fn ingest(
        &self,
        sources: impl IntoIterator<Item = DocumentSource>,
    ) -> Result<Arc<CorpusVersion>, RagError> {
        let _change = self.changes.lock().unwrap_or_else(PoisonError::into_inner);
        let next = self.current().with_documents(sources)?;
        Ok(self.install(next))
    }

    /// Makes a version holding exactly `sources` current.
    pub fn replace(
        &self,
        sources: impl IntoIterator<Item = DocumentSource>,
    ) -> Result<Arc<CorpusVersion>, RagError> {
        let _change = self.changes.lock().unwrap_or_else(PoisonError::into_inner);
        let next = CorpusVersion::build(&self.name, sources)?;
        Ok(self.install(next))
    }

    /// Removes documents (each must exist) and makes the result current.
    pub fn remove<S: AsRef<str>>(&self, ids: &[S]) -> Result<Arc<CorpusVersion>, RagError> {
        let _change = self.changes.lock().unwrap_or_else(PoisonError::into_inner);
        let next = self.current().without_documents(ids)?;
        Ok(self.install(next))
    }

    /// Makes `next`, built elsewhere from [`Corpus::current`], current: for callers that
    /// must record the change (a ledger event) after building it and before readers see it.
    pub fn adopt(&self, next: CorpusVersion) -> Result<Arc<CorpusVersion>, RagError> {
        if next.name() != self.name {
            return Err(RagError::WrongCorpus {
                corpus: self.name.clone(),
                found: next.name().to_string(),
            });
        }
        let _change = self.changes.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(self.install(next))
    }

    /// Makes an earlier version current again (a rollback to a snapshot).
    pub fn activate(&self, version: &CorpusDigest) -> Result<Arc<CorpusVersion>, RagError> {
        let _change = self.changes.lock().unwrap_or_else(PoisonError::into_inner);
        let found = self.get(version).ok_or_else(|| RagError::UnknownVersion {
            corpus: self.name.clone(),
            version: version.to_hex(),
        })?;
        self.current.store(found.clone());
        Ok(found)
    }

    /// Searches the current version; see [`CorpusVersion::search`].
    pub fn search(&self, query: &str, limit: usize) -> Result<Vec<SearchHit>, RagError> {
        self.current.load().search(query, limit)
    }

    /// Records `next` (or the equal version already held) and makes it current.
    fn install(&self, next: CorpusVersion) -> Arc<CorpusVersion> {
        let digest = next.digest();
        let version = {
            let mut versions = self
                .versions
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            match versions.by_digest.get(&digest) {
                Some(existing) => existing.clone(),
                None => {
                    let next = Arc::new(next);
                    versions.by_digest.insert(digest, next.clone());
                    versions.order.push(digest);
                    next
                }
            }
        };
        self.current.store(version.clone());
        version
    }

    fn read_versions(&self) -> std::sync::RwLockReadGuard<'_, Versions> {
        self.versions.read().unwrap_or_else(PoisonError::into_inner)
    }
}

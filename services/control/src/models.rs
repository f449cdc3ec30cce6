//! The model registry: `ModelRegistered` on `model/{ref}` (artifact URI, SM3 digest, feature
//! schema). A registration is checked against the artifact when it is a local file, and a
//! ref is registered once: an identical repeat changes nothing, a different one is refused.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use aether_ledger::hashing::hex_hash;
use aether_ledger::{
    Committed, EventFilter, EventStore, ExpectedVersion, LedgerError, NewEvent, RecordedEvent,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::origin::Origin;
use crate::replay::{After, Pages};

/// Event type of a registration.
pub const MODEL_REGISTERED: &str = "ModelRegistered";

/// A model artifact as registered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// `name@region`, e.g. `finmoe-7b-v3@sgp-region`.
    #[serde(rename = "ref")]
    pub model_ref: String,
    /// Where the artifact is: a local path or a `file://` URI (others are recorded as given).
    pub uri: String,
    /// SM3 of the artifact's bytes, 64 lowercase hex digits.
    pub digest: String,
    /// The features the model expects, as a JSON object (name → type).
    #[schema(value_type = Object)]
    pub feature_schema: serde_json::Map<String, serde_json::Value>,
}

/// Why a registration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model ref {0:?} must look like name@region (letters, digits, '.', '_', '-')")]
    BadRef(String),
    #[error("digest must be 64 lowercase hex digits (SM3), got {0:?}")]
    BadDigest(String),
    #[error("feature_schema must name at least one feature")]
    EmptySchema,
    #[error("artifact {uri} cannot be read: {reason}")]
    Unreadable { uri: String, reason: String },
    #[error(
        "artifact {uri} is outside the model directories ({dirs}); put it in one, or start the service with --model-dir naming its directory"
    )]
    OutsideModelDirs { uri: String, dirs: String },
    #[error("artifact {uri} has SM3 digest {actual}, not the registered {expected}")]
    DigestMismatch {
        uri: String,
        expected: String,
        actual: String,
    },
    #[error("model {0:?} is already registered with a different artifact or schema")]
    AlreadyRegistered(String),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

impl ModelError {
    /// True for errors in the request rather than in the ledger.
    pub fn is_input_error(&self) -> bool {
        !matches!(
            self,
            ModelError::Ledger(_) | ModelError::AlreadyRegistered(_)
        )
    }
}

/// Checks a `name@region` ref; returns the region.
pub fn region_of(model_ref: &str) -> Result<&str, ModelError> {
    let ok_part = |s: &str| {
        !s.is_empty()
            && s.len() <= 100
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    };
    match model_ref.split_once('@') {
        Some((name, region)) if ok_part(name) && ok_part(region) => Ok(region),
        _ => Err(ModelError::BadRef(model_ref.to_owned())),
    }
}

/// The local file an artifact URI names, if it names one.
pub fn local_path(uri: &str) -> Option<std::path::PathBuf> {
    if let Some(path) = uri.strip_prefix("file://") {
        return Some(path.into());
    }
    (!uri.contains("://")).then(|| uri.into())
}

/// Where local model artifacts may be read from, and how large they may be. Without it a
/// registration could make the service read (and answer the digest of) any file it can
/// read, or read `/dev/zero` for ever.
#[derive(Clone, Debug)]
pub struct ArtifactPolicy {
    /// Directories artifacts must be inside (after resolving links); empty: none is local.
    pub dirs: Vec<std::path::PathBuf>,
    /// Largest artifact read, in bytes.
    pub max_bytes: u64,
}

impl ArtifactPolicy {
    /// Default largest artifact: 4 GiB.
    pub const DEFAULT_MAX_BYTES: u64 = 4 << 30;

    /// Any local file (library use and tests of this crate); `aether serve` always names
    /// its directories.
    pub fn anywhere() -> ArtifactPolicy {
        ArtifactPolicy {
            dirs: vec![std::path::PathBuf::from("/")],
            max_bytes: Self::DEFAULT_MAX_BYTES,
        }
    }

    /// The file `uri` names, if it is a regular file inside one of the directories.
    fn admit(&self, uri: &str, path: &std::path::Path) -> Result<std::path::PathBuf, ModelError> {
        let refuse = |reason: String| ModelError::Unreadable {
            uri: uri.to_owned(),
            reason,
        };
        let resolved = std::fs::canonicalize(path).map_err(|e| refuse(e.to_string()))?;
        let inside = self
            .dirs
            .iter()
            .any(|dir| std::fs::canonicalize(dir).is_ok_and(|dir| resolved.starts_with(dir)));
        if !inside {
            return Err(ModelError::OutsideModelDirs {
                uri: uri.to_owned(),
                dirs: self
                    .dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        let meta = std::fs::metadata(&resolved).map_err(|e| refuse(e.to_string()))?;
        if !meta.is_file() {
            return Err(refuse("it is not a regular file".into()));
        }
        if meta.len() > self.max_bytes {
            return Err(refuse(format!(
                "it is {} bytes, over the limit of {} (--max-model-bytes)",
                meta.len(),
                self.max_bytes
            )));
        }
        Ok(resolved)
    }
}

/// SM3 of a file, read in chunks: at most `max_bytes` (a file that grows past it fails).
fn file_digest(path: &std::path::Path, max_bytes: u64) -> std::io::Result<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hasher = <sm3::Sm3 as sm3::Digest>::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > max_bytes {
            return Err(std::io::Error::other(format!(
                "it grew past the limit of {max_bytes} bytes while being read"
            )));
        }
        sm3::Digest::update(&mut hasher, &buffer[..n]);
    }
    Ok(hex::encode(sm3::Digest::finalize(hasher)))
}

/// Reads a local artifact and checks its SM3 digest, under `policy`.
pub async fn check_artifact(
    uri: &str,
    digest: &str,
    policy: &ArtifactPolicy,
) -> Result<(), ModelError> {
    let Some(path) = local_path(uri) else {
        return Ok(()); // remote artifacts are checked by the workers that fetch them
    };
    let path = policy.admit(uri, &path)?;
    let max = policy.max_bytes;
    let actual = tokio::task::spawn_blocking(move || file_digest(&path, max))
        .await
        .map_err(|e| ModelError::Unreadable {
            uri: uri.to_owned(),
            reason: e.to_string(),
        })?
        .map_err(|e| ModelError::Unreadable {
            uri: uri.to_owned(),
            reason: e.to_string(),
        })?;
    if actual != digest {
        return Err(ModelError::DigestMismatch {
            uri: uri.to_owned(),
            expected: digest.to_owned(),
            actual,
        });
    }
    Ok(())
}

/// Registered models, rebuilt from the ledger.
#[derive(Clone)]
pub struct ModelRegistry {
    store: EventStore,
    models: Arc<RwLock<BTreeMap<String, ModelSpec>>>,
    artifacts: Arc<RwLock<ArtifactPolicy>>,
}

impl ModelRegistry {
    pub async fn load(store: EventStore) -> Result<Self, LedgerError> {
        Self::load_until(store, None).await
    }

    /// [`Self::load`] from the events with seq ≤ `upto_seq` only.
    pub(crate) async fn load_until(
        store: EventStore,
        upto_seq: Option<u64>,
    ) -> Result<Self, LedgerError> {
        let registry = ModelRegistry {
            store,
            models: Arc::default(),
            artifacts: Arc::new(RwLock::new(ArtifactPolicy::anywhere())),
        };
        let filter = EventFilter {
            event_type: Some(MODEL_REGISTERED.into()),
            stream_prefix: Some("model/".into()),
            max_seq: upto_seq,
            ..EventFilter::default()
        };
        let mut pages = Pages::new(&registry.store, &filter);
        while let Some(page) = pages.next().await? {
            page.iter().for_each(|e| registry.apply(e));
        }
        Ok(registry)
    }

    /// What a follower of this registry reads: every `ModelRegistered`.
    pub(crate) fn following(&self) -> After {
        After::new(EventFilter {
            event_type: Some(MODEL_REGISTERED.into()),
            stream_prefix: Some("model/".into()),
            ..EventFilter::default()
        })
    }

    /// Applies the next new `ModelRegistered` events (registered through another node of
    /// the cluster; applying a known one again changes nothing).
    pub(crate) async fn follow_step(&self, after: &mut After) -> Result<(), LedgerError> {
        while let Some(page) = after.next(&self.store).await? {
            page.iter().for_each(|e| self.apply(e));
        }
        Ok(())
    }

    /// Where local artifacts may be read from from now on (registration and activation).
    pub fn set_artifact_policy(&self, policy: ArtifactPolicy) {
        if let Ok(mut p) = self.artifacts.write() {
            *p = policy;
        }
    }

    /// The policy in force.
    pub fn artifact_policy(&self) -> ArtifactPolicy {
        self.artifacts
            .read()
            .map(|p| p.clone())
            .unwrap_or_else(|_| ArtifactPolicy {
                dirs: Vec::new(),
                max_bytes: 0,
            })
    }

    fn apply(&self, event: &RecordedEvent) {
        if let Ok(spec) = serde_json::from_str::<ModelSpec>(event.payload.get())
            && let Ok(mut m) = self.models.write()
        {
            m.insert(spec.model_ref.clone(), spec);
        }
    }

    pub fn get(&self, model_ref: &str) -> Option<ModelSpec> {
        self.models.read().ok()?.get(model_ref).cloned()
    }

    pub fn all(&self) -> Vec<ModelSpec> {
        self.models
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Registers a model after checking the ref, digest, schema and (for local files) the
    /// artifact itself. Returns `None` for an identical repeat.
    pub async fn register(
        &self,
        spec: ModelSpec,
        origin: &Origin,
    ) -> Result<Option<Committed>, ModelError> {
        region_of(&spec.model_ref)?;
        hex_hash::parse(&spec.digest)
            .ok()
            .filter(|_| spec.digest.chars().all(|c| !c.is_ascii_uppercase()))
            .ok_or_else(|| ModelError::BadDigest(spec.digest.clone()))?;
        if spec.feature_schema.is_empty() {
            return Err(ModelError::EmptySchema);
        }
        if let Some(existing) = self.get(&spec.model_ref) {
            return if existing == spec {
                Ok(None)
            } else {
                Err(ModelError::AlreadyRegistered(spec.model_ref))
            };
        }
        check_artifact(&spec.uri, &spec.digest, &self.artifact_policy()).await?;
        let payload = serde_json::to_value(&spec).unwrap_or_default();
        let event =
            NewEvent::new(MODEL_REGISTERED, payload).with_metadata(origin.metadata(json!({})));
        let committed = match self
            .store
            .append(
                &format!("model/{}", spec.model_ref),
                ExpectedVersion::NoStream,
                vec![event],
            )
            .await
        {
            Ok(mut c) => c.remove(0),
            Err(LedgerError::WrongExpectedVersion { .. }) => {
                return Err(ModelError::AlreadyRegistered(spec.model_ref));
            }
            Err(e) => return Err(e.into()),
        };
        if let Ok(mut m) = self.models.write() {
            m.insert(spec.model_ref.clone(), spec);
        }
        Ok(Some(committed))
    }
}

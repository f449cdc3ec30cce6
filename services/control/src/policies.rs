//! Compliance policies as events: `PolicyIngested` on stream `policy/{name}` (one event per
//! version, carrying the canonical source so the rule set can be rebuilt from the ledger),
//! `PolicyIngestRejected` on `policy-rejections` for every refused ingest (who tried what,
//! why it failed). The active rule set is swapped atomically after the event commits.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use aether_ledger::{
    Committed, EventFilter, EventStore, ExpectedVersion, LedgerError, NewEvent, RecordedEvent,
};
use aether_rules::{CompiledPolicy, PolicyError, PolicyFormat, RuleEngine};
use serde::Serialize;
use serde_json::json;

use crate::origin::Origin;
use crate::replay::{After, Pages};

/// Event type of an accepted policy version.
pub const POLICY_INGESTED: &str = "PolicyIngested";
/// Event type of a refused ingest.
pub const POLICY_INGEST_REJECTED: &str = "PolicyIngestRejected";
/// Stream of refused ingests (the name may be unreadable, so not per policy).
pub const REJECTIONS_STREAM: &str = "policy-rejections";

/// The stream of one policy's versions.
pub fn policy_stream(name: &str) -> String {
    format!("policy/{name}")
}

/// One ingested version, as the projection keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyRecord {
    pub name: String,
    pub version: String,
    pub digest: String,
    pub rules: usize,
    pub seq: u64,
    pub stream_version: u64,
    pub recorded_at: String,
}

/// Why an ingest was refused. Every variant except `Ledger` has been recorded as a
/// `PolicyIngestRejected` event.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error(transparent)]
    Invalid(PolicyError),
    #[error(
        "policy {name:?} version {version} already exists with digest {existing}; publish a new version"
    )]
    VersionExists {
        name: String,
        version: String,
        existing: String,
    },
    #[error("policy {name:?} changed while this ingest ran (now at version {actual}); retry")]
    Conflict { name: String, actual: u64 },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

#[derive(Default)]
struct Projection {
    /// Versions per policy name, in ledger order.
    versions: BTreeMap<String, Vec<PolicyRecord>>,
    /// Every version compiled, by (name, version): a rollback rebuilds an earlier rule set
    /// from these, also after a restart.
    compiled: BTreeMap<(String, String), Arc<CompiledPolicy>>,
}

/// Policies on the ledger and the rule engine they make up.
#[derive(Clone)]
pub struct PolicyRegistry {
    store: EventStore,
    engine: Arc<RuleEngine>,
    projection: Arc<RwLock<Projection>>,
}

impl PolicyRegistry {
    /// Rebuilds the registry from the ledger: every `PolicyIngested` in seq order, the
    /// latest version of each policy installed in the engine.
    pub async fn load(store: EventStore) -> Result<Self, LedgerError> {
        Self::load_until(store, None).await
    }

    /// [`Self::load`] from the events with seq ≤ `upto_seq` only. Stored policies are
    /// compiled again; nothing is written.
    pub(crate) async fn load_until(
        store: EventStore,
        upto_seq: Option<u64>,
    ) -> Result<Self, LedgerError> {
        let registry = PolicyRegistry {
            store,
            engine: Arc::new(RuleEngine::new()),
            projection: Arc::default(),
        };
        let filter = EventFilter {
            event_type: Some(POLICY_INGESTED.into()),
            stream_prefix: Some("policy/".into()),
            max_seq: upto_seq,
            ..EventFilter::default()
        };
        let mut pages = Pages::new(&registry.store, &filter);
        while let Some(page) = pages.next().await? {
            for event in &page {
                if let Err(e) = registry.apply(event).await {
                    // A stored policy that no longer compiles must not vanish silently.
                    tracing::error!(seq = event.seq, error = %e, "stored policy does not compile");
                }
            }
        }
        Ok(registry)
    }

    /// What a follower of this registry reads: every `PolicyIngested`.
    pub(crate) fn following(&self) -> After {
        After::new(EventFilter {
            event_type: Some(POLICY_INGESTED.into()),
            stream_prefix: Some("policy/".into()),
            ..EventFilter::default()
        })
    }

    /// Applies the next new `PolicyIngested` events that this node does not know yet
    /// (ingested through another node of the cluster). A policy this node ingested itself
    /// is known and skipped.
    pub(crate) async fn follow_step(&self, after: &mut After) -> Result<(), LedgerError> {
        while let Some(page) = after.next(&self.store).await? {
            for event in &page {
                let payload = event.payload_value().unwrap_or_default();
                let key = (
                    payload["name"].as_str().unwrap_or_default().to_owned(),
                    payload["version"].as_str().unwrap_or_default().to_owned(),
                );
                let known = self
                    .projection
                    .read()
                    .map(|p| p.compiled.contains_key(&key))
                    .unwrap_or(true);
                if known {
                    continue;
                }
                match self.apply(event).await {
                    Ok(()) => {
                        tracing::info!(seq = event.seq, policy = %key.0, version = %key.1, "applied a policy ingested through another node")
                    }
                    Err(e) => {
                        tracing::error!(seq = event.seq, error = %e, "a policy on the ledger does not compile")
                    }
                }
            }
        }
        Ok(())
    }

    /// The live rule engine (hot-swapped on every ingest).
    pub fn engine(&self) -> Arc<RuleEngine> {
        self.engine.clone()
    }

    /// Every policy with its versions, by name.
    pub fn policies(&self) -> BTreeMap<String, Vec<PolicyRecord>> {
        self.projection
            .read()
            .map(|p| p.versions.clone())
            .unwrap_or_default()
    }

    /// Versions of one policy, oldest first (`None` if unknown).
    pub fn versions(&self, name: &str) -> Option<Vec<PolicyRecord>> {
        self.projection
            .read()
            .ok()
            .and_then(|p| p.versions.get(name).cloned())
    }

    /// The rule set made of exactly these `(name, version)` policies, each ingested before.
    pub fn rule_set(&self, versions: &[(String, String)]) -> Result<aether_rules::RuleSet, String> {
        let p = self
            .projection
            .read()
            .map_err(|_| "the policy registry is unavailable".to_owned())?;
        let policies = versions
            .iter()
            .map(|key| {
                p.compiled
                    .get(key)
                    .cloned()
                    .ok_or_else(|| format!("policy {} version {} was never ingested", key.0, key.1))
            })
            .collect::<Result<Vec<_>, _>>()?;
        aether_rules::RuleSet::new(policies).map_err(|e| e.to_string())
    }

    async fn apply(&self, event: &RecordedEvent) -> Result<(), PolicyError> {
        let payload = event.payload_value().unwrap_or_default();
        let source = payload["source"].as_str().unwrap_or_default().to_owned();
        let policy = Arc::new(compile(source, PolicyFormat::Json).await?);
        self.remember(&policy, event.seq, event.stream_version, event.recorded_at);
        self.engine.install(policy);
        Ok(())
    }

    fn remember(
        &self,
        policy: &Arc<CompiledPolicy>,
        seq: u64,
        stream_version: u64,
        recorded_at: chrono::DateTime<chrono::Utc>,
    ) {
        if let Ok(mut p) = self.projection.write() {
            // Applied already (a node following the ledger may meet its own ingest).
            if p.compiled
                .contains_key(&(policy.name().to_owned(), policy.version().to_owned()))
            {
                return;
            }
            p.compiled.insert(
                (policy.name().to_owned(), policy.version().to_owned()),
                policy.clone(),
            );
            p.versions
                .entry(policy.name().to_owned())
                .or_default()
                .push(PolicyRecord {
                    name: policy.name().to_owned(),
                    version: policy.version().to_owned(),
                    digest: policy.digest_hex(),
                    rules: policy.rules().len(),
                    seq,
                    stream_version,
                    recorded_at: aether_ledger::hashing::format_timestamp(&recorded_at),
                });
        }
    }

    /// Ingests a policy document. On success the `PolicyIngested` event is committed and
    /// then the new rule set is swapped in; re-ingesting an identical version changes
    /// nothing and returns the existing record. Any refusal is recorded as
    /// `PolicyIngestRejected` with the actor and reason, and changes nothing else.
    pub async fn ingest(
        &self,
        source: &str,
        format: PolicyFormat,
        origin: &Origin,
    ) -> Result<(PolicyRecord, Option<Committed>), IngestError> {
        let policy = match compile_new(source.to_owned(), format).await {
            Ok(p) => p,
            Err(e) => {
                self.reject(source, None, &e.to_string(), origin).await?;
                return Err(IngestError::Invalid(e));
            }
        };
        let name = policy.name().to_owned();
        let existing = self.versions(&name).unwrap_or_default();
        if let Some(same) = existing.iter().find(|r| r.version == policy.version()) {
            if same.digest == policy.digest_hex() {
                return Ok((same.clone(), None));
            }
            let err = IngestError::VersionExists {
                name,
                version: same.version.clone(),
                existing: same.digest.clone(),
            };
            self.reject(source, Some(&policy), &err.to_string(), origin)
                .await?;
            return Err(err);
        }
        let canonical = policy
            .document()
            .canonical_json()
            .map_err(IngestError::Invalid)?;
        let event = NewEvent::new(
            POLICY_INGESTED,
            json!({
                "name": name,
                "version": policy.version(),
                "digest": policy.digest_hex(),
                "rules": policy.rules().iter().map(|r| r.id()).collect::<Vec<_>>(),
                "source": canonical,
            }),
        )
        .with_metadata(origin.metadata(json!({})));
        let expected = ExpectedVersion::Exact(existing.last().map_or(0, |r| r.stream_version));
        let committed = match self
            .store
            .append(&policy_stream(&name), expected, vec![event])
            .await
        {
            Ok(mut c) => c.remove(0),
            Err(LedgerError::WrongExpectedVersion { actual, .. }) => {
                return Err(IngestError::Conflict { name, actual });
            }
            Err(e) => return Err(e.into()),
        };
        let policy = Arc::new(policy);
        self.remember(
            &policy,
            committed.seq,
            committed.stream_version,
            committed.recorded_at,
        );
        let record = self
            .versions(&name)
            .and_then(|v| v.last().cloned())
            .ok_or_else(|| IngestError::Ledger(LedgerError::WriterClosed))?;
        self.engine.install(policy);
        Ok((record, Some(committed)))
    }

    async fn reject(
        &self,
        source: &str,
        policy: Option<&CompiledPolicy>,
        reason: &str,
        origin: &Origin,
    ) -> Result<(), LedgerError> {
        // Keep what was tried, bounded, so that the rejection event stays small.
        let tried: String = source.chars().take(16 * 1024).collect();
        let event = NewEvent::new(
            POLICY_INGEST_REJECTED,
            json!({
                "name": policy.map(|p| p.name()),
                "version": policy.map(|p| p.version()),
                "reason": reason,
                "source": tried,
                "source_truncated": tried.len() < source.len(),
            }),
        )
        .with_metadata(origin.metadata(json!({})));
        self.store
            .append(REJECTIONS_STREAM, ExpectedVersion::Any, vec![event])
            .await
            .map(|_| ())
    }
}

/// Compiles on a blocking thread: the CEL compiler runs on a big-stack thread of its own.
/// [`compile`] for a new ingest: also timed on the sample (`CompiledPolicy::check_cost`),
/// off the runtime's threads. Only a new ingest is timed: a stored policy is never dropped
/// at a replay because the machine is slow that day.
async fn compile_new(source: String, format: PolicyFormat) -> Result<CompiledPolicy, PolicyError> {
    tokio::task::spawn_blocking(move || {
        let policy = CompiledPolicy::parse(&source, format)?;
        policy.check_cost()?;
        Ok(policy)
    })
    .await
    .unwrap_or_else(|e| {
        Err(PolicyError::CompilerUnavailable {
            message: e.to_string(),
        })
    })
}

async fn compile(source: String, format: PolicyFormat) -> Result<CompiledPolicy, PolicyError> {
    tokio::task::spawn_blocking(move || CompiledPolicy::parse(&source, format))
        .await
        .unwrap_or_else(|e| {
            Err(PolicyError::CompilerUnavailable {
                message: e.to_string(),
            })
        })
}

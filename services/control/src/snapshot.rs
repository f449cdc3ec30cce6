//! Consistent snapshot of the three moving parts (gateway routing, rule set, RAG corpora)
//! in two phases, and the rollback to one.
//!
//! Prepare runs on every participant at once under one ttl; only when all have pinned is
//! `SnapshotCommitted` appended on stream `snapshot`, else `SnapshotAborted` and every pin
//! is released, so a failed snapshot changes nothing. A rollback restores every
//! participant to the versions a committed snapshot pinned and records `RolledBack` as
//! one event. Participants are a trait so that the same coordinator drives in-process
//! registries and remote ones over gRPC (`aether_gateway::snapshot_grpc`).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::Duration;

use aether_ledger::cluster::PrepareAnswer;
use aether_ledger::hashing::{canonical_json, sm3};
use aether_ledger::{Direction, EventStore, ExpectedVersion, LedgerError, NewEvent, RecordedEvent};
use aether_rag::CorpusDigest;
use aether_rules::RuleSet;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::time::Instant;
use uuid::Uuid;

use crate::origin::Origin;
use crate::projection::{SNAPSHOT_COMMITTED, SNAPSHOT_STREAM};
use crate::routing::{self, RoutingTable};
use crate::{CorpusRegistry, EngineRegistry, PolicyRegistry, RolloutRegistry};

/// Event type of a snapshot that did not commit (a participant failed or the ttl passed).
pub const SNAPSHOT_ABORTED: &str = "SnapshotAborted";
/// Event type of a rollback to a committed snapshot.
pub const ROLLED_BACK: &str = "RolledBack";
/// How long prepare may take, and a pin wait for commit, unless the caller says otherwise.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// The lease that makes the snapshot coordinator a singleton in a cluster: a node takes it
/// for the length of one snapshot or rollback, renewed while it runs, and fences the event
/// that ends it, so two nodes never coordinate at once and one that lost the lease (paused,
/// cut off) has its `SnapshotCommitted`, `SnapshotAborted` or `RolledBack` refused by the
/// database.
pub const COORDINATOR_LEASE: &str = "snapshot-coordinator";
/// The coordinator lease's term: a node that dies mid-snapshot blocks others this long.
const COORDINATOR_TTL: Duration = Duration::from_secs(3);
/// How often a running snapshot or rollback renews the coordinator lease.
const COORDINATOR_RENEW: Duration = Duration::from_secs(1);

/// Participant names the coordinator files digests under.
pub const GATEWAY: &str = "gateway";
pub const RULES: &str = "rules";
pub const RAG: &str = "rag";

/// What a participant pinned: an identifier it can restore from, and the content digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pinned {
    pub version: String,
    pub digest: String,
}

/// Why a participant refused or failed a phase.
#[derive(Debug, thiserror::Error)]
pub enum ParticipantError {
    #[error("{0}")]
    Failed(String),
    #[error("unknown version {0:?}")]
    UnknownVersion(String),
    #[error("participant unreachable: {0}")]
    Unavailable(String),
}

/// One side of the two-phase snapshot. Implementations must make `abort` of an unknown
/// or expired snapshot succeed, and keep committed pins restorable.
#[async_trait::async_trait]
pub trait SnapshotParticipant: Send + Sync {
    fn name(&self) -> &str;
    async fn prepare(&self, snapshot_id: Uuid, ttl: Duration) -> Result<Pinned, ParticipantError>;
    async fn commit(&self, snapshot_id: Uuid) -> Result<(), ParticipantError>;
    async fn abort(&self, snapshot_id: Uuid) -> Result<(), ParticipantError>;
    /// Switches to `version` (as returned by prepare) and returns the digest now in force.
    async fn restore(&self, version: &str) -> Result<String, ParticipantError>;
}

/// SM3 of a value's RFC 8785 text, hex.
fn digest_of(value: &Value) -> Result<String, ParticipantError> {
    let text = canonical_json(value).map_err(|e| ParticipantError::Failed(e.to_string()))?;
    Ok(hex::encode(sm3(text.as_bytes())))
}

/// Pins awaiting commit (with their deadline) and committed pins, keyed by snapshot id.
struct Pins<T> {
    inner: Mutex<HashMap<Uuid, (T, Option<Instant>)>>,
}

impl<T: Clone> Pins<T> {
    fn new() -> Self {
        Pins {
            inner: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, (T, Option<Instant>)>> {
        let mut pins = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        // Expired prepared pins go first, so an unanswered prepare holds nothing forever.
        let now = Instant::now();
        pins.retain(|_, (_, deadline)| deadline.is_none_or(|d| d > now));
        pins
    }

    fn prepare(&self, id: Uuid, value: T, ttl: Duration) {
        self.lock().insert(id, (value, Some(Instant::now() + ttl)));
    }

    fn commit(&self, id: Uuid) -> Result<(), ParticipantError> {
        match self.lock().get_mut(&id) {
            Some(pin) => {
                pin.1 = None;
                Ok(())
            }
            None => Err(ParticipantError::Failed(format!(
                "snapshot {id} is not prepared here (or its pin expired)"
            ))),
        }
    }

    fn abort(&self, id: Uuid) {
        self.lock().remove(&id);
    }

    fn committed(&self) -> Vec<T> {
        self.lock()
            .values()
            .filter(|(_, deadline)| deadline.is_none())
            .map(|(v, _)| v.clone())
            .collect()
    }
}

/// The rule set: version and digest are the active set's digest; a pin holds the set
/// itself so that it can be reinstalled whole.
pub struct RulesParticipant {
    policies: PolicyRegistry,
    pins: Pins<Arc<RuleSet>>,
}

impl RulesParticipant {
    pub fn new(policies: PolicyRegistry) -> Self {
        RulesParticipant {
            policies,
            pins: Pins::new(),
        }
    }
}

#[async_trait::async_trait]
impl SnapshotParticipant for RulesParticipant {
    fn name(&self) -> &str {
        RULES
    }

    async fn prepare(&self, snapshot_id: Uuid, ttl: Duration) -> Result<Pinned, ParticipantError> {
        let set = self.policies.engine().snapshot();
        let pinned = Pinned {
            version: rules_version(&set),
            digest: set.digest_hex(),
        };
        self.pins.prepare(snapshot_id, set, ttl);
        Ok(pinned)
    }

    async fn commit(&self, snapshot_id: Uuid) -> Result<(), ParticipantError> {
        self.pins.commit(snapshot_id)
    }

    async fn abort(&self, snapshot_id: Uuid) -> Result<(), ParticipantError> {
        self.pins.abort(snapshot_id);
        Ok(())
    }

    /// `version` is the JSON list of `[name, version]` pairs [`rules_version`] wrote; the
    /// set is rebuilt from the registry's compiled versions, so it also works after a
    /// restart. A bare digest (a set pinned in this process) is still accepted.
    async fn restore(&self, version: &str) -> Result<String, ParticipantError> {
        let engine = self.policies.engine();
        let set = match serde_json::from_str::<Vec<(String, String)>>(version) {
            Ok(pairs) => Arc::new(
                self.policies
                    .rule_set(&pairs)
                    .map_err(|_| ParticipantError::UnknownVersion(version.to_owned()))?,
            ),
            Err(_) => self
                .pins
                .committed()
                .into_iter()
                .find(|s| s.digest_hex() == version)
                .ok_or_else(|| ParticipantError::UnknownVersion(version.to_owned()))?,
        };
        if engine.snapshot().digest() != set.digest() {
            engine.replace(set.clone());
        }
        Ok(set.digest_hex())
    }
}

/// A rule set's version as a snapshot records it: its `[name, version]` pairs, sorted.
fn rules_version(set: &RuleSet) -> String {
    let mut pairs: Vec<(String, String)> = set
        .policies()
        .map(|p| (p.name().to_owned(), p.version().to_owned()))
        .collect();
    pairs.sort();
    serde_json::to_string(&pairs).unwrap_or_default()
}

/// The RAG corpora: version is the JSON map corpus → version digest, digest its SM3.
pub struct RagParticipant {
    corpora: CorpusRegistry,
    pins: Pins<BTreeMap<String, String>>,
}

impl RagParticipant {
    pub fn new(corpora: CorpusRegistry) -> Self {
        RagParticipant {
            corpora,
            pins: Pins::new(),
        }
    }

    fn pinned(&self) -> Result<(BTreeMap<String, String>, Pinned), ParticipantError> {
        let versions = self.corpora.current_versions();
        let value = json!(versions);
        let version =
            serde_json::to_string(&value).map_err(|e| ParticipantError::Failed(e.to_string()))?;
        let digest = digest_of(&value)?;
        Ok((versions, Pinned { version, digest }))
    }
}

#[async_trait::async_trait]
impl SnapshotParticipant for RagParticipant {
    fn name(&self) -> &str {
        RAG
    }

    async fn prepare(&self, snapshot_id: Uuid, ttl: Duration) -> Result<Pinned, ParticipantError> {
        let (versions, pinned) = self.pinned()?;
        self.pins.prepare(snapshot_id, versions, ttl);
        Ok(pinned)
    }

    async fn commit(&self, snapshot_id: Uuid) -> Result<(), ParticipantError> {
        self.pins.commit(snapshot_id)
    }

    async fn abort(&self, snapshot_id: Uuid) -> Result<(), ParticipantError> {
        self.pins.abort(snapshot_id);
        Ok(())
    }

    async fn restore(&self, version: &str) -> Result<String, ParticipantError> {
        let target: BTreeMap<String, String> = serde_json::from_str(version)
            .map_err(|_| ParticipantError::UnknownVersion(version.to_owned()))?;
        activate_corpora(&self.corpora, &target)?;
        Ok(self.pinned()?.1.digest)
    }
}

/// Makes each named corpus's version current; all are checked before any is switched.
fn activate_corpora(
    corpora: &CorpusRegistry,
    target: &BTreeMap<String, String>,
) -> Result<(), ParticipantError> {
    let mut plan = Vec::with_capacity(target.len());
    for (name, version) in target {
        let corpus = corpora
            .corpus(name)
            .ok_or_else(|| ParticipantError::UnknownVersion(format!("corpus {name}")))?;
        let digest: CorpusDigest = version
            .parse()
            .map_err(|_| ParticipantError::UnknownVersion(format!("{name}@{version}")))?;
        if corpus.get(&digest).is_none() {
            return Err(ParticipantError::UnknownVersion(format!(
                "{name}@{version}"
            )));
        }
        plan.push((corpus, digest));
    }
    for (corpus, digest) in plan {
        corpus
            .activate(&digest)
            .map_err(|e| ParticipantError::Failed(e.to_string()))?;
    }
    Ok(())
}

/// The gateway routing table ([`RoutingTable`]): active engines and the rollouts that
/// split traffic. The pin is the table itself, so a rollback restores it, also after a
/// restart; replay applies the same restore from the `RolledBack` event.
pub struct GatewayParticipant {
    engines: EngineRegistry,
    rollouts: RolloutRegistry,
}

impl GatewayParticipant {
    pub fn new(engines: EngineRegistry, rollouts: RolloutRegistry) -> Self {
        GatewayParticipant { engines, rollouts }
    }

    fn pinned(&self) -> Pinned {
        let table = RoutingTable::of(&self.engines, &self.rollouts);
        Pinned {
            version: table.version(),
            digest: table.digest(),
        }
    }
}

#[async_trait::async_trait]
impl SnapshotParticipant for GatewayParticipant {
    fn name(&self) -> &str {
        GATEWAY
    }

    async fn prepare(&self, _: Uuid, _: Duration) -> Result<Pinned, ParticipantError> {
        Ok(self.pinned())
    }

    async fn commit(&self, _: Uuid) -> Result<(), ParticipantError> {
        Ok(())
    }

    async fn abort(&self, _: Uuid) -> Result<(), ParticipantError> {
        Ok(())
    }

    async fn restore(&self, version: &str) -> Result<String, ParticipantError> {
        let table = RoutingTable::parse(version)
            .map_err(|e| ParticipantError::UnknownVersion(e.to_string()))?;
        routing::restore(&table, &self.engines, &self.rollouts)
            .map_err(ParticipantError::UnknownVersion)?;
        Ok(self.pinned().digest)
    }
}

/// A committed snapshot as the registry keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub id: String,
    pub participants: BTreeMap<String, Pinned>,
    pub gateway_digest: Option<String>,
    pub rules_digest: Option<String>,
    pub rag_digest: Option<String>,
    /// The other live nodes of the cluster that prepared it, with their state digests.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub nodes: BTreeMap<String, String>,
    #[serde(default)]
    pub seq: u64,
    #[serde(default)]
    pub recorded_at: String,
}

/// A rollback as recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackRecord {
    pub target_snapshot: String,
    pub reason: String,
    pub restored: BTreeMap<String, Option<String>>,
    #[serde(default)]
    pub seq: u64,
}

/// Why a snapshot or rollback did not happen.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Recorded as `SnapshotAborted`.
    #[error("snapshot {id} aborted: participant {participant}: {reason}")]
    Aborted {
        id: String,
        participant: String,
        reason: String,
        /// True when the ttl passed (not a refusal).
        timed_out: bool,
    },
    #[error("no committed snapshot {0:?}")]
    UnknownSnapshot(String),
    #[error("rollback failed restoring {participant}: {reason}; nothing was recorded")]
    Restore { participant: String, reason: String },
    /// Another node of the cluster holds the coordinator lease.
    #[error(
        "node {holder} is taking a snapshot or rolling back (lease {COORDINATOR_LEASE}); \
         nothing was done here: retry once it is done"
    )]
    Busy { holder: String },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

#[derive(Default)]
struct Projection {
    snapshots: Vec<SnapshotRecord>,
    rollbacks: Vec<RollbackRecord>,
    /// The stream version of the last event applied: a follower skips what it already has
    /// (this node's own snapshots and rollbacks, applied when written).
    applied_version: u64,
}

/// The coordinator and the committed snapshots (a projection of stream `snapshot`).
#[derive(Clone)]
pub struct SnapshotCoordinator {
    store: EventStore,
    projection: Arc<RwLock<Projection>>,
    /// One snapshot or rollback at a time, so the stream's expected version holds.
    busy: Arc<tokio::sync::Mutex<()>>,
    /// The in-process participants, made once: their committed pins must outlive a
    /// request for a later rollback to find them.
    local: Arc<OnceLock<Vec<Arc<dyn SnapshotParticipant>>>>,
    /// This node's id in a cluster: the other live nodes prepare each snapshot too.
    node: Arc<OnceLock<String>>,
}

/// The digest of a node's whole snapshot state: SM3 of the RFC 8785 text of its
/// participants' digests by name. Two nodes that applied the same control events agree.
pub fn state_digest(pinned: &BTreeMap<String, Pinned>) -> Result<String, ParticipantError> {
    let digests: BTreeMap<&String, &String> = pinned.iter().map(|(n, p)| (n, &p.digest)).collect();
    digest_of(&json!(digests))
}

/// How often the taking node looks at the other nodes' prepare answers.
const ANSWERS_EVERY: Duration = Duration::from_millis(50);

/// The coordinator lease while this node holds it for one snapshot or rollback (`None`
/// on a lone node: SQLite, or a node not named in a cluster). Renewed in the background;
/// given up when dropped.
struct Coordinating {
    held: Option<(u64, tokio::task::JoinHandle<()>, EventStore, String)>,
}

impl Coordinating {
    /// Adds the lease's fence to an event's metadata, unless it carries one already: a
    /// rollout controller's step snapshot is fenced by the controller's own lease (an event
    /// carries one fence), which is what keeps a stale controller from writing it.
    fn fence(&self, mut metadata: Value) -> Value {
        if let Some((token, ..)) = &self.held
            && metadata.get(aether_ledger::cluster::FENCE_MEMBER).is_none()
        {
            aether_ledger::cluster::fence(&mut metadata, COORDINATOR_LEASE, *token);
        }
        metadata
    }
}

impl Coordinating {
    /// Gives the lease up at once rather than leave it to expire, so that the next
    /// snapshot, on any node, need not wait. Awaited before the node's next snapshot can
    /// start (the caller still holds the node's own lock), so a release can never land
    /// after this node took the lease again.
    async fn release(mut self) {
        if let Some((_, renew, store, node)) = self.held.take() {
            renew.abort();
            if let Err(e) = store.release_lease(COORDINATOR_LEASE, &node).await {
                tracing::warn!(error = %e, "could not give up the snapshot coordinator lease");
            }
        }
    }
}

impl Drop for Coordinating {
    /// A snapshot or rollback dropped half way (its request cancelled) stops renewing; the
    /// lease then expires within its term.
    fn drop(&mut self) {
        if let Some((_, renew, ..)) = self.held.take() {
            renew.abort();
        }
    }
}

impl SnapshotCoordinator {
    /// Takes the cluster's coordinator lease for one snapshot or rollback, or says which
    /// node has it. A lone node (SQLite, or not named in a cluster) coordinates alone.
    async fn coordinate(&self) -> Result<Coordinating, SnapshotError> {
        let Some(node) = self
            .node
            .get()
            .filter(|_| self.store.postgres_pool().is_some())
        else {
            return Ok(Coordinating { held: None });
        };
        let Some(token) = self
            .store
            .acquire_lease(COORDINATOR_LEASE, node, COORDINATOR_TTL)
            .await?
        else {
            let holder = self
                .store
                .leases()
                .await?
                .into_iter()
                .find(|l| l.name == COORDINATOR_LEASE)
                .map_or_else(|| "?".to_owned(), |l| l.holder);
            return Err(SnapshotError::Busy { holder });
        };
        let (store, holder) = (self.store.clone(), node.clone());
        let renew = tokio::spawn(async move {
            loop {
                tokio::time::sleep(COORDINATOR_RENEW).await;
                match store
                    .acquire_lease(COORDINATOR_LEASE, &holder, COORDINATOR_TTL)
                    .await
                {
                    Ok(Some(_)) => {}
                    // Lost: the fence on the closing event makes the database refuse it.
                    Ok(None) => return,
                    Err(e) => {
                        tracing::warn!(error = %e, "renewing the snapshot coordinator lease failed")
                    }
                }
            }
        });
        Ok(Coordinating {
            held: Some((token, renew, self.store.clone(), node.clone())),
        })
    }

    /// Names this node in its cluster: from now on every snapshot it takes also prepares
    /// on each other live node, which must be in the same state.
    pub fn set_node(&self, node_id: &str) {
        let _ = self.node.set(node_id.to_owned());
    }

    /// Asks every other live node to prepare `id` and waits for all their answers until
    /// `deadline`; each must hold the state `pinned` here holds. Returns their digests by
    /// node, or the node that refused, timed out or differs, why, and whether it timed out.
    async fn prepare_elsewhere(
        &self,
        id: Uuid,
        pinned: &BTreeMap<String, Pinned>,
        deadline: Instant,
    ) -> Result<BTreeMap<String, String>, (String, String, bool)> {
        let Some(node) = self.node.get() else {
            return Ok(BTreeMap::new());
        };
        let failed = |e: LedgerError| ("cluster".to_owned(), e.to_string(), false);
        let others = self.store.live_other_nodes(node).await.map_err(failed)?;
        if others.is_empty() {
            return Ok(BTreeMap::new());
        }
        let here = state_digest(pinned).map_err(|e| (node.clone(), e.to_string(), false))?;
        let ttl = deadline.saturating_duration_since(Instant::now());
        self.store
            .request_prepares(&id.to_string(), &others, ttl)
            .await
            .map_err(failed)?;
        loop {
            let answers = self
                .store
                .prepare_answers(&id.to_string())
                .await
                .map_err(failed)?;
            let mut waiting = None;
            let mut prepared = BTreeMap::new();
            for (other, answer) in answers {
                match answer {
                    PrepareAnswer::Pending => waiting = Some(other),
                    PrepareAnswer::Refused(reason) => return Err((other, reason, false)),
                    PrepareAnswer::Prepared(digest) if digest != here => {
                        return Err((
                            other,
                            format!(
                                "it is in another state (digest {digest}, here {here}): the two \
                                 nodes have not applied the same control events yet; retry"
                            ),
                            false,
                        ));
                    }
                    PrepareAnswer::Prepared(digest) => {
                        prepared.insert(other, digest);
                    }
                }
            }
            match waiting {
                None => return Ok(prepared),
                Some(other) if Instant::now() >= deadline => {
                    return Err((other, format!("no answer to prepare within {ttl:?}"), true));
                }
                Some(_) => tokio::time::sleep(ANSWERS_EVERY).await,
            }
        }
    }

    /// Prepares this node's participants for snapshot `id`, asked by another node; the
    /// answer is [`state_digest`] of what they pinned (the pins expire after `ttl` unless
    /// a rollback to the snapshot later restores from the ledger's record).
    pub async fn prepare_here(
        &self,
        participants: &[Arc<dyn SnapshotParticipant>],
        id: Uuid,
        ttl: Duration,
    ) -> Result<String, String> {
        let mut pinned = BTreeMap::new();
        for p in participants {
            let pin = p
                .prepare(id, ttl)
                .await
                .map_err(|e| format!("{} cannot prepare: {e}", p.name()))?;
            pinned.insert(p.name().to_owned(), pin);
        }
        state_digest(&pinned).map_err(|e| e.to_string())
    }
    /// Rebuilds the list of committed snapshots and rollbacks from the ledger.
    pub async fn load(store: EventStore) -> Result<Self, LedgerError> {
        Self::load_until(store, None).await
    }

    pub(crate) async fn load_until(
        store: EventStore,
        upto_seq: Option<u64>,
    ) -> Result<Self, LedgerError> {
        let coordinator = SnapshotCoordinator {
            store,
            projection: Arc::default(),
            busy: Arc::default(),
            local: Arc::default(),
            node: Arc::default(),
        };
        let mut from = 0;
        loop {
            let page = coordinator
                .store
                .read_stream(SNAPSHOT_STREAM, from, Direction::Forward, 500)
                .await?;
            let Some(last) = page.last() else { break };
            from = last.stream_version + 1;
            let full = page.len() == 500;
            for event in page
                .iter()
                .filter(|e| upto_seq.is_none_or(|max| e.seq <= max))
            {
                coordinator.apply(event);
            }
            if !full {
                break;
            }
        }
        Ok(coordinator)
    }

    /// Applies one event of stream `snapshot`; whether it was new here.
    fn apply(&self, event: &RecordedEvent) -> bool {
        let mut p = self
            .projection
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if event.stream_version <= p.applied_version {
            return false;
        }
        p.applied_version = event.stream_version;
        let Ok(payload) = event.payload_value() else {
            tracing::error!(seq = event.seq, "malformed snapshot event");
            return true;
        };
        match event.event_type.as_str() {
            SNAPSHOT_COMMITTED => match serde_json::from_value::<SnapshotRecord>(payload) {
                Ok(mut r) => {
                    r.seq = event.seq;
                    r.recorded_at = aether_ledger::hashing::format_timestamp(&event.recorded_at);
                    p.snapshots.push(r);
                }
                Err(e) => tracing::error!(seq = event.seq, error = %e, "malformed snapshot"),
            },
            ROLLED_BACK => match serde_json::from_value::<RollbackRecord>(payload) {
                Ok(mut r) => {
                    r.seq = event.seq;
                    p.rollbacks.push(r);
                }
                Err(e) => tracing::error!(seq = event.seq, error = %e, "malformed rollback"),
            },
            _ => {}
        }
        true
    }

    /// Applies the snapshots and rollbacks that other nodes of the cluster recorded since
    /// the last step. A rollback is then put in force here as at a start: the rule set and
    /// corpora it restored (unless newer ones built on them, [`Self::reapply`]) and the
    /// rollouts' routing; the engines' routing comes with the engines' own follower.
    pub(crate) async fn follow_step(
        &self,
        corpora: &CorpusRegistry,
        policies: &PolicyRegistry,
        rollouts: &RolloutRegistry,
    ) -> Result<(), LedgerError> {
        loop {
            let from = self.read(|p| p.applied_version) + 1;
            let page = self
                .store
                .read_stream(SNAPSHOT_STREAM, from, Direction::Forward, 500)
                .await?;
            let mut rolled_back = false;
            for event in &page {
                if self.apply(event) && event.event_type == ROLLED_BACK {
                    rollouts.apply_rollback(event);
                    rolled_back = true;
                }
            }
            if rolled_back {
                self.reapply(corpora, policies).await?;
                tracing::info!("a rollback recorded through another node is in force here");
            }
            if page.len() < 500 {
                return Ok(());
            }
        }
    }

    /// Committed snapshots, oldest first.
    pub fn snapshots(&self) -> Vec<SnapshotRecord> {
        self.read(|p| p.snapshots.clone())
    }

    /// Rollbacks, oldest first.
    pub fn rollbacks(&self) -> Vec<RollbackRecord> {
        self.read(|p| p.rollbacks.clone())
    }

    /// A committed snapshot by id, or `"previous"`: the one committed before the newest
    /// (the state before the snapshot now in force).
    pub fn resolve(&self, id: &str) -> Option<SnapshotRecord> {
        self.read(|p| {
            if id == "previous" {
                let n = p.snapshots.len();
                (n >= 2).then(|| p.snapshots[n - 2].clone())
            } else {
                p.snapshots.iter().find(|s| s.id == id).cloned()
            }
        })
    }

    /// The snapshot in force: the newest committed one, or the target of a later
    /// rollback. Every control event names it in its metadata (`snapshot_id`).
    pub fn in_force(&self) -> Option<String> {
        self.read(|p| {
            let snapshot = p.snapshots.last().map(|s| (s.seq, s.id.clone()));
            let rollback = p
                .rollbacks
                .last()
                .map(|r| (r.seq, r.target_snapshot.clone()));
            snapshot.into_iter().chain(rollback).max().map(|(_, id)| id)
        })
    }

    fn read<T: Default>(&self, f: impl FnOnce(&Projection) -> T) -> T {
        self.projection.read().map(|p| f(&p)).unwrap_or_default()
    }

    /// Runs the two phases. On success the `SnapshotCommitted` record is returned; on any
    /// failure or when `ttl` passes, `SnapshotAborted` is recorded and every participant
    /// told to abort.
    pub async fn take(
        &self,
        participants: &[Arc<dyn SnapshotParticipant>],
        ttl: Duration,
        origin: &Origin,
    ) -> Result<SnapshotRecord, SnapshotError> {
        let _one = self.busy.lock().await;
        let coordinating = self.coordinate().await?;
        let taken = self
            .take_coordinated(participants, ttl, origin, &coordinating)
            .await;
        coordinating.release().await;
        taken
    }

    async fn take_coordinated(
        &self,
        participants: &[Arc<dyn SnapshotParticipant>],
        ttl: Duration,
        origin: &Origin,
        coordinating: &Coordinating,
    ) -> Result<SnapshotRecord, SnapshotError> {
        let id = Uuid::now_v7();
        let deadline = Instant::now() + ttl;
        let mut tasks = tokio::task::JoinSet::new();
        for p in participants {
            let p = p.clone();
            tasks.spawn(async move {
                let name = p.name().to_owned();
                let result = match tokio::time::timeout_at(deadline, p.prepare(id, ttl)).await {
                    Ok(r) => r.map_err(|e| (e.to_string(), false)),
                    Err(_) => Err((format!("no answer to prepare within {ttl:?}"), true)),
                };
                (name, result)
            });
        }
        let mut pinned = BTreeMap::new();
        let mut failure = None;
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok((name, Ok(pin))) => {
                    pinned.insert(name, pin);
                }
                Ok((name, Err((reason, timed_out)))) => {
                    failure = Some((name, reason, timed_out));
                    break;
                }
                Err(e) => {
                    failure = Some(("?".to_owned(), format!("prepare task failed: {e}"), false));
                    break;
                }
            }
        }
        tasks.abort_all();
        if let Some((participant, reason, timed_out)) = failure {
            return Err(self
                .abort(
                    id,
                    participants,
                    (participant, reason, timed_out),
                    origin,
                    coordinating,
                )
                .await);
        }
        let nodes = match self.prepare_elsewhere(id, &pinned, deadline).await {
            Ok(nodes) => nodes,
            Err((node, reason, timed_out)) => {
                return Err(self
                    .abort(
                        id,
                        participants,
                        (format!("node {node}"), reason, timed_out),
                        origin,
                        coordinating,
                    )
                    .await);
            }
        };
        let digest = |n: &str| pinned.get(n).map(|p| p.digest.clone());
        let record = SnapshotRecord {
            id: id.to_string(),
            gateway_digest: digest(GATEWAY),
            rules_digest: digest(RULES),
            rag_digest: digest(RAG),
            participants: pinned,
            nodes: nodes.clone(),
            seq: 0,
            recorded_at: String::new(),
        };
        let mut payload = json!({
            "id": record.id,
            "participants": record.participants,
            "gateway_digest": record.gateway_digest,
            "rules_digest": record.rules_digest,
            "rag_digest": record.rag_digest,
        });
        if !nodes.is_empty() {
            // The other live nodes that prepared it, each with its state digest (equal to
            // this node's).
            payload["nodes"] = json!(nodes);
        }
        let event = NewEvent::new(SNAPSHOT_COMMITTED, payload)
            .with_metadata(coordinating.fence(origin.metadata(json!({"snapshot_id": record.id}))));
        let committed = match self
            .store
            .append(SNAPSHOT_STREAM, ExpectedVersion::Any, vec![event])
            .await
        {
            Ok(mut c) => c.remove(0),
            Err(e) => {
                release(participants, id).await;
                return Err(e.into());
            }
        };
        for p in participants {
            if let Err(e) = p.commit(id).await {
                // Committed on the ledger already; the participant can still be restored
                // from its version while it keeps it.
                tracing::warn!(participant = p.name(), snapshot = %id, error = %e, "commit failed");
            }
        }
        let stored = store_record(&self.store, committed.seq).await;
        if let Some(event) = stored {
            self.apply(&event);
        }
        self.resolve(&record.id)
            .ok_or(SnapshotError::UnknownSnapshot(record.id))
    }

    /// Records `SnapshotAborted`: `failed` is the participant (or node), why, and whether
    /// the ttl passed.
    async fn abort(
        &self,
        id: Uuid,
        participants: &[Arc<dyn SnapshotParticipant>],
        failed: (String, String, bool),
        origin: &Origin,
        coordinating: &Coordinating,
    ) -> SnapshotError {
        let (participant, reason, timed_out) = failed;
        release(participants, id).await;
        let event = NewEvent::new(
            SNAPSHOT_ABORTED,
            json!({"id": id.to_string(), "reason": reason, "participant": participant}),
        )
        .with_metadata(coordinating.fence(origin.metadata(json!({}))));
        if let Err(e) = self
            .store
            .append(SNAPSHOT_STREAM, ExpectedVersion::Any, vec![event])
            .await
        {
            return e.into();
        }
        SnapshotError::Aborted {
            id: id.to_string(),
            participant,
            reason,
            timed_out,
        }
    }

    /// Restores every participant named in `target` to its pinned version and records one
    /// `RolledBack`. A participant the snapshot does not name is left alone. If a restore
    /// fails, the ones already restored are put back and nothing is recorded.
    pub async fn rollback(
        &self,
        participants: &[Arc<dyn SnapshotParticipant>],
        target: &str,
        reason: &str,
        origin: &Origin,
    ) -> Result<RollbackRecord, SnapshotError> {
        let _one = self.busy.lock().await;
        let coordinating = self.coordinate().await?;
        let rolled_back = self
            .rollback_coordinated(participants, target, reason, origin, &coordinating)
            .await;
        coordinating.release().await;
        rolled_back
    }

    async fn rollback_coordinated(
        &self,
        participants: &[Arc<dyn SnapshotParticipant>],
        target: &str,
        reason: &str,
        origin: &Origin,
        coordinating: &Coordinating,
    ) -> Result<RollbackRecord, SnapshotError> {
        let snapshot = self
            .resolve(target)
            .ok_or_else(|| SnapshotError::UnknownSnapshot(target.to_owned()))?;
        // What is in force now, to put back if a later restore fails.
        let probe = Uuid::now_v7();
        let mut before = Vec::new();
        let mut restored = BTreeMap::new();
        for p in participants {
            let Some(pin) = snapshot.participants.get(p.name()) else {
                continue;
            };
            let now = p.prepare(probe, Duration::from_secs(1)).await;
            let _ = p.abort(probe).await;
            match p.restore(&pin.version).await {
                Ok(digest) => {
                    restored.insert(p.name().to_owned(), Some(digest));
                    if let Ok(now) = now {
                        before.push((p.clone(), now.version));
                    }
                }
                Err(e) => {
                    for (p, version) in before {
                        let _ = p.restore(&version).await;
                    }
                    return Err(SnapshotError::Restore {
                        participant: p.name().to_owned(),
                        reason: e.to_string(),
                    });
                }
            }
        }
        let payload = json!({
            "target_snapshot": snapshot.id,
            "reason": reason,
            "restored": {
                "gateway_digest": restored.get(GATEWAY).cloned().flatten(),
                "rules_digest": restored.get(RULES).cloned().flatten(),
                "rag_digest": restored.get(RAG).cloned().flatten(),
            },
            // What replay needs to reapply the rollback after a restart.
            "rag_versions": snapshot.participants.get(RAG).map(|p| p.version.clone()),
            "rules_version": snapshot.participants.get(RULES).map(|p| p.version.clone()),
            // Applied by the engine and rollout projections when they replay this event.
            "routing_version": restored
                .contains_key(GATEWAY)
                .then(|| snapshot.participants.get(GATEWAY).map(|p| p.version.clone()))
                .flatten(),
        });
        let event = NewEvent::new(ROLLED_BACK, payload).with_metadata(
            coordinating.fence(origin.metadata(json!({"snapshot_id": snapshot.id}))),
        );
        let committed = match self
            .store
            .append(SNAPSHOT_STREAM, ExpectedVersion::Any, vec![event])
            .await
        {
            Ok(mut c) => c.remove(0),
            Err(e) => {
                for (p, version) in before {
                    let _ = p.restore(&version).await;
                }
                return Err(e.into());
            }
        };
        if let Some(event) = store_record(&self.store, committed.seq).await {
            self.apply(&event);
        }
        self.read(|p| p.rollbacks.last().cloned())
            .ok_or(SnapshotError::UnknownSnapshot(snapshot.id))
    }

    /// After a restart: reapplies the last rollback to the corpora it named whose last
    /// ingest came before it (later ingests built on the restored version and win).
    pub async fn reapply(
        &self,
        corpora: &CorpusRegistry,
        policies: &PolicyRegistry,
    ) -> Result<(), LedgerError> {
        let Some(last) = self.read(|p| p.rollbacks.last().map(|r| r.seq)) else {
            return Ok(());
        };
        let event = match store_record(&self.store, last).await {
            Some(e) => e,
            None => return Ok(()),
        };
        let payload = event.payload_value().unwrap_or_default();
        // The rule set, unless a policy was ingested after the rollback (it built on it).
        let newer_policy = policies.policies().values().flatten().any(|r| r.seq > last);
        if let Some(pairs) = payload["rules_version"]
            .as_str()
            .and_then(|t| serde_json::from_str::<Vec<(String, String)>>(t).ok())
            && !newer_policy
        {
            match policies.rule_set(&pairs) {
                Ok(set) => {
                    policies.engine().replace(Arc::new(set));
                }
                Err(e) => {
                    tracing::error!(seq = last, error = %e, "recorded rule-set rollback cannot be reapplied")
                }
            }
        }
        let Some(text) = payload["rag_versions"].as_str() else {
            return Ok(());
        };
        let Ok(target) = serde_json::from_str::<BTreeMap<String, String>>(text) else {
            return Ok(());
        };
        let history = corpora.corpora();
        let stale: BTreeMap<String, String> = target
            .into_iter()
            .filter(|(name, _)| {
                history
                    .get(name)
                    .and_then(|v| v.last())
                    .is_some_and(|r| r.seq < last)
            })
            .collect();
        if let Err(e) = activate_corpora(corpora, &stale) {
            tracing::error!(seq = last, error = %e, "recorded rollback cannot be reapplied");
        }
        Ok(())
    }
}

impl crate::ControlState {
    /// The gateway, rules and RAG participants over this state's registries (the same
    /// ones on every call).
    pub fn participants(&self) -> Vec<Arc<dyn SnapshotParticipant>> {
        self.snapshots
            .local
            .get_or_init(|| {
                vec![
                    Arc::new(GatewayParticipant::new(
                        self.engines.clone(),
                        self.rollouts.clone(),
                    )) as Arc<dyn SnapshotParticipant>,
                    Arc::new(RulesParticipant::new(self.policies.clone())),
                    Arc::new(RagParticipant::new(self.corpora.clone())),
                ]
            })
            .clone()
    }
}

/// Tells every participant to drop the pins of `id`; failures only logged (pins expire).
async fn release(participants: &[Arc<dyn SnapshotParticipant>], id: Uuid) {
    for p in participants {
        if let Err(e) = p.abort(id).await {
            tracing::warn!(participant = p.name(), snapshot = %id, error = %e, "abort failed");
        }
    }
}

async fn store_record(store: &EventStore, seq: u64) -> Option<RecordedEvent> {
    store.read_all(seq, 1).await.ok()?.pop()
}

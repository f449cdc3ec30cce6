//! Engine activation as events on `engine/{region}`: `EngineActivationRequested` is answered
//! at once (202); then, asynchronously, the artifact is found and its digest checked
//! (`EngineModelVerified`), every policy hook is bound to an ingested policy
//! (`EnginePoliciesBound`), a circuit breaker is registered (`CircuitBreakerRegistered`),
//! and `EngineActivated` closes it — or `EngineActivationFailed` names the step and reason.
//! Every step carries the request's event id as `correlation_id`.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use aether_ledger::{
    Committed, EventFilter, EventStore, ExpectedVersion, LedgerError, NewEvent, RecordedEvent,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::models::{ModelError, ModelRegistry, check_artifact, region_of};
use crate::origin::Origin;
use crate::policies::PolicyRegistry;
use crate::replay::{After, merged};
use crate::routing::{EngineRoute, RoutingTable};
use crate::snapshot::ROLLED_BACK;

pub const ACTIVATION_REQUESTED: &str = "EngineActivationRequested";
pub const MODEL_VERIFIED: &str = "EngineModelVerified";
pub const POLICIES_BOUND: &str = "EnginePoliciesBound";
pub const BREAKER_REGISTERED: &str = "CircuitBreakerRegistered";
pub const ACTIVATED: &str = "EngineActivated";
/// A rollout's promotion (`RolloutPromoted`, on the rollout's stream): the candidate
/// becomes the engine's model. Named here, where the engines' projection applies it;
/// `rollouts` writes it.
pub const PROMOTED: &str = "RolloutPromoted";
pub const ACTIVATION_FAILED: &str = "EngineActivationFailed";

/// The operator's request.
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ActivationRequest {
    pub model_ref: String,
    /// Share of traffic, in (0, 1].
    pub traffic_weight: f64,
    pub policy_hooks: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineStatus {
    Activating,
    Active,
    Failed,
    /// Not routed: a rollback restored a snapshot taken before this engine was active.
    RolledBack,
}

/// An engine as the projection sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineState {
    pub region: String,
    pub model_ref: String,
    pub traffic_weight: f64,
    pub policy_hooks: Vec<String>,
    pub status: EngineStatus,
    /// Event types of the current activation's steps so far.
    pub steps: Vec<String>,
    pub failure: Option<String>,
    /// Event id of the activation request (the correlation id of its steps).
    pub activation_id: String,
    pub stream_version: u64,
    /// The node of the cluster that runs (or ran) the activation, when it said.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("traffic_weight must be in (0, 1], got {0}")]
    BadWeight(f64),
    #[error("policy hook {0:?} is empty, repeated or not a policy name")]
    BadHook(String),
    #[error(
        "engine {region} is already activating (request {activation_id}); wait for it to finish"
    )]
    Busy {
        region: String,
        activation_id: String,
    },
    #[error("engine {region} changed while this request ran; retry")]
    Conflict { region: String },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// Engines per region, rebuilt from the ledger.
#[derive(Clone)]
pub struct EngineRegistry {
    store: EventStore,
    models: ModelRegistry,
    policies: PolicyRegistry,
    engines: Arc<RwLock<BTreeMap<String, EngineState>>>,
    /// The seqs applied here that a follower has not passed yet, and the highest applied:
    /// how [`Self::follow_step`] tells this node's own events from other nodes' and sees an
    /// event that arrives out of order.
    applied: Arc<std::sync::Mutex<Applied>>,
    /// This node's id in its cluster, recorded with each activation it runs.
    node: Arc<RwLock<Option<String>>>,
}

#[derive(Default, Clone)]
struct Applied {
    seqs: std::collections::BTreeSet<u64>,
    max: u64,
}

impl EngineRegistry {
    /// Rebuilds the engines from the ledger. An activation the last run left unfinished
    /// stays `activating` until [`Self::fail_interrupted`] records its end.
    pub async fn load(
        store: EventStore,
        models: ModelRegistry,
        policies: PolicyRegistry,
    ) -> Result<Self, LedgerError> {
        Self::load_until(store, models, policies, None).await
    }

    /// [`Self::load`] from the events with seq ≤ `upto_seq` only; writes nothing.
    pub(crate) async fn load_until(
        store: EventStore,
        models: ModelRegistry,
        policies: PolicyRegistry,
        upto_seq: Option<u64>,
    ) -> Result<Self, LedgerError> {
        let registry = EngineRegistry {
            store,
            models,
            policies,
            engines: Arc::default(),
            applied: Arc::default(),
            node: Arc::default(),
        };
        let [own, foreign @ ..] = Self::filters(upto_seq);
        merged(&registry.store, &own, &foreign, |e| registry.apply(e)).await?;
        Ok(registry)
    }

    pub fn engines(&self) -> Vec<EngineState> {
        self.engines
            .read()
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Names this node in the activations it runs, so that another node starting while one
    /// runs does not close it as interrupted ([`Self::fail_interrupted`]).
    pub fn set_node(&self, node_id: &str) {
        if let Ok(mut node) = self.node.write() {
            *node = Some(node_id.to_owned());
        }
    }

    pub fn engine(&self, region: &str) -> Option<EngineState> {
        self.engines.read().ok()?.get(region).cloned()
    }

    /// What changes engines: their own streams, and (from other streams) a promotion, which
    /// moves a region to the candidate, and a rollback, which restores a snapshot's routing.
    fn filters(upto_seq: Option<u64>) -> [EventFilter; 3] {
        let own = EventFilter {
            stream_prefix: Some("engine/".into()),
            max_seq: upto_seq,
            ..EventFilter::default()
        };
        let [promoted, rolled_back] = [
            (PROMOTED, "rollout/"),
            (ROLLED_BACK, crate::SNAPSHOT_STREAM),
        ]
        .map(|(kind, prefix)| EventFilter {
            event_type: Some(kind.into()),
            stream_prefix: Some(prefix.into()),
            max_seq: upto_seq,
            ..EventFilter::default()
        });
        [own, promoted, rolled_back]
    }

    /// What a follower of this registry reads, from the highest seq applied so far.
    pub(crate) fn following(&self) -> Vec<After> {
        let from = self.applied.lock().map(|a| a.max).unwrap_or(0);
        Self::filters(None)
            .into_iter()
            .map(|f| After::from(f, from))
            .collect()
    }

    /// Applies the activations, promotions and rollbacks that other nodes of the cluster
    /// recorded since the last step, in seq order; this node's own were applied when it
    /// wrote them and are skipped. One that comes after a later event was already applied
    /// here (another node's write that committed before this node's, seen late) cannot be
    /// applied on top: the engines are then rebuilt from the ledger.
    pub(crate) async fn follow_step(&self, after: &mut [After]) -> Result<(), LedgerError> {
        let mut new = Vec::new();
        for a in after.iter_mut() {
            while let Some(page) = a.next(&self.store).await? {
                new.extend(page);
            }
        }
        new.sort_by_key(|e| e.seq);
        let mut rebuild = false;
        for event in &new {
            let (own, in_order) = match self.applied.lock() {
                Ok(mut a) => (a.seqs.remove(&event.seq), event.seq > a.max),
                Err(_) => (false, false),
            };
            if own {
                continue;
            }
            if in_order && !rebuild {
                self.apply(event);
                if let Ok(mut a) = self.applied.lock() {
                    a.seqs.remove(&event.seq);
                }
            } else {
                rebuild = true;
            }
        }
        if rebuild {
            let fresh = Self::load_until(
                self.store.clone(),
                self.models.clone(),
                self.policies.clone(),
                None,
            )
            .await?;
            let engines = fresh.engines.read().map(|e| e.clone()).unwrap_or_default();
            if let Ok(mut mine) = self.engines.write() {
                *mine = engines;
            }
            let applied = fresh.applied.lock().map(|a| a.clone()).unwrap_or_default();
            if let Ok(mut mine) = self.applied.lock() {
                *mine = applied;
            }
            tracing::info!("engines rebuilt from the ledger: another node's change came late");
        }
        // Seqs the followers have passed cannot come again.
        let passed = new.last().map_or(0, |e| e.seq);
        if let Ok(mut a) = self.applied.lock() {
            a.seqs.retain(|&seq| seq > passed);
        }
        Ok(())
    }

    pub(crate) fn apply(&self, event: &RecordedEvent) {
        if let Ok(mut a) = self.applied.lock() {
            a.seqs.insert(event.seq);
            a.max = a.max.max(event.seq);
        }
        match event.event_type.as_str() {
            PROMOTED => return self.apply_promotion(event),
            ROLLED_BACK => {
                let payload = event.payload_value().unwrap_or_default();
                if let Some(version) = payload["routing_version"].as_str() {
                    match RoutingTable::parse(version) {
                        Ok(table) => self.restore_routing(&table.engines),
                        Err(e) => tracing::error!(seq = event.seq, error = %e, "rollback routing"),
                    }
                }
                return;
            }
            _ => {}
        }
        let Some(region) = event.stream_id.strip_prefix("engine/") else {
            return;
        };
        let p = event.payload_value().unwrap_or_default();
        let Ok(mut engines) = self.engines.write() else {
            return;
        };
        // Applying is idempotent: an engine stream's event at or below the version already
        // applied is in the state (a node's start-up load and its follower can both meet
        // an event written by another node while the load ran).
        if engines
            .get(region)
            .is_some_and(|state| event.stream_version <= state.stream_version)
        {
            return;
        }
        if event.event_type == ACTIVATION_REQUESTED {
            let request: Option<ActivationRequest> = serde_json::from_value(p).ok();
            if let Some(r) = request {
                engines.insert(
                    region.to_owned(),
                    EngineState {
                        region: region.to_owned(),
                        model_ref: r.model_ref,
                        traffic_weight: r.traffic_weight,
                        policy_hooks: r.policy_hooks,
                        status: EngineStatus::Activating,
                        steps: vec![event.event_type.clone()],
                        failure: None,
                        activation_id: event.event_id.to_string(),
                        stream_version: event.stream_version,
                        node: serde_json::from_str::<Value>(event.metadata.get())
                            .ok()
                            .and_then(|m| m["node"].as_str().map(str::to_owned)),
                    },
                );
            }
            return;
        }
        if let Some(state) = engines.get_mut(region) {
            state.stream_version = event.stream_version;
            state.steps.push(event.event_type.clone());
            match event.event_type.as_str() {
                ACTIVATED => {
                    // The activated route, as recorded: it wins over a rollback that came
                    // while this activation ran.
                    if let Ok(r) = serde_json::from_value::<ActivationRequest>(p.clone()) {
                        state.model_ref = r.model_ref;
                        state.traffic_weight = r.traffic_weight;
                        state.policy_hooks = r.policy_hooks;
                    }
                    state.status = EngineStatus::Active;
                }
                ACTIVATION_FAILED => {
                    state.status = EngineStatus::Failed;
                    state.failure = p["reason"].as_str().map(str::to_owned);
                }
                _ => {}
            }
        }
    }

    /// A promoted candidate becomes its region's model.
    fn apply_promotion(&self, event: &RecordedEvent) {
        let p = event.payload_value().unwrap_or_default();
        let (Some(region), Some(candidate)) = (p["region"].as_str(), p["candidate"].as_str())
        else {
            return;
        };
        if let Ok(mut engines) = self.engines.write()
            && let Some(engine) = engines.get_mut(region)
            && engine.status == EngineStatus::Active
        {
            engine.model_ref = candidate.to_owned();
        }
    }

    /// Makes `routes` the engines in force: each named region routes as recorded, every
    /// other active engine stops routing. Regions not in the projection are skipped
    /// (callers check them first, see [`crate::routing`]).
    pub(crate) fn restore_routing(&self, routes: &BTreeMap<String, EngineRoute>) {
        let Ok(mut engines) = self.engines.write() else {
            return;
        };
        for (region, engine) in engines.iter_mut() {
            match routes.get(region) {
                Some(route) => {
                    engine.model_ref = route.model_ref.clone();
                    engine.traffic_weight = route.traffic_weight;
                    engine.policy_hooks = route.policy_hooks.clone();
                    engine.status = EngineStatus::Active;
                    engine.failure = None;
                }
                None if engine.status == EngineStatus::Active => {
                    engine.status = EngineStatus::RolledBack;
                }
                None => {}
            }
        }
    }

    /// Validates and records an activation request, then runs its steps in the background.
    pub async fn request_activation(
        &self,
        request: ActivationRequest,
        origin: &Origin,
    ) -> Result<(Committed, tokio::task::JoinHandle<()>), EngineError> {
        let region = region_of(&request.model_ref)?.to_owned();
        if !(request.traffic_weight > 0.0 && request.traffic_weight <= 1.0) {
            return Err(EngineError::BadWeight(request.traffic_weight));
        }
        let mut seen = std::collections::HashSet::new();
        for hook in &request.policy_hooks {
            let ok = !hook.is_empty()
                && hook.len() <= 128
                && hook
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if !ok || !seen.insert(hook) {
                return Err(EngineError::BadHook(hook.clone()));
            }
        }
        let current = self.engine(&region);
        if let Some(e) = &current
            && e.status == EngineStatus::Activating
        {
            return Err(EngineError::Busy {
                region,
                activation_id: e.activation_id.clone(),
            });
        }
        let expected = ExpectedVersion::Exact(current.map_or(0, |e| e.stream_version));
        let mut metadata = origin.metadata(json!({}));
        if let Some(node) = self.node.read().ok().and_then(|n| n.clone()) {
            metadata["node"] = json!(node);
        }
        let event = NewEvent::new(
            ACTIVATION_REQUESTED,
            serde_json::to_value(&request).unwrap_or_default(),
        )
        .with_metadata(metadata);
        let committed = self.append(&region, expected, event).await?;
        let runner = self.clone();
        let origin = origin.clone();
        let request_event = committed.clone();
        let task = tokio::spawn(async move {
            runner.run_activation(request, request_event, &origin).await;
        });
        Ok((committed, task))
    }

    async fn append(
        &self,
        region: &str,
        expected: ExpectedVersion,
        event: NewEvent,
    ) -> Result<Committed, EngineError> {
        let stream = format!("engine/{region}");
        match self.store.append(&stream, expected, vec![event]).await {
            Ok(mut c) => {
                let committed = c.remove(0);
                if let Some(e) = self
                    .store
                    .read_all(committed.seq, 1)
                    .await?
                    .into_iter()
                    .next()
                {
                    self.apply(&e);
                }
                Ok(committed)
            }
            Err(LedgerError::WrongExpectedVersion { .. }) => Err(EngineError::Conflict {
                region: region.to_owned(),
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// One step event, chained to the request by correlation and to the last step by
    /// causation.
    async fn step(
        &self,
        region: &str,
        kind: &str,
        payload: Value,
        correlation: &Committed,
        cause: &Committed,
        origin: &Origin,
    ) -> Result<Committed, EngineError> {
        let event = NewEvent::new(kind, payload).with_metadata(origin.metadata(json!({
            "correlation_id": correlation.event_id,
            "causation_id": cause.event_id,
        })));
        self.append(region, ExpectedVersion::Exact(cause.stream_version), event)
            .await
    }

    async fn run_activation(
        &self,
        request: ActivationRequest,
        requested: Committed,
        origin: &Origin,
    ) {
        let region = region_of(&request.model_ref)
            .map(str::to_owned)
            .unwrap_or_default();
        let mut last = requested.clone();
        let result: Result<(), (&str, String)> = async {
            // 1. The artifact exists and has the registered digest.
            let model = self.models.get(&request.model_ref).ok_or((
                "model",
                format!("model {} is not registered", request.model_ref),
            ))?;
            check_artifact(&model.uri, &model.digest, &self.models.artifact_policy())
                .await
                .map_err(|e| ("model", e.to_string()))?;
            last = self
                .step(&region, MODEL_VERIFIED, json!({"model_ref": model.model_ref, "digest": model.digest, "uri": model.uri}), &requested, &last, origin)
                .await
                .map_err(|e| ("model", e.to_string()))?;
            // 2. Every hook names an ingested policy.
            let rules = self.policies.engine().snapshot();
            let mut bound = Vec::new();
            for hook in &request.policy_hooks {
                let policy = rules.get(hook).ok_or((
                    "policies",
                    format!("policy hook {hook:?} is not bound: no policy of that name is ingested"),
                ))?;
                bound.push(json!({"name": hook, "version": policy.version(), "digest": policy.digest_hex()}));
            }
            last = self
                .step(&region, POLICIES_BOUND, json!({"hooks": bound, "rules_digest": rules.digest_hex()}), &requested, &last, origin)
                .await
                .map_err(|e| ("policies", e.to_string()))?;
            // 3. A circuit breaker for the region.
            last = self
                .step(&region, BREAKER_REGISTERED, json!({"region": region, "max_error_rate": 0.05, "max_p99_ms": 420}), &requested, &last, origin)
                .await
                .map_err(|e| ("circuit_breaker", e.to_string()))?;
            last = self
                .step(&region, ACTIVATED, json!({"model_ref": request.model_ref, "traffic_weight": request.traffic_weight, "policy_hooks": request.policy_hooks, "rules_digest": rules.digest_hex()}), &requested, &last, origin)
                .await
                .map_err(|e| ("activate", e.to_string()))?;
            Ok(())
        }
        .await;
        if let Err((step, reason)) = result {
            let failed = self
                .step(
                    &region,
                    ACTIVATION_FAILED,
                    json!({ "step": step, "reason": reason }),
                    &requested,
                    &last,
                    origin,
                )
                .await;
            if let Err(e) = failed {
                tracing::error!(%region, error = %e, "cannot record a failed activation");
            }
        }
    }

    /// Activations that a restart interrupted are recorded as failed, not left hanging.
    /// `snapshot_id` is the snapshot in force, which the failure records like every
    /// control event.
    pub async fn fail_interrupted(
        &self,
        snapshot_id: Option<String>,
        running_elsewhere: &std::collections::HashSet<String>,
    ) -> Result<usize, EngineError> {
        let stuck: Vec<EngineState> = self
            .engines()
            .into_iter()
            .filter(|e| e.status == EngineStatus::Activating)
            .filter(|e| {
                e.node
                    .as_ref()
                    .is_none_or(|n| !running_elsewhere.contains(n))
            })
            .collect();
        for e in &stuck {
            let event = NewEvent::new(
                ACTIVATION_FAILED,
                json!({"step": "restart", "reason": "the service restarted during the activation; request it again"}),
            )
            .with_metadata(json!({"actor": "aether:control", "correlation_id": e.activation_id,
                                  "snapshot_id": snapshot_id}));
            self.append(&e.region, ExpectedVersion::Exact(e.stream_version), event)
                .await?;
        }
        Ok(stuck.len())
    }
}

//! The control plane's whole projected state as one canonical document, so that a replay
//! from seq 1 can be compared with the live service byte for byte.

use aether_ledger::hashing::{canonical_json, sm3};
use aether_ledger::{EventStore, LedgerError};
use serde_json::{Value, json};

use crate::{CorpusRegistry, EngineRegistry, ModelRegistry, PolicyRegistry, RolloutRegistry};

/// The registries that make up the control plane's state.
#[derive(Clone)]
pub struct ControlState {
    pub policies: PolicyRegistry,
    pub models: ModelRegistry,
    pub engines: EngineRegistry,
    pub rollouts: RolloutRegistry,
    pub corpora: CorpusRegistry,
}

impl ControlState {
    /// Rebuilds every projection from the ledger, from seq 1.
    pub async fn replay(store: &EventStore) -> Result<ControlState, LedgerError> {
        let policies = PolicyRegistry::load(store.clone()).await?;
        let models = ModelRegistry::load(store.clone()).await?;
        let engines = EngineRegistry::load(store.clone(), models.clone(), policies.clone()).await?;
        let rollouts = RolloutRegistry::load(store.clone(), models.clone()).await?;
        let corpora = CorpusRegistry::load(store.clone()).await?;
        Ok(ControlState {
            corpora,
            policies,
            models,
            engines,
            rollouts,
        })
    }

    /// The state as one JSON document (engines, models, policies with versions, the rule
    /// set digest, rollouts, corpora with their versions).
    pub fn document(&self) -> Value {
        json!({
            "engines": self.engines.engines(),
            "models": self.models.all(),
            "policies": self.policies.policies(),
            "rule_set_digest": hex::encode(self.policies.engine().snapshot().digest()),
            "rollouts": self.rollouts.all(),
            "corpora": self.corpora.corpora(),
        })
    }

    /// SM3 of the document's RFC 8785 text, hex.
    pub fn digest(&self) -> String {
        let text = canonical_json(&self.document()).unwrap_or_default();
        hex::encode(sm3(text.as_bytes()))
    }
}

//! The gateway's routing table as one value: what a snapshot pins for the gateway and what
//! a rollback restores.
//!
//! The table is the part of the engine and rollout projections that decides where a
//! request goes: each active engine (region → model, weight, policy hooks) and each
//! rollout that still routes traffic (progressing or paused: its step and candidate
//! weight). Its version is its RFC 8785 text, so a snapshot's pin is enough to restore it
//! after a restart, and its digest is SM3 of that text.

use std::collections::BTreeMap;

use aether_ledger::hashing::{canonical_json, sm3};
use serde::{Deserialize, Serialize};

use crate::{EngineRegistry, EngineStatus, RolloutPhase, RolloutRegistry};

/// Where an active engine sends its region's traffic.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineRoute {
    pub model_ref: String,
    pub traffic_weight: f64,
    pub policy_hooks: Vec<String>,
}

/// A rollout's share of its region's traffic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutRoute {
    pub region: String,
    pub step_index: Option<usize>,
    pub candidate_weight: u32,
    pub phase: RolloutPhase,
}

/// Active engines by region and routing rollouts by id.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingTable {
    pub engines: BTreeMap<String, EngineRoute>,
    pub rollouts: BTreeMap<String, RolloutRoute>,
}

/// A recorded routing version that is not a routing table.
#[derive(Debug, thiserror::Error)]
#[error("not a routing table: {0}")]
pub struct BadRoutingVersion(String);

impl RoutingTable {
    /// The table the gateway routes by now.
    pub fn of(engines: &EngineRegistry, rollouts: &RolloutRegistry) -> RoutingTable {
        RoutingTable {
            engines: engines
                .engines()
                .into_iter()
                .filter(|e| e.status == EngineStatus::Active)
                .map(|e| {
                    let route = EngineRoute {
                        model_ref: e.model_ref,
                        traffic_weight: e.traffic_weight,
                        policy_hooks: e.policy_hooks,
                    };
                    (e.region, route)
                })
                .collect(),
            rollouts: rollouts
                .all()
                .into_iter()
                .filter(|r| r.phase.routes())
                .map(|r| {
                    let route = RolloutRoute {
                        region: r.region,
                        step_index: r.step_index,
                        candidate_weight: r.candidate_weight,
                        phase: r.phase,
                    };
                    (r.id, route)
                })
                .collect(),
        }
    }

    /// The version a snapshot records: the table's RFC 8785 text.
    pub fn version(&self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| canonical_json(&v).ok())
            .unwrap_or_default()
    }

    /// SM3 of [`Self::version`], hex.
    pub fn digest(&self) -> String {
        hex::encode(sm3(self.version().as_bytes()))
    }

    /// Reads a version written by [`Self::version`].
    pub fn parse(version: &str) -> Result<RoutingTable, BadRoutingVersion> {
        serde_json::from_str(version).map_err(|e| BadRoutingVersion(e.to_string()))
    }
}

/// Makes `table` the routing in force, in both projections: every region and rollout it
/// names must exist, and nothing changes unless all do.
pub(crate) fn restore(
    table: &RoutingTable,
    engines: &EngineRegistry,
    rollouts: &RolloutRegistry,
) -> Result<(), String> {
    if let Some(region) = table.engines.keys().find(|r| engines.engine(r).is_none()) {
        return Err(format!("no engine in region {region}"));
    }
    if let Some(id) = table.rollouts.keys().find(|id| rollouts.get(id).is_none()) {
        return Err(format!("no rollout {id}"));
    }
    engines.restore_routing(&table.engines);
    rollouts.restore_routing(&table.rollouts);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_round_trips_and_digest_is_of_the_canonical_text() {
        let mut table = RoutingTable::default();
        table.engines.insert(
            "eu".into(),
            EngineRoute {
                model_ref: "eu/m@1".into(),
                traffic_weight: 0.5,
                policy_hooks: vec!["aml_v2".into()],
            },
        );
        table.rollouts.insert(
            "r1".into(),
            RolloutRoute {
                region: "eu".into(),
                step_index: Some(2),
                candidate_weight: 5,
                phase: RolloutPhase::Paused,
            },
        );
        let version = table.version();
        assert_eq!(RoutingTable::parse(&version).unwrap(), table);
        assert_eq!(table.digest(), hex::encode(sm3(version.as_bytes())));
        assert!(version.starts_with(r#"{"engines":{"eu":{"model_ref":"eu/m@1""#));
    }

    #[test]
    fn a_digest_or_garbage_is_not_a_version() {
        assert!(RoutingTable::parse("ab12").is_err());
        assert!(RoutingTable::parse(r#"{"engines":{},"rollouts":{},"x":1}"#).is_err());
    }
}

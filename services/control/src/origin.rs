//! Who asked and under which trace: traffic colouring carried into every event's metadata.
//!
//! The same rules serve HTTP headers and gRPC metadata: `X-Trace-ID` (generated when
//! absent), W3C `traceparent`, `X-Model-Stage` (`blue-…` or `green-…`, lower-cased) and the
//! semantic tag (`t-…`, `d-…`, `s-…`, `c-…` or `f-…`).

use serde::Serialize;
use serde_json::{Map, Value};

/// Why colouring headers were refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ColouringError {
    #[error("X-Trace-ID must be 1-64 characters of letters, digits, '-', '_' or '.', got {0:?}")]
    TraceId(String),
    #[error(
        "traceparent must be W3C trace context 00-<32 hex>-<16 hex>-<2 hex> (non-zero ids), got {0:?}"
    )]
    TraceParent(String),
    #[error(
        "X-Model-Stage must be blue-<name> or green-<name> (letters, digits, '.', '-'), got {0:?}"
    )]
    ModelStage(String),
    #[error(
        "the semantic tag must be t-, d-, s-, c- or f- followed by 1-63 lowercase letters, digits, '.', '_' or '-', got {0:?}"
    )]
    SemanticTag(String),
}

/// The caller and the trace a change was made under.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Origin {
    pub actor: String,
    pub trace_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_stage: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub semantic_tag: Option<String>,
    /// The consistent snapshot in force when the change was asked for (null before the
    /// first); set by [`crate::ControlState::under_snapshot`].
    pub snapshot_id: Option<String>,
    /// The lease a singleton duty (the rollout controller) acts under: the database stores
    /// the change only while that lease's token is current, so a holder paused past its
    /// lease cannot act when it wakes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence: Option<aether_ledger::cluster::Fence>,
}

impl From<&str> for Origin {
    /// An actor with a fresh trace id (for internal callers and tests).
    fn from(actor: &str) -> Origin {
        Origin {
            actor: actor.to_owned(),
            trace_id: new_trace_id(),
            ..Origin::default()
        }
    }
}

fn new_trace_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

impl Origin {
    /// Validates colouring values as received (any may be absent).
    pub fn from_headers(
        actor: &str,
        trace_id: Option<&str>,
        traceparent: Option<&str>,
        model_stage: Option<&str>,
        semantic_tag: Option<&str>,
    ) -> Result<Origin, ColouringError> {
        let traceparent = traceparent.map(parse_traceparent).transpose()?;
        let trace_id = match trace_id {
            Some(t) => {
                let ok = !t.is_empty()
                    && t.len() <= 64
                    && t.chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
                if !ok {
                    return Err(ColouringError::TraceId(t.to_owned()));
                }
                t.to_owned()
            }
            None => traceparent
                .as_ref()
                .map(|(id, _)| id.clone())
                .unwrap_or_else(new_trace_id),
        };
        let model_stage = model_stage
            .map(|s| {
                let lower = s.trim().to_ascii_lowercase();
                let rest = lower
                    .strip_prefix("blue-")
                    .or_else(|| lower.strip_prefix("green-"));
                match rest {
                    Some(r)
                        if !r.is_empty()
                            && r.len() <= 64
                            && r.chars().all(|c| {
                                c.is_ascii_lowercase()
                                    || c.is_ascii_digit()
                                    || matches!(c, '.' | '-')
                            }) =>
                    {
                        Ok(lower)
                    }
                    _ => Err(ColouringError::ModelStage(s.to_owned())),
                }
            })
            .transpose()?;
        let semantic_tag = semantic_tag
            .map(|t| {
                let bytes = t.as_bytes();
                let ok = t.len() >= 3
                    && t.len() <= 65
                    && matches!(bytes[0], b't' | b'd' | b's' | b'c' | b'f')
                    && bytes[1] == b'-'
                    && t[2..].chars().all(|c| {
                        c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-')
                    });
                if ok {
                    Ok(t.to_owned())
                } else {
                    Err(ColouringError::SemanticTag(t.to_owned()))
                }
            })
            .transpose()?;
        Ok(Origin {
            actor: actor.to_owned(),
            trace_id,
            traceparent: traceparent.map(|(_, full)| full),
            model_stage,
            semantic_tag,
            snapshot_id: None,
            fence: None,
        })
    }

    /// Event metadata: actor and colouring, plus `extra` members.
    pub fn metadata(&self, extra: Value) -> Value {
        let mut map = match serde_json::to_value(self) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        };
        if let Value::Object(extra) = extra {
            map.extend(extra);
        }
        Value::Object(map)
    }
}

/// Whether `value` is a W3C `traceparent` this service follows (version 00 form, non-zero
/// ids, lowercase hex).
pub fn valid_traceparent(value: &str) -> bool {
    parse_traceparent(value).is_ok()
}

/// `(trace id, whole header)` of a valid W3C traceparent.
fn parse_traceparent(value: &str) -> Result<(String, String), ColouringError> {
    let err = || ColouringError::TraceParent(value.to_owned());
    let parts: Vec<&str> = value.trim().split('-').collect();
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    };
    match parts.as_slice() {
        [version, trace, parent, flags]
            if hex(version, 2)
                && *version != "ff"
                && hex(trace, 32)
                && hex(parent, 16)
                && hex(flags, 2)
                && trace.chars().any(|c| c != '0')
                && parent.chars().any(|c| c != '0') =>
        {
            Ok((trace.to_string(), value.trim().to_owned()))
        }
        _ => Err(err()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colouring_is_validated_and_normalised() {
        let o = Origin::from_headers(
            "operator:x",
            None,
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("Green-FinMoE-v3"),
            Some("t-trade.42"),
        )
        .unwrap();
        assert_eq!(o.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(o.model_stage.as_deref(), Some("green-finmoe-v3"));
        let meta = o.metadata(serde_json::json!({"correlation_id": "c"}));
        assert_eq!(meta["semantic_tag"], "t-trade.42");
        assert_eq!(meta["correlation_id"], "c");
        assert_eq!(meta["actor"], "operator:x");

        let generated = Origin::from_headers("a", None, None, None, None).unwrap();
        assert_eq!(generated.trace_id.len(), 32);
        assert_eq!(
            Origin::from_headers("a", Some("given-1"), None, None, None)
                .unwrap()
                .trace_id,
            "given-1"
        );
        for bad in ["purple-x", "blue-", "green-a b", "blue"] {
            assert!(
                Origin::from_headers("a", None, None, Some(bad), None).is_err(),
                "{bad}"
            );
        }
        for bad in ["x-1", "t-", "T-x", "t-UPPER", "t_x"] {
            assert!(
                Origin::from_headers("a", None, None, None, Some(bad)).is_err(),
                "{bad}"
            );
        }
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        ] {
            assert!(
                Origin::from_headers("a", None, Some(bad), None, None).is_err(),
                "{bad}"
            );
        }
        assert!(Origin::from_headers("a", Some(""), None, None, None).is_err());
        assert!(Origin::from_headers("a", Some(&"x".repeat(65)), None, None, None).is_err());
    }
}

//! JSON input to CEL values.
//!
//! Done here rather than through `cel`'s serde support, which turns every non-negative
//! JSON integer into a CEL `uint`; then `request.amount_minor + 1` would fail (CEL has no
//! `uint + int`). Here an integer is an `int` whenever it fits in i64, a `uint` only above
//! that, and any other number a `double`.

use std::collections::HashMap;
use std::sync::Arc;

use cel::Value;
use cel::objects::{Key, Map};

/// Deepest JSON nesting accepted in `request` and `context`.
pub const MAX_INPUT_DEPTH: usize = 64;

/// Converts a JSON value, or `None` when it nests deeper than [`MAX_INPUT_DEPTH`].
pub(crate) fn to_cel(value: &serde_json::Value) -> Option<Value> {
    convert(value, 0)
}

fn convert(value: &serde_json::Value, depth: usize) -> Option<Value> {
    if depth > MAX_INPUT_DEPTH {
        return None;
    }
    Some(match value {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::Int(i)
            } else if let Some(u) = n.as_u64() {
                Value::UInt(u)
            } else {
                Value::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::String(Arc::new(s.clone())),
        serde_json::Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                out.push(convert(item, depth + 1)?);
            }
            Value::List(Arc::new(out))
        }
        serde_json::Value::Object(members) => {
            let mut out: HashMap<Key, Value> = HashMap::with_capacity(members.len());
            for (k, v) in members {
                out.insert(Key::from(k.as_str()), convert(v, depth + 1)?);
            }
            Value::Map(Map { map: Arc::new(out) })
        }
    })
}

/// The JSON type name of a value, for error messages.
pub(crate) fn json_type_name(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a bool",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The CEL type name of a value, for error messages.
pub(crate) fn cel_type_name(value: &Value) -> String {
    match value {
        Value::List(_) => "list".into(),
        Value::Map(_) => "map".into(),
        Value::Function(name, _) => format!("function {name}"),
        Value::Int(i) => format!("int ({i})"),
        Value::UInt(u) => format!("uint ({u})"),
        Value::Float(f) => format!("double ({f})"),
        Value::String(_) => "string".into(),
        Value::Bytes(_) => "bytes".into(),
        Value::Bool(b) => format!("bool ({b})"),
        Value::Null => "null".into(),
        other => format!("{:?}", other.type_of()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn integers_are_ints_when_they_fit() {
        assert!(matches!(to_cel(&json!(5)), Some(Value::Int(5))));
        assert!(matches!(to_cel(&json!(-5)), Some(Value::Int(-5))));
        assert!(matches!(
            to_cel(&json!(u64::MAX)),
            Some(Value::UInt(u64::MAX))
        ));
        assert!(matches!(to_cel(&json!(1.5)), Some(Value::Float(f)) if f == 1.5));
    }

    #[test]
    fn too_deep_is_refused() {
        let mut v = json!(1);
        for _ in 0..(MAX_INPUT_DEPTH + 1) {
            v = json!([v]);
        }
        assert!(to_cel(&v).is_none());
    }
}

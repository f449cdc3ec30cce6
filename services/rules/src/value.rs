//! JSON input to CEL values.
//!
//! Done here rather than through `cel`'s serde support, which turns every non-negative
//! JSON integer into a CEL `uint`; then `request.amount_minor + 1` would fail (CEL has no
//! `uint + int`). Here an integer is an `int` whenever it fits in i64, a `uint` only above
//! that, and any other number a `double`.

use std::collections::HashMap;

use cel::Value;
use cel::common::types::{
    CelBool, CelDouble, CelInt, CelList, CelMap, CelMapKey, CelNull, CelString, CelUInt,
};
use cel::common::value::Val;

/// Deepest JSON nesting accepted in `request` and `context`.
pub const MAX_INPUT_DEPTH: usize = 64;

/// Converts a JSON value straight to the interpreter's value types, or `None` when it nests
/// deeper than [`MAX_INPUT_DEPTH`].
///
/// Why not through the `Value` enum and `Box<dyn Val>::try_from`: that conversion copies a
/// map or list and each of its members twice more; binding the request whole
/// (`has(request.x)`) that way was a sixth of a decision's rule evaluation.
pub(crate) fn to_val(value: &serde_json::Value) -> Option<Box<dyn Val>> {
    val(value, 0)
}

fn val(value: &serde_json::Value, depth: usize) -> Option<Box<dyn Val>> {
    if depth > MAX_INPUT_DEPTH {
        return None;
    }
    Some(match value {
        serde_json::Value::Null => Box::new(CelNull),
        serde_json::Value::Bool(b) => Box::new(CelBool::from(*b)),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Box::new(CelInt::from(i))
            } else if let Some(u) = n.as_u64() {
                Box::new(CelUInt::from(u))
            } else {
                Box::new(CelDouble::from(n.as_f64().unwrap_or(f64::NAN)))
            }
        }
        serde_json::Value::String(s) => Box::new(CelString::from(s.clone())),
        serde_json::Value::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                out.push(val(item, depth + 1)?);
            }
            Box::new(CelList::from(out))
        }
        serde_json::Value::Object(members) => {
            let mut out: HashMap<CelMapKey<'static>, Box<dyn Val>> =
                HashMap::with_capacity(members.len());
            for (k, v) in members {
                out.insert(CelMapKey::from(k.clone()), val(v, depth + 1)?);
            }
            Box::new(CelMap::from(out))
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
    use std::sync::Arc;

    use cel::objects::{Key, Map};
    use serde_json::json;

    use super::*;

    /// Converts a JSON value to the interpreter's `Value` enum, or `None` when it nests deeper
    /// than [`MAX_INPUT_DEPTH`]: the reference [`to_val`] is tested against.
    fn to_cel(value: &serde_json::Value) -> Option<Value> {
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

    #[test]
    fn integers_are_ints_when_they_fit() {
        assert!(matches!(to_cel(&json!(5)), Some(Value::Int(5))));
        assert!(matches!(to_cel(&json!(-5)), Some(Value::Int(-5))));
        assert!(matches!(
            to_cel(&json!(u64::MAX)),
            Some(Value::UInt(u64::MAX))
        ));
        assert!(matches!(to_cel(&json!(1.5)), Some(Value::Float(f)) if f == 1.5));
        // The same for the conversion rules run with.
        let int = to_val(&json!(-5)).unwrap();
        assert_eq!(int.get_type(), CelInt::cel_type());
        let uint = to_val(&json!(u64::MAX)).unwrap();
        assert_eq!(uint.get_type(), CelUInt::cel_type());
        let double = to_val(&json!(1.5)).unwrap();
        assert_eq!(double.get_type(), CelDouble::cel_type());
    }

    #[test]
    fn too_deep_is_refused() {
        let mut v = json!(1);
        for _ in 0..(MAX_INPUT_DEPTH + 1) {
            v = json!([v]);
        }
        assert!(to_cel(&v).is_none());
        assert!(to_val(&v).is_none());
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            (-1e12f64..1e12).prop_map(serde_json::Value::from),
            "[a-zé中]{0,6}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 32, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map("[a-c]{1,2}", inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// The direct conversion gives what the interpreter's own conversion of `to_cel`
        /// gives: same type, equal value.
        #[test]
        fn direct_conversion_equals_the_interpreters(v in json_value()) {
            let direct = to_val(&v).expect("shallow");
            let via: Box<dyn Val> = to_cel(&v).expect("shallow").try_into().expect("converts");
            proptest::prop_assert_eq!(direct.get_type(), via.get_type());
            proptest::prop_assert!(direct.equals(via.as_ref()), "{v}");
        }
    }
}

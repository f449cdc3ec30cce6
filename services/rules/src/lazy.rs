//! `request` and `context` bound member by member, each converted to a CEL value only when
//! a rule first reads it.
//!
//! Why: the gateway's context carries the member's recent trades (up to a hundred maps),
//! and only the structuring rule reads them, after its cheap amount test. Converting the
//! whole context for every request was a third of the gateway's CPU.
//!
//! CEL resolves a qualified name most specific first (`context.recent` before `context`,
//! as cel-go does), so `context.recent` is answered without building the other members. A
//! rule that uses a variable whole (`has(context.x)`, `context["x"]`) gets all of it, built
//! once per evaluation.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::OnceLock;

use cel::Context;
use cel::common::types::{CelMap, CelMapKey};
use cel::common::value::{CowVal, Val};
use cel::context::VariableResolver;

use crate::compile::cel_env;
use crate::value::{MAX_INPUT_DEPTH, to_val};

/// A JSON object whose members are produced on demand: the `request` or `context` of an
/// evaluation (see [`crate::RuleSet::evaluate_members`]).
pub trait Members: Sync {
    /// Every member's name (used when a rule reads the object whole).
    fn names(&self) -> Vec<Cow<'_, str>>;
    /// One member's value, or `None` when the object has no such member.
    fn member(&self, name: &str) -> Option<Cow<'_, serde_json::Value>>;
}

impl Members for serde_json::Map<String, serde_json::Value> {
    fn names(&self) -> Vec<Cow<'_, str>> {
        self.keys().map(|k| Cow::Borrowed(k.as_str())).collect()
    }

    fn member(&self, name: &str) -> Option<Cow<'_, serde_json::Value>> {
        self.get(name).map(Cow::Borrowed)
    }
}

type Converted = Result<Box<dyn Val>, String>;

/// One variable: its members converted on first use, and the whole object if asked for.
struct LazyObject<'s> {
    variable: &'static str,
    source: &'s dyn Members,
    members: HashMap<Cow<'s, str>, OnceLock<Option<Converted>>>,
    whole: OnceLock<Converted>,
}

impl<'s> LazyObject<'s> {
    fn new(variable: &'static str, source: &'s dyn Members) -> Self {
        let members = source
            .names()
            .into_iter()
            .map(|n| (n, OnceLock::new()))
            .collect();
        LazyObject {
            variable,
            source,
            members,
            whole: OnceLock::new(),
        }
    }

    fn member(&self, name: &str) -> Option<&Converted> {
        let cell = self.members.get(name)?;
        cell.get_or_init(|| {
            let value = self.source.member(name)?;
            Some(to_val(&value).ok_or_else(|| too_deep(self.variable, Some(name))))
        })
        .as_ref()
    }

    fn whole(&self) -> &Converted {
        self.whole.get_or_init(|| {
            let mut map: HashMap<CelMapKey<'static>, Box<dyn Val>> =
                HashMap::with_capacity(self.members.len());
            for name in self.members.keys() {
                let Some(value) = self.source.member(name) else {
                    continue;
                };
                let value = to_val(&value).ok_or_else(|| too_deep(self.variable, Some(name)))?;
                map.insert(CelMapKey::from(name.clone().into_owned()), value);
            }
            Ok(Box::new(CelMap::from(map)) as Box<dyn Val>)
        })
    }

    /// The first member (or whole object) that could not be converted, and why.
    fn failure(&self) -> Option<&str> {
        fn failed(c: &Converted) -> Option<&str> {
            c.as_ref().err().map(String::as_str)
        }
        self.whole.get().and_then(failed).or_else(|| {
            self.members
                .values()
                .filter_map(|cell| cell.get()?.as_ref())
                .find_map(failed)
        })
    }
}

fn too_deep(variable: &str, member: Option<&str>) -> String {
    let name = member.map_or_else(|| variable.to_owned(), |m| format!("{variable}.{m}"));
    format!("cannot bind `{name}`: it nests deeper than {MAX_INPUT_DEPTH} levels")
}

/// `request` and `context` of one evaluation, as a CEL variable resolver.
pub(crate) struct Bindings<'s> {
    request: LazyObject<'s>,
    context: LazyObject<'s>,
}

impl<'s> Bindings<'s> {
    pub(crate) fn new(request: &'s dyn Members, context: &'s dyn Members) -> Self {
        Bindings {
            request: LazyObject::new("request", request),
            context: LazyObject::new("context", context),
        }
    }

    /// A CEL context that resolves `request` and `context` through these bindings.
    pub(crate) fn cel_context(&self) -> Context<'_, '_> {
        let mut ctx = Context::with_env(cel_env());
        ctx.set_variable_resolver(self);
        ctx
    }

    /// Why a variable a rule read could not be bound, if that happened.
    pub(crate) fn failure(&self) -> Option<&str> {
        self.request.failure().or_else(|| self.context.failure())
    }
}

impl VariableResolver for Bindings<'_> {
    fn resolve<'b>(&'b self, variable: &str) -> Option<CowVal<'b, 'b>> {
        let (name, member) = match variable.split_once('.') {
            Some((name, member)) => (name, Some(member)),
            None => (variable, None),
        };
        let object = match name {
            "request" => &self.request,
            "context" => &self.context,
            _ => return None,
        };
        let converted = match member {
            None => object.whole(),
            // `context.limits.x`: CEL asks again for `context.limits`.
            Some(m) if m.contains('.') => return None,
            Some(m) => object.member(m)?,
        };
        let value: &(dyn Val + 'static) = converted.as_ref().ok()?.as_ref();
        Some(CowVal::Borrowed(value))
    }
}

//! Reading a request's parameters and body: each malformed value is the caller's 400 or
//! 422 with what was expected, never a server error.

use std::collections::HashMap;

use aether_ledger::ExpectedVersion;
use axum::extract::Query;
use axum::extract::rejection::QueryRejection;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::problem::Problem;

/// The largest seq a caller may name: the largest integer JSON carries exactly (and that
/// access records and answers can hold). A ledger reaches it after 285 years at a million
/// events a second.
pub const MAX_SEQ: u64 = (1 << 53) - 1;

/// A seq from a path or query: an integer from 1 to [`MAX_SEQ`].
pub fn parse_seq(seq: &str) -> Result<u64, Problem> {
    seq.parse()
        .ok()
        .filter(|s| (1..=MAX_SEQ).contains(s))
        .ok_or_else(|| {
            Problem::bad_request(format!(
                "seq must be an integer from 1 to {MAX_SEQ}, got {seq:?}"
            ))
        })
}

pub fn parse_u64(
    params: &HashMap<String, String>,
    name: &str,
    default: u64,
) -> Result<u64, Problem> {
    match params.get(name) {
        None => Ok(default),
        // Every numeric parameter is a seq, a size or a count, recorded as JSON in access
        // records: bounded by what JSON carries exactly.
        Some(v) => v.parse().ok().filter(|n| *n <= MAX_SEQ).ok_or_else(|| {
            Problem::bad_request(format!(
                "query parameter {name} must be an integer from 0 to {MAX_SEQ}, got {v:?}"
            ))
        }),
    }
}

pub type Params = Result<Query<HashMap<String, String>>, QueryRejection>;

pub fn params(query: Params, allowed: &[&str]) -> Result<HashMap<String, String>, Problem> {
    let Query(params) = query.map_err(|e| Problem::bad_request(e.body_text()))?;
    if let Some(unknown) = params.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(Problem::bad_request(format!(
            "unknown query parameter {unknown:?}; expected one of {}",
            allowed.join(", ")
        )));
    }
    Ok(params)
}

pub fn time_param(
    params: &HashMap<String, String>,
    name: &str,
) -> Result<Option<DateTime<Utc>>, Problem> {
    params
        .get(name)
        .map(|v| {
            DateTime::parse_from_rfc3339(v)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|e| {
                    Problem::bad_request(format!("{name} must be an RFC 3339 time, got {v:?}: {e}"))
                })
        })
        .transpose()
}

/// A JSON integer in a request body, written `7` or `7.0` (JSON Schema's `integer` admits
/// both), from 0 to 2^53 − 1 (what JSON carries exactly).
pub fn json_integer<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    use serde::de::Error as _;
    let number = serde_json::Number::deserialize(d)?;
    let exact = number.as_u64().or_else(|| {
        number
            .as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= MAX_SEQ as f64)
            .map(|f| f as u64)
    });
    exact.filter(|n| *n <= MAX_SEQ).ok_or_else(|| {
        D::Error::custom(format!(
            "expected an integer from 0 to {MAX_SEQ}, got {number}"
        ))
    })
}

/// [`json_integer`] for an optional member.
pub fn json_integer_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    struct Wrapped(#[serde(deserialize_with = "json_integer")] u64);
    Ok(Option::<Wrapped>::deserialize(d)?.map(|Wrapped(n)| n))
}

pub fn json_body<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, Problem> {
    serde_json::from_slice(body).map_err(|e| {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid request",
            format!("the body is not a valid {what}: {e}"),
        )
    })
}

/// An append's `expected_version`: absent, `any`, `no_stream`, `stream_exists` or a number.
pub fn expected_version(v: Option<serde_json::Value>) -> Result<ExpectedVersion, Problem> {
    match &v {
        None => Ok(ExpectedVersion::Any),
        Some(serde_json::Value::Number(n)) if n.as_u64().is_some() => {
            Ok(ExpectedVersion::Exact(n.as_u64().unwrap_or_default()))
        }
        Some(serde_json::Value::String(s)) if s == "any" => Ok(ExpectedVersion::Any),
        Some(serde_json::Value::String(s)) if s == "no_stream" => Ok(ExpectedVersion::NoStream),
        Some(serde_json::Value::String(s)) if s == "stream_exists" => {
            Ok(ExpectedVersion::StreamExists)
        }
        Some(other) => Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid event",
            format!(
                "expected_version must be a non-negative integer, \"any\", \"no_stream\" or \"stream_exists\", got {other}"
            ),
        )),
    }
}

//! Who may call a route, and the ledger's record of what regulators read: a bearer token or
//! the console's session cookie, checked against the roles a route allows.

use aether_control::Origin;
use aether_ledger::{ExpectedVersion, NewEvent};
use axum::http::{HeaderMap, StatusCode, header};
use serde_json::{Value, json};

use crate::auth::{Caller, Role};
use crate::problem::Problem;
use crate::state::AppState;

/// Stream of access records.
pub const ACCESS_STREAM: &str = "access/audit";
/// The type of an access record.
pub const ACCESS_EVENT_TYPE: &str = "AuditQueried";
/// Checks the caller and that its role is one of `allowed`: the bearer token, or without
/// one the console's session cookie (whose writes the session middleware checked).
pub fn authorize(
    state: &AppState,
    headers: &HeaderMap,
    allowed: &[Role],
) -> Result<Caller, Problem> {
    let caller = match headers.get(header::AUTHORIZATION) {
        Some(value) => {
            let token = value
                .to_str()
                .unwrap_or_default()
                .strip_prefix("Bearer ")
                .ok_or_else(|| {
                    Problem::new(
                        StatusCode::UNAUTHORIZED,
                        "Unauthorized",
                        "Authorization must use the Bearer scheme",
                    )
                })?;
            state.tokens.caller(token.trim()).ok_or_else(|| {
                Problem::new(StatusCode::UNAUTHORIZED, "Unauthorized", "unknown token")
            })?
        }
        None => match crate::sessions::cookie(headers) {
            Some(id) => state
                .sessions
                .get(id, chrono::Utc::now())
                .map(|s| s.caller)
                .ok_or_else(|| {
                    Problem::new(
                        StatusCode::UNAUTHORIZED,
                        "Unauthorized",
                        "the console session has ended (signed out, expired, or opened on \
                         another node); sign in again",
                    )
                })?,
            None => {
                return Err(Problem::new(
                    StatusCode::UNAUTHORIZED,
                    "Unauthorized",
                    "missing Authorization: Bearer <token>",
                ));
            }
        },
    };
    if allowed.contains(&caller.role) {
        Ok(caller)
    } else {
        Err(Problem::new(
            StatusCode::FORBIDDEN,
            "Forbidden",
            format!("role {} may not do this", caller.role.name()),
        ))
    }
}

/// An operator's write: the caller authenticated as an operator, and the request's
/// colouring with that caller as actor and the snapshot in force, which every event
/// written on the request names. Extracted before the body, so a caller without the role
/// is refused before anything is read.
pub struct Operator(pub Origin);

impl axum::extract::FromRequestParts<AppState> for Operator {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Problem> {
        let caller = authorize(state, &parts.headers, &[Role::Operator])?;
        Ok(Operator(state.control.under_snapshot(Origin {
            actor: caller.actor,
            ..coloured(parts)?.clone()
        })))
    }
}

/// The request's colouring, which the middleware sets on every request.
pub fn coloured(parts: &axum::http::request::Parts) -> Result<&Origin, Problem> {
    parts.extensions.get::<Origin>().ok_or_else(|| {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "Internal error",
            "the request was not coloured (trace id missing)",
        )
    })
}

/// A regulator's query: the caller authenticated as a regulator and the request's trace id,
/// which the access record names. Extracted before anything else is read.
pub struct Auditor {
    pub(crate) actor: String,
    trace_id: String,
}

impl Auditor {
    /// A caller whose access is recorded other than through this extractor (a console
    /// session's sign-in, sign-out and page views).
    pub fn new(actor: String, trace_id: String) -> Auditor {
        Auditor { actor, trace_id }
    }
}

impl axum::extract::FromRequestParts<AppState> for Auditor {
    type Rejection = Problem;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Problem> {
        let caller = authorize(state, &parts.headers, &[Role::Regulator])?;
        Ok(Auditor {
            actor: caller.actor,
            trace_id: coloured(parts)?.trace_id.clone(),
        })
    }
}

/// Records the access in the ledger; the answer waits for that record to commit.
pub async fn record_access(
    state: &AppState,
    auditor: &Auditor,
    what: &str,
    details: Value,
) -> Result<(), Problem> {
    let event = NewEvent::new(
        ACCESS_EVENT_TYPE,
        json!({ "query": what, "details": details }),
    )
    .with_metadata(json!({ "actor": auditor.actor, "trace_id": auditor.trace_id }));
    state
        .store
        .append(ACCESS_STREAM, ExpectedVersion::Any, vec![event])
        .await
        .map(|_| ())
        .map_err(|e| {
            tracing::error!(error = %e, "cannot record an audit access");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "Access not recorded",
                "the access record could not be written to the ledger, so the query was not run",
            )
        })
}

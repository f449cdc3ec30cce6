//! The one error shape of every route: an RFC 9457 problem (`application/problem+json`),
//! and how each ledger error becomes one.

use aether_ledger::LedgerError;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An RFC 9457 problem.
#[derive(Debug)]
pub struct Problem {
    pub(crate) status: StatusCode,
    title: &'static str,
    detail: String,
    extra: serde_json::Map<String, serde_json::Value>,
    /// Seconds for `Retry-After`, when asking again soon may succeed.
    retry_after: Option<u32>,
}

impl Problem {
    pub fn new(status: StatusCode, title: &'static str, detail: impl Into<String>) -> Problem {
        Problem {
            status,
            title,
            detail: detail.into(),
            extra: serde_json::Map::new(),
            retry_after: None,
        }
    }

    /// Adds `Retry-After: seconds`.
    pub fn retry_after(mut self, seconds: u32) -> Problem {
        self.retry_after = Some(seconds);
        self
    }

    /// The HTTP status it is answered with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// What went wrong, for a log line where no answer can carry it any more.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    pub fn bad_request(detail: impl Into<String>) -> Problem {
        Problem::new(StatusCode::BAD_REQUEST, "Bad request", detail)
    }

    pub fn with(mut self, key: &str, value: serde_json::Value) -> Problem {
        self.extra.insert(key.to_owned(), value);
        self
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut body = self.extra;
        body.insert("type".into(), json!("about:blank"));
        body.insert("title".into(), json!(self.title));
        body.insert("status".into(), json!(self.status.as_u16()));
        body.insert("detail".into(), json!(self.detail));
        let mut response = (self.status, axum::Json(body)).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<LedgerError> for Problem {
    fn from(e: LedgerError) -> Problem {
        match &e {
            LedgerError::TooLarge { .. } => Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Payload too large",
                e.to_string(),
            ),
            e if e.is_input_error() => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid event",
                e.to_string(),
            ),
            LedgerError::WrongExpectedVersion { actual, .. } => Problem::new(
                StatusCode::CONFLICT,
                "Wrong expected version",
                e.to_string(),
            )
            .with("actual_version", json!(actual)),
            LedgerError::DuplicateEventId { .. } => {
                Problem::new(StatusCode::CONFLICT, "Duplicate event id", e.to_string())
            }
            LedgerError::Fenced(_) => Problem::new(
                StatusCode::CONFLICT,
                "Lease moved",
                format!(
                    "{e}; this node no longer holds the lease the write was made under, so \
                     nothing was written: retry"
                ),
            )
            .retry_after(1),
            LedgerError::Overloaded => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "Ledger overloaded",
                e.to_string(),
            ),
            LedgerError::WriterClosed => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "Shutting down",
                e.to_string(),
            ),
            e if e.is_unavailable() => {
                tracing::warn!(error = %e, "the ledger database is unavailable");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Ledger unavailable",
                    "the ledger database cannot be reached or did not answer in time; nothing was written, try again",
                )
                .retry_after(1)
            }
            _ => {
                tracing::error!(error = %e, "ledger error");
                Problem::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Ledger unavailable",
                    "the ledger could not complete the request; see the server log",
                )
            }
        }
    }
}

/// The answer to a path no route takes.
pub async fn not_found() -> Problem {
    Problem::new(StatusCode::NOT_FOUND, "Not found", "no such resource")
}

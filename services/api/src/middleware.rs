//! What every request passes through before its route: U+0000 refused, traffic coloured
//! and traced.

use aether_control::Origin;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};

use crate::problem::Problem;

/// Refuses a request whose path or query holds U+0000 (`%00`) with 400: no route takes
/// one, and passed on it would reach a database query (PostgreSQL refuses NUL in text)
/// and come back as a server error instead of the caller's.
pub async fn refuse_nul(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let uri = request.uri();
    let raw = [uri.path(), uri.query().unwrap_or("")];
    let has_nul = raw.iter().any(|part| {
        part.contains('\0') || percent_encoding::percent_decode_str(part).any(|b| b == 0)
    });
    if has_nul {
        return Problem::bad_request(
            "the request's path or query contains U+0000 (%00), which no parameter accepts",
        )
        .into_response();
    }
    next.run(request).await
}

/// Traffic colouring on every call: validates `X-Trace-ID`, `traceparent`,
/// `X-Model-Stage` and `X-Semantic-Tag` (400 when malformed), generates a trace id when
/// absent, hands the [`Origin`] (without actor) to handlers, and returns `X-Trace-ID`.
pub async fn colour(mut request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let origin = {
        let headers = request.headers();
        let header = |name: &str| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap_or("\u{fffd}").to_owned())
        };
        Origin::from_headers(
            "",
            header("x-trace-id").as_deref(),
            header("traceparent").as_deref(),
            header("x-model-stage").as_deref(),
            header("x-semantic-tag").as_deref(),
        )
    };
    let origin = match origin {
        Ok(o) => o,
        Err(e) => return Problem::bad_request(e.to_string()).into_response(),
    };
    let trace_id = HeaderValue::from_str(&origin.trace_id).ok();
    // The call's span (off unless traces are exported): a child of the caller's
    // `traceparent`, validated just above.
    let traceparent = request
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let traced = aether_gateway::telemetry::sampled(&origin.trace_id, &traceparent);
    let span = if !traced {
        tracing::Span::none()
    } else {
        tracing::debug_span!(
        target: "aether",
        "http.request",
        otel.name = %format!("{} {}", request.method(), request.uri().path()),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        http.request.method = %request.method(),
        url.path = %request.uri().path(),
        http.response.status_code = tracing::field::Empty,
        aether.trace_id = %origin.trace_id,
        )
    };
    let tracestate = request
        .headers()
        .get("tracestate")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let baggage = request
        .headers()
        .get("baggage")
        .and_then(|v| v.to_str().ok())
        .filter(|b| aether_gateway::telemetry::valid_baggage(b))
        .unwrap_or_default();
    aether_gateway::telemetry::follow_context(&span, &traceparent, tracestate, baggage);
    let ids = aether_gateway::telemetry::LogIds::new(&origin.trace_id);
    request.extensions_mut().insert(origin);
    let mut response = {
        use tracing::Instrument as _;
        aether_gateway::telemetry::with_log_ids(ids, next.run(request).instrument(span.clone()))
            .await
    };
    span.record("http.response.status_code", response.status().as_u16());
    if response.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    if let Some(id) = trace_id {
        response.headers_mut().insert("x-trace-id", id);
    }
    response
}

//! The spans of a clearing request, for OpenTelemetry. They are DEBUG-level `tracing`
//! spans: the binary's OpenTelemetry layer (on only when an OTLP endpoint is configured)
//! is the only one that enables them, so without it each is a disabled call site.
//!
//! Names and attributes follow the semantic conventions where one applies (`rpc.*` on
//! the request, `db.*` on the ledger commit); Aether's own are under `aether.*`.

use std::collections::HashMap;

use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The span of one clearing request (`SpanKind::Server`), the child of `traceparent` when
/// the member sent one (W3C Trace Context, already validated by the gateway).
pub fn request_span(method: &str, member: &str, request_id: &str, traceparent: &str) -> Span {
    let rpc_method = method.rsplit('/').next().unwrap_or(method);
    let span = tracing::debug_span!(
        "clearing.submit",
        otel.name = %method.trim_start_matches('/'),
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
        otel.status_message = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = "aether.v1.ClearingService",
        rpc.method = %rpc_method,
        aether.member = %member,
        aether.request_id = %request_id,
        aether.ledger.seq = tracing::field::Empty,
    );
    follow(&span, traceparent);
    span
}

/// Makes `span` a child of the caller's `traceparent` (W3C Trace Context) when traces
/// are on and the caller sent one.
pub fn follow(span: &Span, traceparent: &str) {
    if !span.is_disabled() && !traceparent.is_empty() {
        let carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
        let parent = opentelemetry::global::get_text_map_propagator(|p| p.extract(&carrier));
        let _ = span.set_parent(parent);
    }
}

/// Records how the request ended: the ledger seq of its decision (a trace names its
/// event), or an error status (kept whatever the sampling ratio only if sampled: see
/// `docs/operations.md`).
pub fn finish<E: std::fmt::Display>(span: &Span, outcome: Result<u64, &E>) {
    match outcome {
        Ok(seq) => {
            span.record("aether.ledger.seq", seq);
        }
        Err(e) => {
            span.record("otel.status_code", "ERROR");
            span.record("otel.status_message", tracing::field::display(e));
        }
    }
}

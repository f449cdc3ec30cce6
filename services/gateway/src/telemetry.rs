//! The spans of a clearing request, for OpenTelemetry. They are DEBUG-level `tracing`
//! spans: the binary's OpenTelemetry layer (on only when an OTLP endpoint is configured)
//! is the only one that enables them, so without it each is a disabled call site.
//!
//! Names and attributes follow the semantic conventions where one applies (`rpc.*` on
//! the request, `db.*` on the ledger commit); Aether's own are under `aether.*`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::SystemTime;

use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The share of root traces kept, as f64 bits; 0 until the binary sets it (traces off).
static RATIO: AtomicU64 = AtomicU64::new(0);
/// Whether traces are exported at all (whatever the ratio): failed requests are then kept.
static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Sets the share of root traces kept (the binary, when traces are exported).
pub fn set_ratio(ratio: f64) {
    RATIO.store(ratio.clamp(0.0, 1.0).to_bits(), Ordering::Relaxed);
    EXPORTING.store(true, Ordering::Relaxed);
}

/// Whether traces are exported.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// The W3C `traceparent` of the current span when it is traced, else empty: what a
/// traced request's work carries to another process (a remote worker).
pub fn current_traceparent() -> String {
    use opentelemetry::trace::TraceContextExt as _;
    let current = Span::current();
    if current.is_disabled() {
        return String::new();
    }
    let context = current.context();
    let span = context.span();
    let span_context = span.span_context();
    if !span_context.is_valid() {
        return String::new();
    }
    format!(
        "00-{}-{}-{:02x}",
        span_context.trace_id(),
        span_context.span_id(),
        span_context.trace_flags().to_u8()
    )
}

/// A stage that was over before its span could be made (the envelope is opened before the
/// request's `traceparent` is known; a trade's wait in the batch queue ends in another
/// task): a span from `start` to `end` under `traceparent`'s span. Nothing when traces are
/// not exported or `traceparent` is empty (the request is not traced).
pub fn past_span(
    name: &'static str,
    traceparent: &str,
    start: SystemTime,
    end: SystemTime,
    attributes: Vec<opentelemetry::KeyValue>,
) {
    use opentelemetry::trace::{Span as _, Tracer as _};
    if !exporting() || traceparent.is_empty() {
        return;
    }
    let parent = parent_context(traceparent, "", "");
    let tracer = opentelemetry::global::tracer("aether-gateway");
    let mut span = tracer
        .span_builder(name)
        .with_start_time(start)
        .with_attributes(attributes)
        .start_with_context(&tracer, &parent);
    span.end_with_timestamp(end);
}

/// How a TLS handshake on the gateway's port ended: the protocol version and cipher suite
/// agreed, or why it failed.
pub type HandshakeOutcome<'a> = Result<(&'a str, &'a str), String>;

/// The span of one TLS handshake on the gateway's port, made once it is over (from the
/// accepted TCP connection to the end of the handshake). A connection is not part of any
/// request's trace (no trace context can come before TLS), so the span is a root of its
/// own: every failed handshake is kept (an error path), a successful one at the sampling
/// ratio. Attributes after the semantic conventions (`tls.*`, `network.peer.address`).
pub fn handshake_span(
    start: SystemTime,
    end: SystemTime,
    peer: std::net::SocketAddr,
    outcome: HandshakeOutcome<'_>,
) {
    use opentelemetry::KeyValue;
    use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _};
    if !exporting() || (outcome.is_ok() && !sampled("", "")) {
        return;
    }
    let tracer = opentelemetry::global::tracer("aether-gateway");
    let mut attributes = vec![
        KeyValue::new("network.peer.address", peer.ip().to_string()),
        KeyValue::new("network.peer.port", i64::from(peer.port())),
        KeyValue::new("tls.established", outcome.is_ok()),
    ];
    if let Ok((version, cipher)) = &outcome {
        attributes.push(KeyValue::new("tls.protocol.name", "tls"));
        attributes.push(KeyValue::new("tls.protocol.version", (*version).to_owned()));
        attributes.push(KeyValue::new("tls.cipher", (*cipher).to_owned()));
    }
    let mut span = tracer
        .span_builder("tls.handshake")
        .with_kind(SpanKind::Server)
        .with_start_time(start)
        .with_attributes(attributes)
        .start_with_context(&tracer, &opentelemetry::Context::new());
    if let Err(reason) = outcome {
        span.set_status(Status::error(reason));
    }
    span.end_with_timestamp(end);
}

/// What [`keep_failure`] names a failed request by: its call, member and ids, and the
/// caller's trace context.
#[derive(Clone, Copy, Debug)]
pub struct FailedRequest<'a> {
    pub method: &'a str,
    pub member: &'a str,
    pub request_id: &'a str,
    pub trace_id: &'a str,
    pub traceparent: &'a str,
    pub tracestate: &'a str,
    pub baggage: &'a str,
}

/// The span a failed request that was not sampled still leaves (the design's sampler
/// keeps every error path): made after the fact, from the request's start to now, with
/// the request span's name and attributes and an ERROR status, under the member's
/// `traceparent` when there is one, whatever its sampled flag. Its stage spans were never
/// made (an unsampled request costs nothing while it runs), so the trace of a failure
/// not sampled is this one span; a sampled failure keeps its whole tree. Nothing is held
/// in memory for it but the request's start time.
pub fn keep_failure(
    request: &FailedRequest<'_>,
    started: SystemTime,
    error: &dyn std::fmt::Display,
) {
    use opentelemetry::KeyValue;
    use opentelemetry::trace::{SpanKind, Status, Tracer as _};
    if !exporting() {
        return;
    }
    let FailedRequest {
        method,
        member,
        request_id,
        trace_id,
        traceparent,
        tracestate,
        baggage,
    } = *request;
    let parent = parent_context(traceparent, tracestate, baggage);
    let tracer = opentelemetry::global::tracer("aether-gateway");
    let rpc_method = method.rsplit('/').next().unwrap_or(method);
    let mut span = tracer
        .span_builder(method.trim_start_matches('/').to_owned())
        .with_kind(SpanKind::Server)
        .with_start_time(started)
        .with_attributes([
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new("rpc.service", "aether.v1.ClearingService"),
            KeyValue::new("rpc.method", rpc_method.to_owned()),
            KeyValue::new("aether.member", member.to_owned()),
            KeyValue::new("aether.request_id", request_id.to_owned()),
            KeyValue::new("aether.trace_id", trace_id.to_owned()),
            KeyValue::new("aether.kept", "error"),
        ])
        .start_with_context(&tracer, &parent);
    opentelemetry::trace::Span::set_status(&mut span, Status::error(error.to_string()));
    opentelemetry::trace::Span::end(&mut span);
}

/// Whether a request is traced, decided before any span is made so that an untraced one
/// costs nothing: a `traceparent` decides by its sampled flag (parent-based); otherwise the
/// trace id by ratio, as OpenTelemetry's `TraceIdRatioBased` does (its lower 64 bits,
/// shifted right once, below ratio · 2⁶³), so every service keeps the same traces; a
/// request without a trace id by a random draw at the same ratio.
pub fn sampled(trace_id: &str, traceparent: &str) -> bool {
    if !exporting() {
        return false;
    }
    let ratio = f64::from_bits(RATIO.load(Ordering::Relaxed));
    let mut parts = traceparent.split('-');
    if let (Some(_version), Some(_trace), Some(_parent), Some(flags)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    {
        return u8::from_str_radix(flags, 16).is_ok_and(|f| f & 1 == 1);
    }
    // No trace id of the caller's: a random one (a UUIDv7's last 62 bits are random).
    let low = trace_id
        .get(16..32)
        .and_then(|low| u64::from_str_radix(low, 16).ok())
        .unwrap_or_else(|| (uuid::Uuid::now_v7().as_u128() as u64) << 2);
    ratio > 0.0 && (ratio >= 1.0 || ((low >> 1) as f64) < ratio * (1u64 << 63) as f64)
}

/// The ids every log line of one request carries (the service's log formatter reads them),
/// so that its lines join up with each other and with its trace: the trace id the request
/// is coloured with, and its span id. A traced request's lines carry the span's own ids
/// instead (the formatter finds them on the span).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogIds {
    pub trace_id: String,
    /// 16 hex digits, made for the request.
    pub span_id: String,
}

impl LogIds {
    /// The ids of a request coloured with `trace_id`.
    pub fn new(trace_id: &str) -> LogIds {
        LogIds {
            trace_id: trace_id.to_owned(),
            span_id: format!("{:016x}", uuid::Uuid::new_v4().as_u128() as u64),
        }
    }
}

tokio::task_local! {
    static LOG_IDS: LogIds;
}

/// Runs `request` with `ids` as the ids of the log lines it writes on its own task (a task a
/// request hands work to, a batch of many requests, writes its own lines).
pub async fn with_log_ids<F: std::future::Future>(ids: LogIds, request: F) -> F::Output {
    LOG_IDS.scope(ids, request).await
}

/// The ids of the request running on this task, if any.
pub fn log_ids() -> Option<LogIds> {
    LOG_IDS.try_with(Clone::clone).ok()
}

/// A child of the current span, or no span when the current one is off (the request is
/// not traced): stage spans cost nothing on an untraced request.
#[macro_export]
macro_rules! stage_span {
    ($($arg:tt)*) => {
        if tracing::Span::current().is_disabled() {
            tracing::Span::none()
        } else {
            tracing::debug_span!($($arg)*)
        }
    };
}

/// The span of one clearing request (`SpanKind::Server`), the child of `traceparent` when
/// the member sent one (W3C Trace Context, already validated by the gateway); no span
/// when the request is not traced ([`sampled`]).
pub fn request_span(
    method: &str,
    member: &str,
    request_id: &str,
    trace_id: &str,
    traceparent: &str,
    tracestate: &str,
    baggage: &str,
) -> Span {
    if !sampled(trace_id, traceparent) {
        return Span::none();
    }
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
        aether.trace_id = %trace_id,
        aether.ledger.seq = tracing::field::Empty,
    );
    follow_context(&span, traceparent, tracestate, baggage);
    span
}

/// Makes `span` a child of the caller's `traceparent` (W3C Trace Context) when traces
/// are on and the caller sent one.
pub fn follow(span: &Span, traceparent: &str) {
    follow_with_state(span, traceparent, "");
}

/// [`follow`] with the caller's `tracestate`, which the span then carries on.
pub fn follow_with_state(span: &Span, traceparent: &str, tracestate: &str) {
    follow_context(span, traceparent, tracestate, "");
}

/// [`follow_with_state`] with the caller's W3C `baggage` (already checked with
/// [`valid_baggage`]): the span's context carries it, so that it goes on to a remote
/// worker ([`current_baggage`]), and each entry is an attribute `baggage.<key>` of the
/// span, as OpenTelemetry's baggage span processor records it, so that a trace shows what
/// the caller sent.
pub fn follow_context(span: &Span, traceparent: &str, tracestate: &str, baggage: &str) {
    use opentelemetry::baggage::BaggageExt as _;
    if span.is_disabled() || (traceparent.is_empty() && baggage.is_empty()) {
        return;
    }
    let parent = parent_context(traceparent, tracestate, baggage);
    for (key, (value, _)) in parent.baggage() {
        span.set_attribute(format!("baggage.{}", key.as_str()), value.to_string());
    }
    let _ = span.set_parent(parent);
}

/// Most bytes of a `baggage` header followed (W3C Baggage's limit for a whole header).
pub const MAX_BAGGAGE_BYTES: usize = 8_192;
/// Most entries of a `baggage` header followed (W3C Baggage's limit).
pub const MAX_BAGGAGE_MEMBERS: usize = 64;

/// Whether `value` is a W3C `baggage` header Aether follows: at most
/// [`MAX_BAGGAGE_BYTES`] and [`MAX_BAGGAGE_MEMBERS`], each entry `key=value` with an
/// optional `;property` list, the key a token (RFC 9110) and the value baggage octets
/// (percent-encoded where needed). A header that is not is ignored whole: W3C Baggage asks
/// that no partial list be propagated.
pub fn valid_baggage(value: &str) -> bool {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    let octet = |b: u8| matches!(b, 0x21 | 0x23..=0x2b | 0x2d..=0x3a | 0x3c..=0x5b | 0x5d..=0x7e);
    let members: Vec<&str> = value.split(',').collect();
    value.len() <= MAX_BAGGAGE_BYTES
        && members.len() <= MAX_BAGGAGE_MEMBERS
        && members.iter().all(|member| {
            let entry = member.split(';').next().unwrap_or_default();
            let Some((key, val)) = entry.split_once('=') else {
                return false;
            };
            let (key, val) = (key.trim_matches([' ', '\t']), val.trim_matches([' ', '\t']));
            !key.is_empty() && key.bytes().all(tchar) && val.bytes().all(octet)
        })
}

/// The W3C `baggage` of the current span's context (empty when it has none, or the
/// request is not traced): what a traced request's work carries to a remote worker.
pub fn current_baggage() -> String {
    use opentelemetry::propagation::TextMapPropagator as _;
    let current = Span::current();
    if current.is_disabled() {
        return String::new();
    }
    let mut carrier = HashMap::new();
    opentelemetry_sdk::propagation::BaggagePropagator::new()
        .inject_context(&current.context(), &mut carrier);
    carrier.remove("baggage").unwrap_or_default()
}

/// The OpenTelemetry context a W3C `traceparent` (with its `tracestate`) and `baggage`
/// name; without a `traceparent` it makes a root (with the baggage, if any).
fn parent_context(traceparent: &str, tracestate: &str, baggage: &str) -> opentelemetry::Context {
    use opentelemetry::propagation::TextMapPropagator as _;
    let mut carrier = HashMap::new();
    for (name, value) in [
        ("traceparent", traceparent),
        ("tracestate", tracestate),
        ("baggage", baggage),
    ] {
        if !value.is_empty() {
            carrier.insert(name.to_owned(), value.to_owned());
        }
    }
    let context = if traceparent.is_empty() {
        opentelemetry::Context::new()
    } else {
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&carrier))
    };
    if baggage.is_empty() {
        return context;
    }
    opentelemetry_sdk::propagation::BaggagePropagator::new()
        .extract_with_context(&context, &carrier)
}

/// Records how the request ended: the ledger seq of its decision (a trace names its
/// event), or an error status (a failure that was not sampled is kept by [`keep_failure`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baggage_headers_are_followed_only_when_they_are_w3cs() {
        for ok in [
            "userId=alice",
            "desk=fx-options, region=SG;ttl=60",
            "serverNode=DF%2028,isProduction=false",
            "k=",
        ] {
            assert!(valid_baggage(ok), "{ok:?} is W3C baggage");
        }
        let too_many = (0..=MAX_BAGGAGE_MEMBERS)
            .map(|i| format!("k{i}=v"))
            .collect::<Vec<_>>()
            .join(",");
        let too_long = format!("k={}", "v".repeat(MAX_BAGGAGE_BYTES));
        for bad in [
            "",
            "no-equals-sign",
            "=value",
            "key with space=v",
            "k=quoted\"value",
            "k=comma,",
            "k=back\\slash",
            "k=tab\tinside",
            too_many.as_str(),
            too_long.as_str(),
        ] {
            assert!(!valid_baggage(bad), "{bad:?} is not W3C baggage");
        }
    }
}

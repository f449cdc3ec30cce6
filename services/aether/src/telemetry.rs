//! OpenTelemetry traces, configured by the standard `OTEL_*` variables and off unless an
//! OTLP endpoint is named. The spans are `tracing` spans at DEBUG level (`aether` and
//! `aether_gateway` targets); only the OpenTelemetry layer's own filter lets them through,
//! so without an exporter they are disabled at their call site and cost nothing.
//!
//! Sampling: parent-based (an incoming `traceparent`'s sampled flag is followed), a root
//! decided by trace-id ratio, default 1 % (`OTEL_TRACES_SAMPLER` and
//! `OTEL_TRACES_SAMPLER_ARG` override it, as the SDK reads them).

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::Layer;

/// The default share of root traces kept, the source design's 1 %.
pub const DEFAULT_RATIO: f64 = 0.01;

/// How traces are exported, from the environment.
#[derive(Debug, Clone, PartialEq)]
pub enum Export {
    Off,
    Grpc,
    HttpProtobuf,
}

/// What the `OTEL_*` variables ask for.
pub fn configured(env: impl Fn(&str) -> Option<String>) -> Result<Export, String> {
    let truthy = |k: &str| env(k).is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if truthy("OTEL_SDK_DISABLED")
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return Ok(Export::Off);
    }
    let endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
        .filter(|e| !e.trim().is_empty());
    if endpoint.is_none() {
        return Ok(Export::Off);
    }
    if let Some(exporter) = env("OTEL_TRACES_EXPORTER")
        && !exporter.eq_ignore_ascii_case("otlp")
    {
        return Err(format!(
            "OTEL_TRACES_EXPORTER={exporter:?}: only otlp (or none) is supported"
        ));
    }
    let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .unwrap_or_else(|| "grpc".to_owned());
    match protocol.as_str() {
        "grpc" => Ok(Export::Grpc),
        "http/protobuf" => Ok(Export::HttpProtobuf),
        other => Err(format!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={other:?}: grpc and http/protobuf are supported"
        )),
    }
}

/// The share of root traces kept, from `OTEL_TRACES_SAMPLER` and `OTEL_TRACES_SAMPLER_ARG`
/// (the specification's names); always parent-based: a caller's sampled flag decides.
pub fn sampling_ratio(env: impl Fn(&str) -> Option<String>) -> Result<f64, String> {
    let sampler = env("OTEL_TRACES_SAMPLER").unwrap_or_default();
    let arg = || -> Result<f64, String> {
        match env("OTEL_TRACES_SAMPLER_ARG") {
            None => Ok(1.0),
            Some(a) => a
                .parse::<f64>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| format!("OTEL_TRACES_SAMPLER_ARG={a:?}: a ratio in [0, 1]")),
        }
    };
    match sampler.as_str() {
        "" => Ok(DEFAULT_RATIO),
        "always_on" | "parentbased_always_on" => Ok(1.0),
        "always_off" | "parentbased_always_off" => Ok(0.0),
        "traceidratio" | "parentbased_traceidratio" => arg(),
        other => Err(format!(
            "OTEL_TRACES_SAMPLER={other:?}: always_on, always_off, traceidratio or their parentbased_ forms"
        )),
    }
}

/// The tracer provider, kept to flush the spans at exit.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

/// Dropped when the command ends: exports what is still buffered.
impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("OpenTelemetry: could not export the last spans: {e}");
        }
    }
}

/// Log lines that join up with their request and trace: the `fmt` layer's own format (text
/// or JSON) with the trace id and span id of the request the line was written in, the
/// exported span's when the request is traced, else the ids the request's task carries
/// (`aether_gateway::telemetry::with_log_ids`). Lines outside any request are unchanged.
pub struct JoinedUp<F> {
    inner: F,
    json: bool,
}

impl<F> JoinedUp<F> {
    pub fn new(inner: F, json: bool) -> JoinedUp<F> {
        JoinedUp { inner, json }
    }
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for JoinedUp<F>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let Some((trace_id, span_id)) = traced_ids().or_else(|| {
            aether_gateway::telemetry::log_ids().map(|ids| (ids.trace_id, ids.span_id))
        }) else {
            return self.inner.format_event(ctx, writer, event);
        };
        if !self.json {
            write!(writer, "trace_id={trace_id} span_id={span_id} ")?;
            return self.inner.format_event(ctx, writer, event);
        }
        // The JSON line as the inner format writes it, with the two ids as its first members.
        let mut line = String::new();
        self.inner.format_event(
            ctx,
            tracing_subscriber::fmt::format::Writer::new(&mut line),
            event,
        )?;
        match line.strip_prefix('{') {
            Some(rest) => write!(
                writer,
                "{{\"trace_id\":{},\"span_id\":{},{rest}",
                serde_json::Value::from(trace_id),
                serde_json::Value::from(span_id)
            ),
            None => writer.write_str(&line),
        }
    }
}

/// The trace and span ids of the exported span the event is written in, if any. Through
/// the dispatcher, not the formatter's context: that sees only the spans its own level
/// filter lets through, and the request spans are at debug.
fn traced_ids() -> Option<(String, String)> {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let current = tracing::Span::current();
    if current.is_disabled() {
        return None;
    }
    let context = current.context();
    let span = context.span();
    let ids = span.span_context();
    ids.is_valid()
        .then(|| (ids.trace_id().to_string(), ids.span_id().to_string()))
}

/// A subscriber layer, boxed to be optional.
pub type BoxedLayer<S> = Box<dyn Layer<S> + Send + Sync>;

/// The layer that turns Aether's spans into OpenTelemetry spans, when configured. Must
/// be called inside a tokio runtime (the batch exporter runs on it).
pub fn layer<S>() -> Result<(Option<BoxedLayer<S>>, Telemetry), String>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a> + Send + Sync,
{
    let export = configured(|k| std::env::var(k).ok())?;
    let exporter = match export {
        Export::Off => return Ok((None, Telemetry { provider: None })),
        Export::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build(),
        Export::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .build(),
    }
    .map_err(|e| format!("the OTLP exporter cannot be built: {e}"))?;
    let ratio = sampling_ratio(|k| std::env::var(k).ok())?;
    // The decision is the gateway's, made before any span exists (untraced requests cost
    // nothing); the spans it makes are all exported.
    aether_gateway::telemetry::set_ratio(ratio);
    let builder = SdkTracerProvider::builder()
        .with_sampler(Sampler::AlwaysOn)
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(
                    std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "aether".to_owned()),
                )
                .build(),
        );
    let provider = builder.build();
    // Also the global provider: the gateway makes the span of a failed request that was not
    // sampled through it (`aether_gateway::telemetry::keep_failure`).
    opentelemetry::global::set_tracer_provider(provider.clone());
    // W3C Trace Context and W3C Baggage, as OTEL_PROPAGATORS' default ("tracecontext,baggage").
    opentelemetry::global::set_text_map_propagator(
        opentelemetry::propagation::TextMapCompositePropagator::new(vec![
            Box::new(opentelemetry_sdk::propagation::TraceContextPropagator::new()),
            Box::new(opentelemetry_sdk::propagation::BaggagePropagator::new()),
        ]),
    );
    let tracer = provider.tracer("aether");
    // Aether's spans only (the ledger's and the libraries' debug events stay out): the
    // requests' (binary, gateway), the lineage relays' commits and the rollout checks.
    let ours = tracing_subscriber::filter::filter_fn(|meta| {
        meta.is_span()
            && (meta.target().starts_with("aether::")
                || meta.target() == "aether"
                || meta.target().starts_with("aether_gateway")
                || meta.target() == "aether_gpu_worker"
                || meta.target() == "aether_lineage::delta_relay"
                || meta.target() == "aether_control::rollout_controller")
    });
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(ours)
        .boxed();
    Ok((
        Some(layer),
        Telemetry {
            provider: Some(provider),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn traces_are_off_unless_an_endpoint_is_named() {
        assert_eq!(configured(env(&[])), Ok(Export::Off));
        let on = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")];
        assert_eq!(configured(env(&on)), Ok(Export::Grpc));
        let disabled = [on[0], ("OTEL_SDK_DISABLED", "true")];
        assert_eq!(configured(env(&disabled)), Ok(Export::Off));
        let none = [on[0], ("OTEL_TRACES_EXPORTER", "none")];
        assert_eq!(configured(env(&none)), Ok(Export::Off));
        let http = [on[0], ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")];
        assert_eq!(configured(env(&http)), Ok(Export::HttpProtobuf));
        let json = [on[0], ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")];
        assert!(configured(env(&json)).is_err());
        let zipkin = [on[0], ("OTEL_TRACES_EXPORTER", "zipkin")];
        assert!(configured(env(&zipkin)).is_err());
    }

    #[test]
    fn the_sampler_variables_give_the_ratio() {
        assert_eq!(sampling_ratio(env(&[])), Ok(0.01));
        assert_eq!(
            sampling_ratio(env(&[("OTEL_TRACES_SAMPLER", "always_on")])),
            Ok(1.0)
        );
        let half = [
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
        ];
        assert_eq!(sampling_ratio(env(&half)), Ok(0.5));
        let bad = [
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "2"),
        ];
        assert!(sampling_ratio(env(&bad)).is_err());
        assert!(sampling_ratio(env(&[("OTEL_TRACES_SAMPLER", "jaeger_remote")])).is_err());
    }

    #[test]
    fn a_trace_is_kept_by_its_parents_flag_else_by_its_id() {
        use aether_gateway::telemetry::{sampled, set_ratio};
        set_ratio(0.01);
        let id = "4bf92f3577b34da6a3ce929d0e0e4736";
        assert!(sampled(id, &format!("00-{id}-00f067aa0ba902b7-01")));
        assert!(!sampled(id, &format!("00-{id}-00f067aa0ba902b7-00")));
        // Lower 64 bits 0x0000000000000001 → kept at 1 %; 0xffff… → dropped.
        assert!(sampled("4bf92f3577b34da60000000000000001", ""));
        assert!(!sampled("4bf92f3577b34da6ffffffffffffffff", ""));
        // About 1 % of random-looking ids (SM3-spread) are kept.
        let kept = (0..10_000u32)
            .filter(|n| {
                sampled(
                    &hex::encode(&aether_ledger::hashing::sm3(&n.to_be_bytes())[..16]),
                    "",
                )
            })
            .count();
        assert!((50..=150).contains(&kept), "{kept}");
    }
}

//! OpenTelemetry traces of a real `aether serve`, exported over OTLP/gRPC to a real
//! `TraceService` this test starts: a clearing request is one trace under the member's
//! `traceparent`, with its stages as child spans and the ledger seq of its decision; an
//! HTTP call is a span under the caller's `traceparent`; W3C baggage is carried with the
//! trace (to the worker too) and recorded as `baggage.<key>` attributes.

use serde_json::Value;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_e2e::clearing::{activate, client, trade};
use aether_e2e::{REGULATOR_TOKEN, Server, http};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;

/// Collects every span exported to it.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            for scope in resource.scope_spans {
                spans.extend(scope.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

async fn receiver() -> (String, Receiver) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let receiver = Receiver::default();
    let service = TraceServiceServer::new(receiver.clone());
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (format!("http://{address}"), receiver)
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .map(|v| match v {
            AnyValue::StringValue(s) => s.clone(),
            AnyValue::IntValue(i) => i.to_string(),
            AnyValue::BoolValue(b) => b.to_string(),
            AnyValue::DoubleValue(d) => d.to_string(),
            other => format!("{other:?}"),
        })
}

/// The spans of `trace_id` once `names` are all among them (30 s at most).
async fn trace(receiver: &Receiver, trace_id: &[u8], names: &[&str]) -> Vec<Span> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let spans: Vec<Span> = receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect();
        if names.iter().all(|n| spans.iter().any(|s| s.name == *n)) {
            return spans;
        }
        assert!(
            Instant::now() < deadline,
            "trace incomplete: {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Across the worker protocol: a traced request scored by a remote `aether worker` has the
/// worker's span for its batch as a child of its scoring span at the gateway. And the
/// design's sampler: at a ratio of 0 a successful request leaves no span, but a failed one
/// is kept, even under a caller's unsampled `traceparent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_crosses_to_the_worker_and_failures_are_kept_whatever_the_ratio() {
    let (endpoint, receiver) = receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let otel = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
        ("OTEL_TRACES_SAMPLER_ARG", "0"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let mut env = otel.to_vec();
    env.push(("AETHER_NO_LOCAL_WORKERS", "true"));
    let server = Server::start(&data, &env);
    activate(&server).await;
    let mut worker_env = otel.to_vec();
    worker_env.push(("OTEL_SERVICE_NAME", "aether-worker"));
    let _worker = aether_e2e::clearing::WorkerProcess::spawn_with_env(
        &server,
        &data,
        "worker-1",
        &[],
        &worker_env,
    );
    // W3C baggage in the call's metadata goes with the trace, to the worker too.
    let mut bank_a = client(&server, &data, "bank-a")
        .await
        .with_baggage("desk=fx-options, region=SG;ttl=60");

    let trace_hex = "5bf92f3577b34da6a3ce929d0e0e4737";
    let mut traced = trade(125_000);
    traced.traceparent = format!("00-{trace_hex}-00f067aa0ba902b8-01");
    bank_a.submit("req-remote", &traced).await.unwrap();
    let spans = trace(
        &receiver,
        &hex::decode(trace_hex).unwrap(),
        &[
            "aether.v1.ClearingService/Submit",
            "clearing.score",
            "aether.v1.WorkerService/Work",
            "worker.netting",
        ],
    )
    .await;
    let request = spans
        .iter()
        .find(|s| s.name == "aether.v1.ClearingService/Submit")
        .unwrap();
    assert_eq!(
        attribute(request, "baggage.desk").as_deref(),
        Some("fx-options")
    );
    assert_eq!(attribute(request, "baggage.region").as_deref(), Some("SG"));
    let score = spans.iter().find(|s| s.name == "clearing.score").unwrap();
    let work = spans
        .iter()
        .find(|s| s.name == "aether.v1.WorkerService/Work")
        .unwrap();
    assert_eq!(
        work.parent_span_id, score.span_id,
        "the worker's batch is a child of the request's scoring"
    );
    assert_eq!(
        attribute(score, "aether.worker").as_deref(),
        Some("worker-1")
    );
    assert_eq!(attribute(work, "aether.batch_size").as_deref(), Some("1"));
    let netting = spans.iter().find(|s| s.name == "worker.netting").unwrap();
    assert_eq!(
        netting.parent_span_id, work.span_id,
        "the worker's netting is a stage of its batch"
    );
    assert_eq!(
        attribute(work, "baggage.desk").as_deref(),
        Some("fx-options"),
        "the baggage crossed the worker protocol"
    );
    assert_eq!(attribute(work, "aether.device").as_deref(), Some("cpu"));
    assert_eq!(
        attribute(work, "aether.model_digest").as_deref(),
        Some(aether_gpu_worker::reference::REFERENCE_MODEL_DIGEST)
    );

    // A success at ratio 0 without a traceparent: no span.
    let quiet_hex = "6bf92f3577b34da6a3ce929d0e0e4738";
    let mut quiet = trade(125_000);
    quiet.trace_id = quiet_hex.to_owned();
    bank_a.submit("req-quiet", &quiet).await.unwrap();
    // A failure under an unsampled traceparent: kept, as one span with the error.
    let failed_hex = "7bf92f3577b34da6a3ce929d0e0e4739";
    let mut failing = trade(-5);
    failing.traceparent = format!("00-{failed_hex}-00f067aa0ba902b9-00");
    assert!(bank_a.submit("req-failed", &failing).await.is_err());
    let kept = trace(
        &receiver,
        &hex::decode(failed_hex).unwrap(),
        &["aether.v1.ClearingService/Submit"],
    )
    .await;
    assert_eq!(kept.len(), 1, "the failure's one span");
    let failure = &kept[0];
    assert_eq!(
        failure.parent_span_id,
        hex::decode("00f067aa0ba902b9").unwrap()
    );
    assert_eq!(failure.status.as_ref().map(|s| s.code), Some(2), "ERROR");
    assert_eq!(attribute(failure, "aether.kept").as_deref(), Some("error"));
    assert_eq!(
        attribute(failure, "aether.request_id").as_deref(),
        Some("req-failed")
    );
    assert!(failure.end_time_unix_nano > failure.start_time_unix_nano);
    let quiet_id = hex::decode(quiet_hex).unwrap();
    assert!(
        !receiver.spans.lock().unwrap().iter().any(|s| {
            s.trace_id == quiet_id
                || attribute(s, "aether.request_id").as_deref() == Some("req-quiet")
        }),
        "a success at ratio 0 leaves no span"
    );
    assert!(server.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clearing_request_is_one_trace_under_the_members_traceparent() {
    let (endpoint, receiver) = receiver().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(
        &data,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_TRACES_SAMPLER", "always_on"),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ("AETHER_LOG_FORMAT", "json"),
        ],
    );
    activate(&server).await;

    // A caller whose own trace is not sampled (flags 00) is not traced here either.
    let untraced_hex = "11111111111111111111111111111111";
    let mut untraced = trade(125_000);
    untraced.traceparent = format!("00-{untraced_hex}-00f067aa0ba902b7-00");
    let mut bank_a = client(&server, &data, "bank-a").await;
    bank_a.submit("req-untraced", &untraced).await.unwrap();

    let trace_hex = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_hex = "00f067aa0ba902b7";
    let mut request = trade(125_000);
    request.traceparent = format!("00-{trace_hex}-{parent_hex}-01");
    request.trace_id = trace_hex.to_owned();
    let answer = bank_a.submit("req-traced", &request).await.unwrap();
    let seq = answer.receipt.as_ref().unwrap().seq;

    let trace_id = hex::decode(trace_hex).unwrap();
    let root_name = "aether.v1.ClearingService/Submit";
    let stages = [
        "envelope.open",
        "clearing.validate",
        "clearing.route",
        "clearing.rules",
        "clearing.score",
        "ledger.commit",
        "envelope.seal",
    ];
    let nested = [
        ("clearing.citations", "clearing.rules"),
        ("batch.queue", "clearing.score"),
        ("clearing.batch", "clearing.score"),
        ("worker.scoring", "clearing.batch"),
        ("worker.netting", "clearing.batch"),
    ];
    let mut names = vec![root_name];
    names.extend(stages);
    names.extend(nested.map(|(child, _)| child));
    let spans = trace(&receiver, &trace_id, &names).await;
    let untraced_id = hex::decode(untraced_hex).unwrap();
    assert!(
        !receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .any(|s| s.trace_id == untraced_id),
        "an unsampled caller's request left no span: {:?}",
        receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == untraced_id)
            .map(|s| (&s.name, hex::encode(&s.parent_span_id)))
            .collect::<Vec<_>>()
    );
    let root = spans.iter().find(|s| s.name == root_name).unwrap();
    assert_eq!(
        root.parent_span_id,
        hex::decode(parent_hex).unwrap(),
        "the member's span is the parent"
    );
    assert_eq!(attribute(root, "rpc.system").as_deref(), Some("grpc"));
    assert_eq!(attribute(root, "rpc.method").as_deref(), Some("Submit"));
    assert_eq!(
        attribute(root, "aether.ledger.seq"),
        Some(seq.to_string()),
        "the trace names its event"
    );
    assert_eq!(
        attribute(root, "aether.request_id").as_deref(),
        Some("req-traced")
    );
    for stage in stages {
        let span = spans.iter().find(|s| s.name == stage).unwrap();
        assert_eq!(
            span.parent_span_id, root.span_id,
            "{stage} is a child of the request"
        );
        // The envelope is opened before the request's span can exist (its traceparent is
        // inside), so that one stage starts before its parent.
        assert!(
            span.start_time_unix_nano >= root.start_time_unix_nano || stage == "envelope.open",
            "{stage}"
        );
        assert!(
            span.end_time_unix_nano <= root.end_time_unix_nano || stage == "envelope.seal",
            "{stage}"
        );
    }
    for (child, parent) in nested {
        let span = spans.iter().find(|s| s.name == child).unwrap();
        let parent = spans.iter().find(|s| s.name == parent).unwrap();
        assert_eq!(
            span.parent_span_id, parent.span_id,
            "{child} under its stage"
        );
    }
    // The Delta relay's commits are spans of their own.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !receiver
        .spans
        .lock()
        .unwrap()
        .iter()
        .any(|s| s.name == "lineage.delta.commit" && attribute(s, "aether.last_seq").is_some())
    {
        assert!(Instant::now() < deadline, "no lineage.delta.commit span");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let score = spans.iter().find(|s| s.name == "clearing.score").unwrap();
    assert_eq!(attribute(score, "aether.device").as_deref(), Some("cpu"));
    // Stages in order: rules, then scoring, then the commit.
    let start = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap()
            .start_time_unix_nano
    };
    let envelope_open = spans.iter().find(|s| s.name == "envelope.open").unwrap();
    assert!(envelope_open.end_time_unix_nano <= start("clearing.validate"));
    assert!(start("clearing.validate") <= start("clearing.route"));
    assert!(start("clearing.route") <= start("clearing.rules"));
    assert!(start("clearing.rules") <= start("clearing.score"));
    assert!(start("clearing.score") <= start("ledger.commit"));

    // The ledger event names the same trace.
    let event = aether_e2e::clearing::get(&server, &format!("/v1/audit/events/{seq}")).await;
    assert_eq!(event["event"]["metadata"]["trace_id"], trace_hex, "{event}");

    // A member's OpenTelemetry gRPC client puts the trace context in the call's metadata,
    // not in the colouring: followed, with its tracestate, and the decision names it.
    let meta_hex = "8bf92f3577b34da6a3ce929d0e0e4731";
    let meta_parent = "00f067aa0ba902c1";
    let mut by_metadata = client(&server, &data, "bank-a").await.with_trace_context(
        &format!("00-{meta_hex}-{meta_parent}-01"),
        "vendor=abc,other=1",
    );
    let answer = by_metadata
        .submit("req-metadata", &trade(125_000))
        .await
        .unwrap();
    let spans = trace(&receiver, &hex::decode(meta_hex).unwrap(), &[root_name]).await;
    let root = spans.iter().find(|s| s.name == root_name).unwrap();
    assert_eq!(root.parent_span_id, hex::decode(meta_parent).unwrap());
    assert_eq!(root.trace_state, "vendor=abc,other=1");
    let seq = answer.receipt.as_ref().unwrap().seq;
    let event = aether_e2e::clearing::get(&server, &format!("/v1/audit/events/{seq}")).await;
    assert_eq!(event["event"]["metadata"]["trace_id"], meta_hex, "{event}");
    // A traceparent in metadata that is not W3C's is ignored (W3C Trace Context): the
    // request goes through as if it had none.
    let mut bad = client(&server, &data, "bank-a")
        .await
        .with_trace_context("00-zz-yy-01", "");
    bad.submit("req-bad-metadata", &trade(125_000))
        .await
        .unwrap();

    // Each TLS handshake on the gateway's port is a span of its own, a failed one with
    // its error: a client that speaks no TLS.
    let grpc_address = server.grpc_url.trim_start_matches("https://").to_owned();
    let mut plain = tokio::net::TcpStream::connect(&grpc_address).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut plain, b"GET / HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    drop(plain);
    let deadline = Instant::now() + Duration::from_secs(30);
    let (established, failed) = loop {
        let spans = receiver.spans.lock().unwrap().clone();
        let handshakes: Vec<&Span> = spans.iter().filter(|s| s.name == "tls.handshake").collect();
        let established = handshakes
            .iter()
            .find(|s| attribute(s, "tls.established").as_deref() == Some("true"))
            .map(|s| (*s).clone());
        let failed = handshakes
            .iter()
            .find(|s| attribute(s, "tls.established").as_deref() == Some("false"))
            .map(|s| (*s).clone());
        if let (Some(e), Some(f)) = (&established, &failed) {
            break (e.clone(), f.clone());
        }
        assert!(
            Instant::now() < deadline,
            "no handshake spans: {established:?} {failed:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        attribute(&established, "tls.protocol.version").as_deref(),
        Some("1.3")
    );
    assert!(attribute(&established, "tls.cipher").is_some_and(|c| c.starts_with("TLS13_")));
    assert_eq!(
        attribute(&established, "network.peer.address").as_deref(),
        Some("127.0.0.1")
    );
    assert!(
        established.parent_span_id.is_empty(),
        "a handshake is a root"
    );
    assert_eq!(failed.status.as_ref().map(|s| s.code), Some(2), "ERROR");
    assert!(
        failed
            .status
            .as_ref()
            .is_some_and(|s| s.message.starts_with("TLS handshake failed")),
        "{:?}",
        failed.status
    );

    // An HTTP call is a span under the caller's traceparent, with its tracestate.
    let http_trace = "0af7651916cd43dd8448eb211c80319c";
    let resp = http()
        .get(server.url("/v1/engines"))
        .bearer_auth(REGULATOR_TOKEN)
        .header(
            "traceparent",
            format!("00-{http_trace}-b7ad6b7169203331-01"),
        )
        .header("tracestate", "congo=t61rcWkgMzE")
        .header("baggage", "userId=alice%20b,isProduction=false")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let spans = trace(
        &receiver,
        &hex::decode(http_trace).unwrap(),
        &["GET /v1/engines"],
    )
    .await;
    let call = &spans[0];
    assert_eq!(
        call.parent_span_id,
        hex::decode("b7ad6b7169203331").unwrap()
    );
    assert_eq!(call.trace_state, "congo=t61rcWkgMzE");
    assert_eq!(
        attribute(call, "baggage.userId").as_deref(),
        Some("alice b"),
        "baggage values are percent-decoded"
    );
    assert_eq!(
        attribute(call, "baggage.isProduction").as_deref(),
        Some("false")
    );
    assert_eq!(
        attribute(call, "http.request.method").as_deref(),
        Some("GET")
    );
    assert_eq!(
        attribute(call, "http.response.status_code").as_deref(),
        Some("200")
    );

    // Each analysis window of an automated rollout is a span of its own.
    let (status, body) = aether_e2e::clearing::post(
        &server,
        "/v1/models",
        serde_json::json!({"ref": "aether-anomaly-mlp-v2@reference",
            "uri": aether_e2e::clearing::reference_weights(),
            "digest": aether_gpu_worker::reference::REFERENCE_MODEL_DIGEST,
            "feature_schema": {"schema": "aether.features.v1"}}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = aether_e2e::clearing::post(
        &server,
        "/v1/rollouts",
        serde_json::json!({"baseline": "aether-anomaly-mlp@reference",
            "candidate": "aether-anomaly-mlp-v2@reference", "steps": [10, 50, 100],
            "automated": true, "analysis": {"window": {"length_ms": 1000}}}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let rollout = body["rollout"]["id"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !receiver.spans.lock().unwrap().iter().any(|s| {
        s.name == "rollout.check" && attribute(s, "aether.rollout").as_deref() == Some(&rollout)
    }) {
        assert!(Instant::now() < deadline, "no rollout.check span");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Log lines join up: a line written inside a traced call carries the ids of its
    // exported span; inside an untraced one, the call's trace id and a span id of its own.
    let sign_in = |traceparent: String| {
        let server = &server;
        async move {
            let resp = http()
                .post(server.url("/v1/session"))
                .bearer_auth(REGULATOR_TOKEN)
                .header("traceparent", traceparent)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 201);
        }
    };
    let logged_trace = "5bf92f3577b34da6a3ce929d0e0e4737";
    sign_in(format!("00-{logged_trace}-b7ad6b7169203332-01")).await;
    let logged_span = trace(
        &receiver,
        &hex::decode(logged_trace).unwrap(),
        &["POST /v1/session"],
    )
    .await[0]
        .span_id
        .clone();
    let quiet_trace = "6bf92f3577b34da6a3ce929d0e0e4738";
    sign_in(format!("00-{quiet_trace}-b7ad6b7169203333-00")).await;
    let opened = |trace: &str| -> Value {
        let log = std::fs::read_to_string(&server.log_path).unwrap();
        log.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|l| l["fields"]["message"] == "console session opened" && l["trace_id"] == trace)
            .unwrap_or_else(|| panic!("no joined-up line for {trace} in:\n{log}"))
    };
    assert_eq!(opened(logged_trace)["span_id"], hex::encode(&logged_span));
    let quiet = opened(quiet_trace);
    let span_id = quiet["span_id"].as_str().unwrap();
    assert!(
        span_id.len() == 16 && span_id.chars().all(|c| c.is_ascii_hexdigit()),
        "{quiet}"
    );
    assert_ne!(span_id, hex::encode(&logged_span));
    assert!(server.terminate().success());
}

/// An OTLP protocol Aether does not speak is refused at the start, naming the variable.
#[test]
fn an_unsupported_otlp_protocol_is_refused_at_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = aether_e2e::run_aether(
        &[
            "serve",
            "--data-dir",
            dir.path().join("data").to_str().unwrap(),
        ],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("OTEL_EXPORTER_OTLP_PROTOCOL"), "{stderr}");
}

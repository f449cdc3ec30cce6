//! `aether worker`: a clearing worker process. Connects to the gateway over mTLS with a
//! worker certificate, registers the models it holds, scores and nets the batches it is
//! sent, connects again when the gateway goes away, and drains on SIGTERM. It has no
//! database access.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use aether_gateway::identity::Role;
use aether_gateway::pb::v1::worker_message::Body;
use aether_gateway::pb::v1::worker_service_client::WorkerServiceClient;
use aether_gateway::pb::v1::{
    BatchFailed, BatchResult, DrainRequest, HeartbeatRequest, ItemScore, NetPosition,
    RegisterRequest, WorkAssignment, WorkerHello, WorkerMessage,
};
use aether_gateway::tls::{ClientTls, TlsPaths, TlsSuite};
use aether_gpu_worker::{ClearingModel, DeviceChoice, Trade, TradeContext};
use anyhow::Context;
use clap::Args;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tracing::Instrument as _;

#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The gateway's gRPC address.
    #[arg(long, default_value = "https://127.0.0.1:50051")]
    pub connect: String,
    /// Worker id; its certificate `<data>/certs/worker-<id>.pem` is used unless
    /// `--tls-*` name others.
    #[arg(long, default_value = "worker-1")]
    pub id: String,
    #[arg(long, env = "AETHER_DATA_DIR", default_value = "./aether-data")]
    pub data_dir: PathBuf,
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// A model artifact (safetensors) this worker serves; repeatable. Default: the
    /// reference model, written to `<data>/models/reference/`.
    #[arg(long = "model")]
    pub models: Vec<PathBuf>,
    /// `cpu`, `cuda`, `cuda:N` or `auto`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Most trades per batch this worker accepts.
    #[arg(long, default_value_t = 500)]
    pub max_batch: u32,
    /// Exit when the gateway cannot be reached or the connection is lost, instead of
    /// connecting again (with pauses from 0.25 s growing to 10 s) until stopped.
    #[arg(long)]
    pub no_reconnect: bool,
    /// The TLS 1.3 suites to offer: `standard`, `gm` (RFC 8998, with the worker's SM2
    /// certificate from `<data>/certs/sm2`) or `both`.
    #[arg(long, env = "AETHER_TLS_SUITE", default_value = "standard", value_parser = crate::clearing::parse_tls_suite)]
    pub tls_suite: TlsSuite,
    /// Testing aid: wait this long before answering each batch.
    #[arg(long, hide = true, default_value_t = 0)]
    pub delay_ms: u64,
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<()> {
    // Held to the end: its drop exports the last spans.
    let _telemetry = crate::init_logging()?;
    let device: DeviceChoice = args
        .device
        .parse()
        .map_err(|e| anyhow::anyhow!("--device {}: {e}", args.device))?;
    // The certificates first: a mistyped data directory is refused before anything is
    // written into it.
    let tls = match (&args.tls_ca, &args.tls_cert, &args.tls_key) {
        (Some(ca), Some(cert), Some(key)) => ClientTls::load_suite(
            args.tls_suite,
            &TlsPaths {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            },
            &[],
        )?,
        _ => ClientTls::dev(&args.data_dir, args.tls_suite, Role::Worker, &args.id)?,
    };
    match args.connect.parse::<tonic::transport::Uri>() {
        Ok(uri) if uri.scheme_str() == Some("https") && uri.host().is_some() => {}
        _ => anyhow::bail!(
            "bad --connect address {:?}: expected https://host:port",
            args.connect
        ),
    }
    let endpoint = (tls, args.connect.clone());
    let paths = if args.models.is_empty() {
        let dir = args.data_dir.join("models").join("reference");
        let saved = aether_gpu_worker::reference::install(&dir)
            .with_context(|| format!("cannot write the reference model into {}", dir.display()))?;
        vec![saved.weights_path]
    } else {
        args.models.clone()
    };
    let mut models = Vec::new();
    for path in &paths {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let digest = hex::encode(aether_ledger::hashing::sm3(&bytes));
        let model = ClearingModel::load(path, &digest, device)
            .with_context(|| format!("cannot load {}", path.display()))?;
        tracing::info!(model = %path.display(), %digest, device = %model.device_name(), "model loaded");
        models.push(Arc::new(model));
    }

    // One session after another: a gateway that restarts or a connection that drops is
    // waited for, with a growing pause, until SIGTERM or Ctrl-C (batches in flight when
    // it went are reassigned by the gateway, so nothing is decided twice).
    let (stop_tx, mut stop) = watch::channel(false);
    tokio::spawn(async move {
        crate::serve::shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let mut pause = RECONNECT_FIRST;
    loop {
        let mut connected = false;
        let outcome = session(&args, &endpoint, &models, stop.clone(), &mut connected).await;
        if connected {
            pause = RECONNECT_FIRST;
        }
        let error = match outcome {
            Ok(Ended::Stopped) => return Ok(()),
            Ok(Ended::Closed) => anyhow::anyhow!("the gateway closed the work stream"),
            Err(e) => e,
        };
        if args.no_reconnect || refused_for_good(&error) {
            return Err(error);
        }
        tracing::warn!(
            error = %aether_gateway::errors::error_chain(error.as_ref()),
            retry_in_ms = pause.as_millis() as u64,
            "no session with the gateway; connecting again"
        );
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|stop| *stop) => return Ok(()),
        }
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

/// Whether the gateway refused this worker in a way that asking again cannot change (the
/// certificate is not a worker's, or names another worker; no model), rather than being
/// out of reach.
fn refused_for_good(error: &anyhow::Error) -> bool {
    use tonic::Code;
    error.downcast_ref::<tonic::Status>().is_some_and(|status| {
        matches!(
            status.code(),
            Code::PermissionDenied | Code::Unauthenticated | Code::InvalidArgument
        )
    })
}

/// Longest a draining worker waits for the batches it holds.
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// The first pause before connecting again, and the longest.
const RECONNECT_FIRST: Duration = Duration::from_millis(250);
const RECONNECT_MAX: Duration = Duration::from_secs(10);

/// How a session with the gateway ended without an error.
enum Ended {
    /// SIGTERM or Ctrl-C: the gateway was told (once there was a work stream), and the
    /// batches in flight answered.
    Stopped,
    /// The gateway ended the work stream (it is shutting down).
    Closed,
}

/// Connects, registers the models and scores the batches sent until the stream ends or a
/// shutdown signal drains the worker. Sets `connected` once it has a work stream.
async fn session(
    args: &WorkerArgs,
    endpoint: &(ClientTls, String),
    models: &[Arc<ClearingModel>],
    mut stop: watch::Receiver<bool>,
    connected: &mut bool,
) -> anyhow::Result<Ended> {
    let device_name = models
        .first()
        .map(|m| m.device_name())
        .unwrap_or_else(|| "cpu".into());
    let (tx, rx) = mpsc::channel(16);
    let open = async {
        let (tls, address) = endpoint;
        let channel = tls
            .connect(address)
            .await
            .with_context(|| format!("cannot reach the gateway at {}", args.connect))?;
        let mut client = WorkerServiceClient::new(channel);
        let session_id = client
            .register(RegisterRequest {
                worker_id: args.id.clone(),
                device: device_name.clone(),
                model_digests: models
                    .iter()
                    .map(|m| m.model().digest().to_owned())
                    .collect(),
                max_batch: args.max_batch,
            })
            .await
            .context("registration refused")?
            .into_inner()
            .session_id;
        tx.send(WorkerMessage {
            body: Some(Body::Hello(WorkerHello {
                session_id: session_id.clone(),
            })),
        })
        .await?;
        let assignments = client
            .work(ReceiverStream::new(rx))
            .await
            .context("the work stream was refused")?
            .into_inner();
        anyhow::Ok((client, session_id, assignments))
    };
    // Until there is a work stream there is nothing to drain.
    let (mut client, session_id, mut assignments) = tokio::select! {
        opened = open => opened?,
        _ = stop.wait_for(|stop| *stop) => return Ok(Ended::Stopped),
    };
    *connected = true;
    // A line scripts and tests can wait for.
    println!("aether worker {} connected ({device_name})", args.id);
    tracing::info!(worker = %args.id, %session_id, "connected to the gateway");

    // Batches taken and not yet answered: reported with each heartbeat, waited for on
    // drain.
    let in_flight = Arc::new(AtomicU32::new(0));
    let heartbeat = {
        let mut client = client.clone();
        let session_id = session_id.clone();
        let in_flight = Arc::clone(&in_flight);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                if client
                    .heartbeat(HeartbeatRequest {
                        session_id: session_id.clone(),
                        in_flight: in_flight.load(Ordering::Relaxed),
                    })
                    .await
                    .is_err()
                {
                    return;
                }
            }
        })
    };
    let _stop_heartbeat = AbortOnDrop(heartbeat);
    let delay = Duration::from_millis(args.delay_ms);
    loop {
        tokio::select! {
            next = assignments.message() => match next {
                Ok(Some(assignment)) => {
                    let tx = tx.clone();
                    let models = models.to_vec();
                    let in_flight = Arc::clone(&in_flight);
                    in_flight.fetch_add(1, Ordering::Relaxed);
                    tokio::spawn(async move {
                        if !delay.is_zero() {
                            tokio::time::sleep(delay).await;
                        }
                        let _ = tx.send(score(&models, assignment).await).await;
                        in_flight.fetch_sub(1, Ordering::Relaxed);
                    });
                }
                Ok(None) => return Ok(Ended::Closed),
                Err(status) => anyhow::bail!("the work stream failed: {status}"),
            },
            _ = stop.wait_for(|stop| *stop) => {
                // No new batches; the ones taken are answered before the worker goes
                // (up to DRAIN_LIMIT), so the gateway need not send them elsewhere.
                let left = client.drain(DrainRequest { session_id: session_id.clone() }).await?;
                tracing::info!(remaining = left.into_inner().remaining, "draining");
                let deadline = tokio::time::Instant::now() + DRAIN_LIMIT;
                while in_flight.load(Ordering::Relaxed) > 0
                    && tokio::time::Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                // The last answers leave before the stream is dropped with the session.
                tokio::time::sleep(Duration::from_millis(200)).await;
                return Ok(Ended::Stopped);
            }
        }
    }
}

/// Aborts a background task when its owner goes.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Scores and nets one assignment with the model it names.
/// The span of a batch whose items came from traced requests: a child of the first traced
/// item's scoring span at the gateway (the trace crosses the worker protocol), the others
/// counted; no span for a batch of untraced requests, nor when traces are not exported.
fn batch_span(assignment: &WorkAssignment, model: &ClearingModel) -> tracing::Span {
    let mut traced = assignment
        .items
        .iter()
        .filter(|i| !i.traceparent.is_empty());
    let Some(first) = traced.next() else {
        return tracing::Span::none();
    };
    let span = tracing::debug_span!(
        "worker.score",
        otel.name = "aether.v1.WorkerService/Work",
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        otel.status_message = tracing::field::Empty,
        rpc.system = "grpc",
        rpc.service = "aether.v1.WorkerService",
        aether.batch_id = %assignment.batch_id,
        aether.batch_size = assignment.items.len(),
        aether.traced_items = 1 + traced.count(),
        aether.model_digest = %assignment.model_digest,
        aether.device = %model.device_name(),
    );
    aether_gateway::telemetry::follow_context(&span, &first.traceparent, "", &first.baggage);
    span
}

async fn score(models: &[Arc<ClearingModel>], assignment: WorkAssignment) -> WorkerMessage {
    let batch_id = assignment.batch_id.clone();
    let failed = |reason: String| WorkerMessage {
        body: Some(Body::Failed(BatchFailed {
            batch_id: batch_id.clone(),
            reason,
        })),
    };
    let Some(model) = models
        .iter()
        .find(|m| m.model().digest() == assignment.model_digest)
        .cloned()
    else {
        return failed(format!(
            "this worker does not hold model {}",
            assignment.model_digest
        ));
    };
    let mut batch = Vec::with_capacity(assignment.items.len());
    for item in &assignment.items {
        match to_trade(item) {
            Ok(t) => batch.push(t),
            Err(reason) => return failed(reason),
        }
    }
    let plan = aether_gpu_worker::ExplainPlan {
        marked: assignment.items.iter().map(|i| i.explain).collect(),
        at_or_above: assignment.explain_at_or_above.map(|t| t as f32),
    };
    let span = batch_span(&assignment, &model);
    // The span is entered on the blocking thread too: the batch's stages (scoring,
    // netting, explanations) are its children.
    let inner = span.clone();
    let outcome = tokio::task::spawn_blocking(move || {
        inner.in_scope(|| model.score_net_and_explain(&batch, &plan))
    })
    .instrument(span.clone())
    .await;
    if let Ok(Err(e)) = &outcome {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_message", tracing::field::display(e));
    }
    match outcome {
        Ok(Ok(result)) => WorkerMessage {
            body: Some(Body::Result(BatchResult {
                batch_id: assignment.batch_id,
                scores: assignment
                    .items
                    .iter()
                    .zip(&result.scores)
                    .zip(result.explanations.iter().chain(std::iter::repeat(&None)))
                    .map(|((item, s), explanation)| {
                        let (explanation_json, explanation_error) = match explanation {
                            Some(Ok(e)) => {
                                (serde_json::to_string(e).unwrap_or_default(), String::new())
                            }
                            Some(Err(e)) => (String::new(), e.to_string()),
                            None => (String::new(), String::new()),
                        };
                        ItemScore {
                            request_id: item.request_id.clone(),
                            score: f64::from(s.score),
                            confidence: f64::from(s.confidence),
                            explanation_json,
                            explanation_error,
                        }
                    })
                    .collect(),
                netting: result
                    .netting
                    .positions
                    .iter()
                    .map(|p| NetPosition {
                        party: p.party.clone(),
                        currency: p.currency.clone(),
                        net_minor: p.net_minor.to_string(),
                    })
                    .collect(),
                device: result.device,
                model_digest: result.model_digest,
                elapsed_us: u64::try_from(result.elapsed.as_micros()).unwrap_or(u64::MAX),
            })),
        },
        Ok(Err(e)) => failed(e.to_string()),
        Err(e) => failed(format!("scoring stopped: {e}")),
    }
}

fn to_trade(item: &aether_gateway::pb::v1::WorkItem) -> Result<(Trade, TradeContext), String> {
    let t = item
        .trade
        .as_ref()
        .ok_or_else(|| format!("item {} has no trade", item.request_id))?;
    let value_date =
        chrono::NaiveDate::parse_from_str(&t.value_date, "%Y-%m-%d").map_err(|_| {
            format!(
                "item {}: bad value_date {:?}",
                item.request_id, t.value_date
            )
        })?;
    let trade = Trade {
        request_id: item.request_id.clone(),
        member_id: item.member_id.clone(),
        buyer: t.buyer.clone(),
        seller: t.seller.clone(),
        instrument: t.instrument.clone(),
        currency: t.currency.clone(),
        amount_minor: t.amount_minor,
        value_date,
        jurisdiction: t.jurisdiction.clone(),
        counterparty_tier: u8::try_from(t.counterparty_tier).unwrap_or(u8::MAX),
    };
    let context = TradeContext {
        hour_utc: u8::try_from(item.hour_utc).unwrap_or(u8::MAX),
        velocity: item.velocity,
    };
    Ok((trade, context))
}

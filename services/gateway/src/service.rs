//! `ClearingService` over gRPC: identity from the client certificate, the SM2/SM4
//! envelope opened and the answer sealed with the same key, the pipeline in between.
//!
//! Envelope failures are answered UNAUTHENTICATED (or as their kind says) and leave
//! nothing but a counter behind: no event, no state.

use std::pin::Pin;
use std::sync::Arc;

use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use crate::clearing::{Answer, ClearError, ClearingGateway, Decision};
use crate::envelope::{
    Aad, Direction, EnvelopeError, EnvelopeKey, ErrorKind, KEY_HEADER, RequestKeys, SessionKeys,
    seal, unix_now,
};
use crate::identity::Peer;
use crate::pb::v1::clearing_service_server::ClearingService;
use crate::pb::v1::{
    self as pb, KeyExchangeRequest, KeyExchangeResponse, SealedBatchRequest, SealedBatchResponse,
    SealedRequest, SealedResponse,
};

pub const METHOD_SUBMIT: &str = "/aether.v1.ClearingService/Submit";
pub const METHOD_SUBMIT_BATCH: &str = "/aether.v1.ClearingService/SubmitBatch";
pub const METHOD_SUBMIT_STREAM: &str = "/aether.v1.ClearingService/SubmitStream";
/// Requests of one `SubmitStream` being decided at once; the stream's further messages
/// wait unread until one is answered, so a member cannot queue unbounded work on a stream.
pub const MAX_STREAM_IN_FLIGHT: usize = 256;
/// Most requests in one `SubmitBatch`.
pub const MAX_BATCH_REQUESTS: usize = 1_000;

/// The gRPC face of a [`ClearingGateway`].
#[derive(Clone)]
pub struct ClearingServer {
    gateway: ClearingGateway,
    envelope: Arc<EnvelopeKey>,
    sessions: Arc<SessionKeys>,
    request_keys: Arc<RequestKeys>,
}

impl ClearingServer {
    pub fn new(
        gateway: ClearingGateway,
        envelope: Arc<EnvelopeKey>,
        sessions: SessionKeys,
        request_keys: RequestKeys,
    ) -> Self {
        ClearingServer {
            gateway,
            envelope,
            sessions: Arc::new(sessions),
            request_keys: Arc::new(request_keys),
        }
    }

    /// Drops expired session keys and replay records; call from a timer.
    pub fn purge_expired(&self) {
        let now = unix_now();
        self.sessions.purge_expired(now);
        self.request_keys.forget_expired(now);
    }

    /// One sealed request, start to end.
    async fn one(
        &self,
        peer: &Peer,
        method: &str,
        call: &CallMetadata,
        sealed: SealedRequest,
    ) -> Result<SealedResponse, Status> {
        let key_header = call.key_header.as_deref();
        // The gateway stage's time: opening and checking here, sealing at the end.
        let received = std::time::Instant::now();
        peer.authorize_member(&sealed.member_id)?;
        let aad = Aad {
            direction: Direction::Request,
            method,
            request_id: &sealed.request_id,
            member_id: &sealed.member_id,
            key_id: &sealed.key_id,
            issued_at: sealed.issued_at,
        };
        let now = unix_now();
        if !sealed.key_id.is_empty() && key_header.is_some() {
            envelope_failure("two_keys");
            return Err(Status::invalid_argument(format!(
                "the request names session key id {:?} and also carries {KEY_HEADER} metadata; \
                 send one of them (ENVELOPE.md §4)",
                sealed.key_id
            )));
        }
        let opened = if sealed.key_id.is_empty() {
            let header = key_header.ok_or_else(|| {
                envelope_failure("no_key");
                Status::unauthenticated(format!(
                    "the request names no session key id and carries no {KEY_HEADER} metadata"
                ))
            })?;
            self.request_keys.open(
                &self.envelope,
                header,
                &aad,
                &sealed.nonce,
                &sealed.ciphertext,
                now,
            )
        } else {
            self.sessions
                .open(&aad, &sealed.nonce, &sealed.ciphertext, now)
        }
        .map_err(envelope_status)?;
        let mut decoded = crate::request::decode(opened.plaintext.as_slice())
            .map_err(|e| Status::invalid_argument(bounded(e.to_string())))?;
        let request = &mut decoded.request;
        // The colouring's own trace context, else the call's metadata's (with its state).
        let mut tracestate = "";
        if request.traceparent.is_empty()
            && let Some(traceparent) = &call.traceparent
        {
            request.traceparent = traceparent.clone();
            tracestate = &call.tracestate;
        }
        // The request's span, a child of the member's `traceparent` (known only once the
        // envelope is open); off unless traces are exported (`crate::telemetry`).
        let span = crate::telemetry::request_span(
            method,
            &sealed.member_id,
            &sealed.request_id,
            &request.trace_id,
            &request.traceparent,
            tracestate,
            &call.baggage,
        );
        // The ids its log lines carry: the trace id it is coloured with (the member's, else
        // its traceparent's, else the one the gateway makes, made here so both agree).
        let trace_id = match (
            request.trace_id.is_empty(),
            request.traceparent.split('-').nth(1),
        ) {
            (false, _) => request.trace_id.clone(),
            (true, Some(from_parent)) => from_parent.to_owned(),
            (true, None) => {
                request.trace_id = uuid::Uuid::now_v7().simple().to_string();
                request.trace_id.clone()
            }
        };
        let opening = received.elapsed();
        if !span.is_disabled() {
            let opened_at = std::time::SystemTime::now();
            crate::telemetry::past_span(
                "envelope.open",
                &span.in_scope(crate::telemetry::current_traceparent),
                opened_at - opening,
                opened_at,
                vec![opentelemetry::KeyValue::new(
                    "aether.key",
                    if sealed.key_id.is_empty() {
                        "request"
                    } else {
                        "session"
                    },
                )],
            );
        }
        // Kept only for a failure that was not sampled (`telemetry::keep_failure`).
        let unsampled_traceparent = (span.is_disabled() && crate::telemetry::exporting())
            .then(|| request.traceparent.clone());
        let clearing = self.gateway.clear(crate::request::submission(
            &sealed.member_id,
            &sealed.request_id,
            decoded,
        ));
        let decided = crate::telemetry::with_log_ids(
            crate::telemetry::LogIds::new(&trace_id),
            clearing.instrument(span.clone()),
        )
        .await;
        crate::telemetry::finish(&span, decided.as_ref().map(|a| a.receipt.seq));
        if let (Some(traceparent), Err(e)) = (&unsampled_traceparent, &decided) {
            crate::telemetry::keep_failure(
                &crate::telemetry::FailedRequest {
                    method,
                    member: &sealed.member_id,
                    request_id: &sealed.request_id,
                    trace_id: &trace_id,
                    traceparent,
                    tracestate,
                    baggage: &call.baggage,
                },
                std::time::SystemTime::now() - received.elapsed(),
                e,
            );
        }
        let answer = decided.map_err(clear_status)?;
        let plaintext = to_pb(answer).encode_to_vec();
        let issued_at = unix_now();
        let sealing = std::time::Instant::now();
        let out = span
            .in_scope(|| {
                let _seal = crate::stage_span!("envelope.seal").entered();
                seal(&opened.key, &aad.response(issued_at), &plaintext)
            })
            .map_err(envelope_status)?;
        self.gateway
            .budgets()
            .record(crate::budgets::Stage::Gateway, opening + sealing.elapsed());
        Ok(SealedResponse {
            request_id: sealed.request_id,
            nonce: out.nonce.to_vec(),
            ciphertext: out.ciphertext,
            issued_at,
            error: None,
        })
    }
}

/// What a call's gRPC metadata says for all its requests: the per-request key header, and
/// the W3C trace context an OpenTelemetry-instrumented gRPC client puts there (followed
/// when a request's own colouring names no `traceparent`; one that is not W3C's is
/// ignored, as W3C Trace Context says), and its W3C `baggage` (ignored whole when it is not
/// W3C's, `telemetry::valid_baggage`).
#[derive(Clone, Debug, Default)]
struct CallMetadata {
    key_header: Option<String>,
    traceparent: Option<String>,
    tracestate: String,
    baggage: String,
}

fn call_metadata<T>(request: &Request<T>) -> CallMetadata {
    let text = |name: &str| {
        request
            .metadata()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let traceparent = text("traceparent").filter(|t| aether_control::origin::valid_traceparent(t));
    CallMetadata {
        key_header: text(KEY_HEADER),
        tracestate: traceparent
            .as_ref()
            .and_then(|_| text("tracestate"))
            .unwrap_or_default(),
        traceparent,
        baggage: text("baggage")
            .filter(|b| crate::telemetry::valid_baggage(b))
            .unwrap_or_default(),
    }
}

fn envelope_failure(kind: &'static str) {
    metrics::counter!("aether_envelope_failures_total", "kind" => kind).increment(1);
}

/// The gRPC status of an envelope failure; internal details stay in the log.
fn envelope_status(e: EnvelopeError) -> Status {
    match e.kind() {
        ErrorKind::Unauthenticated => {
            envelope_failure("unauthenticated");
            Status::unauthenticated(e.to_string())
        }
        ErrorKind::InvalidArgument => {
            envelope_failure("invalid_argument");
            Status::invalid_argument(e.to_string())
        }
        ErrorKind::ResourceExhausted => {
            envelope_failure("resource_exhausted");
            Status::resource_exhausted(e.to_string())
        }
        _ => {
            tracing::error!(error = %e, "envelope failure");
            Status::internal("the gateway could not process the envelope")
        }
    }
}

/// Longest status message sent: it travels in an HTTP/2 trailer, and a member's 70 kB
/// field echoed back whole would overflow the client's header list (an h2 protocol error
/// instead of the refusal).
pub const MAX_STATUS_MESSAGE: usize = 1_024;

/// `message` cut to [`MAX_STATUS_MESSAGE`] bytes at a character boundary, marked as cut.
fn bounded(message: String) -> String {
    if message.len() <= MAX_STATUS_MESSAGE {
        return message;
    }
    let cut = (0..=MAX_STATUS_MESSAGE - 3)
        .rev()
        .find(|&i| message.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}…", &message[..cut])
}

fn clear_status(e: ClearError) -> Status {
    match &e {
        ClearError::InvalidTrade(_) | ClearError::InvalidColouring(_) => {
            Status::invalid_argument(bounded(e.to_string()))
        }
        ClearError::NoEngine(_) => Status::failed_precondition(e.to_string()),
        ClearError::Overloaded(_) => Status::resource_exhausted(e.to_string()),
        ClearError::Worker(_) => Status::unavailable(e.to_string()),
        ClearError::RequestIdReused { .. } => Status::already_exists(e.to_string()),
        ClearError::Ledger(_) => {
            tracing::error!(error = %e, "a decision could not be recorded");
            Status::unavailable(e.to_string())
        }
    }
}

/// One batch or stream item that got no decision: its status, in place of a sealed answer.
fn item_error(request_id: String, status: &Status) -> SealedResponse {
    SealedResponse {
        request_id,
        error: Some(pb::ItemError {
            code: status.code() as i32,
            message: status.message().to_owned(),
        }),
        ..SealedResponse::default()
    }
}

fn to_pb(a: Answer) -> pb::ClearingAnswer {
    let decision = match a.decision {
        Decision::Cleared => pb::Decision::Cleared,
        Decision::HeldForReview => pb::Decision::HeldForReview,
        Decision::Rejected => pb::Decision::Rejected,
    };
    pb::ClearingAnswer {
        request_id: a.request_id,
        decision: decision as i32,
        score: a.score,
        confidence: a.confidence,
        rules_fired: a.rules_fired,
        cited_clauses: a.cited_clauses,
        receipt: Some(pb::Receipt {
            seq: a.receipt.seq,
            event_hash: a.receipt.event_hash,
            snapshot_id: a.receipt.snapshot_id,
            trace_id: a.receipt.trace_id,
        }),
        model_ref: a.model_ref,
        model_stage: a.model_stage,
        replayed: a.replayed,
    }
}

type AnswerStream = Pin<Box<dyn Stream<Item = Result<SealedResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ClearingService for ClearingServer {
    async fn key_exchange(
        &self,
        request: Request<KeyExchangeRequest>,
    ) -> Result<Response<KeyExchangeResponse>, Status> {
        let peer = Peer::from_request(&request)?;
        peer.authorize_member(&peer.id)?;
        let grant = self
            .sessions
            .exchange_for(
                &self.envelope,
                &request.get_ref().wrapped_key,
                &peer.id,
                unix_now(),
            )
            .map_err(envelope_status)?;
        Ok(Response::new(KeyExchangeResponse {
            key_id: grant.key_id,
            expires_at_unix_ms: i64::try_from(grant.expires_at.saturating_mul(1000))
                .unwrap_or(i64::MAX),
            max_uses: grant.max_uses,
        }))
    }

    async fn submit(
        &self,
        request: Request<SealedRequest>,
    ) -> Result<Response<SealedResponse>, Status> {
        let peer = Peer::from_request(&request)?;
        let call = call_metadata(&request);
        let answer = self
            .one(&peer, METHOD_SUBMIT, &call, request.into_inner())
            .await?;
        Ok(Response::new(answer))
    }

    /// Every item gets its own outcome: a decision or its own error. The call fails as a
    /// whole only before anything is decided (too many items, or an item in another
    /// member's name), so no recorded decision is ever lost with a failed call.
    async fn submit_batch(
        &self,
        request: Request<SealedBatchRequest>,
    ) -> Result<Response<SealedBatchResponse>, Status> {
        let peer = Peer::from_request(&request)?;
        let call = call_metadata(&request);
        let requests = request.into_inner().requests;
        if requests.len() > MAX_BATCH_REQUESTS {
            return Err(Status::invalid_argument(format!(
                "a batch holds at most {MAX_BATCH_REQUESTS} requests, got {}",
                requests.len()
            )));
        }
        for r in &requests {
            peer.authorize_member(&r.member_id)?;
        }
        let answers = futures::future::join_all(requests.into_iter().map(|r| async {
            let request_id = r.request_id.clone();
            self.one(&peer, METHOD_SUBMIT_BATCH, &call, r)
                .await
                .unwrap_or_else(|status| item_error(request_id, &status))
        }))
        .await;
        Ok(Response::new(SealedBatchResponse { responses: answers }))
    }

    type SubmitStreamStream = AnswerStream;

    /// Answers in completion order; an item that gets no decision is answered with its own
    /// error and the stream goes on. An item in another member's name (the connection
    /// cannot be trusted) or a transport failure ends the stream with that status, after
    /// the items already being decided are answered. At most [`MAX_STREAM_IN_FLIGHT`]
    /// requests of one stream are decided at once.
    async fn submit_stream(
        &self,
        request: Request<Streaming<SealedRequest>>,
    ) -> Result<Response<Self::SubmitStreamStream>, Status> {
        let peer = Peer::from_request(&request)?;
        let call = call_metadata(&request);
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(256);
        let server = self.clone();
        tokio::spawn(async move {
            let mut tasks = tokio::task::JoinSet::new();
            let mut ending: Option<Status> = None;
            loop {
                tokio::select! {
                    // At the bound, stop reading: HTTP/2 flow control then holds the member.
                    message = inbound.message(), if tasks.len() < MAX_STREAM_IN_FLIGHT => match message {
                        Ok(Some(sealed)) => {
                            if let Err(status) = peer.authorize_member(&sealed.member_id) {
                                ending = Some(status);
                                break;
                            }
                            let (server, peer, call, tx) =
                                (server.clone(), peer.clone(), call.clone(), tx.clone());
                            tasks.spawn(async move {
                                let request_id = sealed.request_id.clone();
                                // Boxed: the task then holds a pointer, not the whole
                                // pipeline's state, which spawning copied more than once.
                                let answer = Box::pin(server.one(
                                    &peer,
                                    METHOD_SUBMIT_STREAM,
                                    &call,
                                    sealed,
                                ))
                                .await
                                .unwrap_or_else(|status| item_error(request_id, &status));
                                let _ = tx.send(Ok(answer)).await;
                            });
                        }
                        Ok(None) => break,
                        Err(status) => {
                            ending = Some(status);
                            break;
                        }
                    },
                    Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                }
            }
            // Every item being decided is answered before a status ends the stream.
            while tasks.join_next().await.is_some() {}
            if let Some(status) = ending {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

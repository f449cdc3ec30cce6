//! A small clearing client: mTLS channel, session key exchange (or a key per request),
//! sealing requests and opening answers as `proto/ENVELOPE.md` describes.

use std::path::Path;

use prost::Message;
use sm2::pkcs8::DecodePublicKey;
use tonic::transport::Channel;

use crate::envelope::{
    Aad, Direction, EnvelopeError, KEY_HEADER, Sm4Key, encode_wrapped_key, open, seal, unix_now,
    wrap_key,
};
use crate::pb::v1::clearing_service_client::ClearingServiceClient;
use crate::pb::v1::{
    ClearingAnswer, ClearingRequest, KeyExchangeRequest, SealedBatchRequest, SealedRequest,
    SealedResponse,
};
use crate::service::{METHOD_SUBMIT, METHOD_SUBMIT_BATCH, METHOD_SUBMIT_STREAM};
use crate::tls::{ClientTls, TlsError, TlsPaths};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot reach the gateway at {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("the gateway's envelope public key at {path} is unusable: {reason}")]
    ServerKey { path: String, reason: String },
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("the gateway answered {code:?}: {message}")]
    Status { code: tonic::Code, message: String },
    #[error("the gateway's answer cannot be read: {0}")]
    Answer(String),
}

impl ClientError {
    /// Whether the gateway no longer knows the session key this call was sealed with
    /// (unknown there — another node, or a restarted one — expired, or used up): the
    /// refusals whose message ends "send a new KeyExchange" (ENVELOPE.md §9). Nothing was
    /// decided for such a request, so sending it again under a new key is safe.
    pub fn is_session_lost(&self) -> bool {
        matches!(self, ClientError::Status { code: tonic::Code::Unauthenticated, message }
            if message.ends_with(SESSION_LOST_SUFFIX))
    }
}

/// How the gateway's refusals of an unknown, expired or used-up session key end.
const SESSION_LOST_SUFFIX: &str = "send a new KeyExchange";

impl From<tonic::Status> for ClientError {
    fn from(s: tonic::Status) -> Self {
        ClientError::Status {
            code: s.code(),
            message: s.message().to_owned(),
        }
    }
}

/// How requests are keyed.
#[derive(Clone)]
enum Keying {
    PerRequest,
    /// Boxed: a key carries its SM4-GCM key schedule (~300 bytes).
    Session {
        key_id: String,
        key: Box<Sm4Key>,
    },
}

/// A member's connection to the clearing gateway. Clones share the connection and the
/// session key, so one member can have many requests in flight.
///
/// In session mode a call refused because the gateway does not know the session key (the
/// connection reached another node of the cluster, or a restarted one; the key expired or
/// was used up) is re-keyed with one `KeyExchange` and its refused requests sent once more:
/// session keys live in the node that granted them (DEPLOYMENT.md, "Clearing on several
/// nodes"), and nothing was decided for a request whose envelope was not opened. A clone
/// re-keys on its own.
#[derive(Clone)]
pub struct ClearingClient {
    grpc: ClearingServiceClient<Channel>,
    server_key: sm2::PublicKey,
    member_id: String,
    keying: Keying,
    /// `traceparent`, `tracestate` and `baggage`, sent as gRPC metadata with every call.
    trace: Vec<(&'static str, String)>,
}

impl ClearingClient {
    /// Connects over mTLS to `endpoint` (`https://host:port`) as `member_id`, whose
    /// certificate and key are in `tls`; `server_key_pem` is the gateway's SM2 public key.
    pub async fn connect(
        endpoint: &str,
        tls: &TlsPaths,
        server_key_pem: &Path,
        member_id: &str,
    ) -> Result<Self, ClientError> {
        Self::connect_with(endpoint, &ClientTls::load(tls)?, server_key_pem, member_id).await
    }

    /// As [`connect`](Self::connect) with a TLS client already loaded, for instance one
    /// offering the RFC 8998 suites ([`ClientTls::load_suite`]).
    pub async fn connect_with(
        endpoint: &str,
        tls: &ClientTls,
        server_key_pem: &Path,
        member_id: &str,
    ) -> Result<Self, ClientError> {
        let pem = std::fs::read_to_string(server_key_pem).map_err(|e| ClientError::ServerKey {
            path: server_key_pem.display().to_string(),
            reason: e.to_string(),
        })?;
        let server_key =
            sm2::PublicKey::from_public_key_pem(&pem).map_err(|e| ClientError::ServerKey {
                path: server_key_pem.display().to_string(),
                reason: e.to_string(),
            })?;
        let connect_err = |reason: String| ClientError::Connect {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let channel = tls
            .connect(endpoint)
            .await
            .map_err(|e| connect_err(e.reason))?;
        Ok(ClearingClient {
            grpc: ClearingServiceClient::new(channel),
            server_key,
            member_id: member_id.to_owned(),
            keying: Keying::PerRequest,
            trace: Vec::new(),
        })
    }

    /// Switches to a session key: one SM2 operation now instead of one per request.
    pub async fn key_exchange(&mut self) -> Result<String, ClientError> {
        let key = Sm4Key::generate()?;
        let wrapped = wrap_key(&self.server_key, &key)?;
        let grant = self
            .grpc
            .key_exchange(KeyExchangeRequest {
                wrapped_key: wrapped.to_vec(),
            })
            .await?
            .into_inner();
        self.keying = Keying::Session {
            key_id: grant.key_id.clone(),
            key: Box::new(key),
        };
        Ok(grant.key_id)
    }

    /// The session key's id, in session mode.
    pub fn session_key_id(&self) -> Option<&str> {
        match &self.keying {
            Keying::Session { key_id, .. } => Some(key_id),
            Keying::PerRequest => None,
        }
    }

    /// Whether `error` means the session key must be exchanged again (session mode only).
    fn must_rekey(&self, error: &ClientError) -> bool {
        matches!(self.keying, Keying::Session { .. }) && error.is_session_lost()
    }

    /// Submits one trade and opens the sealed answer.
    pub async fn submit(
        &mut self,
        request_id: &str,
        request: &ClearingRequest,
    ) -> Result<ClearingAnswer, ClientError> {
        match self.submit_once(request_id, request).await {
            Err(e) if self.must_rekey(&e) => {
                self.key_exchange().await?;
                self.submit_once(request_id, request).await
            }
            answered => answered,
        }
    }

    async fn submit_once(
        &mut self,
        request_id: &str,
        request: &ClearingRequest,
    ) -> Result<ClearingAnswer, ClientError> {
        let key = self.call_key()?;
        let sealed = self.seal(&key, METHOD_SUBMIT, request_id, request)?;
        let response = self.grpc.submit(key.request(sealed)?).await?.into_inner();
        self.open(&key, METHOD_SUBMIT, request_id, &response)
    }

    /// Submits several trades in one call (at most [`crate::service::MAX_BATCH_REQUESTS`]);
    /// the outcomes come in the order of `trades`, each a decision or that item's own
    /// refusal (nothing recorded for it). An `Err` for the whole call means nothing was
    /// decided.
    pub async fn submit_batch(
        &mut self,
        trades: &[(&str, &ClearingRequest)],
    ) -> Result<Vec<ItemOutcome>, ClientError> {
        // A lost key refuses items, never the whole call (that is only for the caller's
        // identity or the transport), so only refused items are sent again.
        let mut outcomes = self.submit_batch_once(trades).await?;
        let lost = self.lost_items(&outcomes);
        if lost.is_empty() {
            return Ok(outcomes);
        }
        self.key_exchange().await?;
        let again: Vec<(&str, &ClearingRequest)> = lost.iter().map(|&k| trades[k]).collect();
        for (k, outcome) in lost.into_iter().zip(self.submit_batch_once(&again).await?) {
            outcomes[k] = outcome;
        }
        Ok(outcomes)
    }

    /// The positions of the outcomes refused for a lost session key.
    fn lost_items(&self, outcomes: &[ItemOutcome]) -> Vec<usize> {
        outcomes
            .iter()
            .enumerate()
            .filter(|(_, o)| o.answer.as_ref().is_err_and(|e| self.must_rekey(e)))
            .map(|(k, _)| k)
            .collect()
    }

    async fn submit_batch_once(
        &mut self,
        trades: &[(&str, &ClearingRequest)],
    ) -> Result<Vec<ItemOutcome>, ClientError> {
        let key = self.call_key()?;
        let requests = self.seal_all(&key, METHOD_SUBMIT_BATCH, trades)?;
        let responses = self
            .grpc
            .submit_batch(key.request(SealedBatchRequest { requests })?)
            .await?
            .into_inner()
            .responses;
        if responses.len() != trades.len() {
            return Err(ClientError::Answer(format!(
                "{} answers for {} trades",
                responses.len(),
                trades.len()
            )));
        }
        Ok(trades
            .iter()
            .zip(&responses)
            .map(|((id, _), response)| ItemOutcome {
                request_id: (*id).to_owned(),
                answer: self.outcome(&key, METHOD_SUBMIT_BATCH, id, response),
            })
            .collect())
    }

    /// Sends the trades on one `SubmitStream` and collects their outcomes, in the order
    /// they were decided: a decision or that item's own refusal. An `Err` is the stream's
    /// end with a status (a transport failure, or an item in another member's name) or an
    /// answer that does not belong; the outcomes received before it are in the error's
    /// place only when every trade got one.
    pub async fn submit_stream(
        &mut self,
        trades: &[(&str, &ClearingRequest)],
    ) -> Result<Vec<ItemOutcome>, ClientError> {
        // A lost key refuses items, never the whole call (that is only for the caller's
        // identity or the transport), so only refused items are sent again.
        let mut outcomes = self.submit_stream_once(trades).await?;
        let lost = self.lost_items(&outcomes);
        if lost.is_empty() {
            return Ok(outcomes);
        }
        self.key_exchange().await?;
        let again: Vec<(&str, &ClearingRequest)> = lost
            .iter()
            .filter_map(|&k| trades.iter().find(|(id, _)| *id == outcomes[k].request_id))
            .copied()
            .collect();
        for k in lost.into_iter().rev() {
            outcomes.remove(k);
        }
        outcomes.extend(self.submit_stream_once(&again).await?);
        Ok(outcomes)
    }

    async fn submit_stream_once(
        &mut self,
        trades: &[(&str, &ClearingRequest)],
    ) -> Result<Vec<ItemOutcome>, ClientError> {
        let key = self.call_key()?;
        let requests = self.seal_all(&key, METHOD_SUBMIT_STREAM, trades)?;
        let mut responses = self
            .grpc
            .submit_stream(key.request(futures::stream::iter(requests))?)
            .await?
            .into_inner();
        let mut unanswered: std::collections::HashSet<&str> =
            trades.iter().map(|(id, _)| *id).collect();
        let mut outcomes = Vec::with_capacity(trades.len());
        while let Some(response) = responses.message().await? {
            if !unanswered.remove(response.request_id.as_str()) {
                return Err(ClientError::Answer(format!(
                    "an answer for request {:?}, which was not sent or was answered already",
                    response.request_id
                )));
            }
            outcomes.push(ItemOutcome {
                answer: self.outcome(&key, METHOD_SUBMIT_STREAM, &response.request_id, &response),
                request_id: response.request_id,
            });
        }
        if !unanswered.is_empty() {
            return Err(ClientError::Answer(format!(
                "the gateway ended the stream with {} requests unanswered",
                unanswered.len()
            )));
        }
        Ok(outcomes)
    }

    /// One batch or stream item's outcome: its own refusal, or its sealed answer opened.
    fn outcome(
        &self,
        key: &CallKey,
        method: &str,
        request_id: &str,
        response: &SealedResponse,
    ) -> Result<ClearingAnswer, ClientError> {
        match &response.error {
            Some(e) => Err(ClientError::Status {
                code: tonic::Code::from_i32(e.code),
                message: e.message.clone(),
            }),
            None => self.open(key, method, request_id, response),
        }
    }

    /// The key for one call: the session key, or a fresh one wrapped for the header.
    /// Sends this W3C trace context as gRPC metadata (`traceparent`, and `tracestate` when
    /// not empty) with every call, as OpenTelemetry's gRPC instrumentation does; the gateway
    /// follows it for requests whose colouring names no `traceparent` of its own.
    pub fn with_trace_context(mut self, traceparent: &str, tracestate: &str) -> Self {
        self.trace.retain(|(name, _)| *name == "baggage");
        self.trace.push(("traceparent", traceparent.to_owned()));
        if !tracestate.is_empty() {
            self.trace.push(("tracestate", tracestate.to_owned()));
        }
        self
    }

    /// Sends this W3C `baggage` as gRPC metadata with every call, as OpenTelemetry's gRPC
    /// instrumentation does; the gateway's spans of a traced request carry its entries.
    pub fn with_baggage(mut self, baggage: &str) -> Self {
        self.trace.retain(|(name, _)| *name != "baggage");
        self.trace.push(("baggage", baggage.to_owned()));
        self
    }

    fn call_key(&self) -> Result<CallKey, ClientError> {
        let trace = self.trace.clone();
        Ok(match &self.keying {
            Keying::Session { key_id, key } => CallKey {
                key: Sm4Key::clone(key),
                key_id: key_id.clone(),
                header: None,
                trace,
            },
            Keying::PerRequest => {
                let key = Sm4Key::generate()?;
                let wrapped = wrap_key(&self.server_key, &key)?;
                CallKey {
                    key,
                    key_id: String::new(),
                    header: Some(encode_wrapped_key(&wrapped)),
                    trace,
                }
            }
        })
    }

    fn aad<'a>(&'a self, key: &'a CallKey, method: &'a str, request_id: &'a str) -> Aad<'a> {
        Aad {
            direction: Direction::Request,
            method,
            request_id,
            member_id: &self.member_id,
            key_id: &key.key_id,
            issued_at: unix_now(),
        }
    }

    fn seal(
        &self,
        key: &CallKey,
        method: &str,
        request_id: &str,
        request: &ClearingRequest,
    ) -> Result<SealedRequest, ClientError> {
        let aad = self.aad(key, method, request_id);
        let sealed = seal(&key.key, &aad, &request.encode_to_vec())?;
        Ok(SealedRequest {
            member_id: self.member_id.clone(),
            request_id: request_id.to_owned(),
            key_id: key.key_id.clone(),
            nonce: sealed.nonce.to_vec(),
            ciphertext: sealed.ciphertext,
            issued_at: aad.issued_at,
        })
    }

    fn seal_all(
        &self,
        key: &CallKey,
        method: &str,
        trades: &[(&str, &ClearingRequest)],
    ) -> Result<Vec<SealedRequest>, ClientError> {
        trades
            .iter()
            .map(|(id, request)| self.seal(key, method, id, request))
            .collect()
    }

    fn open(
        &self,
        key: &CallKey,
        method: &str,
        request_id: &str,
        response: &SealedResponse,
    ) -> Result<ClearingAnswer, ClientError> {
        let aad = self.aad(key, method, request_id);
        let plaintext = open(
            &key.key,
            &aad.response(response.issued_at),
            &response.nonce,
            &response.ciphertext,
        )?;
        ClearingAnswer::decode(plaintext.as_slice()).map_err(|e| ClientError::Answer(e.to_string()))
    }
}

/// One item of a batch or stream: its request id and its decision, or why it got none.
#[derive(Debug)]
pub struct ItemOutcome {
    pub request_id: String,
    pub answer: Result<ClearingAnswer, ClientError>,
}

/// The key one call is sealed with, and the header that carries it when it is per request.
struct CallKey {
    key: Sm4Key,
    key_id: String,
    header: Option<String>,
    trace: Vec<(&'static str, String)>,
}

impl CallKey {
    /// `message` as a call, with the wrapped key in its header when there is one.
    fn request<T>(&self, message: T) -> Result<tonic::Request<T>, ClientError> {
        let mut call = tonic::Request::new(message);
        if let Some(header) = &self.header {
            let value = header
                .parse()
                .map_err(|_| ClientError::Answer("unencodable key header".into()))?;
            call.metadata_mut().insert(KEY_HEADER, value);
        }
        for (name, value) in &self.trace {
            let value = value
                .parse()
                .map_err(|_| ClientError::Answer(format!("unencodable {name} metadata")))?;
            call.metadata_mut().insert(*name, value);
        }
        Ok(call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(e: EnvelopeError) -> ClientError {
        let status = match e.kind() {
            crate::envelope::ErrorKind::Unauthenticated => {
                tonic::Status::unauthenticated(e.to_string())
            }
            _ => tonic::Status::invalid_argument(e.to_string()),
        };
        ClientError::from(status)
    }

    /// The client re-keys on exactly the refusals of a key the gateway no longer holds;
    /// a forged or replayed request is never sent again.
    #[test]
    fn a_lost_session_is_told_from_other_refusals() {
        for lost in [
            EnvelopeError::UnknownKeyId,
            EnvelopeError::KeyExpired { expired_at: 1 },
            EnvelopeError::KeyExhausted { max_uses: 10 },
        ] {
            assert!(refused(lost.clone()).is_session_lost(), "{lost}");
        }
        for other in [
            EnvelopeError::Authentication,
            EnvelopeError::Replayed,
            EnvelopeError::Stale {
                issued_at: 1,
                now: 1000,
                max_age: 300,
            },
            EnvelopeError::KeyUnwrap,
        ] {
            assert!(!refused(other.clone()).is_session_lost(), "{other}");
        }
        let elsewhere = ClientError::Status {
            code: tonic::Code::InvalidArgument,
            message: "unknown envelope key id; send a new KeyExchange".into(),
        };
        assert!(!elsewhere.is_session_lost());
    }
}

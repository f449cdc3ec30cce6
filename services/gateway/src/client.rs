//! A small clearing client: mTLS channel, session key exchange (or a key per request),
//! sealing requests and opening answers as `proto/ENVELOPE.md` describes.

use std::path::Path;

use prost::Message;
use sm2::pkcs8::DecodePublicKey;
use tonic::transport::{Channel, Endpoint};

use crate::envelope::{
    Aad, Direction, EnvelopeError, KEY_HEADER, Sm4Key, encode_wrapped_key, open, seal, unix_now,
    wrap_key,
};
use crate::pb::v1::clearing_service_client::ClearingServiceClient;
use crate::pb::v1::{ClearingAnswer, ClearingRequest, KeyExchangeRequest, SealedRequest};
use crate::service::METHOD_SUBMIT;
use crate::tls::{TlsError, TlsPaths, client_tls_config};

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
    Session { key_id: String, key: Sm4Key },
}

/// A member's connection to the clearing gateway. Clones share the connection and the
/// session key, so one member can have many requests in flight.
#[derive(Clone)]
pub struct ClearingClient {
    grpc: ClearingServiceClient<Channel>,
    server_key: sm2::PublicKey,
    member_id: String,
    keying: Keying,
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
        let channel = Endpoint::from_shared(endpoint.to_owned())
            .map_err(|e| connect_err(e.to_string()))?
            .tls_config(client_tls_config(tls)?)
            .map_err(|e| connect_err(e.to_string()))?
            .connect()
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        Ok(ClearingClient {
            grpc: ClearingServiceClient::new(channel),
            server_key,
            member_id: member_id.to_owned(),
            keying: Keying::PerRequest,
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
            key,
        };
        Ok(grant.key_id)
    }

    /// Submits one trade and opens the sealed answer.
    pub async fn submit(
        &mut self,
        request_id: &str,
        request: &ClearingRequest,
    ) -> Result<ClearingAnswer, ClientError> {
        let (key, key_id, header) = match &self.keying {
            Keying::Session { key_id, key } => (key.clone(), key_id.clone(), None),
            Keying::PerRequest => {
                let key = Sm4Key::generate()?;
                let wrapped = wrap_key(&self.server_key, &key)?;
                (key, String::new(), Some(encode_wrapped_key(&wrapped)))
            }
        };
        let issued_at = unix_now();
        let aad = Aad {
            direction: Direction::Request,
            method: METHOD_SUBMIT,
            request_id,
            member_id: &self.member_id,
            key_id: &key_id,
            issued_at,
        };
        let sealed = seal(&key, &aad, &request.encode_to_vec())?;
        let mut call = tonic::Request::new(SealedRequest {
            member_id: self.member_id.clone(),
            request_id: request_id.to_owned(),
            key_id: key_id.clone(),
            nonce: sealed.nonce.to_vec(),
            ciphertext: sealed.ciphertext,
            issued_at,
        });
        if let Some(header) = header {
            let value = header
                .parse()
                .map_err(|_| ClientError::Answer("unencodable key header".into()))?;
            call.metadata_mut().insert(KEY_HEADER, value);
        }
        let response = self.grpc.submit(call).await?.into_inner();
        let plaintext = open(
            &key,
            &aad.response(response.issued_at),
            &response.nonce,
            &response.ciphertext,
        )?;
        ClearingAnswer::decode(plaintext.as_slice()).map_err(|e| ClientError::Answer(e.to_string()))
    }
}

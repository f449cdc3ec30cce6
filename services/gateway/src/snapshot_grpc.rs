//! The snapshot participant protocol over gRPC (`proto/aether/v1/snapshot.proto`), so
//! that a participant can live in another process: [`ParticipantServer`] serves any
//! in-process participant, [`GrpcParticipant`] is the coordinator's side of the wire.

use std::sync::Arc;
use std::time::Duration;

use aether_control::{ParticipantError, Pinned, SnapshotParticipant};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Response, Status};
use uuid::Uuid;

use crate::pb::v1::snapshot_participant_client::SnapshotParticipantClient;
use crate::pb::v1::snapshot_participant_server::{
    SnapshotParticipant as ParticipantService, SnapshotParticipantServer,
};
use crate::pb::v1::{
    AbortRequest, AbortResponse, CommitRequest, CommitResponse, PrepareRequest, PrepareResponse,
    RestoreRequest, RestoreResponse,
};

/// Serves one participant as the `SnapshotParticipant` gRPC service.
pub struct ParticipantServer {
    inner: Arc<dyn SnapshotParticipant>,
}

impl ParticipantServer {
    pub fn new(inner: Arc<dyn SnapshotParticipant>) -> Self {
        ParticipantServer { inner }
    }

    /// The tonic service, for `Server::builder().add_service(..)`.
    pub fn into_service(self) -> SnapshotParticipantServer<ParticipantServer> {
        SnapshotParticipantServer::new(self)
    }
}

fn snapshot_id(text: &str) -> Result<Uuid, Status> {
    Uuid::parse_str(text).map_err(|_| Status::invalid_argument("snapshot_id must be a UUID"))
}

fn status(e: ParticipantError) -> Status {
    match e {
        ParticipantError::UnknownVersion(_) => Status::not_found(e.to_string()),
        ParticipantError::Unavailable(_) => Status::unavailable(e.to_string()),
        ParticipantError::Failed(_) => Status::failed_precondition(e.to_string()),
    }
}

#[tonic::async_trait]
impl ParticipantService for ParticipantServer {
    async fn prepare(
        &self,
        request: Request<PrepareRequest>,
    ) -> Result<Response<PrepareResponse>, Status> {
        let r = request.into_inner();
        let id = snapshot_id(&r.snapshot_id)?;
        let pinned = self
            .inner
            .prepare(id, Duration::from_millis(r.ttl_ms))
            .await
            .map_err(status)?;
        Ok(Response::new(PrepareResponse {
            participant: self.inner.name().to_owned(),
            version: pinned.version,
            digest: pinned.digest,
        }))
    }

    async fn commit(
        &self,
        request: Request<CommitRequest>,
    ) -> Result<Response<CommitResponse>, Status> {
        let id = snapshot_id(&request.get_ref().snapshot_id)?;
        self.inner.commit(id).await.map_err(status)?;
        Ok(Response::new(CommitResponse {}))
    }

    async fn abort(
        &self,
        request: Request<AbortRequest>,
    ) -> Result<Response<AbortResponse>, Status> {
        let id = snapshot_id(&request.get_ref().snapshot_id)?;
        self.inner.abort(id).await.map_err(status)?;
        Ok(Response::new(AbortResponse {}))
    }

    async fn restore(
        &self,
        request: Request<RestoreRequest>,
    ) -> Result<Response<RestoreResponse>, Status> {
        let digest = self
            .inner
            .restore(&request.get_ref().version)
            .await
            .map_err(status)?;
        Ok(Response::new(RestoreResponse { digest }))
    }
}

/// Why a remote participant could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum GrpcParticipantError {
    #[error("invalid participant endpoint {uri:?}: {source}")]
    Endpoint {
        uri: String,
        source: tonic::transport::Error,
    },
}

/// A participant in another process, reached over mTLS. The channel connects lazily, so
/// an unreachable participant fails its prepare (and aborts the snapshot) rather than
/// the coordinator's start.
pub struct GrpcParticipant {
    name: String,
    client: SnapshotParticipantClient<Channel>,
}

impl GrpcParticipant {
    /// `uri` like `https://host:port`; `tls` from [`crate::tls::client_tls_config`].
    pub fn connect_lazy(
        name: &str,
        uri: &str,
        tls: ClientTlsConfig,
    ) -> Result<Self, GrpcParticipantError> {
        let endpoint = |source| GrpcParticipantError::Endpoint {
            uri: uri.to_owned(),
            source,
        };
        let channel = Endpoint::from_shared(uri.to_owned())
            .map_err(endpoint)?
            .tls_config(tls)
            .map_err(endpoint)?
            .connect_timeout(Duration::from_secs(5))
            .connect_lazy();
        Ok(Self::with_channel(name, channel))
    }

    /// Over a channel built elsewhere.
    pub fn with_channel(name: &str, channel: Channel) -> Self {
        GrpcParticipant {
            name: name.to_owned(),
            client: SnapshotParticipantClient::new(channel),
        }
    }
}

fn participant_error(s: Status) -> ParticipantError {
    match s.code() {
        tonic::Code::NotFound => ParticipantError::UnknownVersion(s.message().to_owned()),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown => {
            ParticipantError::Unavailable(s.message().to_owned())
        }
        _ => ParticipantError::Failed(s.message().to_owned()),
    }
}

#[tonic::async_trait]
impl SnapshotParticipant for GrpcParticipant {
    fn name(&self) -> &str {
        &self.name
    }

    async fn prepare(&self, snapshot_id: Uuid, ttl: Duration) -> Result<Pinned, ParticipantError> {
        let mut request = Request::new(PrepareRequest {
            snapshot_id: snapshot_id.to_string(),
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        });
        // The server gives up too once the coordinator would no longer wait.
        request.set_timeout(ttl);
        let r = self
            .client
            .clone()
            .prepare(request)
            .await
            .map_err(participant_error)?
            .into_inner();
        Ok(Pinned {
            version: r.version,
            digest: r.digest,
        })
    }

    async fn commit(&self, snapshot_id: Uuid) -> Result<(), ParticipantError> {
        self.client
            .clone()
            .commit(CommitRequest {
                snapshot_id: snapshot_id.to_string(),
            })
            .await
            .map_err(participant_error)?;
        Ok(())
    }

    async fn abort(&self, snapshot_id: Uuid) -> Result<(), ParticipantError> {
        self.client
            .clone()
            .abort(AbortRequest {
                snapshot_id: snapshot_id.to_string(),
            })
            .await
            .map_err(participant_error)?;
        Ok(())
    }

    async fn restore(&self, version: &str) -> Result<String, ParticipantError> {
        let r = self
            .client
            .clone()
            .restore(RestoreRequest {
                version: version.to_owned(),
            })
            .await
            .map_err(participant_error)?
            .into_inner();
        Ok(r.digest)
    }
}

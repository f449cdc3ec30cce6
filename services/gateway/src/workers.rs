//! Remote workers: `WorkerService` (register, a bidirectional work stream, heartbeat,
//! drain) and the pool the batcher dispatches to.
//!
//! A batch sent to a worker that disconnects, fails it or stays silent past the timeout is
//! reported lost and dispatched again elsewhere; a worker silent past the timeout, or
//! without a heartbeat or a message for [`LIVENESS`], is dropped from the pool (its other
//! batches too; a live worker process connects again); decisions are recorded by the gateway only
//! after a result arrives, so a lost batch can never produce a duplicate decision. A
//! worker's result is checked before use: one score per trade in order, and a netting equal
//! to the gateway's own (integer) computation.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use uuid::Uuid;

use crate::identity::{Peer, require_worker};
use crate::pb::v1::worker_message::Body;
use crate::pb::v1::worker_service_server::WorkerService;
use crate::pb::v1::{
    BatchResult, DrainRequest, DrainResponse, HeartbeatRequest, HeartbeatResponse, RegisterRequest,
    RegisterResponse, WorkAssignment, WorkerMessage,
};

/// Why a dispatch produced no result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DispatchError {
    #[error("no connected worker holds model {0}")]
    NoWorker(String),
    #[error("worker {0} was lost before answering")]
    Lost(String),
    #[error("worker {worker} failed the batch: {reason}")]
    Failed { worker: String, reason: String },
    #[error("worker {0} did not answer in time")]
    Timeout(String),
}

type Reply = oneshot::Sender<Result<BatchResult, String>>;

/// A session heard from neither by heartbeat (workers send one every 5 s) nor by a message
/// for this long is taken for dead.
pub const LIVENESS: Duration = Duration::from_secs(15);

struct Worker {
    id: String,
    device: String,
    digests: Vec<String>,
    /// Set once the work stream is open.
    tx: Option<mpsc::Sender<Result<WorkAssignment, Status>>>,
    in_flight: HashMap<String, Reply>,
    draining: bool,
    /// The last heartbeat or message from it (or its registration).
    last_seen: Instant,
}

impl Worker {
    fn alive(&self) -> bool {
        self.last_seen.elapsed() < LIVENESS
    }
}

#[derive(Default)]
struct Pool {
    /// By session id.
    workers: HashMap<String, Worker>,
}

/// The connected workers; cheap to clone.
#[derive(Clone, Default)]
pub struct WorkerPool {
    pool: Arc<Mutex<Pool>>,
}

impl WorkerPool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a connected, live, non-draining worker holds `digest`.
    pub fn serves(&self, digest: &str) -> bool {
        self.lock().workers.values().any(|w| {
            w.tx.is_some() && !w.draining && w.alive() && w.digests.iter().any(|d| d == digest)
        })
    }

    /// Connected workers: `(id, device)`.
    pub fn workers(&self) -> Vec<(String, String)> {
        self.lock()
            .workers
            .values()
            .filter(|w| w.tx.is_some())
            .map(|w| (w.id.clone(), w.device.clone()))
            .collect()
    }

    /// Sends a batch to the least busy worker holding its model and waits for the result.
    /// Returns the worker's id and its device with the result.
    pub async fn dispatch(
        &self,
        assignment: WorkAssignment,
        timeout: Duration,
    ) -> Result<(String, BatchResult), DispatchError> {
        let batch_id = assignment.batch_id.clone();
        let digest = assignment.model_digest.clone();
        let (session, worker_id, tx, rx) = {
            let mut pool = self.lock();
            pool.drop_silent();
            let chosen = pool
                .workers
                .iter_mut()
                .filter(|(_, w)| w.tx.is_some() && !w.draining && w.digests.contains(&digest))
                .min_by_key(|(_, w)| w.in_flight.len())
                .ok_or_else(|| DispatchError::NoWorker(digest.clone()))?;
            let (reply, rx) = oneshot::channel();
            let (session, worker) = chosen;
            worker.in_flight.insert(batch_id.clone(), reply);
            let tx = worker
                .tx
                .clone()
                .ok_or_else(|| DispatchError::NoWorker(digest.clone()))?;
            (session.clone(), worker.id.clone(), tx, rx)
        };
        if tx.send(Ok(assignment)).await.is_err() {
            self.forget(&session, &batch_id);
            return Err(DispatchError::Lost(worker_id));
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Ok(result))) => Ok((worker_id, result)),
            Ok(Ok(Err(reason))) => Err(DispatchError::Failed {
                worker: worker_id,
                reason,
            }),
            Ok(Err(_)) => Err(DispatchError::Lost(worker_id)),
            Err(_) => {
                // Silent past the timeout: not sent more work. Its other batches are lost
                // with it and go elsewhere; a live worker process connects again.
                self.remove(&session, "did not answer a batch in time");
                Err(DispatchError::Timeout(worker_id))
            }
        }
    }

    fn forget(&self, session: &str, batch_id: &str) {
        if let Some(w) = self.lock().workers.get_mut(session) {
            w.in_flight.remove(batch_id);
        }
    }

    fn complete(&self, session: &str, batch_id: &str, outcome: Result<BatchResult, String>) {
        let reply = self
            .lock()
            .workers
            .get_mut(session)
            .and_then(|w| w.in_flight.remove(batch_id));
        if let Some(reply) = reply {
            let _ = reply.send(outcome);
        }
    }

    /// Ends every work stream (at shutdown): workers see the stream close and stop.
    pub fn close_all(&self) {
        for w in self.lock().workers.values_mut() {
            w.tx = None;
        }
    }

    /// Drops a worker; its batches in flight are reported lost (their senders drop), and
    /// its work stream ends.
    fn remove(&self, session: &str, why: &str) {
        self.lock().remove(session, why);
    }

    /// Notes that the session was heard from.
    fn seen(&self, session: &str) {
        if let Some(w) = self.lock().workers.get_mut(session) {
            w.last_seen = Instant::now();
        }
    }
}

impl Pool {
    fn remove(&mut self, session: &str, why: &str) {
        if let Some(w) = self.workers.remove(session) {
            tracing::warn!(worker = %w.id, in_flight = w.in_flight.len(), why, "worker dropped");
            if w.tx.is_some() {
                metrics::gauge!("aether_workers_connected").decrement(1.0);
            }
        }
    }

    /// Drops the sessions not heard from for [`LIVENESS`].
    fn drop_silent(&mut self) {
        let silent: Vec<String> = self
            .workers
            .iter()
            .filter(|(_, w)| !w.alive())
            .map(|(session, _)| session.clone())
            .collect();
        for session in silent {
            self.remove(&session, "no heartbeat");
        }
    }
}

/// The gRPC face of the pool.
#[derive(Clone)]
pub struct WorkerServer {
    pool: WorkerPool,
}

impl WorkerServer {
    pub fn new(pool: WorkerPool) -> Self {
        WorkerServer { pool }
    }
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<WorkAssignment, Status>> + Send>>;

fn session_of(pool: &WorkerPool, peer: &Peer, session_id: &str) -> Result<(), Status> {
    match pool.lock().workers.get(session_id) {
        Some(w) if w.id == peer.id => Ok(()),
        Some(_) => Err(Status::permission_denied(format!(
            "session {session_id} belongs to another worker"
        ))),
        None => Err(Status::failed_precondition(format!(
            "unknown session {session_id:?}; call Register first"
        ))),
    }
}

#[tonic::async_trait]
impl WorkerService for WorkerServer {
    async fn register(
        &self,
        request: Request<RegisterRequest>,
    ) -> Result<Response<RegisterResponse>, Status> {
        let peer = require_worker(&request)?;
        let r = request.into_inner();
        if r.worker_id != peer.id {
            return Err(Status::permission_denied(format!(
                "worker certificate {peer} cannot register as {:?}",
                r.worker_id
            )));
        }
        if r.model_digests.is_empty() {
            return Err(Status::invalid_argument(
                "a worker must hold at least one model",
            ));
        }
        let session_id = Uuid::now_v7().to_string();
        self.pool.lock().workers.insert(
            session_id.clone(),
            Worker {
                id: r.worker_id,
                device: r.device,
                digests: r.model_digests,
                tx: None,
                in_flight: HashMap::new(),
                draining: false,
                last_seen: Instant::now(),
            },
        );
        Ok(Response::new(RegisterResponse { session_id }))
    }

    type WorkStream = AssignmentStream;

    async fn work(
        &self,
        request: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::WorkStream>, Status> {
        let peer = require_worker(&request)?;
        let mut inbound = request.into_inner();
        let session = match inbound.message().await? {
            Some(WorkerMessage {
                body: Some(Body::Hello(hello)),
            }) => hello.session_id,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message of a work stream must be a hello with the session id",
                ));
            }
        };
        session_of(&self.pool, &peer, &session)?;
        let (tx, rx) = mpsc::channel(16);
        if let Some(w) = self.pool.lock().workers.get_mut(&session) {
            w.tx = Some(tx);
        }
        metrics::gauge!("aether_workers_connected").increment(1.0);
        tracing::info!(worker = %peer.id, %session, "worker connected");
        let pool = self.pool.clone();
        tokio::spawn(async move {
            loop {
                let message = inbound.message().await;
                if let Ok(Some(_)) = &message {
                    pool.seen(&session);
                }
                match message {
                    Ok(Some(WorkerMessage {
                        body: Some(Body::Result(result)),
                    })) => {
                        let id = result.batch_id.clone();
                        pool.complete(&session, &id, Ok(result));
                    }
                    Ok(Some(WorkerMessage {
                        body: Some(Body::Failed(failed)),
                    })) => pool.complete(&session, &failed.batch_id, Err(failed.reason)),
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            pool.remove(&session, "its work stream ended");
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let peer = require_worker(&request)?;
        let session = &request.get_ref().session_id;
        session_of(&self.pool, &peer, session)?;
        self.pool.seen(session);
        Ok(Response::new(HeartbeatResponse {}))
    }

    async fn drain(
        &self,
        request: Request<DrainRequest>,
    ) -> Result<Response<DrainResponse>, Status> {
        let peer = require_worker(&request)?;
        let session = &request.get_ref().session_id;
        session_of(&self.pool, &peer, session)?;
        let remaining = self
            .pool
            .lock()
            .workers
            .get_mut(session)
            .map(|w| {
                w.draining = true;
                w.in_flight.len()
            })
            .unwrap_or(0);
        Ok(Response::new(DrainResponse {
            remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "4e31";

    /// A pool with one connected worker holding [`DIGEST`], last heard from `ago`; the
    /// receiving end of its work stream.
    fn pool_with_worker(
        ago: Duration,
    ) -> (WorkerPool, mpsc::Receiver<Result<WorkAssignment, Status>>) {
        let pool = WorkerPool::default();
        let (tx, rx) = mpsc::channel(16);
        pool.lock().workers.insert(
            "session-1".into(),
            Worker {
                id: "worker-1".into(),
                device: "cpu".into(),
                digests: vec![DIGEST.into()],
                tx: Some(tx),
                in_flight: HashMap::new(),
                draining: false,
                last_seen: Instant::now().checked_sub(ago).expect("a past instant"),
            },
        );
        (pool, rx)
    }

    fn batch(id: &str) -> WorkAssignment {
        WorkAssignment {
            batch_id: id.into(),
            model_digest: DIGEST.into(),
            ..WorkAssignment::default()
        }
    }

    #[tokio::test]
    async fn a_worker_silent_past_the_timeout_is_dropped_with_its_other_batches() {
        let (pool, mut stream) = pool_with_worker(Duration::ZERO);
        let long = tokio::spawn({
            let pool = pool.clone();
            async move { pool.dispatch(batch("b-1"), Duration::from_secs(60)).await }
        });
        // b-1 reached the worker before b-2 is sent.
        assert_eq!(
            stream.recv().await.expect("b-1").expect("ok").batch_id,
            "b-1"
        );
        let short = pool.dispatch(batch("b-2"), Duration::from_millis(50)).await;
        assert_eq!(short, Err(DispatchError::Timeout("worker-1".into())));
        // b-1 is reported lost at once rather than after its own minute, so it can go to
        // another worker; none is left here.
        let long = tokio::time::timeout(Duration::from_secs(5), long)
            .await
            .expect("b-1 answered before its timeout")
            .expect("task");
        assert_eq!(long, Err(DispatchError::Lost("worker-1".into())));
        assert!(pool.workers().is_empty());
        assert!(!pool.serves(DIGEST));
        // Its work stream ends once the last assignment is taken: the worker reconnects.
        assert_eq!(
            stream.recv().await.expect("b-2").expect("ok").batch_id,
            "b-2"
        );
        assert!(stream.recv().await.is_none());
    }

    #[tokio::test]
    async fn a_worker_not_heard_from_for_the_liveness_period_gets_no_work() {
        let (pool, mut stream) = pool_with_worker(LIVENESS + Duration::from_secs(1));
        assert!(!pool.serves(DIGEST));
        let answer = pool.dispatch(batch("b-1"), Duration::from_secs(60)).await;
        assert_eq!(answer, Err(DispatchError::NoWorker(DIGEST.into())));
        assert!(pool.workers().is_empty());
        assert!(stream.recv().await.is_none());
        // One heard from recently is served.
        let (pool, _stream) = pool_with_worker(LIVENESS - Duration::from_secs(5));
        assert!(pool.serves(DIGEST));
    }
}

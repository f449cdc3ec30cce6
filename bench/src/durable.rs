//! The durable baseline of `aether bench clearing`: the least a durable, answered request
//! can cost here. A bare tonic mTLS server, on the gateway's certificate and envelope key,
//! that opens the member's SM4 session envelope (the gateway's own session table, replay
//! checks included), appends the request (its bytes, and an SM3 hash chained to the
//! previous request's) through a group commit like the ledger's (batches of at most
//! `max_batch` requests gathered for at most `max_wait`; on PostgreSQL one binary `COPY`
//! per batch with `synchronous_commit` on, on SQLite one multi-row `INSERT` per
//! `BEGIN IMMEDIATE` transaction with the ledger's SQLite settings, as the ledger writes
//! each), and answers, sealed, only after the commit. Nothing else: no rules, no scoring,
//! no netting, no lineage, no checkpoints.
//!
//! The gateway's throughput against this one says how close a decision gets to the cost
//! of the durability it cannot do without.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use aether_gateway::envelope::{
    Aad, Direction, EnvelopeKey, SessionKeys, SessionPolicy, seal, unix_now,
};
use aether_gateway::identity::Peer;
use aether_gateway::pb::v1::clearing_service_server::ClearingService;
use aether_gateway::pb::v1::{
    ClearingAnswer, KeyExchangeRequest, KeyExchangeResponse, Receipt, SealedBatchRequest,
    SealedBatchResponse, SealedRequest, SealedResponse,
};
use aether_gateway::service::{METHOD_SUBMIT, METHOD_SUBMIT_STREAM};
use aether_gateway::tls::TlsSuite;
use aether_ledger::pg_binary::{BinaryRows, copy_in};
use anyhow::Context;
use prost::Message;
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status, Streaming};

/// The table the baseline appends to: a seq, the request's bytes and the hash chain.
const TABLE: &str = "bench_durable_requests";
/// Requests waiting for the group commit; a caller beyond this waits to queue.
const QUEUE: usize = 10_000;

/// How the group commit batches, as `aether serve --max-batch / --max-wait-us` do.
#[derive(Clone, Copy, Debug)]
pub struct GroupCommit {
    pub max_batch: usize,
    pub max_wait: Duration,
}

/// One request waiting for its commit; answered with its seq.
struct Append {
    body: Vec<u8>,
    done: oneshot::Sender<Result<u64, String>>,
}

#[derive(Clone)]
struct Durable {
    envelope: Arc<EnvelopeKey>,
    sessions: Arc<SessionKeys>,
    appends: mpsc::Sender<Append>,
}

impl Durable {
    /// Opens, appends, waits for the commit, answers sealed.
    async fn decide(&self, peer: &Peer, method: &str, sealed: SealedRequest) -> SealedResponse {
        match self.try_decide(peer, method, &sealed).await {
            Ok(response) => response,
            Err(status) => SealedResponse {
                request_id: sealed.request_id,
                error: Some(aether_gateway::pb::v1::ItemError {
                    code: status.code() as i32,
                    message: status.message().to_owned(),
                }),
                ..SealedResponse::default()
            },
        }
    }

    async fn try_decide(
        &self,
        peer: &Peer,
        method: &str,
        sealed: &SealedRequest,
    ) -> Result<SealedResponse, Status> {
        peer.authorize_member(&sealed.member_id)?;
        let aad = Aad {
            direction: Direction::Request,
            method,
            request_id: &sealed.request_id,
            member_id: &sealed.member_id,
            key_id: &sealed.key_id,
            issued_at: sealed.issued_at,
        };
        let opened = self
            .sessions
            .open(&aad, &sealed.nonce, &sealed.ciphertext, unix_now())
            .map_err(|e| Status::unauthenticated(e.to_string()))?;
        let (done, committed) = oneshot::channel();
        self.appends
            .send(Append {
                body: opened.plaintext,
                done,
            })
            .await
            .map_err(|_| Status::unavailable("the group commit stopped"))?;
        let seq = committed
            .await
            .map_err(|_| Status::unavailable("the group commit stopped"))?
            .map_err(Status::unavailable)?;
        let answer = ClearingAnswer {
            request_id: sealed.request_id.clone(),
            receipt: Some(Receipt {
                seq,
                ..Receipt::default()
            }),
            ..ClearingAnswer::default()
        };
        let issued_at = unix_now();
        let reply = seal(
            &opened.key,
            &aad.response(issued_at),
            &answer.encode_to_vec(),
        )
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(SealedResponse {
            request_id: sealed.request_id.clone(),
            nonce: reply.nonce.to_vec(),
            ciphertext: reply.ciphertext,
            issued_at,
            error: None,
        })
    }
}

#[tonic::async_trait]
impl ClearingService for Durable {
    async fn key_exchange(
        &self,
        request: Request<KeyExchangeRequest>,
    ) -> Result<Response<KeyExchangeResponse>, Status> {
        let peer = Peer::from_request(&request)?;
        let grant = self
            .sessions
            .exchange_for(
                &self.envelope,
                &request.get_ref().wrapped_key,
                &peer.id,
                unix_now(),
            )
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
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
        let response = self
            .decide(&peer, METHOD_SUBMIT, request.into_inner())
            .await;
        match response.error {
            Some(e) => Err(Status::new(tonic::Code::from(e.code), e.message)),
            None => Ok(Response::new(response)),
        }
    }

    async fn submit_batch(
        &self,
        _request: Request<SealedBatchRequest>,
    ) -> Result<Response<SealedBatchResponse>, Status> {
        Err(Status::unimplemented(
            "the durable baseline answers Submit and SubmitStream only",
        ))
    }

    type SubmitStreamStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<SealedResponse, Status>> + Send>>;

    /// Each message decided and answered in order, as the load sends them one at a time.
    async fn submit_stream(
        &self,
        request: Request<Streaming<SealedRequest>>,
    ) -> Result<Response<Self::SubmitStreamStream>, Status> {
        use futures::StreamExt;
        let peer = Peer::from_request(&request)?;
        let this = self.clone();
        let answers = request.into_inner().then(move |sealed| {
            let (this, peer) = (this.clone(), peer.clone());
            async move {
                match sealed {
                    Ok(s) => Ok(this.decide(&peer, METHOD_SUBMIT_STREAM, s).await),
                    Err(status) => Err(status),
                }
            }
        });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// One appended request: its seq, its bytes, the previous hash and its own.
type Row<'a> = (u64, &'a [u8], [u8; 32], [u8; 32]);

/// Where the baseline appends: the ledger's database kind, with the ledger's durability.
enum Sink {
    Postgres(PgConnection),
    Sqlite(sqlx::SqliteConnection),
}

impl Sink {
    async fn open(database_url: &str) -> anyhow::Result<Sink> {
        if database_url.starts_with("sqlite:") {
            let options = aether_ledger::sqlite_options(database_url)?.create_if_missing(true);
            let mut conn = sqlx::SqliteConnection::connect_with(&options).await?;
            sqlx::raw_sql(&format!(
                "DROP TABLE IF EXISTS {TABLE}; CREATE TABLE {TABLE} (seq INTEGER PRIMARY KEY, \
                 body BLOB NOT NULL, prev_hash BLOB NOT NULL, hash BLOB NOT NULL)"
            ))
            .execute(&mut conn)
            .await?;
            return Ok(Sink::Sqlite(conn));
        }
        let mut conn = PgConnection::connect(database_url).await?;
        create_table(&mut conn).await?;
        Ok(Sink::Postgres(conn))
    }

    /// Commits one batch: `(seq, body, prev_hash, hash)` rows.
    async fn commit(&mut self, rows: &[Row<'_>]) -> Result<(), String> {
        match self {
            Sink::Postgres(conn) => {
                let copy =
                    format!("COPY {TABLE} (seq, body, prev_hash, hash) FROM STDIN (FORMAT binary)");
                let bytes: usize = rows.iter().map(|r| r.1.len() + 100).sum();
                let mut data = BinaryRows::new(4, bytes);
                for (seq, body, prev, hash) in rows {
                    data.row().int8(*seq as i64);
                    data.bytes(body)
                        .and_then(|r| {
                            r.bytes(prev)?;
                            r.bytes(hash)
                        })
                        .map_err(|e| e.to_string())?;
                }
                commit(conn, &copy, data.finish())
                    .await
                    .map_err(|e| e.to_string())
            }
            Sink::Sqlite(conn) => {
                let mut tx = conn
                    .begin_with("BEGIN IMMEDIATE")
                    .await
                    .map_err(|e| e.to_string())?;
                let mut insert: sqlx::QueryBuilder<sqlx::Sqlite> = sqlx::QueryBuilder::new(
                    format!("INSERT INTO {TABLE} (seq, body, prev_hash, hash) "),
                );
                insert.push_values(rows, |mut b, (seq, body, prev, hash)| {
                    b.push_bind(*seq as i64)
                        .push_bind(*body)
                        .push_bind(prev.as_slice())
                        .push_bind(hash.as_slice());
                });
                insert
                    .build()
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| e.to_string())?;
                tx.commit().await.map_err(|e| e.to_string())
            }
        }
    }
}

/// Creates the baseline's table (dropped first: every run starts empty) with the same
/// durability as the ledger's (`synchronous_commit` on, a primary key on seq).
async fn create_table(conn: &mut PgConnection) -> anyhow::Result<()> {
    sqlx::query(&format!("DROP TABLE IF EXISTS {TABLE}"))
        .execute(&mut *conn)
        .await?;
    sqlx::query(&format!(
        "CREATE TABLE {TABLE} (seq bigint PRIMARY KEY, body bytea NOT NULL, \
         prev_hash bytea NOT NULL, hash bytea NOT NULL)"
    ))
    .execute(&mut *conn)
    .await?;
    sqlx::query("SET synchronous_commit = on")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// The group commit: gathers appends as the ledger's writer does, chains their hashes,
/// writes each batch in one transaction, then answers its callers.
async fn group_commit(mut sink: Sink, mut rx: mpsc::Receiver<Append>, batching: GroupCommit) {
    let (mut seq, mut prev) = (0u64, [0u8; 32]);
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + batching.max_wait;
        while batch.len() < batching.max_batch {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(append)) => batch.push(append),
                _ => break,
            }
        }
        let (first_seq, first_prev) = (seq, prev);
        let mut rows = Vec::with_capacity(batch.len());
        for append in &batch {
            seq += 1;
            let mut chained = Vec::with_capacity(32 + append.body.len());
            chained.extend_from_slice(&prev);
            chained.extend_from_slice(&append.body);
            let hash = aether_ledger::hashing::sm3(&chained);
            rows.push((seq, append.body.as_slice(), prev, hash));
            prev = hash;
        }
        let outcome = sink.commit(&rows).await;
        drop(rows);
        if outcome.is_err() {
            (seq, prev) = (first_seq, first_prev);
        }
        for (answered, append) in (first_seq + 1..).zip(batch) {
            let _ = append.done.send(outcome.clone().map(|()| answered));
        }
    }
}

async fn commit(conn: &mut PgConnection, copy: &str, rows: Vec<u8>) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    copy_in(&mut tx, copy, rows, "the durable baseline").await?;
    tx.commit().await
}

/// Serves the durable baseline on a free port with the gateway's certificate and
/// envelope key from `data`, appending to `database_url`'s database (`postgres://…`, or
/// `sqlite:<file>`, made if missing).
pub async fn start(
    data: &Path,
    database_url: &str,
    suite: TlsSuite,
    batching: GroupCommit,
    key_uses: u64,
) -> anyhow::Result<(String, tokio::sync::watch::Sender<bool>)> {
    let envelope = EnvelopeKey::from_pem_file(&data.join("keys").join("envelope.pem"))
        .context("cannot read the gateway's envelope key")?;
    let sink = Sink::open(database_url)
        .await
        .context("the durable baseline cannot open its database")?;
    let (appends, rx) = mpsc::channel(QUEUE);
    tokio::spawn(group_commit(sink, rx, batching));
    let service = Durable {
        envelope: Arc::new(envelope),
        // The gateway's policy but for the uses a key allows (`--durable-key-uses`, default
        // unlimited): the baseline answers far more requests per key than the gateway in
        // one run, and a re-key costs an SM2 unwrap and a round trip that the gateway's
        // figures do not carry.
        sessions: Arc::new(SessionKeys::new(SessionPolicy {
            max_uses: key_uses,
            ..SessionPolicy::default()
        })),
        appends,
    };
    crate::tls_server::serve(service, data, suite, "the durable baseline").await
}

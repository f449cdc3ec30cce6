//! The OpenLineage HTTP transport against a real HTTP receiver on 127.0.0.1 and a real
//! SQLite ledger file: every stored record arrives once, in seq order, with the API key;
//! an endpoint that fails, is down or refuses delays delivery and loses nothing; a
//! rejected event is recorded, listed by reconcile and sent again on the next start; a
//! restart resumes from the cursor.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aether_ledger::EventStore;
use aether_lineage::http_transport::{
    ENV_API_KEY, ENV_DISABLED, ENV_ENDPOINT, ENV_TIMEOUT, ENV_URL, HTTP_CURSOR,
    HttpTransportConfig, rejections, run_http_relay,
};
use aether_lineage::relay::{reconcile, record};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod support;
use support::{
    Running, TempData, append_policies as append, open_sqlite_ledger as open, start_openlineage,
    wait_until, write_records,
};

const API_KEY: &str = "test-key-0123";

/// The transport's configuration for `base`, read as from the environment, with short
/// waits so the tests do not sit in 30 s backoffs.
fn config(base: &str) -> HttpTransportConfig {
    let env = [
        (ENV_URL, base.to_owned()),
        (ENV_API_KEY, API_KEY.to_owned()),
    ];
    let mut config = HttpTransportConfig::from_lookup(|name| {
        env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())
    })
    .expect("valid configuration")
    .expect("configured");
    config.initial_backoff = Duration::from_millis(10);
    config.max_backoff = Duration::from_millis(200);
    config.poll_interval = Duration::from_millis(20);
    config.timeout = Duration::from_secs(5);
    config
}

fn start_http(store: &EventStore, config: HttpTransportConfig) -> Running {
    let (stop, rx) = watch::channel(false);
    let task = tokio::spawn(run_http_relay(store.clone(), config, rx));
    Running { stop, task }
}

async fn cursor(store: &EventStore) -> u64 {
    store
        .load_position(HTTP_CURSOR)
        .await
        .expect("position")
        .unwrap_or(0)
}

async fn wait_for_cursor(store: &EventStore, seq: u64) {
    wait_until(&format!("HTTP cursor reaches {seq}"), || async {
        cursor(store).await >= seq
    })
    .await;
}

/// What the receiver answers for an event.
#[derive(Clone)]
struct Reply {
    status: u16,
    body: &'static str,
    delay: Duration,
}

impl Reply {
    fn status(status: u16) -> Self {
        Reply {
            status,
            body: "",
            delay: Duration::ZERO,
        }
    }
}

type Policy = Arc<dyn Fn(u64) -> Reply + Send + Sync>;

/// One request as the receiver saw it.
#[derive(Clone, Debug)]
struct Request {
    seq: u64,
    status: u16,
    authorization: Option<String>,
    content_type: Option<String>,
    body: Value,
}

#[derive(Clone)]
struct Receiver {
    requests: Arc<Mutex<Vec<Request>>>,
    policy: Policy,
}

async fn receive(
    State(r): State<Receiver>,
    headers: HeaderMap,
    body: String,
) -> (StatusCode, String) {
    let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let seq = body["run"]["facets"]["aether_ledger"]["seq"]
        .as_u64()
        .unwrap_or(0);
    let reply = (r.policy)(seq);
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    r.requests.lock().expect("requests").push(Request {
        seq,
        status: reply.status,
        authorization: header("authorization"),
        content_type: header("content-type"),
        body,
    });
    tokio::time::sleep(reply.delay).await;
    (
        StatusCode::from_u16(reply.status).expect("status"),
        reply.body.to_owned(),
    )
}

/// A real OpenLineage receiver (`POST /api/v1/lineage`) on 127.0.0.1.
struct Server {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<Request>>>,
    task: JoinHandle<()>,
}

impl Server {
    async fn start(policy: Policy) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        Server::serve(listener, policy)
    }

    /// On a given address (one that refused connections until now).
    async fn start_at(addr: SocketAddr, policy: Policy) -> Server {
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(e) => {
                    tries += 1;
                    assert!(tries < 50, "cannot bind {addr} again: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        Server::serve(listener, policy)
    }

    fn serve(listener: tokio::net::TcpListener, policy: Policy) -> Server {
        let addr = listener.local_addr().expect("address");
        let requests = Arc::new(Mutex::new(Vec::new()));
        let app = axum::Router::new()
            .route("/api/v1/lineage", axum::routing::post(receive))
            .with_state(Receiver {
                requests: requests.clone(),
                policy,
            });
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Server {
            addr,
            requests,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn requests(&self) -> Vec<Request> {
        self.requests.lock().expect("requests").clone()
    }

    /// Seqs the receiver answered with 2xx, in arrival order.
    fn acknowledged(&self) -> Vec<u64> {
        self.requests()
            .iter()
            .filter(|r| (200..300).contains(&r.status))
            .map(|r| r.seq)
            .collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn accept_all() -> Policy {
    Arc::new(|_| Reply::status(201))
}

#[tokio::test]
async fn every_event_is_delivered_once_in_seq_order_with_the_api_key_and_never_ahead_of_its_record()
{
    let dir = TempData::new("http-order");
    let store = open(&dir.0).await;
    append(&store, 1, 25).await;
    let server = Server::start(accept_all()).await;

    // No records yet: the transport waits for them rather than reading the ledger.
    let http = start_http(&store, config(&server.url()));
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(server.requests().is_empty(), "{:?}", server.requests());

    let openlineage = start_openlineage(&store);
    wait_for_cursor(&store, 25).await;
    append(&store, 26, 5).await;
    wait_for_cursor(&store, 30).await;
    openlineage.stop().await;
    http.stop().await;

    let requests = server.requests();
    let seqs: Vec<u64> = requests.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=30).collect::<Vec<u64>>());
    for r in &requests {
        assert_eq!(r.authorization.as_deref(), Some("Bearer test-key-0123"));
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
        // Exactly the stored record, not a fresh mapping.
        let stored = record(&store, r.seq).await.expect("read").expect("stored");
        assert_eq!(r.body, stored.openlineage_event, "seq {}", r.seq);
    }
    assert_eq!(cursor(&store).await, 30);
    let report = reconcile(&store).await.expect("reconcile");
    assert!(report.rejected_by_endpoint.is_empty(), "{report:?}");
    store.shutdown().await;
}

#[tokio::test]
async fn a_failing_endpoint_delays_delivery_without_moving_the_cursor_and_loses_nothing() {
    let dir = TempData::new("http-5xx");
    let store = open(&dir.0).await;
    append(&store, 1, 10).await;
    write_records(&store).await;
    // From seq 4 on it answers 503, 500, 429, 408, 502 ... until it recovers.
    let failing = Arc::new(AtomicBool::new(true));
    let attempts = Arc::new(AtomicUsize::new(0));
    let policy: Policy = {
        let failing = failing.clone();
        Arc::new(move |seq| {
            if seq >= 4 && failing.load(Ordering::SeqCst) {
                let n = attempts.fetch_add(1, Ordering::SeqCst);
                Reply::status([503, 500, 429, 408, 502][n % 5])
            } else {
                Reply::status(200)
            }
        })
    };
    let server = Server::start(policy).await;
    let http = start_http(&store, config(&server.url()));
    wait_until("the endpoint has failed 8 times", || async {
        server.requests().iter().filter(|r| r.status >= 400).count() >= 8
    })
    .await;
    // Delivered events are saved before the retries wait; the failing one is not.
    assert_eq!(cursor(&store).await, 3);
    assert!(
        server.requests().iter().all(|r| r.seq <= 4),
        "nothing after the failing event is sent: {:?}",
        server.requests()
    );

    failing.store(false, Ordering::SeqCst);
    wait_for_cursor(&store, 10).await;
    http.stop().await;
    assert_eq!(server.acknowledged(), (1..=10).collect::<Vec<u64>>());
    assert!(
        reconcile(&store)
            .await
            .expect("reconcile")
            .rejected_by_endpoint
            .is_empty()
    );
    store.shutdown().await;
}

#[tokio::test]
async fn an_endpoint_that_is_down_gets_every_event_once_it_starts() {
    let dir = TempData::new("http-down");
    let store = open(&dir.0).await;
    append(&store, 1, 6).await;
    write_records(&store).await;
    // A port nothing listens on: connections are refused.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("address")
    };
    let http = start_http(&store, config(&format!("http://{addr}")));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        cursor(&store).await,
        0,
        "nothing is acknowledged while down"
    );

    let server = Server::start_at(addr, accept_all()).await;
    wait_for_cursor(&store, 6).await;
    http.stop().await;
    assert_eq!(server.acknowledged(), (1..=6).collect::<Vec<u64>>());
    assert_eq!(server.requests().len(), 6);
    store.shutdown().await;
}

#[tokio::test]
async fn a_rejected_event_is_recorded_skipped_listed_by_reconcile_and_sent_again_on_restart() {
    let dir = TempData::new("http-400");
    let store = open(&dir.0).await;
    append(&store, 1, 8).await;
    write_records(&store).await;
    let rejecting = Arc::new(AtomicBool::new(true));
    let policy: Policy = {
        let rejecting = rejecting.clone();
        Arc::new(move |seq| {
            if seq == 5 && rejecting.load(Ordering::SeqCst) {
                Reply {
                    status: 400,
                    body: r#"{"error":"facet aether_ledger: unknown field"}"#,
                    delay: Duration::ZERO,
                }
            } else {
                Reply::status(201)
            }
        })
    };
    let server = Server::start(policy).await;
    let http = start_http(&store, config(&server.url()));
    wait_for_cursor(&store, 8).await;
    http.stop().await;

    // Sent once, not retried; the events after it were delivered.
    let seqs: Vec<u64> = server.requests().iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=8).collect::<Vec<u64>>());
    assert_eq!(server.acknowledged(), vec![1, 2, 3, 4, 6, 7, 8]);
    // Not silently dropped: recorded with its status and the endpoint's reason.
    let report = reconcile(&store).await.expect("reconcile");
    assert_eq!(report.rejected_by_endpoint, vec![5]);
    let rejected = rejections(&store).await.expect("rejections");
    assert_eq!(rejected.len(), 1);
    assert_eq!(rejected[0].seq, 5);
    assert_eq!(rejected[0].http_status, 400);
    assert!(
        rejected[0].response.contains("unknown field"),
        "{rejected:?}"
    );
    assert_eq!(
        rejected[0].endpoint,
        format!("{}/api/v1/lineage", server.url())
    );

    // The endpoint is fixed; the next start sends the rejected event, and only it.
    rejecting.store(false, Ordering::SeqCst);
    let before = server.requests().len();
    let http = start_http(&store, config(&server.url()));
    wait_until("the rejected event is accepted", || async {
        reconcile(&store)
            .await
            .expect("reconcile")
            .rejected_by_endpoint
            .is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    http.stop().await;
    let again: Vec<u64> = server.requests()[before..].iter().map(|r| r.seq).collect();
    assert_eq!(again, vec![5]);
    assert_eq!(cursor(&store).await, 8);
    store.shutdown().await;
}

#[tokio::test]
async fn an_endpoint_that_refuses_every_event_holds_delivery_and_records_no_rejection() {
    let dir = TempData::new("http-401");
    let store = open(&dir.0).await;
    append(&store, 1, 3).await;
    write_records(&store).await;
    let unauthorized = Arc::new(AtomicBool::new(true));
    let policy: Policy = {
        let unauthorized = unauthorized.clone();
        Arc::new(move |_| {
            Reply::status(if unauthorized.load(Ordering::SeqCst) {
                401
            } else {
                201
            })
        })
    };
    let server = Server::start(policy).await;
    let http = start_http(&store, config(&server.url()));
    wait_until("the endpoint has refused 4 times", || async {
        server.requests().len() >= 4
    })
    .await;
    // A wrong key is not the events' fault: none is skipped or marked rejected.
    assert!(server.requests().iter().all(|r| r.seq == 1));
    assert_eq!(cursor(&store).await, 0);
    assert!(rejections(&store).await.expect("rejections").is_empty());

    unauthorized.store(false, Ordering::SeqCst);
    wait_for_cursor(&store, 3).await;
    http.stop().await;
    assert_eq!(server.acknowledged(), vec![1, 2, 3]);
    store.shutdown().await;
}

#[tokio::test]
async fn a_restart_resumes_from_the_cursor_and_repeats_only_the_unacknowledged_event() {
    let dir = TempData::new("http-restart");
    let store = open(&dir.0).await;
    append(&store, 1, 10).await;
    write_records(&store).await;
    // The endpoint takes seq 7 but never answers (until the test lets it).
    let hanging = Arc::new(AtomicBool::new(true));
    let policy: Policy = {
        let hanging = hanging.clone();
        Arc::new(move |seq| {
            let delay = if seq == 7 && hanging.load(Ordering::SeqCst) {
                Duration::from_secs(60)
            } else {
                Duration::ZERO
            };
            Reply {
                status: 200,
                body: "",
                delay,
            }
        })
    };
    let server = Server::start(policy).await;
    let mut patient = config(&server.url());
    patient.timeout = Duration::from_secs(120);
    let http = start_http(&store, patient.clone());
    wait_until("seq 7 is in flight", || async {
        server.requests().iter().any(|r| r.seq == 7)
    })
    .await;
    // Stopping mid-request saves what was acknowledged, and only that.
    http.stop().await;
    assert_eq!(cursor(&store).await, 6);

    hanging.store(false, Ordering::SeqCst);
    append(&store, 11, 2).await;
    write_records(&store).await;
    let http = start_http(&store, patient);
    wait_for_cursor(&store, 12).await;
    http.stop().await;
    let seqs: Vec<u64> = server.requests().iter().map(|r| r.seq).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10, 11, 12]);

    // A third start with nothing new sends nothing.
    let http = start_http(&store, config(&server.url()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    http.stop().await;
    assert_eq!(server.requests().len(), 13);
    store.shutdown().await;
}

#[tokio::test]
async fn a_missing_record_holds_delivery_at_the_gap() {
    let dir = TempData::new("http-gap");
    let store = open(&dir.0).await;
    append(&store, 1, 6).await;
    write_records(&store).await;
    let pool = store.sqlite_pool().expect("SQLite ledger");
    sqlx::query("DELETE FROM lineage_records WHERE seq = 4")
        .execute(pool)
        .await
        .expect("remove a record");
    let server = Server::start(accept_all()).await;
    let http = start_http(&store, config(&server.url()));
    wait_for_cursor(&store, 3).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    http.stop().await;
    // Nothing after the gap is sent, so nothing can be skipped unnoticed.
    assert_eq!(server.acknowledged(), vec![1, 2, 3]);
    assert_eq!(cursor(&store).await, 3);
    assert_eq!(
        reconcile(&store)
            .await
            .expect("reconcile")
            .missing_openlineage,
        vec![4]
    );
    store.shutdown().await;
}

fn from(vars: &[(&str, &str)]) -> Result<Option<HttpTransportConfig>, String> {
    HttpTransportConfig::from_lookup(|name| {
        vars.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    })
    .map_err(|e| e.to_string())
}

#[test]
fn configuration_follows_the_openlineage_client_variables() {
    // Off unless a URL is set.
    assert!(from(&[]).expect("valid").is_none());
    assert!(from(&[(ENV_URL, "  ")]).expect("valid").is_none());
    assert!(
        from(&[(ENV_URL, "http://m:5000"), (ENV_DISABLED, "TRUE")])
            .expect("valid")
            .is_none()
    );

    let endpoint = |vars: &[(&str, &str)]| {
        from(vars)
            .expect("valid")
            .expect("configured")
            .endpoint
            .to_string()
    };
    assert_eq!(
        endpoint(&[(ENV_URL, "http://marquez:5000")]),
        "http://marquez:5000/api/v1/lineage"
    );
    assert_eq!(
        endpoint(&[(ENV_URL, "https://gw.bank.test/marquez")]),
        "https://gw.bank.test/marquez/api/v1/lineage"
    );
    assert_eq!(
        endpoint(&[
            (ENV_URL, "https://gw.bank.test/marquez/"),
            (ENV_ENDPOINT, "/openapi/lineage")
        ]),
        "https://gw.bank.test/openapi/lineage"
    );

    // A malformed value names its variable and does not echo what may be a secret.
    let err = from(&[(ENV_URL, "marquez:5000 secret")]).expect_err("malformed");
    assert!(err.contains(ENV_URL), "{err}");
    assert!(!err.contains("secret"), "{err}");
    let err = from(&[(ENV_URL, "ftp://marquez")]).expect_err("not http");
    assert!(err.contains(ENV_URL), "{err}");
    let err = from(&[(ENV_URL, "http://m"), (ENV_TIMEOUT, "soon")]).expect_err("timeout");
    assert!(err.contains(ENV_TIMEOUT), "{err}");
    let err = from(&[(ENV_URL, "http://m"), (ENV_API_KEY, "clé")]).expect_err("key");
    assert!(err.contains(ENV_API_KEY) && !err.contains("clé"), "{err}");

    let config = from(&[
        (ENV_URL, "http://m"),
        (ENV_API_KEY, "s3cr3t-key\n"),
        (ENV_TIMEOUT, "2.5"),
    ])
    .expect("valid")
    .expect("configured");
    assert_eq!(config.timeout, Duration::from_millis(2500));
    assert!(config.api_key.is_some());
    // The key never appears in a log of the configuration.
    assert!(!format!("{config:?}").contains("s3cr3t"));
}

//! The drift hand-offs of a real `aether serve` on real PostgreSQL: a review ticket the
//! rollout controller opens is POSTed to a real local HTTP receiver, signed with
//! HMAC-SM3 (checked here with an HMAC written from its definition) and retried after the
//! receiver's 500; a retrain request runs the configured command with the request in its
//! environment; each outcome is on the ledger; the operator closes the review over HTTP.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_e2e::{OPERATOR_TOKEN, Server, http};
use aether_ledger::testing::TestDatabase;
use aether_ledger::{EventStore, ExpectedVersion, NewEvent, StoreConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One request the receiver got: its headers (lowercase names) and body.
#[derive(Clone, Debug)]
struct Received {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// An HTTP/1.1 receiver on a free port: answers the first request 500, the rest 200,
/// one request per connection.
async fn receiver() -> (u16, Arc<Mutex<Vec<Received>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let got: Arc<Mutex<Vec<Received>>> = Arc::default();
    let seen = got.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            let head_end = loop {
                let n = socket.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break None;
                }
                buf.extend_from_slice(&chunk[..n]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break Some(i + 4);
                }
            };
            let Some(head_end) = head_end else { continue };
            let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
            let headers: Vec<(String, String)> = head
                .lines()
                .skip(1)
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
                .collect();
            let length: usize = headers
                .iter()
                .find(|(k, _)| k == "content-length")
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(0);
            while buf.len() < head_end + length {
                let n = socket.read(&mut chunk).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = buf[head_end..].to_vec();
            let first = {
                let mut all = seen.lock().unwrap();
                all.push(Received { headers, body });
                all.len() == 1
            };
            let status = if first {
                "500 Internal Server Error"
            } else {
                "200 OK"
            };
            let answer =
                format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
            let _ = socket.write_all(answer.as_bytes()).await;
            let _ = socket.shutdown().await;
        }
    });
    (port, got)
}

/// HMAC-SM3 by RFC 2104's definition (SM3's 64-byte blocks), not by the service's crate.
fn hmac_sm3(key: &[u8], message: &[u8]) -> String {
    let digest = |data: &[u8]| aether_ledger::hashing::sm3(data);
    let mut k = [0u8; 64];
    k[..key.len()].copy_from_slice(key);
    let inner: Vec<u8> = k
        .iter()
        .map(|b| b ^ 0x36)
        .chain(message.iter().copied())
        .collect();
    let inner = digest(&inner);
    let outer: Vec<u8> = k
        .iter()
        .map(|b| b ^ 0x5c)
        .chain(inner.iter().copied())
        .collect();
    hex::encode(digest(&outer))
}

async fn wait_for<T>(what: &str, mut check: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn of_type(store: &EventStore, stream: &str, kind: &str) -> Vec<Value> {
    store
        .read_stream(stream, 1, aether_ledger::Direction::Forward, 1000)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.event_type == kind)
        .map(|e| {
            json!({
                "event_id": e.event_id.to_string(),
                "payload": serde_json::from_str::<Value>(e.payload.get()).unwrap(),
                "metadata": serde_json::from_str::<Value>(e.metadata.get()).unwrap(),
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_review_ticket_reaches_the_webhook_signed_and_a_retrain_runs_the_command() {
    let db = TestDatabase::create().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (port, received) = receiver().await;
    let secret = b"0123456789abcdef0123456789abcdef";
    let secret_file = dir.path().join("webhook.secret");
    std::fs::write(&secret_file, secret).unwrap();
    let retrain_out = dir.path().join("retrain.out");
    let command = format!(
        "echo \"$AETHER_RETRAIN_REQUEST $AETHER_RETRAIN_FEATURES $AETHER_RETRAIN_FROM $AETHER_RETRAIN_TO\" > {}",
        retrain_out.display()
    );
    let webhook = format!("http://127.0.0.1:{port}/hooks/review");
    // A ticket recorded before the hand-offs were turned on is not delivered.
    let store = EventStore::connect(&db.url, StoreConfig::default())
        .await
        .unwrap();
    let old = store
        .append(
            "analysis/r-before",
            ExpectedVersion::Any,
            vec![NewEvent::new(
                "ReviewTicketOpened",
                json!({"candidate": "m@r", "ticket": "review-r-before-1", "deadline": "2026-01-01T00:00:00Z"}),
            )],
        )
        .await
        .unwrap()[0]
        .event_id;
    let server = Server::start(
        &data,
        &[
            ("DATABASE_URL", db.url.as_str()),
            ("AETHER_REVIEW_WEBHOOK", webhook.as_str()),
            (
                "AETHER_REVIEW_WEBHOOK_SECRET_FILE",
                secret_file.to_str().unwrap(),
            ),
            ("AETHER_RETRAIN_COMMAND", command.as_str()),
        ],
    );
    // The hand-offs start at the ledger's head once their node holds the lease: what
    // they must deliver is recorded after that start (a ticket recorded before it is
    // not delivered, as the one above shows).
    wait_for("the hand-offs to start", async || {
        store.load_position("handoffs").await.ok().flatten()
    })
    .await;
    let client = http();
    let post = |path: String, body: Value| {
        client
            .post(server.url(&path))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&body)
            .send()
    };
    aether_e2e::register_two_models(&server, &data.join("model")).await;
    let resp = post(
        "/v1/rollouts".into(),
        json!({"baseline": "finmoe-7b-v3@sgp-region", "candidate": "finmoe-7b-v4@sgp-region"}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 201);
    let id = resp.json::<Value>().await.unwrap()["rollout"]["id"]
        .as_str()
        .unwrap()
        .to_owned();

    // What the rollout controller records at an L3 freeze and an L2 pause (the analyzer's
    // tests cover when it does), written to the same ledger.
    let ticket = format!("review-{id}-1796000000000");
    let analysis = format!("analysis/{id}");
    let controller = json!({"actor": "rollout-controller"});
    let committed = store
        .append(
            &analysis,
            ExpectedVersion::Any,
            vec![
                NewEvent::new(
                    "ReviewTicketOpened",
                    json!({"candidate": "finmoe-7b-v4@sgp-region", "tier": "l3", "drift_score": 0.42,
                           "ticket": ticket, "sla_ms": 7_200_000, "deadline": "2026-12-06T20:00:00Z",
                           "features": ["amount"]}),
                )
                .with_metadata(controller.clone()),
                NewEvent::new(
                    "RetrainRequested",
                    json!({"candidate": "finmoe-7b-v4@sgp-region", "tier": "l2", "drift_score": 0.2,
                           "features": ["amount", "velocity"],
                           "data_range": {"from": "2026-12-06T10:00:00Z", "to": "2026-12-06T11:00:00Z"}}),
                )
                .with_metadata(controller),
            ],
        )
        .await
        .unwrap();
    let (opened_id, retrain_id) = (committed[0].event_id, committed[1].event_id);

    // The webhook: refused once (500), delivered on the retry, signed over the body.
    let delivered = wait_for("the webhook delivery", async || {
        of_type(&store, "handoff/webhook", "HandoffDelivered")
            .await
            .into_iter()
            .next()
    })
    .await;
    assert_eq!(delivered["payload"]["attempts"], 2, "{delivered}");
    assert_eq!(
        delivered["payload"]["request"]["event_id"],
        opened_id.to_string()
    );
    assert_eq!(delivered["metadata"]["causation_id"], opened_id.to_string());
    let got = received.lock().unwrap().clone();
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        got.iter()
            .all(|r| r.header("x-aether-event-id") != Some(old.to_string().as_str())),
        "the ticket from before the hand-offs started was delivered"
    );
    assert_eq!(got[0].body, got[1].body, "the retry sends the same body");
    for request in &got {
        let expected = format!("hmac-sm3={}", hmac_sm3(secret, &request.body));
        assert_eq!(
            request.header("x-aether-signature"),
            Some(expected.as_str())
        );
        assert_eq!(
            request.header("x-aether-event-id"),
            Some(opened_id.to_string().as_str())
        );
        assert_eq!(request.header("content-type"), Some("application/json"));
    }
    let body: Value = serde_json::from_slice(&got[1].body).unwrap();
    let text = body["text"].as_str().unwrap();
    assert!(
        text.contains(&ticket) && text.contains("2026-12-06T20:00:00Z"),
        "{text}"
    );
    assert_eq!(body["aether"]["event_type"], "ReviewTicketOpened");
    assert_eq!(body["aether"]["payload"]["sla_ms"], 7_200_000);

    // The retraining command ran with the request, recorded as one started and finished.
    let finished = wait_for("the retraining run", async || {
        of_type(&store, "handoff/retrain", "RetrainFinished")
            .await
            .into_iter()
            .next()
    })
    .await;
    assert_eq!(
        finished["metadata"]["correlation_id"],
        retrain_id.to_string()
    );
    let ran = std::fs::read_to_string(&retrain_out).unwrap();
    assert_eq!(
        ran.trim(),
        format!("{retrain_id} amount,velocity 2026-12-06T10:00:00Z 2026-12-06T11:00:00Z")
    );
    assert_eq!(
        of_type(&store, "handoff/retrain", "RetrainStarted")
            .await
            .len(),
        1
    );

    // The hand-offs' streams are the service's own.
    let resp = post(
        "/v1/events".into(),
        json!({"stream_id": "handoff/webhook", "events": [{"event_type": "Anything", "payload": {"n": 1}}]}),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 403);

    // The operator closes the review: only the open ticket, only once, with a resolution.
    let close = |ticket: &str, resolution: &str| {
        post(
            format!("/v1/rollouts/{id}/reviews/{ticket}/close"),
            json!({"resolution": resolution}),
        )
    };
    assert_eq!(close("review-other", "fine").await.unwrap().status(), 409);
    assert_eq!(close(&ticket, "  ").await.unwrap().status(), 422);
    let resp = close(&ticket, "drift explained by a new member; retrain queued")
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let closed: Value = resp.json().await.unwrap();
    assert_eq!(closed["rollout"]["reviews_closed"], 1, "{closed}");
    assert_eq!(close(&ticket, "again").await.unwrap().status(), 409);
    let closes = of_type(&store, &format!("rollout/{id}"), "ReviewTicketClosed").await;
    assert_eq!(closes.len(), 1);
    assert_eq!(closes[0]["payload"]["ticket"], ticket.as_str());

    assert!(server.terminate().success());
    store.shutdown().await;
    db.drop_database().await;
}

#[test]
fn a_webhook_without_its_secret_is_refused_at_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = aether_e2e::run_aether(
        &[
            "serve",
            "--data-dir",
            dir.path().join("data").to_str().unwrap(),
            "--review-webhook",
            "http://127.0.0.1:9/hook",
        ],
        &[],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--review-webhook-secret-file"), "{stderr}");
    assert!(
        !dir.path().join("data").join("ledger.db").exists(),
        "nothing written"
    );
}

//! End-to-end clearing: a real `aether serve` with its development PKI, a member client over
//! mTLS with SM2/SM4 envelopes, the reference model scoring in process, and every decision
//! on the ledger before the member hears it. Negatives: wrong certificates, broken
//! envelopes and replays are refused and record nothing.

use std::path::Path;

use aether_e2e::clearing::{WorkerProcess, activate, client, decisions, get, trade};
use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http};
use aether_gateway::certs::PkiLayout;
use aether_gateway::client::ClientError;
use aether_gateway::envelope::{
    Aad, Direction, KEY_HEADER, Sm4Key, encode_wrapped_key, seal, unix_now, wrap_key,
};
use aether_gateway::identity::Role;
use aether_gateway::pb::v1::clearing_service_client::ClearingServiceClient;
use aether_gateway::pb::v1::{ClearingAnswer, ClearingRequest, Decision, SealedRequest};
use aether_gateway::service::METHOD_SUBMIT;
use aether_gateway::tls::{TlsPaths, client_tls_config};
use aether_gpu_worker::reference::{REFERENCE_MODEL_DIGEST, REFERENCE_MODEL_REF};
use prost::Message;
use sm2::pkcs8::DecodePublicKey;

async fn raw(
    server: &Server,
    data: &Path,
    role: Role,
    id: &str,
) -> ClearingServiceClient<tonic::transport::Channel> {
    let tls = client_tls_config(&TlsPaths::client(&PkiLayout::new(data), role, id)).unwrap();
    let channel = tonic::transport::Endpoint::from_shared(server.grpc_url.clone())
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    ClearingServiceClient::new(channel)
}

/// A per-request sealed submission, built by hand so the test can break it.
fn sealed(
    data: &Path,
    member: &str,
    request_id: &str,
    body: &ClearingRequest,
) -> (SealedRequest, String, Sm4Key) {
    let pem = std::fs::read_to_string(data.join("keys/envelope.pub.pem")).unwrap();
    let server_key = sm2::PublicKey::from_public_key_pem(&pem).unwrap();
    let key = Sm4Key::generate().unwrap();
    let header = encode_wrapped_key(&wrap_key(&server_key, &key).unwrap());
    let issued_at = unix_now();
    let aad = Aad {
        direction: Direction::Request,
        method: METHOD_SUBMIT,
        request_id,
        member_id: member,
        key_id: "",
        issued_at,
    };
    let s = seal(&key, &aad, &body.encode_to_vec()).unwrap();
    (
        SealedRequest {
            member_id: member.into(),
            request_id: request_id.into(),
            key_id: String::new(),
            nonce: s.nonce.to_vec(),
            ciphertext: s.ciphertext,
            issued_at,
        },
        header,
        key,
    )
}

fn with_header(sealed: SealedRequest, header: &str) -> tonic::Request<SealedRequest> {
    let mut r = tonic::Request::new(sealed);
    r.metadata_mut().insert(KEY_HEADER, header.parse().unwrap());
    r
}

/// Clearing events recorded so far: decisions and batch nettings.
async fn head(server: &Server) -> usize {
    let nettings = get(
        server,
        "/v1/audit/events?event_type=NettingComputed&limit=1000",
    )
    .await;
    decisions(server).await.len() + nettings["events"].as_array().unwrap().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trades_are_cleared_over_mtls_with_envelopes_and_every_decision_is_on_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);

    // Before any engine is active the gateway refuses precisely.
    let mut bank_a = client(&server, &data, "bank-a").await;
    match bank_a.submit("req-early", &trade(10_000)).await {
        Err(ClientError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::FailedPrecondition, "{message}");
        }
        other => panic!("expected FAILED_PRECONDITION, got {other:?}"),
    }

    activate(&server).await;

    // A small ordinary trade with a per-request key: cleared, with a receipt that points
    // at the committed event.
    let answer = bank_a.submit("req-1", &trade(125_000)).await.unwrap();
    assert_eq!(answer.decision, Decision::Cleared as i32, "{answer:?}");
    assert!(!answer.replayed);
    assert_eq!(answer.model_ref, REFERENCE_MODEL_REF);
    let receipt = answer.receipt.clone().unwrap();
    let event = get(&server, &format!("/v1/audit/events/{}", receipt.seq)).await;
    assert_eq!(
        event["event"]["hash"],
        receipt.event_hash.as_str(),
        "{event}"
    );
    assert_eq!(event["event"]["event_type"], "ClearingDecided");
    assert_eq!(event["event"]["stream_id"], "clearing/bank-a");
    let payload = &event["event"]["payload"];
    assert_eq!(payload["model_digest"], REFERENCE_MODEL_DIGEST);
    assert_eq!(payload["snapshot_id"], receipt.snapshot_id.as_str());
    assert_eq!(payload["decision"], "cleared");
    assert_eq!(event["event"]["metadata"]["request_id"], "req-1");
    assert_eq!(event["event"]["metadata"]["member"], "bank-a");
    // Its batch was netted, and the netting committed with the decision, in one append
    // just before it; the regulator's explanation names it.
    let why = get(&server, "/v1/audit/decisions/req-1").await;
    let netting_seq = why["worker"]["netting_seq"].as_u64().unwrap();
    assert!(netting_seq < receipt.seq, "{why}");
    let netting = get(&server, &format!("/v1/audit/events/{netting_seq}")).await;
    assert_eq!(
        netting["event"]["event_type"], "NettingComputed",
        "{netting}"
    );
    assert_eq!(
        netting["event"]["payload"]["batch_id"], payload["batch_id"],
        "{netting}"
    );
    assert!(
        netting["event"]["payload"]["request_ids"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("bank-a/req-1")),
        "{netting}"
    );
    assert_eq!(
        netting["event"]["recorded_at"], event["event"]["recorded_at"],
        "one commit"
    );

    // Over the reporting threshold, with a session key: held for review, the rule fired
    // and the clause it cites named from the corpus.
    bank_a.key_exchange().await.unwrap();
    let held = bank_a.submit("req-2", &trade(25_000_000)).await.unwrap();
    assert_eq!(held.decision, Decision::HeldForReview as i32, "{held:?}");
    assert_eq!(held.rules_fired, ["aml_v2/reporting-threshold"]);
    assert_eq!(held.cited_clauses, ["sg-clearing:rep-threshold-1"]);

    // A regulator asks why: the whole explanation, with the cited clause's text from the
    // corpus version in force and an event that matches the receipt.
    let why = get(&server, "/v1/audit/decisions/req-2").await;
    assert_eq!(why["decision"], "held_for_review", "{why}");
    assert_eq!(why["member"], "bank-a");
    assert_eq!(why["model"]["digest"], REFERENCE_MODEL_DIGEST);
    assert_eq!(why["policies"]["aml_v2"], "2.0.0");
    assert_eq!(why["event"]["seq"], held.receipt.as_ref().unwrap().seq);
    assert_eq!(
        why["cited_clauses"][0]["clause"]["id"], "rep-threshold-1",
        "{why}"
    );
    assert!(
        why["cited_clauses"][0]["clause"]["text"]
            .as_str()
            .unwrap()
            .contains("threshold report"),
        "{why}"
    );
    let missing = http()
        .get(server.url("/v1/audit/decisions/no-such-request"))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let operator = http()
        .get(server.url("/v1/audit/decisions/req-2"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(operator.status(), 403);

    // Idempotency: the same request id returns the original decision, writes nothing.
    let before = decisions(&server).await.len();
    let again = bank_a.submit("req-1", &trade(125_000)).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.receipt.unwrap().seq, receipt.seq);
    assert_eq!(decisions(&server).await.len(), before);

    // mTLS: a worker certificate may not clear; a member may not speak for another.
    let mut worker = raw(&server, &data, Role::Worker, "worker-1").await;
    let (req, header, _) = sealed(&data, "bank-a", "req-w", &trade(1_000));
    let status = worker.submit(with_header(req, &header)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    let mut raw_a = raw(&server, &data, Role::Member, "bank-a").await;
    let (req, header, _) = sealed(&data, "bank-b", "req-x", &trade(1_000));
    let status = raw_a.submit(with_header(req, &header)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");

    // Envelope negatives: each UNAUTHENTICATED with a message, none recorded.
    let head_before = head(&server).await;
    let (mut req, header, _) = sealed(&data, "bank-a", "req-flip", &trade(1_000));
    req.ciphertext[3] ^= 0x01;
    let status = raw_a.submit(with_header(req, &header)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    let (req, _, _) = sealed(&data, "bank-a", "req-wrongkey", &trade(1_000));
    let (_, other_header, _) = sealed(&data, "bank-a", "req-wrongkey", &trade(1_000));
    let status = raw_a
        .submit(with_header(req, &other_header))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    let (mut req, header, _) = sealed(&data, "bank-a", "req-truncated", &trade(1_000));
    req.ciphertext.truncate(8);
    let status = raw_a.submit(with_header(req, &header)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    let (req, _, _) = sealed(&data, "bank-a", "req-nokey", &trade(1_000));
    let status = raw_a.submit(tonic::Request::new(req)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("x-sm4-key"), "{status:?}");
    assert_eq!(
        head(&server).await,
        head_before,
        "a refused envelope wrote an event"
    );

    // A replayed (key, nonce): the first is decided, the copy refused.
    let (req, header, _) = sealed(&data, "bank-a", "req-replay", &trade(2_000));
    raw_a
        .submit(with_header(req.clone(), &header))
        .await
        .unwrap();
    let status = raw_a.submit(with_header(req, &header)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("replay"), "{status:?}");

    // A bad trade inside a good envelope: INVALID_ARGUMENT naming the field.
    let mut bad = trade(1_000);
    bad.trade.as_mut().unwrap().value_date = "tomorrow".into();
    match bank_a.submit("req-bad", &bad).await {
        Err(ClientError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::InvalidArgument);
            assert!(message.contains("value_date"), "{message}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }

    // After a restart the decision is still found by request id (from the ledger).
    assert!(server.terminate().success());
    let server = Server::start(&data, &[]);
    let mut bank_a = client(&server, &data, "bank-a").await;
    let again = bank_a.submit("req-2", &trade(25_000_000)).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.decision, Decision::HeldForReview as i32);
    let all = decisions(&server).await;
    let ids: Vec<&str> = all
        .iter()
        .map(|e| e["metadata"]["request_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["req-1", "req-2", "req-replay"]);
    assert!(server.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_on_a_worker_killed_mid_batch_goes_to_another_and_is_decided_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    aether_e2e::clearing::issue_worker_certificate(&data, "worker-2");
    let server = Server::start(&data, &[("AETHER_NO_LOCAL_WORKERS", "true")]);
    activate(&server).await;
    let mut bank_a = client(&server, &data, "bank-a").await;

    // No worker connected and none in process: a precise refusal, nothing decided.
    match bank_a.submit("req-none", &trade(50_000)).await {
        Err(ClientError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::Unavailable, "{message}");
            assert!(message.contains("no connected worker"), "{message}");
        }
        other => panic!("expected UNAVAILABLE, got {other:?}"),
    }

    // A slow worker takes the batch; a second connects; the first dies mid-batch.
    let slow = WorkerProcess::start(&server, &data, "worker-1", 4_000);
    let submitted = tokio::spawn(async move { bank_a.submit("req-1", &trade(50_000)).await });
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    let _fast = WorkerProcess::start(&server, &data, "worker-2", 0);
    slow.kill();
    let answer = submitted.await.unwrap().unwrap();
    assert_eq!(answer.decision, Decision::Cleared as i32, "{answer:?}");

    let all = decisions(&server).await;
    assert_eq!(all.len(), 1, "exactly one decision: {all:?}");
    assert_eq!(all[0]["metadata"]["request_id"], "req-1");
    assert_eq!(all[0]["payload"]["worker"], "worker-2");
    assert!(server.terminate().success());
}

/// `(request id, trade)` pairs for the batch and stream calls.
fn numbered(prefix: &str, n: i64) -> Vec<(String, ClearingRequest)> {
    (0..n)
        .map(|i| (format!("{prefix}-{i}"), trade(100_000 + i * 1_000)))
        .collect()
}

fn refs(trades: &[(String, ClearingRequest)]) -> Vec<(&str, &ClearingRequest)> {
    trades.iter().map(|(id, t)| (id.as_str(), t)).collect()
}

/// Each answer's receipt names a committed `ClearingDecided` of its member and request.
async fn check_receipts(server: &Server, member: &str, answers: &[ClearingAnswer]) {
    for a in answers {
        let receipt = a.receipt.clone().unwrap();
        let event = get(server, &format!("/v1/audit/events/{}", receipt.seq)).await;
        assert_eq!(event["event"]["hash"], receipt.event_hash.as_str());
        assert_eq!(event["event"]["event_type"], "ClearingDecided");
        assert_eq!(
            event["event"]["metadata"]["request_id"],
            a.request_id.as_str()
        );
        assert_eq!(event["event"]["metadata"]["member"], member);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_and_streams_are_decided_and_replayed_like_single_trades() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    activate(&server).await;

    // SubmitBatch with a session key: answers in the order sent, each on the ledger.
    let mut bank_a = client(&server, &data, "bank-a").await;
    bank_a.key_exchange().await.unwrap();
    let batch = numbered("batch", 6);
    let answers = bank_a.submit_batch(&refs(&batch)).await.unwrap();
    let ids: Vec<&str> = answers.iter().map(|a| a.request_id.as_str()).collect();
    assert_eq!(
        ids,
        refs(&batch).iter().map(|(id, _)| *id).collect::<Vec<_>>()
    );
    assert!(answers.iter().all(|a| !a.replayed), "{answers:?}");
    check_receipts(&server, "bank-a", &answers).await;
    let recorded = head(&server).await;
    assert_eq!(decisions(&server).await.len(), 6);

    // The same batch again: the original decisions, nothing new on the ledger.
    let again = bank_a.submit_batch(&refs(&batch)).await.unwrap();
    assert!(again.iter().all(|a| a.replayed), "{again:?}");
    let receipts = |a: &[ClearingAnswer]| a.iter().map(|a| a.receipt.clone()).collect::<Vec<_>>();
    assert_eq!(receipts(&again), receipts(&answers));
    assert_eq!(head(&server).await, recorded);

    // SubmitStream with a per-request key: every trade answered once, in any order; more
    // trades than the gateway decides at once from one stream (the rest wait unread).
    let mut bank_b = client(&server, &data, "bank-b").await;
    let n = aether_gateway::service::MAX_STREAM_IN_FLIGHT as i64 + 44;
    let streamed = numbered("stream", n);
    let answers = bank_b.submit_stream(&refs(&streamed)).await.unwrap();
    let mut ids: Vec<&str> = answers.iter().map(|a| a.request_id.as_str()).collect();
    ids.sort_unstable();
    let mut sent: Vec<&str> = streamed.iter().map(|(id, _)| id.as_str()).collect();
    sent.sort_unstable();
    assert_eq!(ids, sent);
    assert!(answers.iter().all(|a| !a.replayed));
    check_receipts(&server, "bank-b", &answers).await;
    assert_eq!(decisions(&server).await.len(), 6 + streamed.len());
    let recorded = head(&server).await;
    let again = bank_b.submit_stream(&refs(&streamed)).await.unwrap();
    assert_eq!(again.len(), streamed.len());
    assert!(again.iter().all(|a| a.replayed), "{again:?}");
    assert_eq!(head(&server).await, recorded);

    // A trade the gateway refuses ends the stream with its status and records nothing.
    let mut bad = trade(5_000);
    bad.trade.as_mut().unwrap().counterparty_tier = 9;
    match bank_b.submit_stream(&[("stream-bad", &bad)]).await {
        Err(ClientError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
            assert!(message.contains("counterparty_tier"), "{message}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    // So does an oversized batch, before anything is decided.
    let oversized = numbered("oversized", 1_001);
    match bank_a.submit_batch(&refs(&oversized)).await {
        Err(ClientError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    assert_eq!(head(&server).await, recorded);
}

/// `aether client submit` as a user runs it: one line, the decision as JSON, a repeated
/// request id answered from the ledger, and refusals said once, plainly, with a failing
/// exit status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_one_line_client_submits_replays_and_explains_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    activate(&server).await;
    let data_dir = data.to_str().unwrap();
    let submit = |extra: &[&str]| {
        let mut args = vec![
            "client",
            "submit",
            "--data-dir",
            data_dir,
            "--endpoint",
            &server.grpc_url,
        ];
        args.extend_from_slice(extra);
        aether_e2e::run_aether(&args, &[])
    };
    let answer = |out: &std::process::Output| -> serde_json::Value {
        assert!(
            out.status.success(),
            "client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };

    let cleared = answer(&submit(&["--request-id", "cli-1"]));
    assert_eq!(cleared["decision"], "CLEARED", "{cleared}");
    assert_eq!(cleared["replayed"], false);
    let seq = cleared["receipt"]["seq"].as_u64().unwrap();
    let held = answer(&submit(&["--session", "--amount-minor", "25000000"]));
    assert_eq!(held["decision"], "HELD_FOR_REVIEW", "{held}");
    assert_eq!(held["rules_fired"][0], "aml_v2/reporting-threshold");
    // The same request id again: the original decision, nothing new recorded.
    let before = decisions(&server).await.len();
    let again = answer(&submit(&["--request-id", "cli-1", "--amount-minor", "999"]));
    assert_eq!(again["replayed"], true);
    assert_eq!(again["receipt"]["seq"], seq);
    assert_eq!(decisions(&server).await.len(), before);

    // Refusals: a negative amount reaches the gateway and is refused there; a member
    // without a certificate here is refused before anything is sent.
    let negative = submit(&["--amount-minor", "-5"]);
    assert!(!negative.status.success());
    let stderr = String::from_utf8_lossy(&negative.stderr);
    assert!(
        stderr.contains("InvalidArgument") && stderr.contains("amount"),
        "{stderr}"
    );
    let stranger = submit(&["--member", "bank-zz"]);
    assert!(!stranger.status.success());
    let stderr = String::from_utf8_lossy(&stranger.stderr);
    assert!(stderr.contains("member-bank-zz"), "{stderr}");
    let said = |needle: &str| stderr.matches(needle).count();
    assert_eq!(
        said("os error 2"),
        1,
        "the cause said more than once: {stderr}"
    );
    // No gateway at the address: the reason, once.
    let nowhere = aether_e2e::run_aether(
        &[
            "client",
            "submit",
            "--data-dir",
            data_dir,
            "--endpoint",
            "https://127.0.0.1:1",
        ],
        &[],
    );
    assert!(!nowhere.status.success());
    let stderr = String::from_utf8_lossy(&nowhere.stderr);
    assert!(
        stderr.contains("cannot reach the gateway at https://127.0.0.1:1"),
        "{stderr}"
    );
    assert_eq!(stderr.matches("Connection refused").count(), 1, "{stderr}");
    assert_eq!(decisions(&server).await.len(), before);
}

/// A gRPC address already taken stops `serve` with one plain error, after the lineage
/// relays and the Merkle log follower were started or not: no panic from a relay cut off
/// mid-commit.
#[test]
fn a_grpc_address_in_use_stops_serve_with_a_plain_error() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let grpc = taken.local_addr().unwrap().to_string();
    for _ in 0..6 {
        let out = aether_e2e::run_serve(&dir.path().join("data"), &["--grpc-listen", &grpc]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("error: cannot listen on {grpc}")),
            "{stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("crashed"),
            "{stderr}"
        );
    }
}

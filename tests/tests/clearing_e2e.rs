//! End-to-end clearing: a real `aether serve` with its development PKI, a member client over
//! mTLS with SM2/SM4 envelopes, the reference model scoring in process, and every decision
//! on the ledger before the member hears it. Negatives: wrong certificates, broken
//! envelopes and replays are refused and record nothing.

use std::path::Path;

use aether_e2e::clearing::{WorkerProcess, activate, client, decisions, get, trade};
use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http};
use aether_gateway::certs::PkiLayout;
use aether_gateway::client::{ClientError, ItemOutcome};
use aether_gateway::envelope::{
    Aad, Direction, KEY_HEADER, Sm4Key, encode_wrapped_key, seal, unix_now, wrap_key,
};
use aether_gateway::identity::Role;
use aether_gateway::pb::v1::clearing_service_client::ClearingServiceClient;
use aether_gateway::pb::v1::{
    ClearingAnswer, ClearingRequest, Decision, SealedBatchRequest, SealedRequest,
};
use aether_gateway::service::{METHOD_SUBMIT, METHOD_SUBMIT_BATCH, METHOD_SUBMIT_STREAM};
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
    // Why the model scored what it did: a checked explanation, its attributions adding
    // up to the score above the background's, each inside its interval.
    let explanation = &why["explanation"];
    assert_eq!(explanation["status"], "explained", "{why}");
    assert_eq!(explanation["method"], "aether.explain.v1");
    let attributions = explanation["attributions"].as_array().unwrap();
    assert_eq!(attributions.len(), 8, "{explanation}");
    let sum: f64 = attributions
        .iter()
        .map(|a| a["value"].as_f64().unwrap())
        .sum();
    let score = explanation["score"].as_f64().unwrap();
    let base = explanation["base_value"].as_f64().unwrap();
    assert!((sum - (score - base)).abs() < 1e-7, "{explanation}");
    assert!(
        (score - why["score"].as_f64().unwrap()).abs() < 1e-4,
        "{why}"
    );
    // A cleared trade outside the sample carries none.
    let cleared = get(&server, "/v1/audit/decisions/req-1").await;
    assert!(cleared["explanation"].is_null(), "{cleared}");
    // Recomputed offline from the ledger and the artifact, bit for bit.
    let data_arg = data.to_str().unwrap();
    let explain = |request_id: &str| {
        aether_e2e::run_aether(
            &[
                "model",
                "explain",
                "--data-dir",
                data_arg,
                "--request-id",
                request_id,
            ],
            &[],
        )
    };
    let out = explain("req-2");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("MATCH"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = explain("req-1");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("was not explained"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
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
    // A different trade under a used request id is refused, naming the original decision;
    // nothing is recorded (after the restart below, from the ledger too).
    let refused = |r: Result<ClearingAnswer, ClientError>| match r {
        Err(ClientError::Status { code, message }) => (code, message),
        other => panic!("expected a refusal, got {other:?}"),
    };
    let (code, message) = refused(bank_a.submit("req-1", &trade(125_001)).await);
    assert_eq!(code, tonic::Code::AlreadyExists, "{message}");
    assert!(
        message.contains(&format!("already decided (ledger seq {})", receipt.seq)),
        "{message}"
    );
    assert!(message.contains("for a different trade"), "{message}");
    assert_eq!(decisions(&server).await.len(), before);

    // gRPC trace ids are W3C trace-ids, as the proto says: anything else is refused, and
    // a valid one is the receipt's.
    let mut coloured = trade(1_000);
    for bad in [
        "NOT-A-TRACE-ID",
        "4BF92F3577B34DA6A3CE929D0E0E4736",
        "00000000000000000000000000000000",
    ] {
        coloured.trace_id = bad.into();
        let (code, message) = refused(bank_a.submit("req-trace", &coloured).await);
        assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
        assert!(
            message.contains("trace_id must be 32 lowercase hex digits"),
            "{message}"
        );
    }
    coloured.trace_id = "4bf92f3577b34da6a3ce929d0e0e4736".into();
    let answer = bank_a.submit("req-trace", &coloured).await.unwrap();
    assert_eq!(
        answer.receipt.unwrap().trace_id,
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );

    // A NUL in one member's request id is refused on its own: the other members' trades
    // decided at the same time (sharing lookups and batches with it) all succeed.
    let before = decisions(&server).await.len();
    let mut others = Vec::new();
    for n in 0..24 {
        let mut bank_b = client(&server, &data, "bank-b").await;
        others.push(tokio::spawn(async move {
            bank_b
                .submit(&format!("nul-neighbour-{n}"), &trade(2_000 + n))
                .await
        }));
    }
    let (code, message) = refused(bank_a.submit("req-\u{0}-nul", &trade(1_000)).await);
    assert_eq!(code, tonic::Code::InvalidArgument, "{message}");
    assert!(message.contains("request_id"), "{message}");
    for other in others {
        other.await.unwrap().unwrap();
    }
    assert_eq!(decisions(&server).await.len(), before + 24);

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
    // A session key id and an x-sm4-key in one request: refused, never one chosen silently.
    let (mut req, header, _) = sealed(&data, "bank-a", "req-twokeys", &trade(1_000));
    req.key_id = "0123456789abcdef0123456789abcdef".into();
    let status = raw_a.submit(with_header(req, &header)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("also carries x-sm4-key"),
        "{status:?}"
    );
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
    match bank_a.submit("req-2", &trade(25_000_001)).await {
        Err(ClientError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::AlreadyExists, "{message}");
        }
        other => panic!("expected ALREADY_EXISTS, got {other:?}"),
    }
    let all = decisions(&server).await;
    let ids: Vec<&str> = all
        .iter()
        .map(|e| e["metadata"]["request_id"].as_str().unwrap())
        .collect();
    let neighbours: Vec<String> = (0..24).map(|n| format!("nul-neighbour-{n}")).collect();
    let mut expected: Vec<&str> = vec!["req-1", "req-2", "req-trace", "req-replay"];
    expected.extend(neighbours.iter().map(String::as_str));
    let mut ids = ids;
    ids.sort_unstable();
    expected.sort_unstable();
    assert_eq!(ids, expected);
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
/// The decisions of a batch or stream whose every item must have been decided.
fn decided(outcomes: Vec<ItemOutcome>) -> Vec<ClearingAnswer> {
    outcomes
        .into_iter()
        .map(|o| o.answer.unwrap_or_else(|e| panic!("{}: {e}", o.request_id)))
        .collect()
}

/// Items sealed by hand under one per-request key (its header returned) for `method`;
/// those marked forged have a flipped ciphertext byte, as a tampering client would send.
fn sealed_items(data: &Path, method: &str, items: &[(&str, bool)]) -> (Vec<SealedRequest>, String) {
    let pem = std::fs::read_to_string(data.join("keys/envelope.pub.pem")).unwrap();
    let server_key = sm2::PublicKey::from_public_key_pem(&pem).unwrap();
    let key = Sm4Key::generate().unwrap();
    let header = encode_wrapped_key(&wrap_key(&server_key, &key).unwrap());
    let requests = items
        .iter()
        .enumerate()
        .map(|(n, (request_id, forged))| {
            let issued_at = unix_now();
            let aad = Aad {
                direction: Direction::Request,
                method,
                request_id,
                member_id: "bank-a",
                key_id: "",
                issued_at,
            };
            let body = trade(50_000 + n as i64).encode_to_vec();
            let mut s = seal(&key, &aad, &body).unwrap();
            if *forged {
                s.ciphertext[2] ^= 0x40;
            }
            SealedRequest {
                member_id: "bank-a".into(),
                request_id: (*request_id).into(),
                key_id: String::new(),
                nonce: s.nonce.to_vec(),
                ciphertext: s.ciphertext,
                issued_at,
            }
        })
        .collect();
    (requests, header)
}

/// One forged item of a batch or a stream, first or last, is refused on its own with its
/// status; the valid items beside it are decided, answered and on the ledger, and the call
/// itself succeeds: no decision is recorded that its member cannot see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_item_of_a_batch_or_stream_is_refused_alone() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    activate(&server).await;
    let mut raw_a = raw(&server, &data, Role::Member, "bank-a").await;
    let orders: [[(&str, bool); 3]; 2] = [
        [
            ("valid-first", false),
            ("valid-second", false),
            ("forged-last", true),
        ],
        [
            ("forged-first", true),
            ("valid-third", false),
            ("valid-fourth", false),
        ],
    ];
    let mut decided_ids = Vec::new();
    for (round, items) in orders.iter().enumerate() {
        // SubmitBatch: one response per item, in order.
        let batch_items: Vec<(String, bool)> = items
            .iter()
            .map(|(id, f)| (format!("batch-{round}-{id}"), *f))
            .collect();
        let named: Vec<(&str, bool)> = batch_items
            .iter()
            .map(|(id, f)| (id.as_str(), *f))
            .collect();
        let (requests, header) = sealed_items(&data, METHOD_SUBMIT_BATCH, &named);
        let mut call = tonic::Request::new(SealedBatchRequest { requests });
        call.metadata_mut()
            .insert(KEY_HEADER, header.parse().unwrap());
        let responses = raw_a
            .submit_batch(call)
            .await
            .unwrap()
            .into_inner()
            .responses;
        assert_eq!(responses.len(), 3);
        for ((id, forged), response) in named.iter().zip(&responses) {
            assert_eq!(response.request_id, *id);
            match (&response.error, forged) {
                (Some(e), true) => {
                    assert_eq!(e.code, tonic::Code::Unauthenticated as i32, "{e:?}");
                    assert!(response.ciphertext.is_empty());
                }
                (None, false) => {
                    assert!(!response.ciphertext.is_empty());
                    decided_ids.push(id.to_string());
                }
                other => panic!("{id}: {other:?}"),
            }
        }
        // SubmitStream: every item answered, the forged one with its error; the stream
        // ends normally.
        let stream_items: Vec<(String, bool)> = items
            .iter()
            .map(|(id, f)| (format!("stream-{round}-{id}"), *f))
            .collect();
        let named: Vec<(&str, bool)> = stream_items
            .iter()
            .map(|(id, f)| (id.as_str(), *f))
            .collect();
        let (requests, header) = sealed_items(&data, METHOD_SUBMIT_STREAM, &named);
        let mut call = tonic::Request::new(futures::stream::iter(requests));
        call.metadata_mut()
            .insert(KEY_HEADER, header.parse().unwrap());
        let mut responses = raw_a.submit_stream(call).await.unwrap().into_inner();
        let mut answered = Vec::new();
        while let Some(response) = responses.message().await.unwrap() {
            let forged = named
                .iter()
                .find(|(id, _)| *id == response.request_id)
                .unwrap()
                .1;
            assert_eq!(response.error.is_some(), forged, "{response:?}");
            if let Some(e) = &response.error {
                assert_eq!(e.code, tonic::Code::Unauthenticated as i32, "{e:?}");
            } else {
                decided_ids.push(response.request_id.clone());
            }
            answered.push(response.request_id);
        }
        answered.sort();
        let mut sent: Vec<String> = named.iter().map(|(id, _)| id.to_string()).collect();
        sent.sort();
        assert_eq!(answered, sent);
    }
    // Exactly the answered decisions are on the ledger, and nothing for the forged items.
    let mut recorded: Vec<String> = decisions(&server)
        .await
        .iter()
        .map(|e| e["metadata"]["request_id"].as_str().unwrap().to_owned())
        .collect();
    recorded.sort();
    decided_ids.sort();
    assert_eq!(recorded, decided_ids);
    assert_eq!(recorded.len(), 8);

    // An item in another member's name makes the batch untrustworthy: refused whole,
    // before anything is decided.
    let (mut requests, header) = sealed_items(
        &data,
        METHOD_SUBMIT_BATCH,
        &[("mixed-1", false), ("mixed-2", false)],
    );
    requests[1].member_id = "bank-b".into();
    let mut call = tonic::Request::new(SealedBatchRequest { requests });
    call.metadata_mut()
        .insert(KEY_HEADER, header.parse().unwrap());
    let status = raw_a.submit_batch(call).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
    assert_eq!(decisions(&server).await.len(), 8);
}

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
    let answers = decided(bank_a.submit_batch(&refs(&batch)).await.unwrap());
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
    let again = decided(bank_a.submit_batch(&refs(&batch)).await.unwrap());
    assert!(again.iter().all(|a| a.replayed), "{again:?}");
    let receipts = |a: &[ClearingAnswer]| a.iter().map(|a| a.receipt.clone()).collect::<Vec<_>>();
    assert_eq!(receipts(&again), receipts(&answers));
    assert_eq!(head(&server).await, recorded);

    // SubmitStream with a per-request key: every trade answered once, in any order; more
    // trades than the gateway decides at once from one stream (the rest wait unread).
    let mut bank_b = client(&server, &data, "bank-b").await;
    let n = aether_gateway::service::MAX_STREAM_IN_FLIGHT as i64 + 44;
    let streamed = numbered("stream", n);
    let answers = decided(bank_b.submit_stream(&refs(&streamed)).await.unwrap());
    let mut ids: Vec<&str> = answers.iter().map(|a| a.request_id.as_str()).collect();
    ids.sort_unstable();
    let mut sent: Vec<&str> = streamed.iter().map(|(id, _)| id.as_str()).collect();
    sent.sort_unstable();
    assert_eq!(ids, sent);
    assert!(answers.iter().all(|a| !a.replayed));
    check_receipts(&server, "bank-b", &answers).await;
    assert_eq!(decisions(&server).await.len(), 6 + streamed.len());
    let recorded = head(&server).await;
    let again = decided(bank_b.submit_stream(&refs(&streamed)).await.unwrap());
    assert_eq!(again.len(), streamed.len());
    assert!(again.iter().all(|a| a.replayed), "{again:?}");
    assert_eq!(head(&server).await, recorded);

    // A trade the gateway refuses gets its own status; the stream goes on to the next.
    let mut bad = trade(5_000);
    bad.trade.as_mut().unwrap().counterparty_tier = 9;
    let good = trade(5_001);
    let outcomes = bank_b
        .submit_stream(&[("stream-bad", &bad), ("stream-good", &good)])
        .await
        .unwrap();
    let bad_outcome = outcomes
        .iter()
        .find(|o| o.request_id == "stream-bad")
        .unwrap();
    match &bad_outcome.answer {
        Err(ClientError::Status { code, message }) => {
            assert_eq!(*code, tonic::Code::InvalidArgument, "{message}");
            assert!(message.contains("counterparty_tier"), "{message}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    let good_outcome = outcomes
        .iter()
        .find(|o| o.request_id == "stream-good")
        .unwrap();
    assert!(good_outcome.answer.is_ok(), "{good_outcome:?}");
    let recorded = head(&server).await;
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
    let again = answer(&submit(&["--request-id", "cli-1"]));
    assert_eq!(again["replayed"], true);
    assert_eq!(again["receipt"]["seq"], seq);
    assert_eq!(decisions(&server).await.len(), before);
    // The same request id with another trade: refused, naming the original decision.
    let other = submit(&["--request-id", "cli-1", "--amount-minor", "999"]);
    assert!(!other.status.success());
    let stderr = String::from_utf8_lossy(&other.stderr);
    assert!(
        stderr.contains("AlreadyExists") && stderr.contains(&format!("ledger seq {seq}")),
        "{stderr}"
    );
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

/// The value of the Prometheus sample `name{stage="<stage>"}` (a count, sum, gauge or
/// counter), if the text has it.
fn stage_sample(metrics: &str, name: &str, stage: &str) -> Option<f64> {
    let prefix = format!("{name}{{stage=\"{stage}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// Each stage of a clearing request is timed against its share of the latency budget: a
/// histogram per stage, the budgets as gauges, and a count each time a stage runs over (here
/// the batch stage, given no time at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_stage_is_timed_against_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start_with(&data, &["--budget-batch-ms", "0"], &[]);
    activate(&server).await;
    let mut bank_a = client(&server, &data, "bank-a").await;
    for n in 0..3 {
        bank_a
            .submit(&format!("req-budget-{n}"), &trade(125_000))
            .await
            .unwrap();
    }
    let metrics = aether_e2e::metrics(&server).await;
    for stage in ["gateway", "orchestration", "batch", "commit"] {
        assert_eq!(
            stage_sample(&metrics, "aether_clearing_stage_seconds_count", stage),
            Some(3.0),
            "{stage} timed once per request:\n{metrics}"
        );
    }
    assert_eq!(
        stage_sample(&metrics, "aether_clearing_stage_budget_seconds", "gateway"),
        Some(0.03),
        "the design's 30 ms by default"
    );
    assert_eq!(
        stage_sample(&metrics, "aether_clearing_stage_budget_seconds", "batch"),
        Some(0.0)
    );
    assert_eq!(
        stage_sample(&metrics, "aether_clearing_budget_burn_total", "batch"),
        Some(3.0),
        "every request over a zero budget"
    );
    assert!(server.terminate().success());
}

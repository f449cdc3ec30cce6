//! Clearing with remote workers only: a gateway started with `--no-local-workers` never
//! reads the model file, a flood beyond its bounded queue is refused with
//! RESOURCE_EXHAUSTED, records nothing for the refused trades, and leaves the service
//! serving, and worker processes outlive a gateway restart.

use std::collections::BTreeSet;
use std::time::Duration;

use aether_e2e::Server;
use aether_e2e::clearing::{
    WorkerProcess, activate, activate_with_model_uri, client, decisions, events_of_type, trade,
};
use aether_gateway::client::ClientError;
use aether_gateway::pb::v1::{ClearingAnswer, Decision};
use aether_gpu_worker::reference::REFERENCE_MODEL_DIGEST;

/// A gateway that only remote workers serve (`--no-local-workers`), on `data`.
fn gateway_without_local_workers(data: &std::path::Path) -> Server {
    Server::start(data, &[("AETHER_NO_LOCAL_WORKERS", "true")])
}

/// Submits one trade as bank-a on a task of its own, for a test that acts on the workers
/// while the trade's batch is with one.
async fn submit_meanwhile(
    server: &Server,
    data: &std::path::Path,
    request_id: &'static str,
    amount_minor: i64,
) -> tokio::task::JoinHandle<Result<ClearingAnswer, ClientError>> {
    let mut bank_a = client(server, data, "bank-a").await;
    tokio::spawn(async move { bank_a.submit(request_id, &trade(amount_minor)).await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_local_workers_never_reads_the_model_file() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // Every decision explained (a sample of 100 % of the cleared), so the worker explains.
    let server = Server::start(
        &data,
        &[
            ("AETHER_NO_LOCAL_WORKERS", "true"),
            ("AETHER_EXPLAIN_CLEARED_PERCENT", "100"),
        ],
    );
    // An artifact the gateway cannot read: only the worker holds the model.
    activate_with_model_uri(&server, "s3://aether-models/reference/model.safetensors").await;
    let mut bank_a = client(&server, &data, "bank-a").await;

    // No worker yet: the refusal names the missing worker, not an unreadable file.
    match bank_a.submit("req-none", &trade(50_000)).await {
        Err(ClientError::Status { code, message }) => {
            assert_eq!(code, tonic::Code::Unavailable, "{message}");
            assert!(
                message.contains("no connected worker holds model"),
                "{message}"
            );
            assert!(message.contains(REFERENCE_MODEL_DIGEST), "{message}");
        }
        other => panic!("expected UNAVAILABLE, got {other:?}"),
    }

    let _worker = WorkerProcess::start(&server, &data, "worker-1", 0);
    let answer = bank_a.submit("req-1", &trade(50_000)).await.unwrap();
    assert_eq!(answer.decision, Decision::Cleared as i32, "{answer:?}");
    let all = decisions(&server).await;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["payload"]["worker"], "worker-1");
    assert_eq!(all[0]["payload"]["model_digest"], REFERENCE_MODEL_DIGEST);
    // The worker explained it (the gateway cannot: it has no model) and the gateway took
    // the explanation as it checks a worker's score.
    let explanation = &all[0]["payload"]["explanation"];
    assert_eq!(explanation["status"], "explained", "{explanation}");
    assert!(
        (explanation["score"].as_f64().unwrap() - all[0]["payload"]["score"].as_f64().unwrap())
            .abs()
            < 1e-4,
        "{explanation}"
    );
    assert!(server.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_past_the_queue_is_refused_records_nothing_and_the_gateway_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // One batch at a time, one trade per batch, two trades queued at most, and a worker
    // that takes a second per batch: a burst must overflow.
    let server = Server::start(
        &data,
        &[
            ("AETHER_NO_LOCAL_WORKERS", "true"),
            ("AETHER_QUEUE_CAPACITY", "2"),
            ("AETHER_WORKERS", "1"),
            ("AETHER_BATCH_MAX", "1"),
        ],
    );
    activate(&server).await;
    let _worker = WorkerProcess::start(&server, &data, "worker-1", 1_000);
    let mut bank_a = client(&server, &data, "bank-a").await;
    bank_a.key_exchange().await.unwrap();

    let burst: Vec<_> = (0..24i64)
        .map(|n| {
            let mut member = bank_a.clone();
            tokio::spawn(async move {
                let id = format!("flood-{n}");
                let result = member.submit(&id, &trade(10_000 + n)).await;
                (id, result)
            })
        })
        .collect();
    let mut accepted = BTreeSet::new();
    let mut refused = BTreeSet::new();
    for task in burst {
        let (id, result) = task.await.unwrap();
        match result {
            Ok(answer) => {
                assert!(!answer.replayed, "{answer:?}");
                accepted.insert(id);
            }
            Err(ClientError::Status { code, message }) => {
                assert_eq!(code, tonic::Code::ResourceExhausted, "{id}: {message}");
                assert!(
                    message.contains("queue is full") && message.contains("retry"),
                    "{message}"
                );
                refused.insert(id);
            }
            Err(e) => panic!("{id}: {e}"),
        }
    }
    assert!(!refused.is_empty(), "nothing was refused: {accepted:?}");
    assert!(!accepted.is_empty(), "nothing was accepted");

    // Exactly the accepted trades are on the ledger, each netted once.
    let decided: BTreeSet<String> = decisions(&server)
        .await
        .iter()
        .map(|e| e["metadata"]["request_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(decided, accepted);
    let netted: u64 = events_of_type(&server, "NettingComputed")
        .await
        .iter()
        .map(|e| e["payload"]["trades"].as_u64().unwrap())
        .sum();
    assert_eq!(netted, accepted.len() as u64);

    // The gateway keeps serving: a refused request id sent again is decided now.
    let retry = refused.first().unwrap().clone();
    let answer = bank_a.submit(&retry, &trade(10_000)).await.unwrap();
    assert!(!answer.replayed, "{answer:?}");
    assert_eq!(decisions(&server).await.len(), accepted.len() + 1);
    assert!(server.terminate().success());
}

#[test]
fn a_gpu_asked_for_and_missing_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // The exit code and the message of a refused `aether serve --worker-device <device>`.
    let refused = |device: &str| {
        let out = aether_e2e::run_aether(
            &[
                "serve",
                "--data-dir",
                data.to_str().unwrap(),
                "--listen",
                "127.0.0.1:0",
                "--grpc-listen",
                "127.0.0.1:0",
                "--worker-device",
                device,
            ],
            &[],
        );
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr)
    };
    // No GPU 63 anywhere (and no CUDA at all in a build without the `cuda` feature): the
    // service does not fall back to the CPU, it refuses, and creates nothing.
    let (code, stderr) = refused("cuda:63");
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("--worker-device cuda:63: CUDA device 63 is unavailable"),
        "{stderr}"
    );
    assert!(
        !data.exists(),
        "the refused start created {}",
        data.display()
    );
    // Not a device at all: the flag's parser names the choices.
    let (code, stderr) = refused("gpu");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("not one of cpu, auto, cuda, cuda:N"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_connects_again_when_its_gateway_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // One gRPC address across the restart, as a deployment has.
    let grpc = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let args = ["--grpc-listen", grpc.as_str(), "--no-local-workers"];
    let server = Server::start_with(&data, &args, &[]);
    activate(&server).await;
    aether_e2e::clearing::issue_worker_certificate(&data, "worker-2");
    let mut staying = WorkerProcess::spawn(&server, &data, "worker-1", &[]);
    let mut leaving = WorkerProcess::spawn(&server, &data, "worker-2", &["--no-reconnect"]);
    let mut bank_a = client(&server, &data, "bank-a").await;
    let before = bank_a.submit("req-before", &trade(50_000)).await.unwrap();
    assert_eq!(before.decision, Decision::Cleared as i32, "{before:?}");
    assert!(server.terminate().success());

    // Told not to reconnect, a worker exits with an error; the other waits.
    let status = leaving.exit_within(Duration::from_secs(15));
    assert!(
        status.is_some_and(|s| !s.success()),
        "a --no-reconnect worker outlived its gateway: {status:?}"
    );
    assert_eq!(staying.exit_within(Duration::from_millis(500)), None);

    let server = Server::start_with(&data, &args, &[]);
    let mut bank_a = client(&server, &data, "bank-a").await;
    // UNAVAILABLE ("no connected worker") until the worker is back, then decided by it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let after = loop {
        match bank_a.submit("req-after", &trade(60_000)).await {
            Ok(answer) => break answer,
            Err(ClientError::Status {
                code: tonic::Code::Unavailable,
                message,
            }) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the worker did not come back: {message}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("unexpected refusal: {e:?}"),
        }
    };
    assert_eq!(after.decision, Decision::Cleared as i32, "{after:?}");
    let all = decisions(&server).await;
    let last = all.last().unwrap();
    assert_eq!(last["payload"]["request_id"], "req-after", "{last}");
    assert_eq!(last["payload"]["worker"], "worker-1", "{last}");
    assert_eq!(staying.exit_within(Duration::ZERO), None);
    assert!(server.terminate().success());
}

/// A refusal that asking again cannot change ends the worker with the gateway's reason
/// instead of retrying forever: here a member's certificate presented by a worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refused_for_good_exits_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = gateway_without_local_workers(&data);
    let certs = data.join("certs");
    let path = |name: &str| certs.join(name).to_str().unwrap().to_owned();
    let mut worker = std::process::Command::new(aether_e2e::aether_bin())
        .args(["worker", "--connect", &server.grpc_url, "--id", "bank-a"])
        .arg("--data-dir")
        .arg(&data)
        .args(["--tls-ca", &path("ca.pem")])
        .args(["--tls-cert", &path("member-bank-a.pem")])
        .args(["--tls-key", &path("member-bank-a.key.pem")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let Some(status) = aether_e2e::clearing::exit_within(&mut worker, Duration::from_secs(30))
    else {
        let _ = worker.kill();
        panic!("a worker with a member's certificate kept retrying");
    };
    assert!(!status.success());
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut worker.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("registration refused"), "{stderr}");
    assert!(
        stderr.contains("PermissionDenied") || stderr.contains("permission"),
        "{stderr}"
    );
    assert!(server.terminate().success());
}

/// A worker that stops answering (here SIGSTOP: its connection stays open) holds a batch
/// only until the gateway's batch timeout: the batch is decided once, by another worker,
/// the silent one gets no more work, and when it runs again it connects anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_loses_its_batch_to_another_and_comes_back_when_it_runs_again() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = gateway_without_local_workers(&data);
    activate(&server).await;
    aether_e2e::clearing::issue_worker_certificate(&data, "worker-2");
    let silent = WorkerProcess::spawn(&server, &data, "worker-1", &[]);
    silent.signal("-STOP");
    // The only worker is silent: the trade's batch goes to it.
    let first = submit_meanwhile(&server, &data, "req-held", 40_000).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _other = WorkerProcess::spawn(&server, &data, "worker-2", &[]);
    // Past the batch timeout the batch goes to worker-2 and is decided once.
    let answer = first.await.unwrap().unwrap();
    assert_eq!(answer.decision, Decision::Cleared as i32, "{answer:?}");
    let mut bank_a = client(&server, &data, "bank-a").await;
    for n in 0..4 {
        let answer = bank_a
            .submit(&format!("req-{n}"), &trade(50_000))
            .await
            .unwrap();
        assert_eq!(answer.decision, Decision::Cleared as i32, "{answer:?}");
    }
    let all = decisions(&server).await;
    let by_worker: Vec<(&str, &str)> = all
        .iter()
        .map(|d| {
            (
                d["payload"]["request_id"].as_str().unwrap(),
                d["payload"]["worker"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(all.len(), 5, "{by_worker:?}");
    assert!(
        by_worker.iter().all(|(_, worker)| *worker == "worker-2"),
        "{by_worker:?}"
    );
    // Running again, it finds its work stream ended and connects anew.
    silent.signal("-CONT");
    let log = data.with_extension("worker-1.log");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.matches("connected to the gateway").count() >= 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "worker-1 did not connect again:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(server.terminate().success());
}

/// SIGTERM drains a worker: no new batches, and the one it holds is answered by it before
/// it exits (with no other worker, a batch it dropped could not be decided at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_answers_the_batch_it_holds_before_it_exits() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = gateway_without_local_workers(&data);
    activate(&server).await;
    let mut worker = WorkerProcess::start(&server, &data, "worker-1", 1_500);
    let pending = submit_meanwhile(&server, &data, "req-draining", 30_000).await;
    // The batch is with the worker (answered after 1.5 s) when it is told to stop.
    tokio::time::sleep(Duration::from_millis(500)).await;
    worker.signal("-TERM");
    let answer = pending.await.unwrap().unwrap();
    assert_eq!(answer.decision, Decision::Cleared as i32, "{answer:?}");
    let status = worker.exit_within(Duration::from_secs(30));
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let all = decisions(&server).await;
    assert_eq!(all.len(), 1);
    assert_eq!(all[0]["payload"]["worker"], "worker-1");
    assert!(server.terminate().success());
}

/// The breaker on the scoring stage (issue 40): a worker made slow on purpose (150 ms a
/// batch, past the 85 ms threshold) opens it, and batches are then scored in process, the
/// switch on the ledger with the p99 that decided it; once a fast worker replaces the slow
/// one, probes find it within the threshold, the breaker closes (on the ledger too) and
/// batches go to the worker again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_workers_trip_the_breaker_to_in_process_scoring_and_recovery_closes_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(
        &data,
        &[
            ("AETHER_BREAKER_MIN_BATCHES", "4"),
            ("AETHER_BREAKER_PROBE_AFTER_MS", "300"),
        ],
    );
    activate(&server).await;
    let slow = WorkerProcess::start(&server, &data, "worker-1", 150);
    let mut bank_a = client(&server, &data, "bank-a").await;
    for n in 0..4i64 {
        bank_a
            .submit(&format!("slow-{n}"), &trade(10_000 + n))
            .await
            .unwrap();
    }
    let all = decisions(&server).await;
    assert!(
        all.iter().all(|d| d["payload"]["worker"] == "worker-1"),
        "{all:?}"
    );
    // The fourth slow batch opened it, before its trade was answered.
    let degraded = events_of_type(&server, "ScoringDegraded").await;
    assert_eq!(degraded.len(), 1, "{degraded:?}");
    let figures = &degraded[0]["payload"];
    assert_eq!(degraded[0]["stream_id"], "worker/breaker");
    assert_eq!(figures["path"], "in-process");
    assert_eq!(figures["threshold_ms"], 85.0);
    assert_eq!(figures["batches"], 4);
    assert!(figures["p99_ms"].as_f64().unwrap() >= 150.0, "{figures}");

    // Degraded: scored in process while the slow worker is still connected.
    bank_a.submit("degraded-0", &trade(20_000)).await.unwrap();
    let last = decisions(&server).await.pop().unwrap();
    assert_eq!(last["payload"]["worker"], "in-process", "{last}");

    // A fast worker replaces the slow one; the probes find it and the breaker closes.
    drop(slow);
    aether_e2e::clearing::issue_worker_certificate(&data, "worker-2");
    let _fast = WorkerProcess::start(&server, &data, "worker-2", 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut n = 0i64;
    let restored = loop {
        n += 1;
        bank_a
            .submit(&format!("recovering-{n}"), &trade(30_000 + n))
            .await
            .unwrap();
        let restored = events_of_type(&server, "ScoringRestored").await;
        if !restored.is_empty() {
            break restored;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the breaker did not close"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let figures = &restored[0]["payload"];
    assert_eq!(figures["path"], "remote");
    let probes = figures["probe_ms"].as_array().unwrap();
    assert_eq!(probes.len(), 3, "{figures}");
    assert!(
        probes.iter().all(|p| p.as_f64().unwrap() <= 85.0),
        "{figures}"
    );
    assert!(
        figures["batches_in_process"].as_u64().unwrap() >= 1,
        "{figures}"
    );
    assert!(
        figures["degraded_ms"].as_f64().unwrap() >= 300.0,
        "{figures}"
    );

    bank_a.submit("restored-0", &trade(40_000)).await.unwrap();
    let last = decisions(&server).await.pop().unwrap();
    assert_eq!(last["payload"]["worker"], "worker-2", "{last}");
    let metrics = aether_e2e::metrics(&server).await;
    assert!(
        metrics.contains("aether_clearing_breaker_open 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("aether_clearing_breaker_switches_total{to=\"in-process\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("aether_clearing_breaker_switches_total{to=\"remote\"} 1"),
        "{metrics}"
    );
    assert!(server.terminate().success());
}

//! Clearing helpers shared by the clearing tests: a ready engine, member clients, trades,
//! remote worker processes and the decisions on the ledger.

use std::path::Path;
use std::time::Duration;

use aether_gateway::certs::PkiLayout;
use aether_gateway::client::ClearingClient;
use aether_gateway::identity::Role;
use aether_gateway::pb::v1::{ClearingRequest, Trade};
use aether_gateway::tls::TlsPaths;
use aether_gpu_worker::reference::{REFERENCE_MODEL_DIGEST, REFERENCE_MODEL_REF};
use serde_json::{Value, json};

use crate::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http};

/// A trade from bank-a to bank-b in SGD.
pub fn trade(amount_minor: i64) -> ClearingRequest {
    ClearingRequest {
        trade: Some(Trade {
            buyer: "bank-a".into(),
            seller: "bank-b".into(),
            instrument: "SG0000000001".into(),
            currency: "SGD".into(),
            amount_minor,
            value_date: "2026-12-02".into(),
            jurisdiction: "SG".into(),
            counterparty_tier: 2,
        }),
        ..ClearingRequest::default()
    }
}

/// GET as the regulator, the body as JSON.
pub async fn get(server: &Server, path: &str) -> Value {
    http()
        .get(server.url(path))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// POST as the operator: status and body.
pub async fn post(server: &Server, path: &str, body: Value) -> (u16, Value) {
    let resp = http()
        .post(server.url(path))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    (
        resp.status().as_u16(),
        resp.json().await.unwrap_or(Value::Null),
    )
}

/// The reference model's weights in the source tree, as an absolute path.
pub fn reference_weights() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let weights = root.join("gpu-worker/model/reference/model.safetensors");
    weights.canonicalize().unwrap().to_str().unwrap().to_owned()
}

/// Registers the reference model from its local file, ingests aml_v2 and the example
/// corpus, activates the engine and waits until it is active.
pub async fn activate(server: &Server) {
    activate_with_model_uri(server, &reference_weights()).await;
}

/// As [`activate`], with the reference model registered at `model_uri` (a remote URI is
/// not read at registration: the workers that fetch it check the digest).
pub async fn activate_with_model_uri(server: &Server, model_uri: &str) {
    let (status, body) = post(
        server,
        "/v1/models",
        json!({"ref": REFERENCE_MODEL_REF, "uri": model_uri,
               "digest": REFERENCE_MODEL_DIGEST, "feature_schema": {"schema": "aether.features.v1"}}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    ingest_aml_v2(server).await;
    ingest_example_corpus(server).await;
    let (status, body) = post(
        server,
        "/v1/engine/activate",
        json!({"model_ref": REFERENCE_MODEL_REF, "traffic_weight": 1.0, "policy_hooks": ["aml_v2"]}),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    for _ in 0..200 {
        let engines = get(server, "/v1/engines").await;
        if engines["engines"][0]["status"] == "active" {
            return;
        }
        assert_ne!(engines["engines"][0]["status"], "failed", "{engines}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the engine did not become active");
}

/// Ingests the shipped aml_v2 policy through `server`, as the operator.
pub async fn ingest_aml_v2(server: &Server) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let policy = std::fs::read_to_string(root.join("services/rules/policies/aml_v2.yaml")).unwrap();
    ingest_policy(server, policy).await;
}

/// Ingests a policy's YAML through `server`, as the operator; it must be accepted (201).
pub async fn ingest_policy(server: &Server, policy: impl Into<reqwest::Body>) {
    let resp = http()
        .post(server.url("/v1/policy/ingest"))
        .bearer_auth(OPERATOR_TOKEN)
        .header("content-type", "application/yaml")
        .body(policy)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
}

/// Ingests the shipped threshold-reporting document as corpus `sg-clearing`.
pub async fn ingest_example_corpus(server: &Server) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc =
        std::fs::read_to_string(root.join("services/rag/corpus/threshold-reporting.md")).unwrap();
    let (status, body) = post(
        server,
        "/v1/corpus/ingest",
        json!({"name": "sg-clearing", "documents": [{"id": "threshold-reporting", "text": doc}]}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
}

/// A member's client with the development PKI in `data`.
pub async fn client(server: &Server, data: &Path, member: &str) -> ClearingClient {
    let layout = PkiLayout::new(data);
    ClearingClient::connect(
        &server.grpc_url,
        &TlsPaths::client(&layout, Role::Member, member),
        &data.join("keys/envelope.pub.pem"),
        member,
    )
    .await
    .unwrap()
}

/// Every `ClearingDecided` event, in seq order (up to 1000).
pub async fn decisions(server: &Server) -> Vec<Value> {
    events_of_type(server, "ClearingDecided").await
}

/// Every event of `event_type`, in seq order (up to 1000).
pub async fn events_of_type(server: &Server, event_type: &str) -> Vec<Value> {
    let page = get(
        server,
        &format!("/v1/audit/events?event_type={event_type}&limit=1000"),
    )
    .await;
    page["events"].as_array().unwrap().clone()
}

/// Issues a development certificate for worker `id` in `data` (`aether certs init
/// --worker`, which adds to a PKI already there).
pub fn issue_worker_certificate(data: &Path, id: &str) {
    let out = crate::run_aether(
        &[
            "certs",
            "init",
            "--data-dir",
            data.to_str().unwrap(),
            "--worker",
            id,
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `child`'s exit status if it exits within `limit`; `None` while it runs.
pub fn exit_within(
    child: &mut std::process::Child,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("process status") {
            return Some(status);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A running `aether worker`, killed on drop.
pub struct WorkerProcess(std::process::Child);

impl WorkerProcess {
    /// Starts `aether worker --id <id>` against `server` (the reference model; each batch
    /// answered after `delay_ms`) and waits until it has connected.
    pub fn start(server: &Server, data: &Path, id: &str, delay_ms: u64) -> WorkerProcess {
        Self::spawn(server, data, id, &["--delay-ms", &delay_ms.to_string()])
    }

    /// Starts `aether worker --id <id> --device <device>` against `server` and waits until
    /// it has connected.
    pub fn start_on(server: &Server, data: &Path, id: &str, device: &str) -> WorkerProcess {
        Self::spawn(server, data, id, &["--device", device])
    }

    /// Starts `aether worker --id <id> <args>` against `server` and waits until it has
    /// connected. Its log goes to `<data>.<id>.log`, shown if it does not connect.
    pub fn spawn(server: &Server, data: &Path, id: &str, args: &[&str]) -> WorkerProcess {
        Self::spawn_with_env(server, data, id, args, &[])
    }

    /// [`Self::spawn`] with more environment for the worker (its OTLP endpoint, say).
    pub fn spawn_with_env(
        server: &Server,
        data: &Path,
        id: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> WorkerProcess {
        use std::io::BufRead;
        let log_path = data.with_extension(format!("{id}.log"));
        let log = std::fs::File::create(&log_path).expect("worker log file");
        let mut child = std::process::Command::new(crate::aether_bin())
            .envs(env.iter().copied())
            .args(["worker", "--connect", &server.grpc_url, "--id", id])
            .arg("--data-dir")
            .arg(data)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if line.starts_with("aether worker ") {
                    let _ = tx.send(());
                }
            }
        });
        if rx.recv_timeout(Duration::from_secs(30)).is_err() {
            // It exited (a crash leaves an empty log), or did not connect within 30 s.
            std::thread::sleep(Duration::from_millis(100));
            let status = match child.try_wait() {
                Ok(Some(exit)) => format!("it exited, {exit}"),
                _ => "not within 30 s".to_owned(),
            };
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            panic!("the worker did not connect ({status}); its log:\n{log}");
        }
        WorkerProcess(child)
    }

    pub fn kill(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Sends it a signal by name (`-STOP`, `-CONT`, `-TERM`), as `kill` does.
    pub fn signal(&self, name: &str) {
        let sent = std::process::Command::new("kill")
            .args([name, &self.0.id().to_string()])
            .status()
            .expect("kill");
        assert!(sent.success(), "kill {name} failed");
    }

    /// Its exit status if it exits within `limit`; `None` while it runs.
    pub fn exit_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        exit_within(&mut self.0, limit)
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

//! Support for the end-to-end tests: running real `aether` processes on real data
//! directories and databases, and talking to them over HTTP.

pub mod clearing;
pub mod draw;
pub mod postgres_pair;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

pub const OPERATOR_TOKEN: &str = "e2e-operator-token-0123456789";
pub const REGULATOR_TOKEN: &str = "e2e-regulator-token-0123456789";

/// The `aether` binary next to the test executable (`target/<profile>/aether`), or
/// `AETHER_BIN`. `scripts/test.sh` builds it before the tests run.
pub fn aether_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("AETHER_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let bin = profile_dir.join(format!("aether{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.exists(),
        "{} not found: build it first with `cargo build -p aether` (scripts/test.sh does)",
        bin.display()
    );
    bin
}

/// Runs `aether <args>` to completion with the given environment.
/// `aether audit verify BUNDLE --public-key KEY`: the offline check of an evidence bundle
/// against a trusted key.
pub fn audit_verify(bundle: &Path, public_key: &Path) -> std::process::Output {
    run_aether(
        &[
            "audit",
            "verify",
            bundle.to_str().unwrap(),
            "--public-key",
            public_key.to_str().unwrap(),
        ],
        &[],
    )
}

pub fn run_aether(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(aether_bin());
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .env_remove("AETHER_TOKENS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run aether")
}

/// Runs `aether serve --data-dir <data_dir> --listen 127.0.0.1:0 <args>` to its end: for
/// starts that must be refused.
pub fn run_serve(data_dir: &Path, args: &[&str]) -> std::process::Output {
    let data = data_dir.to_str().expect("a UTF-8 path");
    let mut all = vec!["serve", "--data-dir", data, "--listen", "127.0.0.1:0"];
    all.extend_from_slice(args);
    run_aether(&all, &[])
}

/// The directories a test's server registers models from: the repository's shipped
/// models and the test's temporary directory (the data directory's parent).
pub fn model_dirs(data_dir: &Path) -> String {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../gpu-worker/model");
    let own = data_dir.parent().unwrap_or(data_dir);
    format!("{}:{}", shipped.display(), own.display())
}

/// A running `aether serve`.
pub struct Server {
    child: Child,
    pub base_url: String,
    /// `https://127.0.0.1:<port>` of the clearing gateway.
    pub grpc_url: String,
    /// Where its stderr (the log) goes.
    pub log_path: PathBuf,
}

impl Server {
    /// Starts `aether serve` on a free port with `data_dir`, known tokens and `env`, and
    /// waits until it listens. Its log goes to `<data_dir>/../serve-<n>.log`.
    pub fn start(data_dir: &Path, env: &[(&str, &str)]) -> Server {
        Self::start_with(data_dir, &[], env)
    }

    /// As [`Server::start`], with more `serve` arguments; the gRPC address is any free
    /// port unless `args` names one (`--grpc-listen`).
    pub fn start_with(data_dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let log_path = data_dir.with_extension(format!("log.{}", uuid::Uuid::now_v7().simple()));
        let log = std::fs::File::create(&log_path).expect("log file");
        let mut cmd = Command::new(aether_bin());
        cmd.arg("serve")
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen", "127.0.0.1:0"]);
        if !args.contains(&"--grpc-listen") {
            cmd.args(["--grpc-listen", "127.0.0.1:0"]);
        }
        cmd.args(args)
            .env_remove("DATABASE_URL")
            .env(
                "AETHER_TOKENS",
                format!("operator:{OPERATOR_TOKEN},regulator:{REGULATOR_TOKEN}"),
            )
            .env("AETHER_LOG", "info")
            // Models may be registered from the shipped reference and the test's own files.
            .env("AETHER_MODEL_DIRS", model_dirs(data_dir))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self::spawn(cmd, log_path)
    }

    /// Spawns a prepared `aether serve` command (its stdout piped here, its stderr to
    /// `log_path`) and waits until it prints both listening addresses.
    pub fn spawn(mut cmd: Command, log_path: PathBuf) -> Server {
        let mut child = cmd.spawn().expect("spawn aether serve");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut http = None;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("aether listening on ") {
                    http = Some(url.trim().to_string());
                }
                if let (Some(url), Some(grpc)) = (&http, line.strip_prefix("aether clearing on ")) {
                    let _ = tx.send((url.clone(), grpc.trim().to_string()));
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok((base_url, grpc_url)) => Server {
                child,
                base_url,
                grpc_url,
                log_path,
            },
            Err(_) => {
                let _ = child.kill();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                panic!("aether serve did not start within 60 s; its log:\n{log}");
            }
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: the process gets no chance to clean up.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `limit` for the process to exit by itself; its status, or `None` if it
    /// still runs.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM, then waits for a graceful exit.
    pub fn terminate(mut self) -> ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        for _ in 0..300 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        panic!("aether serve did not stop within 30 s of SIGTERM");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// An HTTP client with no proxy and a short timeout.
pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("http client")
}

/// The server's Prometheus text (`GET /metrics`).
/// The service's OpenAPI document (`GET /v1/openapi.json`, no token needed).
pub async fn openapi_document(server: &Server) -> serde_json::Value {
    http()
        .get(server.url("/v1/openapi.json"))
        .send()
        .await
        .expect("GET /v1/openapi.json")
        .json()
        .await
        .expect("the OpenAPI document is JSON")
}

pub async fn metrics(server: &Server) -> String {
    http()
        .get(server.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Every event of the ledger as `GET /v1/events` pages them, read as the regulator.
pub async fn all_events(server: &Server) -> Vec<serde_json::Value> {
    let client = http();
    let mut out = Vec::new();
    let mut from = 1;
    loop {
        let page: serde_json::Value = client
            .get(server.url(&format!("/v1/events?from_seq={from}&limit=1000")))
            .bearer_auth(REGULATOR_TOKEN)
            .send()
            .await
            .expect("GET /v1/events")
            .json()
            .await
            .expect("a page of events");
        out.extend(page["events"].as_array().into_iter().flatten().cloned());
        match page["next_from_seq"].as_u64() {
            Some(n) => from = n,
            None => return out,
        }
    }
}

/// Registers two small models, `finmoe-7b-v3@sgp-region` and `finmoe-7b-v4@sgp-region`,
/// from files written in `dir` (which must be one of the server's model directories), as
/// an operator: the baseline and candidate of a rollout that scores nothing.
pub async fn register_two_models(server: &Server, dir: &Path) {
    for (name, bytes) in [("v3", b"three".as_slice()), ("v4", b"four".as_slice())] {
        std::fs::create_dir_all(dir).expect("model dir");
        let path = dir.join(format!("{name}.bin"));
        std::fs::write(&path, bytes).expect("model file");
        let model = serde_json::json!({"ref": format!("finmoe-7b-{name}@sgp-region"),
            "uri": path.to_str().expect("UTF-8 path"),
            "digest": hex::encode(aether_ledger::hashing::sm3(bytes)),
            "feature_schema": {"amount_minor": "int"}});
        let resp = http()
            .post(server.url("/v1/models"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&model)
            .send()
            .await
            .expect("register a model");
        let status = resp.status();
        assert_eq!(status, 201, "{}", resp.text().await.unwrap_or_default());
    }
}

/// Runs `aether cluster chaos` with `args` against the test server (a scratch database of
/// its own) and a real `s3s-fs`, and checks what every chaos run must print: each kind of
/// acknowledged write in the ledger exactly once, `verify` OK with the one key, the Delta
/// table equal to the ledger, lineage complete, and load that went through (more than 100
/// events). Returns the report.
pub fn chaos_run(args: &[&str]) -> String {
    let url = aether_ledger::testing::admin_url();
    let s3s_fs = aether_lineage::testing::s3s_fs_binary();
    let mut all = vec!["cluster", "chaos", "--database-url", url.as_str()];
    all.extend_from_slice(args);
    all.extend(["--s3s-fs", s3s_fs.to_str().unwrap()]);
    let out = run_aether(&all, &[]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "Delta tables at s3://aether/chaos",
        "every acknowledged event is in the ledger exactly once",
        "every acknowledged policy version is in the ledger exactly once",
        "every acknowledged decision is in the ledger exactly once",
        "every acknowledged snapshot is in the ledger exactly once",
        "every acknowledged rollback is in the ledger exactly once",
        "aether verify: OK with the one cluster key",
        "each once",
        "every event has its OpenLineage record and Delta version",
        "chaos: every check passed",
    ] {
        assert!(report.contains(line), "no {line:?} in:\n{report}");
    }
    let load = report
        .lines()
        .find(|l| l.starts_with("load: "))
        .unwrap_or_default();
    let events: u64 = load
        .get("load: ".len()..)
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        events > 100,
        "not a run that checked an empty ledger: {load}"
    );
    report
}

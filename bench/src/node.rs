//! A real `aether serve` as a child process, for the benches, the chaos run and the demo:
//! started on free ports from this same executable, set up over its HTTP API (the
//! reference model, a policy and a corpus document, the engine activated), stopped.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use aether_gpu_worker::reference::{self, REFERENCE_MODEL_REF};
use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

const AML_POLICY: &str = include_str!("../../services/rules/policies/aml_v2.yaml");
const CORPUS_DOC: &str = include_str!("../../services/rag/corpus/threshold-reporting.md");

/// A running `aether serve` child process.
pub struct ServeChild {
    child: tokio::process::Child,
    pub pid: u32,
    pub http: String,
    pub grpc: String,
}

impl ServeChild {
    /// `tokens`: `AETHER_TOKENS` for the child, or None to let it create `<data>/tokens`;
    /// `log_level`: its `AETHER_LOG` (a bench keeps it at `warn`, a demo's log tells the story).
    pub async fn start(
        data: &Path,
        log_path: &Path,
        database_url: Option<&str>,
        tokens: Option<&str>,
        batch_delay_us: u64,
        log_level: &str,
    ) -> anyhow::Result<ServeChild> {
        Self::start_with_env(
            data,
            log_path,
            database_url,
            tokens,
            batch_delay_us,
            log_level,
            &[],
        )
        .await
    }

    /// [`Self::start`] with more environment for the child (a node id, a lease ttl ...).
    pub async fn start_with_env(
        data: &Path,
        log_path: &Path,
        database_url: Option<&str>,
        tokens: Option<&str>,
        batch_delay_us: u64,
        log_level: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<ServeChild> {
        let exe = std::env::current_exe().context("cannot find the aether binary")?;
        let log = std::fs::File::create(log_path)
            .with_context(|| format!("cannot create {}", log_path.display()))?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg("serve")
            .arg("--data-dir")
            .arg(data)
            .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"])
            .arg("--batch-delay-us")
            .arg(batch_delay_us.to_string())
            .env_remove("AETHER_TOKENS_FILE")
            .env("AETHER_LOG", log_level)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true);
        match database_url {
            Some(url) => cmd.env("DATABASE_URL", url),
            None => cmd.env_remove("DATABASE_URL"),
        };
        match tokens {
            Some(tokens) => cmd.env("AETHER_TOKENS", tokens),
            None => cmd.env_remove("AETHER_TOKENS"),
        };
        cmd.envs(env.iter().copied());
        let mut child = cmd.spawn().context("cannot start aether serve")?;
        let pid = child.id().unwrap_or(0);
        let stdout = child.stdout.take().context("no stdout from aether serve")?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            let mut http = None;
            let mut tx = Some(tx);
            // Keeps reading to the end so the server never blocks on a full pipe.
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(url) = line.strip_prefix("aether listening on ") {
                    http = Some(url.trim().to_owned());
                }
                if let (Some(url), Some(grpc)) = (&http, line.strip_prefix("aether clearing on "))
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send((url.clone(), grpc.trim().to_owned()));
                }
            }
        });
        let started = tokio::time::timeout(Duration::from_secs(180), rx).await;
        match started {
            Ok(Ok((http, grpc))) => Ok(ServeChild {
                child,
                pid,
                http,
                grpc,
            }),
            _ => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                bail!("aether serve did not announce its HTTP and gRPC addresses within 180 s")
            }
        }
    }

    pub async fn stop(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// SIGTERM (an orderly stop: the last checkpoint, the relays drained), then SIGKILL if
    /// it has not exited within `limit`.
    pub async fn terminate(&mut self, limit: Duration) {
        if let Ok(pid) = i32::try_from(self.pid)
            && pid > 0
        {
            // SAFETY: kill(2) with a pid this process spawned and has not yet reaped.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        if tokio::time::timeout(limit, self.child.wait())
            .await
            .is_err()
        {
            self.stop().await;
        }
    }
}

/// Installs the reference model under `<data>/model` (the service's model directory),
/// registers it, ingests aml_v2 and a corpus document, activates the engine and waits
/// until it is active (as `tests/tests/clearing_e2e.rs` does).
pub async fn setup_engine(
    http: &str,
    data: &Path,
    operator: &str,
    regulator: &str,
) -> anyhow::Result<()> {
    let installed =
        reference::install(&data.join("model")).context("cannot install the reference model")?;
    let uri = installed
        .weights_path
        .to_str()
        .context("the temp path is not UTF-8")?
        .to_owned();
    let model = serde_json::json!({
        "ref": REFERENCE_MODEL_REF,
        "uri": uri,
        "digest": installed.digest,
        "feature_schema": {"schema": "aether.features.v1"},
    });
    expect(
        post_json(http, "/v1/models", operator, &model).await?,
        201,
        "register the model",
    )?;
    expect(
        http_request(
            http,
            "POST",
            "/v1/policy/ingest",
            operator,
            Some(("application/yaml", AML_POLICY.as_bytes())),
        )
        .await?,
        201,
        "ingest aml_v2",
    )?;
    let corpus = serde_json::json!({
        "name": "sg-clearing",
        "documents": [{"id": "threshold-reporting", "text": CORPUS_DOC}],
    });
    expect(
        post_json(http, "/v1/corpus/ingest", operator, &corpus).await?,
        201,
        "ingest the corpus",
    )?;
    let activate = serde_json::json!({
        "model_ref": REFERENCE_MODEL_REF,
        "traffic_weight": 1.0,
        "policy_hooks": ["aml_v2"],
    });
    expect(
        post_json(http, "/v1/engine/activate", operator, &activate).await?,
        202,
        "activate the engine",
    )?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (status, body) = http_request(http, "GET", "/v1/engines", regulator, None).await?;
        if status == 200 {
            let doc: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            match doc["engines"][0]["status"].as_str() {
                Some("active") => return Ok(()),
                Some("failed") => bail!("the engine activation failed: {doc}"),
                _ => {}
            }
        }
        if Instant::now() > deadline {
            bail!("the engine did not become active within 120 s (last answer {status}: {body})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn expect(answer: (u16, String), status: u16, what: &str) -> anyhow::Result<()> {
    if answer.0 != status {
        bail!(
            "cannot {what}: HTTP {} (expected {status}): {}",
            answer.0,
            answer.1
        );
    }
    Ok(())
}

/// One trade through the real client module: checks the setup and measures the size of
/// a sealed answer, which the echo server then sends back for every request.
pub async fn post_json(
    base: &str,
    path: &str,
    token: &str,
    body: &serde_json::Value,
) -> anyhow::Result<(u16, String)> {
    let bytes = serde_json::to_vec(body)?;
    http_request(
        base,
        "POST",
        path,
        token,
        Some(("application/json", bytes.as_slice())),
    )
    .await
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`); returns the status
/// and the body. Enough for a handful of setup calls to the local server.
pub async fn http_request(
    base: &str,
    method: &str,
    path: &str,
    token: &str,
    body: Option<(&str, &[u8])>,
) -> anyhow::Result<(u16, String)> {
    let host = base
        .strip_prefix("http://")
        .context("the server's HTTP address is not http://")?
        .trim_end_matches('/');
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(host).await?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n"
        );
        if let Some((content_type, bytes)) = body {
            head.push_str(&format!(
                "Content-Type: {content_type}\r\nContent-Length: {}\r\n",
                bytes.len()
            ));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).await?;
        if let Some((_, bytes)) = body {
            stream.write_all(bytes).await?;
        }
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        anyhow::Ok(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(60), exchange)
        .await
        .with_context(|| format!("{method} {path} timed out"))??;
    parse_response(&raw).with_context(|| format!("{method} {path}: unreadable answer"))
}

pub(crate) fn parse_response(raw: &[u8]) -> anyhow::Result<(u16, String)> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no end of headers")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let mut body = raw[split + 4..].to_vec();
    let mut lines = head.lines();
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .context("no status line")?;
    let chunked = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding") && v.trim() == "chunked"
        })
    });
    if chunked {
        body = dechunk(&body).context("bad chunked body")?;
    }
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&raw[..end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        raw = &raw[end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(raw.get(..size)?);
        raw = raw.get(size + 2..)?;
    }
}

/// Copies a directory tree (a node's keys and certificates to another node).
pub fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name()))?;
        }
    }
    Ok(())
}

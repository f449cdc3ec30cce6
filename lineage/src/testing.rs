//! A real S3-compatible server for tests (feature `testing`): `s3s-fs`, a file-system
//! backed S3 server from crates.io, as a child process on a free local port. Not a mock:
//! requests are signed (SigV4) and checked, and conditional puts are the server's.
//!
//! The binary is `AETHER_S3S_FS`, else `s3s-fs` under `$HOME/.cache/aether/tools/bin`
//! (where `scripts/test.sh` installs it when missing), else on `PATH`.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::delta::StorageOptions;

/// The credentials the server is started with.
pub const ACCESS_KEY: &str = "aether-test";
pub const SECRET_KEY: &str = "aether-test-secret-key";
const REGION: &str = "us-east-1";

/// A running `s3s-fs` with one bucket; killed on drop.
pub struct S3Server {
    child: Child,
    root: tempfile::TempDir,
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
    pub bucket: String,
}

/// Where the `s3s-fs` binary is.
pub fn s3s_fs_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("AETHER_S3S_FS") {
        return PathBuf::from(path);
    }
    if let Some(home) = std::env::var_os("HOME") {
        let cached = PathBuf::from(home).join(".cache/aether/tools/bin/s3s-fs");
        if cached.is_file() {
            return cached;
        }
    }
    PathBuf::from("s3s-fs")
}

impl S3Server {
    /// Starts a server with the bucket `aether` and waits until it accepts connections.
    pub fn start() -> S3Server {
        let root = tempfile::tempdir().expect("temporary directory for the S3 server");
        let bucket = "aether".to_owned();
        std::fs::create_dir(root.path().join(&bucket)).expect("bucket directory");
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let binary = s3s_fs_binary();
        let child = Command::new(&binary)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(root.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start the S3 server {}: {e} (scripts/test.sh installs it: \
                     cargo install s3s-fs --version 0.14.1 --features binary)",
                    binary.display()
                )
            });
        let address = SocketAddr::from(([127, 0, 0, 1], port));
        let started = Instant::now();
        while TcpStream::connect_timeout(&address, Duration::from_millis(200)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the S3 server did not listen on {address}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        S3Server {
            child,
            root,
            endpoint: format!("http://{address}"),
            bucket,
        }
    }

    /// `s3://<bucket>/<prefix>`.
    pub fn uri(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }

    /// The environment a process needs to reach the server (`AWS_*`).
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", REGION),
            ("AWS_ENDPOINT", self.endpoint.as_str()),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    /// The same settings as storage options, for a table opened in this process.
    pub fn options(&self) -> StorageOptions {
        self.env()
            .into_iter()
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .collect()
    }

    /// Every `seq` in the active files of the `events` table at `location` (on this
    /// server), sorted, duplicates kept.
    pub async fn table_seqs(&self, location: &str) -> Vec<i64> {
        crate::delta::events_table_seqs(location, &self.options())
            .await
            .expect("read the table's seqs")
            .into_iter()
            .map(|seq| i64::try_from(seq).expect("a seq"))
            .collect()
    }

    /// Where the server keeps the bucket's objects (one file per object).
    pub fn bucket_dir(&self) -> PathBuf {
        self.root.path().join(&self.bucket)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

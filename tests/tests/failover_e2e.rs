//! The ledger on a PostgreSQL primary with a synchronous standby, named by a multi-host URL:
//! the primary is killed under load, the standby promoted, and the same `aether serve`
//! process goes on appending to the new primary without a restart. Nothing it acknowledged
//! is lost, and the promoted ledger verifies.
//!
//! Both servers are real clusters made here with `initdb` and `pg_basebackup` (as the
//! `postgres` user when the tests run as root), on free local ports.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use aether_e2e::{OPERATOR_TOKEN, Server, http, run_aether};
use serde_json::json;

/// PostgreSQL's server programs: `pg_config --bindir`, else the newest under
/// /usr/lib/postgresql.
fn pg_bin() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("initdb").is_file() {
            return dir;
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's server programs (initdb, pg_ctl, pg_basebackup)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("initdb").is_file())
        .collect();
    versions.sort();
    versions.pop().expect("initdb under /usr/lib/postgresql")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A primary and its synchronous standby; both stopped on drop.
struct Pair {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_postgres: bool,
    primary_port: u16,
    standby_port: u16,
}

impl Pair {
    fn run(&self, program: &str, args: &[&str]) {
        let path = self.bin.join(program);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        let out = cmd.args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn data(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn text(path: &Path) -> String {
        path.to_str().unwrap().to_owned()
    }

    fn start() -> Pair {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: geteuid(2) has no preconditions and cannot fail.
        let as_postgres = unsafe { libc::geteuid() } == 0;
        if as_postgres {
            let status = Command::new("chown")
                .args(["postgres:", Self::text(dir.path()).as_str()])
                .status()
                .unwrap();
            assert!(status.success());
        }
        let pair = Pair {
            dir,
            bin: pg_bin(),
            as_postgres,
            primary_port: free_port(),
            standby_port: free_port(),
        };
        let primary = Self::text(&pair.data("primary"));
        let standby = Self::text(&pair.data("standby"));
        let sockets = Self::text(pair.dir.path());
        pair.run(
            "initdb",
            &[
                "-D",
                &primary,
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
        );
        let conf = format!(
            "port = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{sockets}'\n\
             synchronous_standby_names = 'standby1'\nsynchronous_commit = on\nfsync = on\n\
             max_wal_senders = 4\nwal_level = replica\n",
            pair.primary_port
        );
        pair.append_conf(&pair.data("primary").join("postgresql.conf"), &conf);
        pair.run(
            "pg_ctl",
            &[
                "-D",
                &primary,
                "-l",
                &format!("{primary}.log"),
                "-w",
                "start",
            ],
        );
        pair.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &pair.primary_port.to_string(),
                "-U",
                "postgres",
                "-D",
                &standby,
                "-R",
                "-X",
                "stream",
            ],
        );
        // In postgresql.auto.conf, after what `pg_basebackup -R` wrote there, so that this
        // primary_conninfo (naming the standby for synchronous_standby_names) wins. Once
        // promoted it has no standby of its own: it must not wait for one (the copied
        // setting would make every commit wait for ever).
        pair.append_conf(
            &pair.data("standby").join("postgresql.auto.conf"),
            &format!(
                "port = {}\nprimary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name=standby1'\n\
                 synchronous_standby_names = ''\n",
                pair.standby_port, pair.primary_port
            ),
        );
        pair.run(
            "pg_ctl",
            &[
                "-D",
                &standby,
                "-l",
                &format!("{standby}.log"),
                "-w",
                "start",
            ],
        );
        pair
    }

    /// Appends settings to a cluster's configuration file.
    fn append_conf(&self, file: &Path, text: &str) {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new().append(true).open(file).unwrap();
        file.write_all(text.as_bytes()).unwrap();
    }

    fn url(&self, ports: &[u16]) -> String {
        let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        format!(
            "postgres://postgres@{}/postgres?target_session_attrs=read-write&sslmode=disable",
            hosts.join(",")
        )
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for name in ["standby", "primary"] {
            let data = Self::text(&self.data(name));
            let path = self.bin.join("pg_ctl");
            let mut cmd = if self.as_postgres {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(&path);
                c
            } else {
                Command::new(&path)
            };
            let _ = cmd.args(["-D", &data, "-m", "immediate", "stop"]).output();
        }
    }
}

/// Waits until the primary reports the standby as synchronous.
async fn wait_for_sync(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut conn) = <sqlx::PgConnection as sqlx::Connection>::connect(url).await {
            let state: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1'",
            )
            .fetch_optional(&mut conn)
            .await
            .unwrap_or(None);
            if state.as_deref() == Some("sync") {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the standby never became synchronous"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Appends one event on `stream`, a stream of its own; whether it was acknowledged (201, or
/// 409: a retry of one that was recorded).
async fn append(server: &Server, stream: &str) -> bool {
    let answer = http()
        .post(server.url("/v1/events"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(
            &json!({"stream_id": stream, "expected_version": "no_stream",
                      "events": [{"event_type": "Note", "payload": {}}]}),
        )
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    matches!(answer.map(|r| r.status().as_u16()), Ok(201 | 409))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_promoted_under_load_has_everything_acknowledged() {
    let pair = Pair::start();
    let primary_only = pair.url(&[pair.primary_port]);
    wait_for_sync(&primary_only).await;
    let url = pair.url(&[pair.primary_port, pair.standby_port]);
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(data.path(), &[("DATABASE_URL", url.as_str())]);

    // Four appenders without pause, each on streams of its own, until told to stop.
    let acknowledged = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let refused = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let server = std::sync::Arc::new(server);
    let appenders: Vec<_> = (0..4)
        .map(|w| {
            let (server, acknowledged, refused, stop) = (
                server.clone(),
                acknowledged.clone(),
                refused.clone(),
                stop_rx.clone(),
            );
            tokio::spawn(async move {
                let mut n = 0;
                while !*stop.borrow() {
                    let stream = format!("failover/{w}-{n}");
                    if append(&server, &stream).await {
                        acknowledged.lock().unwrap().push(stream);
                        n += 1;
                    } else {
                        refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            })
        })
        .collect();
    let count = |acknowledged: &std::sync::Mutex<Vec<String>>| acknowledged.lock().unwrap().len();
    let wait_for = |target: usize, what: &'static str| {
        let acknowledged = acknowledged.clone();
        async move {
            let started = Instant::now();
            while count(&acknowledged) < target {
                assert!(started.elapsed() < Duration::from_secs(60), "{what}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_for(200, "appends did not get going").await;

    // The primary dies with appends in flight; the standby is promoted.
    let primary = Pair::text(&pair.data("primary"));
    let standby = Pair::text(&pair.data("standby"));
    pair.run("pg_ctl", &["-D", &primary, "-m", "immediate", "stop"]);
    let at_kill = count(&acknowledged);
    pair.run("pg_ctl", &["-D", &standby, "-w", "promote"]);
    // The same process goes on, now writing to the promoted standby.
    wait_for(
        at_kill + 200,
        "the service did not write to the promoted standby within 60 s",
    )
    .await;
    stop.send(true).unwrap();
    for appender in appenders {
        appender.await.unwrap();
    }
    println!(
        "{at_kill} appends acknowledged before the kill, {} in all; {} refused while the primary changed",
        count(&acknowledged),
        refused.load(std::sync::atomic::Ordering::Relaxed)
    );
    let server = std::sync::Arc::try_unwrap(server).ok().unwrap();
    assert!(server.terminate().success());

    // Everything acknowledged is on the new primary, once.
    let standby_only = pair.url(&[pair.standby_port]);
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&standby_only)
        .await
        .unwrap();
    let stored: Vec<(String, i64)> = sqlx::query_as(
        "SELECT stream_id, count(*) FROM events WHERE stream_id LIKE 'failover/%' GROUP BY 1",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let stored: std::collections::HashMap<String, i64> = stored.into_iter().collect();
    let acknowledged = acknowledged.lock().unwrap().clone();
    for stream in &acknowledged {
        assert_eq!(
            stored.get(stream),
            Some(&1),
            "acknowledged event {stream} is not on the promoted standby exactly once"
        );
    }
    let out = run_aether(
        &["verify", "--data-dir", data.path().to_str().unwrap()],
        &[("DATABASE_URL", standby_only.as_str())],
    );
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

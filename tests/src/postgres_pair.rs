//! A PostgreSQL primary with a synchronous standby (or a lone primary), made for a test with `initdb` and
//! `pg_basebackup` (as the `postgres` user when the tests run as root), on free local ports;
//! both stopped on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

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
pub struct Pair {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_postgres: bool,
    pub primary_port: u16,
    pub standby_port: u16,
}

impl Pair {
    pub fn run(&self, program: &str, args: &[&str]) {
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

    pub fn data(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn text(path: &Path) -> String {
        path.to_str().unwrap().to_owned()
    }

    /// A primary and its synchronous standby, both running.
    pub fn start() -> Pair {
        Self::init(true)
    }

    /// A lone primary (no standby, commits wait for nobody), for tests that stop and
    /// start the database itself.
    pub fn primary_only() -> Pair {
        Self::init(false)
    }

    /// `pg_ctl start` of the primary, waiting until it accepts connections.
    pub fn start_primary(&self) {
        let primary = Self::text(&self.data("primary"));
        self.run(
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
    }

    fn init(with_standby: bool) -> Pair {
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
        let waits_for = if with_standby { "standby1" } else { "" };
        let conf = format!(
            "port = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{sockets}'\n\
             synchronous_standby_names = '{waits_for}'\nsynchronous_commit = on\nfsync = on\n\
             max_wal_senders = 4\nwal_level = replica\n",
            pair.primary_port
        );
        pair.append_conf(&pair.data("primary").join("postgresql.conf"), &conf);
        pair.start_primary();
        if !with_standby {
            return pair;
        }
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

    /// One server's URL, as a replica's is given (no session attributes).
    pub fn url_of(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=disable")
    }

    pub fn url(&self, ports: &[u16]) -> String {
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
pub async fn wait_for_sync(url: &str) {
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

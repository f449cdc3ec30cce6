//! The tour in `docs/tour.md` ("A five-minute tour") run as it stands, in order, by bash,
//! against a fresh `aether serve` on its embedded defaults in a scratch directory: every
//! HTTP answer must be the one the tour says (2xx, and the one refusal it shows), every
//! command must succeed, and the closing `aether verify` must pass. Only the addresses
//! are changed (the service listens on free ports) and `cargo run --release --` runs the
//! binary under test.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use aether_e2e::{Server, aether_bin};

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the repository")
        .to_path_buf()
}

/// The shell block of the section headed `heading` in `docs/tour.md`.
fn tour_block(heading: &str) -> String {
    let tour = std::fs::read_to_string(repo().join("docs/tour.md")).expect("docs/tour.md");
    let section = tour
        .split("\n## ")
        .find(|s| s.starts_with(heading))
        .unwrap_or_else(|| panic!("docs/tour.md has no section {heading:?}"));
    let start = section
        .find("```sh\n")
        .expect("the section has a ```sh block")
        + 6;
    let end = start + section[start..].find("\n```").expect("the block ends");
    section[start..end].to_owned()
}

/// What the script runs before the tour: `cargo run --release --` becomes the binary under
/// test (pointed at the test's gateway and HTTP address), every `curl` writes its status
/// and method to stderr, and the server is stopped before the closing `verify`.
const PRELUDE: &str = r#"set -euo pipefail
cargo() {
    [ "$1 $2 $3" = "run --release --" ] || { echo "unexpected cargo call: $*" >&2; exit 90; }
    shift 3
    case "$1 ${2:-}" in
        "client submit") "$AETHER_BIN" "$@" --endpoint "$AETHER_GRPC" ;;
        "audit export") "$AETHER_BIN" "$@" --url "http://$AETHER_HTTP" ;;
        "verify "*)
            kill -TERM "$AETHER_PID"
            # Until it has exited (a zombie until the test reaps it: state Z).
            while [ -e "/proc/$AETHER_PID" ] && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$AETHER_PID/stat"; do
                sleep 0.2
            done
            "$AETHER_BIN" "$@" ;;
        *) "$AETHER_BIN" "$@" ;;
    esac
}
curl() {
    command curl -w '%{stderr}TOUR-HTTP %{http_code} %{method} %{url_effective}\n' "$@"
}
"#;

#[test]
fn the_tour_runs_as_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    // The tour runs from a checkout: the files it reads are the repository's.
    for name in ["services", "gpu-worker"] {
        std::os::unix::fs::symlink(repo().join(name), root.join(name)).expect("symlink");
    }
    let data = root.join("aether-data");
    let log_path = root.join("serve.log");
    let mut serve = Command::new(aether_bin());
    serve
        .current_dir(root)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
        ])
        .env_remove("DATABASE_URL")
        .env_remove("AETHER_TOKENS")
        .env_remove("AETHER_TOKENS_FILE")
        .env_remove("AETHER_DATA_DIR")
        .env("AETHER_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log_path).expect("log file"));
    let server = Server::spawn(serve, log_path.clone());
    let http = server
        .base_url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();

    let block = tour_block("A five-minute tour").replace("localhost:8080", &http);
    let script = format!("{PRELUDE}\n{block}\n");
    let started = Instant::now();
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(root)
        .env("AETHER_BIN", aether_bin())
        .env("AETHER_HTTP", &http)
        .env("AETHER_GRPC", &server.grpc_url)
        .env("AETHER_PID", server.pid().to_string())
        .env_remove("DATABASE_URL")
        .env_remove("AETHER_DATA_DIR")
        .output()
        .expect("run bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        out.status.success(),
        "the tour stopped ({:?}) after {:?}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n--- server log\n{log}",
        out.status,
        started.elapsed()
    );

    // Every HTTP answer as the tour says: the one stale append refused, the rest 2xx.
    let answers: Vec<(u16, String)> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("TOUR-HTTP "))
        .map(|l| {
            let (status, call) = l.split_once(' ').expect("status and call");
            (status.parse().expect("status"), call.to_owned())
        })
        .collect();
    assert!(answers.len() > 30, "{} HTTP calls: {stderr}", answers.len());
    let refused: Vec<&(u16, String)> = answers.iter().filter(|(s, _)| *s >= 300).collect();
    assert_eq!(
        refused.len(),
        1,
        "only the stale append is refused: {refused:?}\n{stdout}"
    );
    assert_eq!(refused[0].0, 409, "{refused:?}");
    assert!(refused[0].1.starts_with("POST ") && refused[0].1.ends_with("/v1/events"));
    // The second ledger read is the held trade's whole why.
    assert!(
        stdout.contains("HELD_FOR_REVIEW"),
        "the tour's second trade is held: {stdout}"
    );
    // The rollback brought back the rule set without basel3_delta.
    assert!(stdout.contains("\"target_snapshot\""), "{stdout}");
    // The bundle verified offline, and so did the whole ledger after the stop.
    assert!(stdout.contains("evidence bundle OK"), "{stdout}");
    assert!(stdout.contains("OK: "), "{stdout}");
    assert!(root.join("evidence.json").is_file());
    // A log written to a file carries no terminal colour codes.
    assert!(!log.is_empty() && !log.contains('\u{1b}'), "{log}");
    assert!(data.join("tokens").is_file());
    drop(server);
}

//! End-to-end: the lineage relay of a running `aether serve` gives every event an
//! OpenLineage record, survives SIGKILL, and `aether lineage reconcile` reports gaps.

use std::time::{Duration, Instant};

use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http, run_aether};
use serde_json::{Value, json};

async fn append(server: &Server, n: u64) -> u64 {
    let v: Value = http()
        .post(server.url("/v1/events"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(
            &json!({"stream_id": "trades/m-1", "events": [{"event_type": "TradeBooked",
               "payload": {"n": n}, "metadata": {"trace_id": format!("t-{n}")}}]}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["committed"][0]["seq"].as_u64().unwrap()
}

async fn record(server: &Server, seq: u64) -> Option<Value> {
    let resp = http()
        .get(server.url(&format!("/v1/lineage/events/{seq}")))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap();
    (resp.status() == 200).then_some(resp.json().await.unwrap())
}

async fn wait_for_record(server: &Server, seq: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(r) = record(server, seq).await {
            return r;
        }
        assert!(Instant::now() < deadline, "no lineage record for seq {seq}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_gets_an_openlineage_record_even_across_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let jsonl = dir.path().join("lineage").join("openlineage.jsonl");
    // Through its environment variable (`--openlineage-file` is the same setting).
    let file_env = [("AETHER_OPENLINEAGE_FILE", jsonl.to_str().unwrap())];
    let server = Server::start(&data, &file_env);
    for n in 0..5 {
        append(&server, n).await;
    }
    // The last event is a real clearing decision (its stream and type are the gateway's).
    aether_e2e::clearing::activate(&server).await;
    let mut bank_a = aether_e2e::clearing::client(&server, &data, "bank-a").await;
    let mut request = aether_e2e::clearing::trade(125_000);
    request.trace_id = "4bf92f3577b34da6a3ce929d0e0e4736".into();
    let answer = bank_a.submit("lineage-1", &request).await.unwrap();
    let mut last = answer.receipt.as_ref().unwrap().seq;
    let r = wait_for_record(&server, last).await;
    let event = &r["openlineage_event"];
    assert_eq!(event["job"]["namespace"], "aether");
    assert_eq!(event["job"]["name"], "clearing.batch");
    assert_eq!(r["run_id"], event["run"]["runId"]);
    // The decision's record is its scoring batch's: one run, whose ledger event is the
    // batch's netting (just before the decision) and which names the decision.
    let facet = &event["run"]["facets"]["aether_ledger"];
    assert_eq!(facet["event_type"], "NettingComputed");
    assert_eq!(facet["seq"], last - 1);
    assert_eq!(
        (r["seq"].as_u64(), r["last_seq"].as_u64()),
        (Some(last - 1), Some(last))
    );
    let batch = &event["run"]["facets"]["aether_clearing_batch"];
    let decisions = batch["decisions"].as_array().unwrap();
    assert_eq!(decisions.len(), 1, "{batch}");
    assert_eq!(decisions[0]["seq"], last);
    assert_eq!(decisions[0]["request_id"], "lineage-1");
    assert_eq!(decisions[0]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    // Both Delta tables that hold the decision are named, each at the version whose commit
    // (in that table's own log) covers its seq.
    for table in ["events", "clearing_decisions"] {
        let output = event["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["namespace"] == "delta" && d["name"] == table)
            .unwrap_or_else(|| panic!("no delta/{table} output: {event}"));
        let version: u64 = output["facets"]["version"]["datasetVersion"]
            .as_str()
            .unwrap_or_else(|| panic!("delta/{table} has no version: {output}"))
            .parse()
            .unwrap();
        let commits = delta_commits_in_log(&data.join("delta").join(table));
        assert!(
            commits
                .iter()
                .any(|&(v, first, end)| v == version && first <= last && last <= end),
            "{table} version {version} does not hold seq {last}: {commits:?}"
        );
    }
    // Each custom facet's schema is served at the URL the facet names.
    for facet in [facet, batch] {
        let schema_url = facet["_schemaURL"].as_str().unwrap();
        let schema: Value = http()
            .get(schema_url)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(schema["$id"], schema_url);
    }
    // The audit view of an event shows its lineage record.
    let audit: Value = http()
        .get(server.url(&format!("/v1/audit/events/{last}")))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(audit["lineage"]["run_id"], r["run_id"]);

    // A first start on an empty data directory creates both Delta tables and commits to
    // them without an ERROR in the log, and the Delta libraries' per-commit INFO lines
    // stay out of it.
    let log = std::fs::read_to_string(&server.log_path).unwrap();
    assert!(log.contains("aether serving"), "{log}");
    for unwanted in ["ERROR", "buoyant_kernel", "deltalake_core"] {
        assert!(!log.contains(unwanted), "{unwanted} in the log:\n{log}");
    }

    // SIGKILL, more events while down are impossible, so append after restart and check
    // the relay resumed from its cursor and left no seq behind.
    server.kill();
    let server = Server::start(&data, &file_env);
    for n in 5..8 {
        last = append(&server, n).await;
    }
    wait_for_record(&server, last).await;
    assert!(server.terminate().success());
    let out = run_aether(
        &[
            "lineage",
            "reconcile",
            "--data-dir",
            data.to_str().unwrap(),
            "--json",
        ],
        &[],
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["missing_openlineage"], json!([]), "{report}");
    // Every event is in exactly one Delta commit of <data>/delta/events, and linked.
    assert_eq!(report["missing_delta"], json!([]), "{report}");
    assert_eq!(out.status.code(), Some(0));
    let head = report["events"].as_u64().unwrap();
    let mut next = 1;
    for (first, last) in delta_commit_ranges(&data.join("delta").join("events")) {
        assert_eq!(first, next, "Delta commits overlap or leave a gap");
        next = last + 1;
    }
    assert_eq!(next, head + 1, "Delta commits do not reach the head");
    // The JSON-lines transport holds every event at least once: its own run's, or (a
    // decision) its scoring batch's.
    let lines = std::fs::read_to_string(&jsonl).unwrap();
    let mut seqs = std::collections::BTreeSet::new();
    for line in lines.lines() {
        let facets = serde_json::from_str::<Value>(line).unwrap()["run"]["facets"].clone();
        seqs.insert(facets["aether_ledger"]["seq"].as_u64().unwrap());
        for decision in facets["aether_clearing_batch"]["decisions"]
            .as_array()
            .into_iter()
            .flatten()
        {
            seqs.insert(decision["seq"].as_u64().unwrap());
        }
    }
    assert_eq!(seqs.len() as u64, report["events"].as_u64().unwrap());
}

/// The seq range of each Delta commit, from the commit metadata in `_delta_log`.
fn delta_commit_ranges(table: &std::path::Path) -> Vec<(u64, u64)> {
    delta_commits_in_log(table)
        .into_iter()
        .map(|(_, first, last)| (first, last))
        .collect()
}

/// `(version, first seq, last seq)` of each Delta commit that names a seq range, from the
/// commit files in `_delta_log` (the version is the file's name).
fn delta_commits_in_log(table: &std::path::Path) -> Vec<(u64, u64, u64)> {
    let mut logs: Vec<_> = std::fs::read_dir(table.join("_delta_log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    logs.sort();
    let mut out = Vec::new();
    for log in logs {
        let version: u64 = log.file_stem().unwrap().to_str().unwrap().parse().unwrap();
        for line in std::fs::read_to_string(&log).unwrap().lines() {
            let action: Value = serde_json::from_str(line).unwrap();
            let info = &action["commitInfo"];
            if let (Some(a), Some(b)) = (
                info["aether.first_seq"].as_u64(),
                info["aether.last_seq"].as_u64(),
            ) {
                out.push((version, a, b));
            }
        }
    }
    out
}

/// Every `(Authorization header, body)` the receiver below was sent.
type Received = std::sync::Arc<std::sync::Mutex<Vec<(Option<String>, Value)>>>;

/// A minimal OpenLineage backend on 127.0.0.1: answers every request `201 Created` and
/// keeps what it was sent (HTTP/1.1 with Content-Length, as the transport sends).
async fn openlineage_receiver() -> (String, Received) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let received = Received::default();
    let store = received.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let store = store.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                loop {
                    let end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    let header = |name: &str| {
                        head.lines().find_map(|l| {
                            l.split_once(':')
                                .filter(|(k, _)| k.trim().eq_ignore_ascii_case(name))
                                .map(|(_, v)| v.trim().to_owned())
                        })
                    };
                    let len: usize = header("content-length")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    while buf.len() < end + len {
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body = serde_json::from_slice(&buf[end..end + len]).unwrap_or(Value::Null);
                    store.lock().unwrap().push((header("authorization"), body));
                    buf.drain(..end + len);
                    let reply = b"HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n";
                    if socket.write_all(reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openlineage_url_receives_every_event_with_the_api_key() {
    let (url, received) = openlineage_receiver().await;
    let seqs = |received: &Received| -> std::collections::BTreeSet<u64> {
        received
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(_, body)| body["run"]["facets"]["aether_ledger"]["seq"].as_u64())
            .collect()
    };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(
        &data,
        &[
            ("OPENLINEAGE_URL", url.as_str()),
            ("OPENLINEAGE_API_KEY", "e2e-openlineage-key"),
        ],
    );
    let mut last = 0;
    for n in 0..3 {
        last = append(&server, n).await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while !seqs(&received).contains(&last) {
        assert!(
            Instant::now() < deadline,
            "seq {last} never reached OPENLINEAGE_URL"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A graceful stop waits for the transport too, so the final checkpoint arrives as well.
    assert!(server.terminate().success());
    let out = run_aether(
        &[
            "lineage",
            "reconcile",
            "--data-dir",
            data.to_str().unwrap(),
            "--json",
        ],
        &[],
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["rejected_by_endpoint"], json!([]), "{report}");
    let head = report["events"].as_u64().unwrap();
    assert_eq!(seqs(&received), (1..=head).collect());
    for (authorization, body) in received.lock().unwrap().iter() {
        assert_eq!(
            authorization.as_deref(),
            Some("Bearer e2e-openlineage-key"),
            "{body}"
        );
        assert_eq!(body["job"]["namespace"], "aether");
    }
}

/// The JSON-lines file is a transport a user asks for: without `AETHER_OPENLINEAGE_FILE`
/// (or `--openlineage-file`) the records are stored and served, and no file grows beside
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_json_lines_file_is_written_unless_one_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let seq = append(&server, 1).await;
    let r = wait_for_record(&server, seq).await;
    assert_eq!(
        r["openlineage_event"]["run"]["facets"]["aether_ledger"]["seq"],
        seq
    );
    assert!(server.terminate().success());
    let mut written = Vec::new();
    let mut dirs = vec![dir.path().to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "jsonl") {
                written.push(path);
            }
        }
    }
    assert_eq!(written, Vec::<std::path::PathBuf>::new());
}

/// The nice value of each thread of process `pid`, with the thread's name (Linux).
#[cfg(target_os = "linux")]
fn thread_priorities(pid: u32) -> Vec<(String, i64)> {
    let mut threads = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let Ok(stat) = std::fs::read_to_string(entry.unwrap().path().join("stat")) else {
            continue; // the thread ended meanwhile
        };
        // `tid (name) state …`: the name may hold spaces, so split after its last ')';
        // nice is the 19th field, the 17th after the name.
        let (head, rest) = stat.rsplit_once(')').unwrap();
        let name = head.split_once('(').unwrap().1.to_string();
        let nice = rest.split_whitespace().nth(16).unwrap().parse().unwrap();
        threads.push((name, nice));
    }
    threads
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lineage_runs_below_the_answers_priority_and_still_keeps_up() {
    let dir = tempfile::tempdir().unwrap();
    for (setting, lower_by) in [(None, 10), (Some("0"), 0), (Some("4"), 4)] {
        let data = dir.path().join(format!("data-{lower_by}"));
        let env: Vec<(&str, &str)> = setting
            .map(|n| ("AETHER_BACKGROUND_NICE", n))
            .into_iter()
            .collect();
        let server = Server::start(&data, &env);
        // The relays and the follower work from their lower-priority threads.
        let seq = append(&server, 1).await;
        wait_for_record(&server, seq).await;
        let threads = thread_priorities(server.pid());
        let main = threads[0].1;
        let of = |prefix: &str| -> Vec<i64> {
            threads
                .iter()
                .filter(|(name, _)| name.starts_with(prefix))
                .map(|(_, nice)| *nice)
                .collect()
        };
        let background = of("aether-backgrou");
        let answers = of("tokio-r");
        assert!(!background.is_empty(), "no background threads: {threads:?}");
        assert!(!answers.is_empty(), "no runtime workers: {threads:?}");
        let expected = (main + lower_by).min(19);
        assert!(
            background.iter().all(|n| *n == expected),
            "background threads at {background:?}, expected {expected} ({setting:?})"
        );
        assert!(
            answers.iter().all(|n| *n == main),
            "the answers' threads moved: {answers:?}"
        );
        assert!(server.terminate().success());
    }
    // Out of range: refused with the range, before anything starts.
    let out = aether_e2e::run_serve(&dir.path().join("never"), &["--background-nice", "20"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("20 is not in 0..=19"), "{stderr}");
    assert!(!dir.path().join("never").exists());
}

//! The `aether bench` commands as a user runs them, made small: each must finish and count
//! what it did (the figures in BENCHMARKS.md come from these commands). No timing is
//! asserted, only that every phase ran, and ran what it was asked to.

use aether_e2e::run_aether;
use aether_ledger::testing::admin_url;
use serde_json::Value;

/// Runs `aether bench <args>` and returns its stdout, failing with its stderr.
fn bench(args: &[&str]) -> String {
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    let out = run_aether(&all, &[]);
    assert!(
        out.status.success(),
        "aether {}: {}\n{}",
        all.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 report")
}

fn line_starting<'a>(report: &'a str, prefix: &str) -> &'a str {
    report
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{report}"))
}

#[test]
fn ledger_bench_appends_what_it_offers_and_verifies_the_fill() {
    let url = admin_url();
    let report = bench(&[
        "ledger",
        "--database-url",
        &url,
        "--concurrency",
        "1,4",
        "--secs",
        "1",
        "--rate",
        "100",
        "--verify-events",
        "1500",
    ]);
    // One row per appender count, each having appended something.
    for n in ["| 1 |", "| 4 |"] {
        let row = line_starting(&report, n);
        let rate: u64 = row.split('|').nth(2).unwrap().trim().parse().unwrap();
        assert!(rate > 0, "{row}");
    }
    assert!(
        report.contains("baseline binary COPY of the same rows"),
        "PostgreSQL runs carry their baseline:\n{report}"
    );
    // The open loop appends exactly what it offers: rate × seconds.
    assert!(
        line_starting(&report, "open loop at 100 events/s offered:").contains(": 100 appended"),
        "{report}"
    );
    // The 1,500 filled events and the checkpoints signed over them (one at the end at
    // least; how many on the way depends on timing) all verified.
    let verify = line_starting(&report, "verify: ");
    let words: Vec<&str> = verify.split_whitespace().collect();
    let (events, checkpoints): (u64, u64) = (words[1].parse().unwrap(), words[4].parse().unwrap());
    assert!(checkpoints >= 1, "{verify}");
    assert_eq!(events, 1500 + checkpoints, "{verify}");
}

/// On the embedded default the ledger bench measures against raw SQLite: the same rows
/// inserted 500 a transaction with the ledger's durability, and the ratio.
#[test]
fn ledger_bench_on_sqlite_carries_its_sqlite_baseline() {
    let report = bench(&[
        "ledger",
        "--database-url",
        "sqlite:",
        "--concurrency",
        "1,4",
        "--secs",
        "1",
        "--rate",
        "0",
        "--verify-events",
        "0",
    ]);
    let baseline = line_starting(&report, "baseline SQLite INSERT of the same rows");
    let rows: f64 = baseline
        .rsplit(": ")
        .next()
        .and_then(|r| r.trim_end_matches(" rows/s").parse().ok())
        .unwrap();
    assert!(rows > 0.0, "{baseline}");
    let ratio = line_starting(&report, "ratio at 4 appenders: ");
    assert!(ratio.contains(&format!("/ {rows:.0} = ")), "{ratio}");
}

#[test]
fn audit_bench_proves_exports_and_replays_on_sqlite() {
    let report = bench(&[
        "audit",
        "--database-url",
        "sqlite:",
        "--events",
        "2000",
        "--export-events",
        "300",
        "--proofs",
        "50",
        "--control-rounds",
        "2",
        "--states",
        "5",
    ]);
    assert!(line_starting(&report, "Merkle log in memory: ").contains("leaves loaded"));
    assert!(
        line_starting(&report, "Merkle log with its file (as served): ").contains("opened again"),
        "{report}"
    );
    assert!(line_starting(&report, "inclusion proof at tree size ").contains("baseline"));
    assert!(
        line_starting(&report, "export of 300 events with proofs:").contains("offline verify"),
        "{report}"
    );
    assert!(
        line_starting(&report, "state as of a time (5 random points").contains("full replay"),
        "{report}"
    );
}

#[test]
fn lineage_bench_relays_the_whole_fill_and_measures_the_lag() {
    let report = bench(&[
        "lineage",
        "--database-url",
        "sqlite:",
        "--events",
        "3000",
        "--rate",
        "300",
        "--secs",
        "2",
    ]);
    line_starting(&report, "filled 3000 events in ");
    assert!(
        line_starting(&report, "relay throughput").contains(": 3000 events in"),
        "every filled event reaches Delta and the OpenLineage store:\n{report}"
    );
    assert!(line_starting(&report, "open the events table at 3000 events:").contains("median"));
    assert!(
        line_starting(
            &report,
            "lag at an offered 300 events/s for 2 s (600 events):"
        )
        .contains("p99"),
        "{report}"
    );
}

#[test]
fn clearing_bench_decides_every_request_on_the_postgres_ledger() {
    let url = admin_url();
    let stdout = bench(&[
        "clearing",
        "--database-url",
        &url,
        "--duration-secs",
        "1",
        "--warmup-secs",
        "1",
        "--concurrency",
        "8",
        "--nodes",
        "2",
        // The baseline's keys run out every 2 requests: the load client re-keys (a
        // handful of requests are enough however slow a busy machine makes the phase).
        "--durable-key-uses",
        "2",
        "--json",
    ]);
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!("--json prints one JSON object and nothing else ({e}):\n{stdout}")
    });
    assert_eq!(report["api"], "stream", "the default API: {report}");

    let gateway = &report["gateway"];
    let ok = gateway["ok"].as_u64().unwrap();
    assert!(ok > 0, "{gateway}");
    assert_eq!(gateway["errors"], serde_json::json!({}), "{gateway}");
    assert_eq!(gateway["shed"], 0);
    assert_eq!(gateway["replayed"], 0, "every request id is new");
    let decided: u64 = gateway["decisions"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(decided, ok, "one decision per answered request: {gateway}");
    // One slowest answer per measured second, each within the run's own maximum.
    let slowest: Vec<f64> = gateway["per_second_max_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ms| ms.as_f64().unwrap())
        .collect();
    assert_eq!(slowest.len(), 1, "{gateway}");
    let max_ms = gateway["max_ms"].as_f64().unwrap();
    assert!(
        slowest.iter().all(|&ms| ms > 0.0 && ms <= max_ms),
        "{gateway}"
    );
    assert_eq!(slowest.iter().copied().fold(0.0, f64::max), max_ms);
    // The warm-up's decisions and the measured ones are all on the ledger.
    assert!(gateway["max_receipt_seq"].as_u64().unwrap() >= ok);
    assert!(
        gateway["postgres_cpu_secs"].as_f64().is_some(),
        "PostgreSQL's backends are measured: {gateway}"
    );

    let echo = &report["echo"];
    assert!(echo["ok"].as_u64().unwrap() > 0, "{echo}");
    // The same trades sealed the same way; the mean differs by a byte at most, as request
    // ids and amounts are a digit longer in a phase that sends more of them.
    let same_size = |a: &Value, b: &Value| {
        a["request_bytes"]
            .as_u64()
            .unwrap()
            .abs_diff(b["request_bytes"].as_u64().unwrap())
            <= 1
    };
    assert!(same_size(echo, gateway), "same sizes: {echo} {gateway}");
    assert!(report["ratio_to_echo"].as_f64().unwrap() > 0.0);
    // The durable baseline: the same requests opened, appended by a group commit and
    // answered sealed with the seq they were committed at, on the same database.
    let durable = &report["durable"];
    let durable_ok = durable["ok"].as_u64().unwrap();
    // More requests than the 4 channels' first keys allow: keys were used up and replaced.
    assert!(
        durable_ok > 8,
        "several keys used up and replaced: {durable}"
    );
    assert_eq!(durable["errors"], serde_json::json!({}), "{durable}");
    assert!(
        same_size(durable, gateway),
        "same sizes: {durable} {gateway}"
    );
    assert!(durable["max_receipt_seq"].as_u64().unwrap() >= durable_ok);
    assert!(durable["postgres_cpu_secs"].as_f64().is_some(), "{durable}");
    assert!(report["ratio_to_durable"].as_f64().unwrap() > 0.0);
    // The server's memory around the gateway phase, read from /proc.
    let memory = &report["memory"];
    for when in ["idle_mib", "after_load_mib", "settled_mib"] {
        assert!(memory[when].as_f64().unwrap() > 1.0, "{memory}");
    }
    // Then the load over two nodes of one cluster: every request decided once, none lost
    // to the two writers' race for the chain.
    let two = &report["cluster"][0];
    assert_eq!(two["nodes"], 2, "{report}");
    let result = &two["result"];
    assert!(result["ok"].as_u64().unwrap() > 0, "{two}");
    assert_eq!(result["errors"], serde_json::json!({}), "{two}");
    let decided: u64 = result["decisions"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(decided, result["ok"].as_u64().unwrap(), "{two}");
    assert!(two["ratio_to_one_node"].as_f64().unwrap() > 0.0);
    assert_eq!(report["targets"].as_array().unwrap().len(), 5);
    assert!(
        report["lineage"]["caught_up_ms"].as_u64().is_some(),
        "lineage reached the head after the load: {}",
        report["lineage"]
    );
}

/// On the embedded default (no `--database-url`: SQLite) the durable baseline appends to
/// a SQLite file with the ledger's settings, and the report carries its ratio.
#[test]
fn clearing_bench_on_sqlite_measures_its_sqlite_durable_baseline() {
    let stdout = bench(&[
        "clearing",
        "--duration-secs",
        "1",
        "--warmup-secs",
        "1",
        "--concurrency",
        "8",
        "--json",
    ]);
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!("--json prints one JSON object and nothing else ({e}):\n{stdout}")
    });
    let durable = &report["durable"];
    assert!(durable["ok"].as_u64().unwrap() > 0, "{durable}");
    assert_eq!(durable["errors"], serde_json::json!({}), "{durable}");
    assert!(
        durable["max_receipt_seq"].as_u64().unwrap() >= durable["ok"].as_u64().unwrap(),
        "every answer names its committed seq: {durable}"
    );
    assert!(
        report["ratio_to_durable"].as_f64().unwrap() > 0.0,
        "{report}"
    );
}

#[test]
fn clearing_bench_refuses_a_bad_database_url_before_starting_anything() {
    let out = run_aether(
        &["bench", "clearing", "--database-url", "mysql://localhost/x"],
        &[],
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--database-url must be postgres://… or sqlite:"),
        "{stderr}"
    );
}

#[test]
fn failover_bench_kills_the_holder_and_times_each_takeover() {
    let url = admin_url();
    let report = bench(&[
        "failover",
        "--database-url",
        &url,
        "--kills",
        "2",
        "--lease-ttl-ms",
        "600",
        "--policies",
        "2",
    ]);
    // Both nodes took the duty in turn.
    assert!(
        report.contains("kill 1: node-b took the checkpointer after"),
        "{report}"
    );
    assert!(
        report.contains("kill 2: node-a took the checkpointer after"),
        "{report}"
    );
    let summary = line_starting(&report, "checkpointer failover after SIGKILL");
    assert!(summary.contains("2 kills: p50 "), "{summary}");
    let policies = line_starting(&report, "policy propagation to the other node");
    assert!(policies.contains("2 ingests: p50 "), "{policies}");
}

//! `aether audit export`: a regulator exports an evidence bundle from the running service
//! with the CLI and verifies it offline; refusals are reported with the service's reason.

use std::time::{Duration, Instant};

use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http, run_aether};
use aether_ledger::checkpoint::PUBLIC_KEY_FILE;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_exports_a_bundle_that_verifies_offline() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[("AETHER_CHECKPOINT_EVERY_EVENTS", "4")]);
    for n in 0..9u64 {
        let resp = http()
            .post(server.url("/v1/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(
                &json!({"stream_id": "trades/m-3", "events": [{"event_type": "TradeBooked",
                   "payload": {"n": n}, "metadata": {"member": "m-3"}}]}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
    }
    let bundle = dir.path().join("evidence.json");
    let export = |token: &str, filter: &str| {
        run_aether(
            &[
                "audit",
                "export",
                "--url",
                &server.base_url,
                "--filter",
                filter,
                "-o",
                bundle.to_str().unwrap(),
            ],
            &[("AETHER_TOKEN", token)],
        )
    };

    // Until a checkpoint covers the appends the service says why; then the export lands.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = export(REGULATOR_TOKEN, "member=m-3");
        if out.status.success() {
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(stdout.contains("wrote the evidence bundle"), "{stdout}");
            break;
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("checkpoint"), "{stderr}");
        assert!(Instant::now() < deadline, "no checkpoint within 20 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!dir.path().join("evidence.json.part").exists());

    let key = data.join("keys").join(PUBLIC_KEY_FILE);
    let out = run_aether(
        &[
            "audit",
            "verify",
            bundle.to_str().unwrap(),
            "--public-key",
            key.to_str().unwrap(),
            "--json",
        ],
        &[],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let verdict: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(verdict["ok"], true);
    assert!(
        verdict["events_checked"].as_u64().unwrap() >= 4,
        "{verdict}"
    );

    // Refusals carry the service's reason; the earlier bundle is left as it was.
    let before = std::fs::read(&bundle).unwrap();
    for (token, filter, reason) in [
        (OPERATOR_TOKEN, "member=m-3", "403"),
        (REGULATOR_TOKEN, "colour=blue", "unknown filter"),
        (REGULATOR_TOKEN, "member", "KEY=VALUE"),
    ] {
        let out = export(token, filter);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{filter}");
        assert!(stderr.contains(reason), "{filter}: {stderr}");
    }
    assert_eq!(std::fs::read(&bundle).unwrap(), before);
    assert!(server.terminate().success());
}

/// `aether audit verify`'s exit status says what happened, as its `--help` documents: a
/// file that is not a well-formed bundle is an invalid bundle (2), a file that cannot be
/// read is an error (1).
#[test]
fn audit_verify_exit_statuses_are_the_documented_ones() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "not-json.json",
            Some("{not json"),
            2,
            "not a well-formed bundle",
        ),
        (
            "other-format.json",
            Some(r#"{"format": "something-else"}"#),
            2,
            "not a well-formed bundle",
        ),
        ("missing.json", None, 1, "cannot read the bundle"),
    ];
    for (name, content, code, says) in cases {
        let path = dir.path().join(name);
        if let Some(content) = content {
            std::fs::write(&path, content).unwrap();
        }
        let out = run_aether(&["audit", "verify", path.to_str().unwrap()], &[]);
        assert_eq!(out.status.code(), Some(code), "{name}");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(said.contains(says), "{name}: {said}");
    }
    let help = run_aether(&["audit", "verify", "--help"], &[]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("1: the bundle or key file could not be read"),
        "{help}"
    );
}

/// An export of several pages is streamed as it is built (no `Content-Length`, a page of
/// events at a time) and is still one bundle that verifies offline, with every event the
/// filter selects; once downloaded, the regulator's one export place is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_export_is_streamed_and_verifies_whole() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[("AETHER_CHECKPOINT_EVERY_EVENTS", "500")]);
    const EVENTS: u64 = 2_600;
    for batch in 0..(EVENTS / 200) {
        let events: Vec<_> = (0..200)
            .map(|i| {
                json!({"event_type": "TradeBooked", "payload": {"n": batch * 200 + i},
                       "metadata": {"member": "m-bulk"}})
            })
            .collect();
        let resp = http()
            .post(server.url("/v1/events"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&json!({"stream_id": "trades/m-bulk", "events": events}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
    }
    let filter = json!({"member": "m-bulk", "limit": 100_000});
    let deadline = Instant::now() + Duration::from_secs(30);
    let (resp, anchor) = loop {
        let body: serde_json::Value = http()
            .get(server.url("/v1/audit/checkpoints"))
            .bearer_auth(REGULATOR_TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let anchor = body["checkpoints"]
            .as_array()
            .and_then(|c| c.last())
            .and_then(|c| c["checkpoint"]["tree_size"].as_u64())
            .unwrap_or(0);
        if anchor >= EVENTS {
            let resp = http()
                .post(server.url("/v1/audit/exports"))
                .bearer_auth(REGULATOR_TOKEN)
                .json(&filter)
                .send()
                .await
                .unwrap();
            break (resp, anchor);
        }
        assert!(Instant::now() < deadline, "no checkpoint covers the events");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.content_length(), None, "{:?}", resp.headers());
    assert_eq!(resp.headers()["transfer-encoding"], "chunked");
    let bytes = resp.bytes().await.unwrap();
    let bundle: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let seqs: Vec<u64> = bundle["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs.len() as u64, EVENTS.min(anchor));
    assert!(seqs.windows(2).all(|w| w[0] < w[1]));
    let file = dir.path().join("bulk.json");
    std::fs::write(&file, &bytes).unwrap();
    let out = aether_e2e::audit_verify(&file, &data.join("keys").join(PUBLIC_KEY_FILE));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Once the download ended the place is free again.
    let again = http()
        .post(server.url("/v1/audit/exports"))
        .bearer_auth(REGULATOR_TOKEN)
        .json(&json!({"member": "m-bulk", "limit": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    assert!(server.terminate().success());
}

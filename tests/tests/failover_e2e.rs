//! The ledger on a PostgreSQL primary with a synchronous standby, named by a multi-host URL:
//! the primary is killed under load, the standby promoted, and the same `aether serve`
//! process goes on appending to the new primary without a restart. Nothing it acknowledged
//! is lost, and the promoted ledger verifies.
//!
//! Both servers are real clusters made here with `initdb` and `pg_basebackup` (as the
//! `postgres` user when the tests run as root), on free local ports.

use std::time::{Duration, Instant};

use aether_e2e::postgres_pair::{Pair, wait_for_sync};
use aether_e2e::{OPERATOR_TOKEN, Server, http, run_aether};
use serde_json::json;

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

/// How many events of streams `replica/` a regulator's page shows.
async fn replica_page(server: &Server) -> usize {
    aether_e2e::clearing::get(server, "/v1/audit/events?stream_prefix=replica/").await["events"]
        .as_array()
        .unwrap()
        .len()
}

/// Regulators' reads go to the streaming replica (`--read-database-url`): a plain page shows
/// what the replica has replayed, and an export with proofs never pairs a tree size with
/// events the replica has not reached (it reads those from the primary); the bundle verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regulators_read_from_the_replica_and_proofs_never_outrun_it() {
    use aether_e2e::REGULATOR_TOKEN;
    let pair = Pair::start();
    let primary = pair.url_of(pair.primary_port);
    let replica = pair.url_of(pair.standby_port);
    wait_for_sync(&primary).await;
    let data = tempfile::tempdir().unwrap();
    let server = Server::start(
        data.path(),
        &[
            ("DATABASE_URL", primary.as_str()),
            ("AETHER_READ_DATABASE_URL", replica.as_str()),
            ("AETHER_CHECKPOINT_EVERY_SECS", "1"),
        ],
    );
    for n in 0..5 {
        assert!(append(&server, &format!("replica/a{n}")).await);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while replica_page(&server).await < 5 {
        assert!(
            Instant::now() < deadline,
            "the replica never showed the events"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The replica stops replaying: a plain page is what it has (so it is read there) ...
    let mut standby = <sqlx::PgConnection as sqlx::Connection>::connect(&replica)
        .await
        .unwrap();
    sqlx::query("SELECT pg_wal_replay_pause()")
        .execute(&mut standby)
        .await
        .unwrap();
    assert!(append(&server, "replica/b").await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        replica_page(&server).await,
        5,
        "the page was not read from the replica"
    );

    // ... but an export anchored at a checkpoint past the replica's head holds every event
    // up to it, read from the primary, and verifies offline.
    let deadline = Instant::now() + Duration::from_secs(20);
    let bundle = loop {
        let resp = http()
            .post(server.url("/v1/audit/exports"))
            .bearer_auth(REGULATOR_TOKEN)
            .json(&json!({"stream_prefix": "replica/"}))
            .send()
            .await
            .unwrap();
        let status = resp.status();
        let bundle: serde_json::Value = resp.json().await.unwrap();
        // 409: no checkpoint signed yet.
        assert!(status == 200 || status == 409, "{bundle}");
        if status == 200 && bundle["events"].as_array().unwrap().len() == 6 {
            break bundle;
        }
        assert!(
            Instant::now() < deadline,
            "no checkpoint came to cover the new event"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let path = data.path().join("bundle.json");
    std::fs::write(&path, serde_json::to_vec(&bundle).unwrap()).unwrap();
    let public = data
        .path()
        .join("keys")
        .join(aether_ledger::checkpoint::PUBLIC_KEY_FILE);
    let out = aether_e2e::audit_verify(&path, &public);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        aether_e2e::metrics(&server)
            .await
            .contains("aether_audit_replica_behind_total"),
        "the export did not go to the primary"
    );

    // Replaying again, the replica serves the page whole.
    sqlx::query("SELECT pg_wal_replay_resume()")
        .execute(&mut standby)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while replica_page(&server).await < 6 {
        assert!(Instant::now() < deadline, "the replica never caught up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(server.terminate().success());
}

//! End-to-end: the console's server side on a running `aether serve`. A person signs in
//! once with a token and gets an HttpOnly, SameSite=Strict cookie; the cookie reads the
//! API, but writes only with the session's CSRF token; a regulator's sign-in, page views
//! and sign-out are on `access/audit`; signing out makes the cookie worthless; a worker
//! token opens no session. The search finds jobs, datasets, event types, runs and a
//! request id; `/ui` serves the embedded page under a strict content security policy.
//! (The page itself is tested in Chromium by `console/web/e2e`.)

use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http};
use serde_json::{Value, json};

const WORKER_TOKEN: &str = "e2e-worker-token-0123456789";

struct Session {
    cookie: String,
    csrf: String,
    body: Value,
}

async fn sign_in(server: &Server, token: &str) -> Session {
    let resp = http()
        .post(server.url("/v1/session"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let set_cookie = resp.headers()["set-cookie"].to_str().unwrap().to_owned();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=28800"] {
        assert!(set_cookie.contains(attribute), "{set_cookie}");
    }
    assert_eq!(resp.headers()["cache-control"], "no-store");
    let cookie = set_cookie.split(';').next().unwrap().to_owned();
    assert!(cookie.starts_with("aether_session="));
    let body: Value = resp.json().await.unwrap();
    assert!(!cookie.contains(token) && !body.to_string().contains(token));
    Session {
        cookie,
        csrf: body["csrf_token"].as_str().unwrap().to_owned(),
        body,
    }
}

async fn get(server: &Server, path: &str, cookie: &str) -> (u16, Value) {
    let resp = http()
        .get(server.url(path))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn post(
    server: &Server,
    path: &str,
    cookie: &str,
    csrf: Option<&str>,
    body: &Value,
) -> (u16, Value) {
    let mut req = http()
        .post(server.url(path))
        .header("cookie", cookie)
        .json(body);
    if let Some(token) = csrf {
        req = req.header("x-csrf-token", token);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// The `access/audit` records of `actor`, read with the regulator's bearer token.
async fn access_records(server: &Server, actor: &str) -> Vec<Value> {
    let page: Value = http()
        .get(server.url("/v1/audit/events"))
        .query(&[
            ("stream_prefix", "access/audit"),
            ("actor", actor),
            ("limit", "1000"),
        ])
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    page["events"].as_array().unwrap().clone()
}

fn queries(records: &[Value]) -> Vec<String> {
    records
        .iter()
        .map(|e| {
            e["payload"]["query"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_session_reads_writes_with_csrf_is_recorded_and_ends() {
    let dir = tempfile::tempdir().unwrap();
    let tokens =
        format!("operator:{OPERATOR_TOKEN},regulator:{REGULATOR_TOKEN},worker:{WORKER_TOKEN}");
    let server = Server::start(&dir.path().join("data"), &[("AETHER_TOKENS", &tokens)]);

    // A worker token opens no session; a cookie alone opens none either.
    let resp = http()
        .post(server.url("/v1/session"))
        .bearer_auth(WORKER_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let (status, problem) =
        post(&server, "/v1/session", "aether_session=x", None, &json!({})).await;
    assert_eq!(status, 401, "{problem}");
    let (status, _) = get(&server, "/v1/session", "aether_session=forged").await;
    assert_eq!(status, 401);

    // With a bearer token, `GET /v1/session` says who the token is (no session, no CSRF
    // token), and there is no session to end.
    let who: Value = http()
        .get(server.url("/v1/session"))
        .bearer_auth(REGULATOR_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(who["role"], "regulator");
    assert!(who.get("csrf_token").is_none(), "{who}");

    // The regulator signs in; the cookie reads what the token reads.
    let regulator = sign_in(&server, REGULATOR_TOKEN).await;
    assert_eq!(regulator.body["role"], "regulator");
    let actor = regulator.body["actor"].as_str().unwrap().to_owned();
    let (status, shown) = get(&server, "/v1/session", &regulator.cookie).await;
    assert_eq!(status, 200);
    assert_eq!(shown["csrf_token"], regulator.csrf.as_str());
    let (status, checkpoints) = get(&server, "/v1/audit/checkpoints", &regulator.cookie).await;
    assert_eq!(status, 200);
    // The cadence, so that the console can tell a late checkpoint from one not yet due.
    assert!(
        checkpoints["cadence"]["every_secs"].as_u64().unwrap() >= 1,
        "{checkpoints}"
    );
    let (status, _) = get(&server, "/api/v1/namespaces", &regulator.cookie).await;
    assert_eq!(status, 200);
    // ... and may not do what the role may not.
    let (status, _) = post(
        &server,
        "/v1/snapshots",
        &regulator.cookie,
        Some(&regulator.csrf),
        &json!({}),
    )
    .await;
    assert_eq!(status, 403);

    // Page views: refused without the CSRF token, recorded with it.
    let view = json!({ "path": "/ui/lineage?node=job:aether:policy.ingest" });
    let (status, problem) =
        post(&server, "/v1/session/views", &regulator.cookie, None, &view).await;
    assert_eq!(status, 403, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("X-CSRF-Token"));
    let (status, _) = post(
        &server,
        "/v1/session/views",
        &regulator.cookie,
        Some("0".repeat(64).as_str()),
        &view,
    )
    .await;
    assert_eq!(status, 403, "a wrong CSRF token is refused");
    let (status, _) = post(
        &server,
        "/v1/session/views",
        &regulator.cookie,
        Some(&regulator.csrf),
        &view,
    )
    .await;
    assert_eq!(status, 204);
    let (status, _) = post(
        &server,
        "/v1/session/views",
        &regulator.cookie,
        Some(&regulator.csrf),
        &json!({ "path": "https://elsewhere.test/" }),
    )
    .await;
    assert_eq!(status, 422);
    let records = access_records(&server, &actor).await;
    let seen = queries(&records);
    assert!(seen.contains(&"session.open".to_owned()), "{seen:?}");
    let views: Vec<&Value> = records
        .iter()
        .filter(|e| e["payload"]["query"] == "page_view")
        .collect();
    assert_eq!(
        views.len(),
        1,
        "one view recorded, none of the refused ones"
    );
    assert_eq!(views[0]["payload"]["details"]["path"], view["path"]);

    // The operator's cookie writes only with its CSRF token, and nothing is written
    // without it.
    let operator = sign_in(&server, OPERATOR_TOKEN).await;
    let (status, _) = post(&server, "/v1/snapshots", &operator.cookie, None, &json!({})).await;
    assert_eq!(status, 403);
    let snapshots = |cookie: String| {
        let server = &server;
        async move { get(server, "/v1/snapshots", &cookie).await.1 }
    };
    let before = snapshots(operator.cookie.clone()).await;
    let (status, taken) = post(
        &server,
        "/v1/snapshots",
        &operator.cookie,
        Some(&operator.csrf),
        &json!({}),
    )
    .await;
    assert_eq!(status, 201, "{taken}");
    let after = snapshots(operator.cookie.clone()).await;
    let count = |v: &Value| v["snapshots"].as_array().map_or(0, Vec::len);
    assert_eq!(count(&after), count(&before) + 1, "{before} / {after}");
    // The bearer token still works as before, without any CSRF token.
    let resp = http()
        .post(server.url("/v1/snapshots"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);

    // Sign-out needs the CSRF token; afterwards the cookie is refused everywhere.
    let resp = http()
        .delete(server.url("/v1/session"))
        .header("cookie", &regulator.cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let resp = http()
        .delete(server.url("/v1/session"))
        .header("cookie", &regulator.cookie)
        .header("x-csrf-token", &regulator.csrf)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 204);
    assert!(
        resp.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
    for path in ["/v1/session", "/v1/audit/checkpoints", "/api/v1/namespaces"] {
        let (status, problem) = get(&server, path, &regulator.cookie).await;
        assert_eq!(status, 401, "{path}: {problem}");
    }
    let seen = queries(&access_records(&server, &actor).await);
    assert!(seen.contains(&"session.close".to_owned()), "{seen:?}");
    // The operator's session is untouched by the regulator's sign-out.
    let (status, _) = get(&server, "/v1/session", &operator.cookie).await;
    assert_eq!(status, 200);
    assert!(server.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn search_finds_nodes_event_types_and_runs_and_the_page_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data"), &[]);
    aether_e2e::clearing::ingest_aml_v2(&server).await;

    let search = |query: Vec<(&'static str, String)>| {
        let server = &server;
        async move {
            let resp = http()
                .get(server.url("/api/v1/search"))
                .query(&query)
                .bearer_auth(REGULATOR_TOKEN)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    // The lineage relay follows the ledger: wait for the policy job.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let found = loop {
        let (status, body) = search(vec![("q", "POLICY".into())]).await;
        assert_eq!(status, 200, "{body}");
        if body["results"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["type"] == "JOB")
        {
            break body;
        }
        assert!(std::time::Instant::now() < deadline, "no job found: {body}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let results = found["results"].as_array().unwrap();
    let job = results.iter().find(|r| r["type"] == "JOB").unwrap();
    assert_eq!(job["name"], "policy.ingest");
    assert_eq!(job["nodeId"], "job:aether:policy.ingest");
    assert!(
        results
            .iter()
            .any(|r| r["type"] == "EVENT_TYPE" && r["name"] == "PolicyIngested"),
        "{found}"
    );
    let (_, datasets) = search(vec![("q", "aml_v2".into()), ("filter", "DATASET".into())]).await;
    let datasets = datasets["results"].as_array().unwrap();
    assert!(!datasets.is_empty());
    assert!(datasets.iter().all(|r| r["type"] == "DATASET"));
    let (_, none) = search(vec![("q", "no-such-thing-anywhere".into())]).await;
    assert_eq!(none["totalCount"], 0);
    let (_, limited) = search(vec![("q", "e".into()), ("limit", "1".into())]).await;
    assert_eq!(limited["results"].as_array().unwrap().len(), 1);
    assert!(limited["totalCount"].as_u64().unwrap() > 1);

    // A run by its id: the policy job's latest run.
    let (_, job_list) = (
        0,
        http()
            .get(server.url("/api/v1/namespaces/aether/jobs"))
            .bearer_auth(REGULATOR_TOKEN)
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap(),
    );
    let run_id = job_list["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["name"] == "policy.ingest")
        .and_then(|j| j["latestRun"]["id"].as_str())
        .expect("the policy job's latest run")
        .to_owned();
    let (_, runs) = search(vec![("q", run_id.clone()), ("filter", "RUN".into())]).await;
    assert_eq!(runs["results"][0]["type"], "RUN", "{runs}");
    assert_eq!(runs["results"][0]["nodeId"], "job:aether:policy.ingest");

    // The job's page: the job itself and its runs, each naming the ledger events behind it.
    let read = |path: String| {
        let server = &server;
        async move {
            let resp = http()
                .get(server.url(&path))
                .bearer_auth(REGULATOR_TOKEN)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let (status, job) = read("/api/v1/namespaces/aether/jobs/policy.ingest".into()).await;
    assert_eq!(status, 200, "{job}");
    assert_eq!(job["name"], "policy.ingest");
    let (status, runs) = read("/api/v1/namespaces/aether/jobs/policy.ingest/runs".into()).await;
    assert_eq!(status, 200, "{runs}");
    let first = &runs["runs"][0];
    assert_eq!(first["id"], run_id.as_str(), "{runs}");
    assert!(
        first["facets"]["aether_ledger"]["seq"].as_u64().is_some(),
        "{first}"
    );
    for missing in [
        "/api/v1/namespaces/aether/jobs/no.such.job",
        "/api/v1/namespaces/aether/widgets/x",
    ] {
        let (status, _) = read(missing.into()).await;
        assert_eq!(status, 404, "{missing}");
    }
    let (_, none) = read("/api/v1/namespaces/aether/jobs/no.such.job/runs".into()).await;
    assert_eq!(none["runs"], json!([]));

    for (query, why) in [
        (vec![("q", String::new())], "empty q"),
        (
            vec![("q", "x".into()), ("filter", "TABLE".into())],
            "unknown filter",
        ),
        (
            vec![("q", "x".into()), ("sort", "SIZE".into())],
            "unknown sort",
        ),
        (
            vec![("q", "x".into()), ("limit", "101".into())],
            "limit too large",
        ),
        (
            vec![("q", "x".into()), ("page", "2".into())],
            "unknown parameter",
        ),
    ] {
        let (status, body) = search(query).await;
        assert_eq!(status, 400, "{why}: {body}");
        assert!(body["detail"].is_string());
    }
    let resp = http()
        .get(server.url("/api/v1/search?q=policy"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);

    // The page: any console route loads it, under a strict content security policy; a
    // missing asset is a 404 problem, not the page.
    let mut scripts = Vec::new();
    for path in ["/ui", "/ui/", "/ui/lineage", "/ui/decisions/req.with.dots"] {
        let resp = http().get(server.url(path)).send().await.unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        let csp = resp.headers()["content-security-policy"]
            .to_str()
            .unwrap()
            .to_owned();
        assert!(csp.contains("default-src 'self'") && csp.contains("frame-ancestors 'none'"));
        assert_eq!(resp.headers()["cache-control"], "no-cache");
        let page = resp.text().await.unwrap();
        assert!(page.contains("<html"), "{path}");
        for src in page.split("src=\"").skip(1) {
            assert!(
                src.starts_with("/ui/"),
                "{path} loads a script from elsewhere: {src}"
            );
            scripts.push(src.split('"').next().unwrap().to_owned());
        }
    }
    // The built scripts are kept for good by browsers and sent compressed.
    for script in scripts.iter().filter(|s| s.ends_with(".js")) {
        let plain = http().get(server.url(script)).send().await.unwrap();
        assert_eq!(plain.status(), 200, "{script}");
        assert_eq!(
            plain.headers()["cache-control"],
            "public, max-age=31536000, immutable"
        );
        let size = plain.bytes().await.unwrap().len();
        let zipped = http()
            .get(server.url(script))
            .header("accept-encoding", "gzip, br")
            .send()
            .await
            .unwrap();
        assert_eq!(zipped.headers()["content-encoding"], "gzip", "{script}");
        assert!(zipped.bytes().await.unwrap().len() < size);
    }
    let resp = http()
        .get(server.url("/ui/assets/missing.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    assert!(server.terminate().success());
}

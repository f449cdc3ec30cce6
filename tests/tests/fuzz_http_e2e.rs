//! The HTTP API against arbitrary input (issue 43's standing fuzz suite, the HTTP part):
//! every operation of the OpenAPI document, called by a role it admits, with path
//! parameters, query strings and JSON bodies drawn at random from the shapes that broke
//! services before (NUL, lone surrogates escaped, numbers past 2^53 and 2^64, deep nesting,
//! huge strings, wrong types). No answer may be a 5xx, every refusal is
//! `application/problem+json`, and the ledger still verifies afterwards.
//!
//! Inputs are drawn from a seeded generator (`aether_e2e::draw`) against the whole server;
//! the body decoders themselves are also fuzzed coverage-guided (`fuzz/`, `append_body`,
//! `openlineage`, `policy`). `AETHER_FUZZ_SEED` and `AETHER_FUZZ_CASES` change the draw
//! (the long suite runs more cases).

use aether_e2e::draw::Draw;
use aether_e2e::{OPERATOR_TOKEN, REGULATOR_TOKEN, Server, http};
use serde_json::Value;

/// `s` fit for a URL: percent-encoded, and cut to 2,000 bytes first (a URL past 64 KiB is
/// refused by the client before it is sent).
fn percent_encode(s: &str) -> String {
    let cut = s.len().min(2_000);
    let cut = (0..=cut)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0);
    s[..cut]
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_input_on_every_operation_never_gets_a_5xx() {
    let (seed, cases) = aether_e2e::draw::seed_and_cases(8);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    let doc: Value = aether_e2e::openapi_document(&server).await;
    let mut draw = Draw(seed | 1);
    let mut calls = 0;
    let mut failures = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, operation) in item.as_object().unwrap() {
            let description = operation["description"].as_str().unwrap_or_default();
            let token = if description.contains("Role: regulator") {
                REGULATOR_TOKEN
            } else {
                OPERATOR_TOKEN
            };
            let params: Vec<(String, String)> = operation["parameters"]
                .as_array()
                .map(|ps| {
                    ps.iter()
                        .filter_map(|p| {
                            Some((p["name"].as_str()?.to_owned(), p["in"].as_str()?.to_owned()))
                        })
                        .collect()
                })
                .unwrap_or_default();
            for case in 0..cases {
                let concrete: String = path
                    .split('/')
                    .map(|part| {
                        if part.starts_with('{') {
                            percent_encode(&draw.text())
                        } else {
                            part.to_owned()
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("/");
                let mut query = Vec::new();
                for (name, place) in &params {
                    if place == "query" && draw.below(2) == 1 {
                        query.push(format!("{name}={}", percent_encode(&draw.text())));
                    }
                }
                if draw.below(4) == 0 {
                    query.push("unknown=1".to_owned());
                }
                let url = if query.is_empty() {
                    server.url(&concrete)
                } else {
                    server.url(&format!("{concrete}?{}", query.join("&")))
                };
                let request = match method.as_str() {
                    "get" => http().get(&url),
                    "delete" => http().delete(&url),
                    "put" => http().put(&url),
                    _ => http().post(&url),
                };
                let request = if method == "get" {
                    request
                } else {
                    request
                        .header("content-type", "application/json")
                        .body(draw.body())
                };
                let response = request.bearer_auth(token).send().await.unwrap();
                calls += 1;
                let status = response.status().as_u16();
                let content_type = response
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                if status >= 500 {
                    let body = response.text().await.unwrap_or_default();
                    failures.push(format!(
                        "{} {} (case {case}): {status} {}",
                        method.to_uppercase(),
                        url.chars().take(200).collect::<String>(),
                        body.chars().take(300).collect::<String>()
                    ));
                } else if status >= 400 && !content_type.starts_with("application/problem+json") {
                    failures.push(format!(
                        "{} {} (case {case}): {status} as {content_type:?}, not problem+json",
                        method.to_uppercase(),
                        url.chars().take(200).collect::<String>()
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "seed {seed}: {} of {calls} calls failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(calls >= 40 * cases, "{calls} calls");
    assert!(server.terminate().success());
    // Whatever was accepted, the ledger's proof holds.
    let out = aether_e2e::run_aether(&["verify", "--data-dir", data.to_str().unwrap()], &[]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

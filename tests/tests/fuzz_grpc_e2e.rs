//! The clearing API over gRPC against arbitrary requests (issue 43's standing fuzz suite,
//! the gRPC part): a member sends trades whose every field, request id and colouring is
//! drawn from the shapes that broke services before, sealed as a real client seals them,
//! over real mTLS to a real `aether serve`, while another member clears valid trades.
//! Every refusal must be a precise status (INVALID_ARGUMENT, or ALREADY_EXISTS for a
//! request id drawn twice) with a message; the other member's trades all decided; one
//! decision on the ledger for each accepted request; the ledger verifies afterwards.
//! `AETHER_FUZZ_SEED` and `AETHER_FUZZ_CASES` change the draw (the long suite runs more).

use aether_e2e::clearing::{activate, client, decisions, trade};
use aether_e2e::draw::{Draw, seed_and_cases};
use aether_e2e::{Server, run_aether};
use aether_gateway::client::ClientError;
use aether_gateway::pb::v1::ClearingRequest;
use tonic::Code;

/// A valid trade with up to two of its fields (or its colouring) replaced by something
/// drawn to break it: a third of the draws stay valid, so both outcomes are reached and the
/// checks past the first are too.
fn arbitrary_request(draw: &mut Draw) -> ClearingRequest {
    let mut request = trade(1 + draw.below(1_000_000) as i64);
    let mut trade = request.trade.take().unwrap_or_default();
    trade.buyer = draw.pick(&["bank-a", "fund-7"]).to_owned();
    trade.seller = draw.pick(&["bank-b", "broker-9"]).to_owned();
    for _ in 0..draw.below(3) {
        match draw.below(14) {
            0 => trade.buyer = draw.text(),
            1 => trade.seller = draw.text(),
            2 => trade.instrument = draw.text(),
            3 => trade.currency = draw.pick(&["usd", "EURO", "", "S\u{0}D"]).to_owned(),
            4 => {
                trade.amount_minor = *[0, -1, i64::MIN, i64::MAX, draw.next_u64() as i64]
                    .get(draw.below(5) as usize)
                    .unwrap_or(&0)
            }
            5 => trade.value_date = draw.text(),
            6 => {
                trade.value_date = draw
                    .pick(&["2026-02-30", "2026-1-2", "+2026-12-02", "20261202"])
                    .to_owned()
            }
            7 => trade.jurisdiction = draw.pick(&["ZZ", "sg", "", "SGP"]).to_owned(),
            8 => trade.counterparty_tier = draw.next_u64() as u32,
            9 => request.trace_id = draw.text(),
            10 => request.model_stage = draw.text(),
            11 => request.semantic_tag = draw.text(),
            12 => request.traceparent = draw.text(),
            _ => return request, // no trade at all
        }
    }
    request.trade = Some(trade);
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arbitrary_clearing_requests_are_refused_precisely_and_hurt_no_other_member() {
    let (seed, cases) = seed_and_cases(60);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let server = Server::start(&data, &[]);
    activate(&server).await;
    let mut fuzzer = client(&server, &data, "bank-a").await;
    fuzzer.key_exchange().await.unwrap();
    let mut honest = client(&server, &data, "bank-b").await;
    honest.key_exchange().await.unwrap();

    // The other member clears valid trades all the while.
    let honest_trades = tokio::spawn(async move {
        let mut refused = Vec::new();
        for i in 0..cases {
            if let Err(e) = honest
                .submit(&format!("honest-{i}"), &trade(1_000 + i as i64))
                .await
            {
                refused.push(format!("honest-{i}: {e}"));
            }
        }
        refused
    });

    let mut draw = Draw(seed | 1);
    let mut accepted = std::collections::BTreeSet::new();
    let mut failures = Vec::new();
    for case in 0..cases {
        let request_id = if draw.below(4) == 0 {
            draw.text()
        } else {
            format!("fuzz-{case}")
        };
        let request = arbitrary_request(&mut draw);
        match fuzzer.submit(&request_id, &request).await {
            Ok(answer) => {
                if !accepted.insert(request_id.clone()) {
                    failures.push(format!(
                        "case {case}: request id {request_id:?} decided twice ({answer:?})"
                    ));
                }
            }
            Err(ClientError::Status { code, message })
                if matches!(code, Code::InvalidArgument | Code::AlreadyExists)
                    && !message.is_empty()
                    && message.len() <= aether_gateway::service::MAX_STATUS_MESSAGE => {}
            // The client refuses to seal what the envelope cannot carry (an AAD field over
            // its limit): nothing is sent.
            Err(ClientError::Envelope(_)) => {}
            Err(other) => failures.push(format!(
                "case {case}: {} as {:?}: {}",
                format!("{request:?}").chars().take(600).collect::<String>(),
                request_id.chars().take(80).collect::<String>(),
                other.to_string().chars().take(600).collect::<String>()
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "seed {seed}: {} of {cases} requests failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let honest_refused = honest_trades.await.unwrap();
    assert!(
        honest_refused.is_empty(),
        "the other member was refused: {honest_refused:?}"
    );
    assert!(
        !accepted.is_empty() && accepted.len() < cases as usize,
        "seed {seed}: {} of {cases} accepted; the draw must reach both outcomes",
        accepted.len()
    );

    // One decision for each accepted request, none for a refused one.
    let recorded = decisions(&server).await;
    let fuzzed: std::collections::BTreeSet<String> = recorded
        .iter()
        .filter(|e| e["stream_id"] == "clearing/bank-a")
        .map(|e| e["metadata"]["request_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(fuzzed, accepted);
    assert_eq!(recorded.len() as u64, accepted.len() as u64 + cases);

    assert!(server.terminate().success());
    let out = run_aether(&["verify", "--data-dir", data.to_str().unwrap()], &[]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

//! Personal data in clearing decisions: the parties' identifiers are recorded as salted
//! commitments, a regulator's explanation shows them per the redaction policy, and an
//! erasure marks them redacted while the ledger still verifies.

use aether_e2e::Server;
use aether_e2e::clearing::{activate, client, get, post, trade};
use serde_json::{Value, json};

/// The commitment the hashed payload holds for a personal trade field.
fn commitment(event: &Value, field: &str) -> String {
    event["payload"]["trade"][field]["$personal"]
        .as_str()
        .unwrap_or_else(|| panic!("trade.{field} is not a personal placeholder: {event}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_shows_its_parties_per_policy_and_an_erasure_marks_them_redacted() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // The operator reveals the buyer to regulators, not the seller.
    let server = Server::start(&data, &[("AETHER_AUDIT_REVEAL", "trade.buyer")]);
    activate(&server).await;
    let mut bank_a = client(&server, &data, "bank-a").await;
    let mut request = trade(125_000);
    let t = request.trade.as_mut().unwrap();
    t.buyer = "acct-ada-7".into();
    t.seller = "acct-bob-9".into();
    let answer = bank_a.submit("req-p1", &request).await.unwrap();
    let receipt = answer.receipt.unwrap();

    // The hashed event holds commitments in place of the parties, never the values.
    let stored = get(&server, &format!("/v1/audit/events/{}", receipt.seq)).await;
    let event = &stored["event"];
    assert!(!event.to_string().contains("acct-"), "{event}");
    let (buyer, seller) = (commitment(event, "buyer"), commitment(event, "seller"));
    assert_eq!(event["payload"]["trade"]["currency"], "SGD");
    // The events endpoint reveals only what the policy reveals (with its salt).
    assert_eq!(stored["personal"].as_array().unwrap().len(), 1, "{stored}");
    assert_eq!(stored["personal"][0]["member"], "trade.buyer");
    assert_eq!(stored["personal"][0]["value"], "\"acct-ada-7\"");

    // The explanation: buyer shown, seller replaced by its commitment and a marker.
    let why = get(&server, "/v1/audit/decisions/req-p1").await;
    assert_eq!(why["redaction_policy"], "trade.buyer", "{why}");
    assert_eq!(why["trade"]["buyer"], "acct-ada-7", "{why}");
    assert_eq!(
        why["trade"]["seller"],
        json!({"redacted": "withheld by policy", "commitment": seller})
    );
    assert_eq!(why["trade"]["amount_minor"], "125000");
    assert!(!why.to_string().contains("acct-bob-9"), "{why}");
    let statuses: Vec<(&str, &str)> = why["personal_fields"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap(), f["status"].as_str().unwrap()))
        .collect();
    assert_eq!(
        statuses,
        [("trade.buyer", "revealed"), ("trade.seller", "withheld")]
    );

    // The buyer asks to be erased.
    let (status, body) = post(
        &server,
        "/v1/redactions",
        json!({"seq": receipt.seq, "member": "trade.buyer", "reason": "erasure request 42"}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let redaction_seq = body["redaction"]["seq"].as_u64().unwrap();

    // Now the buyer is marked erased with its commitment and the redaction that erased it;
    // the event itself (hash, receipt) is unchanged.
    let why = get(&server, "/v1/audit/decisions/req-p1").await;
    assert_eq!(
        why["trade"]["buyer"],
        json!({"redacted": "erased", "commitment": buyer}),
        "{why}"
    );
    assert_eq!(why["trade"]["seller"]["redacted"], "withheld by policy");
    assert!(!why.to_string().contains("acct-"), "{why}");
    let erased = &why["personal_fields"][0];
    assert_eq!(erased["status"], "erased", "{why}");
    assert_eq!(erased["redaction"]["seq"], redaction_seq);
    assert_eq!(erased["redaction"]["reason"], "erasure request 42");
    assert_eq!(why["event"]["hash"], receipt.event_hash.as_str());
    let stored = get(&server, &format!("/v1/audit/events/{}", receipt.seq)).await;
    assert_eq!(stored["personal"], json!([]), "{stored}");

    // The member still gets its original decision back by request id.
    let again = bank_a.submit("req-p1", &request).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.receipt.unwrap().seq, receipt.seq);

    // The chain, stream versions and checkpoints still verify after the erasure.
    assert!(server.terminate().success());
    let out = aether_e2e::run_aether(&["verify", "--data-dir", data.to_str().unwrap()], &[]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

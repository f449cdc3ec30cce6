//! Hand-offs of the drift tiers to people and pipelines: a review ticket (opened,
//! overdue) and a drift escalation are POSTed to the operators' webhook, signed with
//! HMAC-SM3 and retried with back-off; a retrain request runs the configured retraining
//! command. Each outcome is an event (`handoff/webhook`, `handoff/retrain`), so what was
//! delivered, when and after how many tries is on the ledger with the request it answers.
//!
//! Runs on one node of a cluster at a time (lease `handoffs`), follows the ledger from a
//! stored position (the ledger's head the first time), and saves it after each hand-off:
//! at-least-once delivery, each POST carrying the event id (`X-Aether-Event-Id`) for the
//! receiver to drop repeats.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use aether_control::handoff::{
    DELIVERED, DELIVERY_FAILED, RETRAIN_FAILED, RETRAIN_FINISHED, RETRAIN_STARTED, RETRAIN_STREAM,
    WEBHOOK_STREAM,
};
use aether_control::rollout_controller::{
    DRIFT_ESCALATED, RETRAIN_REQUESTED, REVIEW_OPENED, REVIEW_OVERDUE,
};
use aether_ledger::{EventStore, LedgerError, NewEvent, RecordedEvent};
use hmac::{KeyInit, Mac};
use serde_json::{Value, json};
use tokio::sync::watch;

/// The stored subscription position of the hand-offs.
pub const POSITION: &str = "handoffs";
/// The signature header: `hmac-sm3=<64 lowercase hex>` over the exact body bytes.
pub const SIGNATURE_HEADER: &str = "x-aether-signature";

/// Where the hand-offs go; each part is off unless configured.
#[derive(Clone, Debug, Default)]
pub struct HandoffConfig {
    pub webhook: Option<Webhook>,
    /// Run through `sh -c` for each `RetrainRequested`, with the request in `AETHER_RETRAIN_*`.
    pub retrain_command: Option<String>,
    /// Longest a retraining command may run before it is killed and recorded as failed.
    pub retrain_timeout: Duration,
}

impl HandoffConfig {
    pub fn is_empty(&self) -> bool {
        self.webhook.is_none() && self.retrain_command.is_none()
    }
}

/// The operators' webhook.
#[derive(Clone)]
pub struct Webhook {
    pub url: reqwest::Url,
    pub secret: Vec<u8>,
    /// Tries per hand-off; the waits between them double from `first_retry`.
    pub attempts: u32,
    pub first_retry: Duration,
}

impl std::fmt::Debug for Webhook {
    /// The secret never appears in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("url", &self.url.as_str())
            .field("attempts", &self.attempts)
            .finish_non_exhaustive()
    }
}

impl Webhook {
    /// Reads the signing secret from `secret_file` (its whole content, trailing newline
    /// removed; at least 16 bytes).
    pub fn new(url: &str, secret_file: &PathBuf) -> anyhow::Result<Webhook> {
        use anyhow::Context;
        let url = reqwest::Url::parse(url).with_context(|| format!("--review-webhook {url:?}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            anyhow::bail!("--review-webhook must be an http or https URL, got {url}");
        }
        let mut secret = std::fs::read(secret_file)
            .with_context(|| format!("cannot read {}", secret_file.display()))?;
        while secret.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            secret.pop();
        }
        if secret.len() < 16 {
            anyhow::bail!(
                "the webhook secret in {} is {} bytes; it must be at least 16",
                secret_file.display(),
                secret.len()
            );
        }
        Ok(Webhook {
            url,
            secret,
            attempts: 6,
            first_retry: Duration::from_secs(1),
        })
    }
}

/// `hmac-sm3=<hex>` of `body` under `secret`: what [`SIGNATURE_HEADER`] carries.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    let mut mac = <hmac::Hmac<sm3::Sm3> as KeyInit>::new_from_slice(secret)
        .expect("HMAC takes a key of any length");
    mac.update(body);
    format!("hmac-sm3={}", hex::encode(mac.finalize().into_bytes()))
}

/// Follows the ledger and hands off each drift event, until `stop`.
pub async fn run(
    store: EventStore,
    config: HandoffConfig,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    // The first time on a ledger they start at its head: turning a webhook or a command on
    // must not replay every drift event of the past (those stay on the ledger).
    if store.load_position(POSITION).await?.is_none() {
        let head = store.head().await?.map_or(0, |(seq, _)| seq);
        store.save_position(POSITION, head).await?;
        tracing::info!(
            from_seq = head + 1,
            "drift hand-offs start at the ledger's head; earlier drift events are not handed off"
        );
    }
    let mut subscription = store.subscribe_named(POSITION).await?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    loop {
        let event = tokio::select! {
            event = subscription.next() => event?,
            _ = stop.changed() => return Ok(()),
        };
        if *stop.borrow() {
            return Ok(());
        }
        let handled = match event.event_type.as_str() {
            REVIEW_OPENED | REVIEW_OVERDUE | DRIFT_ESCALATED => match &config.webhook {
                Some(webhook) => deliver(&store, &http, webhook, &event, &mut stop).await?,
                None => true,
            },
            RETRAIN_REQUESTED => match &config.retrain_command {
                Some(command) => retrain(&store, command, config.retrain_timeout, &event).await?,
                None => true,
            },
            _ => true,
        };
        if !handled {
            return Ok(()); // stopped mid-delivery: the next holder delivers it again
        }
        subscription.save_position(event.seq).await?;
    }
}

/// The chat message and the event behind it. `text` is what Slack, Mattermost,
/// Rocket.Chat and Teams incoming webhooks show; `aether` is the machine-readable part.
fn message(event: &RecordedEvent) -> Value {
    let p: Value = serde_json::from_str(event.payload.get()).unwrap_or(Value::Null);
    let candidate = p["candidate"].as_str().unwrap_or("?");
    let text = match event.event_type.as_str() {
        REVIEW_OPENED => format!(
            "Aether: drift review {} opened: candidate {candidate} frozen at 0 % (drift {}). Respond by {} (SLA {} min).",
            p["ticket"].as_str().unwrap_or("?"),
            p["drift_score"],
            p["deadline"].as_str().unwrap_or("?"),
            p["sla_ms"].as_u64().unwrap_or(0) / 60_000,
        ),
        REVIEW_OVERDUE => format!(
            "Aether: drift review {} is OVERDUE: its deadline {} passed unanswered (candidate {candidate} still frozen).",
            p["ticket"].as_str().unwrap_or("?"),
            p["deadline"].as_str().unwrap_or("?"),
        ),
        _ => format!(
            "Aether: drift escalated on {}: composite score {} followed {} within the escalation window.",
            event.stream_id, p["score"], p["first_score"],
        ),
    };
    json!({
        "text": text,
        "aether": {
            "event_type": event.event_type,
            "event_id": event.event_id.to_string(),
            "seq": event.seq,
            "stream_id": event.stream_id,
            "recorded_at": event.recorded_at,
            "payload": p,
        },
    })
}

/// POSTs one event, retrying a failure (connection error, timeout, 429 or 5xx) with
/// doubling waits; records the outcome. `false` when stopped before the outcome.
async fn deliver(
    store: &EventStore,
    http: &reqwest::Client,
    webhook: &Webhook,
    event: &RecordedEvent,
    stop: &mut watch::Receiver<bool>,
) -> Result<bool, LedgerError> {
    let body = serde_json::to_vec(&message(event)).unwrap_or_default();
    let signed = signature(&webhook.secret, &body);
    let mut wait = webhook.first_retry;
    let mut last_error = String::new();
    for attempt in 1..=webhook.attempts.max(1) {
        let sent = http
            .post(webhook.url.clone())
            .header("content-type", "application/json")
            .header(SIGNATURE_HEADER, &signed)
            .header("x-aether-event-id", event.event_id.to_string())
            .body(body.clone())
            .send()
            .await;
        let retry = match sent {
            Ok(r) if r.status().is_success() => {
                metrics::counter!("aether_handoff_deliveries_total", "outcome" => "delivered")
                    .increment(1);
                record(
                    store,
                    WEBHOOK_STREAM,
                    DELIVERED,
                    event,
                    json!({"attempts": attempt, "status": r.status().as_u16()}),
                )
                .await?;
                return Ok(true);
            }
            Ok(r) => {
                last_error = format!("answered {}", r.status());
                r.status().is_server_error() || r.status() == reqwest::StatusCode::TOO_MANY_REQUESTS
            }
            Err(e) => {
                last_error = e.to_string();
                true
            }
        };
        tracing::warn!(event = %event.event_type, seq = event.seq, attempt, error = %last_error, "webhook delivery failed");
        if !retry || attempt == webhook.attempts.max(1) {
            break;
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return Ok(false),
        }
        wait = (wait * 2).min(Duration::from_secs(60));
    }
    metrics::counter!("aether_handoff_deliveries_total", "outcome" => "failed").increment(1);
    record(
        store,
        WEBHOOK_STREAM,
        DELIVERY_FAILED,
        event,
        json!({"attempts": webhook.attempts.max(1), "error": last_error}),
    )
    .await?;
    Ok(true)
}

/// Runs the retraining command for one request, recording its start and its end.
async fn retrain(
    store: &EventStore,
    command: &str,
    timeout: Duration,
    request: &RecordedEvent,
) -> Result<bool, LedgerError> {
    let p: Value = serde_json::from_str(request.payload.get()).unwrap_or(Value::Null);
    let features: Vec<&str> = p["features"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let rollout = request
        .stream_id
        .strip_prefix("analysis/")
        .unwrap_or(&request.stream_id)
        .to_owned();
    let range = |k: &str| p["data_range"][k].as_str().unwrap_or_default().to_owned();
    let env = [
        ("AETHER_RETRAIN_REQUEST", request.event_id.to_string()),
        ("AETHER_RETRAIN_ROLLOUT", rollout.clone()),
        (
            "AETHER_RETRAIN_CANDIDATE",
            p["candidate"].as_str().unwrap_or_default().to_owned(),
        ),
        ("AETHER_RETRAIN_FROM", range("from")),
        ("AETHER_RETRAIN_TO", range("to")),
        ("AETHER_RETRAIN_FEATURES", features.join(",")),
    ];
    record(
        store,
        RETRAIN_STREAM,
        RETRAIN_STARTED,
        request,
        json!({
            "rollout": rollout,
            "candidate": p["candidate"],
            "data_range": p["data_range"],
            "features": features,
        }),
    )
    .await?;
    let started = Instant::now();
    let mut child = tokio::process::Command::new("sh");
    child.arg("-c").arg(command).kill_on_drop(true);
    for (k, v) in &env {
        child.env(k, v);
    }
    let outcome = match tokio::time::timeout(timeout, child.output()).await {
        Ok(Ok(out)) if out.status.success() => Ok(out),
        Ok(Ok(out)) => Err(format!(
            "exited with {}: {}",
            out.status,
            tail(&String::from_utf8_lossy(&out.stderr))
        )),
        Ok(Err(e)) => Err(format!("could not start: {e}")),
        Err(_) => Err(format!(
            "still running after {} s; killed",
            timeout.as_secs()
        )),
    };
    let elapsed_ms = started.elapsed().as_millis() as u64;
    match outcome {
        Ok(out) => {
            record(
                store,
                RETRAIN_STREAM,
                RETRAIN_FINISHED,
                request,
                json!({"elapsed_ms": elapsed_ms, "output": tail(&String::from_utf8_lossy(&out.stdout))}),
            )
            .await?
        }
        Err(error) => {
            tracing::warn!(request = %request.event_id, %error, "the retraining command failed");
            record(
                store,
                RETRAIN_STREAM,
                RETRAIN_FAILED,
                request,
                json!({"elapsed_ms": elapsed_ms, "error": error}),
            )
            .await?
        }
    }
    Ok(true)
}

/// The last 2,000 characters of a command's output.
fn tail(text: &str) -> String {
    let chars: Vec<char> = text.trim().chars().collect();
    chars[chars.len().saturating_sub(2000)..].iter().collect()
}

/// One hand-off event, naming the request it answers (`causation_id`, and as
/// `correlation_id` the run the lineage joins it to).
async fn record(
    store: &EventStore,
    stream: &str,
    kind: &str,
    request: &RecordedEvent,
    mut payload: Value,
) -> Result<(), LedgerError> {
    payload["request"] = json!({
        "seq": request.seq,
        "event_id": request.event_id.to_string(),
        "event_type": request.event_type,
        "stream_id": request.stream_id,
    });
    let event = NewEvent::new(kind, payload).with_metadata(json!({
        "causation_id": request.event_id.to_string(),
        "correlation_id": request.event_id.to_string(),
        "actor": "aether-handoffs",
    }));
    store
        .append(stream, aether_ledger::ExpectedVersion::Any, vec![event])
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sm3_of_the_body() {
        // HMAC by its definition (RFC 2104) with SM3 (64-byte blocks), computed here from
        // the sm3 crate alone: H((K ⊕ opad) ‖ H((K ⊕ ipad) ‖ m)).
        use sm3::Digest;
        let key = b"a webhook secret of 32 bytes....";
        let body = br#"{"text":"hello"}"#;
        let mut k = [0u8; 64];
        k[..key.len()].copy_from_slice(key);
        let inner: Vec<u8> = k
            .iter()
            .map(|b| b ^ 0x36)
            .chain(body.iter().copied())
            .collect();
        let inner = sm3::Sm3::digest(&inner);
        let outer: Vec<u8> = k
            .iter()
            .map(|b| b ^ 0x5c)
            .chain(inner.iter().copied())
            .collect();
        let expected = format!("hmac-sm3={}", hex::encode(sm3::Sm3::digest(&outer)));
        assert_eq!(signature(key, body), expected);
        assert_ne!(signature(key, b"other"), expected);
    }
}

//! The OpenLineage HTTP transport: POSTs every stored RunEvent to an OpenLineage backend
//! (Marquez, DataHub, OpenMetadata, ...) at `OPENLINEAGE_URL`.
//!
//! It follows `lineage_records`, not the ledger: the events it sends are exactly the ones
//! stored (never mapped twice), and it can never run ahead of them. Its own durable cursor
//! ([`HTTP_CURSOR`]) means a slow or absent endpoint delays only this relay, and its lag is
//! a metric (`aether_lineage_http_lag_events`).
//!
//! Delivery is at-least-once, one POST per event, in seq order. The cursor moves past an
//! event only once the endpoint answered 2xx, or once a content rejection was recorded:
//! - 5xx, 408, 429 and network errors are retried with exponential backoff (capped at 30 s,
//!   `Retry-After` honoured up to the cap); nothing is skipped.
//! - 400, 413 and 422 reject *this event's content*: sending it again cannot succeed, and
//!   holding every later event behind it would turn one bad record into an outage of all
//!   lineage. The event is skipped, but recorded in `openlineage_http_rejections` (status and
//!   response), counted, logged, listed by `aether lineage reconcile` (which then fails),
//!   and POSTed again on every start until it is accepted.
//! - Any other answer (401, 403, 404, 415, a redirect, ...) says the endpoint or its
//!   configuration refuses *every* event, so skipping would mark the whole ledger rejected:
//!   the relay holds at that event and retries with backoff until the configuration is
//!   fixed.
//!
//! The cursor is saved after at most 64 delivered events or 250 ms, and before every wait,
//! so after a crash at most that window is sent twice (same run id and event type: backends
//! treat a repeated event as the same run state). A graceful stop re-sends nothing that was
//! acknowledged. Redirects are not followed (a POST must not turn into a GET, nor carry the
//! API key to another host).

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use aether_ledger::EventStore;
use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue, LOCATION, RETRY_AFTER};
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;
use url::Url;

pub use crate::error::HttpTransportError;
use crate::error::RelayError;
use crate::retry::retry_until_stopped;

/// Name of the transport's cursor in the ledger's subscription positions: the last seq
/// the endpoint acknowledged (or whose rejection was recorded).
pub const HTTP_CURSOR: &str = "lineage-openlineage-http";

/// The OpenLineage clients' variables (Python client `HttpConfig` / legacy HTTP variables):
/// the backend's base URL ...
pub const ENV_URL: &str = "OPENLINEAGE_URL";
/// ... the path events are POSTed to, resolved against the URL ...
pub const ENV_ENDPOINT: &str = "OPENLINEAGE_ENDPOINT";
/// ... an API key, sent as `Authorization: Bearer <key>` ...
pub const ENV_API_KEY: &str = "OPENLINEAGE_API_KEY";
/// ... `true` turns emission off even when a URL is set ...
pub const ENV_DISABLED: &str = "OPENLINEAGE_DISABLED";
/// ... and the transport timeout in seconds, in the clients' `OPENLINEAGE__` form.
pub const ENV_TIMEOUT: &str = "OPENLINEAGE__TRANSPORT__TIMEOUT";

/// The clients' default endpoint (relative: kept under a URL that has a path).
pub const DEFAULT_ENDPOINT: &str = "api/v1/lineage";
/// The clients' default timeout.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// Stored records read per query.
const BATCH: i64 = 100;
/// The cursor is saved after this many delivered events ...
const SAVE_EVERY_EVENTS: u64 = 64;
/// ... or once the oldest unsaved delivery is this old (bounds re-sends after a crash).
const SAVE_EVERY: Duration = Duration::from_millis(250);
/// How much of an error response is kept in logs and the rejections table.
const RESPONSE_EXCERPT: usize = 1024;

fn config_error(var: &'static str, reason: impl Into<String>) -> HttpTransportError {
    HttpTransportError::Config {
        var,
        reason: reason.into(),
    }
}

/// An API key; its `Debug` never shows it, so it cannot end up in a log.
#[derive(Clone)]
pub struct ApiKey(HeaderValue);

impl ApiKey {
    /// Checks that the key is visible ASCII without spaces, as a bearer token must be (HTTP
    /// headers would take other bytes, which servers read in differing ways).
    pub fn new(key: &str) -> Result<Self, HttpTransportError> {
        let invalid = || {
            config_error(
                ENV_API_KEY,
                "must be visible ASCII without spaces (it is sent as a bearer token)",
            )
        };
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(invalid());
        }
        let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| invalid())?;
        value.set_sensitive(true);
        Ok(ApiKey(value))
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Where and how the transport delivers.
#[derive(Clone)]
pub struct HttpTransportConfig {
    /// The URL events are POSTed to (`OPENLINEAGE_URL` joined with `OPENLINEAGE_ENDPOINT`).
    pub endpoint: Url,
    pub api_key: Option<ApiKey>,
    /// Per request, connection included.
    pub timeout: Duration,
    /// First wait after a failed attempt; doubled per failure up to `max_backoff`.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// How often to look for new stored records once caught up.
    pub poll_interval: Duration,
}

impl fmt::Debug for HttpTransportConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpTransportConfig")
            .field("endpoint", &redacted(&self.endpoint))
            .field("api_key", &self.api_key)
            .field("timeout", &self.timeout)
            .field("initial_backoff", &self.initial_backoff)
            .field("max_backoff", &self.max_backoff)
            .field("poll_interval", &self.poll_interval)
            .finish()
    }
}

impl HttpTransportConfig {
    /// Defaults: no API key, 5 s timeout, backoff from 200 ms to 30 s, polling every 200 ms.
    pub fn new(endpoint: Url) -> Self {
        HttpTransportConfig {
            endpoint,
            api_key: None,
            timeout: DEFAULT_TIMEOUT,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
            poll_interval: Duration::from_millis(200),
        }
    }

    /// From the process environment; `None` when `OPENLINEAGE_URL` is unset or empty (or
    /// `OPENLINEAGE_DISABLED=true`).
    pub fn from_env() -> Result<Option<Self>, HttpTransportError> {
        Self::from_lookup(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// As [`from_env`](Self::from_env), reading variables through `var`.
    pub fn from_lookup(
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, HttpTransportError> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if set(ENV_DISABLED).is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let Some(url) = set(ENV_URL) else {
            return Ok(None);
        };
        let endpoint = set(ENV_ENDPOINT).unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned());
        let mut config = Self::new(endpoint_url(&url, &endpoint)?);
        // Trimmed: keys mounted from secret files usually end in a newline.
        config.api_key = set(ENV_API_KEY)
            .map(|k| ApiKey::new(k.trim()))
            .transpose()?;
        if let Some(t) = set(ENV_TIMEOUT) {
            config.timeout = t
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= 3600.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| {
                    config_error(
                        ENV_TIMEOUT,
                        format!("must be a number of seconds in (0, 3600], not {t:?}"),
                    )
                })?;
        }
        Ok(Some(config))
    }
}

/// Resolves `endpoint` against the base `url` as the OpenLineage clients do, except that a
/// base with a path is taken as a directory: `https://h/marquez` + `api/v1/lineage` is
/// `https://h/marquez/api/v1/lineage`; an absolute `/api/v1/lineage` replaces the path.
pub fn endpoint_url(url: &str, endpoint: &str) -> Result<Url, HttpTransportError> {
    // The value is not echoed: a URL may carry credentials.
    let mut base = Url::parse(url.trim())
        .map_err(|e| config_error(ENV_URL, format!("is not a valid URL: {e}")))?;
    if !matches!(base.scheme(), "http" | "https") {
        return Err(config_error(
            ENV_URL,
            format!("must be an http or https URL, not {}:", base.scheme()),
        ));
    }
    if base.host_str().is_none_or(str::is_empty) {
        return Err(config_error(ENV_URL, "has no host"));
    }
    if !base.path().ends_with('/') {
        let path = format!("{}/", base.path());
        base.set_path(&path);
    }
    let endpoint = endpoint.trim();
    let endpoint = if endpoint.is_empty() {
        DEFAULT_ENDPOINT
    } else {
        endpoint
    };
    base.join(endpoint)
        .map_err(|e| config_error(ENV_ENDPOINT, format!("is not a valid path: {e}")))
}

/// The URL without user name and password, for logs and the rejections table.
fn redacted(url: &Url) -> String {
    let mut shown = url.clone();
    let _ = shown.set_password(None);
    let _ = shown.set_username("");
    shown.to_string()
}

/// One event the endpoint refused for its content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Rejection {
    pub seq: u64,
    /// The endpoint that answered (without credentials).
    pub endpoint: String,
    pub http_status: u16,
    /// The start of the response body (at most 1 KiB).
    pub response: String,
    /// When it was last rejected (RFC 3339).
    pub rejected_at: String,
}

/// Follows the stored OpenLineage records until `stop` turns true, POSTing each to the
/// endpoint. Database failures are logged and retried from the stored cursor; endpoint
/// failures are retried in place. Fails only if the HTTP client cannot be built.
pub async fn run_http_relay(
    store: EventStore,
    config: HttpTransportConfig,
    stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    let endpoint = Endpoint::new(&config)?;
    // Earlier rejections are retried once per start, not after every database error.
    let rejections_retried = Arc::new(AtomicBool::new(false));
    retry_until_stopped("openlineage-http", stop.clone(), || {
        follow(
            store.clone(),
            endpoint.clone(),
            config.clone(),
            rejections_retried.clone(),
            stop.clone(),
        )
    })
    .await
}

#[derive(Clone)]
struct Endpoint {
    client: reqwest::Client,
    url: Url,
    shown: String,
    authorization: Option<HeaderValue>,
}

/// What one POST came to.
enum Answer {
    Delivered,
    /// The event's content was refused (400, 413, 422).
    Rejected {
        status: u16,
        response: String,
    },
    /// Try again later; `kind` labels the failure metric.
    Retry {
        kind: &'static str,
        detail: String,
        after: Option<Duration>,
    },
}

impl Endpoint {
    fn new(config: &HttpTransportConfig) -> Result<Self, HttpTransportError> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("aether/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(HttpTransportError::Client)?;
        Ok(Endpoint {
            client,
            url: config.endpoint.clone(),
            shown: redacted(&config.endpoint),
            authorization: config.api_key.as_ref().map(|k| k.0.clone()),
        })
    }

    async fn post(&self, json: &str) -> Answer {
        let mut request = self
            .client
            .post(self.url.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(json.to_owned());
        if let Some(auth) = &self.authorization {
            request = request.header(AUTHORIZATION, auth.clone());
        }
        let response = match request.send().await {
            Ok(r) => r,
            Err(e) => {
                let kind = if e.is_timeout() {
                    "timeout"
                } else if e.is_connect() {
                    "connect"
                } else {
                    "network"
                };
                return Answer::Retry {
                    kind,
                    detail: error_chain(&e.without_url()),
                    after: None,
                };
            }
        };
        let status = response.status();
        if status.is_success() {
            return Answer::Delivered;
        }
        let header = |name| {
            response
                .headers()
                .get(name)
                .and_then(|v: &HeaderValue| v.to_str().ok())
                .map(str::to_owned)
        };
        let after = header(RETRY_AFTER)
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let location = header(LOCATION);
        let body = excerpt(response).await;
        match status {
            StatusCode::BAD_REQUEST
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::UNPROCESSABLE_ENTITY => Answer::Rejected {
                status: status.as_u16(),
                response: body,
            },
            StatusCode::REQUEST_TIMEOUT | StatusCode::TOO_MANY_REQUESTS => Answer::Retry {
                kind: "throttled",
                detail: format!("HTTP {status}: {body}"),
                after,
            },
            s if s.is_server_error() => Answer::Retry {
                kind: "server",
                detail: format!("HTTP {status}: {body}"),
                after,
            },
            s if s.is_redirection() => Answer::Retry {
                kind: "refused",
                detail: format!(
                    "HTTP {status} to {} (redirects are not followed: set {ENV_URL} to the final address)",
                    location.as_deref().unwrap_or("nowhere")
                ),
                after: None,
            },
            _ => Answer::Retry {
                kind: "refused",
                detail: format!(
                    "HTTP {status} (the endpoint refuses every event; check {ENV_URL}, {ENV_ENDPOINT} and {ENV_API_KEY}): {body}"
                ),
                after: None,
            },
        }
    }
}

/// The start of a response body, read no further than needed.
async fn excerpt(mut response: reqwest::Response) -> String {
    let mut buf = Vec::new();
    while buf.len() < RESPONSE_EXCERPT {
        match response.chunk().await {
            Ok(Some(chunk)) => buf.extend_from_slice(&chunk),
            _ => break,
        }
    }
    buf.truncate(RESPONSE_EXCERPT);
    String::from_utf8_lossy(&buf).into_owned()
}

/// `error: cause: cause`, since reqwest's own message names only the outermost layer.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// Exponential backoff from `initial` to `max`, reset by any answer that ends an event.
struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(config: &HttpTransportConfig) -> Self {
        let max = config.max_backoff.max(Duration::from_millis(1));
        let initial = config.initial_backoff.clamp(Duration::from_millis(1), max);
        Backoff {
            initial,
            max,
            next: initial,
        }
    }

    fn wait(&mut self, asked: Option<Duration>) -> Duration {
        let wait = self.next.max(asked.unwrap_or_default()).min(self.max);
        self.next = (self.next * 2).min(self.max);
        wait
    }

    fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// The transport's position: `at` is handled, `saved` is what a restart resumes after.
struct Cursor {
    store: EventStore,
    at: u64,
    saved: u64,
    unsaved_since: Option<Instant>,
}

impl Cursor {
    fn advance(&mut self, seq: u64) {
        self.at = seq;
        self.unsaved_since.get_or_insert_with(Instant::now);
    }

    async fn flush(&mut self) -> Result<(), RelayError> {
        if self.at > self.saved {
            self.store.save_position(HTTP_CURSOR, self.at).await?;
            self.saved = self.at;
        }
        self.unsaved_since = None;
        Ok(())
    }

    async fn flush_if_due(&mut self) -> Result<(), RelayError> {
        let due = self.at - self.saved >= SAVE_EVERY_EVENTS
            || self
                .unsaved_since
                .is_some_and(|t| t.elapsed() >= SAVE_EVERY);
        if due { self.flush().await } else { Ok(()) }
    }
}

/// How an event's delivery ended.
enum Outcome {
    Delivered,
    Rejected { status: u16, response: String },
}

/// POSTs one event until it is delivered or rejected; `None` when stopped first (the
/// event stays unacknowledged and is sent again after the restart).
async fn deliver(
    endpoint: &Endpoint,
    seq: u64,
    json: &str,
    cursor: &mut Cursor,
    backoff: &mut Backoff,
    stop: &mut watch::Receiver<bool>,
) -> Result<Option<Outcome>, RelayError> {
    loop {
        let answer = tokio::select! {
            answer = endpoint.post(json) => answer,
            _ = stop.changed() => return Ok(None),
        };
        let (kind, detail, after) = match answer {
            Answer::Delivered => {
                backoff.reset();
                return Ok(Some(Outcome::Delivered));
            }
            Answer::Rejected { status, response } => {
                backoff.reset();
                return Ok(Some(Outcome::Rejected { status, response }));
            }
            Answer::Retry {
                kind,
                detail,
                after,
            } => (kind, detail, after),
        };
        metrics::counter!("aether_lineage_http_failures_total", "kind" => kind).increment(1);
        // What was delivered so far is durable before a possibly long wait.
        cursor.flush().await?;
        let wait = backoff.wait(after);
        let retry_in_ms = wait.as_millis() as u64;
        if kind == "refused" {
            tracing::error!(seq, kind, endpoint = %endpoint.shown, error = %detail, retry_in_ms, "OpenLineage endpoint refused the event; holding delivery");
        } else {
            tracing::warn!(seq, kind, endpoint = %endpoint.shown, error = %detail, retry_in_ms, "OpenLineage endpoint did not take the event; retrying");
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return Ok(None),
        }
    }
}

async fn follow(
    store: EventStore,
    endpoint: Endpoint,
    config: HttpTransportConfig,
    rejections_retried: Arc<AtomicBool>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), RelayError> {
    if *stop.borrow() {
        return Ok(());
    }
    let start = store.load_position(HTTP_CURSOR).await?.unwrap_or(0);
    let mut cursor = Cursor {
        store: store.clone(),
        at: start,
        saved: start,
        unsaved_since: None,
    };
    let mut backoff = Backoff::new(&config);
    // Rejections past the cursor (a crash before it was saved) are re-sent in order below;
    // their rows go once they are delivered.
    let mut rejected_ahead = BTreeSet::new();
    for r in rejections(&store).await? {
        if r.seq > start {
            rejected_ahead.insert(r.seq);
        }
    }
    if !rejections_retried.load(Ordering::Acquire) {
        let done =
            redeliver_rejected(&store, &endpoint, &mut cursor, &mut backoff, &mut stop).await?;
        if !done {
            return Ok(());
        }
        rejections_retried.store(true, Ordering::Release);
    }
    tracing::info!(endpoint = %endpoint.shown, after_seq = start, "delivering OpenLineage events over HTTP");
    let committed = store.committed_seq();
    let lag = |at: u64| {
        let head = *committed.borrow();
        metrics::gauge!("aether_lineage_http_lag_events").set(head.saturating_sub(at) as f64);
    };
    let mut gap_reported = None;
    loop {
        let rows = pending(&store, cursor.at).await?;
        // Only the unbroken run after the cursor: a missing record holds delivery rather
        // than being skipped (reconcile names it).
        let ready: Vec<(u64, String)> = rows
            .iter()
            .zip(cursor.at + 1..)
            .take_while(|((seq, _), expected)| *seq == *expected)
            .map(|((seq, json), _)| (*seq, json.clone()))
            .collect();
        if ready.is_empty() {
            cursor.flush().await?;
            lag(cursor.at);
            let missing = cursor.at + 1;
            if !rows.is_empty() && gap_reported != Some(missing) {
                gap_reported = Some(missing);
                metrics::counter!("aether_lineage_http_failures_total", "kind" => "missing_record")
                    .increment(1);
                tracing::error!(
                    seq = missing,
                    "the OpenLineage record of this event is missing; HTTP delivery holds here \
                     (see `aether lineage reconcile`)"
                );
            }
            tokio::select! {
                _ = tokio::time::sleep(config.poll_interval) => continue,
                _ = stop.changed() => return Ok(()),
            }
        }
        for (seq, json) in ready {
            let outcome =
                deliver(&endpoint, seq, &json, &mut cursor, &mut backoff, &mut stop).await?;
            match outcome {
                None => {
                    cursor.flush().await?;
                    return Ok(());
                }
                Some(Outcome::Delivered) => {
                    if rejected_ahead.remove(&seq) {
                        delete_rejection(&store, seq).await?;
                    }
                    metrics::counter!("aether_lineage_http_delivered_total").increment(1);
                }
                Some(Outcome::Rejected { status, response }) => {
                    reject(&store, &endpoint, seq, status, &response).await?;
                }
            }
            cursor.advance(seq);
            cursor.flush_if_due().await?;
            lag(cursor.at);
        }
    }
}

/// Records a content rejection before the cursor can pass it.
async fn reject(
    store: &EventStore,
    endpoint: &Endpoint,
    seq: u64,
    status: u16,
    response: &str,
) -> Result<(), RelayError> {
    record_rejection(store, seq, &endpoint.shown, status, response, Utc::now()).await?;
    metrics::counter!("aether_lineage_http_failures_total", "kind" => "rejected").increment(1);
    tracing::error!(
        seq,
        status,
        endpoint = %endpoint.shown,
        response,
        "OpenLineage endpoint rejected the event; recorded (listed by `aether lineage reconcile`, \
         sent again on the next start)"
    );
    Ok(())
}

/// POSTs every recorded rejection at or before the cursor once more, in seq order; an
/// accepted one loses its row. `false` when stopped first.
async fn redeliver_rejected(
    store: &EventStore,
    endpoint: &Endpoint,
    cursor: &mut Cursor,
    backoff: &mut Backoff,
    stop: &mut watch::Receiver<bool>,
) -> Result<bool, RelayError> {
    let waiting = rejected_records(store, cursor.at).await?;
    if !waiting.is_empty() {
        tracing::info!(
            events = waiting.len(),
            "sending events the OpenLineage endpoint rejected before once more"
        );
    }
    for (seq, json) in waiting {
        match deliver(endpoint, seq, &json, cursor, backoff, stop).await? {
            None => return Ok(false),
            Some(Outcome::Delivered) => {
                delete_rejection(store, seq).await?;
                metrics::counter!("aether_lineage_http_delivered_total").increment(1);
                tracing::info!(
                    seq,
                    "OpenLineage endpoint accepted an event it had rejected"
                );
            }
            Some(Outcome::Rejected { status, response }) => {
                reject(store, endpoint, seq, status, &response).await?;
            }
        }
    }
    Ok(true)
}

/// Stored records after `after`, in seq order.
async fn pending(store: &EventStore, after: u64) -> Result<Vec<(u64, String)>, sqlx::Error> {
    let after = after as i64;
    let rows: Vec<(i64, String)> = if let Some(pool) = store.postgres_pool() {
        sqlx::query_as(
            "SELECT seq, openlineage_event FROM lineage_records WHERE seq > $1 ORDER BY seq LIMIT $2",
        )
        .bind(after)
        .bind(BATCH)
        .fetch_all(pool)
        .await?
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query_as(
            "SELECT seq, openlineage_event FROM lineage_records WHERE seq > ? ORDER BY seq LIMIT ?",
        )
        .bind(after)
        .bind(BATCH)
        .fetch_all(pool)
        .await?
    } else {
        Vec::new()
    };
    Ok(rows.into_iter().map(|(s, j)| (s as u64, j)).collect())
}

/// The stored records of rejected events at or before `through`, in seq order.
async fn rejected_records(
    store: &EventStore,
    through: u64,
) -> Result<Vec<(u64, String)>, sqlx::Error> {
    let through = through as i64;
    let rows: Vec<(i64, String)> = if let Some(pool) = store.postgres_pool() {
        sqlx::query_as(
            "SELECT r.seq, l.openlineage_event FROM openlineage_http_rejections r \
             JOIN lineage_records l ON l.seq = r.seq WHERE r.seq <= $1 ORDER BY r.seq",
        )
        .bind(through)
        .fetch_all(pool)
        .await?
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query_as(
            "SELECT r.seq, l.openlineage_event FROM openlineage_http_rejections r \
             JOIN lineage_records l ON l.seq = r.seq WHERE r.seq <= ? ORDER BY r.seq",
        )
        .bind(through)
        .fetch_all(pool)
        .await?
    } else {
        Vec::new()
    };
    Ok(rows.into_iter().map(|(s, j)| (s as u64, j)).collect())
}

async fn record_rejection(
    store: &EventStore,
    seq: u64,
    endpoint: &str,
    status: u16,
    response: &str,
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    let (seq, status) = (seq as i64, i32::from(status));
    if let Some(pool) = store.postgres_pool() {
        sqlx::query(
            "INSERT INTO openlineage_http_rejections (seq, endpoint, http_status, response, rejected_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (seq) DO UPDATE SET endpoint = excluded.endpoint, \
             http_status = excluded.http_status, response = excluded.response, rejected_at = excluded.rejected_at",
        )
        .bind(seq)
        .bind(endpoint)
        .bind(status)
        .bind(response)
        .bind(now)
        .execute(pool)
        .await?;
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query(
            "INSERT INTO openlineage_http_rejections (seq, endpoint, http_status, response, rejected_at) \
             VALUES (?, ?, ?, ?, ?) ON CONFLICT (seq) DO UPDATE SET endpoint = excluded.endpoint, \
             http_status = excluded.http_status, response = excluded.response, rejected_at = excluded.rejected_at",
        )
        .bind(seq)
        .bind(endpoint)
        .bind(status)
        .bind(response)
        .bind(now.timestamp_micros())
        .execute(pool)
        .await?;
    }
    Ok(())
}

async fn delete_rejection(store: &EventStore, seq: u64) -> Result<(), sqlx::Error> {
    let seq = seq as i64;
    if let Some(pool) = store.postgres_pool() {
        sqlx::query("DELETE FROM openlineage_http_rejections WHERE seq = $1")
            .bind(seq)
            .execute(pool)
            .await?;
    } else if let Some(pool) = store.sqlite_pool() {
        sqlx::query("DELETE FROM openlineage_http_rejections WHERE seq = ?")
            .bind(seq)
            .execute(pool)
            .await?;
    }
    Ok(())
}

/// Every event the endpoint rejected and has not accepted since, by seq.
pub async fn rejections(store: &EventStore) -> Result<Vec<Rejection>, sqlx::Error> {
    const SQL: &str = "SELECT seq, endpoint, http_status, response, rejected_at \
                       FROM openlineage_http_rejections ORDER BY seq";
    let rows: Vec<(i64, String, i32, String, DateTime<Utc>)> =
        if let Some(pool) = store.postgres_pool() {
            sqlx::query_as(SQL).fetch_all(pool).await?
        } else if let Some(pool) = store.sqlite_pool() {
            let rows: Vec<(i64, String, i32, String, i64)> =
                sqlx::query_as(SQL).fetch_all(pool).await?;
            rows.into_iter()
                .map(|(s, e, h, r, at)| {
                    (
                        s,
                        e,
                        h,
                        r,
                        DateTime::from_timestamp_micros(at).unwrap_or_default(),
                    )
                })
                .collect()
        } else {
            Vec::new()
        };
    Ok(rows
        .into_iter()
        .map(|(seq, endpoint, status, response, at)| Rejection {
            seq: seq as u64,
            endpoint,
            http_status: u16::try_from(status).unwrap_or(0),
            response,
            rejected_at: aether_ledger::hashing::format_timestamp(&at),
        })
        .collect())
}

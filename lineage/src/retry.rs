//! How every relay keeps going: each failed attempt logged and counted, then retried with
//! back-off until the relay is told to stop.

use tokio::sync::watch;

use crate::error::RelayError;

/// Runs `attempt` until it returns `Ok` (it saw the stop request) or `stop` turns true,
/// logging each failure and backing off from 200 ms to 30 s between attempts.
pub(crate) async fn retry_until_stopped<F, Fut>(
    sink: &'static str,
    mut stop: watch::Receiver<bool>,
    mut attempt: F,
) -> Result<(), RelayError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), RelayError>>,
{
    let mut backoff = std::time::Duration::from_millis(200);
    loop {
        match attempt().await {
            Ok(()) => return Ok(()),
            Err(e) => {
                tracing::error!(sink, error = %e, retry_in_ms = backoff.as_millis() as u64, "lineage relay failed");
                metrics::counter!("aether_lineage_relay_failures_total", "sink" => sink)
                    .increment(1);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return Ok(()),
        }
        backoff = (backoff * 2).min(std::time::Duration::from_secs(30));
    }
}

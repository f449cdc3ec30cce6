//! The HTTP listener: axum's router on hyper, with the limits a service facing untrusted
//! clients needs. A connection must send a request's headers within the header timeout,
//! also when it sits idle between requests (hyper's timer), and the number of open
//! connections is capped below the process's file limit, so that a flood of idle
//! connections can neither hold the service nor starve the ledger, the relays and gRPC of
//! descriptors (a connection past the cap is closed at once).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Limits of the HTTP listener.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// Longest a connection may take to send a request's headers, idle time included.
    pub header_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

/// Descriptors kept for everything but HTTP connections: database pools, Delta files,
/// gRPC connections, logs.
const RESERVED_DESCRIPTORS: u64 = 256;

/// The connection cap: as asked, but never more than the file limit leaves after the
/// reserve (`RLIMIT_NOFILE`, read now); warns when that limit makes it lower.
pub fn connection_cap(asked: usize) -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    if !ok {
        return asked;
    }
    let room = limit.rlim_cur.saturating_sub(RESERVED_DESCRIPTORS).max(16) / 2;
    let cap = asked.min(usize::try_from(room).unwrap_or(usize::MAX));
    if cap < asked {
        tracing::warn!(
            open_files_limit = limit.rlim_cur,
            http_connections = cap,
            asked,
            "the open-files limit (ulimit -n) caps HTTP connections below --max-http-connections; raise it"
        );
    }
    cap
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open requests finish
/// (up to 10 s).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.header_timeout)
        .keep_alive_timeout(limits.header_timeout);
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors and the like: wait a moment rather than spin.
                    tracing::warn!(error = %e, "cannot accept an HTTP connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics::counter!("aether_http_connections_refused_total").increment(1);
            drop(stream);
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            // Telling HTTP/1 from HTTP/2 reads the first bytes with no timer of hyper's:
            // a connection that sends nothing is closed here.
            let mut first = [0u8; 1];
            match tokio::time::timeout(header_timeout, stream.peek(&mut first)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
            let connection = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned();
            let _ = watcher.watch(connection).await;
            drop(slot);
        });
    }
    drop(listener);
    if tokio::time::timeout(Duration::from_secs(10), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("HTTP connections still open after 10 s were cut");
    }
    Ok(())
}

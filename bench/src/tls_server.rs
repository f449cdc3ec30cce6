//! The bench's own clearing services (the echo, the durable baseline), served as the
//! gateway serves its own: the same TLS 1.3 acceptor, certificate and PKI from the
//! server's data directory.

use std::path::Path;

use aether_gateway::pb::v1::clearing_service_server::{ClearingService, ClearingServiceServer};
use aether_gateway::tls::{ServerIdentities, ServerTls, TlsSuite};

/// Serves `service` on a free port; answers its `https://` address and the sender that
/// stops it. `what` names it in the message if it stops on an error.
pub async fn serve<S: ClearingService>(
    service: S,
    data: &Path,
    suite: TlsSuite,
    what: &'static str,
) -> anyhow::Result<(String, tokio::sync::watch::Sender<bool>)> {
    let tls = ServerTls::load_suite(suite, &ServerIdentities::dev(data, suite))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let incoming = tls.incoming(listener);
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let result = tonic::transport::Server::builder()
            .add_service(ClearingServiceServer::new(service))
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop_rx.changed().await;
            })
            .await;
        if let Err(e) = result {
            eprintln!("{what} stopped: {e}");
        }
    });
    Ok((format!("https://{addr}"), stop_tx))
}

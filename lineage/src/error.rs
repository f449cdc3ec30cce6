//! The crate's errors: why an event could not be mapped, why a relay failed, why the
//! OpenLineage HTTP transport cannot start.

/// Why a ledger event could not be turned into an OpenLineage run event.
///
/// None of these depend on the event's payload or metadata contents: any JSON object
/// there maps. They mean a misconfigured mapping or a corrupt event, which the relay must
/// report rather than skip.
#[derive(Debug, thiserror::Error)]
pub enum LineageError {
    /// The base URL the custom facet's schema is served under is not usable.
    #[error("schema base URL {url:?} {reason}")]
    SchemaBaseUrl { url: String, reason: String },
    /// The event's payload text is not JSON (the ledger stores canonical JSON only).
    #[error("event {event_id}: payload is not JSON: {source}")]
    Payload {
        event_id: uuid::Uuid,
        source: serde_json::Error,
    },
    /// The event's metadata text is not JSON (the ledger stores canonical JSON only).
    #[error("event {event_id}: metadata is not JSON: {source}")]
    Metadata {
        event_id: uuid::Uuid,
        source: serde_json::Error,
    },
    /// `recorded_at` has no RFC 3339 form (a year outside 0000..=9999).
    #[error("event {event_id}: recorded_at {recorded_at} is outside RFC 3339's years")]
    EventTime {
        event_id: uuid::Uuid,
        recorded_at: String,
    },
    /// A facet could not be serialized.
    #[error("cannot serialize the {facet} facet: {source}")]
    Facet {
        facet: &'static str,
        source: serde_json::Error,
    },
}

/// Why a relay's attempt failed (it is retried, see `retry`).
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Ledger(#[from] aether_ledger::LedgerError),
    #[error("lineage records: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Mapping(#[from] LineageError),
    #[error("cannot serialise a run event: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error(transparent)]
    Delta(#[from] crate::table::DeltaError),
    #[error(transparent)]
    Http(#[from] HttpTransportError),
    #[error("cannot write the OpenLineage file {path}: {source}")]
    File {
        path: String,
        source: std::io::Error,
    },
}

/// A configuration or client problem; it stops `aether serve` from starting.
#[derive(Debug, thiserror::Error)]
pub enum HttpTransportError {
    /// An environment variable has a value that cannot be used.
    #[error("{var} {reason}")]
    Config { var: &'static str, reason: String },
    /// The HTTP client could not be built (TLS setup).
    #[error("cannot build the OpenLineage HTTP client: {0}")]
    Client(#[source] reqwest::Error),
}

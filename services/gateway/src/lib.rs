//! The gRPC clearing gateway: mTLS identities ([`identity`], [`tls`], [`certs`]), the
//! SM2/SM4 envelope ([`envelope`]), the clearing pipeline ([`clearing`]: rules, routing,
//! [`batcher`], decision events, [`observations`] for rollout analysis), the decoding of an opened payload ([`request`]), its gRPC service ([`service`]) and a client ([`client`]).
//!
//! Invariant: a member is never answered before the decision's event has committed.

pub mod batcher;
pub mod breaker;
pub mod budgets;
pub mod certs;
pub mod clearing;
pub mod client;
pub mod coalesce;
mod decision;
pub mod envelope;
pub mod errors;
pub mod identity;
mod lookups;
pub mod observations;
pub mod pb;
pub mod request;
pub mod risk_book;
pub mod service;
pub mod snapshot_grpc;
pub mod telemetry;
pub mod tls;
pub mod workers;

//! Aether's benchmark and fault harnesses (`aether bench …`, `aether cluster chaos`): each
//! measures a real `aether serve` or the real ledger against a baseline measured in the
//! same run, and reports figures, never pass/fail. Shared pieces: a scratch ledger
//! (`scratch`), a child `aether serve` set up over its API (`node`), the synthetic trades
//! (`trades`), payloads and percentiles (`report`).

mod audit;
pub mod chaos;
mod clearing;
mod durable;
mod failover;
mod ledger;
mod lineage;
pub mod node;
mod report;
mod scratch;
mod tls_server;
pub mod trades;

/// `aether bench …`.
#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Ledger append throughput / latency and verify speed, with a raw-INSERT baseline.
    Ledger(ledger::LedgerBench),
    /// Audit: inclusion-proof latency and evidence export at scale, against plain reads.
    Audit(audit::AuditBench),
    /// Clearing over gRPC (mTLS, SM2/SM4 session keys) through a real `aether serve`,
    /// against a bare tonic mTLS echo server in the same run.
    Clearing(clearing::ClearingBench),
    /// Lineage: relay throughput into Delta and the OpenLineage store, OpenLineage lag at
    /// an offered rate, and the time to open the Delta `events` table.
    Lineage(lineage::LineageBench),
    /// Cluster: how long the checkpointer duty is unowned after its holder is SIGKILLed
    /// (two real nodes on one PostgreSQL database).
    Failover(failover::FailoverBench),
}

/// Runs one bench; its report goes to stdout.
pub async fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Ledger(b) => ledger::run(b).await,
        BenchCommand::Audit(b) => audit::run(b).await,
        BenchCommand::Clearing(b) => clearing::run(b).await,
        BenchCommand::Lineage(b) => lineage::run(b).await,
        BenchCommand::Failover(b) => failover::run(b).await,
    }
}

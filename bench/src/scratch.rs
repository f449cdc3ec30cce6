//! A scratch ledger for one bench run: a fresh database on the PostgreSQL server, dropped
//! afterwards, or a temporary SQLite file.

use aether_ledger::checkpoint::CheckpointSigner;
use aether_ledger::{
    CheckpointPolicy, EventStore, ExpectedVersion, NewEvent, redact_url, run_checkpointer,
};
use anyhow::Context;
use sqlx::Connection;
use sqlx::postgres::PgConnection;

use crate::report::payload;

/// A scratch ledger: a fresh database on the server, or a temp SQLite file.
pub struct Scratch {
    pub url: String,
    cleanup: Option<(String, String)>,
    _dir: Option<tempfile::TempDir>,
}

impl Scratch {
    pub async fn new(base: &str) -> anyhow::Result<Scratch> {
        if base.starts_with("sqlite:") {
            let dir = tempfile::tempdir()?;
            let url = format!("sqlite:{}", dir.path().join("bench.db").display());
            return Ok(Scratch {
                url,
                cleanup: None,
                _dir: Some(dir),
            });
        }
        let name = format!("aether_bench_{}", uuid::Uuid::now_v7().simple());
        let mut conn = PgConnection::connect(base)
            .await
            .with_context(|| format!("cannot connect to {}", redact_url(base)))?;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .context("CREATE DATABASE (the bench needs a role that may create databases)")?;
        // Each measured run starts with the previous run's dirty pages written out, so that
        // it does not pay for them. (The open-loop p99 right after the 256-appender run
        // still varies from 8 to 53 ms with it, against 2–4 ms on its own.)
        if let Err(e) = sqlx::raw_sql("CHECKPOINT").execute(&mut conn).await {
            eprintln!(
                "note: CHECKPOINT before the run failed ({e}); the run may overlap the previous one's writes"
            );
        }
        conn.close().await?;
        Ok(Scratch {
            url: aether_ledger_url_with_db(base, &name),
            cleanup: Some((base.to_owned(), name)),
            _dir: None,
        })
    }

    /// The scratch database's name (PostgreSQL only).
    pub fn database_name(&self) -> Option<&str> {
        self.cleanup.as_ref().map(|(_, name)| name.as_str())
    }

    pub async fn drop(self) {
        if let Some((base, name)) = self.cleanup
            && let Ok(mut conn) = PgConnection::connect(&base).await
        {
            let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut conn)
                .await;
        }
    }
}

/// `url` with its database path replaced by `name` (query string kept).
fn aether_ledger_url_with_db(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let start = base.find("://").map_or(0, |i| i + 3);
    let path = base[start..].find('/').map_or(base.len(), |i| start + i);
    let mut out = format!("{}/{name}", &base[..path]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Appends `events` events from 4 tasks in 500-event appends while a checkpointer signs
/// every 1,000; ends with a final checkpoint covering everything. With `access`, one task
/// in four writes regulators' `AuditQueried` records to `access/audit` instead of
/// clearing decisions.
pub async fn fill_signed(
    store: &EventStore,
    signer: CheckpointSigner,
    events: u64,
    payload_bytes: usize,
    access: bool,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let checkpointer = tokio::spawn(run_checkpointer(
        store.clone(),
        signer,
        CheckpointPolicy::default(),
        stop_rx,
    ));
    let per_task = events / 4;
    let fills: Vec<_> = (0..4u64)
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut done = 0;
                let (stream, kind) = match t {
                    3 if access => ("access/audit".to_owned(), "AuditQueried"),
                    _ => (format!("clearing/member-{t}"), "ClearingDecided"),
                };
                while done < per_task {
                    let n = (per_task - done).min(500);
                    let events = (0..n)
                        .map(|i| NewEvent::new(kind, payload(payload_bytes, done + i)))
                        .collect();
                    store.append(&stream, ExpectedVersion::Any, events).await?;
                    done += n;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for f in fills {
        f.await??;
    }
    let _ = stop_tx.send(true);
    checkpointer.await??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_urls_keep_host_and_query() {
        assert_eq!(
            aether_ledger_url_with_db("postgres://u@h:5432/postgres?sslmode=disable", "x"),
            "postgres://u@h:5432/x?sslmode=disable"
        );
        assert_eq!(
            aether_ledger_url_with_db("postgres://h", "x"),
            "postgres://h/x"
        );
    }
}

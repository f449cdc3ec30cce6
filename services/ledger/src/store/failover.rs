//! A ledger on a PostgreSQL primary with standbys, named by a multi-host URL
//! (`postgres://user@h1:5432,h2:5432/db?target_session_attrs=read-write`, libpq's form):
//! the store connects to whichever host is the primary (not in recovery), refuses
//! connections to a standby, and when the primary changes (a standby promoted after the old
//! one failed) points every pool of the store at the new one, without a restart.
//!
//! sqlx takes one host per pool; this keeps the candidates, probes them, and moves the pools
//! with `Pool::set_connect_options` (connections already open to the old primary fail and
//! are replaced from the new options).

use std::str::FromStr;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};

use crate::error::LedgerError;

/// How often the current primary is checked.
const CHECK_EVERY: Duration = Duration::from_millis(500);
/// How long one probe of a host may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The hosts of a multi-host URL and the pools that follow its primary.
pub(crate) struct Failover {
    hosts: Vec<(String, PgConnectOptions)>,
    current: Mutex<usize>,
    pools: Mutex<Vec<PgPool>>,
}

/// The hosts of `url` as one URL each, when it names more than one; `None` for a
/// single-host URL. `target_session_attrs` may only be `read-write` (or absent): the ledger
/// writes, so it always wants the primary.
pub(crate) fn split_hosts(url: &str) -> Result<Option<Vec<(String, String)>>, LedgerError> {
    let Some(scheme_end) = url.find("://") else {
        return Ok(None);
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    if !hosts.contains(',') {
        return Ok(None);
    }
    let tail = &rest[authority_end..];
    let (path, query) = match tail.split_once('?') {
        Some((path, query)) => (path, query),
        None => (tail, ""),
    };
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("target_session_attrs", "read-write")) => {}
            Some(("target_session_attrs", other)) => {
                return Err(LedgerError::UnsupportedUrl(format!(
                    "target_session_attrs={other}: the ledger writes, so only read-write is supported"
                )));
            }
            _ => kept.push(pair),
        }
    }
    let query = if kept.is_empty() {
        String::new()
    } else {
        format!("?{}", kept.join("&"))
    };
    let scheme = &url[..scheme_end + 3];
    let mut out = Vec::new();
    for host in hosts.split(',') {
        if host.is_empty() {
            return Err(LedgerError::UnsupportedUrl(
                "an empty host in a multi-host URL".into(),
            ));
        }
        out.push((
            host.to_owned(),
            format!("{scheme}{userinfo}{host}{path}{query}"),
        ));
    }
    Ok(Some(out))
}

impl Failover {
    /// Probes `hosts` (`(host, url)`) and returns the failover set with the primary chosen,
    /// and that primary's options. Fails when no host is a reachable primary.
    pub(crate) async fn connect(
        hosts: Vec<(String, String)>,
        tune: impl Fn(PgConnectOptions) -> PgConnectOptions,
    ) -> Result<(Arc<Failover>, PgConnectOptions), LedgerError> {
        let mut parsed = Vec::new();
        for (host, url) in hosts {
            parsed.push((host, tune(PgConnectOptions::from_str(&url)?)));
        }
        let failover = Failover {
            hosts: parsed,
            current: Mutex::new(0),
            pools: Mutex::new(Vec::new()),
        };
        let Some(primary) = failover.find_primary().await else {
            return Err(LedgerError::NoPrimary(failover.host_list()));
        };
        if let Ok(mut current) = failover.current.lock() {
            *current = primary;
        }
        let options = failover.hosts[primary].1.clone();
        tracing::info!(primary = %failover.hosts[primary].0, "the PostgreSQL primary");
        Ok((Arc::new(failover), options))
    }

    fn host_list(&self) -> String {
        self.hosts
            .iter()
            .map(|(h, _)| h.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Makes `pool` follow the primary from now on.
    pub(crate) fn register(&self, pool: &PgPool) {
        if let Ok(mut pools) = self.pools.lock() {
            pools.push(pool.clone());
        }
    }

    /// The options of the primary as last found.
    pub(crate) fn current_options(&self) -> PgConnectOptions {
        let index = self.current.lock().map(|c| *c).unwrap_or(0);
        self.hosts[index].1.clone()
    }

    /// The first host that answers as a primary, the current one tried first.
    async fn find_primary(&self) -> Option<usize> {
        let current = self.current.lock().map(|c| *c).unwrap_or(0);
        let order = std::iter::once(current).chain((0..self.hosts.len()).filter(|&i| i != current));
        for index in order {
            if is_primary(&self.hosts[index].1).await {
                return Some(index);
            }
        }
        None
    }

    /// Checks the primary every 500 ms for as long as the store lives; when it is gone or
    /// has become a standby, finds the new one and moves every pool to it.
    pub(crate) fn watch(failover: &Arc<Failover>) {
        let weak: Weak<Failover> = Arc::downgrade(failover);
        tokio::spawn(async move {
            let mut lost = false;
            loop {
                tokio::time::sleep(CHECK_EVERY).await;
                let Some(failover) = weak.upgrade() else {
                    return;
                };
                let current = failover.current.lock().map(|c| *c).unwrap_or(0);
                if is_primary(&failover.hosts[current].1).await {
                    lost = false;
                    continue;
                }
                match failover.find_primary().await {
                    Some(index) if index != current => {
                        if let Ok(mut c) = failover.current.lock() {
                            *c = index;
                        }
                        let options = failover.hosts[index].1.clone();
                        if let Ok(pools) = failover.pools.lock() {
                            for pool in pools.iter() {
                                pool.set_connect_options(options.clone());
                            }
                        }
                        lost = false;
                        tracing::warn!(
                            primary = %failover.hosts[index].0,
                            was = %failover.hosts[current].0,
                            "the PostgreSQL primary changed; the ledger writes to the new one"
                        );
                    }
                    Some(_) => lost = false,
                    None if !lost => {
                        lost = true;
                        tracing::error!(
                            hosts = %failover.host_list(),
                            "no PostgreSQL host is a primary; looking every 500 ms"
                        );
                    }
                    None => {}
                }
            }
        });
    }
}

/// Whether the host answers and is not in recovery (a primary).
async fn is_primary(options: &PgConnectOptions) -> bool {
    let probe = async {
        let mut conn = PgConnection::connect_with(options).await?;
        let in_recovery: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(&mut conn)
            .await?;
        let _ = conn.close().await;
        Ok::<bool, sqlx::Error>(!in_recovery)
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, probe).await,
        Ok(Ok(true))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multi_host_url_is_one_url_per_host() {
        let hosts = split_hosts(
            "postgres://u:secret@h1:5432,h2:6543/ledger?target_session_attrs=read-write&sslmode=disable",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            hosts,
            vec![
                (
                    "h1:5432".to_owned(),
                    "postgres://u:secret@h1:5432/ledger?sslmode=disable".to_owned()
                ),
                (
                    "h2:6543".to_owned(),
                    "postgres://u:secret@h2:6543/ledger?sslmode=disable".to_owned()
                ),
            ]
        );
        assert_eq!(split_hosts("postgres://u@h1/db").unwrap(), None);
        assert!(split_hosts("postgres://h1,h2/db?target_session_attrs=read-only").is_err());
        assert!(split_hosts("postgres://h1,,h2/db").is_err());
        let bare = split_hosts("postgresql://h1,h2").unwrap().unwrap();
        assert_eq!(bare[1].1, "postgresql://h2");
    }
}

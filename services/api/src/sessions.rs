//! Console sessions: a person exchanges an operator or regulator token once for a session
//! cookie, so that the token never sits in a URL, in storage a script can read, or in the
//! page. The cookie is `HttpOnly` and `SameSite=Strict`, lives [`SESSION_TTL`], and
//! every API route accepts it where it accepts a bearer token ([`crate::access::authorize`]).
//! A write made with the cookie must also carry the session's CSRF token in
//! `X-CSRF-Token` (the session middleware): the cookie alone authorises reads only.
//!
//! Sessions are rows of `console_sessions` in the ledger's database (only the SM3 digest of
//! each session id), so every node of a cluster accepts a session opened through any of
//! them, a restart keeps them, and a sign-out through any node ends the session on all at
//! once. Opening and closing a session, and every page a regulator views, are recorded on
//! `access/audit` as their API calls are.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aether_ledger::EventStore;
use axum::http::{HeaderMap, StatusCode, header};
use chrono::{DateTime, Duration, Utc};
use rand::RngExt;

use crate::auth::Caller;
use crate::problem::Problem;

/// The session cookie's name.
pub const COOKIE: &str = "aether_session";
/// The header a cookie-authenticated write must carry.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// How long a session lasts: a working day.
pub const SESSION_TTL: Duration = Duration::hours(8);
/// Most sessions one node keeps in its cache (the database holds them all).
const MAX_CACHED: usize = 10_000;

/// One signed-in person.
#[derive(Clone, Debug)]
pub struct Session {
    pub caller: Caller,
    pub csrf: String,
    pub expires: DateTime<Utc>,
}

/// The console's sessions: rows of `console_sessions` in the ledger's database, shared by
/// every node, and this node's cache of those its requests presented. [`resolve_session`]
/// reads a request's session from the database before anything else runs (so a sign-in or
/// sign-out through any node counts at once), and leaves it in the cache, where
/// [`crate::access::authorize`], which cannot wait, finds it.
#[derive(Clone, Default)]
pub struct Sessions(Arc<Mutex<HashMap<[u8; 32], Session>>>);

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sessions({} cached)", self.lock().len())
    }
}

fn random_hex() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    hex::encode(bytes)
}

fn digest(id: &str) -> [u8; 32] {
    aether_ledger::hashing::sm3(id.as_bytes())
}

/// A session row: actor, role, CSRF token, expiry.
type Row = (String, String, String, DateTime<Utc>);

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Session>> {
        // A panic elsewhere cannot leave the map half-changed: every change is one call.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn cache(&self, key: [u8; 32], session: Option<Session>, now: DateTime<Utc>) {
        let mut map = self.lock();
        match session {
            Some(session) => {
                if map.len() >= MAX_CACHED {
                    map.retain(|_, s| s.expires > now);
                }
                if map.len() < MAX_CACHED {
                    map.insert(key, session);
                }
            }
            None => {
                map.remove(&key);
            }
        }
    }

    /// Opens a session for `caller` (recorded in the database first): the cookie value and
    /// the session. Rows expired a day ago are removed on the way.
    pub async fn open(
        &self,
        store: &EventStore,
        caller: Caller,
        now: DateTime<Utc>,
    ) -> Result<(String, Session), sqlx::Error> {
        let id = random_hex();
        let key = digest(&id);
        let session = Session {
            caller,
            csrf: random_hex(),
            expires: now + SESSION_TTL,
        };
        let stale = now - Duration::days(1);
        let role = session.caller.role.name();
        let (actor, csrf) = (&session.caller.actor, &session.csrf);
        if let Some(pool) = store.postgres_pool() {
            sqlx::query("DELETE FROM console_sessions WHERE expires_at < $1")
                .bind(stale)
                .execute(pool)
                .await?;
            sqlx::query(
                "INSERT INTO console_sessions (id_digest, actor, role, csrf, expires_at) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(key.as_slice())
            .bind(actor)
            .bind(role)
            .bind(csrf)
            .bind(session.expires)
            .execute(pool)
            .await?;
        } else if let Some(pool) = store.sqlite_pool() {
            sqlx::query("DELETE FROM console_sessions WHERE expires_at < ?")
                .bind(stale.timestamp_micros())
                .execute(pool)
                .await?;
            sqlx::query(
                "INSERT INTO console_sessions (id_digest, actor, role, csrf, expires_at) \
                 VALUES (?, ?, ?, ?, ?)",
            )
            .bind(key.as_slice())
            .bind(actor)
            .bind(role)
            .bind(csrf)
            .bind(session.expires.timestamp_micros())
            .execute(pool)
            .await?;
        }
        self.cache(key, Some(session.clone()), now);
        Ok((id, session))
    }

    /// The live session a cookie value names, as the database has it now (opened through
    /// any node, not closed, not expired); this node's cache follows.
    pub async fn resolve(
        &self,
        store: &EventStore,
        id: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<Session>, sqlx::Error> {
        let key = digest(id);
        let row: Option<Row> = if let Some(pool) = store.postgres_pool() {
            sqlx::query_as(
                "SELECT actor, role, csrf, expires_at FROM console_sessions \
                 WHERE id_digest = $1 AND closed_at IS NULL AND expires_at > $2",
            )
            .bind(key.as_slice())
            .bind(now)
            .fetch_optional(pool)
            .await?
        } else if let Some(pool) = store.sqlite_pool() {
            let row: Option<(String, String, String, i64)> = sqlx::query_as(
                "SELECT actor, role, csrf, expires_at FROM console_sessions \
                 WHERE id_digest = ? AND closed_at IS NULL AND expires_at > ?",
            )
            .bind(key.as_slice())
            .bind(now.timestamp_micros())
            .fetch_optional(pool)
            .await?;
            row.and_then(|(a, r, c, e)| Some((a, r, c, DateTime::from_timestamp_micros(e)?)))
        } else {
            None
        };
        let session = row.and_then(|(actor, role, csrf, expires)| {
            Some(Session {
                caller: Caller {
                    role: role.parse().ok()?,
                    actor,
                },
                csrf,
                expires,
            })
        });
        self.cache(key, session.clone(), now);
        Ok(session)
    }

    /// The session this request's cookie named when the session middleware read it.
    pub fn get(&self, id: &str, now: DateTime<Utc>) -> Option<Session> {
        self.lock()
            .get(&digest(id))
            .filter(|s| s.expires > now)
            .cloned()
    }

    /// Ends a session on every node: closed in the database, dropped from this node's cache.
    pub async fn close(
        &self,
        store: &EventStore,
        id: &str,
        now: DateTime<Utc>,
    ) -> Result<(), sqlx::Error> {
        let key = digest(id);
        self.cache(key, None, now);
        if let Some(pool) = store.postgres_pool() {
            sqlx::query("UPDATE console_sessions SET closed_at = $2 WHERE id_digest = $1")
                .bind(key.as_slice())
                .bind(now)
                .execute(pool)
                .await?;
        } else if let Some(pool) = store.sqlite_pool() {
            sqlx::query("UPDATE console_sessions SET closed_at = ? WHERE id_digest = ?")
                .bind(now.timestamp_micros())
                .bind(key.as_slice())
                .execute(pool)
                .await?;
        }
        Ok(())
    }
}

pub(crate) fn unavailable(e: sqlx::Error) -> Problem {
    tracing::error!(error = %e, "console sessions could not be read or written");
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "Sessions unavailable",
        "the console's sessions could not be read or written; see the server log",
    )
    .retry_after(1)
}

/// The value of the session cookie among the request's cookies.
pub fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim())
}

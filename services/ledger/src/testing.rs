//! Test support (feature `testing`): a fresh PostgreSQL database per test on the server
//! named by `DATABASE_URL` (as `scripts/test.sh` provides), dropped when the test ends.

use sqlx::Connection;
use sqlx::postgres::PgConnection;

/// The server tests use: `DATABASE_URL`, else the local server on 127.0.0.1:5432.
pub fn admin_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".to_string())
}

/// A database that exists for one test.
pub struct TestDatabase {
    pub name: String,
    pub url: String,
    admin: String,
}

impl TestDatabase {
    /// Creates `aether_t_<random>` on the test server.
    ///
    /// # Panics
    /// When the server cannot be reached: tests need a real PostgreSQL.
    pub async fn create() -> TestDatabase {
        let admin = admin_url();
        let name = format!("aether_t_{}", uuid::Uuid::now_v7().simple());
        let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| {
            panic!(
                "tests need PostgreSQL at {} (set DATABASE_URL or run scripts/test.sh): {e}",
                crate::redact_url(&admin)
            )
        });
        drop_stale_databases(&mut conn).await;
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("cannot create test database {name}: {e}"));
        let _ = conn.close().await;
        let url = with_database(&admin, &name);
        TestDatabase { name, url, admin }
    }

    /// Drops the database, closing any connection still open to it.
    pub async fn drop_database(self) {
        if let Ok(mut conn) = PgConnection::connect(&self.admin).await {
            let _ = sqlx::raw_sql(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .execute(&mut conn)
            .await;
            let _ = conn.close().await;
        }
    }
}

/// Drops test databases left by tests that failed more than an hour ago (their names
/// carry a UUIDv7, hence their creation time), so failures do not pile up on a server.
async fn drop_stale_databases(conn: &mut PgConnection) {
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'aether\\_t\\_%'")
            .fetch_all(&mut *conn)
            .await
            .unwrap_or_default();
    let cutoff = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for name in names {
        let created = name
            .strip_prefix("aether_t_")
            .and_then(|id| uuid::Uuid::parse_str(id).ok())
            .and_then(|id| id.get_timestamp())
            .map(|ts| {
                let (secs, nanos) = ts.to_unix();
                std::time::UNIX_EPOCH + std::time::Duration::new(secs, nanos)
            });
        if created.is_some_and(|t| t < cutoff) {
            let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .execute(&mut *conn)
                .await;
        }
    }
}

/// `url` with its database path replaced by `name` (query string kept).
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[authority_start..]
        .find('/')
        .map_or(base.len(), |i| authority_start + i);
    let mut out = format!("{}/{}", &base[..path_start], name);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

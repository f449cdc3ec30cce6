//! The console's sign-in, sign-out and page views (`/v1/session`), and the middleware
//! that reads a request's session cookie and checks a cookie write's CSRF token.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{SecondsFormat, Utc};
use serde::Deserialize;
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::access::{Auditor, coloured, record_access};
use crate::auth::{Caller, Role};
use crate::problem::Problem;
use crate::sessions::{COOKIE, CSRF_HEADER, SESSION_TTL, Session, cookie, unavailable};
use crate::state::AppState;

/// Longest page path a view record takes.
const MAX_VIEW_PATH: usize = 2048;

/// Reads the session the request's cookie names (when it has no bearer token) from the
/// database, for [`crate::access::authorize`], and refuses a write made with the cookie unless
/// it carries the session's CSRF token: `SameSite=Strict` already keeps other sites'
/// requests from carrying the cookie; this keeps any request the page did not make from
/// writing.
pub async fn resolve_session(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let headers = request.headers();
    if headers.contains_key(header::AUTHORIZATION) {
        return next.run(request).await;
    }
    let Some(id) = cookie(headers) else {
        return next.run(request).await;
    };
    let session = match state.sessions.resolve(&state.store, id, Utc::now()).await {
        Ok(session) => session,
        Err(e) => return unavailable(e).into_response(),
    };
    let safe = matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    if !safe && let Some(session) = session {
        let presented = headers
            .get(CSRF_HEADER)
            .map(HeaderValue::as_bytes)
            .unwrap_or_default();
        if !constant_time_eq(presented, session.csrf.as_bytes()) {
            return Problem::new(
                StatusCode::FORBIDDEN,
                "CSRF token missing or wrong",
                "a write made with the console's session cookie must carry the session's \
                 csrf_token in X-CSRF-Token (GET /v1/session gives it)",
            )
            .into_response();
        }
    }
    next.run(request).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The session routes, documented (see the `openapi` module).
pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(open, show, close))
        .routes(routes!(view))
}

fn described(session: &Session) -> serde_json::Value {
    json!({
        "role": session.caller.role,
        "actor": session.caller.actor,
        "expires_at": session.expires.to_rfc3339_opts(SecondsFormat::Secs, true),
        "csrf_token": session.csrf,
    })
}

fn set_cookie(headers: &HeaderMap, value: &str, max_age: i64) -> HeaderValue {
    // Behind a proxy that ends TLS, the browser must never send the cookie in the clear.
    let https = headers
        .get("x-forwarded-proto")
        .is_some_and(|p| p.as_bytes().eq_ignore_ascii_case(b"https"));
    let secure = if https { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("aether_session=; Path=/; Max-Age=0"))
}

fn no_session() -> Problem {
    Problem::new(
        StatusCode::UNAUTHORIZED,
        "Not signed in",
        "no live console session: sign in with POST /v1/session",
    )
}

/// The session the request's cookie names.
fn current(state: &AppState, headers: &HeaderMap) -> Result<(String, Session), Problem> {
    let id = cookie(headers).ok_or_else(no_session)?;
    let session = state.sessions.get(id, Utc::now()).ok_or_else(no_session)?;
    Ok((id.to_owned(), session))
}

fn auditor(caller: &Caller, parts_trace: &str) -> Auditor {
    Auditor::new(caller.actor.clone(), parts_trace.to_owned())
}

/// `POST /v1/session`: a bearer token (operator or regulator) exchanged for a session
/// cookie.
#[utoipa::path(post, path = "/v1/session", tag = "console",
    description = "Opens a console session. Role: operator or regulator. Present the token as `Authorization: Bearer` once; the answer sets the `aether_session` cookie (HttpOnly, SameSite=Strict, 8 hours) that every route then accepts in place of the token, and gives the CSRF token that writes made with the cookie must carry in `X-CSRF-Token`. Recorded on `access/audit`.",
    responses((status = 201, description = "`{role, actor, expires_at, csrf_token}`; `Set-Cookie` carries the session", body = serde_json::Value),
              (status = 503, description = "The sign-in could not be recorded on the ledger; no session was opened")))]
async fn open(State(state): State<AppState>, request: axum::extract::Request) -> Response {
    let (parts, _) = request.into_parts();
    let result = async {
        if !parts.headers.contains_key(header::AUTHORIZATION) {
            return Err(Problem::new(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "sign in with Authorization: Bearer <operator or regulator token>",
            ));
        }
        let caller = crate::access::authorize(
            &state,
            &parts.headers,
            &[Role::Operator, Role::Regulator, Role::Worker],
        )?;
        if caller.role == Role::Worker {
            return Err(Problem::new(
                StatusCode::FORBIDDEN,
                "Forbidden",
                "a worker token cannot open a console session",
            ));
        }
        let trace_id = coloured(&parts)?.trace_id.clone();
        let now = Utc::now();
        let expires = now + SESSION_TTL;
        record_access(
            &state,
            &auditor(&caller, &trace_id),
            "session.open",
            json!({ "expires_at": expires.to_rfc3339_opts(SecondsFormat::Secs, true) }),
        )
        .await?;
        let (id, session) = state
            .sessions
            .open(&state.store, caller, now)
            .await
            .map_err(unavailable)?;
        tracing::info!(actor = %session.caller.actor, "console session opened");
        let cookie = set_cookie(&parts.headers, &id, SESSION_TTL.num_seconds());
        Ok((
            StatusCode::CREATED,
            [(header::SET_COOKIE, cookie)],
            [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))],
            axum::Json(described(&session)),
        )
            .into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// `GET /v1/session`: who the cookie signs in, and the CSRF token (the page keeps it in
/// memory only and asks again after a reload).
#[utoipa::path(get, path = "/v1/session", tag = "console",
    description = "Who is signed in. Role: operator or regulator. With the `aether_session` cookie: `{role, actor, expires_at, csrf_token}`, 401 when its session has ended (signed out, expired, or opened on another node); with a bearer token: `{role, actor}`.",
    responses((status = 200, description = "The session", body = serde_json::Value)))]
async fn show(State(state): State<AppState>, headers: HeaderMap) -> Result<Response, Problem> {
    let body = if headers.contains_key(header::AUTHORIZATION) {
        let caller =
            crate::access::authorize(&state, &headers, &[Role::Operator, Role::Regulator])?;
        json!({ "role": caller.role, "actor": caller.actor })
    } else {
        described(&current(&state, &headers)?.1)
    };
    Ok(([(header::CACHE_CONTROL, "no-store")], axum::Json(body)).into_response())
}

/// `DELETE /v1/session`: signs out; the cookie is refused from then on.
#[utoipa::path(delete, path = "/v1/session", tag = "console",
    description = "Signs out. Role: operator or regulator, by the session cookie (with a bearer token there is nothing to end: 204); the session ends at once on this node (the cookie is refused from then on) and the browser is told to drop it. Needs `X-CSRF-Token`. Recorded on `access/audit`.",
    responses((status = 204, description = "Signed out")))]
async fn close(State(state): State<AppState>, request: axum::extract::Request) -> Response {
    let (parts, _) = request.into_parts();
    let result = async {
        if parts.headers.contains_key(header::AUTHORIZATION) {
            // A bearer caller has no session of its own to end.
            crate::access::authorize(&state, &parts.headers, &[Role::Operator, Role::Regulator])?;
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        let (id, session) = current(&state, &parts.headers)?;
        state
            .sessions
            .close(&state.store, &id, Utc::now())
            .await
            .map_err(unavailable)?;
        let trace_id = coloured(&parts)?.trace_id.clone();
        // Closed first: a failed record must not leave the person signed in.
        record_access(
            &state,
            &auditor(&session.caller, &trace_id),
            "session.close",
            json!({}),
        )
        .await?;
        tracing::info!(actor = %session.caller.actor, "console session closed");
        Ok::<_, Problem>(
            (
                StatusCode::NO_CONTENT,
                [(header::SET_COOKIE, set_cookie(&parts.headers, "", 0))],
            )
                .into_response(),
        )
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct PageView {
    /// The console page viewed: a path under `/ui`, with its query (at most 2,048 bytes).
    #[schema(pattern = "^/ui($|[/?])[^\\x00]*$", max_length = 512)]
    path: String,
}

/// `POST /v1/session/views`: the console reports each page it shows, so that a
/// regulator's page views are on the ledger as their API calls are.
#[utoipa::path(post, path = "/v1/session/views", tag = "console",
    description = "Records a console page view (`{\"path\": \"/ui/…\"}`). Role: operator or regulator; a regulator's views are recorded on `access/audit`, an operator's are not. With the session cookie it needs `X-CSRF-Token`.",
    request_body = PageView,
    responses((status = 204, description = "Recorded"),
              (status = 422, description = "Not a console page path")))]
async fn view(State(state): State<AppState>, request: axum::extract::Request) -> Response {
    let (parts, body) = request.into_parts();
    let result = async {
        let caller =
            crate::access::authorize(&state, &parts.headers, &[Role::Operator, Role::Regulator])?;
        let body: Bytes = axum::body::to_bytes(body, MAX_VIEW_PATH * 2)
            .await
            .map_err(|_| Problem::bad_request("the body is larger than a page view"))?;
        let page: PageView = crate::params::json_body(&body, "page view")?;
        if !(page.path == "/ui" || page.path.starts_with("/ui/") || page.path.starts_with("/ui?"))
            || page.path.len() > MAX_VIEW_PATH
        {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid request",
                format!("path must be a console page under /ui, at most {MAX_VIEW_PATH} bytes"),
            ));
        }
        if caller.role == Role::Regulator {
            let trace_id = coloured(&parts)?.trace_id.clone();
            record_access(
                &state,
                &auditor(&caller, &trace_id),
                "page_view",
                json!({ "path": page.path }),
            )
            .await?;
        }
        Ok::<_, Problem>(StatusCode::NO_CONTENT.into_response())
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sessions::Sessions;
    use aether_ledger::EventStore;

    fn caller() -> Caller {
        Caller {
            role: Role::Regulator,
            actor: "regulator:00000000".into(),
        }
    }

    #[tokio::test]
    async fn a_session_lives_until_it_expires_or_is_closed_on_every_node() {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite:{}", dir.path().join("l.db").display());
        let store = EventStore::connect(&url, aether_ledger::StoreConfig::default())
            .await
            .expect("store");
        // Two nodes: two caches over one database.
        let (a, b) = (Sessions::default(), Sessions::default());
        let now = Utc::now();
        let (id, session) = a.open(&store, caller(), now).await.expect("open");
        assert_eq!(id.len(), 64);
        assert_ne!(session.csrf, id);
        assert!(a.get(&id, now).is_some());
        assert!(
            b.get(&id, now).is_none(),
            "not in b's cache before b reads it"
        );
        let read = b.resolve(&store, &id, now).await.expect("resolve");
        assert_eq!(read.map(|s| s.csrf), Some(session.csrf.clone()));
        assert!(b.get(&id, now).is_some());
        assert!(
            b.resolve(&store, "not-a-session", now)
                .await
                .expect("resolve")
                .is_none()
        );
        assert!(
            b.resolve(&store, &id, now + SESSION_TTL)
                .await
                .expect("resolve")
                .is_none(),
            "expired"
        );
        assert!(
            b.get(&id, now).is_none(),
            "an expired session leaves the cache"
        );
        // Closed through a: b's next read finds it gone.
        assert!(
            a.resolve(&store, &id, now)
                .await
                .expect("resolve")
                .is_some()
        );
        a.close(&store, &id, now).await.expect("close");
        assert!(a.get(&id, now).is_none());
        assert!(
            b.resolve(&store, &id, now)
                .await
                .expect("resolve")
                .is_none()
        );
        store.shutdown().await;
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("a=1; b=2"));
        assert_eq!(cookie(&headers), None);
        headers.append(
            header::COOKIE,
            HeaderValue::from_static("theme=dark; aether_session=abc ; x=y"),
        );
        assert_eq!(cookie(&headers), Some("abc"));
    }

    #[test]
    fn the_cookie_is_private_and_secure_behind_tls() {
        let plain = set_cookie(&HeaderMap::new(), "v", 60);
        let plain = plain.to_str().expect("ascii");
        assert!(plain.contains("HttpOnly") && plain.contains("SameSite=Strict"));
        assert!(!plain.contains("Secure"));
        let mut proxied = HeaderMap::new();
        proxied.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        assert!(
            set_cookie(&proxied, "v", 60)
                .to_str()
                .expect("ascii")
                .ends_with("; Secure")
        );
    }
}

//! The lineage and audit console at `/ui`: the page and its assets, built from
//! `console/web` and embedded ([`aether_console`]). Public: the page holds no data; it
//! signs in through `/v1/session` and reads the API with the session cookie.

use axum::Router;
use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::problem::Problem;
use crate::state::AppState;

/// What the page may load and call: only this service. Styles may be inline (the
/// framework sets element styles); scripts may not.
const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
    style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; \
    object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ui", get(|h: HeaderMap| async move { serve("", &h) }))
        .route("/ui/", get(|h: HeaderMap| async move { serve("", &h) }))
        .route(
            "/ui/{*path}",
            get(|Path(path): Path<String>, h: HeaderMap| async move { serve(&path, &h) }),
        )
}

fn serve(path: &str, headers: &HeaderMap) -> Response {
    let Some(asset) = aether_console::lookup(path) else {
        return Problem::new(
            StatusCode::NOT_FOUND,
            "Not found",
            format!("the console has no file /ui/{path}"),
        )
        .into_response();
    };
    let accepts_gzip = headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| coding.split(';').next().is_some_and(|c| c.trim() == "gzip"));
    let (body, gzipped) = match asset.gzipped().filter(|_| accepts_gzip) {
        Some(z) => (z, true),
        None => (asset.bytes, false),
    };
    let cache = if asset.immutable {
        "public, max-age=31536000, immutable"
    } else {
        "no-cache"
    };
    let mut response = (
        [
            (header::CONTENT_TYPE, asset.content_type),
            (header::CACHE_CONTROL, cache),
            (header::VARY, "Accept-Encoding"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        ],
        body,
    )
        .into_response();
    if gzipped {
        response
            .headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    response
}

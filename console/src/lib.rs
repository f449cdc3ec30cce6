//! The console's web assets, built from `console/web` by Vite into `console/dist` (which is
//! committed, so neither the README's commands nor CI's build need Node), embedded at
//! compile time.
//!
//! [`lookup`] maps a path under `/ui/` to what to send: a file of the build, or the page
//! itself for any path without an extension (the console routes in the browser, so a
//! shared link such as `/ui/lineage?node=…` must load the page).

use std::collections::HashMap;
use std::io::Write;
use std::sync::OnceLock;

use include_dir::{Dir, include_dir};

static DIST: Dir<'static> = include_dir!("$CARGO_MANIFEST_DIR/dist");

/// The page every console route loads.
pub const INDEX: &str = "index.html";

/// One file of the build.
#[derive(Clone, Copy, Debug)]
pub struct Asset {
    /// The path under `/ui/` it was found at.
    pub path: &'static str,
    pub bytes: &'static [u8],
    pub content_type: &'static str,
    /// Vite names a file under `assets/` by a hash of its contents: it never changes, so a
    /// browser may keep it for good. The page itself must be asked for again each time.
    pub immutable: bool,
}

impl Asset {
    /// The asset gzip-compressed, made once per process, when compressing it saves space.
    pub fn gzipped(&self) -> Option<&'static [u8]> {
        static CACHE: OnceLock<HashMap<&'static str, Option<Vec<u8>>>> = OnceLock::new();
        CACHE
            .get_or_init(|| {
                files()
                    .map(|a| {
                        (
                            a.path,
                            compressible(a.content_type)
                                .then(|| gzip(a.bytes))
                                .flatten(),
                        )
                    })
                    .collect()
            })
            .get(self.path)
            .and_then(|z| z.as_deref())
    }
}

/// What `/ui/<path>` answers: the file at `path`, else the page (a route: a decision's
/// request id may hold a dot), except under `assets/`, where a missing file is `None`: a
/// stale page asking for an old build's script must fail, not get HTML.
pub fn lookup(path: &str) -> Option<Asset> {
    let path = path.trim_start_matches('/');
    match file(path) {
        Some(found) => Some(found),
        None if path.starts_with("assets/") => None,
        None => file(INDEX),
    }
}

fn file(path: &str) -> Option<Asset> {
    let f = DIST.get_file(path)?;
    Some(asset(f))
}

fn asset(f: &'static include_dir::File<'static>) -> Asset {
    let path = f.path().to_str().unwrap_or_default();
    Asset {
        path,
        bytes: f.contents(),
        content_type: content_type(path),
        immutable: path.starts_with("assets/"),
    }
}

/// Every file of the build.
pub fn files() -> impl Iterator<Item = Asset> {
    fn walk(dir: &'static Dir<'static>, out: &mut Vec<Asset>) {
        for f in dir.files() {
            out.push(asset(f));
        }
        for d in dir.dirs() {
            walk(d, out);
        }
    }
    let mut out = Vec::new();
    walk(&DIST, &mut out);
    out.into_iter()
}

fn content_type(path: &str) -> &'static str {
    match path.rsplit('.').next().unwrap_or_default() {
        "html" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" | "map" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "woff2" => "font/woff2",
        "txt" => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

fn compressible(content_type: &str) -> bool {
    content_type.starts_with("text/")
        || content_type.starts_with("application/json")
        || content_type.starts_with("image/svg")
}

fn gzip(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(bytes).ok()?;
    let out = encoder.finish().ok()?;
    (out.len() < bytes.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_load_the_page_and_files_load_themselves() {
        let page = lookup("/").expect("the page");
        assert_eq!(page.path, INDEX);
        assert!(!page.immutable);
        assert_eq!(lookup("lineage").expect("a route").path, INDEX);
        assert_eq!(lookup("decisions/req-1").expect("a route").path, INDEX);
        assert_eq!(lookup("decisions/req.2026.1").expect("a route").path, INDEX);
        assert!(lookup("assets/missing.js").is_none());
        for f in files() {
            let found = lookup(f.path).expect("every file is found at its path");
            assert_eq!(found.bytes, f.bytes);
        }
    }

    #[test]
    fn the_page_is_html_and_compresses_to_what_it_was() {
        let page = lookup("").expect("the page");
        assert!(page.content_type.starts_with("text/html"));
        assert!(
            std::str::from_utf8(page.bytes)
                .expect("utf-8")
                .contains("<html")
        );
        if let Some(z) = page.gzipped() {
            let mut out = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(z), &mut out)
                .expect("gunzip");
            assert_eq!(out, page.bytes);
        }
    }
}

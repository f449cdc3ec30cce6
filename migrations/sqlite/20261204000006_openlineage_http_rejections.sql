-- Owned by the lineage crate: events the OPENLINEAGE_URL endpoint refused for their content
-- (HTTP 400, 413, 422). The HTTP transport moves past such an event so that one bad record
-- cannot hold back all later lineage, but it is never dropped silently: the row stays until
-- a later attempt (one on every start) is accepted, and `aether lineage reconcile` lists it.
CREATE TABLE openlineage_http_rejections (
    seq         INTEGER PRIMARY KEY REFERENCES events (seq),
    endpoint    TEXT    NOT NULL, -- the URL that answered, without credentials
    http_status INTEGER NOT NULL,
    response    TEXT    NOT NULL, -- the start of the response body (at most 1 KiB)
    rejected_at INTEGER NOT NULL  -- microseconds since the Unix epoch, UTC
);

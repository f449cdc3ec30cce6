-- Events by the request id in their metadata (see the PostgreSQL migration of the same
-- name). Queries must use exactly this expression.
CREATE INDEX events_request_id ON events (json_extract(metadata, '$.request_id'))
    WHERE json_extract(metadata, '$.request_id') IS NOT NULL;

-- Console sessions (`POST /v1/session`); see the PostgreSQL migration of the same date.
-- Times are microseconds since the Unix epoch, as elsewhere in the SQLite schema.
CREATE TABLE console_sessions (
    id_digest  BLOB    PRIMARY KEY,
    actor      TEXT    NOT NULL,
    role       TEXT    NOT NULL CHECK (role IN ('operator', 'regulator')),
    csrf       TEXT    NOT NULL,
    expires_at INTEGER NOT NULL,
    closed_at  INTEGER
);
CREATE INDEX console_sessions_expires ON console_sessions (expires_at);

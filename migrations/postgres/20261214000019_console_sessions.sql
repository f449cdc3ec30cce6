-- Console sessions (`POST /v1/session`), shared by every node of a cluster so that a
-- person signed in through one node is signed in on all, and signed out on all at once.
-- Only the SM3 digest of the cookie's session id is kept.
CREATE TABLE console_sessions (
    id_digest  BYTEA       PRIMARY KEY,
    actor      TEXT        NOT NULL,
    role       TEXT        NOT NULL CHECK (role IN ('operator', 'regulator')),
    csrf       TEXT        NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    closed_at  TIMESTAMPTZ
);
CREATE INDEX console_sessions_expires ON console_sessions (expires_at);

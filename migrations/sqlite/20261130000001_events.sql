-- The ledger: one row per event, hash-chained. Written only by the ledger's group-commit writer.
CREATE TABLE events (
    seq            INTEGER PRIMARY KEY CHECK (seq >= 1),
    stream_id      TEXT    NOT NULL,
    stream_version INTEGER NOT NULL CHECK (stream_version >= 1),
    event_id       BLOB    NOT NULL UNIQUE CHECK (length(event_id) = 16),
    event_type     TEXT    NOT NULL,
    schema_version INTEGER NOT NULL,
    payload        TEXT    NOT NULL, -- RFC 8785 text, exactly the bytes hashed
    metadata       TEXT    NOT NULL, -- RFC 8785 text, exactly the bytes hashed
    recorded_at    INTEGER NOT NULL, -- microseconds since the Unix epoch, UTC
    prev_hash      BLOB    NOT NULL CHECK (length(prev_hash) = 32),
    hash           BLOB    NOT NULL CHECK (length(hash) = 32),
    UNIQUE (stream_id, stream_version)
);

CREATE INDEX events_recorded_at ON events (recorded_at);
CREATE INDEX events_event_type ON events (event_type, seq);

-- Append-only, enforced by the database itself (SQLite has no TRUNCATE; a DELETE without
-- WHERE fires these triggers too, which turns off its truncate optimisation).
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN
    SELECT RAISE(ABORT, 'aether ledger is append-only: UPDATE on events is not allowed');
END;

CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN
    SELECT RAISE(ABORT, 'aether ledger is append-only: DELETE on events is not allowed');
END;

-- Where each named subscriber (lineage relay, projections, checkpointer) has got to.
CREATE TABLE subscription_positions (
    name       TEXT    PRIMARY KEY,
    position   INTEGER NOT NULL CHECK (position >= 0),
    updated_at INTEGER NOT NULL
);

-- The ledger: one row per event, hash-chained. Written only by the ledger's group-commit writer.
CREATE TABLE events (
    seq            BIGINT      PRIMARY KEY CHECK (seq >= 1),
    stream_id      TEXT        NOT NULL,
    stream_version BIGINT      NOT NULL CHECK (stream_version >= 1),
    event_id       UUID        NOT NULL UNIQUE,
    event_type     TEXT        NOT NULL,
    schema_version INTEGER     NOT NULL,
    payload        TEXT        NOT NULL, -- RFC 8785 text, exactly the bytes hashed
    metadata       TEXT        NOT NULL, -- RFC 8785 text, exactly the bytes hashed
    recorded_at    TIMESTAMPTZ NOT NULL,
    prev_hash      BYTEA       NOT NULL CHECK (octet_length(prev_hash) = 32),
    hash           BYTEA       NOT NULL CHECK (octet_length(hash) = 32),
    UNIQUE (stream_id, stream_version)
);

CREATE INDEX events_recorded_at ON events (recorded_at);
CREATE INDEX events_event_type ON events (event_type, seq);

-- Append-only, enforced by the database itself: UPDATE, DELETE and TRUNCATE are refused
-- whatever the client. Only a superuser disabling the triggers can get past this, and
-- `aether verify` then names the altered seq.
CREATE FUNCTION aether_events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'aether ledger is append-only: % on events is not allowed', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER events_no_update_delete
    BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION aether_events_append_only();

CREATE TRIGGER events_no_truncate
    BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION aether_events_append_only();

REVOKE UPDATE, DELETE, TRUNCATE ON events FROM PUBLIC;

-- Where each named subscriber (lineage relay, projections, checkpointer) has got to.
CREATE TABLE subscription_positions (
    name       TEXT        PRIMARY KEY,
    position   BIGINT      NOT NULL CHECK (position >= 0),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Singleton duties (checkpointer, lineage relays, rollout controllers, snapshot coordinator)
-- run on one node of a cluster at a time, under a lease kept here. Each change of holder
-- raises the lease's fencing token; an event whose metadata names a lease and token
-- (`"fence": {"lease": …, "token": …}`) is stored only while that token is the lease's
-- current one and the lease has not expired, so a holder that was paused past its lease
-- cannot write under it: the database refuses the row, not the holder's good manners.
CREATE TABLE leases (
    name        TEXT        PRIMARY KEY,
    holder      TEXT        NOT NULL,
    token       BIGINT      NOT NULL CHECK (token >= 1),
    acquired_at TIMESTAMPTZ NOT NULL,
    renewed_at  TIMESTAMPTZ NOT NULL,
    expires_at  TIMESTAMPTZ NOT NULL
);

CREATE FUNCTION aether_events_fence() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    fence jsonb := NEW.metadata::jsonb -> 'fence';
    current_token BIGINT;
BEGIN
    IF fence IS NULL THEN
        RETURN NEW;
    END IF;
    -- FOR SHARE: a takeover (an UPDATE of this row) waits for this transaction, so no row
    -- checked under the old token commits after the new holder got its token.
    SELECT token INTO current_token FROM leases
        WHERE name = fence ->> 'lease' AND expires_at > clock_timestamp()
        FOR SHARE;
    IF current_token IS NULL OR current_token <> (fence ->> 'token')::bigint THEN
        RAISE EXCEPTION 'fenced: lease % is not held under token % (current: %)',
            fence ->> 'lease', fence ->> 'token', coalesce(current_token::text, 'expired or none')
            USING ERRCODE = 'AE001';
    END IF;
    RETURN NEW;
END;
$$;

-- Only rows whose metadata has a top-level-looking "fence" member pay for the check
-- (canonical JSON writes a member name as `"fence":`; the function reads the real value).
CREATE TRIGGER events_fence
    BEFORE INSERT ON events
    FOR EACH ROW
    WHEN (position('"fence":' in NEW.metadata) > 0)
    EXECUTE FUNCTION aether_events_fence();

-- One decision per member and request id, whichever node or process decided it: the
-- database refuses a second `ClearingDecided` for the same stream and request id.
CREATE UNIQUE INDEX events_one_decision ON events (stream_id, request_id)
    WHERE event_type = 'ClearingDecided';

-- The cluster's checkpoint public key (and other facts every node must agree on): the
-- first node records it; a node started with another key refuses to start.
CREATE TABLE ledger_settings (
    name       TEXT        PRIMARY KEY,
    value      TEXT        NOT NULL,
    set_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The nodes of the cluster: each `aether serve` on this database beats here every second.
CREATE TABLE cluster_nodes (
    node_id      TEXT        PRIMARY KEY,
    http_address TEXT        NOT NULL,
    grpc_address TEXT        NOT NULL,
    version      TEXT        NOT NULL,
    started_at   TIMESTAMPTZ NOT NULL,
    heartbeat_at TIMESTAMPTZ NOT NULL
);

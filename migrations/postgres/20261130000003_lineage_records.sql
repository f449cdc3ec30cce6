-- Owned by the lineage crate: each ledger event's two lineage records. Written by the relay
-- (idempotent by seq), never by the ledger writer.
CREATE TABLE lineage_records (
    seq               BIGINT      PRIMARY KEY REFERENCES events (seq),
    event_id          UUID        NOT NULL,
    run_id            UUID        NOT NULL,
    job               TEXT        NOT NULL,
    openlineage_event TEXT        NOT NULL, -- the RunEvent as sent, JSON
    openlineage_at    TIMESTAMPTZ NOT NULL,
    delta_table       TEXT,
    delta_version     BIGINT,
    delta_at          TIMESTAMPTZ
);
CREATE INDEX lineage_records_run ON lineage_records (run_id);

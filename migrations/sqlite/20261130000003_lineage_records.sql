-- Owned by the lineage crate: each ledger event's two lineage records. Written by the relay
-- (idempotent by seq), never by the ledger writer.
CREATE TABLE lineage_records (
    seq               INTEGER PRIMARY KEY REFERENCES events (seq),
    event_id          BLOB    NOT NULL,
    run_id            BLOB    NOT NULL,
    job               TEXT    NOT NULL,
    openlineage_event TEXT    NOT NULL, -- the RunEvent as sent, JSON
    openlineage_at    INTEGER NOT NULL, -- microseconds since the Unix epoch
    delta_table       TEXT,
    delta_version     INTEGER,
    delta_at          INTEGER
);
CREATE INDEX lineage_records_run ON lineage_records (run_id);

-- Owned by the lineage crate: OpenLineage events sent to Aether by other producers
-- (`POST /api/v1/lineage`, e.g. the feature pipeline behind a model's training data),
-- validated against the OpenLineage 2-0-2 spec before they are stored, and joined with
-- Aether's own records (lineage_records) into one graph. Stored once per distinct event:
-- a producer that resends after a timeout does not duplicate it.
CREATE TABLE external_lineage_events (
    id            INTEGER PRIMARY KEY AUTOINCREMENT, -- arrival order
    digest        TEXT    NOT NULL UNIQUE, -- SM3 (hex) of the event's RFC 8785 form
    kind          TEXT    NOT NULL CHECK (kind IN ('RUN', 'DATASET', 'JOB')),
    event_time    INTEGER NOT NULL, -- the event's eventTime, microseconds since the Unix epoch
    run_id        TEXT,             -- run.runId, lowercase, for run events
    job_namespace TEXT,
    job_name      TEXT,
    event         TEXT    NOT NULL, -- the event as received, JSON
    received_at   INTEGER NOT NULL, -- microseconds since the Unix epoch
    actor         TEXT    NOT NULL  -- who sent it, as in event metadata (role:fingerprint)
);
CREATE INDEX external_lineage_events_time ON external_lineage_events (event_time, id);
CREATE INDEX external_lineage_events_run ON external_lineage_events (run_id);

-- Owned by the lineage crate: one row per Delta Lake commit of the relay, naming the seq
-- range it holds. An event's Delta version is the commit whose range covers its seq, so
-- the link is one row per commit (thousands of events) rather than one update per event.
-- Written after the Delta commit; rebuilt from the Delta log (its commit metadata) when a
-- crash came in between, so the Delta log is the truth and this table its index.
CREATE TABLE delta_commits (
    delta_table  TEXT        NOT NULL,
    version      BIGINT      NOT NULL,
    first_seq    BIGINT      NOT NULL,
    last_seq     BIGINT      NOT NULL,
    last_hash    TEXT        NOT NULL,
    committed_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (delta_table, version),
    CHECK (first_seq >= 1 AND last_seq >= first_seq)
);
CREATE UNIQUE INDEX delta_commits_last_seq ON delta_commits (delta_table, last_seq);

-- The per-event Delta columns were never written: the link lives in delta_commits.
ALTER TABLE lineage_records DROP COLUMN delta_table;
ALTER TABLE lineage_records DROP COLUMN delta_version;
ALTER TABLE lineage_records DROP COLUMN delta_at;

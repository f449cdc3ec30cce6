-- Owned by the lineage crate: one row per Delta Lake commit of the relay, naming the seq
-- range it holds (see the PostgreSQL migration of the same name for the reasoning).
CREATE TABLE delta_commits (
    delta_table  TEXT    NOT NULL,
    version      INTEGER NOT NULL,
    first_seq    INTEGER NOT NULL,
    last_seq     INTEGER NOT NULL,
    last_hash    TEXT    NOT NULL,
    committed_at INTEGER NOT NULL, -- microseconds since the Unix epoch
    PRIMARY KEY (delta_table, version),
    CHECK (first_seq >= 1 AND last_seq >= first_seq)
);
CREATE UNIQUE INDEX delta_commits_last_seq ON delta_commits (delta_table, last_seq);

ALTER TABLE lineage_records DROP COLUMN delta_table;
ALTER TABLE lineage_records DROP COLUMN delta_version;
ALTER TABLE lineage_records DROP COLUMN delta_at;

-- A scoring batch is one OpenLineage record; see the PostgreSQL migration of the same date.
ALTER TABLE lineage_records ADD COLUMN last_seq INTEGER;

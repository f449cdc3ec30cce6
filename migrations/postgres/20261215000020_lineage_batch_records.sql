-- A scoring batch (its NettingComputed event and the ClearingDecided events appended with
-- it) is one OpenLineage record, keyed by the netting's seq: last_seq is the batch's last
-- decision. NULL (records written before) means the record covers its own seq only. The
-- record covering a seq is the one with the greatest seq at or before it (the primary key
-- finds it) whose COALESCE(last_seq, seq) reaches it.
ALTER TABLE lineage_records ADD COLUMN last_seq BIGINT;

-- A job's runs, newest first (the console's and Marquez's `GET .../jobs/{job}/runs`): without
-- it, a rare job's runs are found by scanning every lineage record.
CREATE INDEX lineage_records_job ON lineage_records (job, seq);

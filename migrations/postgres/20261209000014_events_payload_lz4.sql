-- LZ4 instead of pglz for event payloads and metadata over the 2 KB TOAST threshold.
--
-- Why: under clearing load the batch netting events (`NettingComputed`, one per scored
-- batch) carry ~7–8 KB payloads, which PostgreSQL compresses before storing; pglz was
-- 2.2 % of the database's CPU in the clearing bench (`perf record -a`), LZ4 compresses
-- several times faster at a similar ratio on JSON. Only new values are compressed with
-- LZ4; stored ones keep pglz and read as before. The text (and so every hash) is unchanged.
-- Servers built without LZ4 keep pglz.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE events ALTER COLUMN payload SET COMPRESSION lz4';
    EXECUTE 'ALTER TABLE events ALTER COLUMN metadata SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    RAISE NOTICE 'events keeps pglz: %', SQLERRM;
END;
$$;

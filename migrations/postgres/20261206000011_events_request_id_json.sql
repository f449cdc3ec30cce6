-- The request-id index, cheaper to keep up on every append: `metadata::json ->> …` reads
-- the stored text where `::jsonb` built a binary document first, and without the partial
-- predicate the member is extracted once per row instead of twice (events without a
-- request id are indexed under NULL). Measured on 20,000-row inserts of clearing metadata
-- (~330 bytes): ~13 µs of server time per row for the old index, ~8 µs for this one.
-- Queries must use exactly this expression: `(metadata::json ->> 'request_id')`.
-- The metadata is RFC 8785 text, so `json` and `jsonb` give the same member values.
DROP INDEX IF EXISTS events_request_id;
CREATE INDEX events_request_id ON events ((metadata::json ->> 'request_id'));

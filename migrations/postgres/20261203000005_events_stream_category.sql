-- Events by stream category (the stream id up to its first '/': `engine`, `policy`,
-- `clearing`), in seq order. Control-plane projections and time travel read a few
-- categories of a ledger dominated by others; with this index their reads cost what they
-- return, not the ledger's size. Queries must use exactly this expression.
CREATE INDEX events_stream_category ON events (split_part(stream_id, '/', 1), seq);

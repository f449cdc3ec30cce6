-- Events by stream category (the stream id up to its first '/': `engine`, `policy`,
-- `clearing`), in seq order. Control-plane projections and time travel read a few
-- categories of a ledger dominated by others; with this index their reads cost what they
-- return, not the ledger's size. SQLite uses an index on an expression only for queries
-- with the same expression, so the store writes exactly this one.
CREATE INDEX events_stream_category ON events (substr(stream_id, 1, instr(stream_id || '/', '/') - 1), seq);

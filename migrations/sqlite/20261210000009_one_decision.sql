-- One decision per member and request id (see the PostgreSQL migration of the same date):
-- the database refuses a second `ClearingDecided` for the same stream and request id.
CREATE UNIQUE INDEX events_one_decision
    ON events (stream_id, json_extract(metadata, '$.request_id'))
    WHERE event_type = 'ClearingDecided';

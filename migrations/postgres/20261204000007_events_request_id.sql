-- Events by the request id in their metadata: the clearing gateway's idempotency check
-- ("was this (member, request_id) decided already?") and the audit API's decision lookup.
-- Without it every lookup reads every decision. Queries must use exactly this expression.
CREATE INDEX events_request_id ON events ((metadata::jsonb ->> 'request_id'))
    WHERE (metadata::jsonb ->> 'request_id') IS NOT NULL;

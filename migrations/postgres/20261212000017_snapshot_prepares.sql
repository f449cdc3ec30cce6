-- A consistent snapshot prepares on every live node of a cluster: the node that takes it
-- asks each other live node here, and each answers with the digest of its own gateway,
-- rule engine and RAG state (or why it cannot prepare). Every answer must equal the taking
-- node's, else the snapshot is aborted: no snapshot names a state some live node is not in.
CREATE TABLE snapshot_prepares (
    snapshot_id  TEXT        NOT NULL,
    node_id      TEXT        NOT NULL,
    requested_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    deadline     TIMESTAMPTZ NOT NULL,
    answered_at  TIMESTAMPTZ,
    digest       TEXT,
    error        TEXT,
    PRIMARY KEY (snapshot_id, node_id)
);

CREATE INDEX snapshot_prepares_pending ON snapshot_prepares (node_id) WHERE answered_at IS NULL;

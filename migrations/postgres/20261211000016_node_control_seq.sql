-- How far each node has applied the control plane recorded through the others (the seq
-- its follower had reached), reported with its heartbeat: a rollback's answer names the
-- nodes where it is not in force yet.
ALTER TABLE cluster_nodes ADD COLUMN control_seq BIGINT NOT NULL DEFAULT 0;

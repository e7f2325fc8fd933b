-- Fences: what a job lost with its node (the node's heartbeats stopped) held there: its
-- devices and its cores, RAM, slots and GPU memory. The job is over for placement (`lost`,
-- perhaps retried elsewhere), but its processes may still run on the node, cut off rather than
-- down; so what it held stays held until the node's executor reports that grant's end (the
-- cancel placement sent at the loss reaches it when the node is back). docs/operations.md,
-- "A node cut off".
CREATE TABLE fences (
    grant_id text   NOT NULL,
    node_id  text   NOT NULL,
    job_id   text   NOT NULL,
    -- 'device': resource is the mode held ('exclusive', 'shared'), amount the device index;
    -- 'reservation': resource and amount as in reservations.
    kind     text   NOT NULL CHECK (kind IN ('device', 'reservation')),
    resource text   NOT NULL,
    amount   bigint NOT NULL,
    since    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX fences_grant_idx ON fences (grant_id, node_id);
CREATE INDEX fences_node_idx ON fences (node_id);

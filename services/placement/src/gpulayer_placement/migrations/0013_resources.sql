-- Host cores, RAM, executor job slots and shared GPU memory (issue 13), next to the device
-- allocations and with the same guarantee: whatever replicas race, the database refuses a
-- placement that takes a node past what it offers.

-- What a node offers and what its jobs hold, per resource: 'cpu' (millicores), 'memory'
-- (bytes), 'slots' (jobs), 'gpu_memory:<device index>' (MiB). ``used`` is kept equal to the
-- sum of the node's reservations by the triggers below; ``capacity`` NULL: not known, no limit.
CREATE TABLE node_resources (
    node_id  text   NOT NULL,
    resource text   NOT NULL,
    capacity bigint,
    used     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (node_id, resource)
);

-- One row per resource a placed or running job holds. Released (deleted) when the job ends,
-- like its allocations. ``capacity``: what the placing replica matched against, recorded in
-- node_resources (a replica that doesn't know it sends NULL and the last known one stays).
CREATE TABLE reservations (
    job_id   text   NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    node_id  text   NOT NULL,
    resource text   NOT NULL,
    amount   bigint NOT NULL CHECK (amount > 0),
    capacity bigint,
    PRIMARY KEY (job_id, resource)
);
CREATE INDEX reservations_node_idx ON reservations (node_id);

-- After each statement that reserves: add to the nodes' usage (rows locked in key order, so
-- two replicas' batches don't deadlock), then refuse the whole statement if any node it
-- touched is past its capacity. SQLSTATE 23514 (check_violation): placement reloads and
-- matches again, as for a device conflict.
CREATE FUNCTION gpulayer_reserve() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    over record;
BEGIN
    INSERT INTO node_resources AS n (node_id, resource, capacity, used)
    SELECT node_id, resource, max(capacity), sum(amount)
    FROM added GROUP BY node_id, resource ORDER BY node_id, resource
    ON CONFLICT (node_id, resource) DO UPDATE
    SET used = n.used + EXCLUDED.used, capacity = coalesce(EXCLUDED.capacity, n.capacity);
    SELECT n.node_id, n.resource, n.used, n.capacity INTO over
    FROM node_resources n
    JOIN (SELECT DISTINCT node_id, resource FROM added) a USING (node_id, resource)
    WHERE n.used > n.capacity
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'node % would hold % of its % %', over.node_id, over.used,
            over.capacity, over.resource
            USING ERRCODE = 'check_violation', CONSTRAINT = 'node_resources_within_capacity';
    END IF;
    RETURN NULL;
END $$;

CREATE FUNCTION gpulayer_unreserve() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Locked in key order first, as gpulayer_reserve does: an UPDATE ... FROM takes its rows
    -- in whatever order its join produces, and two replicas' releases would deadlock.
    PERFORM 1 FROM node_resources n
    WHERE (n.node_id, n.resource) IN (SELECT node_id, resource FROM gone)
    ORDER BY n.node_id, n.resource
    FOR UPDATE;
    UPDATE node_resources n SET used = greatest(n.used - g.amount, 0)
    FROM (SELECT node_id, resource, sum(amount) AS amount FROM gone
          GROUP BY node_id, resource ORDER BY node_id, resource) g
    WHERE n.node_id = g.node_id AND n.resource = g.resource;
    RETURN NULL;
END $$;

CREATE TRIGGER reservations_reserve AFTER INSERT ON reservations
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION gpulayer_reserve();
CREATE TRIGGER reservations_unreserve AFTER DELETE ON reservations
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION gpulayer_unreserve();

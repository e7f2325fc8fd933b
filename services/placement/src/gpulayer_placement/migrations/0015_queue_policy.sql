-- Queue policy (issue 15 part A): priority, per-owner quotas, fair share, preemption.
-- docs/placement-rules.md "Order of decisions" says how each is used.

-- A job's priority and preemptibility, copied from its request at insert (indexable).
-- ``preempted_for``: the job this one is being cancelled for; its executor's 'cancelled' report
-- then puts it back to 'pending' (apply_status) instead of ending it.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS priority int NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS preemptible boolean NOT NULL DEFAULT false;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS preempted_for text;
-- Waiting jobs are taken highest priority first, then oldest (fair share reorders each page
-- in memory). The negated priority keeps one ascending row comparison for the page cursor.
CREATE INDEX IF NOT EXISTS jobs_pending_priority_idx
    ON jobs ((-priority), submitted_at, job_id) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS jobs_preemptible_idx
    ON jobs (priority) WHERE preemptible AND state IN ('placed', 'running');

-- Quotas, per owner and resource: 'jobs' (placed or running jobs), 'cores' (millicores, as the
-- 'cpu' reservation), 'gpus:<accelerator>' (devices). Owner '*' is the default: an owner's
-- own row for a resource replaces the default's for that resource. No row: no limit.
CREATE TABLE IF NOT EXISTS quotas (
    owner    text   NOT NULL,
    resource text   NOT NULL,
    max      bigint NOT NULL CHECK (max >= 0),
    PRIMARY KEY (owner, resource)
);

-- What each placed or running job counts against its owner's quota, and since when (its
-- GPU-seconds for fair share). Written by place_jobs; deleted when the job's reservations are
-- (the job ended, was lost, or was requeued), by the trigger below.
CREATE TABLE IF NOT EXISTS owner_holds (
    job_id      text        PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
    owner       text        NOT NULL,
    accelerator text,
    gpus        int         NOT NULL DEFAULT 0,
    millicores  bigint      NOT NULL DEFAULT 0,
    placed_at   timestamptz NOT NULL DEFAULT now()
);

-- Per owner and resource: the sum of owner_holds, kept by the triggers below (row locks in key
-- order serialize replicas, as node_resources does for nodes).
CREATE TABLE IF NOT EXISTS owner_usage (
    owner    text   NOT NULL,
    resource text   NOT NULL,
    used     bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, resource)
);

-- Fair share: GPU-seconds of ended holds per owner, decayed with a half-life of one day
-- (gpulayer_fair_share_half_life_s): worth half as much a day later, a quarter after two.
CREATE TABLE IF NOT EXISTS fair_share (
    owner       text             PRIMARY KEY,
    gpu_seconds double precision NOT NULL DEFAULT 0,
    as_of       timestamptz      NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION gpulayer_fair_share_half_life_s() RETURNS double precision
    LANGUAGE sql IMMUTABLE AS 'SELECT 86400.0::double precision';

-- The quota a resource of an owner is held to: its own row, else the default's; NULL: none.
CREATE OR REPLACE FUNCTION gpulayer_quota(o text, r text) RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT max FROM quotas WHERE owner = o AND resource = r),
                    (SELECT max FROM quotas WHERE owner = '*' AND resource = r))
$$;

-- After each statement that adds holds: add to the owners' usage (rows locked in key order),
-- then refuse the whole statement if an owner it touched is past a quota. SQLSTATE 23514
-- (check_violation): placement reloads and matches again, as for a node past its capacity.
CREATE OR REPLACE FUNCTION gpulayer_hold() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    over record;
BEGIN
    INSERT INTO owner_usage AS u (owner, resource, used)
    SELECT owner, resource, sum(amount) FROM (
        SELECT owner, 'jobs' AS resource, 1::bigint AS amount FROM added
        UNION ALL SELECT owner, 'cores', millicores FROM added
        UNION ALL SELECT owner, 'gpus:' || accelerator, gpus FROM added
            WHERE gpus > 0 AND accelerator IS NOT NULL
    ) h GROUP BY owner, resource ORDER BY owner, resource
    ON CONFLICT (owner, resource) DO UPDATE SET used = u.used + EXCLUDED.used;
    SELECT u.owner, u.resource, u.used, gpulayer_quota(u.owner, u.resource) AS max INTO over
    FROM owner_usage u
    WHERE u.owner IN (SELECT owner FROM added)
      AND u.used > gpulayer_quota(u.owner, u.resource)
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'owner % would hold %/% %', over.owner, over.used, over.max,
            over.resource
            USING ERRCODE = 'check_violation', CONSTRAINT = 'owner_within_quota';
    END IF;
    RETURN NULL;
END $$;

-- After each statement that removes holds: take them off the owners' usage and add their
-- GPU-seconds to fair share (the old sum decayed to now first).
CREATE OR REPLACE FUNCTION gpulayer_unhold() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM owner_usage u WHERE u.owner IN (SELECT owner FROM gone)
    ORDER BY u.owner, u.resource FOR UPDATE;
    UPDATE owner_usage u SET used = greatest(u.used - g.amount, 0)
    FROM (SELECT owner, resource, sum(amount) AS amount FROM (
              SELECT owner, 'jobs' AS resource, 1::bigint AS amount FROM gone
              UNION ALL SELECT owner, 'cores', millicores FROM gone
              UNION ALL SELECT owner, 'gpus:' || accelerator, gpus FROM gone
                  WHERE gpus > 0 AND accelerator IS NOT NULL
          ) h GROUP BY owner, resource) g
    WHERE u.owner = g.owner AND u.resource = g.resource;
    INSERT INTO fair_share AS f (owner, gpu_seconds, as_of)
    SELECT owner, sum(gpus * greatest(extract(epoch FROM now() - placed_at), 0)), now()
    FROM gone WHERE gpus > 0 GROUP BY owner ORDER BY owner
    ON CONFLICT (owner) DO UPDATE
    SET gpu_seconds = f.gpu_seconds * power(0.5, greatest(extract(epoch FROM now() - f.as_of), 0)
                          / gpulayer_fair_share_half_life_s()) + EXCLUDED.gpu_seconds,
        as_of = now();
    RETURN NULL;
END $$;

-- A job's holds go with its reservations (every placed job reserves at least a slot), so every
-- path that ends or requeues a job releases its quota without knowing about quotas.
CREATE OR REPLACE FUNCTION gpulayer_release_holds() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM owner_holds h USING (SELECT DISTINCT job_id FROM gone) g
    WHERE h.job_id = g.job_id;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS owner_holds_hold ON owner_holds;
CREATE TRIGGER owner_holds_hold AFTER INSERT ON owner_holds
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION gpulayer_hold();
DROP TRIGGER IF EXISTS owner_holds_unhold ON owner_holds;
CREATE TRIGGER owner_holds_unhold AFTER DELETE ON owner_holds
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION gpulayer_unhold();
DROP TRIGGER IF EXISTS reservations_release_holds ON reservations;
CREATE TRIGGER reservations_release_holds AFTER DELETE ON reservations
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION gpulayer_release_holds();

-- Jobs already placed or running when this runs count from now on (their start is unknown here:
-- their last update stands in for it).
INSERT INTO owner_holds (job_id, owner, accelerator, gpus, millicores, placed_at)
SELECT j.job_id, j.owner, j.accelerator, cardinality(j.devices),
       coalesce((SELECT r.amount FROM reservations r WHERE r.job_id = j.job_id AND r.resource = 'cpu'), 0),
       j.updated_at
FROM jobs j WHERE j.state IN ('placed', 'running')
ON CONFLICT (job_id) DO NOTHING;

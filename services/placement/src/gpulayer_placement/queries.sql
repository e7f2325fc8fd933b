-- Every SQL statement of the placement service, called by name from store.Store.

-- name: upsert_nodes
-- Capabilities only move forward in time: a late, older event never overwrites a newer one.
INSERT INTO nodes (node_id, capabilities, platform, agent_version, detected_at, last_seen, online)
SELECT n.node_id, n.capabilities::jsonb, n.platform, n.agent_version, n.detected_at, now(), true
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::timestamptz[])
     AS n(node_id, capabilities, platform, agent_version, detected_at)
ON CONFLICT (node_id) DO UPDATE
SET capabilities = EXCLUDED.capabilities, platform = EXCLUDED.platform,
    agent_version = EXCLUDED.agent_version, detected_at = EXCLUDED.detected_at,
    last_seen = now(), online = true
WHERE nodes.detected_at IS NULL OR nodes.detected_at <= EXCLUDED.detected_at;

-- name: touch_nodes
UPDATE nodes SET last_seen = greatest(nodes.last_seen, t.seen), online = true
FROM unnest($1::text[], $2::timestamptz[]) AS t(node_id, seen)
WHERE nodes.node_id = t.node_id
RETURNING nodes.node_id;

-- name: load_nodes
SELECT node_id, capabilities::text AS capabilities, online, last_seen FROM nodes;

-- name: load_holds
-- What nodes' jobs hold, in one snapshot: devices ('device': device index, mode), reservations
-- ('reservation': job, resource, amount) and recorded capacities ('capacity': resource, value).
-- NULL for $1: every node.
SELECT 'device' AS kind, NULL AS job_id, node_id, mode AS resource, device_index::bigint AS amount
FROM allocations WHERE $1::text[] IS NULL OR node_id = ANY($1::text[])
UNION ALL
SELECT 'reservation', job_id, node_id, resource, amount
FROM reservations WHERE $1::text[] IS NULL OR node_id = ANY($1::text[])
UNION ALL
SELECT 'capacity', NULL, node_id, resource, capacity
FROM node_resources
WHERE capacity IS NOT NULL AND resource IN ('cpu', 'memory', 'slots')
  AND ($1::text[] IS NULL OR node_id = ANY($1::text[]));

-- name: set_offline
-- Nodes whose heartbeats stopped; their placed and running jobs are lost and release devices.
UPDATE nodes SET online = false WHERE node_id = ANY($1::text[]) AND online
RETURNING node_id;

-- name: lose_node_jobs
WITH lost AS (
    UPDATE jobs SET state = 'lost', reason = $2, updated_at = now()
    WHERE node_id = ANY($1::text[]) AND state IN ('placed', 'running')
    RETURNING job_id, node_id, owner
), released AS (
    DELETE FROM allocations a USING lost WHERE a.job_id = lost.job_id
), freed AS (
    DELETE FROM reservations r USING lost WHERE r.job_id = lost.job_id
)
SELECT job_id, node_id, owner FROM lost;

-- name: insert_jobs
-- $6: owners; NULL (a caller of an older version) is 'anonymous'.
INSERT INTO jobs (job_id, request, state, reason, traceparent, owner)
SELECT j.job_id, j.request::jsonb, j.state, j.reason, j.traceparent,
       coalesce(j.owner, 'anonymous')
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[])
     AS j(job_id, request, state, reason, traceparent, owner)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id;

-- name: take_pending
-- Oldest first, a page after ($2, $3). SKIP LOCKED lets several replicas split waiting jobs.
SELECT job_id, request::text AS request, reason, attempt, submitted_at, traceparent, owner
FROM jobs
WHERE state = 'pending' AND (submitted_at, job_id) > ($2::timestamptz, $3::text)
ORDER BY submitted_at, job_id
LIMIT $1
FOR UPDATE SKIP LOCKED;

-- name: take_jobs
SELECT job_id, request::text AS request, reason, attempt, submitted_at, traceparent, owner
FROM jobs
WHERE state = 'pending' AND job_id = ANY($1::text[])
ORDER BY submitted_at, job_id
FOR UPDATE SKIP LOCKED;

-- name: place_jobs
-- Notifications on 'gpulayer_allocations' carry '<replica>|<node>,<node>' (replica_sync.NOTIFY_CHANNEL).
-- One statement for a batch: hold the devices and the cores, RAM, slots and GPU memory, mark
-- the jobs placed, tell other replicas which nodes changed. The exclusion constraint (a device
-- held twice) or the reservations trigger (a node past its capacity) fails the whole statement.
WITH held AS (
    INSERT INTO allocations (job_id, node_id, device_index, mode)
    SELECT * FROM unnest($6::text[], $7::text[], $8::int[], $9::text[])
    RETURNING node_id
), reserved AS (
    INSERT INTO reservations (job_id, node_id, resource, amount, capacity)
    SELECT * FROM unnest($11::text[], $12::text[], $13::text[], $14::bigint[], $15::bigint[])
    RETURNING node_id
), placed AS (
    UPDATE jobs SET state = 'placed', node_id = p.node_id, grant_id = p.grant_id,
        accelerator = p.accelerator, devices = p.devices::int[], attempt = jobs.attempt + 1,
        reason = NULL, unsatisfiable = false, updated_at = now()
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[])
         AS p(job_id, node_id, grant_id, accelerator, devices)
    WHERE jobs.job_id = p.job_id
    RETURNING jobs.job_id
)
SELECT (SELECT count(*) FROM placed) AS placed,
       (SELECT pg_notify('gpulayer_allocations', $10 || '|' || string_agg(DISTINCT node_id, ','))
        FROM (SELECT node_id FROM held UNION SELECT node_id FROM reserved) AS changed
        HAVING count(*) > 0) AS notified;

-- name: mark_waiting
UPDATE jobs SET reason = w.reason, unsatisfiable = w.unsatisfiable, updated_at = now()
FROM unnest($1::text[], $2::text[], $3::bool[]) AS w(job_id, reason, unsatisfiable)
WHERE jobs.job_id = w.job_id;

-- name: apply_status
-- Executors' reports, in one statement: job rows updated, devices of finished jobs released,
-- other replicas told. Only the current grant on the node that holds it counts, and a finished
-- job stays finished, so a redelivered, stale or forged report changes nothing.
WITH s AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::text[])
         AS s(job_id, grant_id, node_id, state, exit_code, reason)
), changed AS (
    UPDATE jobs SET state = s.state, exit_code = s.exit_code, reason = s.reason, updated_at = now()
    FROM s
    WHERE jobs.job_id = s.job_id AND jobs.grant_id = s.grant_id AND jobs.node_id = s.node_id
      AND jobs.state IN ('placed', 'running')
      AND NOT (s.state = 'running' AND jobs.state = 'running')
    RETURNING jobs.job_id, jobs.node_id, jobs.state
), released AS (
    DELETE FROM allocations a USING changed c
    WHERE a.job_id = c.job_id AND c.state <> 'running'
    RETURNING a.job_id, a.node_id, a.device_index, a.mode
), freed AS (
    DELETE FROM reservations r USING changed c
    WHERE r.job_id = c.job_id AND c.state <> 'running'
    RETURNING r.node_id
)
SELECT c.job_id, c.node_id, c.state, r.device_index, r.mode,
       (SELECT pg_notify('gpulayer_allocations', $7 || '|' || string_agg(DISTINCT node_id, ','))
        FROM (SELECT node_id FROM released UNION SELECT node_id FROM freed) AS gone
        HAVING count(*) > 0) AS notified
FROM changed c LEFT JOIN released r ON r.job_id = c.job_id;

-- name: stale_placed
-- Placed jobs whose executor never said "running": re-send the grant (executors start a grant
-- at most once, so this is safe).
SELECT job_id, request::text AS request, node_id, grant_id, accelerator, devices, traceparent,
       owner, extract(epoch FROM now() - submitted_at)::float8 AS age_s
FROM jobs
WHERE state = 'placed' AND updated_at < now() - make_interval(secs => $1);

-- name: job_ages
-- Seconds since each job was stored (a redelivered submit re-announces only young jobs).
SELECT job_id, extract(epoch FROM now() - submitted_at)::float8 AS age_s
FROM jobs WHERE job_id = ANY($1::text[]);

-- name: touch_jobs
UPDATE jobs SET updated_at = now() WHERE job_id = ANY($1::text[]);

-- name: fail_pending
-- Waiting jobs that can't be matched at all (the matcher raised on them): failed, with why.
UPDATE jobs SET state = 'failed', reason = f.reason, updated_at = now()
FROM unnest($1::text[], $2::text[]) AS f(job_id, reason)
WHERE jobs.job_id = f.job_id AND jobs.state = 'pending';

-- name: cancel_pending
UPDATE jobs SET state = 'cancelled', reason = $2, updated_at = now()
WHERE job_id = $1 AND state = 'pending'
RETURNING job_id;

-- name: get_job
SELECT job_id, request::text AS request, state, submitted_at, updated_at, node_id, grant_id,
       accelerator, devices, exit_code, reason, unsatisfiable, attempt, owner
FROM jobs WHERE job_id = $1;

-- name: list_jobs
SELECT job_id, state, submitted_at, updated_at, node_id, accelerator, devices, exit_code, reason,
       owner
FROM jobs
WHERE ($1::text IS NULL OR state = $1)
ORDER BY submitted_at DESC, job_id
LIMIT $2;

-- name: list_nodes
SELECT node_id, capabilities::text AS capabilities, online, last_seen, first_seen,
       (SELECT count(*) FROM jobs j WHERE j.node_id = n.node_id AND j.state IN ('placed', 'running'))
           AS active_jobs
FROM nodes n ORDER BY node_id;

-- name: job_counts
SELECT state, count(*) AS n FROM jobs GROUP BY state;

-- name: pending_counts
SELECT unsatisfiable, count(*) AS n FROM jobs WHERE state = 'pending' GROUP BY unsatisfiable;

-- name: jobs_on_devices
-- Placed and running jobs holding any of devices $2 on node $1 (issue 17: a warning each when
-- one of its devices turns unhealthy).
SELECT DISTINCT a.job_id, j.owner, j.grant_id
FROM allocations a JOIN jobs j ON j.job_id = a.job_id
WHERE a.node_id = $1 AND a.device_index = ANY($2::int[]) AND j.state IN ('placed', 'running');

-- name: lose_device_jobs
-- Jobs holding any of devices $2 on node $1 are lost with reason $3 (the devices vanished from
-- the node's detection), their holds released.
WITH hit AS (
    SELECT DISTINCT job_id FROM allocations WHERE node_id = $1 AND device_index = ANY($2::int[])
), lost AS (
    UPDATE jobs j SET state = 'lost', reason = $3, updated_at = now()
    FROM hit WHERE j.job_id = hit.job_id AND j.state IN ('placed', 'running')
    RETURNING j.job_id, j.node_id, j.owner, j.grant_id
), released AS (
    DELETE FROM allocations a USING lost WHERE a.job_id = lost.job_id
), freed AS (
    DELETE FROM reservations r USING lost WHERE r.job_id = lost.job_id
)
SELECT job_id, node_id, owner, grant_id FROM lost;

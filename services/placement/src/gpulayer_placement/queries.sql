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
-- What nodes' jobs (and fences) hold, in one snapshot: devices ('device': device index, mode),
-- reservations ('reservation': job, resource, amount) and recorded capacities ('capacity':
-- resource, value).
-- NULL for $1: every node.
SELECT 'device' AS kind, NULL AS job_id, node_id, mode AS resource, device_index::bigint AS amount
FROM allocations WHERE $1::text[] IS NULL OR node_id = ANY($1::text[])
UNION ALL
SELECT 'reservation', job_id, node_id, resource, amount
FROM reservations WHERE $1::text[] IS NULL OR node_id = ANY($1::text[])
UNION ALL
-- Fences (0022) hold as their jobs did; a fence's reservations are keyed by its grant.
SELECT kind, CASE WHEN kind = 'reservation' THEN 'fence:' || grant_id END, node_id, resource,
       amount
FROM fences WHERE $1::text[] IS NULL OR node_id = ANY($1::text[])
UNION ALL
SELECT 'capacity', NULL, node_id, resource, capacity
FROM node_resources
WHERE capacity IS NOT NULL AND resource IN ('cpu', 'memory', 'slots')
  AND ($1::text[] IS NULL OR node_id = ANY($1::text[]));

-- name: set_offline
-- Nodes whose heartbeats stopped; their placed and running jobs are lost (lose_node_jobs).
UPDATE nodes SET online = false WHERE node_id = ANY($1::text[]) AND online
RETURNING node_id;

-- name: lose_node_jobs
-- The jobs are over for placement; what they held on the node moves to fences (0022), held
-- until the node's executor reports each grant's end: a node cut off may still run them.
WITH lost AS (
    UPDATE jobs SET state = 'lost', reason = $2, updated_at = now()
    WHERE node_id = ANY($1::text[]) AND state IN ('placed', 'running')
    RETURNING jobs.job_id, jobs.node_id, jobs.grant_id, jobs.owner, jobs.state, jobs.reason,
       jobs.gang_id, jobs.rank,
       -- lifecycle: what lifecycle.plan needs for a retry or a restart, NULL for most jobs
       -- (migrations/0021); has_dependents: a job waits for it.
       gpulayer_job_lifecycle(jobs) AS lifecycle,
       EXISTS (SELECT 1 FROM job_dependencies d WHERE d.after_id = jobs.job_id) AS has_dependents
), released AS (
    DELETE FROM allocations a USING lost WHERE a.job_id = lost.job_id
    RETURNING a.job_id, a.node_id, 'device' AS kind, a.mode AS resource,
        a.device_index::bigint AS amount
), freed AS (
    DELETE FROM reservations r USING lost WHERE r.job_id = lost.job_id
    RETURNING r.job_id, r.node_id, 'reservation' AS kind, r.resource, r.amount
), fenced AS (
    INSERT INTO fences (grant_id, node_id, job_id, kind, resource, amount)
    SELECT l.grant_id, h.node_id, h.job_id, h.kind, h.resource, h.amount
    FROM (SELECT * FROM released UNION ALL SELECT * FROM freed) AS h
    JOIN lost l USING (job_id)
    WHERE l.grant_id IS NOT NULL
)
SELECT job_id, node_id, grant_id, owner, state, reason, lifecycle, has_dependents, gang_id, rank
FROM lost;

-- name: release_fences
-- Reports of grants whose job is no longer theirs (lost with its node): what the grant held
-- there is free now. Other replicas are told which nodes changed.
WITH s AS (
    SELECT * FROM unnest($1::text[], $2::text[]) AS s(grant_id, node_id)
), gone AS (
    DELETE FROM fences f USING s
    WHERE f.grant_id = s.grant_id AND f.node_id = s.node_id
    RETURNING f.grant_id, f.node_id, f.kind, f.resource, f.amount
)
SELECT grant_id, node_id, kind, resource, amount,
       (SELECT gpulayer_notify_nodes($3, array_agg(DISTINCT node_id))
        FROM gone HAVING count(*) > 0) AS notified
FROM gone;

-- name: lock_node
-- A node to forget (gpulayer node forget), locked against its heartbeats' touch_nodes until the
-- forgetting commits; silent_s: seconds since its last heartbeat (or capabilities) was stored.
SELECT node_id, online, extract(epoch FROM now() - last_seen)::float8 AS silent_s
FROM nodes WHERE node_id = $1
FOR UPDATE;

-- name: forget_fences
-- Every fence of a node forgotten: what its lost jobs held there is free, whether or not its
-- executor ever reports those grants' ends (release_fences then finds nothing).
DELETE FROM fences WHERE node_id = $1
RETURNING grant_id, job_id, kind, resource, amount;

-- name: insert_jobs
-- $6: owners; NULL is 'anonymous'. $7 priorities and $8 preemptible: a waiting job's, from
-- its decoded request (validated: within bounds); 0 / false otherwise. Passed rather than read
-- from the request here: each `request::jsonb` parses the whole text again, and three of
-- them were two thirds of this statement's time.
INSERT INTO jobs (job_id, request, state, reason, traceparent, owner, priority, preemptible)
SELECT j.job_id, j.request::jsonb, j.state, j.reason, j.traceparent,
       coalesce(j.owner, 'anonymous'),
       CASE WHEN j.state = 'pending' THEN coalesce(j.priority, 0) ELSE 0 END,
       j.state = 'pending' AND coalesce(j.preemptible, false)
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
            $7::int[], $8::boolean[])
     AS j(job_id, request, state, reason, traceparent, owner, priority, preemptible)
ON CONFLICT (job_id) DO NOTHING
RETURNING job_id;

-- name: take_pending
-- Highest priority first, then oldest, a page after ($2, $3, $4) = (-priority, submitted_at,
-- job_id) (jobs_pending_priority_idx). SKIP LOCKED lets several replicas split waiting jobs.
-- Without the request: the scheduler keeps the decoded requests of the jobs it knows (a pass
-- after a release reads a page of the queue to place a few), and reads the others' by id
-- (job_requests). The request's text was a third of this statement's time. The statement is
-- a function (migration 0023) so that its plan is the ordered walk of the index whatever the
-- table's statistics say.
SELECT job_id, reason, attempt, submitted_at, traceparent, owner, priority
FROM gpulayer_take_pending($1, $2, $3, $4);

-- name: waiting_owners
-- Owners with a waiting job (migration 0025: a loose scan of jobs_pending_owner_idx).
SELECT o AS owner FROM gpulayer_waiting_owners($1) AS o;

-- name: take_heads
-- Each of the owners' ($1) first $2 waiting jobs, locked, in matching order (migration 0025).
SELECT job_id, reason, attempt, submitted_at, traceparent, owner, priority
FROM gpulayer_take_heads($1::text[], $2);

-- name: job_requests
SELECT job_id, request::text AS request FROM jobs WHERE job_id = ANY($1::text[]);

-- name: take_jobs
SELECT job_id, request::text AS request, reason, attempt, submitted_at, traceparent, owner,
       priority
FROM jobs
WHERE state = 'pending' AND job_id = ANY($1::text[])
  AND NOT blocked AND (not_before IS NULL OR not_before <= now())
ORDER BY (-priority), submitted_at, job_id
FOR UPDATE SKIP LOCKED;

-- name: place_jobs
-- Notifications on 'gpulayer_allocations' carry '<replica>|<node>,<node>' (replica_sync.NOTIFY_CHANNEL),
-- as many as the nodes take (gpulayer_notify_nodes, migration 0026).
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
), counted AS (
    -- What each job counts against its owner's quota ($16 owners, $17 devices, $18
    -- millicores); the owner_holds trigger refuses the statement past a quota.
    INSERT INTO owner_holds (job_id, owner, accelerator, gpus, millicores)
    SELECT * FROM unnest($1::text[], $16::text[], $4::text[], $17::int[], $18::bigint[])
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
       (SELECT gpulayer_notify_nodes($10, array_agg(DISTINCT node_id))
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
    -- A job being preempted (preempted_for set) that reports 'cancelled' is requeued: back to
    -- 'pending' with the reason, same id; its next placement takes the next attempt number.
    UPDATE jobs SET state = CASE WHEN s.state = 'cancelled' AND jobs.preempted_for IS NOT NULL
                                 THEN 'pending' ELSE s.state END,
        exit_code = s.exit_code,
        reason = CASE WHEN s.state = 'cancelled' AND jobs.preempted_for IS NOT NULL
                      THEN 'requeued: preempted for job ' || jobs.preempted_for ELSE s.reason END,
        preempted_for = NULL, updated_at = now()
    FROM s
    WHERE jobs.job_id = s.job_id AND jobs.grant_id = s.grant_id AND jobs.node_id = s.node_id
      AND jobs.state IN ('placed', 'running')
      AND NOT (s.state = 'running' AND jobs.state = 'running')
    RETURNING jobs.job_id, jobs.node_id, jobs.state, jobs.owner, jobs.reason, jobs.exit_code,
       jobs.gang_id, jobs.rank,
       -- lifecycle: what lifecycle.plan needs for a retry or a restart, NULL for most jobs
       -- (migrations/0021); has_dependents: a job waits for it.
       gpulayer_job_lifecycle(jobs) AS lifecycle,
       EXISTS (SELECT 1 FROM job_dependencies d WHERE d.after_id = jobs.job_id) AS has_dependents
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
       c.owner, c.reason, c.lifecycle, c.has_dependents, c.exit_code, c.gang_id, c.rank,
       (SELECT gpulayer_notify_nodes($7, array_agg(DISTINCT node_id))
        FROM (SELECT node_id FROM released UNION SELECT node_id FROM freed) AS gone
        HAVING count(*) > 0) AS notified
FROM changed c LEFT JOIN released r ON r.job_id = c.job_id;

-- name: apply_running
-- A batch of 'running' reports only (most batches: a job's start comes alone), as apply_status
-- applies them, in one statement of its own (no BEGIN, no COMMIT round trip) committed without
-- waiting for the disk: a 'running' lost with PostgreSQL's last moments is harmless (the job's
-- end replaces it; until then stale_placed re-sends the grant, which an executor starts once).
-- Ranks of a distributed job are left out: their gang's state is decided in a transaction.
-- Returns the reports applied; the rest (ranks, stale or repeated reports) go to apply_status.
WITH durability AS (SELECT set_config('synchronous_commit', 'off', true)),
s AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::text[])
         AS s(job_id, grant_id, node_id, exit_code, reason)
)
UPDATE jobs SET state = 'running', exit_code = s.exit_code, reason = s.reason,
    preempted_for = NULL, updated_at = now()
FROM s, durability
WHERE jobs.job_id = s.job_id AND jobs.grant_id = s.grant_id AND jobs.node_id = s.node_id
  AND jobs.state = 'placed' AND jobs.gang_id IS NULL
RETURNING jobs.job_id, jobs.grant_id;

-- name: stale_placed
-- Placed jobs whose executor never said "running": re-send the grant (executors start a grant
-- at most once, so this is safe).
-- A gang row has no grant of its own (its ranks do): left out; a rank's grant carries its gang.
SELECT job_id, request::text AS request, node_id, grant_id, accelerator, devices, traceparent,
       owner, extract(epoch FROM now() - submitted_at)::float8 AS age_s, gang::text AS gang
FROM jobs
WHERE state = 'placed' AND updated_at < now() - make_interval(secs => $1) AND NOT is_gang;

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
       accelerator, devices, exit_code, reason, unsatisfiable, attempt, owner,
       requeues, blocked, not_before, kind, array_id, priority, preemptible, preempted_for,
       is_gang, gang_id, rank, stop_requested
FROM jobs WHERE job_id = $1;

-- name: list_jobs
SELECT job_id, state, submitted_at, updated_at, node_id, accelerator, devices, exit_code, reason,
       owner, kind, array_id, requeues, priority, is_gang,
       -- The job's own name (the fleet page lists it); NULL for a request that is no object.
       request->>'name' AS name
FROM jobs
-- A distributed job's ranks are shown under it (gpulayer job), not as jobs of their own.
WHERE ($1::text IS NULL OR state = $1) AND gang_id IS NULL
ORDER BY submitted_at DESC, job_id
LIMIT $2 OFFSET $3;

-- name: list_nodes
SELECT node_id, capabilities::text AS capabilities, online, last_seen, first_seen,
       (SELECT count(*) FROM jobs j WHERE j.node_id = n.node_id AND j.state IN ('placed', 'running'))
           AS active_jobs
-- A page of the fleet (LIMIT NULL: the rest of it).
FROM nodes n ORDER BY node_id
OFFSET $1 LIMIT $2;

-- name: job_counts
SELECT state, count(*) AS n FROM jobs GROUP BY state;

-- name: pending_counts
SELECT unsatisfiable, count(*) AS n FROM jobs WHERE state = 'pending' GROUP BY unsatisfiable;

-- --- Job lifecycle (issue 15, part B): retries, services, arrays, dependencies -----------------

-- name: requeue_jobs
-- Jobs whose attempt just ended (in this transaction) and that wait again: a retry or a
-- service's restart. The next placement makes attempt + 1, so a new grant id; reports for the
-- old grant find the job no longer placed or running and change nothing. A job whose cancel was
-- asked for stays ended.
UPDATE jobs SET state = 'pending', requeues = jobs.requeues + 1, not_before = r.not_before,
    reason = r.reason, devices = '{}', unsatisfiable = false, updated_at = now()
FROM unnest($1::text[], $2::text[], $3::timestamptz[]) AS r(job_id, reason, not_before)
WHERE jobs.job_id = r.job_id AND jobs.state IN ('succeeded', 'failed', 'lost')
  AND NOT jobs.stop_requested
RETURNING jobs.job_id, jobs.requeues;

-- name: request_stop
-- gpulayer cancel of a placed or running job: its end will be final (no retry, no restart).
UPDATE jobs SET stop_requested = true
WHERE job_id = $1 AND state IN ('placed', 'running')
RETURNING job_id, state, node_id, grant_id;

-- name: dependency_states
-- The jobs named as dependencies, locked against a change of state until the dependents are
-- stored: the statement that ends a dependency then sees them (dependencies.check).
SELECT job_id, state, owner FROM jobs WHERE job_id = ANY($1::text[])
ORDER BY job_id
FOR SHARE;

-- name: record_dependencies
-- $1, $2: (job, dependency) pairs; $3: jobs with a dependency not yet succeeded.
WITH deps AS (
    INSERT INTO job_dependencies (job_id, after_id)
    SELECT * FROM unnest($1::text[], $2::text[])
    ON CONFLICT DO NOTHING
    RETURNING job_id
)
UPDATE jobs SET blocked = true
WHERE job_id = ANY($3::text[]) AND state = 'pending';

-- name: unblock_dependents
-- Waiting jobs of which one of $1 was a dependency and whose dependencies have now all
-- succeeded: matched from now on.
UPDATE jobs SET blocked = false, updated_at = now()
WHERE blocked AND state = 'pending'
  AND job_id IN (SELECT job_id FROM job_dependencies WHERE after_id = ANY($1::text[]))
  AND NOT EXISTS (
      SELECT 1 FROM job_dependencies d JOIN jobs j ON j.job_id = d.after_id
      WHERE d.job_id = jobs.job_id AND j.state <> 'succeeded')
RETURNING job_id;

-- name: cancel_dependents
-- Waiting jobs of which one of $1 was a dependency, which ended without succeeding ($2: how):
-- cancelled, naming it. One level; dependencies.release repeats it for their dependents.
UPDATE jobs SET state = 'cancelled', blocked = false, updated_at = now(),
    reason = 'dependency ' || e.after_id || ' ended ' || e.how || ' (after)'
FROM (SELECT DISTINCT ON (d.job_id) d.job_id, x.after_id, x.how
      FROM unnest($1::text[], $2::text[]) AS x(after_id, how)
      JOIN job_dependencies d ON d.after_id = x.after_id
      ORDER BY d.job_id, x.after_id) AS e
WHERE jobs.job_id = e.job_id AND jobs.state = 'pending'
RETURNING jobs.job_id, jobs.owner, jobs.reason;

-- name: list_services
SELECT job_id, state, submitted_at, updated_at, node_id, requeues AS restarts, reason, owner,
       not_before, request->'restart' AS restart
FROM jobs
WHERE kind = 'service' AND ($1::text IS NULL OR state = $1)
ORDER BY submitted_at DESC, job_id
LIMIT $2;

-- --- Queue policy (issue 15 part A): quotas, fair share, preemption ---

-- name: load_active
-- Placed and running jobs, for quotas, fair share, reservations and preemption. NULL for $1:
-- every node. ``started``: when it was placed (its owner_holds row), ``timeout_s`` its limit.
SELECT j.job_id, j.node_id, j.owner, j.accelerator, j.devices, j.priority, j.preemptible,
       j.preempted_for, (j.request ->> 'timeout_s')::float8 AS timeout_s,
       extract(epoch FROM coalesce(h.placed_at, j.updated_at))::float8 AS started,
       coalesce(h.millicores, 0) AS millicores,
       (SELECT min(a.mode) FROM allocations a WHERE a.job_id = j.job_id) AS mode
FROM jobs j LEFT JOIN owner_holds h ON h.job_id = j.job_id
WHERE j.state IN ('placed', 'running') AND ($1::text[] IS NULL OR j.node_id = ANY($1::text[]))
  AND NOT j.is_gang;

-- name: load_policy
-- Quotas ('quota': owner, resource, max) and each owner's ended GPU-seconds decayed to now
-- ('share': owner, NULL, value), in one snapshot.
SELECT 'quota' AS kind, owner, resource, max::float8 AS value FROM quotas
UNION ALL
SELECT 'share', owner, NULL,
       gpu_seconds * power(0.5, greatest(extract(epoch FROM now() - as_of), 0)
                               / gpulayer_fair_share_half_life_s())
FROM fair_share;

-- name: set_quota
-- One owner's quota rows ($2 resources, $3 maxima) replace the named resources; $4 lists the
-- resources to clear.
WITH cleared AS (
    DELETE FROM quotas WHERE owner = $1 AND resource = ANY($4::text[])
)
INSERT INTO quotas (owner, resource, max)
SELECT $1, r, m FROM unnest($2::text[], $3::bigint[]) AS q(r, m)
ON CONFLICT (owner, resource) DO UPDATE SET max = EXCLUDED.max;

-- name: delete_quota
DELETE FROM quotas WHERE owner = $1 RETURNING resource;

-- name: list_quotas
SELECT q.owner, q.resource, q.max, coalesce(u.used, 0) AS used
FROM quotas q LEFT JOIN owner_usage u ON u.owner = q.owner AND u.resource = q.resource
ORDER BY q.owner, q.resource;

-- name: mark_preempted
-- Victims chosen for job $2: still active, preemptible, of lower priority than $3, not already
-- being preempted. Returns those marked (their grant and node, to send the cancel to).
UPDATE jobs SET preempted_for = $2, updated_at = now()
WHERE job_id = ANY($1::text[]) AND state IN ('placed', 'running') AND preemptible
  AND priority < $3 AND preempted_for IS NULL
RETURNING job_id, node_id, grant_id, owner, preempted_for;

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
    RETURNING j.job_id, j.node_id, j.owner, j.grant_id, j.state, j.reason, j.gang_id, j.rank,
       -- lifecycle, as in lose_node_jobs: a retry or a restart, or the dependents released.
       gpulayer_job_lifecycle(j) AS lifecycle,
       EXISTS (SELECT 1 FROM job_dependencies d WHERE d.after_id = j.job_id) AS has_dependents
), released AS (
    DELETE FROM allocations a USING lost WHERE a.job_id = lost.job_id
), freed AS (
    DELETE FROM reservations r USING lost WHERE r.job_id = lost.job_id
)
SELECT job_id, node_id, owner, grant_id, state, reason, lifecycle, has_dependents, gang_id, rank
FROM lost;

-- --- Distributed jobs (issue 14): gangs and their ranks (gangs.py, gang_status.py) ---

-- name: reserve_gang_port
-- The lowest port of $3..$4 no active gang holds on node $2, for gang $1; no row when all are
-- taken. Two replicas choosing the same port at once: the unique index fails one's commit.
INSERT INTO gang_ports (gang_id, node_id, port)
SELECT $1, $2, p FROM generate_series($3::int, $4::int) AS p
WHERE NOT EXISTS (SELECT 1 FROM gang_ports g WHERE g.node_id = $2 AND g.port = p)
ORDER BY p LIMIT 1
RETURNING port;

-- name: insert_ranks
-- The rank jobs of gangs placed in this transaction: inserted waiting, then placed by
-- place_jobs in the same transaction (no other replica ever sees them waiting). Never
-- preemptible; their priority is the gang's.
INSERT INTO jobs (job_id, request, state, traceparent, owner, priority, preemptible, gang_id,
                  rank, gang)
SELECT r.job_id, r.request::jsonb, 'pending', r.traceparent, r.owner, r.priority, false,
       r.gang_id, r.rank, r.gang::jsonb
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::text[], $7::int[],
            $8::text[]) AS r(job_id, request, traceparent, owner, priority, gang_id, rank, gang);

-- name: place_gangs
-- Gang rows whose every rank was placed in this transaction.
UPDATE jobs SET state = 'placed', attempt = jobs.attempt + 1, reason = NULL,
    unsatisfiable = false, updated_at = now()
WHERE job_id = ANY($1::text[]) AND state = 'pending';

-- name: lock_gangs
-- Gang rows $1 still placed or running, locked: replicas settling reports of one gang take
-- turns. Their ranks are read by the next statement, whose snapshot sees what the replica
-- that held the lock before committed.
SELECT job_id, state, owner, stop_requested FROM jobs
WHERE job_id = ANY($1::text[]) AND is_gang AND state IN ('placed', 'running')
ORDER BY job_id
FOR UPDATE;

-- name: gang_rank_states
SELECT gang_id, job_id, rank, state, node_id, grant_id, exit_code, reason
FROM jobs WHERE gang_id = ANY($1::text[])
ORDER BY gang_id, rank;

-- name: set_gangs
-- Gangs whose state the ranks decided ($2: running, succeeded, failed, lost, cancelled); an
-- ended one gives its rendezvous port back.
WITH s AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::text[])
         AS s(job_id, state, exit_code, reason)
), upd AS (
    UPDATE jobs SET state = s.state, exit_code = s.exit_code, reason = s.reason, updated_at = now()
    FROM s WHERE jobs.job_id = s.job_id AND jobs.state IN ('placed', 'running')
    RETURNING jobs.job_id, jobs.state
), freed AS (
    DELETE FROM gang_ports p USING upd WHERE p.gang_id = upd.job_id AND upd.state <> 'running'
)
SELECT job_id, state FROM upd;

-- name: stop_gang
-- gpulayer cancel of a placed or running gang: its ranks still active, to cancel; the gang
-- ends 'cancelled' when they report.
WITH g AS (
    UPDATE jobs SET stop_requested = true
    WHERE job_id = $1 AND is_gang AND state IN ('placed', 'running')
    RETURNING job_id
)
SELECT r.job_id, r.node_id, r.grant_id
FROM jobs r JOIN g ON r.gang_id = g.job_id
WHERE r.state IN ('placed', 'running');

-- name: gang_ranks
-- Every rank of gang $1, for gpulayer job.
SELECT rank, job_id, state, node_id, devices, exit_code, reason, gang::text AS gang
FROM jobs WHERE gang_id = $1 ORDER BY rank;

-- --- The outbox (migrations/0024): events announced after their transaction commits ---------

-- name: record_outbox
-- Events to publish once the caller's transaction commits. The NOTIFY, sent at the commit,
-- wakes every replica's outbox (outbox.CHANNEL).
WITH added AS (
    INSERT INTO event_outbox (msg_id, subject, payload)
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[])
    ON CONFLICT (msg_id) DO NOTHING
    RETURNING msg_id
)
SELECT pg_notify('gpulayer_outbox', '') FROM (SELECT 1 FROM added LIMIT 1) AS any_added;

-- name: take_outbox
-- The oldest events not published yet, locked until the transaction publishing them deletes
-- them: replicas draining at once take different ones (SKIP LOCKED).
SELECT msg_id, subject, payload FROM event_outbox
ORDER BY added_at, msg_id
LIMIT $1
FOR UPDATE SKIP LOCKED;

-- name: delete_outbox
DELETE FROM event_outbox WHERE msg_id = ANY($1::text[]);

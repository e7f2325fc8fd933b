-- Fair share over the whole queue, not a page of it, and the jobs table's indexes for a
-- million jobs (issue 49).
--
-- A scheduling pass reads the waiting jobs a page at a time, highest priority first, then
-- oldest, and the queue policy orders each page by fair share. When one owner has queued more
-- jobs than a page holds, another owner's job sits behind all of them: each release's pass
-- reads the first page, fills the freed device from it and stops. The pass now begins with
-- each waiting owner's first jobs (gpulayer_take_heads), so that the owner with the least
-- recent use gets the next free device wherever its jobs stand in the queue.
--
-- Building the index reads the jobs table once (a few seconds per million rows), holding off
-- job writes meanwhile: placement replicas apply migrations before they take any message.
CREATE INDEX IF NOT EXISTS jobs_pending_owner_idx
    ON jobs (owner, (-priority), submitted_at, job_id) WHERE state = 'pending';

-- The jobs page (queries.sql: list_jobs, newest first): without an index in that order every
-- page read the whole table and sorted it, 1.3 s with two million jobs stored. It replaces
-- jobs_owner_idx, which no query used: a job's row changes state four times or so, and each
-- change writes an entry into every index over all rows (a state change is never a HOT update:
-- partial indexes name the state), so the table keeps the number of such indexes it had.
-- jobs_pending_idx, the waiting jobs oldest first, is read by nothing since
-- jobs_pending_priority_idx (0015).
CREATE INDEX IF NOT EXISTS jobs_listed_idx ON jobs (submitted_at DESC, job_id) WHERE gang_id IS NULL;
DROP INDEX IF EXISTS jobs_owner_idx;
DROP INDEX IF EXISTS jobs_pending_idx;

-- Grants not yet taken after the resend delay (queries.sql: stale_placed, every 10 s by
-- default): a scan of every job's row without it.
CREATE INDEX IF NOT EXISTS jobs_placed_idx ON jobs (updated_at) WHERE state = 'placed';

-- The owners with a waiting job, in name order: one index probe per owner (a loose index scan)
-- rather than a read of every waiting job. At most ``most`` of them.
CREATE OR REPLACE FUNCTION gpulayer_waiting_owners(most int) RETURNS SETOF text
LANGUAGE sql STABLE
AS $$
    WITH RECURSIVE o(owner) AS (
        (SELECT j.owner FROM jobs j WHERE j.state = 'pending' ORDER BY j.owner LIMIT 1)
        UNION ALL
        SELECT (SELECT j.owner FROM jobs j
                WHERE j.state = 'pending' AND j.owner > o.owner ORDER BY j.owner LIMIT 1)
        FROM o WHERE o.owner IS NOT NULL
    )
    SELECT owner FROM o WHERE owner IS NOT NULL LIMIT most
$$;

-- Each of ``owners``' first ``per_owner`` waiting jobs in matching order (as
-- gpulayer_take_pending's page: highest priority first, then oldest), locked SKIP LOCKED.
CREATE OR REPLACE FUNCTION gpulayer_take_heads(owners text[], per_owner int)
RETURNS TABLE (
    job_id text, reason text, attempt int, submitted_at timestamptz, traceparent text,
    owner text, priority int
)
LANGUAGE sql VOLATILE
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
    SELECT h.job_id, h.reason, h.attempt, h.submitted_at, h.traceparent, h.owner, h.priority
    FROM unnest(owners) AS o(owner),
    LATERAL (
        SELECT j.job_id, j.reason, j.attempt, j.submitted_at, j.traceparent, j.owner, j.priority
        FROM jobs j
        WHERE j.state = 'pending' AND j.owner = o.owner
          AND NOT j.blocked AND (j.not_before IS NULL OR j.not_before <= now())
        ORDER BY (-j.priority), j.submitted_at, j.job_id
        LIMIT per_owner
        FOR UPDATE OF j SKIP LOCKED
    ) h
    ORDER BY (-h.priority), h.submitted_at, h.job_id
$$;

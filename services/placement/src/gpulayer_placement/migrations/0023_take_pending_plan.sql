-- The scheduler's page of waiting jobs (queries.sql: take_pending), always planned as an
-- ordered walk of jobs_pending_priority_idx that stops once the page is full.
--
-- Left to the planner, the statement's plan follows the table's statistics. Taken while few
-- jobs waited (a new install, a quiet night), they make a long queue look like a handful of
-- rows, and the planner then picks a bitmap scan of every waiting job, sorted, of which the
-- page keeps the first 1,000: measured with 20,000 waiting jobs behind statistics of an empty
-- table, 47 ms a page against 1.1 ms for the ordered walk, on every pass. Autovacuum's
-- re-analysis comes after a tenth of the table has changed: never soon on a table of millions
-- of ended jobs. A bitmap scan also never marks the index entries of jobs placed since the
-- last vacuum as dead (an ordered walk does), so every pass steps over all of them again.
--
-- The settings hold inside this function only (its SET clauses), not for the caller's session.
CREATE OR REPLACE FUNCTION gpulayer_take_pending(
    page int, after_priority int, after_submitted timestamptz, after_job text
) RETURNS TABLE (
    job_id text, reason text, attempt int, submitted_at timestamptz, traceparent text,
    owner text, priority int
)
LANGUAGE sql VOLATILE
SET enable_bitmapscan = off
SET enable_sort = off
AS $$
    SELECT j.job_id, j.reason, j.attempt, j.submitted_at, j.traceparent, j.owner, j.priority
    FROM jobs j
    WHERE j.state = 'pending'
      AND ((-j.priority), j.submitted_at, j.job_id) > (after_priority, after_submitted, after_job)
      -- lifecycle: dependencies not all succeeded, or a restart's backoff not over
      AND NOT j.blocked AND (j.not_before IS NULL OR j.not_before <= now())
    ORDER BY (-j.priority), j.submitted_at, j.job_id
    LIMIT page
    FOR UPDATE OF j SKIP LOCKED
$$;

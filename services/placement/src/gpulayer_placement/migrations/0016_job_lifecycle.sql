-- Job lifecycle (issue 15, part B): retries, services, arrays, dependencies. Numbered after the
-- issue, like 0012 and 0013, so that branches written at the same time don't collide.

-- Times the job went back to waiting after an attempt ended (a retry, or a service's restart).
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS requeues int NOT NULL DEFAULT 0;
-- A restarting service's backoff: it is not matched before then.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS not_before timestamptz;
-- Some dependency (``after``) has not succeeded yet: the job is not even matched. Cleared by
-- the statement that records its last dependency's success.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS blocked boolean NOT NULL DEFAULT false;
-- ``gpulayer cancel`` asked to stop it while placed or running: its attempt's end is final,
-- never a retry or a restart.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS stop_requested boolean NOT NULL DEFAULT false;
-- From the request, for listing: 'service' or 'job'; the array a job belongs to (its id less
-- '-<index>'), NULL for a job of no array. jsonb operators give NULL on a rejected request
-- that is no object.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS kind text
    GENERATED ALWAYS AS (coalesce(request->>'kind', 'job')) STORED;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS array_id text
    GENERATED ALWAYS AS (
        CASE WHEN jsonb_typeof(request->'array'->'index') = 'number'
             THEN left(job_id, length(job_id) - length(request->'array'->>'index') - 1)
        END
    ) STORED;
CREATE INDEX IF NOT EXISTS jobs_array_idx ON jobs (array_id) WHERE array_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_service_idx ON jobs (submitted_at) WHERE kind = 'service';

-- One row per dependency: ``job_id`` starts only after ``after_id`` succeeded. Both ids were
-- stored when the row was written (unknown ids are rejected at submit).
CREATE TABLE IF NOT EXISTS job_dependencies (
    job_id   text NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    after_id text NOT NULL,
    PRIMARY KEY (job_id, after_id)
);
CREATE INDEX IF NOT EXISTS job_dependencies_after_idx ON job_dependencies (after_id);

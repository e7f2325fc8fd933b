-- Who submitted each job (issue 12): taken from the submit subject, never from the payload.
-- Numbered after the issue so that migrations written on other branches at the same time
-- don't take the same version. Jobs stored before it belong to 'anonymous'.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS owner text NOT NULL DEFAULT 'anonymous';
CREATE INDEX IF NOT EXISTS jobs_owner_idx ON jobs (owner, submitted_at);

-- What lifecycle.plan needs to requeue a retried job or restart a service, as text; NULL for
-- every other job (most jobs: nothing to decode). One definition for the three statements that
-- end jobs (queries.sql: update_statuses, lose_node_jobs, lose_device_jobs), which each spelt
-- it out before. A single-expression SQL function: PostgreSQL inlines it into the statement.
CREATE OR REPLACE FUNCTION gpulayer_job_lifecycle(j jobs) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN j.kind = 'service' OR coalesce(j.request->>'retries', '0') <> '0'
                THEN jsonb_build_object(
                    'kind', j.kind, 'retries', j.request->'retries',
                    'retry_on_failure', j.request->'retry_on_failure',
                    'restart', j.request->'restart', 'requeues', j.requeues,
                    'stop_requested', j.stop_requested)::text
           END
$$;

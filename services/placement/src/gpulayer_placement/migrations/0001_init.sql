-- gpulayer placement state. Node identity comes from the NATS subject a message arrived on.
CREATE EXTENSION IF NOT EXISTS btree_gist;

CREATE TABLE nodes (
    node_id       text PRIMARY KEY,
    capabilities  jsonb NOT NULL,
    platform      text,
    agent_version text,
    detected_at   timestamptz,
    first_seen    timestamptz NOT NULL DEFAULT now(),
    last_seen     timestamptz NOT NULL DEFAULT now(),
    online        boolean NOT NULL DEFAULT true
);

CREATE TABLE jobs (
    job_id       text PRIMARY KEY,
    request      jsonb NOT NULL,
    state        text NOT NULL CHECK (state IN
                   ('pending', 'placed', 'running', 'succeeded', 'failed', 'cancelled', 'lost', 'rejected')),
    submitted_at timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    node_id      text,
    grant_id     text,
    accelerator  text,
    devices      int[] NOT NULL DEFAULT '{}',
    exit_code    int,
    reason       text,
    unsatisfiable boolean NOT NULL DEFAULT false,
    attempt      int NOT NULL DEFAULT 0,
    -- W3C traceparent the job was submitted with: its placement joins the submitter's trace.
    traceparent  text
);
-- The scheduler takes waiting jobs oldest first.
CREATE INDEX jobs_pending_idx ON jobs (submitted_at, job_id) WHERE state = 'pending';
CREATE INDEX jobs_active_node_idx ON jobs (node_id) WHERE state IN ('placed', 'running');

-- One row per device a placed or running job holds. Released (deleted) when the job ends.
CREATE TABLE allocations (
    job_id       text NOT NULL REFERENCES jobs (job_id) ON DELETE CASCADE,
    node_id      text NOT NULL,
    device_index int  NOT NULL,
    mode         text NOT NULL CHECK (mode IN ('exclusive', 'shared')),
    -- Exclusive holders conflict with anyone else on the device; shared holders only with an
    -- exclusive one. Two rows for one device conflict exactly when their slots differ.
    slot         text GENERATED ALWAYS AS (CASE WHEN mode = 'shared' THEN '' ELSE job_id END) STORED,
    PRIMARY KEY (job_id, node_id, device_index),
    -- The last guard against double booking, whatever replicas race: a device is never held by
    -- an exclusive job and anyone else at once.
    CONSTRAINT allocations_no_double_booking
        EXCLUDE USING gist (node_id WITH =, device_index WITH =, slot WITH <>)
);
CREATE INDEX allocations_node_idx ON allocations (node_id);

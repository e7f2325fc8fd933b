-- Distributed jobs (issue 14): gangs and their ranks. Numbered after the issue, like 0012,
-- 0013, 0015 and 0016, so that branches written at the same time don't collide.
--
-- A job with ``distributed`` set is a gang: its own row (the "gang row", what the user sees)
-- never holds devices; placement creates one rank job per node, ``<job_id>-rank<R>``, as an
-- ordinary row placed in the same transaction, with its own grant, allocations, reservations
-- and status. Rank rows are never 'pending' (they are inserted placed), never preemptible,
-- never retried: the gang row decides (gang.py).

-- Rank rows: the gang they belong to, their rank, and the GangRank their grant carries (the
-- rendezvous address and port), so that a re-sent grant carries it too.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS gang_id text;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS rank int;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS gang jsonb;
-- The gang row itself: a distributed job that is no rank. jsonb operators give NULL on a
-- rejected request that is no object.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS is_gang boolean
    GENERATED ALWAYS AS (
        gang_id IS NULL AND coalesce(jsonb_typeof(request->'distributed') = 'object', false)
    ) STORED;
CREATE INDEX IF NOT EXISTS jobs_gang_idx ON jobs (gang_id, rank) WHERE gang_id IS NOT NULL;

-- The rendezvous port reserved for an active gang on its rank 0's node: one row per gang
-- while it is placed or running (deleted when it ends), unique per node, so two gangs never
-- get the same port on one node whichever replica placed them.
CREATE TABLE IF NOT EXISTS gang_ports (
    gang_id text PRIMARY KEY REFERENCES jobs (job_id) ON DELETE CASCADE,
    node_id text NOT NULL,
    port    int  NOT NULL CHECK (port > 0 AND port < 65536),
    UNIQUE (node_id, port)
);

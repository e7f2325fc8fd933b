-- The outbox: job events recorded in the transaction of the change they announce, where
-- nothing would announce that change again once its event was lost (the jobs cancelled because
-- a dependency ended without succeeding). Any replica publishes a row under its message id
-- (JetStream keeps one copy) and deletes it in one transaction; what a replica that stopped
-- between its commit and its publish left is published by another (outbox.py).
CREATE TABLE event_outbox (
    msg_id   text        PRIMARY KEY,
    subject  text        NOT NULL,
    payload  bytea       NOT NULL,
    added_at timestamptz NOT NULL DEFAULT now()
);

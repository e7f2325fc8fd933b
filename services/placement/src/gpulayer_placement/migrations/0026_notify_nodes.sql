-- Tell the other placement replicas which nodes' allocations changed (replica_sync.py:
-- '<replica>|<node>,<node>' on 'gpulayer_allocations'), in as many notifications as it takes.
--
-- PostgreSQL refuses a notification's payload of 8,000 bytes or more ("payload string too
-- long"), and with it the whole statement: a scheduling batch that placed jobs on 800 nodes of
-- ten-character names failed, and failed again at every retry, stalling placement (c1m, issue
-- 49: a thousand jobs a page on a 10,000-node fleet). Each payload here stays under 7,900
-- bytes; a node id is at most 128 of them (gpulayer_contracts.bounds, MAX_NODE_ID_BYTES).
CREATE OR REPLACE FUNCTION gpulayer_notify_nodes(replica text, nodes text[]) RETURNS int
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    payload text := '';
    node text;
    sent int := 0;
BEGIN
    IF nodes IS NULL OR cardinality(nodes) = 0 THEN
        RETURN 0;
    END IF;
    FOREACH node IN ARRAY nodes LOOP
        IF payload <> ''
           AND octet_length(replica) + octet_length(payload) + octet_length(node) + 2 > 7900 THEN
            PERFORM pg_notify('gpulayer_allocations', replica || '|' || payload);
            sent := sent + 1;
            payload := '';
        END IF;
        payload := CASE WHEN payload = '' THEN node ELSE payload || ',' || node END;
    END LOOP;
    PERFORM pg_notify('gpulayer_allocations', replica || '|' || payload);
    RETURN sent + 1;
END
$$;

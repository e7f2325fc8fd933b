-- A release (a job's reservations deleted) must lock what a placement locks, in the same
-- order: node_resources (the reservations trigger of 0013), then owner_usage (the owner_holds
-- triggers of 0015). Triggers on one event fire in the order of their names, and
-- "reservations_release_holds" came before "reservations_unreserve": a status batch took
-- owner_usage then node_resources while a scheduling pass took them the other way round, and
-- PostgreSQL broke the deadlock by failing one (the status batch waited for redelivery).
DROP TRIGGER IF EXISTS reservations_release_holds ON reservations;
CREATE TRIGGER reservations_zz_release_holds AFTER DELETE ON reservations
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION gpulayer_release_holds();

"""Grant record transitions (pure) and the state store (files in a temp folder)."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import msgspec
import pytest

from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobs import JobRequest
from gpulayer_executor import state as st


def grant(grant_id: str = "g1", job_id: str = "j1") -> Grant:
    return Grant(
        grant_id=grant_id,
        job=JobRequest(job_id=job_id, command=["true"]),
        node_id="n",
        accelerator="cpu",
    )


PROC = st.ProcessInfo(pid=123, pgid=123, start_ticks=456, boot_id="b")


def test_the_normal_life_of_a_grant() -> None:
    rec = st.received(grant())
    rec = st.starting(rec)
    rec = st.running(rec, PROC)
    rec = st.finished(rec, st.Outcome(state="succeeded", exit_code=0))
    rec = st.reported(rec)
    assert (rec.phase, rec.process, rec.reported) == ("finished", PROC, True)


def test_any_unfinished_phase_may_finish() -> None:
    lost = st.Outcome(state="lost", reason="executor restarted")
    assert st.finished(st.received(grant()), lost).phase == "finished"
    assert st.finished(st.starting(st.received(grant())), lost).phase == "finished"


@pytest.mark.parametrize(
    "step",
    [
        lambda r: st.running(r, PROC),  # running without starting
        lambda r: st.reported(r),  # reported before finishing
        lambda r: st.starting(st.starting(r)),  # starting twice: a second spawn
    ],
)
def test_illegal_transitions_raise(step: object) -> None:
    with pytest.raises(st.InvalidTransition):
        step(st.received(grant()))  # type: ignore[operator]


def test_finishing_twice_raises() -> None:
    done = st.finished(st.received(grant()), st.Outcome(state="cancelled"))
    with pytest.raises(st.InvalidTransition):
        st.finished(done, st.Outcome(state="lost"))


def test_grant_keys_are_safe_file_names() -> None:
    assert st.grant_key("g-1_a.b") == "g-1_a.b"
    for unsafe in ("../../etc/passwd", "a/b", ".", "..", "x" * 300, "ä"):
        key = st.grant_key(unsafe)
        assert key.startswith("~")
        assert "/" not in key
    assert st.grant_key("a/b") != st.grant_key("a/c")


def test_create_is_create_if_absent(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    rec = st.received(grant())
    assert store.create(rec)
    assert not store.create(st.received(grant()))
    assert store.load("g1") == rec


def test_create_many_writes_each_new_grant_once(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    store.create(st.received(grant("known", "j0")))
    batch = [st.received(grant(g, f"j-{g}")) for g in ("a", "known", "b", "a")]
    assert store.create_many(batch) == {"a", "b"}
    assert {r.grant_id for r in store.all()} == {"known", "a", "b"}
    assert store.create_many([]) == set()


def test_save_replaces_and_all_lists_records(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    rec = st.received(grant())
    store.create(rec)
    store.create(st.received(grant("g2", "j2")))
    store.save(st.starting(rec))
    assert {(r.grant_id, r.phase) for r in store.all()} == {("g1", "starting"), ("g2", "received")}


def test_unsettled_leaves_out_only_finished_and_reported(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    done = st.finished(st.received(grant("done")), st.Outcome(state="succeeded"))
    store.create(done)
    store.create(st.received(grant("queued", "j2")))
    assert {r.grant_id for r in store.unsettled()} == {"done", "queued"}  # done: unreported
    store.save(st.reported(done))
    assert {r.grant_id for r in store.unsettled()} == {"queued"}
    assert {r.grant_id for r in store.all()} == {"done", "queued"}


def test_unreadable_records_are_skipped(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    store.create(st.received(grant()))
    store.create(st.received(grant("g2", "j2")))
    with sqlite3.connect(store.db_path) as db:
        db.execute("UPDATE grants SET record = '{' WHERE grant_id = 'g2'")
    assert [r.grant_id for r in store.all()] == ["g1"]
    assert [r.grant_id for r in store.unsettled()] == ["g1"]


def test_records_survive_a_new_store_and_round_trip_exactly(tmp_path: Path) -> None:
    rec = st.running(st.starting(st.received(grant())), PROC)
    first = st.StateStore(tmp_path)
    first.create(rec)
    done = st.finished(rec, st.Outcome(state="failed", exit_code=3))
    first.save(done)
    first.close()
    again = st.StateStore(tmp_path)
    assert again.load("g1") == done
    assert not again.create(rec)  # still recognised


def test_the_state_database_is_readable_by_the_executor_only(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    store.create(st.received(grant()))
    assert stat.S_IMODE(store.db_path.stat().st_mode) == 0o600


def test_files_of_an_older_executor_move_into_the_database(tmp_path: Path) -> None:
    """An earlier executor kept a JSON file per grant (with a field since dropped) and per
    cancel: they are imported once and removed; an unreadable one stays for a person to see."""
    rec = st.running(st.starting(st.received(grant())), PROC)
    (tmp_path / "grants").mkdir()
    (tmp_path / "cancels").mkdir()
    legacy = msgspec.json.encode(rec)[:-1] + b', "running_reported": true}'
    (tmp_path / "grants" / "g1.json").write_bytes(legacy)
    (tmp_path / "grants" / "broken.json").write_text("{")
    mark = st.CancelMark(job_id="j9", reason="user asked")
    (tmp_path / "cancels" / "j9.json").write_bytes(msgspec.json.encode(mark))
    store = st.StateStore(tmp_path)
    assert store.load("g1") == rec
    cancel = store.cancel_mark("j9")
    assert cancel is not None
    assert cancel.reason == "user asked"
    assert sorted(p.name for p in (tmp_path / "grants").iterdir()) == ["broken.json"]
    assert not (tmp_path / "cancels").exists()


def test_cancel_marks(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    assert store.cancel_mark("j1") is None
    store.mark_cancel("j1", "user asked")
    mark = store.cancel_mark("j1")
    assert mark is not None
    assert mark.reason == "user asked"
    store.mark_cancel("../x", "ignored: not a job id")
    assert store.cancel_mark("../x") is None


def test_prune_forgets_only_old_reported_records(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    done = st.reported(st.finished(st.received(grant("old")), st.Outcome(state="succeeded")))
    store.create(done)
    store.job_dir("old").mkdir()
    store.create(st.received(grant("queued", "j2")))
    assert store.prune(older_than_s=3600) == 0
    assert store.prune(older_than_s=-1) == 1
    assert store.load("old") is None
    assert not store.job_dir("old").exists()
    assert store.load("queued") is not None


def test_the_write_ahead_log_is_checkpointed_and_stays_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Auto-checkpoints are off; the store checkpoints every so many commits itself, so the
    WAL file is reused."""
    monkeypatch.setattr(st, "_CHECKPOINT_EVERY", 50)
    store = st.StateStore(tmp_path)
    for i in range(400):
        job = JobRequest(job_id=f"j{i}", command=["true"], env={"PAYLOAD": "x" * 1000})
        store.create(st.received(Grant(grant_id=f"g{i}", node_id="n", job=job, accelerator="cpu")))
    wal = store.db_path.with_name("state.db-wal").stat().st_size
    assert wal < 1_500_000, wal  # without checkpoints: about 6.6 MB
    assert len(store.all()) == 400


def test_write_many_creates_and_saves_in_one_commit(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    running = st.received(grant("r", "jr"))
    store.create(running)
    started = st.starting(running)
    assert store.write_many([st.received(grant("n", "jn"))], [started]) == {"n"}
    assert store.load("r") == started
    assert store.load("n") is not None


def test_owner_uids_are_given_once_kept_and_never_shared(tmp_path: Path) -> None:
    store = st.StateStore(tmp_path)
    a = store.owner_uid("alice", 5000, 2)
    b = store.owner_uid("bob", 5000, 2)
    assert {a, b} == {5000, 5001}
    assert store.owner_uid("alice", 5000, 2) == a
    with pytest.raises(ValueError, match="all 2 owner uids from 5000"):
        store.owner_uid("carol", 5000, 2)
    store.close()
    # A restarted executor gives the same owners the same uids.
    again = st.StateStore(tmp_path)
    assert again.owner_uid("bob", 5000, 2) == b
    again.close()

"""The executor's local durable memory: one SQLite database (WAL) with a record per grant.

A grant's record moves ``received → starting → running → finished`` and then gets
``reported``. ``received`` is written (and fsynced) before the grant is acked, so a redelivered
grant finds its record and is never started twice; ``starting`` is written before the process
is spawned, so after a crash the executor knows a process may exist; ``running`` holds what is
needed to find (and kill) the process group after a restart.

Transitions are pure functions on frozen records; ``StateStore`` only reads and writes them.

Why SQLite and not a file per grant and phase: a durable write is one fsynced WAL commit
(about 0.26 ms here) instead of a file write, rename and directory fsync (0.85 ms), and the
writes of grants handled at about the same time share a commit (the executor's group commit).
Records of settled grants stay on disk, not in memory, for as long as a late duplicate grant
must still be recognised.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Literal

import msgspec

from gpulayer_contracts.events import Grant, utcnow
from gpulayer_contracts.jobs import JOB_ID_PATTERN

log = logging.getLogger(__name__)

Phase = Literal["received", "starting", "running", "finished"]
TerminalState = Literal["succeeded", "failed", "cancelled", "lost"]

_SAFE_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


class InvalidTransition(RuntimeError):
    pass


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """How a job ended, as reported to placement and the user."""

    state: TerminalState
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    at: datetime = msgspec.field(default_factory=utcnow)
    # Placement gave the job up before it ended here (lost with its node): the end goes to
    # placement alone, the job's events already have its outcome.
    told: bool = False


class ProcessInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Enough to recognise the job's process group after an executor restart.

    ``start_ticks`` (Linux: field 22 of /proc/<pid>/stat) and ``boot_id`` tell our process from
    a later one that happens to reuse the pid.
    """

    pid: int
    pgid: int
    start_ticks: int | None = None
    boot_id: str | None = None
    started_at: datetime = msgspec.field(default_factory=utcnow)


class GrantRecord(msgspec.Struct, frozen=True, kw_only=True):
    grant: Grant
    phase: Phase
    received_at: datetime = msgspec.field(default_factory=utcnow)
    process: ProcessInfo | None = None
    outcome: Outcome | None = None
    reported: bool = False
    # W3C traceparent the grant arrived with: the job's run joins the submitter's trace.
    traceparent: str | None = None

    @property
    def grant_id(self) -> str:
        return self.grant.grant_id

    @property
    def job_id(self) -> str:
        return self.grant.job.job_id


def received(grant: Grant) -> GrantRecord:
    return GrantRecord(grant=grant, phase="received")


def starting(rec: GrantRecord) -> GrantRecord:
    if rec.phase != "received":
        raise InvalidTransition(f"grant {rec.grant_id}: {rec.phase} → starting")
    return msgspec.structs.replace(rec, phase="starting")


def running(rec: GrantRecord, process: ProcessInfo) -> GrantRecord:
    if rec.phase != "starting":
        raise InvalidTransition(f"grant {rec.grant_id}: {rec.phase} → running")
    return msgspec.structs.replace(rec, phase="running", process=process)


def finished(rec: GrantRecord, outcome: Outcome) -> GrantRecord:
    """Any unfinished phase may end (refused, cancelled before start, lost while starting...)."""
    if rec.phase == "finished":
        raise InvalidTransition(f"grant {rec.grant_id}: already finished")
    return msgspec.structs.replace(rec, phase="finished", outcome=outcome)


def reported(rec: GrantRecord) -> GrantRecord:
    if rec.phase != "finished":
        raise InvalidTransition(f"grant {rec.grant_id}: reported while {rec.phase}")
    return msgspec.structs.replace(rec, reported=True)


def grant_key(grant_id: str) -> str:
    """A file name for a grant id: the id itself when it is safe, else a hash of it."""
    if _SAFE_KEY.fullmatch(grant_id) and grant_id not in (".", ".."):
        return grant_id
    # "~" never appears in a safe key, so a hashed key can't collide with a literal one.
    return "~" + hashlib.sha256(grant_id.encode()).hexdigest()[:40]


class CancelMark(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    reason: str
    at: datetime = msgspec.field(default_factory=utcnow)
    # The grant the cancel named: a job lost with its node and retried may come back to this
    # node under a new grant, which the old grant's stop must not touch. "": every grant.
    grant_id: str = ""
    # Placement gave the grant up (CancelJob.given_up).
    given_up: bool = False

    def applies_to(self, grant_id: str) -> bool:
        return self.grant_id in ("", grant_id)


_record_decoder = msgspec.json.Decoder(GrantRecord)
_cancel_decoder = msgspec.json.Decoder(CancelMark)
_encoder = msgspec.json.Encoder()

_SCHEMA = """
CREATE TABLE IF NOT EXISTS grants (
    grant_id    TEXT PRIMARY KEY,
    record      BLOB NOT NULL,              -- GrantRecord as JSON
    settled     INTEGER NOT NULL DEFAULT 0, -- finished and reported: nothing left to do
    received_at REAL NOT NULL               -- unix seconds, for pruning
);
CREATE INDEX IF NOT EXISTS grants_unsettled ON grants (grant_id) WHERE settled = 0;
-- The uid each owner's jobs run as on this node, when owners get uids of their own
-- (GPULAYER_EXECUTOR_OWNER_UIDS): given once, kept, never given to another owner.
CREATE TABLE IF NOT EXISTS owner_uids (
    owner TEXT PRIMARY KEY,
    uid   INTEGER NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS cancels (
    job_id TEXT PRIMARY KEY,
    record BLOB NOT NULL,                   -- CancelMark as JSON
    at     REAL NOT NULL
);
"""


# A checkpoint every this many commits keeps the WAL file small (a few MB).
_CHECKPOINT_EVERY = 500


def _settled(rec: GrantRecord) -> int:
    return int(rec.phase == "finished" and rec.reported)


_INSERT_GRANT = (
    "INSERT OR IGNORE INTO grants (grant_id, record, settled, received_at) VALUES (?, ?, ?, ?)"
)
_UPDATE_GRANT = "UPDATE grants SET record = ?, settled = ? WHERE grant_id = ?"


def _insert_args(rec: GrantRecord) -> tuple[object, ...]:
    return (rec.grant_id, _encoder.encode(rec), _settled(rec), rec.received_at.timestamp())


def _update_args(rec: GrantRecord) -> tuple[object, ...]:
    return (_encoder.encode(rec), _settled(rec), rec.grant_id)


def _private_dir(path: Path) -> None:
    """The executor's folder, or its jobs' parent: 0711 (others may pass through to a folder
    of their own below it, never list it or read the state in it). Created 0700 and only then
    widened to 0711, so it is never open wider; an existing one gets the mode too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    path.chmod(0o711)


class StateStore:
    """Grant records and cancel marks in ``root/state.db``; job folders under ``root/jobs``
    (their TMPDIRs removed through ``root/trash``).

    Thread-safe: one connection behind a lock (callers write from a thread, so the event loop
    doesn't wait for an fsync). Every write commits with ``synchronous=FULL``: on disk before
    the call returns, even across a power loss. Writes whose loss would be harmless share a
    commit with others instead (the executor's group commit), so there is no cheaper mode.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.jobs_dir = self.root / "jobs"
        for d in (self.root, self.jobs_dir):
            _private_dir(d)
        # Job shims' run folders (shim.py): the executor's alone, never the job's.
        self.run_dir = self.root / "run"
        with contextlib.suppress(FileExistsError):
            self.run_dir.mkdir(mode=0o700)
        # What jobs left in their TMPDIR, moved out of their folders to be removed (folders.py).
        self.trash_dir = self.root / "trash"
        with contextlib.suppress(FileExistsError):
            self.trash_dir.mkdir(mode=0o700)
        self.db_path = self.root / "state.db"
        # Grants hold the jobs' env, which may carry secrets: only the executor reads them. The
        # file is created 0600 before SQLite opens it, and SQLite gives the WAL and
        # shared-memory files it creates next to it the database's mode and owner.
        self.db_path.touch(mode=0o600, exist_ok=True)
        for path in (self.db_path, *(self.root / f"state.db{s}" for s in ("-wal", "-shm"))):
            with contextlib.suppress(FileNotFoundError):
                path.chmod(0o600)  # files an earlier version left with a wider mode
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.db_path, isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        # Checkpoints (WAL into the database file) every so many commits, from the store itself,
        # so their cost is paid at known points and the WAL file is reused.
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._commits = 0
        self._db.executescript(_SCHEMA)
        self._import_legacy_files()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[object, ...]) -> None:
        """Run one statement as its own (durable) transaction."""
        with self._lock:
            self._db.execute(sql, args)
            self._after_commit()

    def _after_commit(self) -> None:
        """Under the lock, after a commit: checkpoint now and then."""
        self._commits += 1
        if self._commits % _CHECKPOINT_EVERY == 0:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def owner_uid(self, owner: str, first: int, count: int) -> int:
        """The uid ``owner``'s jobs run as: the one given before, else the next free one in
        [first, first + count), written durably before it is used. ValueError when the range is
        used up (the job then fails, saying so)."""
        with self._lock:
            row = self._db.execute(
                "SELECT uid FROM owner_uids WHERE owner = ?", (owner,)
            ).fetchone()
            if row is not None:
                return int(row[0])
            (top,) = self._db.execute(
                "SELECT max(uid) FROM owner_uids WHERE uid >= ? AND uid < ?", (first, first + count)
            ).fetchone()
            uid = first if top is None else int(top) + 1
            if uid >= first + count:
                raise ValueError(f"all {count} owner uids from {first} are given out")
            self._db.execute("INSERT INTO owner_uids (owner, uid) VALUES (?, ?)", (owner, uid))
            self._after_commit()
            return uid

    def job_dir(self, grant_id: str) -> Path:
        return self.jobs_dir / grant_key(grant_id)

    def create(self, rec: GrantRecord) -> bool:
        """Write a new record durably; False (and nothing written) if the grant is known."""
        return rec.grant_id in self.create_many([rec])

    def create_many(self, recs: Sequence[GrantRecord]) -> set[str]:
        """Write new records durably in one commit (one fsync for a whole fetched batch); the
        ids of those written. A known grant, or one repeated in ``recs``, is written once."""
        return self.write_many(recs, ())

    def write_many(self, creates: Sequence[GrantRecord], saves: Sequence[GrantRecord]) -> set[str]:
        """Create ``creates`` (as :meth:`create_many`) and replace ``saves``, durably, in one
        commit; the ids created."""
        created: set[str] = set()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for rec in creates:
                    cursor = self._db.execute(_INSERT_GRANT, _insert_args(rec))
                    if cursor.rowcount == 1:
                        created.add(rec.grant_id)
                self._db.executemany(_UPDATE_GRANT, map(_update_args, saves))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._after_commit()
        return created

    def save(self, rec: GrantRecord) -> None:
        """Replace a record, durably."""
        self._write(_UPDATE_GRANT, _update_args(rec))

    def load(self, grant_id: str) -> GrantRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT record FROM grants WHERE grant_id = ?", (grant_id,)
            ).fetchone()
        return None if row is None else _record_decoder.decode(row[0])

    def _decoded(self, rows: list[tuple[str, bytes]]) -> list[GrantRecord]:
        out = []
        for grant_id, blob in rows:
            try:
                out.append(_record_decoder.decode(blob))
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                log.error("state record of grant %s is unreadable, skipped: %s", grant_id, err)
        return out

    def all(self) -> list[GrantRecord]:
        """Every readable record, by grant id. An unreadable one is logged and skipped."""
        with self._lock:
            rows = self._db.execute("SELECT grant_id, record FROM grants ORDER BY grant_id")
            return self._decoded(rows.fetchall())

    def unsettled(self) -> list[GrantRecord]:
        """Records with something left to do: not finished, or finished but not reported."""
        with self._lock:
            rows = self._db.execute(
                "SELECT grant_id, record FROM grants WHERE settled = 0 ORDER BY grant_id"
            )
            return self._decoded(rows.fetchall())

    def mark_cancel(
        self, job_id: str, reason: str, grant_id: str = "", *, given_up: bool = False
    ) -> None:
        """Remember a cancel (durably) so that a grant for the job arriving later never starts
        (only ``grant_id``, when the cancel named one)."""
        if not re.fullmatch(JOB_ID_PATTERN, job_id):
            return
        mark = CancelMark(job_id=job_id, reason=reason, grant_id=grant_id, given_up=given_up)
        self._write(
            "INSERT OR REPLACE INTO cancels (job_id, record, at) VALUES (?, ?, ?)",
            (job_id, _encoder.encode(mark), mark.at.timestamp()),
        )

    def cancel_mark(self, job_id: str, grant_id: str | None = None) -> CancelMark | None:
        """The job's cancel mark; with ``grant_id``, only one that applies to that grant."""
        with self._lock:
            row = self._db.execute(
                "SELECT record FROM cancels WHERE job_id = ?", (job_id,)
            ).fetchone()
        if row is None:
            return None
        try:
            mark = _cancel_decoder.decode(row[0])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return mark if grant_id is None or mark.applies_to(grant_id) else None

    def prune(self, older_than_s: float) -> int:
        """Forget settled records, their job folders and cancel marks older than the limit.
        Records are kept that long so that a grant redelivered late is still recognised.
        """
        cutoff = time.time() - older_than_s
        old = "FROM grants WHERE settled = 1 AND received_at < ?"
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                gone = [r[0] for r in self._db.execute(f"SELECT grant_id {old}", (cutoff,))]
                self._db.execute(f"DELETE {old}", (cutoff,))
                self._db.execute("DELETE FROM cancels WHERE at < ?", (cutoff,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        for grant_id in gone:
            shutil.rmtree(self.job_dir(grant_id), ignore_errors=True)
            shutil.rmtree(self.run_dir / grant_key(grant_id), ignore_errors=True)
        return len(gone)

    def _import_legacy_files(self) -> None:
        """Records and cancel marks an earlier executor kept as one JSON file each, under
        ``grants/`` and ``cancels/``: moved into the database once, then the files removed."""
        for folder, table in ((self.root / "grants", "grants"), (self.root / "cancels", "cancels")):
            if not folder.is_dir():
                continue
            imported = 0
            for path in sorted(folder.glob("*.json")):
                try:
                    if table == "grants":
                        rec = _record_decoder.decode(path.read_bytes())
                        self.create(rec)
                    else:
                        mark = _cancel_decoder.decode(path.read_bytes())
                        self.mark_cancel(mark.job_id, mark.reason)
                except (OSError, msgspec.DecodeError, msgspec.ValidationError) as err:
                    log.error("legacy state file %s is unreadable, left in place: %s", path, err)
                    continue
                path.unlink()
                imported += 1
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: unreadable files stay for a person to see
            if imported:
                log.info("moved %d legacy %s files into %s", imported, table, self.db_path)

"""The executor's local durable memory: one small JSON file per grant, written atomically.

A grant's record moves ``received → starting → running → finished`` and then gets
``reported``. ``received`` is written (and fsynced) before the grant is acked, so a redelivered
grant finds its record and is never started twice; ``starting`` is written before the process
is spawned, so after a crash the executor knows a process may exist; ``running`` holds what is
needed to find (and kill) the process group after a restart.

Transitions are pure functions on frozen records; ``StateStore`` only reads and writes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
from datetime import UTC, datetime
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


_record_decoder = msgspec.json.Decoder(GrantRecord)
_cancel_decoder = msgspec.json.Decoder(CancelMark)
_encoder = msgspec.json.Encoder()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(directory: Path, name: str, data: bytes, *, durable: bool = True) -> Path:
    tmp = directory / f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return tmp


class StateStore:
    """Grant records under ``root/grants``, cancel marks under ``root/cancels``.

    Synchronous and small: callers in the event loop run it in a thread.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.grants_dir = self.root / "grants"
        self.cancels_dir = self.root / "cancels"
        self.jobs_dir = self.root / "jobs"
        for d in (self.root, self.grants_dir, self.cancels_dir, self.jobs_dir):
            d.mkdir(parents=True, exist_ok=True)
        # Grants hold the jobs' env, which may carry secrets: only the executor reads them.
        self.grants_dir.chmod(0o700)
        self.cancels_dir.chmod(0o700)

    def _path(self, grant_id: str) -> Path:
        return self.grants_dir / f"{grant_key(grant_id)}.json"

    def job_dir(self, grant_id: str) -> Path:
        return self.jobs_dir / grant_key(grant_id)

    def create(self, rec: GrantRecord) -> bool:
        """Write a new record; False (and nothing written) if the grant is already known."""
        path = self._path(rec.grant_id)
        tmp = _write_tmp(self.grants_dir, path.name, _encoder.encode(rec))
        try:
            # link() fails when the target exists: create-if-absent in one atomic step.
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink()
        _fsync_dir(self.grants_dir)
        return True

    def save(self, rec: GrantRecord, *, durable: bool = True) -> None:
        """Replace a record atomically. ``durable=False`` skips the fsyncs, for phases whose loss
        in a crash is harmless: the pid of a running job (the restart finds its processes by
        GPULAYER_GRANT_ID) and the "reported" flags (a repeated report is deduplicated)."""
        path = self._path(rec.grant_id)
        tmp = _write_tmp(self.grants_dir, path.name, _encoder.encode(rec), durable=durable)
        os.replace(tmp, path)
        if durable:
            _fsync_dir(self.grants_dir)

    def load(self, grant_id: str) -> GrantRecord | None:
        try:
            return _record_decoder.decode(self._path(grant_id).read_bytes())
        except FileNotFoundError:
            return None

    def all(self) -> list[GrantRecord]:
        """Every readable record. An unreadable one is logged and skipped, never fatal."""
        out = []
        for path in sorted(self.grants_dir.glob("*.json")):
            try:
                out.append(_record_decoder.decode(path.read_bytes()))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as err:
                log.error("state file %s is unreadable, skipped: %s", path, err)
        return out

    def mark_cancel(self, job_id: str, reason: str) -> None:
        """Remember a cancel so that a grant for the job arriving later is never started."""
        if not re.fullmatch(JOB_ID_PATTERN, job_id):
            return
        path = self.cancels_dir / f"{job_id}.json"
        data = _encoder.encode(CancelMark(job_id=job_id, reason=reason))
        os.replace(_write_tmp(self.cancels_dir, path.name, data), path)
        _fsync_dir(self.cancels_dir)

    def cancel_mark(self, job_id: str) -> CancelMark | None:
        if not re.fullmatch(JOB_ID_PATTERN, job_id):
            return None
        try:
            return _cancel_decoder.decode((self.cancels_dir / f"{job_id}.json").read_bytes())
        except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def prune(self, older_than_s: float) -> int:
        """Forget reported records, their job folders and cancel marks older than the limit.

        Records are kept that long so that a grant redelivered late is still recognised.
        """
        cutoff = datetime.now(UTC).timestamp() - older_than_s
        pruned = 0
        for rec in self.all():
            if rec.phase == "finished" and rec.reported and rec.received_at.timestamp() < cutoff:
                shutil.rmtree(self.job_dir(rec.grant_id), ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    self._path(rec.grant_id).unlink()
                pruned += 1
        for path in self.cancels_dir.glob("*.json"):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()
        return pruned

"""Settling, at start, every grant a previous run of the executor left unfinished or
unreported, before anything new is fetched."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import Literal

import msgspec

from gpulayer_executor import procs
from gpulayer_executor import state as st
from gpulayer_executor.job_runner import JobRunner
from gpulayer_executor.reporter import Reporter
from gpulayer_executor.shim import read_status
from gpulayer_executor.shim_client import has_shim, shim_alive
from gpulayer_runtime.logs import job_context

# The executor's lines keep the logger name they had before it was split into parts.
log = logging.getLogger("gpulayer_executor.service")

RESTARTED = "executor restarted"
SHIM_GONE = "the job's shim is gone (node restarted, or the shim was killed)"

Action = Literal["report", "start", "orphan", "none"]


def action_for(rec: st.GrantRecord) -> Action:
    """What a record left by a previous run needs. Pure.

    - finished but unreported: ``report`` it (Nats-Msg-Id makes a repeat harmless);
    - received (never spawned): ``start`` it (the job runner honours a cancel recorded since);
    - starting or running: an ``orphan``. Started through a shim that still runs (or that wrote
      the job's exit status): re-attached (``Reconciler``). Otherwise the process may still run,
      but nobody holds its pipes or its exit status: kill its group if it is still ours and
      report ``lost``. Never started again.
    - finished and reported: ``none``.
    """
    if rec.phase == "finished":
        return "none" if rec.reported else "report"
    if rec.phase == "received":
        return "start"
    return "orphan"


class Reconciler:
    """Reads the unsettled records once and settles each (see ``action_for``)."""

    def __init__(
        self,
        store: st.StateStore,
        runner: JobRunner,
        reporter: Reporter,
        *,
        node_id: str,
        kill_grace_s: float,
        run_root: Path | None = None,
    ) -> None:
        self._store = store
        self._runner = runner
        self._reporter = reporter
        self._node_id = node_id
        self._kill_grace_s = kill_grace_s
        # Where shims keep their jobs' run folders (None: jobs are not started through shims).
        self._run_root = run_root

    async def reconcile(self) -> None:
        """Settle every grant a previous run left unfinished or unreported. Returns once the
        reports and kills are done; grants that were queued are running again in the runner."""
        records = await asyncio.to_thread(self._store.unsettled)
        settle: list[Awaitable[None]] = []
        for rec in records:
            action = action_for(rec)
            if action == "report":
                settle.append(self._reporter.report_finished(rec))
            elif action == "start":
                log.info("grant %s (job %s) was queued; starting it", rec.grant_id, rec.job_id)
                self._runner.launch(rec)
            elif action == "orphan" and self._never_spawned(rec):
                log.info(
                    "grant %s (job %s) was starting, its shim never asked for; starting it",
                    rec.grant_id,
                    rec.job_id,
                )
                self._runner.launch(msgspec.structs.replace(rec, phase="received"))
            elif action == "orphan":
                reason = self._adopt(rec)
                if reason is not None:
                    settle.append(self._settle_orphan(rec, reason))
        if settle:
            await asyncio.gather(*settle)

    def _never_spawned(self, rec: st.GrantRecord) -> bool:
        """A ``starting`` grant whose shim run folder doesn't exist: the launcher makes that
        folder before it asks the fork server for a shim, so nothing of the job ever ran, and
        starting it now runs it once (the executor was killed between the two: reporting it
        ``lost`` lost a job that never started; the fault run, once)."""
        if self._run_root is None or rec.phase != "starting" or rec.process is not None:
            return False
        return not (self._run_root / st.grant_key(rec.grant_id)).exists()

    def _adopt(self, rec: st.GrantRecord) -> str | None:
        """Re-attach to the job when its shim still runs or wrote its end; else why it is lost."""
        if self._run_root is None:
            return RESTARTED
        run = self._run_root / st.grant_key(rec.grant_id)
        if read_status(run).exit is not None or shim_alive(run):
            log.info("grant %s (job %s): re-attaching to its shim", rec.grant_id, rec.job_id)
            self._runner.adopt(rec, run)
            return None
        return SHIM_GONE if has_shim(run) else RESTARTED

    async def _settle_orphan(self, rec: st.GrantRecord, reason: str = RESTARTED) -> None:
        proc = rec.process
        ctx = job_context(rec.job_id, self._node_id, rec.traceparent)
        if proc is not None and procs.owns_group(proc.pgid, proc.start_ticks, proc.boot_id):
            log.warning(
                "job %s (grant %s): killing orphaned group %s",
                rec.job_id,
                rec.grant_id,
                proc.pgid,
                extra=ctx,
            )
            await procs.terminate_group(proc.pgid, self._kill_grace_s)
        elif proc is None:
            # Crashed between spawn and recording the pid: the job's environment names the grant,
            # so its processes can still be found (Linux) and their groups killed.
            pids = await asyncio.to_thread(procs.find_by_env, "GPULAYER_GRANT_ID", rec.grant_id)
            groups = {g for g in map(procs.pgid_of, pids) if g is not None and g > 1}
            for pgid in groups:
                log.warning("job %s: killing unrecorded group %s", rec.job_id, pgid, extra=ctx)
            await asyncio.gather(*(procs.terminate_group(g, self._kill_grace_s) for g in groups))
        else:
            log.warning(
                "job %s (grant %s): process gone while the executor was down",
                rec.job_id,
                rec.grant_id,
                extra=ctx,
            )
        await self._clear_cgroup(rec.grant_id)
        await self._runner.end(rec, st.Outcome(state="lost", reason=reason))

    async def _clear_cgroup(self, grant_id: str) -> None:
        """Kill what is left in the orphan's cgroup (children that left its group included)
        and remove it, so a crash leaves no cgroup behind."""
        if self._runner.hierarchy is not None:
            await self._runner.hierarchy.clear_leftover(grant_id)

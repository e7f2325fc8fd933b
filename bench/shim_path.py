"""The executor's shim path alone: ``python -m bench --only shim``.

Jobs of ``true`` started through the executor's shim pool (``gpulayer_executor.shim_pool``:
the fork server, idle shims handed their next job) and followed to their end through each
job's notify pipe, 8 at once, each in its own cgroup where this machine lets us make them (as
the executor does). No NATS, no PostgreSQL: what one job costs the executor's side (this
process, standing in for it), the fork server, the shim and the job itself.

The full loop's CPU per job moves 10-20% between runs of the same code on these machines, more
than a change to the shim saves: this figure, alternated in ``make bench-ab``, resolves one.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import psutil

from bench.cpu import tree_cpu
from bench.report import Figure, unavailable

JOBS = 1500
AT_ONCE = 8
ROUNDS = 3
NAMES = [("shim_path_cpu_us_per_job", "us"), ("shim_path_jobs_per_s", "jobs/s")]


async def _until_ended(notify: int) -> None:
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            data = os.read(notify, 4096)
        except BlockingIOError:
            return
        if (not data or b"e" in data) and not ended.done():
            ended.set_result(None)

    os.set_blocking(notify, False)
    loop.add_reader(notify, readable)
    try:
        await asyncio.wait_for(ended, 60)
    finally:
        loop.remove_reader(notify)
        os.close(notify)


async def _round(root: Path, jobs: int) -> tuple[float, float, str]:
    """One round: µs of CPU per job, jobs per second, and whether cgroups were on."""
    from gpulayer_executor import cgroups
    from gpulayer_executor.shim import ShimSpec, hierarchy_spec, read_status
    from gpulayer_executor.shim_pool import ForkServer

    found = cgroups.hierarchy(True)
    hierarchy = hierarchy_spec(found) if found is not None else None
    pool = ForkServer()
    pool.start()
    gate = asyncio.Semaphore(AT_ONCE)
    runs = root / f"shim-path-{uuid.uuid4().hex[:8]}"
    runs.mkdir(parents=True)

    async def one(i: int) -> None:
        async with gate:
            run = runs / f"r{i}"
            run.mkdir()
            grant_id = f"shim-path-{run.parent.name}-{i}"
            spec = ShimSpec(
                grant_id=grant_id,
                job_id=f"j{i}",
                run_dir=str(run),
                argv=["true"],
                env={"PATH": os.environ.get("PATH", os.defpath), "GPULAYER_GRANT_ID": grant_id},
                cwd=str(run),
                hierarchy=hierarchy,
            )
            lease = await pool.fork(spec)
            try:
                await _until_ended(lease.notify)
            finally:
                pool.done(lease)
            if read_status(run).exit is None:
                raise OSError(f"job {i} ended without its outcome in its status file")

    try:
        await asyncio.gather(*(one(-1 - i) for i in range(2 * AT_ONCE)))  # the shims forked
        assert pool._proc is not None
        server = pool._proc.pid
        me = psutil.Process()
        own0, tree0, t0 = (
            sum(me.cpu_times()[:2]),
            tree_cpu(psutil.Process(server)),
            time.perf_counter(),
        )
        await asyncio.gather(*(one(i) for i in range(jobs)))
        own1, tree1, t1 = (
            sum(me.cpu_times()[:2]),
            tree_cpu(psutil.Process(server)),
            time.perf_counter(),
        )
    finally:
        await pool.close()
    cpu = (own1 - own0 + tree1 - tree0) * 1e6 / jobs
    return cpu, jobs / (t1 - t0), "cgroups on" if hierarchy is not None else "no cgroups"


async def shim_path(root: Path, jobs: int = JOBS, rounds: int = ROUNDS) -> list[Figure]:
    """The median of ``rounds`` rounds of ``jobs`` jobs each."""
    try:
        results = [await _round(root, jobs) for _ in range(rounds)]
    except (OSError, TimeoutError, ImportError) as err:
        return [unavailable(n, u, str(err)) for n, u in NAMES]
    cpus = sorted(r[0] for r in results)
    rates = sorted(r[1] for r in results)
    note = f"{jobs} `true` jobs, {AT_ONCE} at once, {results[0][2]}"
    return [
        Figure(
            NAMES[0][0], cpus[len(cpus) // 2], "us", note=f"{note}; runs {[round(c) for c in cpus]}"
        ),
        Figure(
            NAMES[1][0], rates[len(rates) // 2], "jobs/s", note=f"runs {[round(r) for r in rates]}"
        ),
    ]

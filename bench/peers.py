"""The peer figures (``make bench PEERS=1``, ``--peers``): the full loop's workload in Ray,
measured in the same run right after gpulayer's, and the ratios of the two.

Ray is installed from the package registry (``pip install ray``) into a venv under the bench's
temp folder, then ``bench/ray_peer.py`` runs there as its own process. When Ray can't be
installed or run, the figures are ``unavailable`` with the reason: the bench never fails on it.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec

from bench.harness import percentile
from bench.report import Figure, unavailable

RAY_SCRIPT = Path(__file__).resolve().parent / "ray_peer.py"
MARK = "RAY_PEER "
DEFAULT_MODE_JOBS = 50  # Ray's default mode starts a worker per task: a few jobs/s
INSTALL_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 600.0

NAMES = [
    ("ray_fast_jobs_per_s", "jobs/s"),
    ("ray_fast_submit_to_start_p50", "ms"),
    ("ray_fast_submit_to_start_p99", "ms"),
    ("ray_default_jobs_per_s", "jobs/s"),
    ("full_loop_over_ray", "x"),
    ("start_p99_over_ray", "x"),
]


class PeerError(RuntimeError):
    """Ray could not be installed, run or understood; the message says why."""


class RayRun(msgspec.Struct):
    """What ``bench/ray_peer.py`` prints after its mark (raw timings, seconds)."""

    ray_version: str
    fast_jobs: int
    fast_seconds: float
    paced_offered: float
    paced_start_seconds: list[float]
    default_jobs: int
    default_seconds: float


def parse_peer_output(stdout: str) -> RayRun:
    """The last ``RAY_PEER {json}`` line of the script's output, checked: positive job counts
    and durations, at least one paced start, every value finite."""
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise PeerError(f"no {MARK.strip()} line in the Ray script's output")
    try:
        run = msgspec.json.decode(lines[-1][len(MARK) :], type=RayRun)
    except msgspec.DecodeError as err:
        raise PeerError(f"bad {MARK.strip()} line: {err}") from err
    for name in ("fast_jobs", "default_jobs", "fast_seconds", "default_seconds", "paced_offered"):
        value = getattr(run, name)
        if not math.isfinite(value) or value <= 0:
            raise PeerError(f"bad {MARK.strip()} line: {name} = {value} (must be > 0)")
    if not run.paced_start_seconds:
        raise PeerError(f"bad {MARK.strip()} line: no paced start measured")
    if not all(math.isfinite(v) for v in run.paced_start_seconds):
        raise PeerError(f"bad {MARK.strip()} line: a paced start is not a finite number")
    return run


def peer_figures(run: RayRun, loop_rate: float | None, loop_p99_ms: float | None) -> list[Figure]:
    """Ray's figures, then gpulayer's full loop over Ray's fast mode: jobs/s (higher is better
    for gpulayer) and start p99 (lower is better); a ratio is unavailable when gpulayer's own
    figure is."""
    fast_rate = run.fast_jobs / run.fast_seconds
    starts = [v * 1000.0 for v in run.paced_start_seconds]
    p99 = percentile(starts, 99)
    figs = [
        Figure(
            "ray_fast_jobs_per_s",
            fast_rate,
            "jobs/s",
            note=f"Ray {run.ray_version}, max_calls=0, {run.fast_jobs} jobs",
        ),
        Figure("ray_fast_paced_offered", run.paced_offered, "jobs/s"),
        Figure("ray_fast_submit_to_start_p50", percentile(starts, 50), "ms"),
        Figure("ray_fast_submit_to_start_p99", p99, "ms"),
        Figure(
            "ray_default_jobs_per_s",
            run.default_jobs / run.default_seconds,
            "jobs/s",
            note=f"Ray {run.ray_version}, max_calls=1 (its default), {run.default_jobs} jobs",
        ),
    ]
    if loop_rate is None:
        figs.append(unavailable("full_loop_over_ray", "x", "no full loop figure in this run"))
    else:
        figs.append(Figure("full_loop_over_ray", loop_rate / fast_rate, "x"))
    if loop_p99_ms is None or p99 <= 0:
        figs.append(unavailable("start_p99_over_ray", "x", "no start p99 to compare"))
    else:
        figs.append(Figure("start_p99_over_ray", loop_p99_ms / p99, "x"))
    return figs


def _install(venv: Path) -> Path:
    """``python3 -m venv`` + ``pip install ray``; the venv's interpreter."""
    python3 = shutil.which("python3") or sys.executable
    for argv in (
        [python3, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "ray"],
    ):
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise PeerError(f"{' '.join(argv[1:4])}: {err}") from err
        if done.returncode != 0:
            why = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise PeerError(f"{' '.join(argv[1:4])} exited {done.returncode}: {why}")
    return venv / "bin" / "python"


def _run_ray(python: Path, temp: Path, jobs: int, paced: int, default_jobs: int) -> RayRun:
    argv = [str(python), str(RAY_SCRIPT), "--jobs", str(jobs), "--paced", str(paced)]
    argv += ["--default-jobs", str(default_jobs), "--temp-dir", str(temp)]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PeerError(f"the Ray script: {err}") from err
    if done.returncode != 0:
        why = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise PeerError(f"the Ray script exited {done.returncode}: {why}")
    return parse_peer_output(done.stdout)


async def ray_figures(
    root: Path, jobs: int, paced: int, loop_rate: float | None, loop_p99_ms: float | None
) -> list[Figure]:
    """Install Ray under ``root``, run its side of the loop, and return the peer figures (each
    ``unavailable`` with the reason when that fails)."""
    venv = root / "ray-venv"
    print(
        f"# peers: installing Ray from the package registry (pip install ray) into {venv}",
        flush=True,
    )
    try:
        python = await asyncio.to_thread(_install, venv)
        print(f"# peers: running {jobs} + {paced} + {DEFAULT_MODE_JOBS} jobs in Ray", flush=True)
        # Ray's session files under the bench's temp folder, removed with it.
        temp = root / "ray"
        run = await asyncio.to_thread(_run_ray, python, temp, jobs, paced, DEFAULT_MODE_JOBS)
    except PeerError as err:
        print(f"# peers: Ray not measured: {err}", flush=True)
        return [unavailable(name, unit, str(err)) for name, unit in NAMES]
    return peer_figures(run, loop_rate, loop_p99_ms)

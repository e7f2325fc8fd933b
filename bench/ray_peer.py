"""The full loop's workload in Ray, run by ``bench/peers.py`` with the interpreter of a venv that
has Ray (``python bench/ray_peer.py --jobs N --paced M --default-jobs K``). It imports nothing
from gpulayer (that venv has only Ray) and prints one line, ``RAY_PEER {json}``, with the raw
timings; the bench computes the figures from them (``bench.peers.parse_peer_output``).

The workload is the one of ``bench.figures.full_loop``: 8 logical GPUs, one-GPU jobs each
starting a new ``true`` process. A job's start is taken as gpulayer's executor takes it: the
wall time right after the spawn call returned (the shim records ``started_at`` just after
``posix_spawn``), against the wall time just before the submit call.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from typing import Any

MARK = "RAY_PEER "
GPUS = 8
WARM_UP = 16  # jobs run (and not counted) before the fast burst: Ray starts its workers lazily


def spawn_true() -> float:
    """One job: start ``true`` as a new process, note when it started, wait for its end."""
    child = subprocess.Popen(["true"])
    started = time.time()
    if child.wait() != 0:
        raise RuntimeError(f"true exited with {child.returncode}")
    return started


def _burst(task: Any, ray: Any, n: int) -> float:
    """Seconds from the first submit to the last result of ``n`` jobs submitted at once."""
    t0 = time.perf_counter()
    ray.get([task.remote() for _ in range(n)])
    return time.perf_counter() - t0


def _paced(task: Any, ray: Any, n: int, offered: float) -> list[float]:
    """``n`` jobs at ``offered`` per second in 1 ms ticks (as the bench paces gpulayer's);
    per job, seconds from its submit to its process start."""
    sent: list[float] = []
    refs: list[Any] = []
    p0 = time.perf_counter()
    while len(refs) < n:
        due = min(n, int((time.perf_counter() - p0) * offered) + 1)
        while len(refs) < due:
            sent.append(time.time())
            refs.append(task.remote())
        time.sleep(0.001)
    starts = ray.get(refs)
    return [float(start) - t for start, t in zip(starts, sent, strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ray_peer.py", description=__doc__)
    p.add_argument("--jobs", type=int, required=True, help="fast-mode burst size")
    p.add_argument("--paced", type=int, required=True, help="jobs in the paced half-load")
    p.add_argument("--default-jobs", type=int, required=True, help="default-mode burst size")
    p.add_argument("--temp-dir", help="Ray's session files (default: Ray's, under /tmp/ray)")
    args = p.parse_args(argv)
    ray: Any = importlib.import_module("ray")
    # The dashboard off: it is a web UI, no part of running tasks, and it takes CPU from the
    # same 2 cores.
    extra = {"_temp_dir": args.temp_dir} if args.temp_dir else {}
    ray.init(num_cpus=GPUS, num_gpus=GPUS, include_dashboard=False, log_to_driver=False, **extra)
    try:
        # Worker reuse: Ray's fastest mode for GPU tasks.
        fast = ray.remote(num_gpus=1, max_calls=0)(spawn_true)
        ray.get([fast.remote() for _ in range(WARM_UP)])
        fast_s = _burst(fast, ray, args.jobs)
        offered = args.jobs / fast_s * 0.5
        paced = _paced(fast, ray, args.paced, offered)
        # Ray's default for a num_gpus task (max_calls=1): a fresh worker process per task.
        default = ray.remote(num_gpus=1)(spawn_true)
        default_s = _burst(default, ray, args.default_jobs)
    finally:
        ray.shutdown()
    result = {
        "ray_version": str(ray.__version__),
        "fast_jobs": args.jobs,
        "fast_seconds": fast_s,
        "paced_offered": offered,
        "paced_start_seconds": paced,
        "default_jobs": args.default_jobs,
        "default_seconds": default_s,
    }
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

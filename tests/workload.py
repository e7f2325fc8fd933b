"""A real workload interpreter for the tests that need one: a throwaway venv with numpy, and
torch==2.13.0 (the CPU wheel) where pip can install it. Built once per test session (the
``workload_venv`` fixture in tests/conftest.py), shared by the probe's framework tests and the
distributed (torchrun + gloo) tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TORCH = "2.13.0"


class Workload:
    def __init__(self, python: str, numpy: str, torch: str | None, torch_skip: str) -> None:
        self.python, self.numpy, self.torch, self.torch_skip = python, numpy, torch, torch_skip

    def need_torch(self) -> None:
        """Skip the calling test, saying why, where torch could not be installed."""
        if self.torch is None:
            pytest.skip(self.torch_skip)


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def make_workload_venv(root: Path) -> Workload:
    """The venv at ``root``; skips the test (with the reason) where not even numpy installs."""
    made = subprocess.run(
        [sys.executable, "-m", "venv", str(root)], capture_output=True, text=True, timeout=120
    )
    if made.returncode != 0:
        pytest.skip(f"could not create a venv: {made.stderr.strip()[-300:]}")
    python = root / "bin" / "python"
    got = _pip(python, "numpy")
    if got.returncode != 0:
        pytest.skip(f"pip install numpy failed (offline?): {got.stderr.strip()[-300:]}")
    numpy = subprocess.run(
        [str(python), "-c", "import numpy; print(numpy.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    torch, why = None, ""
    got = _pip(python, f"torch=={TORCH}")
    if got.returncode == 0:
        torch = TORCH
    else:
        why = (
            f"pip install torch=={TORCH} failed (not available offline here?): "
            f"{got.stderr.strip()[-300:]}"
        )
    return Workload(str(python), numpy, torch, why)


# Each worker of a distributed job: all_reduce of (its global rank + 1) over gloo, then one JSON
# file per rank in its working folder (the job's folder on its node): what it saw and summed.
# Every worker first leaves its pid in ``pid-<node>-<local rank>``; with FAIL_NODE set to its
# node rank it then exits 3 before the rendezvous.
ALL_REDUCE = """\
import json, os, sys
from pathlib import Path

node, local = os.environ["NODE_RANK"], os.environ["LOCAL_RANK"]
Path(f"pid-{node}-{local}").write_text(str(os.getpid()))
if os.environ.get("FAIL_NODE") == node:
    sys.exit(3)
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
seen = {k: os.environ.get(k) for k in (
    "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPULAYER_JOB_ID",
    "TMPDIR", "TORCHELASTIC_ERROR_FILE",
)}
seen.update(rank=rank, world=dist.get_world_size(), sum=int(value.item()), pid=os.getpid())
Path(f"rank{rank}.json").write_text(json.dumps(seen))
dist.destroy_process_group()
print(f"rank {rank}: sum {int(value.item())}", flush=True)
"""


def all_reduce_sum(world_size: int) -> int:
    """What every rank of ALL_REDUCE reports: 1 + 2 + ... + world_size."""
    return world_size * (world_size + 1) // 2

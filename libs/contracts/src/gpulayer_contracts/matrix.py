"""The support matrix: what gpulayer may schedule at all. Edited by hand.

Two tables: accelerators (the devices a job is granted) per mode, and GPU APIs (what
``gpu.apis_any`` asks for). A node that offers an API the matrix doesn't schedule is no match
for a job that asks for that API alone.

Levels, strongest first:
- ``tested``: exercised end to end by the test suite on every CI run.
- ``hardware-validated``: passed ``tests/hardware/`` on real hardware (see docs/hardware-validation.md).
- ``implemented``: scheduled, but never shown as tested.
- ``detection-only``: the probe reports it; jobs are never scheduled on it.
- ``unsupported``: never scheduled.

Only raise a level when the run that justifies it has happened and is recorded.
"""

from __future__ import annotations

from typing import Literal

from gpulayer_contracts.jobs import Accelerator

Level = Literal["tested", "hardware-validated", "implemented", "detection-only", "unsupported"]
Mode = Literal["independent", "distributed"]

SCHEDULABLE: frozenset[Level] = frozenset({"tested", "hardware-validated", "implemented"})

SUPPORT_MATRIX: dict[Accelerator, dict[Mode, Level]] = {
    # Distributed: tests/e2e/test_distributed.py runs a 2-node x 2-process torchrun + gloo job
    # (all_reduce) through the whole stack on one host, with torch 2.13.0 CPU, on every CI run.
    "cpu": {"independent": "tested", "distributed": "tested"},
    # tests/hardware passed on one NVIDIA H200 (2026-11-30, docs/hardware-validation.md): the
    # probe agreed with nvidia-smi and a one-GPU torch job ran through the whole stack.
    # Distributed cuda (nccl or gloo) is placed and launched like cpu's (planning and the
    # launch are tested), but no multi-GPU NCCL run has happened.
    "cuda": {"independent": "hardware-validated", "distributed": "implemented"},
    # No Apple machine has run the suite; MPS has no multi-node story at all.
    "mps": {"independent": "implemented", "distributed": "unsupported"},
    "rocm": {"independent": "detection-only", "distributed": "detection-only"},
}


# The GPU APIs a node reports (host or containers) and ``gpu.apis_any`` names. Matching a job on
# one is tested by the unit suite; no node with these APIs has run in CI, so none is "tested".
API_SUPPORT: dict[str, Level] = {
    "cuda": "implemented",
    "rocm": "implemented",
    "vulkan": "implemented",
    "opencl": "implemented",
    "metal": "implemented",
    # Detected in WSL2 (/dev/dxg, the D3D12 libraries, a vendor driver in the driver store) and
    # passed to containers, but no WSL2 machine has run the suite or a DirectML job.
    "directml": "detection-only",
}


def api_level(api: str) -> Level | None:
    """The level of a GPU API; None for a name the matrix doesn't know (no detector reports it)."""
    return API_SUPPORT.get(api)


def api_schedulable(api: str) -> bool:
    """Whether a node offering ``api`` may take a job for it. An API the matrix doesn't know is
    left to the node's report (no detector reports one, so no node offers it)."""
    level = API_SUPPORT.get(api)
    return level is None or level in SCHEDULABLE


def support_level(accelerator: Accelerator, mode: Mode) -> Level:
    return SUPPORT_MATRIX[accelerator][mode]


def is_schedulable(accelerator: Accelerator, mode: Mode) -> bool:
    return support_level(accelerator, mode) in SCHEDULABLE

"""Job requests: what users publish to ``gpulayer.jobs.submit`` or write in job files.

Input from outside is decoded strictly (``forbid_unknown_fields``): a typo in a job file is an
error naming its path, not a silently ignored field.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from gpulayer_contracts._base import Input

Accelerator = Literal["cpu", "cuda", "mps", "rocm"]
MemoryKind = Literal["dedicated", "unified"]
GpuUse = Literal["none", "shared", "exclusive"]
PlatformFamily = Literal["linux", "darwin", "windows"]

# A job id becomes one token of a NATS subject (gpulayer.job.<id>.events), so it may not hold
# dots, wildcards or whitespace.
JOB_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
JobId = Annotated[str, msgspec.Meta(pattern=JOB_ID_PATTERN, description="Client-chosen job id")]


class Requirements(Input, frozen=True):
    """What a node must offer. Unset fields are no constraint."""

    accelerator: Accelerator | None = None
    gpu_count: Annotated[int, msgspec.Meta(ge=0)] = 0
    gpu_memory_gb: Annotated[float, msgspec.Meta(gt=0)] | None = None
    gpu_memory_kind: MemoryKind | None = None
    min_cuda_compute_capability: float | str | None = None
    frameworks: dict[str, str] = {}
    framework_capabilities: list[str] = []
    python: str | None = None


class GpuUsage(Input, frozen=True):
    """How the job uses GPUs. ``use`` unset means: exclusive when GPUs are requested, else none."""

    use: GpuUse | None = None
    apis_any: list[str] = []
    in_container: bool = False


class Variant(Input, frozen=True):
    """Per-platform replacement of the job's ``gpu`` section (replaces it whole)."""

    gpu: GpuUsage = GpuUsage()


class SandboxDevices(Input, frozen=True):
    gpu: Literal["compute"] | None = None


class Sandbox(Input, frozen=True):
    """Sandbox grants. Without ``devices.gpu = "compute"`` no GPU is made visible to the job."""

    devices: SandboxDevices = SandboxDevices()


class Distributed(Input, frozen=True):
    nodes: Annotated[int, msgspec.Meta(ge=1)] = 1
    processes_per_node: Annotated[int, msgspec.Meta(ge=1)] = 1
    backend: str | None = None
    launcher: str | None = None


class JobRequest(Input, frozen=True):
    """A job as submitted. ``job_id`` is the dedupe key: the same id twice is one job."""

    job_id: JobId
    command: Annotated[list[str], msgspec.Meta(min_length=1)]
    name: str = ""
    env: dict[str, str] = {}
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    requirements: Requirements = Requirements()
    gpu: GpuUsage | None = None
    variants: dict[PlatformFamily, Variant] = {}
    sandbox: Sandbox = Sandbox()
    distributed: Distributed | None = None
    requires_core: str | None = None

"""What a job needs, compiled once per call: the plan every rule reads.

``Plan.key`` names the job's shape (everything a capability verdict depends on), so that a node's
verdict, cached in its ``Facts.results``, is reused by every job of the same shape.
"""

from __future__ import annotations

import itertools
from typing import Final

from packaging.utils import canonicalize_name

from gpulayer_contracts import matrix
from gpulayer_contracts.jobs import Accelerator, GpuUse, JobRequest
from gpulayer_contracts.validation import (
    effective_gpu,
    effective_use,
    parse_compute_capability,
    requested_gpu_count,
)
from gpulayer_matching.facts import specifier
from gpulayer_matching.resources import job_memory_bytes, job_millicores, need_mib

__all__ = ["GPU_ORDER", "Gpu", "Plan", "compile_plan"]

# Order in which GPU accelerators are tried when a job names none. ROCm stays in the list so
# that it starts being used the day the support matrix raises it.
GPU_ORDER: Final[tuple[Accelerator, ...]] = ("cuda", "mps", "rocm")


class Gpu:
    __slots__ = ("apis", "in_container", "use")

    def __init__(self, use: GpuUse, apis: tuple[str, ...], in_container: bool) -> None:
        self.use = use
        self.apis = apis
        self.in_container = in_container


_SHAPES: dict[tuple[object, ...], int] = {}
_SHAPE_IDS = itertools.count()


class Plan:
    __slots__ = (
        "acc",
        "backend",
        "candidates",
        "cc",
        "container",
        "cpu_ok",
        "device_rules",
        "driver",
        "failure",
        "frameworks",
        "from_profile",
        "fwcaps",
        "gb",
        "gpus",
        "job",
        "key",
        "kind",
        "launcher",
        "mem_bytes",
        "mig_ok",
        "millicores",
        "mode_name",
        "n",
        "need_mib",
        "os",
        "profile",
        "python",
    )

    def __init__(self, job: JobRequest) -> None:
        req = job.requirements
        self.job = job
        self.failure: str | None = None
        self.acc = req.accelerator
        self.n = requested_gpu_count(job)
        self.mode_name: matrix.Mode = (
            "distributed" if job.distributed is not None else "independent"
        )
        self.kind = req.gpu_memory_kind
        self.gb = req.gpu_memory_gb
        self.need_mib = None if req.gpu_memory_gb is None else need_mib(req.gpu_memory_gb)
        # A MIG instance goes only to a job that asks for one device and says how much memory
        # it needs: a job without a memory figure expects a whole GPU, and CUDA enumerates one
        # MIG instance per process at most.
        self.mig_ok = self.n == 1 and self.need_mib is not None
        self.millicores = job_millicores(job)
        self.mem_bytes = job_memory_bytes(job)
        self.cc: tuple[int, int] | None = None
        try:
            self.cc = parse_compute_capability(req.min_cuda_compute_capability)
        except ValueError as err:
            self.failure = f"requirements.min_cuda_compute_capability: {err}"
        self.driver = req.driver
        self.os = req.os
        # Which requirements the job's profile supplied: explanations name it for them.
        self.profile = job.profile
        self.from_profile = frozenset(job.profile_fields)
        self.device_rules = (
            self.kind is not None
            or self.gb is not None
            or self.cc is not None
            or self.driver is not None
        )
        self.python = req.python
        self.frameworks = [(canonicalize_name(k), k, v) for k, v in sorted(req.frameworks.items())]
        self.fwcaps = tuple(req.framework_capabilities)
        dist = job.distributed
        self.backend = dist.backend if dist is not None else None
        self.launcher = dist.launcher if dist is not None else None
        # A job that names an image runs in a container: it needs a working container runtime,
        # and its GPU APIs are the node's container APIs (as with gpu.in_container).
        self.container = job.container is not None
        self.cpu_ok = matrix.is_schedulable("cpu", self.mode_name)

        self.candidates = self._candidates()
        self.gpus: dict[str | None, Gpu] = {}

        if self.failure is None:
            self.failure = self._job_failure()
        self.key = self._key()

    def _candidates(self) -> tuple[Accelerator, ...]:
        """The GPU accelerators the job may get, in the order they are tried."""
        if self.acc is None:
            # A compute capability and the NVIDIA driver are CUDA notions: asking for one means
            # asking for CUDA.
            cuda = self.cc is not None or self.driver is not None
            pool: tuple[Accelerator, ...] = ("cuda",) if cuda else GPU_ORDER
        elif self.acc == "cpu":
            pool = ()
        else:
            pool = (self.acc,)
        return tuple(a for a in pool if matrix.is_schedulable(a, self.mode_name))

    def _key(self) -> int:
        """The id of the job's shape: everything a node's capability verdict depends on."""
        shape = (
            self.n,
            self.acc,
            self.candidates,
            self.cpu_ok,
            self.kind,
            self.need_mib,
            self.cc,
            self.driver,
            self.os,
            self.python,
            tuple(self.frameworks),
            self.fwcaps,
            self.backend,
            self.launcher,
            self.container,
            self._gpu_shape(self.job),
        )
        key = _SHAPES.get(shape)
        if key is None:
            if len(_SHAPES) >= 65_536:
                # Ids are never reused (a fresh counter value each time), so forgetting shapes
                # only costs a recomputation of their cached verdicts.
                _SHAPES.clear()
            key = _SHAPES[shape] = next(_SHAPE_IDS)
        return key

    @staticmethod
    def _gpu_shape(job: JobRequest) -> tuple[object, ...]:
        sections = [(None, job.gpu), *sorted((p, v.gpu) for p, v in job.variants.items())]
        return tuple(
            (p, g.use, tuple(g.apis_any), g.in_container) if g is not None else (p,)
            for p, g in sections
        )

    def _job_failure(self) -> str | None:
        """Reasons no node could ever satisfy, whatever it offers."""
        dist = self.job.distributed
        if self.acc is not None and not matrix.is_schedulable(self.acc, self.mode_name):
            level = matrix.support_level(self.acc, self.mode_name)
            return f"{self.acc} is {level} in the support matrix for {self.mode_name} jobs"
        if dist is not None and not self.cpu_ok and not self.candidates:
            return "distributed jobs are not schedulable for any accelerator in the support matrix"
        if self.acc == "cpu" and (self.n > 0 or self.device_rules):
            return "a cpu job cannot ask for GPU devices or GPU memory"
        for field, spec in (("python", self.python), ("driver", self.driver)):
            if spec is not None and specifier(spec) is None:
                return f"requirements.{field}: {spec!r} is not a PEP 440 version specifier"
        for _, name, spec in self.frameworks:
            if specifier(spec) is None:
                return (
                    f"requirements.frameworks.{name}: {spec!r} is not a PEP 440 version specifier"
                )
        return None

    def gpu_for(self, family: str | None) -> Gpu:
        gpu = self.gpus.get(family)
        if gpu is None:
            section = effective_gpu(self.job, family)
            gpu = Gpu(
                effective_use(self.job, section),
                tuple(section.apis_any),
                section.in_container or self.container,
            )
            self.gpus[family] = gpu
        return gpu


def compile_plan(job: JobRequest) -> Plan:
    return Plan(job)

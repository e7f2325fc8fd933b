"""Rules every service applies the same way: submit-time validation, effective GPU use,
compute-capability parsing and the device visibility environment. Pure functions."""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from gpulayer_contracts.bounds import bound_messages, env_path, job_bound_errors
from gpulayer_contracts.events import GangRank
from gpulayer_contracts.jobs import (
    RANK_SUFFIX,
    Accelerator,
    GpuUsage,
    GpuUse,
    JobRequest,
)
from gpulayer_contracts.matrix import is_schedulable, support_level
from gpulayer_contracts.version import __version__

KNOWN_GPU_APIS = frozenset({"cuda", "rocm", "vulkan", "opencl", "directml", "metal"})
GPU_ACCELERATORS: frozenset[Accelerator] = frozenset({"cuda", "mps", "rocm"})

# Variables the executor owns. A job may not set them: they decide which GPUs it sees, or they
# inject code into every process it starts.
PROTECTED_ENV_EXACT = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "NVIDIA_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "GPU_DEVICE_ORDINAL",
        "LD_PRELOAD",
        "LD_AUDIT",
        "LD_LIBRARY_PATH",
        "DYLD_INSERT_LIBRARIES",
        "DYLD_LIBRARY_PATH",
    }
)
PROTECTED_ENV_PREFIXES = ("GPULAYER_",)
# What the executor sets for a rank of a distributed job (``rank_env``; torchrun derives RANK
# and LOCAL_RANK per worker from them): protected in a distributed job only, so a one-node job
# that sets up its own torch.distributed (MASTER_ADDR=localhost ...) keeps working.
RENDEZVOUS_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "NODE_RANK",
    "NNODES",
    "NPROC_PER_NODE",
    "RANK",
    "LOCAL_RANK",
)
# Launchers the executor can start a rank through (None: the command runs once per node).
LAUNCHERS = ("torchrun",)
# A submitted job id of this shape would name a rank of another job (``rank_job_id``).
_RANK_ID = re.compile(re.escape(RANK_SUFFIX) + r"[0-9]+$")


class Validation(msgspec.Struct, frozen=True):
    errors: list[str]
    warnings: list[str]

    @property
    def ok(self) -> bool:
        return not self.errors


def protected_env_names(env: Iterable[str], *, distributed: bool = False) -> list[str]:
    """The names in ``env`` gpulayer sets itself; with ``distributed``, the rendezvous ones too."""
    return sorted(
        name
        for name in env
        if name in PROTECTED_ENV_EXACT
        or name.startswith(PROTECTED_ENV_PREFIXES)
        or (distributed and name in RENDEZVOUS_ENV)
    )


def parse_compute_capability(value: float | str | None) -> tuple[int, int] | None:
    """``8.6`` / ``"8.6"`` / ``"10.0"`` → (major, minor), compared as numbers: 10.0 > 9.0."""
    if value is None:
        return None
    text = repr(value) if isinstance(value, float) else str(value).strip()
    major, _, minor = text.partition(".")
    if not major.isdigit() or (minor and not minor.isdigit()):
        raise ValueError(f"not a compute capability: {value!r}")
    return int(major), int(minor or 0)


def requested_gpu_count(job: JobRequest) -> int:
    """Devices the job needs. A GPU accelerator named without a count means one device."""
    req = job.requirements
    if req.gpu_count == 0 and req.accelerator in GPU_ACCELERATORS:
        return 1
    return req.gpu_count


def effective_gpu(job: JobRequest, platform_family: str | None) -> GpuUsage:
    """The job's ``gpu`` section on a node of this platform: a variant replaces it whole."""
    if platform_family is not None and platform_family in job.variants:
        return job.variants[platform_family].gpu
    return job.gpu or GpuUsage()


def effective_use(job: JobRequest, gpu: GpuUsage) -> GpuUse:
    if gpu.use is not None:
        return gpu.use
    if requested_gpu_count(job) > 0:
        return "exclusive"
    return "none"


def _check_specifier(path: str, spec: str, errors: list[str]) -> None:
    try:
        SpecifierSet(spec)
    except InvalidSpecifier:
        errors.append(f"{path}: {spec!r} is not a PEP 440 version specifier")


def validate_job(job: JobRequest, core_version: str = __version__) -> Validation:
    """Everything that makes a decoded job invalid whatever the fleet looks like, hard bounds
    (``bounds.job_bound_errors``) first. At most ``bounds.MAX_ERRORS`` errors are listed."""
    errors: list[str] = job_bound_errors(job)
    warnings: list[str] = []
    errors += _command_and_id_errors(job)
    _check_device_requirements(job, errors, warnings)
    errors += _version_errors(job, core_version)
    sections: list[tuple[str, GpuUsage]] = [("$.gpu", job.gpu or GpuUsage())]
    sections += [(f"$.variants.{p}.gpu", v.gpu) for p, v in job.variants.items()]
    for path, gpu in sections:
        _check_gpu_section(job, path, gpu, errors, warnings)
    errors += distributed_errors(job)
    if job.distributed is not None and job.preemptible:
        warnings.append(
            "$.preemptible: a distributed job is never preempted (its ranks are placed and end "
            "together); preemptible has no effect on it"
        )
    req = job.requirements
    if req.accelerator is not None and not is_schedulable(req.accelerator, "independent"):
        level = support_level(req.accelerator, "independent")
        errors.append(
            f"$.requirements.accelerator: {req.accelerator} is {level} in the support matrix"
        )
    errors += lifecycle_errors(job)
    errors += gang_errors(job)
    return Validation(errors=bound_messages(errors), warnings=bound_messages(warnings))


def _command_and_id_errors(job: JobRequest) -> list[str]:
    """The program name, the env a job may not set, and a job id shaped like a rank's."""
    errors: list[str] = []
    if any(not arg for arg in job.command[:1]):
        errors.append("$.command[0]: the program name is empty")
    for name in protected_env_names(job.env, distributed=job.distributed is not None):
        errors.append(f"{env_path(name)}: set by gpulayer, a job may not set it")
    if isinstance(job.job_id, str) and _RANK_ID.search(job.job_id):
        errors.append(
            f"$.job_id: {job.job_id!r} ends in {RANK_SUFFIX}<digits>, the shape of the ids gpulayer "
            "gives the ranks of a distributed job (<job_id>-rank<R>): choose another id"
        )
    return errors


def _check_device_requirements(job: JobRequest, errors: list[str], warnings: list[str]) -> None:
    """What the requirements ask of each device, against the accelerator they name."""
    req = job.requirements
    if req.accelerator == "cpu":
        if req.gpu_count > 0:
            errors.append("$.requirements.gpu_count: a cpu job cannot ask for GPU devices")
        for field in ("gpu_memory_gb", "gpu_memory_kind"):
            if getattr(req, field) is not None:
                errors.append(f"$.requirements.{field}: a cpu job uses no GPU memory")
    per_device = [
        f
        for f in ("gpu_memory_gb", "gpu_memory_kind", "min_cuda_compute_capability", "driver")
        if getattr(req, f) is not None
    ]
    if per_device and requested_gpu_count(job) == 0 and req.accelerator != "cpu":
        warnings.append(
            f"$.requirements: {', '.join(per_device)} apply per device, but the job asks for no "
            "device (set gpu_count or accelerator): they only filter nodes"
        )
    if req.accelerator == "mps" and req.gpu_memory_kind == "dedicated":
        errors.append(
            "$.requirements.gpu_memory_kind: mps devices have unified memory, never dedicated"
        )
    if req.min_cuda_compute_capability is not None:
        try:
            parse_compute_capability(req.min_cuda_compute_capability)
        except ValueError as err:
            errors.append(f"$.requirements.min_cuda_compute_capability: {err}")
        if req.accelerator not in (None, "cuda"):
            errors.append(
                "$.requirements.min_cuda_compute_capability: only meaningful for cuda jobs, "
                f"this job asks for {req.accelerator}"
            )


def _version_errors(job: JobRequest, core_version: str) -> list[str]:
    """The driver, framework, python and gpulayer version specifiers."""
    errors: list[str] = []
    req = job.requirements
    if req.driver is not None:
        _check_specifier("$.requirements.driver", req.driver, errors)
        if req.accelerator not in (None, "cuda"):
            errors.append(
                "$.requirements.driver: the NVIDIA driver is only meaningful for cuda jobs, "
                f"this job asks for {req.accelerator}"
            )
    for name, spec in req.frameworks.items():
        _check_specifier(f"$.requirements.frameworks.{name}", spec, errors)
    if req.python is not None:
        _check_specifier("$.requirements.python", req.python, errors)
    if job.requires_core is not None:
        errors += _requires_core_errors(job.requires_core, core_version)
    return errors


def _requires_core_errors(requires_core: str, core_version: str) -> list[str]:
    try:
        if not SpecifierSet(requires_core).contains(Version(core_version), prereleases=True):
            return [f"$.requires_core: gpulayer {core_version} does not satisfy {requires_core!r}"]
    except InvalidSpecifier:
        return [f"$.requires_core: {requires_core!r} is not a PEP 440 version specifier"]
    except InvalidVersion:  # pragma: no cover - our own version is always valid
        return [f"$.requires_core: gpulayer's version {core_version!r} is not PEP 440"]
    return []


def _check_gpu_section(
    job: JobRequest, path: str, gpu: GpuUsage, errors: list[str], warnings: list[str]
) -> None:
    """One ``gpu`` section (the job's or a platform variant's) against the requirements."""
    req = job.requirements
    if gpu.apis_any and effective_use(job, gpu) == "none":
        errors.append(f'{path}.apis_any: needs gpu.use = "shared" or "exclusive"')
    if gpu.apis_any and req.accelerator == "cpu":
        errors.append(f"{path}.apis_any: a cpu job uses no GPU API")
    if gpu.use == "none" and requested_gpu_count(job) > 0:
        errors.append(f'{path}.use: "none" contradicts the GPU devices the job asks for')
    if effective_use(job, gpu) == "shared" and req.gpu_memory_gb is None:
        warnings.append(
            f'{path}.use: "shared" without requirements.gpu_memory_gb reserves no GPU '
            "memory: jobs sharing the device may take all of it"
        )
    for api in gpu.apis_any:
        if api not in KNOWN_GPU_APIS:
            warnings.append(
                f"{path}.apis_any: {api!r} is an API no detector knows; "
                "no node will report it until one does"
            )


def distributed_errors(job: JobRequest) -> list[str]:
    """What the support matrix and the executor make of a distributed job (docs/jobs.md)."""
    dist, req = job.distributed, job.requirements
    if dist is None:
        return []
    errors: list[str] = []
    if req.accelerator == "mps":
        errors.append(
            "$.distributed: mps jobs cannot be distributed (requirements.accelerator = mps is "
            "unsupported for distributed jobs in the support matrix)"
        )
    elif req.accelerator is not None and not is_schedulable(req.accelerator, "distributed"):
        level = support_level(req.accelerator, "distributed")
        errors.append(
            f"$.distributed: distributed {req.accelerator} jobs are {level} in the support matrix"
        )
    if dist.backend == "nccl" and req.accelerator != "cuda":
        errors.append(
            '$.distributed.backend: "nccl" runs on NVIDIA GPUs only: set '
            'requirements.accelerator = "cuda" (or use "gloo")'
        )
    gpus = requested_gpu_count(job)
    if req.accelerator == "cuda" and dist.processes_per_node > gpus:
        errors.append(
            f"$.distributed.processes_per_node: {dist.processes_per_node} processes on each node, "
            f"but each node gets {gpus} cuda device{'s' if gpus != 1 else ''} "
            "(requirements.gpu_count): one GPU per process"
        )
    if dist.launcher is not None and dist.launcher not in LAUNCHERS:
        errors.append(
            f"$.distributed.launcher: {dist.launcher!r} is not a launcher the executor can start "
            f"({', '.join(LAUNCHERS)}; unset: the command runs once per node)"
        )
    return errors  # retries, services: gang_errors


def rank_env(gang: GangRank, launcher: str | None) -> dict[str, str]:
    """The rendezvous variables of one rank (node) of a distributed job, as the executor sets
    them. Without a launcher the command is the node's only process, so it is also RANK (its
    node rank) and LOCAL_RANK 0 when there is one process per node; torchrun sets both per
    worker itself."""
    env = {
        "MASTER_ADDR": gang.master_addr,
        "MASTER_PORT": str(gang.master_port),
        "WORLD_SIZE": str(gang.world_size),
        "NODE_RANK": str(gang.rank),
        "NNODES": str(gang.nnodes),
        "NPROC_PER_NODE": str(gang.nproc_per_node),
        "GPULAYER_JOB_ID": gang.job_id,
    }
    if launcher is None and gang.nproc_per_node == 1:
        env["RANK"] = str(gang.rank)
        env["LOCAL_RANK"] = "0"
    return env


def gang_errors(job: JobRequest) -> list[str]:
    """What placement can't do with a distributed job (issue 14, placement side): its ranks are
    placed once, as a whole, so no retries and no service restarts; each rank's id
    (``<job_id>-rank<R>``) must still be a job id."""
    dist = job.distributed
    if dist is None:
        return []
    errors = []
    if job.retries:
        errors.append(
            "$.retries: a distributed job is not retried (its ranks are placed once, together)"
        )
    if job.kind == "service":
        errors.append('$.kind: a distributed job cannot be a "service" (no gang restarts)')
    # The id's room for its ranks' suffix: bounds (_rank_id_error, arrays included).
    return errors


def lifecycle_errors(job: JobRequest) -> list[str]:
    """What makes retries, a service, an array or dependencies invalid on their own (whether
    the dependencies exist is placement's to say, at submit)."""
    errors: list[str] = []
    if job.kind == "service":
        if job.retries or job.retry_on_failure:
            errors.append(
                "$.retries: a service is restarted by its restart policy, not retried "
                "(leave retries and retry_on_failure unset)"
            )
    elif job.restart is not None:
        errors.append('$.restart: only a service restarts (set kind = "service")')
    if job.retry_on_failure and not job.retries:
        errors.append("$.retry_on_failure: set retries too (how many times)")
    r = job.restart
    if r is not None and r.max_backoff_s < r.backoff_s:
        errors.append(
            f"$.restart.max_backoff_s: {r.max_backoff_s:g} is below backoff_s ({r.backoff_s:g})"
        )
    if job.array is not None and job.array.index is not None:
        errors.append(
            "$.array.index: set by gpulayer on each job of the array, a job may not set it"
        )
    for i, dep in enumerate(job.after):
        if dep == job.job_id:
            errors.append(f"$.after[{i}]: a job can't wait for itself")
    return errors


def array_env(job: JobRequest) -> dict[str, str]:
    """``GPULAYER_ARRAY_INDEX`` of a job of an array (set by the executor); empty otherwise."""
    if job.array is None or job.array.index is None:
        return {}
    return {"GPULAYER_ARRAY_INDEX": str(job.array.index)}


def visibility_env(
    accelerator: Accelerator,
    devices: list[int],
    gpu_granted: bool,
    instances: list[str] | None = None,
) -> dict[str, str]:
    """Device visibility variables for a granted job.

    Without the sandbox grant (``gpu_granted`` false) no GPU is made visible, whatever was
    requested. These variables steer well-behaved runtimes; they are not a security boundary.
    ``instances``: MIG instance UUIDs granted; CUDA sees them (and only them) by UUID, while
    ``devices`` are their parent GPUs.
    """
    indices = ",".join(str(i) for i in devices) if gpu_granted else ""
    env = {"GPULAYER_DEVICES": indices, "CUDA_VISIBLE_DEVICES": ""}
    if accelerator == "cuda":
        # CUDA takes MIG instances by UUID only (an index would name the parent GPU).
        env["CUDA_VISIBLE_DEVICES"] = ",".join(instances) if instances and gpu_granted else indices
        # Without this, CUDA numbers devices fastest-first, not as nvidia-smi does.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    elif accelerator == "rocm":
        env["ROCR_VISIBLE_DEVICES"] = indices
        env["HIP_VISIBLE_DEVICES"] = indices
    return env

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
# A rank of a distributed job is stored and granted as a job of its own, ``<job_id>-rank<R>``; a
# submitted job id may not have that shape (it would collide with a rank).
RANK_SUFFIX = "-rank"


def rank_job_id(job_id: str, rank: int) -> str:
    """The id of rank ``rank`` of distributed job ``job_id`` (its grant, status, events, logs)."""
    return f"{job_id}{RANK_SUFFIX}{rank}"


JobId = Annotated[str, msgspec.Meta(pattern=JOB_ID_PATTERN, description="Client-chosen job id")]

# A runtime profile and its version, ``name@version`` (``torch-2.5-cu124@1``): a name of up to
# 64 characters, then the version, a whole number. Profiles live in placement's profiles file.
PROFILE_REF_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}@[1-9][0-9]{0,5}$"
ProfileRef = Annotated[
    str,
    msgspec.Meta(
        pattern=PROFILE_REF_PATTERN,
        description="A runtime profile, name@version (e.g. torch-2.5-cu124@1)",
    ),
]


# The constraint sits on the number, the description on the optional field around it (msgspec
# allows no numeric constraint on an optional type, and drops a description inside a union).
Positive = Annotated[float, msgspec.Meta(gt=0)]

# What a job holds of its node's host when it names nothing (docs/jobs.md): one core, like
# Slurm's default of one CPU per task, and 1 GB of RAM, enough for a Python interpreter with a
# framework imported; a job that needs more says so, and is limited to what it asked for.
DEFAULT_CPU_CORES = 1.0
DEFAULT_MEMORY_GB = 1.0


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class Requirements(Input, frozen=True):
    """What a node must offer. Unset fields are no constraint."""

    accelerator: Annotated[Accelerator | None, _doc("cpu, cuda, mps or rocm; unset means any")] = (
        None
    )
    gpu_count: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="Devices needed; only devices that can execute work count. "
            "A GPU accelerator named without a count means one",
        ),
    ] = 0
    gpu_memory_gb: Annotated[
        Positive | None, _doc("Memory per device, in GB of 10^9 bytes (80 fits an 80GB card)")
    ] = None
    gpu_memory_kind: Annotated[MemoryKind | None, _doc("dedicated (VRAM) or unified (Apple)")] = (
        None
    )
    min_cuda_compute_capability: Annotated[
        float | str | None, _doc("Compared numerically per device: 8.6 >= 8.0, 10.0 > 9.0")
    ] = None
    frameworks: Annotated[
        dict[str, str], _doc('Framework name to PEP 440 specifier, e.g. {torch = ">=2.3"}')
    ] = {}
    framework_capabilities: Annotated[
        list[str], _doc("What frameworks must be able to drive, e.g. torch.cuda, torch.mps")
    ] = []
    python: Annotated[
        str | None, _doc("PEP 440 specifier on the workload interpreter's version")
    ] = None
    driver: Annotated[
        str | None,
        _doc(
            'PEP 440 specifier on the NVIDIA driver version of each device, e.g. ">=550"; '
            "asking for one means asking for CUDA"
        ),
    ] = None
    os: Annotated[
        PlatformFamily | None, _doc("The node's operating system: linux, darwin or windows")
    ] = None
    cpu_cores: Annotated[
        Positive,
        _doc(
            "Host CPU cores held while the job runs (fractions allowed, e.g. 0.5); enforced as a "
            "CPU quota where the node's executor can"
        ),
    ] = DEFAULT_CPU_CORES
    memory_gb: Annotated[
        Positive,
        _doc(
            "Host RAM held while the job runs, in GB of 10^9 bytes; enforced as a memory limit "
            "where the node's executor can (past it, the job fails with 'out of memory')"
        ),
    ] = DEFAULT_MEMORY_GB


class GpuUsage(Input, frozen=True):
    """How the job uses GPUs. ``use`` unset means: exclusive when GPUs are requested, else none."""

    use: Annotated[
        GpuUse | None,
        _doc("none, shared or exclusive; unset: exclusive when GPUs are requested, else none"),
    ] = None
    apis_any: Annotated[
        list[str],
        _doc(
            "Any one of these GPU APIs must be usable (cuda, rocm, vulkan, opencl, directml, metal)"
        ),
    ] = []
    in_container: Annotated[
        bool, _doc("Check apis_any against the node's container APIs instead of its host APIs")
    ] = False


class Variant(Input, frozen=True):
    """Per-platform replacement of the job's ``gpu`` section (replaces it whole)."""

    gpu: GpuUsage = GpuUsage()


class SandboxDevices(Input, frozen=True):
    gpu: Annotated[
        Literal["compute"] | None, _doc('"compute" makes the granted GPUs visible; unset: none')
    ] = None


class Sandbox(Input, frozen=True):
    """Sandbox grants. Without ``devices.gpu = "compute"`` no GPU is made visible to the job."""

    devices: SandboxDevices = SandboxDevices()


PullPolicy = Literal["missing", "never", "always"]

# An OCI image reference, [registry[:port]/]path[:tag][@digest], as the distribution spec's
# reference grammar has it (lower-case path components, a tag of up to 128 word characters, a
# digest algorithm:hex). Checked by validation (an error names $.container.image); it never
# starts with "-", so it can't read as an option of the runtime's command line.
_REF_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REF_HOST = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_REF_DOMAIN = rf"(?:{_REF_HOST}(?:\.{_REF_HOST})*|\[[0-9A-Fa-f:]+\])(?::[0-9]{{1,5}})?"
_REF_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_REF_DIGEST = r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[0-9a-fA-F]{32,}"
IMAGE_REF_PATTERN = (
    rf"^(?:{_REF_DOMAIN}/)?{_REF_COMPONENT}(?:/{_REF_COMPONENT})*"
    rf"(?::{_REF_TAG})?(?:@{_REF_DIGEST})?$"
)


class Container(Input, frozen=True):
    """Run the job's command inside an OCI image (podman on the node), with only its granted
    devices; matched against the node's container runtime and container GPU APIs."""

    image: Annotated[
        str, _doc("Image reference, e.g. localhost/train:1 or registry.example/org/img@sha256:...")
    ]
    pull: Annotated[
        PullPolicy,
        _doc("missing: pull when the node lacks it; never: the node must have it; always"),
    ] = "missing"


class Distributed(Input, frozen=True):
    nodes: Annotated[int, msgspec.Meta(ge=1, description="Number of nodes")] = 1
    processes_per_node: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="Processes on each node (cuda: at most the GPUs each node gets, one each)",
        ),
    ] = 1
    backend: Annotated[
        str | None, _doc("Distributed backend each node must offer: gloo, or nccl (cuda only)")
    ] = None
    launcher: Annotated[str | None, _doc("torchrun, or unset: the command runs once per node")] = (
        None
    )


# --- Lifecycle (issue 15, part B): retries, services, arrays, dependencies ---

JobKind = Literal["job", "service"]
RestartPolicy = Literal["always", "on-failure"]


class Restart(Input, frozen=True):
    """How a service is restarted when its process ends. Each restart waits ``backoff_s``
    doubled per restart so far, at most ``max_backoff_s``; only ``gpulayer cancel`` stops it."""

    policy: Annotated[
        RestartPolicy,
        _doc("always: whatever the exit; on-failure: not after exit code 0"),
    ] = "always"
    backoff_s: Annotated[
        float, msgspec.Meta(ge=0, description="Seconds before the first restart")
    ] = 1.0
    max_backoff_s: Annotated[
        float, msgspec.Meta(ge=0, description="Cap on the doubled backoff, in seconds")
    ] = 300.0


class ArraySpec(Input, frozen=True):
    """One submit, ``count`` jobs ``<job_id>-<i>`` (i from 0), each with
    ``GPULAYER_ARRAY_INDEX=<i>``."""

    count: Annotated[int, msgspec.Meta(ge=1, description="Jobs in the array")]
    index: Annotated[
        int | None,
        _doc("Set by placement on each job of the array; a submitted job leaves it unset"),
    ] = None


class JobRequest(Input, frozen=True):
    """A job as submitted. ``job_id`` is the dedupe key: the same id twice is one job."""

    job_id: JobId
    command: Annotated[
        list[str],
        msgspec.Meta(
            min_length=1, description="argv; run without a shell, arguments arrive literally"
        ),
    ]
    name: Annotated[str, _doc("Human-readable name")] = ""
    env: Annotated[
        dict[str, str],
        _doc(
            "Extra environment; variables gpulayer sets (CUDA_VISIBLE_DEVICES, LD_PRELOAD, GPULAYER_*) are refused"
        ),
    ] = {}
    timeout_s: Annotated[
        Positive | None, _doc("Killed (with its children) after this many seconds")
    ] = None
    requirements: Requirements = Requirements()
    gpu: GpuUsage | None = None
    variants: Annotated[
        dict[PlatformFamily, Variant],
        _doc("Per platform (linux, darwin, windows): replaces gpu whole there"),
    ] = {}
    sandbox: Sandbox = Sandbox()
    distributed: Distributed | None = None
    container: Annotated[
        Container | None, _doc("Run command in this OCI image instead of on the host")
    ] = None
    requires_core: Annotated[str | None, _doc("PEP 440 specifier on gpulayer's own version")] = None
    profile: Annotated[
        ProfileRef | None,
        _doc(
            "A runtime profile, name@version: placement adds its requirements to the job's own "
            "at submit (a field both set differently is an error)"
        ),
    ] = None
    profile_fields: Annotated[
        list[str],
        _doc(
            "Set by placement when it expands profile: the requirements (and container) the "
            "profile supplied (explanations name the profile for them); a submitter's value is "
            "replaced"
        ),
    ] = []
    # --- lifecycle (issue 15, part B) ---
    retries: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="Times a lost job (node gone, executor lost it) is placed again; "
            "failed ones too with retry_on_failure",
        ),
    ] = 0
    retry_on_failure: Annotated[
        bool, _doc("Also retry a job that failed (non-zero exit, timeout), within retries")
    ] = False
    kind: Annotated[
        JobKind, _doc("job: runs once; service: restarted by its restart policy until cancelled")
    ] = "job"
    restart: Annotated[
        Restart | None, _doc('A service\'s restart policy (kind = "service" only)')
    ] = None
    array: Annotated[ArraySpec | None, _doc("Submit count jobs <job_id>-<i> at once")] = None
    after: Annotated[
        list[JobId],
        _doc("Job ids that must all have succeeded before this one starts (submitted before it)"),
    ] = []
    # --- Queue policy (issue 15 part A) ---
    priority: Annotated[
        int,
        _doc(
            "Higher is placed first (-1000000 .. 1000000); within a priority, the owner with "
            "the least recent GPU usage goes first, then the oldest job"
        ),
    ] = 0
    preemptible: Annotated[
        bool,
        _doc(
            "May be cancelled to place a higher-priority job that can't fit otherwise; it is "
            "then requeued (same id, next attempt), not failed"
        ),
    ] = False

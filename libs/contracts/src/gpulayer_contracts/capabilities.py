"""What a node can do, as its probe detected it. Published on ``gpulayer.node.<node>.capabilities``.

Every value a probe could not detect is ``None`` and named in ``notes``: a requirement against
an unknown value is never satisfied. Hardware claims are self-reported by the node.
"""

from __future__ import annotations

from datetime import datetime

from gpulayer_contracts._base import Wire
from gpulayer_contracts.jobs import Accelerator, MemoryKind


class AcceleratorDevice(Wire, frozen=True):
    accelerator: Accelerator
    index: int
    vendor: str | None = None
    name: str | None = None
    uuid: str | None = None
    memory_mib: int | None = None
    memory_kind: MemoryKind | None = None
    compute_capability: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    mig_mode: str | None = None
    execution_supported: bool = False
    notes: list[str] = []
    # A MIG instance, offered as a device of its own: the GPU it is carved from (that GPU's
    # ``index``), its profile (``1g.10gb``). Its ``index`` is allocatable, not CUDA's
    # (``mig_index``), and its ``uuid`` is the ``MIG-...`` one CUDA_VISIBLE_DEVICES takes.
    mig_parent: int | None = None
    mig_profile: str | None = None


# Allocatable index of MIG device ``d`` of GPU ``p``: MIG_INDEX_BASE + p * MIG_INDEX_STRIDE + d.
# Above every real GPU index, so a node's indices stay unique (holds and allocations key on it).
MIG_INDEX_BASE = 1000
MIG_INDEX_STRIDE = 100


def mig_index(parent: int, device: int) -> int:
    """The allocatable index of MIG device ``device`` (``nvidia-smi -L``) of GPU ``parent``."""
    return MIG_INDEX_BASE + parent * MIG_INDEX_STRIDE + device


def grant_devices(
    accelerators: list[AcceleratorDevice], indices: list[int]
) -> tuple[list[int], list[str]]:
    """For allocated ``indices``: the GPU indices whose device nodes the job opens (a MIG
    instance's parent), and the MIG instances' UUIDs (empty when none is a MIG instance)."""
    by_index = {d.index: d for d in accelerators}
    parents: list[int] = []
    instances: list[str] = []
    for i in indices:
        d = by_index.get(i)
        if d is not None and d.mig_parent is not None and d.uuid is not None:
            instances.append(d.uuid)
            if d.mig_parent not in parents:
                parents.append(d.mig_parent)
        elif i not in parents:
            parents.append(i)
    return sorted(parents), instances


class HostInfo(Wire, frozen=True):
    hostname: str | None = None
    os: str | None = None
    os_release: str | None = None
    platform: str | None = None
    arch: str | None = None
    cpu_cores: int | None = None
    memory_bytes: int | None = None
    disk_free_bytes: int | None = None
    python_version: str | None = None
    # The address other nodes reach this one at: rank 0 of a distributed job placed here hosts
    # its rendezvous there (MASTER_ADDR). GPULAYER_ADVERTISE_ADDRESS, else detected.
    advertise_address: str | None = None
    # The probe runs in WSL2 (its kernel names microsoft-standard-WSL2): a Linux on Windows,
    # whose GPUs it reaches through /dev/dxg.
    wsl2: bool = False


class GpuApis(Wire, frozen=True):
    """GPU APIs usable on the host and inside containers, with the evidence for each."""

    host: list[str] = []
    containers: list[str] = []
    evidence: dict[str, str] = {}


class ContainerRuntime(Wire, frozen=True):
    """The node's container runtime as its probe found it. ``works``: its self-test started a
    container (placement places container jobs only where it did); ``notes`` say why not.
    ``cdi_devices``: the devices the node's CDI specs name, qualified (``nvidia.com/gpu=0``).
    ``machine_provider``: on macOS, the provider of the podman machine containers run in
    (``libkrun``, ``applehv``, ``qemu``), from ``podman machine inspect``."""

    name: str  # podman
    version: str | None = None
    oci_runtime: str | None = None  # runc, crun: what podman starts containers with
    works: bool = False
    notes: list[str] = []
    cdi_devices: list[str] = []
    machine_provider: str | None = None

    def describe(self) -> str:
        """``podman 4.3.1/runc``, with ``(self-test failed)`` when it did not start one."""
        text = " ".join(p for p in (self.name, self.version) if p)
        if self.oci_runtime:
            text += f"/{self.oci_runtime}"
        if self.machine_provider:
            text += f" (machine: {self.machine_provider})"
        return text if self.works else f"{text} (self-test failed)"


class WorkerCapabilities(Wire, frozen=True):
    node_id: str
    agent_version: str
    detected_at: datetime
    host: HostInfo = HostInfo()
    accelerators: list[AcceleratorDevice] = []
    # Versions read from package metadata of the workload interpreter (not the probe's own).
    workload_python: str | None = None
    workload_python_version: str | None = None
    frameworks: dict[str, str] = {}
    framework_capabilities: list[str] = []
    distributed_backends: list[str] = []
    launchers: list[str] = []
    gpu_apis: GpuApis = GpuApis()
    # None: no runtime found, the probe was told not to look, or an older probe (never said).
    container_runtime: ContainerRuntime | None = None
    advertise_address: str | None = None
    origin: str = "probe"
    notes: list[str] = []

    @property
    def platform_family(self) -> str | None:
        """``linux`` / ``darwin`` / ``windows`` from ``host.platform`` (``linux-x86_64``)."""
        if self.host.platform is None:
            return None
        return self.host.platform.split("-", 1)[0]


class Heartbeat(Wire, frozen=True):
    node_id: str
    sent_at: datetime
    source: str = "probe"
    agent_version: str | None = None
    # An executor's beat says what it offers placement (None: not said, e.g. a probe's beat or
    # an older executor; placement then keeps what it last knew, or counts no limit).
    # ``slots``: jobs it runs at once (GPULAYER_EXECUTOR_MAX_JOBS). ``reserved_*``: host cores
    # and RAM kept for the system, taken off what the probe reports. ``enforcement``: how job
    # limits are enforced on this node, e.g. "cgroup v1: memory cpu pids devices" or "none".
    slots: int | None = None
    reserved_cores: float | None = None
    reserved_memory_gb: float | None = None
    enforcement: str | None = None

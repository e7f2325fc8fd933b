"""The probe registry: every source, run at once, merged into one ``WorkerCapabilities``.

Each probe is run under a guard: an exception or a hang in one source becomes a note and the
others still report. (Probes bound their own commands; the guard catches a probe that hangs
outside them.)
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime

from gpulayer_contracts import __version__
from gpulayer_contracts.capabilities import GpuApis, HostInfo, WorkerCapabilities
from gpulayer_detection.apple import AppleProbe
from gpulayer_detection.base import DEFAULT_CDI_DIRS, Finding, Probe, ProbeContext, under_root
from gpulayer_detection.containers import ContainerRuntimeProbe, ContainerSettings
from gpulayer_detection.frameworks import FrameworksProbe, query_torch
from gpulayer_detection.gpu_apis import GpuApisProbe
from gpulayer_detection.host import HostProbe
from gpulayer_detection.nvidia import NvidiaProbe
from gpulayer_detection.rocm import RocmProbe
from gpulayer_detection.runner import Runner, run_command, with_tool_dirs
from gpulayer_detection.wsl import LIB_DIR, WslProbe

Timing = Callable[[str, float], None]

# Extra time a probe gets beyond its command timeout before the guard gives up on it.
_GUARD_GRACE_S = 5.0
# Where a program not on PATH is looked for too: WSL2's NVIDIA library holds nvidia-smi.
TOOL_DIRS: tuple[str, ...] = (LIB_DIR,)
HOST_ROOT_VARIABLE = "GPULAYER_PROBE_HOST_ROOT"


def host_root_from_env(env: Mapping[str, str]) -> str:
    """GPULAYER_PROBE_HOST_ROOT (default ``/``): an absolute path to an existing folder.
    Raises ValueError naming the variable otherwise."""
    root = env.get(HOST_ROOT_VARIABLE, "").strip() or "/"
    if not os.path.isabs(root) or not os.path.isdir(root):
        raise ValueError(f"{HOST_ROOT_VARIABLE}={root!r} is not an absolute path to a folder")
    return root


def default_probes(
    *,
    frameworks: bool = True,
    path: str | None = None,
    containers: ContainerRuntimeProbe | None = None,
    include_containers: bool = True,
) -> list[Probe]:
    """Every source, in the order their notes appear. ``containers``: the container runtime
    probe, which a caller that detects again and again keeps (its self-test is cached in it);
    None: a fresh one with the default settings. ``include_containers=False``: left out (the
    probe service runs it on its own, so that a slow podman never delays the others)."""
    probes: list[Probe] = [
        HostProbe(),
        NvidiaProbe(),
        RocmProbe(),
        AppleProbe(),
        GpuApisProbe(),
        WslProbe(),
    ]
    if include_containers:
        probes.append(containers if containers is not None else ContainerRuntimeProbe())
    if frameworks:
        probes.append(FrameworksProbe(path))
    return probes


async def _guarded(probe: Probe, ctx: ProbeContext, on_timing: Timing | None = None) -> Finding:
    started = time.perf_counter()
    # A probe that runs several bounded commands in a row says how long it may take in all.
    limit = getattr(probe, "time_limit", None)
    bound = (limit(ctx) if callable(limit) else ctx.timeout) + _GUARD_GRACE_S
    try:
        return await asyncio.wait_for(probe.probe(ctx), bound)
    except TimeoutError:
        found = Finding(probe.name)
        found.note(f"probe did not finish within {bound:g}s; unknown")
        return found
    except Exception as err:  # a bug in one probe must not take the others down
        found = Finding(probe.name)
        found.note(f"probe failed: {type(err).__name__}: {err}")
        return found
    finally:
        if on_timing is not None:
            on_timing(probe.name, time.perf_counter() - started)


async def collect(
    ctx: ProbeContext, probes: Sequence[Probe], on_timing: Timing | None = None
) -> list[Finding]:
    """Run every probe concurrently; always one finding per probe. ``on_timing(source,
    seconds)`` hears how long each source took."""
    return list(await asyncio.gather(*(_guarded(p, ctx, on_timing) for p in probes)))


def build_capabilities(
    node_id: str,
    findings: Sequence[Finding],
    *,
    agent_version: str = __version__,
    detected_at: datetime | None = None,
) -> WorkerCapabilities:
    """Merge findings (in order) into capabilities. Pure."""
    host = HostInfo()
    accelerators = []
    host_apis: dict[str, str] = {}
    container_apis: dict[str, str] = {}
    evidence: dict[str, str] = {}
    frameworks: dict[str, str] = {}
    fw_caps: list[str] = []
    backends: list[str] = []
    launchers: list[str] = []
    notes: list[str] = []
    workload_python = workload_python_version = advertise = None
    runtime = None
    for f in findings:
        runtime = f.container_runtime or runtime
        host = f.host or host
        advertise = f.advertise_address or advertise
        accelerators.extend(f.accelerators)
        for api, why in f.host_apis.items():
            host_apis.setdefault(api, why)
        for api, why in f.container_apis.items():
            container_apis.setdefault(api, why)
        for key, why in f.evidence.items():
            evidence.setdefault(key, why)
        workload_python = f.workload_python or workload_python
        workload_python_version = f.workload_python_version or workload_python_version
        frameworks.update(f.frameworks)
        fw_caps.extend(c for c in f.framework_capabilities if c not in fw_caps)
        backends.extend(b for b in f.distributed_backends if b not in backends)
        launchers.extend(x for x in f.launchers if x not in launchers)
        notes.extend(f.notes)
    # An API shown as present carries its positive evidence; container evidence gets its own key.
    evidence.update(host_apis)
    evidence.update({f"container:{api}": why for api, why in container_apis.items()})
    return WorkerCapabilities(
        node_id=node_id,
        agent_version=agent_version,
        detected_at=detected_at or datetime.now(UTC),
        host=host,
        accelerators=accelerators,
        workload_python=workload_python,
        workload_python_version=workload_python_version,
        frameworks=dict(sorted(frameworks.items())),
        framework_capabilities=fw_caps,
        distributed_backends=backends,
        launchers=launchers,
        gpu_apis=GpuApis(
            host=sorted(host_apis), containers=sorted(container_apis), evidence=evidence
        ),
        container_runtime=runtime,
        advertise_address=advertise,
        notes=notes,
    )


def make_context(
    *,
    run: Runner = run_command,
    timeout: float = 10.0,
    python: str | None = None,
    cdi_dirs: Sequence[str] = DEFAULT_CDI_DIRS,
    dev_dir: str | None = None,
    advertise_address: str | None = None,
    host_root: str = "/",
    tool_dirs: Sequence[str] = TOOL_DIRS,
) -> ProbeContext:
    """This machine's context. ``dev_dir``: where device files are looked for (default: the
    host root's ``/dev``); ``tool_dirs``: where a program missing from PATH is looked for."""
    return ProbeContext(
        run=with_tool_dirs(run, tool_dirs),
        timeout=timeout,
        system=platform.system().lower(),
        machine=platform.machine().lower(),
        python=python,
        cdi_dirs=tuple(cdi_dirs),
        dev_dir=dev_dir if dev_dir is not None else under_root(host_root, "/dev"),
        advertise_address=advertise_address,
        host_root=host_root,
    )


def torch_unknown(reason: str) -> Finding:
    """A note for capabilities the torch query has not answered (yet)."""
    found = Finding("torch")
    found.note(f"capability query {reason}; torch.cuda, torch.mps and distributed backends unknown")
    return found


async def detect_capabilities(
    node_id: str,
    *,
    python: str | None = None,
    include_torch: bool = True,
    include_frameworks: bool = True,
    timeout: float = 10.0,
    torch_timeout: float = 60.0,
    run: Runner = run_command,
    cdi_dirs: Sequence[str] = DEFAULT_CDI_DIRS,
    advertise_address: str | None = None,
    path: str | None = None,
    containers: ContainerSettings | None = None,
    host_root: str = "/",
    tool_dirs: Sequence[str] = TOOL_DIRS,
) -> WorkerCapabilities:
    """Detect this machine's capabilities once.

    ``python`` is the workload interpreter (default: this one). ``timeout`` bounds each source;
    the torch query (only where torch is installed) is bounded by ``torch_timeout``;
    ``containers``: how the container runtime is looked for (default: podman on PATH);
    ``host_root``: where the host's /proc, /sys, /dev and /usr/lib/wsl are read.
    """
    if python is None:
        python = sys.executable
    ctx = make_context(
        run=run,
        timeout=timeout,
        python=python,
        cdi_dirs=cdi_dirs,
        advertise_address=advertise_address,
        host_root=host_root,
        tool_dirs=tool_dirs,
    )
    runtime_probe = ContainerRuntimeProbe(containers or ContainerSettings())
    probes = default_probes(frameworks=include_frameworks, path=path, containers=runtime_probe)
    findings = await collect(ctx, probes)
    frameworks = {k: v for f in findings for k, v in f.frameworks.items()}
    if "torch" in frameworks:
        if include_torch:
            findings.append(await query_torch(python, run, torch_timeout))
        else:
            findings.append(torch_unknown("skipped"))
    return build_capabilities(node_id, findings)

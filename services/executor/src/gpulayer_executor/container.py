"""A job in an OCI container: the ``podman run`` argv the shim starts for it, the devices it
gets, and the small podman steps around it (the image's presence and architecture, a bounded
pull, stop, removal, the leftovers of an earlier run). Pure but for the functions that run
podman (``run``: an argv and a timeout, never a shell) and read the machine's limits.

The shim runs podman as the executor's user (root: rootful podman) and podman runs the job as
its account (``--user``), with no new privileges and no capabilities, its folder mounted at
the same path as its working directory and HOME, and only its granted devices: each by its CDI
name where the node's CDI spec names it, else the device nodes themselves; in WSL2, where every
GPU is behind ``/dev/dxg``, that device and ``/usr/lib/wsl`` read-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import platform
import resource
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobenv import DEFAULT_PATH
from gpulayer_contracts.validation import effective_gpu, effective_use
from gpulayer_executor.env import RunAs
from gpulayer_executor.limits import CPU_PERIOD_US, JobLimits

if TYPE_CHECKING:  # the shim imports this module, and never reads a CDI spec
    from gpulayer_detection.cdi import CdiDevice

# Labels every container of gpulayer carries: found again by them after a restart.
LABEL_GRANT = "gpulayer.grant"
LABEL_EXECUTOR = "gpulayer.executor"
NAME_PREFIX = "gpulayer-"
# The job's env in a file podman reads (``--env-file``), never on the argv other users can read
# in /proc; podman's format has one variable per line, so a value can't hold a newline.
ENV_FILE = "container.env"
# Control nodes a CUDA process opens besides its GPU's own node, passed where they exist.
NVIDIA_CONTROL = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
DEFAULT_CDI_KINDS = {"cuda": "nvidia.com/gpu", "rocm": "amd.com/gpu"}
# WSL2: the one device every GPU is reached through, and the D3D12/DXCore libraries, the NVIDIA
# WSL library and the driver store (the vendor's user-mode driver) it needs.
DXG = "dxg"
WSL_DIR = Path("/usr/lib/wsl")
# podman's own exit codes for a container it could not run (its error is on the job's stderr).
PODMAN_FAILED = 125
PODMAN_CODES = {
    PODMAN_FAILED: "podman could not run the container",
    126: "the command in the image could not be invoked",
    127: "the command was not found in the image",
}

Network = Literal["host", "none"]
Runner = Callable[[Sequence[str], float], "subprocess.CompletedProcess[str]"]


class ContainerError(RuntimeError):
    """A container job can't run as asked; ``str()`` is the reason reported (names the image)."""


class ContainerRun(msgspec.Struct, frozen=True, kw_only=True):
    """What the shim needs to run one job's container: the ``podman run`` argv (the image and
    command last) and what it does before and after it."""

    podman: str
    name: str
    image: str
    pull: Literal["missing", "never", "always"] = "missing"
    pull_timeout_s: float = 300.0
    argv: list[str]
    # The variables the job sees (written to its env file) and podman's own environment (the
    # executor's PATH, never the job's: podman runs as root and finds its helpers on it).
    env: dict[str, str]
    podman_env: dict[str, str]
    limits: JobLimits | None = None
    # A container of this image ran on this node before (``container_jobs.RanImages``): its
    # presence and architecture are not checked again before ``podman run``, which is one
    # podman process less on the way to the job's start. Should the image be gone meanwhile,
    # the shim checks and pulls as for a first run and runs again.
    image_known: bool = False


def container_name(workdir: Path, grant_id: str) -> str:
    """The container's name: unique per executor and grant, in podman's name alphabet. Pure."""
    digest = hashlib.sha256(f"{workdir}\0{grant_id}".encode()).hexdigest()[:32]
    return NAME_PREFIX + digest


def executor_label(workdir: Path) -> str:
    """The label value naming one executor (its workdir): its leftovers, never another's."""
    return hashlib.sha256(str(workdir).encode()).hexdigest()[:32]


def ulimits(nofile_hard: int, nproc_hard: int, pid_max: int) -> list[str]:
    """``--ulimit`` options the machine allows: podman's defaults ask for more open files and
    processes than some hosts' hard limits (runc then fails ``rlimit type 7``/``6``), and
    podman caps processes at ``pid_max``. Pure."""
    out = []
    if nofile_hard != resource.RLIM_INFINITY:
        out += ["--ulimit", f"nofile={nofile_hard}:{nofile_hard}"]
    nproc = pid_max if nproc_hard == resource.RLIM_INFINITY else min(nproc_hard, pid_max)
    out += ["--ulimit", f"nproc={nproc}:{nproc}"]
    return out


def machine_ulimits() -> list[str]:
    """``ulimits`` for this process' hard limits, read now."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 32768
    return ulimits(nofile, nproc, pid_max)


def device_args(
    grant: Grant,
    cdi: Sequence[CdiDevice],
    device_dir: Path,
    kind: str | None = None,
    wsl_dir: Path = WSL_DIR,
) -> list[str]:
    """``--device`` options for the granted devices alone (none for a job that asked for no
    GPU): each by its CDI name, else its device nodes; in WSL2 (``device_dir/dxg`` is a
    character device) ``--device`` that and ``wsl_dir`` read-only, also for a job placed on a
    GPU API alone (no device tracked). Raises ContainerError. Pure but for looking at which
    nodes exist."""
    from gpulayer_detection.cdi import device_for

    if grant.job.sandbox.devices.gpu != "compute":
        return []
    if not grant.devices:
        wants = effective_use(grant.job, effective_gpu(grant.job, "linux")) != "none"
        return wsl_args(device_dir, wsl_dir) if wants and is_wsl(device_dir) else []
    kind = kind or DEFAULT_CDI_KINDS.get(grant.accelerator)
    out: list[str] = []
    fallback: list[str] = []
    wsl = False
    uuids = list(grant.instance_uuids)
    for pos, index in enumerate(grant.devices):
        mig = uuids[pos] if pos < len(uuids) else None
        found = device_for(cdi, index, mig, kind) if kind else None
        if mig and (found is None or found.name != mig):
            raise ContainerError(
                f"MIG instance {mig} has no CDI device on this node (a spec naming it by UUID, "
                "e.g. from nvidia-ctk cdi generate, is needed to hand it to a container)"
            )
        if found is not None:
            out += ["--device", found.qualified]
            continue
        if wsl:
            continue
        try:
            fallback += _device_nodes(grant.accelerator, index, device_dir)
        except ContainerError:
            # No /dev/nvidia<N>: in WSL2 every GPU is behind /dev/dxg. (Looked at only then, so
            # a Linux node's launch costs nothing more.)
            wsl = is_wsl(device_dir)
            if not wsl:
                raise
    if fallback:
        fallback += _control_nodes(grant.accelerator, device_dir)
    for node in dict.fromkeys(fallback):
        out += ["--device", node]
    return out + (wsl_args(device_dir, wsl_dir) if wsl else [])


def is_wsl(device_dir: Path) -> bool:
    """Is ``device_dir/dxg`` a character device (WSL2's GPU paravirtualization)?"""
    try:
        return stat.S_ISCHR((device_dir / DXG).stat().st_mode)
    except OSError:
        return False


def wsl_args(device_dir: Path, wsl_dir: Path = WSL_DIR) -> list[str]:
    """WSL2's GPU for a container: ``/dev/dxg``, which reaches every GPU of the machine (CUDA
    still sees only the granted ones, by ``CUDA_VISIBLE_DEVICES``), and ``/usr/lib/wsl``
    read-only. Raises ContainerError without that folder."""
    if not wsl_dir.is_dir():
        raise ContainerError(f"{device_dir / DXG} is here but {wsl_dir} is not (WSL2's libraries)")
    return ["--device", str(device_dir / DXG), "--volume", f"{wsl_dir}:{wsl_dir}:ro"]


def _device_nodes(accelerator: str, index: int, device_dir: Path) -> list[str]:
    if accelerator == "rocm":
        render = device_dir / "dri" / f"renderD{128 + index}"
        return [str(render)] if render.exists() else []
    node = device_dir / f"nvidia{index}"
    if not node.exists():
        raise ContainerError(f"device {index}: neither a CDI device nor {node} on this node")
    return [str(node)]


def _control_nodes(accelerator: str, device_dir: Path) -> list[str]:
    names = ("kfd",) if accelerator == "rocm" else NVIDIA_CONTROL
    return [str(device_dir / n) for n in names if (device_dir / n).exists()]


def limit_args(limits: JobLimits | None) -> list[str]:
    """The job's limits as podman's own options (its container's cgroup, under podman's
    parent: the job's cgroup can't hold it on every layout). Pure."""
    if limits is None:
        return []
    out: list[str] = []
    if limits.memory_bytes is not None:
        # Swap as much as memory: no swap beyond the limit, as the job's cgroup has it.
        out += ["--memory", str(limits.memory_bytes), "--memory-swap", str(limits.memory_bytes)]
    if limits.cpu_quota_us is not None:
        out += ["--cpus", f"{limits.cpu_quota_us / CPU_PERIOD_US:g}"]
    if limits.pids_max is not None:
        out += ["--pids-limit", str(limits.pids_max)]
    return out


def container_env(env: Mapping[str, str], job_env: Mapping[str, str], cwd: Path) -> dict[str, str]:
    """The variables passed into the container: the job's environment, less the host's PATH
    (the image's own stays, unless the job set one), HOME its folder (mounted at the same path).
    Raises ContainerError for a value podman's env file can't carry. Pure."""
    out = {k: v for k, v in env.items() if k != "PATH" or "PATH" in job_env}
    out["HOME"] = str(cwd)
    for name, value in out.items():
        if "\n" in value or "\r" in value:
            raise ContainerError(
                f"env: {name} holds a line break, which a container job can't pass"
            )
        # podman's env file skips a line starting with "#" and refuses a name with blanks.
        if name.startswith("#") or any(c.isspace() for c in name):
            raise ContainerError(f"env: {name!r} is not a name a container job can pass")
    return out


def podman_env(base: Mapping[str, str], grant_id: str, marker: str) -> dict[str, str]:
    """podman's environment: the executor's PATH and locale, and the job's marker (its processes
    are found by it where no cgroup holds them). Pure."""
    env = {k: base[k] for k in ("PATH", "LANG", "LC_ALL") if k in base}
    env.setdefault("PATH", DEFAULT_PATH)
    env[marker] = grant_id
    return env


def env_file_text(env: Mapping[str, str]) -> str:
    """podman's ``--env-file`` format: ``NAME=value`` lines. Pure."""
    return "".join(f"{k}={v}\n" for k, v in env.items())


def run_argv(
    *,
    podman: str,
    runtime: str | None,
    name: str,
    labels: Mapping[str, str],
    image: str,
    command: Sequence[str],
    user: tuple[int, int],
    cwd: Path,
    env_file: Path,
    devices: Sequence[str],
    limits: Sequence[str],
    ulimit: Sequence[str],
    network: Network,
) -> list[str]:
    """``podman run`` for one job. The image is the last option, then the command: podman
    reads nothing after the image as its own. Raises ContainerError for a job folder whose path
    podman's ``--volume`` can't carry. Pure."""
    if ":" in str(cwd) or "," in str(cwd):
        raise ContainerError(f"the job's folder {cwd} holds ':' or ',' (podman's --volume can't)")
    argv = [podman]
    if runtime:
        argv += ["--runtime", runtime]
    argv += ["run", "--name", name, "--pull", "never", "--stop-signal", "SIGTERM"]
    for key, value in labels.items():
        argv += ["--label", f"{key}={value}"]
    argv += [
        "--user",
        f"{user[0]}:{user[1]}",
        "--security-opt",
        "no-new-privileges",
        "--cap-drop",
        "all",
        "--network",
        network,
        "--volume",
        f"{cwd}:{cwd}:rw",
        "--workdir",
        str(cwd),
        "--env-file",
        str(env_file),
        *ulimit,
        *limits,
        *devices,
        image,
        *command,
    ]
    return argv


def job_user(run_as: RunAs | None) -> tuple[int, int]:
    """uid and gid the job runs as inside: its account's, else the executor's own."""
    if run_as is not None:
        return run_as.uid, run_as.gid
    return os.geteuid(), os.getegid()


def host_arch() -> str:
    """This machine's architecture in OCI words (amd64, arm64, ...)."""
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}.get(
        machine, machine
    )


def _run(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def image_arch(podman: str, image: str, run: Runner = _run) -> str | None:
    """The architecture of ``image`` as the node holds it; None when it doesn't hold it."""
    try:
        done = run([podman, "image", "inspect", "--format", "{{.Architecture}}", image], 30.0)
    except subprocess.TimeoutExpired:
        raise ContainerError(f"image {image}: podman image inspect took over 30 s") from None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or "unknown"


def check_arch(image: str, arch: str, host: str) -> None:
    """Raises ContainerError when the image is for another architecture. Pure."""
    if arch not in (host, "unknown", ""):
        raise ContainerError(f"image {image} is for {arch}, this node is {host}")


def pull_argv(podman: str, image: str) -> list[str]:
    return [podman, "pull", "--quiet", image]


def pull_failed(image: str, returncode: int, stderr: str) -> ContainerError:
    why = _last_line(stderr) or f"exit code {returncode}"
    return ContainerError(f"image {image}: pull failed: {why}")


def never_pulled(image: str) -> ContainerError:
    return ContainerError(f"image {image} is not on this node and its pull policy is never")


def remove(podman: str, name: str, run: Runner = _run) -> str | None:
    """Remove the container (killed first if it still runs) and what podman mounted for it;
    None once it is gone, else podman's error. Then whatever still runs under that name outside
    podman's records is killed (``kill_strays``), also when podman failed or hung."""
    try:
        done = run([podman, "rm", "--force", "--ignore", "--time", "0", name], 60.0)
    except subprocess.TimeoutExpired:
        error: str | None = "podman rm took over 60 s"
    else:
        error = None if done.returncode == 0 else _last_line(done.stderr) or str(done.returncode)
    kill_strays(name)
    return error


def kill_strays(name: str) -> int:
    """Kill the container monitor (``conmon``) that runs container ``name``, and every process
    under it, whatever podman's records say; returns how many processes were killed. A
    ``podman run`` killed after the runtime made the container but before podman recorded it
    as made leaves its ``conmon`` and ``runc init`` running: ``podman rm`` then removes a
    record of a container it believes never ran, and they wait on their start forever, outside
    the job's cgroup. conmon is told the container's name (``-n``), unique per executor and
    grant (``container_name``). Only a ``conmon`` of this process's own user counts (podman
    runs as it): any user can name a process ``conmon`` and give it that argv."""
    import psutil  # here: the shim imports this module, and most shims never remove

    found: list[psutil.Process] = []
    me = os.getuid()
    for proc in psutil.process_iter(["name", "uids"]):
        uids = proc.info["uids"]
        if proc.info["name"] != "conmon" or uids is None or uids.real != me:
            continue
        try:
            argv = proc.cmdline()
            if _named(argv, name):
                found += [*proc.children(recursive=True), proc]
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    for proc in found:  # children first: reparented ones would be out of reach
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(found, timeout=5)
    return len(found)


def _named(argv: Sequence[str], name: str) -> bool:
    """Whether conmon's ``argv`` names container ``name`` (``-n``/``--name``, the value apart or
    after ``=``). Pure."""
    for flag, value in itertools.pairwise(argv):
        if flag in ("-n", "--name") and value == name:
            return True
    return any(arg in (f"-n={name}", f"--name={name}") for arg in argv)


def oom_killed(podman: str, name: str, run: Runner = _run) -> bool:
    """Whether podman saw the container killed for memory (its flag is not set on every cgroup
    layout: the caller also reads a SIGKILL it did not send as one)."""
    try:
        done = run([podman, "inspect", "--format", "{{.State.OOMKilled}}", name], 30.0)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0 and done.stdout.strip() == "true"


def leftovers(podman: str, workdir: Path, run: Runner = _run) -> dict[str, str]:
    """Containers an earlier run of this executor left, as {name: grant id}."""
    label = f"label={LABEL_EXECUTOR}={executor_label(workdir)}"
    fmt = '{{.Names}} {{index .Labels "' + LABEL_GRANT + '"}}'
    try:
        done = run([podman, "ps", "--all", "--filter", label, "--format", fmt], 60.0)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if done.returncode != 0:
        return {}
    found = {}
    for line in done.stdout.splitlines():
        name, _, grant = line.strip().partition(" ")
        if name.startswith(NAME_PREFIX):
            found[name] = grant
    return found

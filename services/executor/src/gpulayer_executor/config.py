"""The executor's settings: plain values, filled in by ``__main__`` (or a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from gpulayer_detection.cdi import CDI_DIRS
from gpulayer_executor.env import RunAs
from gpulayer_runtime.signing import DEFAULT_MAX_AGE_S


class ExecutorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Plain settings, filled in by ``__main__`` (or a test); nothing here reads the environment."""

    node_id: str
    workdir: Path
    base_env: dict[str, str]
    # The account jobs run as (None: the executor's own), and per job owner, the account that
    # owner's jobs run as instead (``users.run_as_for``).
    run_as: RunAs | None = None
    user_map: dict[str, RunAs] = {}
    # (first uid, how many): an owner not in ``user_map`` gets a uid of its own from this range
    # (GPULAYER_EXECUTOR_OWNER_UIDS), kept in the state database, so different owners' jobs
    # can't signal or read each other. None: they all run as ``run_as``.
    owner_uids: tuple[int, int] | None = None
    # Jobs get TMPDIR, a folder of their own in their job folder (folders.py). False where the
    # job accounts can't reach the workdir by path (a folder above it not passable for them):
    # their temporary files then go where their tools default to (/tmp), as a TMPDIR they
    # can't reach would make tools fail (mktemp).
    job_tmpdir: bool = True
    kill_grace_s: float = 5.0
    # Job slots: jobs running at once, also announced in the heartbeat (``slots``).
    max_jobs: int = 64
    # Limits per job in a cgroup where the machine allows (``cgroups.hierarchy``); False
    # (GPULAYER_EXECUTOR_ENFORCE=off): job processes are tracked only, "enforcement: none".
    enforce: bool = True
    # Processes (threads included) one job may have at once; 0: no limit.
    job_pids_max: int = 4096
    # Where the /dev/nvidia<N> nodes are read from (tests point it at mknod'd nodes).
    device_dir: Path = Path("/dev")
    # WSL2's libraries and driver store, mounted read-only into a container job given /dev/dxg.
    wsl_dir: Path = Path("/usr/lib/wsl")
    # Host cores and RAM (GB) kept for the system, announced in the heartbeat: placement
    # offers the probe's figures minus these.
    reserved_cores: float = 0.0
    reserved_memory_gb: float = 1.0
    drain_s: float = 0.0
    # Jobs run under a shim each (shim.py) and outlive the executor: a restart re-attaches to
    # them. False (GPULAYER_EXECUTOR_SHIM=off): the executor is their parent, and a job running
    # when it stops or dies is reported lost.
    shim: bool = True
    max_line_bytes: int = 16 * 1024
    max_log_backlog_bytes: int = 1 << 20
    retain_s: float = 7 * 24 * 3600.0
    fetch_timeout_s: float = 1.0
    publish_timeout_s: float = 5.0
    # Beats on the node's heartbeat subject (source "executor"): placement stops granting to a
    # node whose executor went silent, instead of queueing grants nobody runs.
    heartbeat_s: float = 5.0
    # Grants and cancels run only when signed by one of these placement keys (base64url
    # ed25519); ``require_signatures=False`` (GPULAYER_GRANT_SIGNING=off) is unsafe: any NATS
    # client could then make this node run a command.
    placement_public_keys: tuple[str, ...] = ()
    require_signatures: bool = True
    # A signed grant issued longer ago than this is refused (a replay whose record was pruned);
    # keep it below ``retain_s``.
    grant_max_age_s: float = DEFAULT_MAX_AGE_S
    # The node's workload interpreter (GPULAYER_WORKLOAD_PYTHON, as the probe's): a rank of a
    # distributed job with launcher torchrun runs the torchrun next to it, else the one on PATH.
    workload_python: str | None = None
    # Container jobs (container.py): podman (None: not on this node, such a job fails saying
    # so), the OCI runtime it is told to use (None: podman's own default), the network a
    # container gets, how long a pull may take, where the node's CDI specs are and the CDI kind
    # granted GPUs are named by (None: nvidia.com/gpu for CUDA, amd.com/gpu for ROCm).
    podman: str | None = None
    container_runtime: str | None = None
    container_network: Literal["host", "none"] = "host"
    container_pull_timeout_s: float = 300.0
    cdi_dirs: tuple[str, ...] = CDI_DIRS
    cdi_kind: str | None = None

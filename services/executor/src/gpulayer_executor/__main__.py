"""``gpulayer-executor``: configuration is read here, from the environment, and nowhere deeper."""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import re
import shutil
import signal
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from gpulayer_contracts.bounds import MAX_EXECUTOR_SLOTS, MAX_JOB_CPU_CORES, MAX_JOB_MEMORY_GB
from gpulayer_contracts.jobenv import base_environment
from gpulayer_detection.cdi import CDI_DIRS
from gpulayer_executor import users
from gpulayer_executor.env import RunAs
from gpulayer_executor.limits import MAX_PIDS
from gpulayer_executor.service import ExecutorConfig
from gpulayer_runtime.nats import connect, let_go, wait_for_streams
from gpulayer_runtime.settings import (
    ConfigError,
    NatsSettings,
    env_float,
    env_str,
    nats_settings,
    node_id,
    run_service,
)
from gpulayer_runtime.signing import (
    DEFAULT_MAX_AGE_S,
    MAX_AGE_SETTING,
    public_keys_from_env,
    signing_required,
)
from gpulayer_runtime.stopping import or_stop
from gpulayer_runtime.telemetry import setup_telemetry

log = logging.getLogger("gpulayer_executor")


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ConfigError(f"{name}={raw!r}: expected 1 or 0")


# Owners' own uids when the executor runs as root and no single job user was chosen: far above
# the ranges distributions give accounts (1000-60000) and subuids (100000 up, 65536 each).
DEFAULT_OWNER_UIDS = (3_000_000, 1_000_000)


def owner_uids(
    env: Mapping[str, str], *, euid: int, run_as: RunAs | None
) -> tuple[int, int] | None:
    """``GPULAYER_EXECUTOR_OWNER_UIDS``: ``first-last``, or ``off``. Unset: on, with
    DEFAULT_OWNER_UIDS, when the executor is root and its jobs run as the default job user
    (none was named); off otherwise."""
    raw = env_str(env, "GPULAYER_EXECUTOR_OWNER_UIDS", "").lower()
    if raw == "off":
        return None
    if not raw:
        default_user = euid == 0 and run_as is not None and not _job_user_name(env)
        return DEFAULT_OWNER_UIDS if default_user else None
    first, sep, last = raw.partition("-")
    try:
        lo, hi = int(first), int(last)
    except ValueError:
        lo = hi = -1
    if not sep or not 0 < lo <= hi < 2**32 - 1:
        raise ConfigError(
            f"GPULAYER_EXECUTOR_OWNER_UIDS={raw!r}: expected FIRST-LAST (uids above 0) or off"
        )
    if euid != 0:
        raise ConfigError(
            "GPULAYER_EXECUTOR_OWNER_UIDS: owners get uids of their own only when the executor "
            "runs as root"
        )
    return lo, hi - lo + 1


def _job_user_name(env: Mapping[str, str]) -> str:
    # GPULAYER_EXECUTOR_USER is the setting's earlier name, still honoured.
    new = env_str(env, "GPULAYER_EXECUTOR_JOB_USER", "")
    old = env_str(env, "GPULAYER_EXECUTOR_USER", "")
    if new and old and new != old:
        raise ConfigError(
            f"GPULAYER_EXECUTOR_JOB_USER={new!r} and GPULAYER_EXECUTOR_USER={old!r} disagree "
            "(the second is the first's earlier name: set one)"
        )
    return new or old


def _user_map(env: Mapping[str, str], lookup: users.Lookup) -> dict[str, RunAs]:
    path = env_str(env, "GPULAYER_EXECUTOR_USER_MAP", "")
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"GPULAYER_EXECUTOR_USER_MAP={path!r}: {err.strerror}") from None
    return users.parse_user_map(text, f"GPULAYER_EXECUTOR_USER_MAP={path!r}", lookup)


def job_accounts(
    env: Mapping[str, str], *, euid: int, lookup: users.Lookup = pwd.getpwnam
) -> tuple[RunAs | None, dict[str, RunAs]]:
    """The default job account (None: the executor's own) and the per-owner ones."""
    try:
        user_map = _user_map(env, lookup)
        run_as = users.job_users(
            euid=euid,
            job_user=_job_user_name(env),
            user_map=user_map,
            allow_root_jobs=_flag(env, "GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS"),
            lookup=lookup,
        )
    except users.UserError as err:
        raise ConfigError(str(err)) from None
    accounts = [*user_map.values(), *([run_as] if run_as else [])]
    creds = env_str(env, "GPULAYER_NATS_CREDS", "")
    readers = users.readable_by(Path(creds), accounts) if creds else []
    if readers:
        raise ConfigError(
            f"GPULAYER_NATS_CREDS={creds!r} is readable by the job user(s) "
            f"{', '.join(sorted(set(readers)))}: a job could act as this node (make it 0600, "
            "owned by the executor's user)"
        )
    return run_as, user_map


def _say_who_runs_jobs(config: ExecutorConfig) -> None:
    if not config.job_tmpdir:
        _say_what_jobs_cannot_reach(config)
    if config.owner_uids is not None:
        first, count = config.owner_uids
        log.info(
            "each owner's jobs run as a uid of its own, from %d to %d (mapped owners: %s)",
            first,
            first + count - 1,
            ", ".join(f"{o}={u.name}" for o, u in sorted(config.user_map.items())) or "none",
        )
    elif config.run_as is not None:
        owners = ", ".join(f"{o}={u.name}" for o, u in sorted(config.user_map.items()))
        log.info("jobs run as %s%s", config.run_as.name, f" (by owner: {owners})" if owners else "")
    elif os.geteuid() == 0:
        log.warning(
            "GPULAYER_EXECUTOR_ALLOW_ROOT_JOBS=1: JOBS RUN AS ROOT. Every job can read this "
            "executor's state and credentials, every other job's files, and the whole machine."
        )
    else:
        log.info(
            "jobs run as the executor's own account (uid %d): they can read its state and "
            "credentials; run the executor as root with a job user to separate them",
            os.geteuid(),
        )


def _unreachable(config: ExecutorConfig) -> tuple[str, Path] | None:
    """A job account and a folder above the workdir it can't pass, if any: a job's folder (its
    HOME where its account has none, its TMPDIR) is then not usable by its absolute path (a
    workdir under /root, say)."""
    if config.run_as is None and config.owner_uids is None:
        return None  # jobs run as the executor's own account
    accounts = [*config.user_map.values(), *([config.run_as] if config.run_as else [])]
    if config.owner_uids is not None:
        accounts = []  # owners' own uids: only what others may do counts
    blocked = users.not_passable(config.workdir, accounts)
    return blocked[0] if blocked else None


def _say_what_jobs_cannot_reach(config: ExecutorConfig) -> None:
    """Said once at start (``settings`` turned TMPDIR off for it); jobs not using their folder
    by path run all the same."""
    found = _unreachable(config)
    if found is not None:
        name, folder = found
        log.warning(
            "jobs can't reach their folders in %s by path: %s is not passable for %s (its mode "
            "has no x for it), so jobs get no TMPDIR of their own (their tools use /tmp) and a "
            "HOME in their folder won't resolve; pick a workdir under a folder others may pass "
            "(/var/lib) or chmod o+x %s",
            config.workdir,
            folder,
            name,
            folder,
        )


def _count(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ConfigError(f"{name}={raw!r}: expected a whole number from {low} to {high}")
    return value


def _on_off(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "on", "1", "true", "yes"):
        return True
    if raw in ("off", "0", "false", "no"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected on or off")


def _enforce(env: Mapping[str, str]) -> bool:
    return _on_off(env, "GPULAYER_EXECUTOR_ENFORCE")


def _device_dir(env: Mapping[str, str]) -> Path:
    raw = env_str(env, "GPULAYER_EXECUTOR_DEVICE_DIR", "/dev")
    path = Path(raw)
    if not path.is_dir():
        raise ConfigError(f"GPULAYER_EXECUTOR_DEVICE_DIR={raw!r}: no such folder")
    return path.resolve()


def limit_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """Job slots, the system's reserve and the per-job limits (``ExecutorConfig`` fields)."""
    return {
        "max_jobs": _count(env, "GPULAYER_EXECUTOR_MAX_JOBS", 64, 1, MAX_EXECUTOR_SLOTS),
        "enforce": _enforce(env),
        "job_pids_max": _count(env, "GPULAYER_EXECUTOR_JOB_PIDS_MAX", 4096, 0, MAX_PIDS),
        "device_dir": _device_dir(env),
        "reserved_cores": env_float(
            env, "GPULAYER_EXECUTOR_RESERVED_CORES", 0.0, low_open=False, high=MAX_JOB_CPU_CORES
        ),
        "reserved_memory_gb": env_float(
            env,
            "GPULAYER_EXECUTOR_RESERVED_MEMORY_GB",
            1.0,
            low_open=False,
            high=MAX_JOB_MEMORY_GB,
        ),
    }


def _program(env: Mapping[str, str], name: str, default: str) -> str | None:
    """A program by setting (a path, or a name looked up on PATH), else ``default`` on PATH;
    None when it is not there. A setting naming a missing program is an error."""
    raw = env_str(env, name, "")
    found = shutil.which(raw or default, path=env.get("PATH") or os.defpath)
    if raw and found is None:
        raise ConfigError(f"{name}={raw!r}: no such program")
    return str(Path(found).resolve()) if found else None


def container_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """How container jobs are run (``ExecutorConfig`` fields): podman, its OCI runtime (runc
    where found: crun refuses hybrid cgroup layouts), the network, the pull bound, CDI."""
    network = env_str(env, "GPULAYER_EXECUTOR_CONTAINER_NETWORK", "host").lower()
    if network not in ("host", "none"):
        raise ConfigError(f"GPULAYER_EXECUTOR_CONTAINER_NETWORK={network!r}: expected host or none")
    # The probe's GPULAYER_OCI_RUNTIME unless the executor is told otherwise: jobs run with the
    # runtime whose self-test placed them here.
    runtime = env_str(env, "GPULAYER_EXECUTOR_CONTAINER_RUNTIME", "") or env_str(
        env, "GPULAYER_OCI_RUNTIME", ""
    )
    if not runtime:
        runtime = "runc" if shutil.which("runc", path=env.get("PATH") or os.defpath) else ""
    dirs = env_str(env, "GPULAYER_EXECUTOR_CDI_DIRS", "")
    kind = env_str(env, "GPULAYER_EXECUTOR_CDI_KIND", "")
    if kind and not _CDI_KIND.fullmatch(kind):
        raise ConfigError(f"GPULAYER_EXECUTOR_CDI_KIND={kind!r}: expected vendor/class")
    return {
        "podman": _program(env, "GPULAYER_EXECUTOR_PODMAN", "podman"),
        "container_runtime": runtime or None,
        "container_network": network,
        "container_pull_timeout_s": env_float(
            env, "GPULAYER_EXECUTOR_CONTAINER_PULL_TIMEOUT_S", 300.0, high=24 * 3600.0
        ),
        "cdi_dirs": tuple(d for d in dirs.split(os.pathsep) if d) if dirs else CDI_DIRS,
        "cdi_kind": kind or None,
    }


_CDI_KIND = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def settings(env: Mapping[str, str], *, euid: int | None = None) -> ExecutorConfig:
    """The executor's configuration from an environment mapping (``euid``: the executor's
    effective uid, this process' when not given)."""
    node = node_id(env)
    workdir = Path(env_str(env, "GPULAYER_EXECUTOR_WORKDIR", f".gpulayer/executor/{node}"))
    effective = os.geteuid() if euid is None else euid
    run_as, user_map = job_accounts(env, euid=effective)
    uids = owner_uids(env, euid=effective, run_as=run_as)
    # HOME and USER of the executor's own account; a job running as another account gets that
    # account's instead (env.account_env).
    me = pwd.getpwuid(os.getuid())
    base = base_environment(env, user=me.pw_name, home=env.get("HOME") or me.pw_dir)
    config = ExecutorConfig(
        node_id=node,
        workdir=workdir.resolve(),
        base_env=base,
        run_as=run_as,
        user_map=user_map,
        owner_uids=uids,
        kill_grace_s=env_float(env, "GPULAYER_KILL_GRACE_S", 5.0),
        **limit_settings(env),
        **container_settings(env),
        drain_s=env_float(env, "GPULAYER_EXECUTOR_DRAIN_S", 0.0, low_open=False),
        shim=_on_off(env, "GPULAYER_EXECUTOR_SHIM"),
        heartbeat_s=env_float(env, "GPULAYER_HEARTBEAT_S", 5.0),
        placement_public_keys=public_keys_from_env(env),
        require_signatures=signing_required(env),
        grant_max_age_s=env_float(env, MAX_AGE_SETTING, DEFAULT_MAX_AGE_S),
        workload_python=env.get("GPULAYER_WORKLOAD_PYTHON", "").strip() or None,
    )
    if _unreachable(config) is not None:
        config = msgspec.structs.replace(config, job_tmpdir=False)
    if config.grant_max_age_s >= config.retain_s:
        # Past the retention, a grant's record is pruned and only its age stops a replay.
        raise ConfigError(
            f"{MAX_AGE_SETTING}={config.grant_max_age_s:g}: must be below the grant record "
            f"retention ({config.retain_s:g} s)"
        )
    return config


def _log_settings(nats: NatsSettings, config: ExecutorConfig) -> None:
    log.info(
        "settings: nats=%s node=%s workdir=%s user=%s kill_grace_s=%s max_jobs=%s drain_s=%s "
        "signed grants=%s (%d keys, max age %ss) enforce=%s job_pids_max=%s device_dir=%s "
        "reserved_cores=%s reserved_memory_gb=%s shim=%s podman=%s container_runtime=%s "
        "container_network=%s container_pull_timeout_s=%s cdi_dirs=%s cdi_kind=%s",
        nats,
        config.node_id,
        config.workdir,
        config.run_as.name if config.run_as else "(executor's own)",
        config.kill_grace_s,
        config.max_jobs,
        config.drain_s,
        "required" if config.require_signatures else "OFF (unsafe)",
        len(config.placement_public_keys),
        config.grant_max_age_s,
        "on" if config.enforce else "off",
        config.job_pids_max or "no limit",
        config.device_dir,
        config.reserved_cores,
        config.reserved_memory_gb,
        "on" if config.shim else "off",
        config.podman or "(none: container jobs fail)",
        config.container_runtime or "(podman's default)",
        config.container_network,
        config.container_pull_timeout_s,
        ":".join(config.cdi_dirs),
        config.cdi_kind or "(by accelerator)",
    )


async def _amain() -> None:
    env = os.environ
    nats = nats_settings(env)
    config = settings(env)
    _log_settings(nats, config)
    _say_who_runs_jobs(config)
    from gpulayer_executor.service import Executor

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Durable state writes (fsync) run in threads and mostly wait on the disk: enough threads
    # for every concurrent job, so one job's fsync never queues behind another's.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=min(config.max_jobs, 64) + 4))
    if sys.version_info < (3, 12) and hasattr(os, "pidfd_open"):
        # 3.11's default child watcher starts a thread per job to wait for it; a pidfd is
        # watched by the event loop itself (3.12 does this by default).
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(loop)
        asyncio.set_child_watcher(watcher)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    telemetry = setup_telemetry("gpulayer-executor", env)
    nc = await or_stop(
        connect(nats.url, f"gpulayer-executor-{config.node_id}", **nats.connect_args()),
        stop,
        "NATS",
    )
    try:
        # Placement declares the streams (all at once); a node's credential may not, and may
        # look up only those it consumes (docs/security.md).
        await or_stop(
            wait_for_streams(nc.jetstream(), ["GRANTS", "CONTROL"]), stop, "streams GRANTS, CONTROL"
        )
        await Executor(nc, config, telemetry).run(stop)
    finally:
        await let_go(nc)
        telemetry.shutdown()


# What ``gpulayer-executor --help`` says it is.
DESCRIPTION = (
    "Runs the jobs placement grants to this node, each as an unprivileged account in a "
    "cgroup that holds its limits, and reports their output and end."
)


def main() -> None:
    run_service("gpulayer-executor", _amain, DESCRIPTION)


if __name__ == "__main__":
    main()

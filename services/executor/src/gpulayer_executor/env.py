"""A job's environment, built from nothing but deliberate parts. Pure functions.

Order, last one wins: the executor's minimal base environment, the job's own ``env`` (checked
first: it may not touch a protected variable), then what gpulayer owns: device visibility,
``GPULAYER_JOB_ID``, ``GPULAYER_GRANT_ID``, ``GPULAYER_DEVICES``, for a job of an array
``GPULAYER_ARRAY_INDEX``, and for a rank of a distributed job the rendezvous variables
(``rank_env``: MASTER_ADDR, WORLD_SIZE, ...; GPULAYER_JOB_ID is then the distributed job's id).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec

from gpulayer_contracts.events import Grant
from gpulayer_contracts.validation import (
    array_env,
    protected_env_names,
    rank_env,
    visibility_env,
)

# Passed through from the executor's own environment when set there. Everything else the
# executor was started with (credentials, NATS URLs, proxies, LD_* ...) stays out of jobs.
PASSTHROUGH_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class RunAs(msgspec.Struct, frozen=True, kw_only=True):
    """An unprivileged account jobs run as (``GPULAYER_EXECUTOR_JOB_USER``, or an owner's in
    ``GPULAYER_EXECUTOR_USER_MAP``). ``home`` empty: the account has no usable home, and each
    job gets its own working folder as HOME."""

    name: str
    uid: int
    gid: int
    home: str


class EnvRefused(ValueError):
    """The job's env can't be honoured. ``str()`` is the reason reported to the user."""


def base_environment(source: Mapping[str, str], *, user: str, home: str) -> dict[str, str]:
    """The minimal environment every job starts from.

    ``source`` is the executor's own environment (read by ``__main__``); ``user``/``home``
    describe the account the job runs as, so a job never inherits the executor's HOME when it
    runs as someone else.
    """
    env = {name: source[name] for name in PASSTHROUGH_ENV if source.get(name)}
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("LANG", "C.UTF-8")
    env["HOME"] = home
    env["USER"] = user
    env["LOGNAME"] = user
    return env


def account_env(run_as: RunAs, cwd: Path) -> dict[str, str]:
    """HOME, USER and LOGNAME of a job running as ``run_as`` in ``cwd``: never the executor's."""
    return {
        "HOME": run_as.home or str(cwd),
        "USER": run_as.name,
        "LOGNAME": run_as.name,
    }


def device_env(grant: Grant) -> dict[str, str]:
    """Visibility variables recomputed from the grant's devices and the job's sandbox grant.

    ``grant.visible_env`` from placement is deliberately not trusted: the executor applies the
    rule itself, so a placement bug (or a forged grant) can't widen what a job sees.
    """
    gpu_granted = grant.job.sandbox.devices.gpu == "compute"
    return visibility_env(
        grant.accelerator, list(grant.devices), gpu_granted, list(grant.instance_uuids)
    )


def check_job_env(env: Mapping[str, str], *, distributed: bool = False) -> None:
    """Raise EnvRefused naming the first problem in a job's own ``env`` (``distributed``: the
    rendezvous variables are gpulayer's too)."""
    protected = protected_env_names(env, distributed=distributed)
    if len(protected) == 1:
        raise EnvRefused(f"env: {protected[0]} is set by gpulayer, a job may not set it")
    if protected:
        raise EnvRefused(f"env: {', '.join(protected)} are set by gpulayer, a job may not set them")
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            raise EnvRefused(f"env: {name!r} is not a valid variable name")
        if "\0" in value:
            raise EnvRefused(f"env: the value of {name} contains a NUL byte")


def job_environment(grant: Grant, base: Mapping[str, str]) -> dict[str, str]:
    """The complete environment of the job's process. Raises EnvRefused."""
    dist = grant.job.distributed
    check_job_env(grant.job.env, distributed=dist is not None or grant.gang is not None)
    env = dict(base)
    env.update(grant.job.env)
    env.update(device_env(grant))
    env["GPULAYER_JOB_ID"] = grant.job.job_id
    env["GPULAYER_GRANT_ID"] = grant.grant_id
    env.update(array_env(grant.job))
    if grant.gang is not None:
        env.update(rank_env(grant.gang, dist.launcher if dist is not None else None))
    return env

"""A job's environment, built from nothing but deliberate parts: the one copy of the rules,
used by the executor for every grant and by ``gpulayer conform`` to run a job the same way.
Pure functions.

Order, last one wins: a minimal base environment, the job's own ``env`` (checked first: it may
not touch a protected variable), then what gpulayer owns: device visibility,
``GPULAYER_JOB_ID``, ``GPULAYER_GRANT_ID``, ``GPULAYER_DEVICES``, for a job of an array
``GPULAYER_ARRAY_INDEX``, and for a rank of a distributed job (``gang``) the rendezvous
variables (``validation.rank_env``: MASTER_ADDR, WORLD_SIZE, ...; GPULAYER_JOB_ID is then the
distributed job's id).
"""

from __future__ import annotations

from collections.abc import Mapping

from gpulayer_contracts.events import GangRank, Grant
from gpulayer_contracts.jobs import Accelerator, JobRequest
from gpulayer_contracts.validation import (
    array_env,
    protected_env_names,
    rank_env,
    visibility_env,
)

__all__ = [
    "DEFAULT_PATH",
    "PASSTHROUGH_ENV",
    "EnvRefused",
    "base_environment",
    "grant_device_env",
    "grant_environment",
    "job_env_error",
    "job_environment",
]

# Passed through from the launcher's own environment when set there. Everything else the
# executor was started with (credentials, NATS URLs, proxies, LD_* ...) stays out of jobs.
PASSTHROUGH_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class EnvRefused(ValueError):
    """The job's env can't be honoured. ``str()`` is the reason reported to the user."""


def base_environment(source: Mapping[str, str], *, user: str, home: str) -> dict[str, str]:
    """The minimal environment every job starts from.

    ``source`` is the launcher's own environment (the executor's, read by its ``__main__``);
    ``user``/``home`` describe the account the job runs as, so a job never inherits the
    executor's HOME when it runs as someone else.
    """
    env = {name: source[name] for name in PASSTHROUGH_ENV if source.get(name)}
    env.setdefault("PATH", DEFAULT_PATH)
    env.setdefault("LANG", "C.UTF-8")
    env["HOME"] = home
    env["USER"] = user
    env["LOGNAME"] = user
    return env


def job_env_error(env: Mapping[str, str], *, distributed: bool = False) -> str | None:
    """Why a job's own ``env`` can't be honoured, or None (``distributed``: a distributed job's,
    which may not set the rendezvous variables either)."""
    protected = protected_env_names(env, distributed=distributed)
    if len(protected) == 1:
        return f"env: {protected[0]} is set by gpulayer, a job may not set it"
    if protected:
        return f"env: {', '.join(protected)} are set by gpulayer, a job may not set them"
    for name, value in env.items():
        if not name or "=" in name or "\0" in name:
            return f"env: {name!r} is not a valid variable name"
        if "\0" in value:
            return f"env: the value of {name} contains a NUL byte"
    return None


def job_environment(
    job: JobRequest,
    *,
    accelerator: Accelerator,
    devices: list[int],
    grant_id: str,
    base: Mapping[str, str],
    gang: GangRank | None = None,
    instance_uuids: list[str] | None = None,
) -> dict[str, str]:
    """The complete environment of a job given ``devices`` of ``accelerator`` (MIG instances:
    ``instance_uuids``, ``devices`` their parent GPUs) and, for a rank of a distributed job,
    its ``gang``. Raises EnvRefused (``job_env_error``'s reason)."""
    dist = job.distributed
    error = job_env_error(job.env, distributed=dist is not None or gang is not None)
    if error is not None:
        raise EnvRefused(error)
    env = dict(base)
    env.update(job.env)
    gpu_granted = job.sandbox.devices.gpu == "compute"
    env.update(visibility_env(accelerator, devices, gpu_granted, instance_uuids))
    env["GPULAYER_JOB_ID"] = job.job_id
    env["GPULAYER_GRANT_ID"] = grant_id
    env.update(array_env(job))
    if gang is not None:
        env.update(rank_env(gang, dist.launcher if dist is not None else None))
    return env


def grant_device_env(grant: Grant) -> dict[str, str]:
    """Visibility variables recomputed from the grant's devices and the job's sandbox grant.

    ``grant.visible_env`` from placement is deliberately not trusted: the executor applies the
    rule itself, so a placement bug (or a forged grant) can't widen what a job sees.
    """
    gpu_granted = grant.job.sandbox.devices.gpu == "compute"
    return visibility_env(
        grant.accelerator, list(grant.devices), gpu_granted, list(grant.instance_uuids)
    )


def grant_environment(grant: Grant, base: Mapping[str, str]) -> dict[str, str]:
    """The complete environment of a granted job's process. Raises EnvRefused."""
    return job_environment(
        grant.job,
        accelerator=grant.accelerator,
        devices=list(grant.devices),
        grant_id=grant.grant_id,
        base=base,
        gang=grant.gang,
        instance_uuids=list(grant.instance_uuids),
    )

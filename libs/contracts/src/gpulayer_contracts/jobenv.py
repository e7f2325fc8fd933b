"""A job's environment, by the executor's rules, for whatever runs a job outside it
(``gpulayer conform``). Pure functions.

Order, last one wins: a minimal base environment, the job's own ``env`` (checked first: it may
not touch a protected variable), then what gpulayer owns: device visibility,
``GPULAYER_JOB_ID``, ``GPULAYER_GRANT_ID``, ``GPULAYER_DEVICES`` and, for a rank of a
distributed job (``gang``), the rendezvous variables (``validation.rank_env``). The executor's
``gpulayer_executor.env`` applies the same rules to a grant; tests/unit/test_jobenv.py checks
that the two agree.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpulayer_contracts.events import GangRank
from gpulayer_contracts.jobs import Accelerator, JobRequest
from gpulayer_contracts.validation import protected_env_names, rank_env, visibility_env

__all__ = [
    "DEFAULT_PATH",
    "PASSTHROUGH_ENV",
    "base_environment",
    "job_env_error",
    "job_environment",
]

# Passed through from the launcher's own environment when set there; nothing else is.
PASSTHROUGH_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def base_environment(source: Mapping[str, str], *, user: str, home: str) -> dict[str, str]:
    """The minimal environment a job starts from: a few variables of ``source`` (the launcher's
    own environment), and the account it runs as."""
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
) -> dict[str, str]:
    """The complete environment of a job given ``devices`` of ``accelerator`` (and, for a rank
    of a distributed job, its ``gang``). Raises ValueError (``job_env_error``'s reason) when
    the job's env can't be honoured."""
    dist = job.distributed
    error = job_env_error(job.env, distributed=dist is not None or gang is not None)
    if error is not None:
        raise ValueError(error)
    env = dict(base)
    env.update(job.env)
    env.update(visibility_env(accelerator, devices, job.sandbox.devices.gpu == "compute"))
    env["GPULAYER_JOB_ID"] = job.job_id
    env["GPULAYER_GRANT_ID"] = grant_id
    if gang is not None:
        env.update(rank_env(gang, dist.launcher if dist is not None else None))
    return env

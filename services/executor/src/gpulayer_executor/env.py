"""The account side of a job's environment: who the job runs as (``RunAs``) and the HOME,
USER and LOGNAME that follow. The rest of the environment is built by the one copy of the
rules, ``gpulayer_contracts.jobenv``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec


class RunAs(msgspec.Struct, frozen=True, kw_only=True):
    """An unprivileged account jobs run as (``GPULAYER_EXECUTOR_JOB_USER``, or an owner's in
    ``GPULAYER_EXECUTOR_USER_MAP``). ``home`` empty: the account has no usable home, and each
    job gets its own working folder as HOME."""

    name: str
    uid: int
    gid: int
    home: str


def account_env(run_as: RunAs, cwd: Path) -> dict[str, str]:
    """HOME, USER and LOGNAME of a job running as ``run_as`` in ``cwd``: never the executor's."""
    return {
        "HOME": run_as.home or str(cwd),
        "USER": run_as.name,
        "LOGNAME": run_as.name,
    }

"""Quotas: per owner, a maximum of placed-or-running jobs, cores and GPUs per accelerator.

Pure: what a quota is, how a request to set one is read, and whether placing one more job would
go past it (with the reason a waiting job shows). PostgreSQL keeps the quotas (table
``quotas``) and is the last guard with several replicas: the ``owner_holds`` trigger refuses a
placement statement that takes an owner past a quota (migrations/0015_queue_policy.sql).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from gpulayer_contracts.bounds import MAX_GPU_COUNT, MAX_JOB_CPU_CORES

# Resource names, as in the ``quotas`` and ``owner_usage`` tables.
JOBS = "jobs"
CORES = "cores"  # millicores, as the job's 'cpu' reservation
GPUS = "gpus:"  # + accelerator
DEFAULT_OWNER = "*"  # the default quota: an owner's own row for a resource replaces it

# Far above any fleet, within bigint: a quota past these is a typo.
MAX_QUOTA_JOBS = 10**9
MAX_QUOTA_GPUS = MAX_GPU_COUNT * 10**6
MAX_QUOTA_CORES = MAX_JOB_CPU_CORES * 10**6
ACCELERATORS = ("cpu", "cuda", "mps", "rocm")

Limits = dict[str, int]  # resource -> max


class QuotaRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``gpulayer quota set``: the owner (None: the default quota) and what to change. A limit
    of -1 clears that resource (no limit)."""

    owner: str | None = None
    gpus: dict[str, int] = {}
    cores: float | None = None
    jobs: int | None = None


def quota_rows(q: QuotaRequest) -> tuple[list[str], list[int], list[str]]:
    """(resources, maxima) to set and resources to clear; ValueError naming a bad value."""
    set_r: list[str] = []
    set_m: list[int] = []
    clear: list[str] = []

    def put(resource: str, value: int, most: int, what: str) -> None:
        if value == -1:
            clear.append(resource)
        elif 0 <= value <= most:
            set_r.append(resource)
            set_m.append(value)
        else:
            raise ValueError(f"{what}: {value} is out of range (0 .. {most}, or -1 to clear)")

    for acc, n in q.gpus.items():
        if acc not in ACCELERATORS:
            raise ValueError(f"gpus: {acc!r} is not an accelerator ({', '.join(ACCELERATORS)})")
        put(GPUS + acc, n, MAX_QUOTA_GPUS, f"gpus {acc}")
    if q.cores is not None:
        if not math.isfinite(q.cores):
            raise ValueError(f"cores: {q.cores!r} is not a number of cores")
        put(CORES, -1 if q.cores == -1 else math.floor(q.cores * 1000), MAX_QUOTA_CORES, "cores")
    if q.jobs is not None:
        put(JOBS, q.jobs, MAX_QUOTA_JOBS, "jobs")
    if not (set_r or clear):
        raise ValueError("nothing to set: give --gpus ACC=N, --cores N or --jobs N")
    return set_r, set_m, clear


def limit(quotas: Mapping[str, Limits], owner: str, resource: str) -> int | None:
    """The quota ``owner`` is held to for ``resource``: its own, else the default's."""
    own = quotas.get(owner)
    if own is not None and resource in own:
        return own[resource]
    default = quotas.get(DEFAULT_OWNER)
    return None if default is None else default.get(resource)


def describe(resource: str, amount: int) -> str:
    """``8 cuda GPUs``, ``64 cores``, ``100 jobs``."""
    if resource.startswith(GPUS):
        return f"{amount} {resource[len(GPUS) :]} GPUs"
    if resource == CORES:
        return f"{amount / 1000:g} cores"
    return f"{amount} jobs"


def over_quota(
    quotas: Mapping[str, Limits],
    owner: str,
    held: Mapping[str, int],
    need: Mapping[str, int],
) -> str | None:
    """Why placing a job that holds ``need`` would take ``owner`` (holding ``held``) past a
    quota, e.g. ``owner alice holds 8/8 cuda GPUs``; None when it fits."""
    if not quotas:
        return None
    for resource, amount in need.items():
        if amount <= 0:
            continue
        most = limit(quotas, owner, resource)
        if most is None:
            continue
        have = held.get(resource, 0)
        if have + amount > most:
            used = describe(resource, have).split(" ", 1)
            text = f"owner {owner} holds {used[0]}/{describe(resource, most)}"
            if have < most:
                text += f"; this job needs {describe(resource, amount).split(' ', 1)[0]} more"
            return text
    return None


def job_need(gpus: int, accelerator: str | None, millicores: int) -> dict[str, int]:
    """What one job counts against its owner's quota."""
    need = {JOBS: 1, CORES: millicores}
    if gpus > 0 and accelerator is not None:
        need[GPUS + accelerator] = gpus
    return need

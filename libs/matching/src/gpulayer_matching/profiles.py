"""How many nodes satisfy each runtime profile, and why the others don't: ``gpulayer profiles``.

Pure. A profile is judged as a job that asks for nothing but the profile, on every node as if
idle: what it holds now, and its cores, RAM and slots, are not the profile's concern. Offline
nodes and nodes whose executor stopped don't satisfy it now, and are counted as such.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from gpulayer_contracts.jobs import JobRequest
from gpulayer_contracts.profiles import PROFILE_FIELDS, Profiles, expand_profile
from gpulayer_matching.matcher import NodeView, explain

__all__ = ["profile_fit", "profile_job"]


def profile_job(ref: str, profiles: Profiles) -> JobRequest:
    """A job that asks for profile ``ref`` and nothing else, expanded."""
    job, _ = expand_profile(JobRequest(job_id="profile", command=["true"], profile=ref), profiles)
    return job


def _idle(view: NodeView) -> NodeView:
    return msgspec.structs.replace(
        view,
        exclusive=frozenset(),
        shared=frozenset(),
        cpu_total=None,
        cpu_free=None,
        memory_total=None,
        memory_free=None,
        slots_total=None,
        slots_free=None,
        gpu_reserved={},
    )


def profile_fit(profiles: Profiles, views: Sequence[NodeView]) -> list[dict[str, Any]]:
    """One entry per profile, by name and version: its requirements, the fleet's size, how
    many nodes satisfy it now (``satisfy``), and a reason per rule for the others, as ``explain``
    words them (each naming the profile)."""
    idle = [_idle(v) for v in views]
    out = []
    for ref in sorted(profiles.by_ref, key=_order):
        profile = profiles.by_ref[ref]
        why = explain(profile_job(ref, profiles), idle)
        requirements = {
            f: v
            for f in (*PROFILE_FIELDS, "container")
            if (v := msgspec.to_builtins(getattr(profile, f))) not in (None, [], {})
        }
        out.append(
            {
                "profile": ref,
                "description": profile.description,
                "requirements": requirements,
                "nodes": len(views),
                "satisfy": why.can_run_now,
                "summary": why.summary,
                "reasons": why.reasons,
                "ruled_out": why.ruled_out,
            }
        )
    return out


def _order(ref: str) -> tuple[str, int]:
    name, _, version = ref.rpartition("@")
    return name, int(version)

"""Devices in use: an exclusive job needs its devices free; a shared job needs them not held
exclusively; a job that uses the node's GPU pool (no ``gpu_count``) needs the whole pool free
(exclusive) or any of it not held exclusively (shared). The devices chosen are ``place``'s."""

from __future__ import annotations

from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import Outcome, Rule, Tally, gpus_wanted
from gpulayer_matching.verdicts import POOL, Cap


def _exclusive_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", (
        f"too few free devices (need {gpus_wanted(plan)}, most free: {t.best_node} {t.best})"
    )


def _shared_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", (
        f"too few devices not held exclusively (need {gpus_wanted(plan)}, most: "
        f"{t.best_node} {t.best})"
    )


def _pool_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "GPUs in use (exclusive use holds the node's whole GPU pool)"


def _pool_shared_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "every GPU held exclusively"


EXCLUSIVE = Outcome("busy_exclusive", 40_103, "gpu.use", "free devices", _exclusive_words)
SHARED = Outcome("busy_shared", 40_104, "gpu.use", "held exclusively", _shared_words)
POOL_EXCLUSIVE = Outcome("busy_pool", 40_105, "gpu.use", "in use", _pool_words)
POOL_SHARED = Outcome("busy_pool_shared", 40_106, "gpu.use", "held exclusively", _pool_shared_words)


def busy_rule(cap: Cap) -> str:
    """The outcome a node that has too few of its devices free for the job is counted under."""
    if cap.mode == POOL:
        return POOL_EXCLUSIVE.name if cap.use == "exclusive" else POOL_SHARED.name
    return EXCLUSIVE.name if cap.use == "exclusive" else SHARED.name


RULE = Rule("busy_devices", (EXCLUSIVE, SHARED, POOL_EXCLUSIVE, POOL_SHARED))

"""Shared GPU memory: a shared job that names ``gpu_memory_gb`` needs that much left on each of
its devices beside what other shared jobs on them reserved."""

from __future__ import annotations

from collections.abc import Sequence

from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import GB, MIB, Outcome, Rule, Tally, fmt_gb
from gpulayer_matching.verdicts import Cap, Miss
from gpulayer_matching.views import NodeView


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    n = plan.n
    assert plan.gb is not None
    assert isinstance(t.best, int)
    whose = "its" if t.count == 1 else "their"
    where = f"on {whose} best shared GPU" if n <= 1 else f"per GPU on {whose} best {n} shared GPUs"
    room = max(t.best, 0) * MIB / GB
    return "have", f"{room:.1f} GB free {where} (need {fmt_gb(plan.gb)})"


SHORT = Outcome("busy_gpu_memory", 40_107, "gpu_memory_gb", "GB free", _words)


def roomy(
    plan: Plan, cap: Cap, view: NodeView, free: Sequence[int], n: int
) -> Sequence[int] | Miss:
    """``free`` less the devices where a shared job's ``gpu_memory_gb`` no longer fits beside
    what other shared jobs reserved; a miss when fewer than ``n`` remain."""
    need = plan.need_mib
    reserved = view.gpu_reserved
    if need is None or not reserved:
        return free
    mib = cap.mib
    left = [mib.get(i, 0) - reserved.get(i, 0) for i in free]
    fits = [i for i, room in zip(free, left, strict=True) if room >= need]
    if len(fits) >= n:
        return fits
    return Miss(SHORT.name, sorted(left, reverse=True)[n - 1] if len(left) >= n else 0)


RULE = Rule("shared_gpu_memory", (SHORT,))

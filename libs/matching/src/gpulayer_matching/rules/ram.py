"""Host RAM: ``memory_gb`` within what the node offers jobs in all (a capability: never on this
node) and within what is free now (occupancy), in bytes."""

from __future__ import annotations

from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import HostRule, Outcome, Tally, fmt_bytes
from gpulayer_matching.verdicts import Fail
from gpulayer_matching.views import NodeView


def _in_all_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    assert isinstance(t.best, int)
    return "have", (
        f"< {fmt_bytes(plan.mem_bytes)} GB of RAM for jobs "
        f"(best: {t.best_node} {fmt_bytes(t.best)} GB)"
    )


def _free_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    assert isinstance(t.best, tuple)
    free, total = t.best
    return "have", (
        f"{fmt_bytes(free)}/{fmt_bytes(total)} GB free RAM (need {fmt_bytes(plan.mem_bytes)})"
    )


IN_ALL = Outcome("host_memory", 30_101, "memory_gb", "RAM", _in_all_words)
BUSY = Outcome("busy_memory", 40_102, "memory_gb", "RAM", _free_words)


def check(plan: Plan, view: NodeView) -> Fail | None:
    """Short of what the node offers in all (ranked first: a node that never can), else of
    what is free now."""
    total = view.memory_total
    if total is not None and plan.mem_bytes > total:
        return Fail(IN_ALL.rank, IN_ALL.name, total)
    free = view.memory_free
    if free is not None and plan.mem_bytes > free:
        return Fail(BUSY.rank, BUSY.name, (free, total))
    return None


RULE = HostRule("ram", (IN_ALL, BUSY), check)

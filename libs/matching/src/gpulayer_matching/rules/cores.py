"""Host cores: ``cpu_cores`` within what the node offers jobs in all (a capability: never on
this node) and within what is free now (occupancy), in millicores."""

from __future__ import annotations

from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import HostRule, Outcome, Tally, fmt_cores
from gpulayer_matching.verdicts import Fail
from gpulayer_matching.views import NodeView


def _in_all_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    assert isinstance(t.best, int)
    return "have", (
        f"< {fmt_cores(plan.millicores)} cores for jobs (best: {t.best_node} {fmt_cores(t.best)})"
    )


def _free_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    assert isinstance(t.best, tuple)
    free, total = t.best
    return "have", (
        f"{fmt_cores(free)}/{fmt_cores(total)} free cores (need {fmt_cores(plan.millicores)})"
    )


IN_ALL = Outcome("cores", 30_100, "cpu_cores", "cores", _in_all_words)
BUSY = Outcome("busy_cores", 40_101, "cpu_cores", "cores", _free_words)


def check(plan: Plan, view: NodeView) -> Fail | None:
    """Short of what the node offers in all (ranked first: a node that never can), else of
    what is free now."""
    total = view.cpu_total
    if total is not None and plan.millicores > total:
        return Fail(IN_ALL.rank, IN_ALL.name, total)
    free = view.cpu_free
    if free is not None and plan.millicores > free:
        return Fail(BUSY.rank, BUSY.name, (free, total))
    return None


RULE = HostRule("cores", (IN_ALL, BUSY), check)

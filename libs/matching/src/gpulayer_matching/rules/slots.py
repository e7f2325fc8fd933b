"""Job slots: every job holds one of the executor's slots while it runs."""

from __future__ import annotations

from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import HostRule, Outcome, Tally
from gpulayer_matching.verdicts import Fail
from gpulayer_matching.views import NodeView


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "no free job slot"


NO_SLOT = Outcome("no_slot", 40_100, "slots_free", "job slot", _words)


def check(plan: Plan, view: NodeView) -> Fail | None:
    free = view.slots_free
    if free is not None and free < 1:
        return Fail(NO_SLOT.rank, NO_SLOT.name, view.slots_total)
    return None


RULE = HostRule("slots", (NO_SLOT,), check)

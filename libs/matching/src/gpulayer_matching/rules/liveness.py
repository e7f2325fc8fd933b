"""Liveness: a node that is offline, or whose executor stopped sending heartbeats, gets no grant
(it would only queue there). Counted after the capability rules: such a node could run the job."""

from __future__ import annotations

from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import HostRule, Outcome, Tally
from gpulayer_matching.verdicts import Fail
from gpulayer_matching.views import NodeView


def _offline_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "are", "offline"


def _executor_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "no running executor (its heartbeats stopped)"


OFFLINE = Outcome("offline", 40_000, "online", "offline", _offline_words)
EXECUTOR_DOWN = Outcome("executor_down", 40_001, "executor_down", "executor", _executor_words)


def check(plan: Plan, view: NodeView) -> Fail | None:
    if not view.online:
        return Fail(OFFLINE.rank, OFFLINE.name)
    if view.executor_down:
        return Fail(EXECUTOR_DOWN.rank, EXECUTOR_DOWN.name)
    return None


RULE = HostRule("liveness", (OFFLINE, EXECUTOR_DOWN), check)

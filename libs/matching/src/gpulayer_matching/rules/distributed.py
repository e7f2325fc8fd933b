"""Distributed: a distributed job's ``distributed.backend`` and ``distributed.launcher`` offered by
the node. (A gang's spread over nodes is ``gpulayer_matching.gang``'s.)"""

from __future__ import annotations

from gpulayer_matching.facts import Facts
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally
from gpulayer_matching.verdicts import Fail


def _backend_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "lack", f"the {plan.backend} distributed backend"


def _launcher_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "lack", f"the {plan.launcher} launcher"


BACKEND = Outcome("backend", 30_000, "distributed.backend", "distributed backend", _backend_words)
LAUNCHER = Outcome("launcher", 30_001, "distributed.launcher", "launcher", _launcher_words)


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    if plan.backend is not None and plan.backend not in facts.backends:
        return Fail(BACKEND.rank, BACKEND.name)
    if plan.launcher is not None and plan.launcher not in facts.launchers:
        return Fail(LAUNCHER.rank, LAUNCHER.name)
    return None


RULE = NodeRule("distributed", (BACKEND, LAUNCHER), check)

"""Platform: a job that names ``os`` runs only on nodes of that platform family."""

from __future__ import annotations

from gpulayer_matching.facts import Facts
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally, seen
from gpulayer_matching.verdicts import Fail


def _unknown_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "unknown operating system"


def _other_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"an operating system other than {plan.os}{seen(t)}"


UNKNOWN = Outcome("os_unknown", 40, "os", "operating system", _unknown_words)
OTHER = Outcome("os", 41, "os", "operating system", _other_words)


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    if plan.os is not None and facts.family != plan.os:
        if facts.family is None:
            return Fail(UNKNOWN.rank, UNKNOWN.name)
        return Fail(OTHER.rank, OTHER.name, facts.family)
    return None


RULE = NodeRule("platform", (UNKNOWN, OTHER), check)

"""Python: ``python`` (a PEP 440 specifier) against the Python the node's workloads run."""

from __future__ import annotations

from gpulayer_matching.facts import Facts, satisfies
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally, seen
from gpulayer_matching.verdicts import Fail


def _unknown_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "unknown Python version"


def _other_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"Python not matching {plan.python}{seen(t)}"


UNKNOWN = Outcome("python_unknown", 700, "python", "Python", _unknown_words)
OTHER = Outcome("python", 701, "python", "Python", _other_words)


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    if plan.python is None:
        return None
    ok = None if facts.python is None else satisfies(plan.python, facts.python)
    if ok is None:
        return Fail(UNKNOWN.rank, UNKNOWN.name)
    if not ok:
        return Fail(OTHER.rank, OTHER.name, facts.python)
    return None


RULE = NodeRule("python", (UNKNOWN, OTHER), check)

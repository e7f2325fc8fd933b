"""Frameworks: each of ``frameworks`` (name -> PEP 440 specifier) installed in a matching
version. One outcome per framework the job names (``framework:torch``), ranked in name order."""

from __future__ import annotations

from gpulayer_matching.facts import Facts, satisfies
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally, seen
from gpulayer_matching.verdicts import Fail


def _unknown_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"unknown {rule.partition(':')[2]} version (not reported)"


def _other_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    name = rule.partition(":")[2]
    spec = dict((k, v) for _, k, v in plan.frameworks)[name]
    return "have", f"{name} not matching {spec}{seen(t)}"


# The i-th framework's outcomes rank at 10_000 + 2i (unknown) and 10_000 + 2i + 1.
UNKNOWN = Outcome("framework_unknown", 10_000, "frameworks", "{member}", _unknown_words)
OTHER = Outcome("framework", 10_001, "frameworks", "{member}", _other_words)


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    for i, (canon, name, spec) in enumerate(plan.frameworks):
        version = facts.frameworks.get(canon)
        ok = None if version is None else satisfies(spec, version)
        if ok is None:
            return Fail(UNKNOWN.rank + 2 * i, f"{UNKNOWN.name}:{name}")
        if not ok:
            return Fail(OTHER.rank + 2 * i, f"{OTHER.name}:{name}", version)
    return None


RULE = NodeRule("frameworks", (UNKNOWN, OTHER), check)

"""Framework capabilities: each of ``framework_capabilities`` (``torch.cuda``, ...) reported by
the node's probe. One outcome per capability the job names, ranked in the job's order."""

from __future__ import annotations

from gpulayer_matching.facts import Facts
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally
from gpulayer_matching.verdicts import Fail


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "lack", rule.partition(":")[2]


# The i-th capability's outcome ranks at 20_000 + i.
MISSING = Outcome("framework_capability", 20_000, "framework_capabilities", "{member}", _words)


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    for i, fwcap in enumerate(plan.fwcaps):
        if fwcap not in facts.fwcaps:
            return Fail(MISSING.rank + i, f"{MISSING.name}:{fwcap}")
    return None


RULE = NodeRule("framework_capabilities", (MISSING,), check)

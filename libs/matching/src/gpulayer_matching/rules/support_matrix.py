"""The support matrix: a job placed as cpu work (no devices held) needs cpu to be schedulable for
its mode (independent or distributed). Which accelerators a job may get at all is decided when
its plan is compiled (``Plan.candidates``, ``Plan.failure``)."""

from __future__ import annotations

from gpulayer_matching.facts import Facts
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally
from gpulayer_matching.verdicts import Fail


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "can't", f"take {plan.mode_name} cpu work (support matrix)"


MATRIX = Outcome("matrix", 50, "accelerator", "cpu work", _words)


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    if as_cpu and not plan.cpu_ok:
        return Fail(MATRIX.rank, MATRIX.name)
    return None


RULE = NodeRule("support_matrix", (MATRIX,), check)

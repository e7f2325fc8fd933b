"""GPU APIs: a job's ``gpu.apis_any`` needs one of them offered on the host, or in containers
when it runs in one (``gpu.in_container``), at a level the support matrix schedules
(``matrix.API_SUPPORT``: directml is detection-only)."""

from __future__ import annotations

from gpulayer_contracts import matrix
from gpulayer_matching.facts import Facts
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally
from gpulayer_matching.verdicts import Fail


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"none of the GPU APIs {' or '.join(t.seen)}"


def _matrix_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"only GPU APIs the support matrix doesn't schedule: {' or '.join(t.seen)}"


NONE_OFFERED = Outcome("apis", 600, "gpu.apis_any", "GPU APIs", _words)
NOT_SCHEDULED = Outcome("apis_matrix", 601, "gpu.apis_any", "support matrix", _matrix_words)


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    if gpu.apis:
        offered = facts.apis_containers if gpu.in_container else facts.apis_host
        present = [a for a in gpu.apis if a in offered]
        if any(matrix.api_schedulable(a) for a in present):
            return None
        where = "in containers" if gpu.in_container else "on the host"
        if present:
            levels = ", ".join(f"{a} {matrix.api_level(a)}" for a in present)
            return Fail(NOT_SCHEDULED.rank, NOT_SCHEDULED.name, f"{levels} {where}")
        return Fail(NONE_OFFERED.rank, NONE_OFFERED.name, f"{' / '.join(gpu.apis)} {where}")
    return None


RULE = NodeRule("gpu_apis", (NONE_OFFERED, NOT_SCHEDULED), check)

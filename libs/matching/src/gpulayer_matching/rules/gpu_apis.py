"""GPU APIs: a job's ``gpu.apis_any`` needs one of them offered on the host, or in containers
when it runs in one (``gpu.in_container``)."""

from __future__ import annotations

from gpulayer_matching.facts import Facts
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.rules.base import NodeRule, Outcome, Tally
from gpulayer_matching.verdicts import Fail


def _words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", f"none of the GPU APIs {' or '.join(t.seen)}"


NONE_OFFERED = Outcome("apis", 600, "gpu.apis_any", "GPU APIs", _words)


def check(plan: Plan, facts: Facts, gpu: Gpu, as_cpu: bool) -> Fail | None:
    if gpu.apis:
        offered = facts.apis_containers if gpu.in_container else facts.apis_host
        if not any(a in offered for a in gpu.apis):
            where = "in containers" if gpu.in_container else "on the host"
            return Fail(NONE_OFFERED.rank, NONE_OFFERED.name, f"{' / '.join(gpu.apis)} {where}")
    return None


RULE = NodeRule("gpu_apis", (NONE_OFFERED,), check)

"""Per-device memory: ``gpu_memory_gb`` on each of the job's devices, the node idle. (What shared
jobs leave free now is the ``shared_gpu_memory`` occupancy rule.)"""

from __future__ import annotations

from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Device, Facts
from gpulayer_matching.plan import Plan
from gpulayer_matching.rules.base import DeviceRule, Outcome, Tally, fmt_gb, fmt_mib, nth_miss
from gpulayer_matching.verdicts import Fail


def _unknown_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    return "have", "unknown GPU memory"


def _short_words(plan: Plan, rule: str, t: Tally) -> tuple[str, str]:
    n = plan.n
    on = f" on {n} GPUs" if n > 1 else ""
    assert plan.gb is not None
    assert isinstance(t.best, int)
    return "have", f"< {fmt_gb(plan.gb)} GB per GPU{on} (best: {t.best_node} {fmt_mib(t.best)})"


UNKNOWN = Outcome("memory_unknown", 400, "gpu_memory_gb", "GPU memory", _unknown_words)
SHORT = Outcome("memory", 401, "gpu_memory_gb", "GB per GPU", _short_words)


def check(
    plan: Plan, facts: Facts, acc: Accelerator, devs: tuple[Device, ...], n: int
) -> tuple[Device, ...] | Fail:
    need = plan.need_mib
    if need is None:
        return devs
    passing = [d for d in devs if d.mib is not None and d.mib >= need]
    if len(passing) < n:
        miss = nth_miss([d.mib for d in devs], len(passing), n)
        if miss is None:
            return Fail(UNKNOWN.rank, UNKNOWN.name)
        return Fail(SHORT.rank, SHORT.name, miss)
    return tuple(passing)


RULE = DeviceRule("device_memory", (UNKNOWN, SHORT), check)

"""What every rule module is made of: its outcomes (name, rank, field, words) and its check, by
the step of matching it belongs to; and the helpers reasons share to show what was seen."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from gpulayer_contracts.jobs import Accelerator
from gpulayer_matching.facts import Device, Facts, version_key
from gpulayer_matching.plan import Gpu, Plan
from gpulayer_matching.verdicts import Fail
from gpulayer_matching.views import NodeView

__all__ = [
    "GB",
    "MIB",
    "DeviceRule",
    "HostRule",
    "NodeRule",
    "Outcome",
    "Rule",
    "Tally",
    "Words",
    "fmt_bytes",
    "fmt_cores",
    "fmt_gb",
    "fmt_mib",
    "gpus_wanted",
    "label",
    "nth_miss",
    "seen",
    "seen_all",
]

MIB: Final = 1 << 20
GB: Final = 10**9

_Num = TypeVar("_Num", int, tuple[int, int])


class Tally:
    """What explaining collected for one outcome over the fleet: how many nodes it ruled out,
    the best nearest miss (and its node) for numeric values, the distinct texts seen."""

    __slots__ = ("best", "best_node", "count", "rank", "seen")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.count = 0
        self.best: object = None
        self.best_node = ""
        self.seen: list[str] = []


# (plan, the outcome's full name, its tally) -> (verb, rest). The verb is in the plural
# ("have", "are", "lack", "can't") and agrees with a count of one by itself.
Words = Callable[[Plan, str, Tally], tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One way a node fails a rule. ``name``: its key in ``NoPlacement.ruled_out`` (a family
    like ``framework`` is keyed ``framework:<name>``); ``rank``: its place in the explanation
    order (a family's first; the check adds an offset per name); ``field``: the requirement it
    checks, as ``JobRequest.profile_fields`` names it (``requirements.`` left out; a family's
    ``.<name>`` added), or the node state it reads; ``names``: the words by which its reason
    names that field (a test checks they are in it)."""

    name: str
    rank: int
    field: str
    names: str
    words: Words

    def names_of(self, rule: str) -> str:
        """``names`` with ``{member}`` filled in (a family's reasons name their member)."""
        return self.names.replace("{member}", rule.partition(":")[2])

    def field_of(self, rule: str) -> str:
        """The field that outcome ``rule`` (``name`` or ``name:<member>``) checks."""
        _, _, member = rule.partition(":")
        return f"{self.field}.{member}" if member else self.field


@dataclass(frozen=True, slots=True)
class Rule:
    """A rule: its concern and its outcomes. The subclasses add the check the matcher runs at
    their step; a bare ``Rule`` is applied by the placement step while it chooses devices
    (devices in use, shared GPU memory: ``place``) or by ``explain`` (health), with the helpers
    its module gives them."""

    concern: str
    outcomes: tuple[Outcome, ...]


# check(plan, facts, gpu, as_cpu): a node-wide capability; ``gpu``: the job's GPU section for the
# node's platform; ``as_cpu``: the job would be placed as cpu work (no devices held) there,
# which is known once the device rules ran (False for the node rules before them).
NodeCheck = Callable[[Plan, Facts, Gpu, bool], Fail | None]
# check(plan, facts, acc, devices, n): the devices of ``acc`` still eligible that pass, or why
# fewer than ``n`` do.
DeviceCheck = Callable[
    [Plan, Facts, Accelerator, tuple[Device, ...], int], tuple[Device, ...] | Fail
]


@dataclass(frozen=True, slots=True)
class NodeRule(Rule):
    check: NodeCheck


@dataclass(frozen=True, slots=True)
class DeviceRule(Rule):
    check: DeviceCheck


@dataclass(frozen=True, slots=True)
class HostRule(Rule):
    """A host resource read from the node's view on each call (never cached: it changes with
    every grant); ``check(plan, view)``."""

    check: Callable[[Plan, NodeView], Fail | None]


def nth_miss(values: Sequence[_Num | None], passing: int, n: int) -> _Num | None:
    """The n-th entry of: passing devices, then unknown ones, then the rest best first."""
    unknown = sum(1 for v in values if v is None)
    if passing + unknown >= n:
        return None
    # Passing values are known and larger than every short one, so the short ones are the known
    # values after the top ``passing``.
    known = sorted((v for v in values if v is not None), reverse=True)
    return known[n - 1 - unknown]


def label(plan: Plan) -> str:
    """The devices' name in reasons: the accelerator the job named, else GPU."""
    return plan.acc if plan.acc is not None and plan.acc != "cpu" else "GPU"


def gpus_wanted(plan: Plan) -> str:
    n = plan.n
    return f"{n} {label(plan)} devices" if n > 1 else f"a {label(plan)} device"


def fmt_gb(gb: float) -> str:
    return f"{gb:g}"


def fmt_cores(millicores: int) -> str:
    return f"{millicores / 1000:g}"


def fmt_bytes(n: int) -> str:
    """GB of 10^9 bytes, to a tenth (never shown as more than it is)."""
    return f"{math.floor(n / GB * 10) / 10:g}"


def fmt_mib(mib: int) -> str:
    return f"{mib * MIB / GB:.1f} GB ({mib} MiB)"


def seen(t: Tally) -> str:
    """The versions seen, highest first (at most 3)."""
    shown = sorted(t.seen, key=version_key, reverse=True)[:3]
    more = ", ..." if len(t.seen) > 3 else ""
    return f" (seen: {', '.join(shown)}{more})"


def seen_all(t: Tally) -> str:
    """The values seen, in the order met (at most 3, then a count)."""
    shown = t.seen[:3]
    more = f", ... ({len(t.seen) - 3} more)" if len(t.seen) > 3 else ""
    return f" (seen: {'; '.join(shown)}{more})" if shown else ""

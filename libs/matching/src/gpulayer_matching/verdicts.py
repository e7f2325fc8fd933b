"""What a rule answers: a node's capability verdict for one job shape (``Cap``), the first rule
it fails (``Fail``) and why a node that could take the job can't now (``Miss``)."""

from __future__ import annotations

import msgspec

from gpulayer_contracts.jobs import Accelerator, GpuUse

__all__ = ["COUNT", "CPU", "POOL", "Cap", "Fail", "Miss"]

# Modes: how a job holds devices on a node (its `use` can differ per platform variant).
COUNT = 1  # gpu_count (or a named GPU accelerator): that many devices
POOL = 2  # no count, use shared/exclusive (the apis_any runner style): the node's GPU pool
CPU = 3  # no count, use none: no devices


class Fail(msgspec.Struct, frozen=True, gc=False):
    """A node fails ``rule`` (an outcome's name, ``framework:<name>`` for the per-name ones) at
    ``rank``; ``value`` is its nearest miss (a number, a version, a text), or None. (A struct:
    built in C, as the host rules build one per node scanned that is short of something.)"""

    rank: int
    rule: str
    value: object = None


class Miss:
    """Why a node that could run the job can't now: an occupancy outcome, and its nearest miss."""

    __slots__ = ("rule", "value")

    def __init__(self, rule: str, value: object) -> None:
        self.rule = rule
        self.value = value


class Cap:
    """A node's verdict for one job shape, with every device free and the node online.

    ok: every capability rule passes. ``pools``: per accelerator that passes, the indices of
    the devices that satisfy the per-device rules, in index order. When not ok: ``rank`` and
    ``rule`` name the first rule failed, ``value`` is the node's nearest-miss value for it.
    """

    __slots__ = ("mib", "mode", "ok", "pools", "rank", "rule", "use", "value")

    def __init__(
        self,
        *,
        ok: bool,
        use: GpuUse = "none",
        mode: int = 0,
        pools: tuple[tuple[Accelerator, tuple[int, ...], frozenset[int]], ...] = (),
        rank: int = 0,
        rule: str = "",
        value: object = None,
        mib: dict[int, int] | None = None,
    ) -> None:
        self.ok = ok
        self.mib = mib if mib is not None else {}
        self.use = use
        self.mode = mode
        self.pools = pools
        self.rank = rank
        self.rule = rule
        self.value = value

    @classmethod
    def failed(cls, use: GpuUse, fail: Fail) -> Cap:
        return cls(ok=False, use=use, rank=fail.rank, rule=fail.rule, value=fail.value)

"""Which running jobs to stop so that a higher-priority job fits, and what a node would look
like without them. Pure: node views and the active jobs in, a choice out.

Rules (docs/placement-rules.md "Order of decisions"): only jobs submitted with
``preemptible = true``, of strictly lower priority than the waiting job, not already being
preempted, on one node; the fewest such jobs, lowest priorities and most recently started first
(they lose the least work). No choice when even all of them together would not make room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgspec

from gpulayer_contracts import JobRequest
from gpulayer_matching import NodeView, Placement, match, would_fit_when_idle
from gpulayer_matching.resources import CPU, GPU_MEMORY, MEMORY, SLOTS


@dataclass(slots=True)
class Active:
    """A placed or running job, as the queue policy sees it."""

    job_id: str
    node_id: str
    owner: str
    accelerator: str | None
    devices: tuple[int, ...]
    shared: bool
    priority: int
    preemptible: bool
    started: float  # epoch seconds it was placed
    ends_at: float  # started + timeout_s; inf without a timeout
    millicores: int = 0
    preempting: bool = False  # chosen as a victim, its cancel sent

    @property
    def gpus(self) -> int:
        return len(self.devices)


Items = Callable[[str], list[tuple[str, int]]]  # job id -> what it reserves besides devices


def _totals(
    held: Iterable[tuple[str, int]], gpu_reserved: dict[int, int], sign: int
) -> tuple[int, int, int, dict[int, int]]:
    """The cores, RAM and slots in ``held`` (``resources.reservations`` items), and the GPU
    memory reserved per device with theirs added (``sign`` +1) or taken off (-1)."""
    cpu = memory = slots = 0
    gpu = dict(gpu_reserved)
    for resource, amount in held:
        if resource == CPU:
            cpu += amount
        elif resource == MEMORY:
            memory += amount
        elif resource == SLOTS:
            slots += amount
        elif resource.startswith(GPU_MEMORY):
            d = int(resource[len(GPU_MEMORY) :])
            gpu[d] = gpu.get(d, 0) + sign * amount
    return cpu, memory, slots, gpu


def without(
    view: NodeView, gone: Sequence[Active], rest: Iterable[Active], items: Items
) -> NodeView:
    """``view`` as it would be once the ``gone`` jobs ended: their exclusive devices free, shared
    devices free where no job of ``rest`` (the node's other jobs) still shares them, their cores,
    RAM, slot and GPU memory given back."""
    exclusive = set(view.exclusive)
    shared_gone: set[int] = set()
    for a in gone:
        if a.shared:
            shared_gone.update(a.devices)
        else:
            exclusive.difference_update(a.devices)
    released = [item for a in gone for item in items(a.job_id)]
    cpu, memory, slots, gpu = _totals(released, view.gpu_reserved, -1)
    still = {d for a in rest if a.shared for d in a.devices}
    return msgspec.structs.replace(
        view,
        exclusive=frozenset(exclusive),
        shared=frozenset(view.shared - (shared_gone - still)),
        cpu_free=None if view.cpu_free is None else view.cpu_free + cpu,
        memory_free=None if view.memory_free is None else view.memory_free + memory,
        slots_free=None if view.slots_free is None else view.slots_free + slots,
        gpu_reserved={d: v for d, v in gpu.items() if v > 0},
    )


def with_placed(
    view: NodeView, devices: Iterable[int], shared: bool, held: Iterable[tuple[str, int]]
) -> NodeView:
    """``view`` with one more placement on it: ``devices`` held (shared or whole) and ``held``
    (``resources.reservations``) taken, as ``Fleet.hold`` would leave it."""
    cpu, memory, slots, gpu = _totals(held, view.gpu_reserved, +1)
    devs = frozenset(devices)
    return msgspec.structs.replace(
        view,
        exclusive=view.exclusive if shared else view.exclusive | devs,
        shared=view.shared | devs if shared else view.shared,
        cpu_free=None if view.cpu_free is None else view.cpu_free - cpu,
        memory_free=None if view.memory_free is None else view.memory_free - memory,
        slots_free=None if view.slots_free is None else view.slots_free - slots,
        gpu_reserved=gpu,
    )


def room_after(
    job: JobRequest,
    view: NodeView,
    order: Sequence[Active],
    on_node: Sequence[Active],
    items: Items,
) -> int | None:
    """How many of ``order`` (the node's jobs, in the order they would go) must end before
    ``job`` fits on ``view``; None when even all of them are not enough.

    A job that fits once n have ended fits once more have (each end only frees), so the count
    is found by bisection: a match per halving, not one per job. One per job took 25 s to
    reserve a node on a fleet of 10,000 nodes running 100 jobs each (c1m, issue 49)."""

    def fits(n: int) -> bool:
        gone = order[:n]
        ids = {a.job_id for a in gone}
        rest = [a for a in on_node if a.job_id not in ids]
        return isinstance(match(job, [without(view, gone, rest, items)]), Placement)

    low, high = 1, len(order)
    if high == 0 or not fits(high):
        return None
    while low < high:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid + 1
    return low


@dataclass(frozen=True, slots=True)
class Choice:
    node_id: str
    victims: tuple[Active, ...]


def choose_victims(
    job: JobRequest,
    priority: int,
    views: Iterable[NodeView],
    active_by_node: dict[str, list[Active]],
    items: Items,
) -> Choice | None:
    """The node and the fewest preemptible, lower-priority jobs there whose end makes room for
    ``job``; ties: the lowest highest victim priority, then the node's id. None: no such set."""
    best: tuple[tuple[int, int, str], Choice] | None = None
    for view in views:
        on_node = active_by_node.get(view.node_id)
        if not on_node or not view.online or view.executor_down:
            continue
        candidates = [
            a for a in on_node if a.preemptible and a.priority < priority and not a.preempting
        ]
        if not candidates or not would_fit_when_idle(job, view):
            continue
        candidates.sort(key=lambda a: (a.priority, -a.started, a.job_id))
        n = room_after(job, view, candidates, on_node, items)
        if n is None:
            continue
        victims = tuple(candidates[:n])
        key = (n, max(v.priority for v in victims), view.node_id)
        if best is None or key < best[0]:
            best = (key, Choice(view.node_id, victims))
    return None if best is None else best[1]

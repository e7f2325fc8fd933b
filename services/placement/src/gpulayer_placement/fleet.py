"""In-memory view of the fleet that the matcher reads: node capabilities, liveness, allocations.

PostgreSQL is the truth; this is a cache kept current by the capability and heartbeat
consumers, this replica's own placements and releases, and NOTIFYs from other replicas.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import msgspec

from gpulayer_contracts.capabilities import AcceleratorDevice, Heartbeat, WorkerCapabilities
from gpulayer_matching import NodeView
from gpulayer_matching.resources import CPU, GB, GPU_MEMORY, MEMORY, SLOTS, gpu_memory_resource


class _Holds:
    __slots__ = ("exclusive", "shared")

    def __init__(self) -> None:
        self.exclusive: set[int] = set()
        self.shared: dict[int, int] = {}


class Offer(msgspec.Struct, frozen=True):
    """What a node's executor said it offers (its heartbeat): job slots, the host cores
    (millicores) and RAM (bytes) it keeps for the system, how it enforces job limits."""

    slots: int | None = None
    reserved_millicores: int = 0
    reserved_bytes: int = 0
    enforcement: str | None = None

    @classmethod
    def of(cls, beat: Heartbeat) -> Offer:
        return cls(
            slots=beat.slots,
            reserved_millicores=round((beat.reserved_cores or 0) * 1000),
            reserved_bytes=round((beat.reserved_memory_gb or 0) * GB),
            enforcement=beat.enforcement,
        )


class _Used:
    """Host resources and shared GPU memory held on one node (sums of its jobs' reservations)."""

    __slots__ = ("cpu", "gpu", "memory", "slots")

    def __init__(self) -> None:
        self.cpu = 0
        self.memory = 0
        self.slots = 0
        self.gpu: dict[int, int] = {}

    def add(self, resource: str, amount: int) -> None:
        if resource == CPU:
            self.cpu += amount
        elif resource == MEMORY:
            self.memory += amount
        elif resource == SLOTS:
            self.slots += amount
        elif resource.startswith(GPU_MEMORY):
            index = int(resource[len(GPU_MEMORY) :])
            left = self.gpu.get(index, 0) + amount
            if left > 0:
                self.gpu[index] = left
            else:
                self.gpu.pop(index, None)


def _free(total: int | None, used: int) -> int | None:
    return None if total is None else total - used


class Rotated(Sequence[NodeView]):
    """The node list starting at ``start``, without copying: spreads first-fit placements."""

    def __init__(self, items: list[NodeView], start: int) -> None:
        self._items = items
        self._start = start % len(items) if items else 0

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, i: int) -> NodeView: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[NodeView]: ...
    def __getitem__(self, i: int | slice) -> NodeView | Sequence[NodeView]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._items)
        if not -n <= i < n:
            raise IndexError(i)
        return self._items[(self._start + i) % n]

    def __iter__(self) -> Iterator[NodeView]:
        items, start = self._items, self._start
        yield from items[start:]
        yield from items[:start]


def _unhealthy(bad: dict[int, tuple[str, str]], d: AcceleratorDevice) -> bool:
    hits = [bad.get(i) for i in (d.index, d.mig_parent) if i is not None]
    return any(h is not None and h[0] == "unhealthy" for h in hits)


def sick_devices(
    caps: WorkerCapabilities, bad: dict[int, tuple[str, str]]
) -> tuple[frozenset[int], dict[int, str]]:
    """The node's devices kept from new grants by health (a GPU and its MIG instances), and
    ``<health>: <why>`` for each."""
    if not bad:
        return frozenset(), {}
    health: dict[int, str] = {}
    for d in caps.accelerators:
        entry = bad.get(d.index) or (bad.get(d.mig_parent) if d.mig_parent is not None else None)
        if entry is not None:
            health[d.index] = f"{entry[0]}: {entry[1]}"
    return frozenset(health), health


class Fleet:
    def __init__(self) -> None:
        self._views: list[NodeView] = []
        self._pos: dict[str, int] = {}
        self._holds: dict[str, _Holds] = {}
        self._used: dict[str, _Used] = {}
        # job id -> (node, what it reserves there): released by job id when it ends.
        self._reserved: dict[str, tuple[str, list[tuple[str, int]]]] = {}
        self._offers: dict[str, Offer] = {}
        # Capacities last recorded in PostgreSQL, per node and resource: used where this replica
        # has no word of its own yet (no executor heartbeat since it started).
        self._stored: dict[str, dict[str, int]] = {}
        self.last_seen: dict[str, float] = {}
        self.executor_seen: dict[str, float] = {}
        # Nodes whose last capabilities report was refused (kept: their last good one), why.
        self.report_errors: dict[str, str] = {}
        # Per node, the GPUs its last observations found not healthy: index -> (health, why).
        self._bad: dict[str, dict[int, tuple[str, str]]] = {}
        self._cursor = 0
        # Held by a reload of the holds from PostgreSQL (replica sync: from its read to its
        # replace) and by an executor status batch (from its commit to the release here): a
        # reload that read before an end committed, and replaced after that end's release
        # here, would hold the ended job's devices again, and count the job active for its
        # owner, until the next reload. Neither waits for a row lock while holding it.
        self.reload_lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._views)

    def get(self, node_id: str) -> NodeView | None:
        pos = self._pos.get(node_id)
        return None if pos is None else self._views[pos]

    def views(self) -> list[NodeView]:
        return self._views

    def rotated(self) -> Sequence[NodeView]:
        """Each call starts one node further, so equal jobs spread over equal nodes."""
        self._cursor += 1
        return Rotated(self._views, self._cursor)

    def _set(self, view: NodeView) -> None:
        pos = self._pos.get(view.node_id)
        if pos is None:
            self._pos[view.node_id] = len(self._views)
            self._views.append(view)
        else:
            self._views[pos] = view

    def _refresh(self, node_id: str) -> None:
        view = self.get(node_id)
        if view is None:
            return
        holds = self._holds.get(node_id)
        exclusive = frozenset(holds.exclusive) if holds else frozenset()
        shared = frozenset(holds.shared) if holds else frozenset()
        changes = self._resources(node_id, view.capabilities)
        self._set(msgspec.structs.replace(view, exclusive=exclusive, shared=shared, **changes))

    def capacity(self, node_id: str, caps: WorkerCapabilities) -> dict[str, int | None]:
        """What the node offers jobs in all: cores (millicores) and RAM (bytes) the probe
        reported less the executor's reserve, and the executor's slots. None: not known (then
        the last value stored in PostgreSQL, if any)."""
        offer = self._offers.get(node_id)
        stored = self._stored.get(node_id, {})
        cores, memory = caps.host.cpu_cores, caps.host.memory_bytes
        if offer is None:
            return {
                CPU: stored.get(CPU, None if cores is None else cores * 1000),
                MEMORY: stored.get(MEMORY, memory),
                SLOTS: stored.get(SLOTS),
            }
        return {
            CPU: None if cores is None else max(0, cores * 1000 - offer.reserved_millicores),
            MEMORY: None if memory is None else max(0, memory - offer.reserved_bytes),
            SLOTS: offer.slots if offer.slots is not None else stored.get(SLOTS),
        }

    def _resources(self, node_id: str, caps: WorkerCapabilities) -> dict[str, object]:
        total = self.capacity(node_id, caps)
        used = self._used.get(node_id) or _Used()
        return {
            "cpu_total": total[CPU],
            "cpu_free": _free(total[CPU], used.cpu),
            "memory_total": total[MEMORY],
            "memory_free": _free(total[MEMORY], used.memory),
            "slots_total": total[SLOTS],
            "slots_free": _free(total[SLOTS], used.slots),
            "gpu_reserved": dict(used.gpu),
        }

    @staticmethod
    def capacities(view: NodeView) -> dict[str, int | None]:
        """Every capacity the view's node offers, by resource name: what the database's
        trigger checks a placement's reservations against."""
        out: dict[str, int | None] = {
            CPU: view.cpu_total,
            MEMORY: view.memory_total,
            SLOTS: view.slots_total,
        }
        for d in view.capabilities.accelerators:
            if d.memory_mib is not None:
                out.setdefault(gpu_memory_resource(d.index), d.memory_mib)
        return out

    def offer(self, node_id: str) -> Offer | None:
        return self._offers.get(node_id)

    def used(self, node_id: str) -> dict[str, int]:
        """Cores (millicores), RAM (bytes) and slots held on the node now."""
        u = self._used.get(node_id) or _Used()
        return {CPU: u.cpu, MEMORY: u.memory, SLOTS: u.slots}

    def set_offer(self, node_id: str, offer: Offer) -> bool:
        """The executor's heartbeat said what it offers. True when that changed."""
        if self._offers.get(node_id) == offer:
            return False
        self._offers[node_id] = offer
        self._refresh(node_id)
        return True

    def reserve(
        self, job_id: str, node_id: str, items: list[tuple[str, int]], *, refresh: bool = True
    ) -> None:
        """A job placed on the node holds ``items`` (``resources.reservations``) until it ends."""
        if job_id in self._reserved:
            return
        self._reserved[job_id] = (node_id, items)
        used = self._used.setdefault(node_id, _Used())
        for resource, amount in items:
            used.add(resource, amount)
        if refresh:
            self._refresh(node_id)

    def reserved_items(self, job_id: str) -> list[tuple[str, int]]:
        """What a placed job reserves besides devices (empty when not known here)."""
        entry = self._reserved.get(job_id)
        return list(entry[1]) if entry is not None else []

    def unreserve(self, job_id: str) -> str | None:
        """The job ended (or its placement was not committed): give back what it held. Returns
        its node, None when nothing was held (already given back, or never known here)."""
        entry = self._reserved.pop(job_id, None)
        if entry is None:
            return None
        node_id, items = entry
        used = self._used.get(node_id)
        if used is not None:
            for resource, amount in items:
                used.add(resource, -amount)
        self._refresh(node_id)
        return node_id

    def upsert(self, caps: WorkerCapabilities, *, online: bool = True) -> bool:
        """Store a node's capabilities. True when the node is new or its capabilities changed."""
        old = self.get(caps.node_id)
        self.last_seen[caps.node_id] = time.monotonic()
        if (
            old is not None
            and old.online == online
            and old.capabilities
            == msgspec.structs.replace(caps, detected_at=old.capabilities.detected_at)
        ):
            # Nothing but the detection time moved: keep the old object, whose derived facts
            # the matcher has cached by identity.
            return False
        holds = self._holds.get(caps.node_id)
        sick, health = sick_devices(caps, self._bad.get(caps.node_id, {}))
        self._set(
            NodeView(
                node_id=caps.node_id,
                capabilities=caps,
                online=online,
                executor_down=old.executor_down if old is not None else False,
                exclusive=frozenset(holds.exclusive) if holds else frozenset(),
                shared=frozenset(holds.shared) if holds else frozenset(),
                sick=sick,
                health=health,
                **self._resources(caps.node_id, caps),  # type: ignore[arg-type]
            )
        )
        return True

    def set_health(self, node_id: str, bad: dict[int, tuple[str, str]]) -> tuple[bool, list[int]]:
        """The GPUs of the node's latest observations that are not healthy (index -> (health,
        why)). Returns whether the node's sick devices changed, and the allocatable indices that
        became unhealthy just now (their jobs get a warning)."""
        before = self._bad.get(node_id, {})
        if bad == before:
            return False, []
        if bad:
            self._bad[node_id] = bad
        else:
            self._bad.pop(node_id, None)
        view = self.get(node_id)
        if view is None:
            return False, []
        sick, health = sick_devices(view.capabilities, bad)
        newly = [
            d.index
            for d in view.capabilities.accelerators
            if _unhealthy(bad, d) and not _unhealthy(before, d)
        ]
        if sick == view.sick and health == view.health:
            return False, newly
        self._set(msgspec.structs.replace(view, sick=sick, health=health))
        return True, newly

    def bad_devices(self, node_id: str) -> dict[int, tuple[str, str]]:
        return self._bad.get(node_id, {})

    def remove(self, node_id: str, why: str) -> None:
        """Take a node out of matching until it reports capabilities again (``why`` is kept in
        ``report_errors``): its last report makes the matcher fail."""
        pos = self._pos.pop(node_id, None)
        if pos is not None:
            del self._views[pos]
            self._pos = {v.node_id: i for i, v in enumerate(self._views)}
        self.report_errors[node_id] = why

    def set_online(self, node_id: str, online: bool) -> bool:
        """True when this changed the node's state."""
        view = self.get(node_id)
        if online:
            self.last_seen[node_id] = time.monotonic()
        if view is None or view.online == online:
            return False
        self._set(msgspec.structs.replace(view, online=online))
        return True

    def executor_beat(self, node_id: str) -> bool:
        """The node's executor is alive. True when it had been marked down."""
        self.executor_seen[node_id] = time.monotonic()
        view = self.get(node_id)
        if view is None or not view.executor_down:
            return False
        self._set(msgspec.structs.replace(view, executor_down=False))
        return True

    def stale_executors(self, timeout_s: float) -> list[str]:
        """Nodes whose executor was heard from, not marked down yet, and silent ``timeout_s``."""
        now = time.monotonic()
        stale = []
        for node_id, seen in self.executor_seen.items():
            view = self.get(node_id)
            if view is not None and not view.executor_down and now - seen > timeout_s:
                stale.append(node_id)
        return stale

    def set_executor_down(self, node_id: str) -> None:
        view = self.get(node_id)
        if view is not None and not view.executor_down:
            self._set(msgspec.structs.replace(view, executor_down=True))

    def hold(
        self,
        node_id: str,
        devices: Iterable[int],
        mode: str,
        *,
        job_id: str | None = None,
        items: list[tuple[str, int]] | None = None,
    ) -> None:
        """Devices held by a placement, and with ``job_id`` what else it reserves (``reserve``),
        in one refresh of the node's view: the scheduler's hot path."""
        if job_id is not None and items is not None:
            self.reserve(job_id, node_id, items, refresh=False)
        holds = self._holds.setdefault(node_id, _Holds())
        for d in devices:
            if mode == "exclusive":
                holds.exclusive.add(d)
            else:
                holds.shared[d] = holds.shared.get(d, 0) + 1
        self._refresh(node_id)

    def release(self, node_id: str, devices: Iterable[int], mode: str) -> None:
        holds = self._holds.get(node_id)
        if holds is None:
            return
        for d in devices:
            if mode == "exclusive":
                holds.exclusive.discard(d)
            elif d in holds.shared:
                holds.shared[d] -= 1
                if holds.shared[d] <= 0:
                    del holds.shared[d]
        self._refresh(node_id)

    def replace_holds(
        self,
        rows: Iterable[tuple[str, int, str]],
        nodes: Iterable[str] | None = None,
        reservations: Iterable[tuple[str, str, str, int]] = (),
        capacities: Iterable[tuple[str, str, int]] = (),
    ) -> None:
        """Reset allocations from the database: for ``nodes`` only, or for the whole fleet.
        ``reservations``: (job, node, resource, amount) rows; ``capacities``: (node, resource,
        capacity) as last recorded."""
        targets = (
            set(self._holds) | set(self._pos) | set(self._used) if nodes is None else set(nodes)
        )
        for node_id in targets:
            self._holds[node_id] = _Holds()
            self._used[node_id] = _Used()
            self._stored.pop(node_id, None)
        self._reserved = {j: e for j, e in self._reserved.items() if e[0] not in targets}
        for job_id, node_id, resource, amount in reservations:
            entry = self._reserved.setdefault(job_id, (node_id, []))
            entry[1].append((resource, amount))
            self._used.setdefault(node_id, _Used()).add(resource, amount)
        for node_id, resource, capacity in capacities:
            self._stored.setdefault(node_id, {})[resource] = capacity
        for node_id, device, mode in rows:
            holds = self._holds.setdefault(node_id, _Holds())
            if mode == "exclusive":
                holds.exclusive.add(device)
            else:
                holds.shared[device] = holds.shared.get(device, 0) + 1
        for node_id in targets:
            self._refresh(node_id)

    def any_room(self) -> bool:
        """Whether any online node with a running executor has a free job slot, a core and RAM
        left (or doesn't say): when none has, no waiting job can be placed."""
        for v in self._views:
            if not v.online or v.executor_down:
                continue
            if (
                (v.slots_free is None or v.slots_free > 0)
                and (v.cpu_free is None or v.cpu_free > 0)
                and (v.memory_free is None or v.memory_free > 0)
            ):
                return True
        return False

    def any_free_device(self) -> bool:
        """Whether any online node has a usable device no exclusive job holds."""
        for v in self._views:
            if not v.online or v.executor_down:
                continue
            for d in v.capabilities.accelerators:
                if d.execution_supported and d.index not in v.exclusive and d.index not in v.sick:
                    return True
        return False

    def stale(self, timeout_s: float) -> list[str]:
        """Online nodes not heard from for ``timeout_s``."""
        now = time.monotonic()
        return [
            v.node_id
            for v in self._views
            if v.online and now - self.last_seen.get(v.node_id, now) > timeout_s
        ]

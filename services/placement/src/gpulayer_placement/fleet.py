"""In-memory view of the fleet that the matcher reads: node capabilities, liveness, allocations.

PostgreSQL is the truth; this is a cache kept current by the capability and heartbeat
consumers, this replica's own placements and releases, and NOTIFYs from other replicas.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import msgspec

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_matching import NodeView


class _Holds:
    __slots__ = ("exclusive", "shared")

    def __init__(self) -> None:
        self.exclusive: set[int] = set()
        self.shared: dict[int, int] = {}


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


class Fleet:
    def __init__(self) -> None:
        self._views: list[NodeView] = []
        self._pos: dict[str, int] = {}
        self._holds: dict[str, _Holds] = {}
        self.last_seen: dict[str, float] = {}
        self.executor_seen: dict[str, float] = {}
        # Nodes whose last capabilities report was refused (kept: their last good one), why.
        self.report_errors: dict[str, str] = {}
        self._cursor = 0

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
        if view.exclusive != exclusive or view.shared != shared:
            self._set(msgspec.structs.replace(view, exclusive=exclusive, shared=shared))

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
        self._set(
            NodeView(
                node_id=caps.node_id,
                capabilities=caps,
                online=online,
                executor_down=old.executor_down if old is not None else False,
                exclusive=frozenset(holds.exclusive) if holds else frozenset(),
                shared=frozenset(holds.shared) if holds else frozenset(),
            )
        )
        return True

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

    def hold(self, node_id: str, devices: Iterable[int], mode: str) -> None:
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
        self, rows: Iterable[tuple[str, int, str]], nodes: Iterable[str] | None = None
    ) -> None:
        """Reset allocations from the database: for ``nodes`` only, or for the whole fleet."""
        targets = set(self._holds) | set(self._pos) if nodes is None else set(nodes)
        for node_id in targets:
            self._holds[node_id] = _Holds()
        for node_id, device, mode in rows:
            holds = self._holds.setdefault(node_id, _Holds())
            if mode == "exclusive":
                holds.exclusive.add(device)
            else:
                holds.shared[device] = holds.shared.get(device, 0) + 1
        for node_id in targets:
            self._refresh(node_id)

    def any_free_device(self) -> bool:
        """Whether any online node has a usable device no exclusive job holds."""
        for v in self._views:
            if not v.online or v.executor_down:
                continue
            for d in v.capabilities.accelerators:
                if d.execution_supported and d.index not in v.exclusive:
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

"""Step 2 of matching: given that the node could run the job, is it free to now, and which
devices does the job get? Host resources first (``host_miss``: the host rules), then devices
(``place``: the devices-in-use and shared GPU memory rules, sick devices kept out)."""

from __future__ import annotations

from collections.abc import Sequence

from gpulayer_matching.plan import Plan
from gpulayer_matching.registry import HOST_CHECKS
from gpulayer_matching.rules.busy_devices import busy_rule
from gpulayer_matching.rules.shared_gpu_memory import roomy
from gpulayer_matching.verdicts import COUNT, POOL, Cap, Fail, Miss
from gpulayer_matching.views import NodeView, Placement

__all__ = ["host_miss", "place"]


def host_miss(plan: Plan, view: NodeView) -> Fail | None:
    """The lowest-ranked host rule the node fails now: what it offers in all, whether it is up,
    what is free. None when all pass (or the node didn't say)."""
    miss = None
    for check in HOST_CHECKS:
        failed = check(plan, view)
        if failed is not None and (miss is None or failed.rank < miss.rank):
            miss = failed
    return miss


def place(plan: Plan, cap: Cap, view: NodeView) -> Placement | Miss:
    """The devices the job gets on this node now, or why not (with the nearest miss)."""
    ex = view.exclusive
    if view.sick:
        ex = ex | view.sick  # no new grant on a sick device, in any mode
    use = cap.use
    if cap.mode != COUNT:
        return _place_pool(plan, cap, view, ex) if cap.mode == POOL else _cpu(view)
    if use == "none":
        return Placement(node_id=view.node_id, accelerator=cap.pools[0][0], devices=[], use=use)
    # ``gpu_count`` devices of the first accelerator that has them free. (Inline, not a
    # function of its own: this is the hot loop's, once per node scanned.)
    sh = view.shared
    n = plan.n
    most = 0
    memory_miss: Miss | None = None
    free: Sequence[int]
    for acc, eligible, members in cap.pools:
        if use == "exclusive":
            if ex or sh:
                taken = members.difference(ex, sh)  # set arithmetic in C: busy nodes are cheap
                if len(taken) < n:
                    most = max(most, len(taken))
                    continue
                free = sorted(taken)
            else:
                free = eligible
            # Lowest free indices: predictable, and leaves the high end contiguous.
            return Placement(node_id=view.node_id, accelerator=acc, devices=list(free[:n]), use=use)
        free = sorted(members.difference(ex)) if ex else eligible
        if len(free) < n:
            most = max(most, len(free))
            continue
        fits = roomy(plan, cap, view, free, n)
        if isinstance(fits, Miss):
            memory_miss = fits
            continue
        free = fits
        if sh:
            # Pack shared jobs onto devices already shared, so that whole devices stay free
            # for exclusive jobs; lowest indices within each group.
            free = sorted(free, key=lambda i: i not in sh)
        return Placement(node_id=view.node_id, accelerator=acc, devices=sorted(free[:n]), use=use)
    if memory_miss is not None:
        return memory_miss
    return Miss(busy_rule(cap), most)


def _cpu(view: NodeView) -> Placement:
    return Placement(node_id=view.node_id, accelerator="cpu", devices=[], use="none")


def _place_pool(plan: Plan, cap: Cap, view: NodeView, ex: frozenset[int]) -> Placement | Miss:
    """The node's GPU pool: all of it (exclusive) or one device of it (shared)."""
    use = cap.use
    sh = view.shared
    if not cap.pools:
        # API alone, on a node with no GPU gpulayer tracks: nothing to hold or show.
        return Placement(node_id=view.node_id, accelerator="cpu", devices=[], use=use)
    acc, eligible, members = cap.pools[0]
    if use == "exclusive":
        if ex or sh:
            free_count = len(members.difference(ex, sh))
            if free_count < len(eligible):
                return Miss(busy_rule(cap), free_count)
        return Placement(node_id=view.node_id, accelerator=acc, devices=list(eligible), use=use)
    free = sorted(members.difference(ex)) if ex else eligible
    if not free:
        return Miss(busy_rule(cap), 0)
    fits = roomy(plan, cap, view, free, 1)
    if isinstance(fits, Miss):
        return fits
    return Placement(node_id=view.node_id, accelerator=acc, devices=list(fits), use=use)

"""The matcher: a pure function from a job and node states to a placement or the reasons why not.

No I/O. The placement service fetches node views, calls :func:`match`, persists and publishes.
The rules are written down in ``docs/placement-rules.md`` and implemented once each, in
``gpulayer_matching/rules/`` (one module per concern, with its check and its words), run in the
order ``registry.RULES`` lists them. :func:`match`, :func:`explain` and
:func:`would_fit_when_idle` all go through the same two steps, so a placement and its
explanation can never disagree:

1. ``capability``: does the node, idle and online, offer what the job needs? (Cached per
   capabilities object and job shape.)
2. ``place``: given that, is it free to now (host rules), and which devices does the job get?

Speed: a fleet keeps its ``WorkerCapabilities`` objects across calls (``fleet.Fleet`` does), so
everything derived from them (``facts``) and the verdict of each job shape (``plan``) is computed
once per node and shape; the hot loop is a dict lookup and a few set tests per node. Explanation
strings (``explain``) are only built when no node fits.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_contracts.jobs import JobRequest
from gpulayer_matching.capability import cached_capability, capability
from gpulayer_matching.explain import explain_plan
from gpulayer_matching.facts import FACTS, facts_of
from gpulayer_matching.place import host_miss, place
from gpulayer_matching.plan import compile_plan
from gpulayer_matching.registry import LIVE_RANK, OCCUPANCY_CHECKS
from gpulayer_matching.verdicts import CPU, Miss
from gpulayer_matching.views import Decision, NodeView, NoPlacement, Placement

__all__ = [
    "Decision",
    "NoPlacement",
    "NodeView",
    "Placement",
    "explain",
    "match",
    "would_fit_when_idle",
]


def match(job: JobRequest, nodes: Sequence[NodeView]) -> Decision:
    """First node, in the order given, that satisfies every requirement of ``job`` now.

    The caller orders (rotates) the nodes; the first that fits wins, so a fitting node near the
    front costs O(1). When none fits, the answer is :func:`explain`'s breakdown.
    """
    plan = compile_plan(job)
    if plan.failure is None:
        key = plan.key
        for view in nodes:
            # The liveness rule, first: an offline node's verdict isn't even looked up.
            if not view.online or view.executor_down:
                continue
            caps = view.capabilities
            facts = FACTS.get(id(caps))
            if facts is None or facts.caps is not caps:
                facts = facts_of(caps)
            cap = facts.results.get(key)
            if cap is None:
                cap = capability(plan, facts)
            if not cap.ok:
                continue
            # Devices and host resources must both pass, and neither check has side effects:
            # a job that holds devices asks for them first (most nodes a busy fleet scans fail
            # there); one that holds none, its host resources (placing it only builds the answer).
            placed = None if cap.mode == CPU else place(plan, cap, view)
            if isinstance(placed, Miss):
                continue
            for check in OCCUPANCY_CHECKS:  # host_miss less liveness, inline
                if check(plan, view) is not None:
                    break
            else:
                if placed is None:
                    placed = place(plan, cap, view)
                if isinstance(placed, Placement):
                    return placed
    return explain_plan(plan, nodes)


def explain(job: JobRequest, nodes: Sequence[NodeView]) -> NoPlacement:
    """The full per-rule breakdown over ``nodes``, also when some node could take the job now
    (then ``can_run_now`` > 0 and the summary starts with that count)."""
    return explain_plan(compile_plan(job), nodes)


def would_fit_when_idle(job: JobRequest, node: NodeView | WorkerCapabilities) -> bool:
    """True when the node, online and with every device free, satisfies every requirement.

    ``gpulayer check`` asks this of the local probe's capabilities; :class:`NoPlacement`'s
    ``unsatisfiable`` is this being false for every node.
    """
    plan = compile_plan(job)
    if plan.failure is not None:
        return False
    if isinstance(node, NodeView):
        view = node
    else:
        cores = node.host.cpu_cores
        view = NodeView(
            node_id=node.node_id,
            capabilities=node,
            cpu_total=None if cores is None else cores * 1000,
            memory_total=node.host.memory_bytes,
        )
    miss = host_miss(plan, view)
    if miss is not None and miss.rank < LIVE_RANK:
        return False  # short of cores or RAM in all; what is free now doesn't count
    return cached_capability(plan, view.capabilities).ok

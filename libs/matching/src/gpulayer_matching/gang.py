"""Gang matching (issue 14): a distributed job of ``distributed.nodes = N`` is placed on N
distinct nodes at once, each satisfying every requirement of the job on its own (devices,
memory, frameworks, the backend, the launcher), or not at all.

Rank 0 hosts the rendezvous, so when N > 1 it goes on a node that advertises an address other
nodes can reach (``host.advertise_address``). A loopback address (a probe that found no route
falls back to 127.0.0.1) reaches only nodes on the same host: such a gang is placed only on
nodes reporting one host name, where it can still meet. Pure, like the matcher: node views in, a
``GangPlacement`` (rank 0 first) or the reasons why not out. The per-node rules are the
matcher's own (``capability``, ``host_miss``, ``place``), so a gang's rank and a
single-node job are judged alike.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import msgspec

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_contracts.jobs import JobRequest
from gpulayer_matching.capability import capability
from gpulayer_matching.explain import explain_plan
from gpulayer_matching.facts import FACTS, facts_of
from gpulayer_matching.place import host_miss, place
from gpulayer_matching.plan import Plan, compile_plan
from gpulayer_matching.views import NodeView, NoPlacement, Placement

__all__ = [
    "GangPlacement",
    "advertise_address",
    "fitting_nodes",
    "is_gang",
    "is_loopback",
    "match_gang",
]

# A single-node gang's rank 0 needs no address other nodes reach: its ranks talk over loopback.
LOOPBACK = "127.0.0.1"


class GangPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Where each rank goes: ``ranks[r]`` is rank r's placement (distinct nodes);
    ``master_addr`` is rank 0's node's advertised address."""

    ranks: list[Placement]
    master_addr: str


def is_gang(job: JobRequest) -> bool:
    """Every job with ``distributed`` set is placed as a gang, even one node."""
    return job.distributed is not None


def advertise_address(caps: WorkerCapabilities) -> str | None:
    """The address a node's probe advertises for rendezvous (``host`` first)."""
    return caps.host.advertise_address or caps.advertise_address


def is_loopback(addr: str) -> bool:
    """True for an address only its own host reaches (127.0.0.0/8, ::1, localhost)."""
    if addr.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _fits(plan: Plan, view: NodeView) -> Placement | None:
    if not view.online or view.executor_down:
        return None
    caps = view.capabilities
    facts = FACTS.get(id(caps))
    if facts is None or facts.caps is not caps:
        facts = facts_of(caps)
    cap = facts.results.get(plan.key)
    if cap is None:
        cap = capability(plan, facts)
    if not cap.ok or host_miss(plan, view) is not None:
        return None
    placed = place(plan, cap, view)
    return placed if isinstance(placed, Placement) else None


def fitting_nodes(job: JobRequest, nodes: Sequence[NodeView]) -> list[Placement]:
    """Every node of ``nodes`` that could take one rank of ``job`` now, in order."""
    plan = compile_plan(job)
    if plan.failure is not None:
        return []
    return [p for view in nodes if (p := _fits(plan, view)) is not None]


def match_gang(job: JobRequest, nodes: Sequence[NodeView]) -> GangPlacement | NoPlacement:
    """N distinct nodes that each take one rank of ``job`` now, in the order given, rank 0 on
    the first that advertises an address (any for N = 1); else why not."""
    want = job.distributed.nodes if job.distributed is not None else 1
    plan = compile_plan(job)
    if plan.failure is not None:
        return explain_plan(plan, nodes)
    fits: list[tuple[Placement, str | None]] = []
    hosts: dict[str, list[int]] = {}  # host name -> indices in fits (loopback rendezvous)
    master: int | None = None
    for view in nodes:
        placed = _fits(plan, view)
        if placed is None:
            continue
        addr = advertise_address(view.capabilities)
        if master is None and addr and not is_loopback(addr):
            master = len(fits)
        if view.capabilities.host.hostname:
            hosts.setdefault(view.capabilities.host.hostname, []).append(len(fits))
        fits.append((placed, addr))
        if len(fits) >= want and (want == 1 or master is not None):
            break
    if want == 1 and fits:
        placed, addr = fits[0]
        return GangPlacement(ranks=[placed], master_addr=addr or LOOPBACK)
    if master is not None and len(fits) >= want:
        rank0, addr0 = fits[master]
        others = [p for i, (p, _) in enumerate(fits) if i != master][: want - 1]
        return GangPlacement(ranks=[rank0, *others], master_addr=addr0 or LOOPBACK)
    # No address other hosts reach: N nodes of one host can still meet over loopback.
    for members in hosts.values():
        if len(members) >= want:
            return GangPlacement(ranks=[fits[i][0] for i in members[:want]], master_addr=LOOPBACK)
    return explain_gang(job, nodes, found=len(fits), plan=plan)


def explain_gang(
    job: JobRequest,
    nodes: Sequence[NodeView],
    *,
    found: int | None = None,
    plan: Plan | None = None,
) -> NoPlacement:
    """Why the gang can't be placed now: ``needs 2 nodes with 1 free cuda device: 1 found``,
    then the per-node reasons of the matcher; ``unsatisfiable`` when fewer than N nodes could
    ever take a rank."""
    want = job.distributed.nodes if job.distributed is not None else 1
    plan = plan if plan is not None else compile_plan(job)
    single = explain_plan(plan, nodes)
    if plan.failure is not None:
        return single
    if found is None:
        found = single.can_run_now
    need = f"needs {want} node{'s' if want != 1 else ''} with {_what(plan)}: {found} found"
    reasons = [need, *single.reasons]
    if found >= want and want > 1:
        # Enough nodes fit, but none of them advertises an address for rank 0's rendezvous.
        why = (
            f"none of the {found} nodes that fit advertises an address other hosts reach for "
            "the rendezvous, and fewer than the gang share one host (rank 0 needs one: "
            "GPULAYER_ADVERTISE_ADDRESS on its probe; 127.0.0.1 serves one host only)"
        )
        reasons.insert(1, why)
        need = f"{need}; {why}"
    summary = need if not single.reasons else f"{need}; ruled out: {', '.join(single.reasons)}"
    return NoPlacement(
        summary=summary,
        reasons=reasons,
        unsatisfiable=single.could_run < want,
        total=single.total,
        can_run_now=min(found, want - 1) if found < want else 0,
        could_run=single.could_run,
        ruled_out=single.ruled_out,
    )


def _what(plan: Plan) -> str:
    """What each node must have free: ``1 free cuda device``, ``room for one rank``."""
    n = plan.n
    if n == 0:
        return "room for one rank"
    label = plan.acc if plan.acc is not None and plan.acc != "cpu" else "GPU"
    return f"{n} free {label} device{'s' if n != 1 else ''}"

"""Gang matching (issue 14): N distinct nodes, each fitting one rank, or nothing; rank 0 on a
node that advertises an address; explanations that count the nodes found."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulayer_contracts.capabilities import AcceleratorDevice, HostInfo, WorkerCapabilities
from gpulayer_contracts.jobs import Distributed, JobRequest, Requirements
from gpulayer_matching import NodeView, NoPlacement, Placement, match
from gpulayer_matching.gang import GangPlacement, explain_gang, match_gang


def gpu(i: int) -> AcceleratorDevice:
    return AcceleratorDevice(
        accelerator="cuda",
        index=i,
        vendor="NVIDIA",
        name="H100",
        memory_mib=81559,
        memory_kind="dedicated",
        compute_capability="9.0",
        execution_supported=True,
    )


def node(
    node_id: str,
    n: int = 1,
    *,
    addr: str | None = "10.0.0.1",
    busy: tuple[int, ...] = (),
    backends: tuple[str, ...] = ("gloo", "nccl"),
    online: bool = True,
    hostname: str | None = None,
) -> NodeView:
    caps = WorkerCapabilities(
        node_id=node_id,
        agent_version="0",
        detected_at=datetime(2026, 1, 1, tzinfo=UTC),
        host=HostInfo(platform="linux-x86_64", advertise_address=addr, hostname=hostname),
        accelerators=[gpu(i) for i in range(n)],
        distributed_backends=list(backends),
        launchers=["torchrun"],
    )
    return NodeView(node_id=node_id, capabilities=caps, exclusive=frozenset(busy), online=online)


def gang_job(nodes: int = 2, gpus: int = 1, **dist: Any) -> JobRequest:
    return JobRequest(
        job_id="g",
        command=["python", "train.py"],
        requirements=Requirements(accelerator="cuda", gpu_count=gpus),
        distributed=Distributed(nodes=nodes, backend="gloo", launcher="torchrun", **dist),
    )


def test_a_two_node_gang_goes_on_two_distinct_nodes_rank0_with_an_address() -> None:
    fleet = [node("a", addr=None), node("b", addr="10.0.0.2"), node("c", addr="10.0.0.3")]
    g = match_gang(gang_job(), fleet)
    assert isinstance(g, GangPlacement)
    assert [p.node_id for p in g.ranks] == ["b", "a"]  # rank 0 where an address is advertised
    assert g.master_addr == "10.0.0.2"
    assert all(p.devices == [0] for p in g.ranks)


def test_one_node_that_fits_is_no_partial_placement_and_says_how_many_were_found() -> None:
    fleet = [node("a"), node("b", busy=(0,))]
    d = match_gang(gang_job(), fleet)
    assert isinstance(d, NoPlacement)
    assert d.reasons[0] == "needs 2 nodes with 1 free cuda device: 1 found"
    assert d.summary.startswith("needs 2 nodes with 1 free cuda device: 1 found; ruled out: ")
    assert d.reasons[1] == "1 has too few free devices (need a cuda device, most free: b 0)"
    assert not d.unsatisfiable  # b could take a rank once its device is free


def test_too_few_nodes_in_the_fleet_is_unsatisfiable() -> None:
    d = match_gang(gang_job(nodes=3), [node("a"), node("b")])
    assert isinstance(d, NoPlacement)
    assert d.unsatisfiable
    assert d.reasons[0] == "needs 3 nodes with 1 free cuda device: 2 found"


def test_nodes_lacking_the_backend_are_ruled_out_per_node() -> None:
    d = match_gang(gang_job(), [node("a"), node("b", backends=("nccl",))])
    assert isinstance(d, NoPlacement)
    assert d.unsatisfiable
    assert "1 lacks the gloo distributed backend" in d.reasons


def test_no_node_with_an_address_for_rank0_places_nothing() -> None:
    d = match_gang(gang_job(), [node("a", addr=None), node("b", addr=None)])
    assert isinstance(d, NoPlacement)
    assert "advertises an address" in d.summary


def test_a_loopback_address_serves_only_ranks_on_its_own_host() -> None:
    """A probe without a route advertises 127.0.0.1: rank 0 there reaches no other host, so the
    gang goes on nodes of one host (two agents on one machine), never across hosts."""
    across = [
        node("a", addr="127.0.0.1", hostname="h1"),
        node("b", addr="127.0.0.1", hostname="h2"),
    ]
    d = match_gang(gang_job(), across)
    assert isinstance(d, NoPlacement)
    assert "127.0.0.1 serves one host only" in d.summary
    one_host = [*across, node("c", addr="127.0.0.1", hostname="h1")]
    g = match_gang(gang_job(), one_host)
    assert isinstance(g, GangPlacement)
    assert [p.node_id for p in g.ranks] == ["a", "c"]
    assert g.master_addr == "127.0.0.1"
    # A routable address wins over loopback ones, whichever comes first.
    g = match_gang(gang_job(), [*one_host, node("d", addr="10.0.0.4", hostname="h3")])
    assert isinstance(g, GangPlacement)
    assert g.ranks[0].node_id == "d"
    assert g.master_addr == "10.0.0.4"


def test_a_single_node_gang_uses_loopback_without_an_address() -> None:
    g = match_gang(gang_job(nodes=1, gpus=2), [node("a", 2, addr=None)])
    assert isinstance(g, GangPlacement)
    assert g.master_addr == "127.0.0.1"
    assert g.ranks[0].devices == [0, 1]


def test_offline_nodes_take_no_rank() -> None:
    d = match_gang(gang_job(), [node("a"), node("b", online=False)])
    assert isinstance(d, NoPlacement)
    assert d.reasons[0].endswith(": 1 found")


def test_explain_gang_counts_the_nodes_that_fit_now() -> None:
    d = explain_gang(gang_job(nodes=4), [node("a"), node("b"), node("c", busy=(0,))])
    assert d.reasons[0] == "needs 4 nodes with 1 free cuda device: 2 found"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fleet=st.lists(
        st.tuples(
            st.integers(0, 3),  # devices
            st.integers(0, 3),  # busy devices (lowest indices)
            st.booleans(),  # advertises an address
            st.booleans(),  # online
        ),
        min_size=0,
        max_size=8,
    ),
    nodes=st.integers(1, 4),
    gpus=st.integers(1, 3),
)
def test_gangs_are_placed_whole_or_not_at_all(
    fleet: list[tuple[int, int, bool, bool]], nodes: int, gpus: int
) -> None:
    views = [
        node(
            f"n{i}",
            n,
            busy=tuple(range(min(b, n))),
            addr=f"10.0.0.{i}" if a else None,
            online=on,
        )
        for i, (n, b, a, on) in enumerate(fleet)
    ]
    job = gang_job(nodes=nodes, gpus=gpus)
    single = JobRequest(
        job_id="s", command=["x"], requirements=Requirements(accelerator="cuda", gpu_count=gpus)
    )
    # The oracle: the nodes that take one such job on their own now.
    fit = [v for v in views if isinstance(match(single, [v]), Placement)]
    with_addr = [v for v in fit if v.capabilities.host.advertise_address]
    d = match_gang(job, views)
    if len(fit) >= nodes and (nodes == 1 or with_addr):
        assert isinstance(d, GangPlacement)
        assert len(d.ranks) == nodes
        assert len({p.node_id for p in d.ranks}) == nodes  # distinct nodes
        fit_ids = {v.node_id for v in fit}
        assert all(p.node_id in fit_ids and len(p.devices) == gpus for p in d.ranks)
        if nodes > 1:
            rank0 = next(v for v in views if v.node_id == d.ranks[0].node_id)
            assert d.master_addr == rank0.capabilities.host.advertise_address
    else:
        assert isinstance(d, NoPlacement)  # never a partial gang
        assert d.reasons[0].startswith(f"needs {nodes} node")

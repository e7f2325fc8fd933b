"""The API's node and job lists in pages (the fleet page reads fleets larger than one reply)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from tests.unit.placement.placement_fakes import FakeConn, FakePool

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_placement.api import Api
from gpulayer_placement.fleet import Fleet


def _api(conn: FakeConn) -> Api:
    return Api(nc=None, js=None, pool=FakePool(conn), fleet=Fleet(), publisher=None, forget=print)  # type: ignore[arg-type]


def _node_row(i: int) -> dict[str, object]:
    caps = WorkerCapabilities(node_id=f"n{i}", agent_version="0", detected_at=datetime.now(UTC))
    return {"node_id": f"n{i}", "online": True, "last_seen": None, "active_jobs": 0,
            "capabilities": msgspec.json.encode(caps).decode()}  # fmt: skip


async def test_nodes_in_pages() -> None:
    conn = FakeConn({"list_nodes": [_node_row(i) for i in range(2)]})
    api = _api(conn)
    assert [n["node_id"] for n in await api.nodes(b"")] == ["n0", "n1"]
    await api.nodes(b'{"offset": 2, "limit": 2}')
    # Worst values are clamped, never an error or the whole list by accident.
    await api.nodes(b'{"offset": -3, "limit": 0}')
    assert [args for name, args in conn.calls if name == "list_nodes"] == [
        (0, None), (2, 2), (0, 1)
    ]  # fmt: skip
    with pytest.raises(msgspec.ValidationError):
        await api.nodes(b'{"offset": "x"}')


async def test_jobs_pass_their_offset_to_the_query() -> None:
    conn = FakeConn()
    api = _api(conn)
    await api.jobs(b'{"limit": 50, "offset": 100}')
    await api.jobs(b'{"limit": 99999, "offset": -1}')
    await api.jobs(b"")
    assert [args for name, args in conn.calls if name == "list_jobs"] == [
        (None, 50, 100), (None, 10_000, 0), (None, 100, 0)
    ]  # fmt: skip

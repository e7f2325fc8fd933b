"""Placement keeps a node's container runtime (issue 28): stored with its capabilities in
PostgreSQL (the ``capabilities`` document: no column of its own to keep in step), and a report
out of bounds is refused whole, the node keeping its last good one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import asyncpg
import pytest
from nats.aio.client import Client
from tests.helpers import linux_node, running_placement

from gpulayer_contracts import WorkerCapabilities, encode
from gpulayer_contracts.bounds import MAX_CDI_DEVICES
from gpulayer_contracts.capabilities import ContainerRuntime
from gpulayer_contracts.subjects import node_capabilities
from gpulayer_placement.service import PlacementService

pytestmark = pytest.mark.integration

RUNTIME = ContainerRuntime(
    name="podman", version="4.3.1", oci_runtime="runc", works=True, cdi_devices=["nvidia.com/gpu=0"]
)


def caps(runtime: ContainerRuntime | None) -> WorkerCapabilities:
    return linux_node("ctr-node", container_runtime=runtime)


@pytest.fixture
async def placement(nc: Client, database_url: str) -> AsyncIterator[PlacementService]:
    async with running_placement(nc, database_url) as svc:
        yield svc


async def _stored(database_url: str) -> object:
    conn = await asyncpg.connect(database_url)
    try:
        raw = await conn.fetchval(
            "SELECT capabilities->'container_runtime' FROM nodes WHERE node_id = 'ctr-node'"
        )
    finally:
        await conn.close()
    return None if raw is None else json.loads(raw)


async def test_the_runtime_is_stored_and_a_report_out_of_bounds_is_refused(
    nc: Client, placement: PlacementService, database_url: str
) -> None:
    js = nc.jetstream()
    await js.publish(node_capabilities("ctr-node"), encode(caps(RUNTIME)))
    async with asyncio.timeout(10):
        # Stored in PostgreSQL: no event announces that, so look.
        while await _stored(database_url) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert await _stored(database_url) == {
        "name": "podman",
        "version": "4.3.1",
        "oci_runtime": "runc",
        "works": True,
        "notes": [],
        "cdi_devices": ["nvidia.com/gpu=0"],
        "machine_provider": None,  # a Mac's podman machine: none on Linux
    }
    view = placement.fleet.get("ctr-node")
    assert view is not None
    assert view.capabilities.container_runtime == RUNTIME

    # Thousands of CDI devices, a NUL in the version: refused, the last good report kept.
    too_many = ContainerRuntime(
        name="podman",
        version="4.3.1\x00",
        cdi_devices=[f"nvidia.com/gpu={i}" for i in range(MAX_CDI_DEVICES + 1)],
    )
    await js.publish(node_capabilities("ctr-node"), encode(caps(too_many)))
    async with asyncio.timeout(10):
        while "ctr-node" not in placement.fleet.report_errors:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    why = placement.fleet.report_errors["ctr-node"]
    assert "$.container_runtime.cdi_devices: 4097 entries, over the limit of 4096" in why
    assert "$.container_runtime.version: contains a NUL character" in why
    assert placement.fleet.get("ctr-node").capabilities.container_runtime == RUNTIME  # type: ignore[union-attr]
    assert (await _stored(database_url))["works"] is True  # type: ignore[index]

    # A node whose podman went away reports none; placement forgets the runtime.
    await js.publish(node_capabilities("ctr-node"), encode(caps(None)))
    async with asyncio.timeout(10):
        while await _stored(database_url) is not None:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

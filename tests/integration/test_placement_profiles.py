"""Runtime profiles through placement, against real NATS and PostgreSQL: a job by profile is
expanded at submit, placed only on nodes meeting it, explained naming the profile; conflicts and
unknown versions are rejected; ``api.profiles`` counts the fleet per profile."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pytest
from nats.aio.client import Client
from tests.helpers import PROFILES_FILE, running_placement
from tests.integration.test_placement_service import Events

from gpulayer_cli.client import api
from gpulayer_contracts import (
    AcceleratorDevice,
    HostInfo,
    Pending,
    WorkerCapabilities,
    __version__,
    encode,
)
from gpulayer_contracts.profiles import load_profiles
from gpulayer_contracts.subjects import (
    API_EXPLAIN,
    API_PROFILES,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    node_capabilities,
)
from gpulayer_placement.service import PlacementService, Settings

pytestmark = pytest.mark.integration

TORCH = "torch-2.5-cu124@1"


def caps(
    node_id: str, driver: str | None, *, platform: str = "linux-x86_64", torch: str = "2.5.1"
) -> WorkerCapabilities:
    """A node with one H100 on ``driver`` (none without), torch installed, Python 3.11."""
    return WorkerCapabilities(
        node_id=node_id,
        agent_version=__version__,
        detected_at=datetime.now(UTC),
        host=HostInfo(platform=platform, os=platform.split("-")[0], cpu_cores=8),
        accelerators=[]
        if driver is None
        else [
            AcceleratorDevice(
                accelerator="cuda",
                index=0,
                memory_mib=81559,
                memory_kind="dedicated",
                compute_capability="9.0",
                driver_version=driver,
                execution_supported=True,
            )
        ],
        workload_python_version="3.11.9",
        frameworks={"torch": torch},
        framework_capabilities=["torch.cuda"] if driver else [],
    )


@pytest.fixture
async def placement(nc: Client, database_url: str) -> AsyncIterator[PlacementService]:
    settings = Settings(node_timeout_s=30, resend_after_s=60, profiles=load_profiles(PROFILES_FILE))
    async with running_placement(nc, database_url, settings) as svc:
        yield svc


@pytest.fixture
async def events(nc: Client) -> Events:
    ev = Events()
    await nc.subscribe("gpulayer.job.*.*.events", cb=ev.cb)
    return ev


async def submit(nc: Client, job: dict[str, object]) -> None:
    body = json.dumps({"command": ["true"], **job}).encode()
    await nc.jetstream().publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: str(job["job_id"])})


async def test_a_job_by_profile_goes_only_to_nodes_meeting_it(
    nc: Client, placement: PlacementService, events: Events, database_url: str
) -> None:
    js = nc.jetstream()
    for node in (caps("old-driver", "535.129.03"), caps("mac", None, platform="darwin-arm64")):
        await js.publish(node_capabilities(node.node_id), encode(node))
    await submit(nc, {"job_id": "by-profile", "profile": TORCH})
    # The job may arrive before placement has both nodes (then it waits on "no nodes in the
    # fleet" first): wait for the pending event that weighs both.
    async with asyncio.timeout(10):
        while not any(
            isinstance(e, Pending) and len(e.reasons) == 2
            for e in events.by_job.get("by-profile", [])
        ):
            events.changed.clear()
            await events.changed.wait()
    accepted = events.by_job["by-profile"][0]
    assert accepted.profile == TORCH  # type: ignore[attr-defined]
    why = await api(nc, API_EXPLAIN, {"job_id": "by-profile"})
    assert why["unsatisfiable"] is True
    assert why["reasons"] == [
        f"1 has an operating system other than linux (seen: darwin) (profile {TORCH})",
        f"1 has NVIDIA driver not matching >=550 (seen: 535.129.03) (profile {TORCH})",
    ]
    # A node meeting the profile joins: the job goes there, and nowhere else.
    await js.publish(node_capabilities("new-driver"), encode(caps("new-driver", "550.54.15")))
    await events.wait_for("by-profile", "placed")
    placed = events.by_job["by-profile"][-1]
    assert (placed.node_id, placed.profile) == ("new-driver", TORCH)  # type: ignore[attr-defined]
    # The record holds the expanded job, naming the profile and what it supplied.
    conn = await asyncpg.connect(database_url)
    try:
        stored = json.loads(
            await conn.fetchval("SELECT request FROM jobs WHERE job_id = 'by-profile'")
        )
    finally:
        await conn.close()
    assert stored["profile"] == TORCH
    assert stored["requirements"]["driver"] == ">=550"
    assert "driver" in stored["profile_fields"]


async def test_conflicts_and_unknown_versions_are_rejected_at_submit(
    nc: Client, placement: PlacementService, events: Events
) -> None:
    await submit(nc, {"job_id": "clash", "profile": TORCH, "requirements": {"python": ">=3.13"}})
    await submit(nc, {"job_id": "no-such-version", "profile": "torch-2.5-cu124@7"})
    await events.wait_for("clash", "rejected")
    await events.wait_for("no-such-version", "rejected")
    clash = events.by_job["clash"][0]
    assert clash.profile == TORCH  # type: ignore[attr-defined]
    assert clash.reasons == [  # type: ignore[attr-defined]
        f"$.requirements.python: the job's '>=3.13' conflicts with profile {TORCH}'s '>=3.10,<3.13'"
    ]
    assert events.by_job["no-such-version"][0].reasons == [  # type: ignore[attr-defined]
        "$.profile: unknown version 'torch-2.5-cu124@7'; known versions: "
        "torch-2.5-cu124@1, torch-2.5-cu124@2"
    ]


async def test_api_profiles_counts_the_fleet_per_profile(
    nc: Client, placement: PlacementService
) -> None:
    js = nc.jetstream()
    fleet = [
        caps("new-1", "550.54.15"),
        caps("new-2", "560.35.03"),
        caps("old", "535.129.03"),
        caps("torch-24", "550.54.15", torch="2.4.1"),
        caps("mac", None, platform="darwin-arm64"),
    ]
    for node in fleet:
        await js.publish(node_capabilities(node.node_id), encode(node))
    async with asyncio.timeout(10):
        # Capabilities are absorbed by a consumer task: no event says so, the fleet does.
        while len(placement.fleet) < len(fleet):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    answer = {e["profile"]: e for e in await api(nc, API_PROFILES, {})}
    assert set(answer) == {"python-linux@1", TORCH, "torch-2.5-cu124@2"}
    torch = answer[TORCH]
    assert (torch["nodes"], torch["satisfy"]) == (5, 2)
    assert torch["ruled_out"] == {"os": 1, "driver": 1, "framework:torch": 1}
    assert f"1 has torch not matching ==2.5.* (seen: 2.4.1) (profile {TORCH})" in torch["reasons"]
    assert (answer["python-linux@1"]["satisfy"], answer["python-linux@1"]["ruled_out"]) == (
        4,
        {"os": 1},
    )

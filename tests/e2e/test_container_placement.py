"""A container job through the stack (issue 28): on a fleet where no node has a container runtime
it is ``pending (unsatisfiable)`` saying so; once a node whose probe found podman joins, it is
placed there. ``gpulayer nodes`` and ``explain`` show it. (Placement only: running the image is
the executor's part.) The joining node's probe finds the recorded podman of
tests/fixtures/podman/ (its self-test passing as it does on this machine), so the test runs
where podman is absent; tests/integration/test_container_selftest.py runs the real one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from tests.helpers import Services, gpulayer, service_env, until_node

from gpulayer_cli.common import me
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.e2e

PODMAN = Path(__file__).resolve().parents[1] / "fixtures" / "podman"


async def _until(env: dict[str, str], *args: str, what: str, ok: Any) -> str:
    """Run ``gpulayer *args`` until ``ok(stdout)``; its last output."""
    out = ""
    try:
        async with asyncio.timeout(30):
            while True:
                code, out, _ = await gpulayer(*args, env=env)
                if code == 0 and ok(out):
                    return out
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"{what}: gpulayer {' '.join(args)} said {out!r}") from None


@pytest.fixture
async def stack(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client
) -> AsyncIterator[tuple[Services, dict[str, str]]]:
    await ensure_streams(nc.jetstream())
    # Wide enough that no table cell wraps.
    env = service_env(nats_url, database_url, tmp_path / "work", "plain-node", COLUMNS="400")
    env["GPULAYER_PROBE_PODMAN"] = "none"  # this node's probe doesn't look: no runtime
    async with Services() as services:
        await services.start("gpulayer-placement", env, tmp_path / "placement.log")
        await services.start("gpulayer-probe", env, tmp_path / "plain-probe.log", key="plain")
        # No executor: the node is known, never "up".
        await until_node(nc, "plain-node", caller=me(), executor_up=False, timeout=30)
        yield services, env


async def test_a_container_job_waits_for_a_node_with_a_runtime_and_is_placed_there(
    stack: tuple[Services, dict[str, str]], tmp_path: Path
) -> None:
    services, env = stack
    job = {"job_id": "ctr-job", "command": ["true"], "container": {"image": "localhost/app:1"}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    code, out, err = await gpulayer("submit", str(tmp_path / "job.json"), env=env)
    assert code == 0, out + err

    shown = await _until(
        env,
        "job",
        "ctr-job",
        what="the job waits, unsatisfiable",
        ok=lambda out: "pending (unsatisfiable)" in out,
    )
    assert "0/1 nodes can run this job: 1 has no container runtime" in shown
    code, out, _ = await gpulayer("explain", "ctr-job", env=env)
    assert code == 0
    assert "1 has no container runtime" in out
    code, out, _ = await gpulayer("nodes", env=env)
    assert code == 0
    assert "containers" in out
    assert "none" in out

    # A node whose probe finds podman, and its self-test passing, joins.
    joined = dict(
        env,
        GPULAYER_NODE_ID="podman-node",
        GPULAYER_PROBE_PODMAN=str(PODMAN / "fake-podman"),
        GPULAYER_OCI_RUNTIME="runc",
        FAKE_PODMAN_DIR=str(PODMAN / "works"),
    )
    await services.start("gpulayer-probe", joined, tmp_path / "podman-probe.log", key="podman")
    record = await _until(
        env,
        "job",
        "ctr-job",
        "--json",
        what="the job is placed on podman-node",
        ok=lambda out: json.loads(out)["job"]["state"] != "pending",
    )
    placed = json.loads(record)["job"]
    assert (placed["state"], placed["node_id"]) in {
        ("placed", "podman-node"),
        ("running", "podman-node"),
    }
    nodes = {n["node_id"]: n for n in json.loads((await gpulayer("nodes", "--json", env=env))[1])}
    runtime = nodes["podman-node"]["capabilities"]["container_runtime"]
    assert (runtime["name"], runtime["version"], runtime["works"]) == ("fake-podman", "4.3.1", True)
    assert nodes["plain-node"]["capabilities"]["container_runtime"] is None
    code, out, _ = await gpulayer("nodes", env=env)
    assert "fake-podman 4.3.1/runc" in out

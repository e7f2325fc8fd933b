"""``gpulayer-probe`` as a process: configured by environment, publishes, stops on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import subscribed

from gpulayer_contracts.codec import capabilities_decoder, heartbeat_decoder
from gpulayer_contracts.subjects import node_capabilities, node_heartbeat
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.e2e

NVIDIA = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
SCRIPT = Path(sys.executable).parent / "gpulayer-probe"


async def test_console_script_publishes_and_stops_cleanly(
    nc: Client, nats_url: str, tmp_path: Path
) -> None:
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} not installed (uv sync)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(NVIDIA / "fake-nvidia-smi", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    node = "probe-e2e"
    caps_q: asyncio.Queue[Msg] = asyncio.Queue()
    beats_q: asyncio.Queue[Msg] = asyncio.Queue()
    # Placement declares the streams; the probe waits for them.
    await ensure_streams(nc.jetstream())
    await nc.subscribe(node_capabilities(node), cb=caps_q.put)
    await nc.subscribe(node_heartbeat(node), cb=beats_q.put)
    await subscribed(nc)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "FAKE_NVIDIA_SMI_DIR": str(NVIDIA / "a100-sxm4-80gb-mig"),
        "GPULAYER_NATS_URL": nats_url,
        "GPULAYER_NODE_ID": node,
        "GPULAYER_WORKLOAD_PYTHON": sys.executable,
        "GPULAYER_HEARTBEAT_S": "0.2",
        "GPULAYER_PROBE_REFRESH_S": "60",
        "GPULAYER_LOG_FORMAT": "json",
    }
    proc = await asyncio.create_subprocess_exec(
        str(SCRIPT), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        caps = capabilities_decoder.decode((await asyncio.wait_for(caps_q.get(), 30)).data)
        assert caps.node_id == node
        assert [(d.index, d.mig_mode, d.execution_supported) for d in caps.accelerators] == [
            (0, "Disabled", True),
            (1, "Enabled", False),
        ]
        assert caps.workload_python == sys.executable
        hb = heartbeat_decoder.decode((await asyncio.wait_for(beats_q.get(), 10)).data)
        assert hb.node_id == node
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 15)
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
    assert b'"msg": "stopped"' in out


async def test_bad_configuration_exits_2(tmp_path: Path) -> None:
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} not installed (uv sync)")
    env = {
        **os.environ,
        "GPULAYER_PROBE_REFRESH_S": "soon",
        "GPULAYER_NATS_URL": "nats://127.0.0.1:1",
    }
    proc = await asyncio.create_subprocess_exec(
        str(SCRIPT), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert b"GPULAYER_PROBE_REFRESH_S" in out

"""Hardware truth on a machine with an NVIDIA GPU. Skipped, with the reason, everywhere else.

Run there as one prepared script (see docs/hardware-validation.md):

    .venv/bin/pytest -m hardware tests/hardware -v -rs

The first test needs only the probe; the second runs a CUDA job through the whole stack and needs
the `gpulayer` CLI, a running stack, and torch with CUDA in GPULAYER_WORKLOAD_PYTHON.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gpulayer_detection.registry import detect_capabilities

pytestmark = pytest.mark.hardware

NVIDIA_SMI = shutil.which("nvidia-smi")
requires_nvidia = pytest.mark.skipif(
    NVIDIA_SMI is None, reason="no NVIDIA GPU here: nvidia-smi is not on PATH"
)


def smi_truth() -> list[dict[str, str]]:
    """What nvidia-smi itself says, asked independently of the probe's parser."""
    fields = ["index", "uuid", "name", "memory.total", "driver_version"]
    out = subprocess.run(
        [
            NVIDIA_SMI or "nvidia-smi",
            f"--query-gpu={','.join(fields)}",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [
        dict(zip(fields, (v.strip() for v in line.split(",")), strict=True))
        for line in out.splitlines()
        if line.strip()
    ]


@requires_nvidia
@pytest.mark.timeout(300)
def test_probe_agrees_with_nvidia_smi() -> None:
    truth = smi_truth()
    assert truth, "nvidia-smi listed no GPU"
    python = os.environ.get("GPULAYER_WORKLOAD_PYTHON", sys.executable)
    caps = asyncio.run(detect_capabilities("hw-node", python=python, torch_timeout=240))
    print(json.dumps({"truth": truth, "notes": caps.notes}, indent=2))
    cuda = [d for d in caps.accelerators if d.accelerator == "cuda"]
    assert [d.index for d in cuda] == [int(t["index"]) for t in truth]
    for d, t in zip(cuda, truth, strict=True):
        assert d.uuid == t["uuid"]
        assert d.name == t["name"]
        assert d.memory_mib == int(t["memory.total"])
        assert d.driver_version == t["driver_version"]
        assert d.compute_capability is not None  # any driver from R510 on reports it
        assert d.cuda_driver_version is not None
        if d.mig_mode != "Enabled":
            assert d.execution_supported
    assert "cuda" in caps.gpu_apis.host
    if "torch" in caps.frameworks:
        # torch in the workload interpreter must see the same GPUs the probe reported usable.
        probe = subprocess.run(
            [
                python,
                "-c",
                "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            check=True,
        ).stdout.split()
        assert probe[0] == "True"
        assert "torch.cuda" in caps.framework_capabilities
        if not any(d.mig_mode == "Enabled" for d in cuda):  # MIG instances count differently
            assert int(probe[1]) == len(cuda)


MARKED = re.compile(r"\b(?P<key>VISIBLE|COUNT|NAME|SUM) (?P<value>[^\n]*)$", re.M)
GPULAYER = shutil.which("gpulayer") or str(Path(sys.executable).parent / "gpulayer")


@requires_nvidia
@pytest.mark.skipif(
    not Path(GPULAYER).exists() or not os.environ.get("GPULAYER_NATS_URL"),
    reason="whole-stack part: needs the gpulayer CLI and a running stack (GPULAYER_NATS_URL)",
)
@pytest.mark.timeout(600)
def test_cuda_job_through_the_whole_stack(tmp_path: Path) -> None:
    """A job asking for one CUDA GPU runs, sees exactly the granted GPU, and agrees with
    nvidia-smi about which one it is."""
    python = os.environ.get("GPULAYER_WORKLOAD_PYTHON", sys.executable)
    job_id = f"hw-smoke-{uuid.uuid4().hex[:8]}"
    script = (
        "import os, torch; assert torch.cuda.is_available(); "
        "print('VISIBLE', os.environ.get('CUDA_VISIBLE_DEVICES')); "
        "print('COUNT', torch.cuda.device_count()); "
        "print('NAME', torch.cuda.get_device_name(0)); "
        "x = torch.ones(1024, device='cuda'); print('SUM', int(x.sum().item()))"
    )
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "job_id": job_id,
                "command": [python, "-c", script],
                "timeout_s": 300,
                "requirements": {"accelerator": "cuda", "gpu_count": 1},
                "sandbox": {"devices": {"gpu": "compute"}},
            }
        )
    )
    done = subprocess.run(
        [GPULAYER, "submit", str(job), "--wait"], capture_output=True, text=True, timeout=540
    )
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr
    logs = subprocess.run(
        [GPULAYER, "logs", job_id], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    # Tolerant of whatever prefix `gpulayer logs` puts before each output line.
    lines = {m["key"]: m["value"].strip() for m in MARKED.finditer(logs)}
    assert lines["COUNT"] == "1"
    assert lines["SUM"] == "1024"
    visible = lines["VISIBLE"]
    truth = {t["index"]: t for t in smi_truth()}
    assert visible in truth, f"granted {visible!r}, nvidia-smi knows {sorted(truth)}"
    assert lines["NAME"] == truth[visible]["name"]


def _torchrun_for(python: str) -> str | None:
    """torchrun where the executor looks for it: next to the workload interpreter, else PATH."""
    beside = Path(python).parent / "torchrun"
    return str(beside) if beside.exists() else shutil.which("torchrun")


@requires_nvidia
@pytest.mark.skipif(
    not Path(GPULAYER).exists() or not os.environ.get("GPULAYER_NATS_URL"),
    reason="whole-stack part: needs the gpulayer CLI and a running stack (GPULAYER_NATS_URL)",
)
@pytest.mark.timeout(600)
def test_nccl_rank_through_the_whole_stack(tmp_path: Path) -> None:
    """A one-node distributed CUDA job (torchrun, nccl, one process on one GPU) is placed as a
    gang, launched by torchrun with the rendezvous placement chose, and its NCCL all_reduce
    runs on the granted GPU. One rank only: a single GPU can't show NCCL between ranks."""
    python = os.environ.get("GPULAYER_WORKLOAD_PYTHON", sys.executable)
    if _torchrun_for(python) is None:
        pytest.skip(f"no torchrun next to {python} or on PATH")
    job_id = f"hw-nccl-{uuid.uuid4().hex[:8]}"
    script = (
        "import os, torch, torch.distributed as dist; "
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])); "
        "dist.init_process_group('nccl'); "
        "x = torch.tensor([float(dist.get_rank() + 41)], device='cuda'); dist.all_reduce(x); "
        "print('SUM', int(x.item())); print('COUNT', dist.get_world_size()); "
        "print('NAME', dist.get_backend()); "
        "print('VISIBLE', os.environ.get('CUDA_VISIBLE_DEVICES')); dist.destroy_process_group()"
    )
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {
                "job_id": job_id,
                "command": [python, "-c", script],
                "timeout_s": 300,
                "requirements": {"accelerator": "cuda", "gpu_count": 1},
                "sandbox": {"devices": {"gpu": "compute"}},
                "distributed": {
                    "nodes": 1,
                    "processes_per_node": 1,
                    "backend": "nccl",
                    "launcher": "torchrun",
                },
            }
        )
    )
    try:
        done = subprocess.run(
            [GPULAYER, "submit", str(job), "--wait"], capture_output=True, text=True, timeout=360
        )
    finally:
        why = subprocess.run([GPULAYER, "job", job_id], capture_output=True, text=True, timeout=60)
        print(why.stdout, why.stderr)
    print(done.stdout, done.stderr)
    assert done.returncode == 0, done.stderr
    logs = subprocess.run(
        [GPULAYER, "logs", f"{job_id}-rank0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    print(logs)
    lines = {m["key"]: m["value"].strip() for m in MARKED.finditer(logs)}
    assert lines["SUM"] == "41"
    assert lines["COUNT"] == "1"
    assert lines["NAME"] == "nccl"
    assert lines["VISIBLE"] in {t["index"] for t in smi_truth()}

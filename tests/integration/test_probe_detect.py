"""The probe end to end in this process: fake tools first on PATH, real interpreters."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from tests.workload import Workload

from gpulayer_detection.cli import main as probe_main
from gpulayer_detection.registry import detect_capabilities

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NVIDIA = FIXTURES / "nvidia-smi"


@pytest.fixture
def fake_nvidia(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Returns use(scenario): puts a fake nvidia-smi printing that recording first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(NVIDIA / "fake-nvidia-smi", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")

    def use(scenario: str) -> Path:
        folder = tmp_path / "recording"
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(NVIDIA / scenario, folder)
        monkeypatch.setenv("FAKE_NVIDIA_SMI_DIR", str(folder))
        return folder

    return use


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert probe_main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_this_machine(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULAYER_NODE_ID", "probe-test-node")
    out = run_cli(capsys, "--no-torch")
    assert out["node_id"] == "probe-test-node"
    host = out["host"]
    for fact in (
        "hostname",
        "os",
        "platform",
        "arch",
        "cpu_cores",
        "memory_bytes",
        "python_version",
    ):
        assert host[fact], fact
    assert out["workload_python"] == sys.executable
    assert out["workload_python_version"] == ".".join(map(str, sys.version_info[:3]))
    import msgspec

    assert out["frameworks"].get("msgspec") is None  # only the listed frameworks are reported
    if shutil.which("nvidia-smi") is None:
        assert out["accelerators"] == []
        assert any(n.startswith("nvidia: no NVIDIA devices") for n in out["notes"])
    if shutil.which("rocm-smi") is None:
        assert any(n.startswith("rocm: no ROCm devices") for n in out["notes"])
    if sys.platform != "darwin":
        assert any(n.startswith("apple: no Metal GPU") for n in out["notes"])
    assert msgspec  # imported above only to show it is installed yet unreported


def test_multi_gpu_recording(fake_nvidia, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake_nvidia("mixed-4090-3090-a6000")
    out = run_cli(capsys, "--no-torch", "--timeout", "5")
    devices = [
        (d["index"], d["name"], d["memory_mib"], d["compute_capability"], d["execution_supported"])
        for d in out["accelerators"]
    ]
    assert devices == [
        (0, "NVIDIA GeForce RTX 4090", 24564, "8.9", True),
        (1, "NVIDIA GeForce RTX 3090", 24576, "8.6", True),
        (2, "NVIDIA RTX A6000", 49140, "8.6", True),
    ]
    assert {d["driver_version"] for d in out["accelerators"]} == {"550.54.15"}
    assert {d["cuda_driver_version"] for d in out["accelerators"]} == {"12.4"}
    assert "cuda" in out["gpu_apis"]["host"]
    assert "nvidia-smi lists 3 GPU(s)" in out["gpu_apis"]["evidence"]["cuda"]
    assert not any(n.startswith("nvidia:") for n in out["notes"])


def test_gpu_apis_view(fake_nvidia, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake_nvidia("h100-dgx-8x")
    out = run_cli(capsys, "--gpu-apis")
    assert set(out) == {"host", "containers", "evidence", "platform", "agent_version"}
    assert "cuda" in out["host"]
    assert "8 GPU(s)" in out["evidence"]["cuda"]
    assert out["platform"].startswith(sys.platform.replace("win32", "windows"))


@pytest.mark.parametrize(
    ("scenario", "says"),
    [
        ("driver-failure", "couldn't communicate with the NVIDIA driver"),
        ("no-devices", "No devices were found"),
    ],
)
def test_driver_failure_recording(fake_nvidia, capsys, scenario: str, says: str) -> None:  # type: ignore[no-untyped-def]
    fake_nvidia(scenario)
    out = run_cli(capsys, "--no-torch")
    assert out["accelerators"] == []
    assert "cuda" not in out["gpu_apis"]["host"]
    notes = [n for n in out["notes"] if n.startswith("nvidia:")]
    assert len(notes) == 1
    assert says in notes[0]


async def test_hanging_nvidia_smi_is_cut_off(fake_nvidia) -> None:  # type: ignore[no-untyped-def]
    (fake_nvidia("rtx-4090") / "hang").write_text("")
    started = time.monotonic()
    caps = await detect_capabilities("n1", include_torch=False, timeout=1.0)
    assert (
        time.monotonic() - started < 60
    )  # cut off, not the 300 s hang (room for a loaded machine)
    assert caps.accelerators == []
    assert any("nvidia-smi timed out after 1s" in n for n in caps.notes)
    assert caps.host.cpu_cores  # the other sources still reported


async def test_hanging_workload_interpreter_is_cut_off(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 300\n")
    python.chmod(0o755)
    started = time.monotonic()
    caps = await detect_capabilities("n1", python=str(python), timeout=1.0, torch_timeout=1.0)
    assert (
        time.monotonic() - started < 60
    )  # cut off, not the 300 s hang (room for a loaded machine)
    assert caps.frameworks == {}
    assert any(
        n.startswith("frameworks: unknown") and "timed out after 1s" in n for n in caps.notes
    )
    assert caps.host.memory_bytes


async def test_missing_workload_interpreter(tmp_path: Path) -> None:
    caps = await detect_capabilities("n1", python=str(tmp_path / "nope"), include_torch=False)
    assert caps.frameworks == {}
    assert any("not executable" in n for n in caps.notes if n.startswith("frameworks:"))


# -- a real workload interpreter ---------------------------------------------------------------


@pytest.mark.timeout(900)
async def test_frameworks_of_a_real_venv(workload_venv: Workload) -> None:
    caps = await detect_capabilities("n1", python=workload_venv.python, include_torch=False)
    assert caps.workload_python == workload_venv.python
    assert caps.frameworks["numpy"] == workload_venv.numpy
    assert "jax" not in caps.frameworks
    assert "tensorflow" not in caps.frameworks
    if workload_venv.torch is not None:
        assert caps.frameworks["torch"].startswith(workload_venv.torch)
        assert any("capability query skipped" in n for n in caps.notes)


@pytest.mark.timeout(900)
async def test_torch_query_in_a_real_venv(workload_venv: Workload) -> None:
    if workload_venv.torch is None:
        pytest.skip(workload_venv.torch_skip)
    caps = await detect_capabilities("n1", python=workload_venv.python, torch_timeout=120)
    assert caps.frameworks["torch"].startswith("2.13.0")
    # The CPU wheel: torch is present, CUDA is not available, gloo is.
    assert "torch.cuda" not in caps.framework_capabilities
    assert "gloo" in caps.distributed_backends
    assert "nccl" not in caps.distributed_backends
    assert "torchrun" in caps.launchers  # found next to the venv's interpreter
    assert not any(n.startswith("torch:") and "unknown" in n for n in caps.notes)


async def test_versions_from_metadata_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The metadata script in a real interpreter, against a site folder put first on its path:
    dist-info names, variant distributions, egg-info and a duplicated install."""
    site = tmp_path / "site"

    def dist(folder: str, name: str, version: str, meta: str = "METADATA") -> None:
        (site / folder).mkdir(parents=True)
        (site / folder / meta).write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )

    dist("torch-2.3.1+cu121.dist-info", "torch", "2.3.1+cu121")
    dist("onnxruntime_gpu-1.18.0.dist-info", "onnxruntime-gpu", "1.18.0")
    dist("numpy-1.21.0-py3.9.egg-info", "numpy", "1.21.0", meta="PKG-INFO")
    dist("jax-0.4.1.dist-info", "jax", "0.4.1")
    dist("jax-0.4.30.dist-info", "jax", "0.4.30")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("raise SystemExit('torch must not be imported')\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    caps = await detect_capabilities("n1", include_torch=False)
    assert caps.frameworks["torch"] == "2.3.1+cu121"
    assert caps.frameworks["onnxruntime"] == "1.18.0"
    assert caps.frameworks["numpy"] == "1.21.0"  # from egg-info, through importlib.metadata
    assert caps.frameworks["jax"] in {"0.4.1", "0.4.30"}
    assert "onnxruntime is provided by the onnxruntime-gpu distribution" in " ".join(caps.notes)

"""The probe over WSL2 host roots (tests/wsl_roots.py) with its real runner: nvidia-smi found in
/usr/lib/wsl/lib, ``gpulayer probe`` and ``gpulayer check`` reading GPULAYER_PROBE_HOST_ROOT, and
``check`` of a DirectML job explaining its verdict on each kind of node."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from tests.wsl_roots import wsl_root

from gpulayer_cli.check import run_check
from gpulayer_detection.cli import main as probe_main
from gpulayer_detection.containers import ContainerSettings
from gpulayer_detection.registry import detect_capabilities
from gpulayer_detection.runner import resolve

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MATRIX = "only GPU APIs the support matrix doesn't schedule: directml detection-only"


def _root(tmp_path: Path, kind: str) -> Path:
    if kind == "no-dxg":
        return wsl_root(tmp_path / kind, "nvidia", dxg=False)
    if kind == "plain-linux":
        return wsl_root(tmp_path / kind, "none", dxg=False, wsl2=False)
    return wsl_root(tmp_path / kind, kind)  # type: ignore[arg-type]


async def test_cuda_is_read_from_the_wsl_library_by_the_real_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if resolve("nvidia-smi") is not None:
        pytest.skip("an nvidia-smi on PATH would be asked first")
    root = wsl_root(tmp_path, "nvidia")
    lib = root / "usr" / "lib" / "wsl" / "lib"
    (lib / "nvidia-smi").unlink()
    shutil.copy(FIXTURES / "nvidia-smi" / "fake-nvidia-smi", lib / "nvidia-smi")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_DIR", str(FIXTURES / "nvidia-smi" / "rtx-4090"))
    caps = await detect_capabilities(
        "wsl-01",
        include_frameworks=False,
        containers=ContainerSettings(podman=None),
        host_root=str(root),
        tool_dirs=[str(lib)],
    )
    assert caps.host.wsl2 is True
    assert [(d.accelerator, d.name, d.memory_mib) for d in caps.accelerators] == [
        ("cuda", "NVIDIA GeForce RTX 4090", 24564)
    ]
    assert {"cuda", "directml"} <= set(caps.gpu_apis.host)
    assert {"cuda", "directml"} <= set(caps.gpu_apis.containers)
    assert "nv_dispi.inf_amd64_" in caps.gpu_apis.evidence["directml"]


def test_gpulayer_probe_reads_the_host_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPULAYER_PROBE_HOST_ROOT", str(wsl_root(tmp_path, "amd")))
    assert probe_main(["--gpu-apis"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert "directml" in shown["host"]
    assert "(AMD: amdxc64.so)" in shown["evidence"]["directml"]
    monkeypatch.setenv("GPULAYER_PROBE_HOST_ROOT", "not/absolute")
    assert probe_main(["--gpu-apis"]) == 2
    assert "GPULAYER_PROBE_HOST_ROOT='not/absolute'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kind", "in_container", "reason"),
    [
        ("nvidia", False, f"1 has {MATRIX} on the host"),
        ("amd", False, f"1 has {MATRIX} on the host"),
        ("nvidia", True, f"1 has {MATRIX} in containers"),
        ("none", False, "1 has none of the GPU APIs directml on the host"),
        ("no-dxg", False, "1 has none of the GPU APIs directml on the host"),
        ("plain-linux", False, "1 has none of the GPU APIs directml on the host"),
    ],
)
def test_check_explains_a_directml_job_on_each_kind_of_node(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    in_container: bool,
    reason: str,
) -> None:
    monkeypatch.setenv("GPULAYER_PROBE_HOST_ROOT", str(_root(tmp_path, kind)))
    monkeypatch.setenv("GPULAYER_NODE_ID", f"node-{kind}")
    job = tmp_path / "dml.json"
    gpu = {"use": "shared", "apis_any": ["directml"], "in_container": in_container}
    job.write_text(json.dumps({"job_id": "dml", "command": ["python", "run.py"], "gpu": gpu}))
    out = io.StringIO()
    assert run_check(str(job), python=None, as_json=False, console=Console(file=out)) == 1
    assert reason in " ".join(out.getvalue().split())
    capsys.readouterr()
    assert run_check(str(job), python=None, as_json=True, console=Console(file=out)) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["fits"] is False
    assert shown["reasons"] == [reason]


def test_check_refuses_a_bad_host_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULAYER_PROBE_HOST_ROOT", str(tmp_path / "missing"))
    job = tmp_path / "dml.json"
    job.write_text(json.dumps({"job_id": "dml", "command": ["true"]}))
    out = io.StringIO()
    assert run_check(str(job), python=None, as_json=False, console=Console(file=out)) == 2
    assert "GPULAYER_PROBE_HOST_ROOT=" in out.getvalue()

"""Framework reports from the workload interpreter, parsed without running it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpulayer_detection.frameworks import (
    MARKER,
    ReportError,
    TorchFacts,
    find_launchers,
    parse_metadata_report,
    parse_torch_report,
    torch_finding,
)


def report(data: object, noise: str = "") -> str:
    return f"{noise}\n{MARKER}{json.dumps(data)}\n"


def test_metadata_report_keeps_versions_and_distributions() -> None:
    r = parse_metadata_report(
        report(
            {
                "python_version": "3.10.14",
                "frameworks": {
                    "torch": {"version": "2.3.1", "dist": "torch"},
                    "onnxruntime": {"version": "1.18.0", "dist": "onnxruntime-gpu"},
                },
                "errors": ["jax: OSError: bad METADATA"],
            },
            noise="sitecustomize says hello",
        )
    )
    assert r.python_version == "3.10.14"
    assert r.frameworks == {"torch": "2.3.1", "onnxruntime": "1.18.0"}
    assert r.distributions["onnxruntime"] == "onnxruntime-gpu"
    assert r.errors == ["jax: OSError: bad METADATA"]


@pytest.mark.parametrize(
    "stdout", ["", "Traceback (most recent call last):\n", f"{MARKER}{{not json"]
)
def test_metadata_report_missing_or_broken(stdout: str) -> None:
    with pytest.raises(ReportError):
        parse_metadata_report(stdout)


def test_torch_cpu_build_has_gloo_and_no_accelerator() -> None:
    facts = parse_torch_report(
        report(
            {
                "version": "2.13.0+cpu",
                "cuda_build": None,
                "cuda": False,
                "cuda_device_count": 0,
                "mps": False,
                "distributed": {"gloo": True, "nccl": False, "mpi": False},
            }
        )
    )
    found = torch_finding(facts)
    assert found.framework_capabilities == []
    assert found.distributed_backends == ["gloo"]
    assert found.notes == []


def test_torch_cuda_build_without_driver_says_so() -> None:
    found = torch_finding(
        TorchFacts(
            version="2.3.1+cu121",
            cuda=False,
            cuda_build="12.1",
            mps=False,
            backends={"gloo": True, "nccl": True},
        )
    )
    assert found.framework_capabilities == []
    assert found.distributed_backends == ["gloo", "nccl"]
    assert any("built for CUDA 12.1" in n for n in found.notes)


def test_torch_cuda_and_mps_capabilities() -> None:
    found = torch_finding(TorchFacts(cuda=True, mps=True, backends={"gloo": True}))
    assert found.framework_capabilities == ["torch.cuda", "torch.mps"]


def test_torch_import_failure_and_unknowns() -> None:
    broken = torch_finding(TorchFacts(import_error="ImportError: libcudnn.so.9: not found"))
    assert broken.framework_capabilities == []
    assert "libcudnn" in broken.notes[0]
    unknown = torch_finding(TorchFacts(errors=["cuda: RuntimeError: boom"]))
    assert any("torch.cuda availability unknown" in n for n in unknown.notes)
    assert any("distributed backends unknown" in n for n in unknown.notes)


def test_launchers_on_path_and_next_to_interpreter(tmp_path: Path) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    other = tmp_path / "other"
    for d in (venv_bin, other):
        d.mkdir(parents=True)
    for exe in (venv_bin / "python", venv_bin / "torchrun", other / "mpirun", other / "deepspeed"):
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    (other / "accelerate").write_text("not executable")
    found = find_launchers(str(venv_bin / "python"), str(other))
    assert found == ["torchrun", "mpirun", "deepspeed"]
    assert find_launchers(None, str(other)) == ["mpirun", "deepspeed"]
    assert find_launchers(str(venv_bin / "python"), os.devnull) == ["torchrun"]

"""WSL2 nodes and DirectML in the matcher: shown like any other API, and held back by the support
matrix (directml is detection-only) with a reason of their own, node by node."""

from __future__ import annotations

import msgspec
import pytest
from tests.unit.test_matcher import gpu, job, node, placed, refused

from gpulayer_contracts import matrix
from gpulayer_contracts.capabilities import GpuApis, HostInfo
from gpulayer_contracts.jobs import GpuUsage, JobRequest
from gpulayer_matching import NodeView, Placement, explain, match

MATRIX = "only GPU APIs the support matrix doesn't schedule: directml detection-only"


def wsl_nvidia() -> NodeView:
    """A WSL2 machine with an NVIDIA GPU: cuda from nvidia-smi, directml from /dev/dxg."""
    both = ["cuda", "directml"]
    return node("wsl-nv", [gpu(0)], gpu_apis=GpuApis(host=both, containers=both))


def wsl_amd() -> NodeView:
    """A WSL2 machine with an AMD GPU: no device gpulayer tracks, directml alone."""
    return node("wsl-amd", gpu_apis=GpuApis(host=["directml"], containers=["directml"]))


def linux_vulkan() -> NodeView:
    return node("igpu", gpu_apis=GpuApis(host=["vulkan"]))


def dml(*apis: str, in_container: bool = False) -> JobRequest:
    section = GpuUsage(use="shared", apis_any=list(apis or ["directml"]), in_container=in_container)
    return job(gpu_section=section)


def test_a_directml_job_is_explained_node_by_node() -> None:
    fleet = [wsl_nvidia(), wsl_amd(), linux_vulkan()]
    d = refused(match(dml(), fleet))
    assert d.unsatisfiable  # no level of the matrix changes while the job waits
    assert d.ruled_out == {"apis_matrix": 2, "apis": 1}
    why = explain(dml(), fleet)
    assert why.reasons == [
        "1 has none of the GPU APIs directml on the host",
        f"2 have {MATRIX} on the host",
    ]
    inside = refused(match(dml(in_container=True), [wsl_amd()]))
    assert inside.reasons == [f"1 has {MATRIX} in containers"]


def test_another_api_the_job_accepts_places_it() -> None:
    p = placed(match(dml("directml", "cuda"), [wsl_amd(), wsl_nvidia()]))
    assert (p.node_id, p.accelerator, p.devices) == ("wsl-nv", "cuda", [0])
    p = placed(match(dml("directml", "vulkan"), [wsl_amd(), linux_vulkan()]))
    assert p.node_id == "igpu"


def test_a_wsl2_node_is_a_linux_node() -> None:
    wsl = wsl_nvidia()
    caps = wsl.capabilities
    host = HostInfo(platform="linux-x86_64", wsl2=True)
    flagged = NodeView(node_id="wsl-nv", capabilities=msgspec.structs.replace(caps, host=host))
    assert placed(match(job(os="linux", gpu_count=1), [flagged])).node_id == "wsl-nv"


def test_once_the_matrix_schedules_directml_the_amd_node_takes_it_by_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(matrix.API_SUPPORT, "directml", "implemented")
    p = placed(match(dml(), [wsl_amd()]))
    assert p == Placement(node_id="wsl-amd", accelerator="cpu", devices=[], use="shared")

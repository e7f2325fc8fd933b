"""Each rule's words, whole: the reason ``explain`` gives for the one node of its example (the
same words the matcher gave before the rules had modules of their own; the golden file holds
them for the whole test corpus)."""

from __future__ import annotations

import pytest
from tests.unit.matching.rule_cases import EXAMPLES

from gpulayer_matching import explain

WORDS = [
    ("apis", "1 has none of the GPU APIs vulkan on the host"),
    (
        "apis_matrix",
        "1 has only GPU APIs the support matrix doesn't schedule: directml detection-only on the host",
    ),
    ("backend", "1 lacks the nccl distributed backend"),
    ("busy_cores", "1 has 0.5/8 free cores (need 2)"),
    ("busy_exclusive", "1 has too few free devices (need a GPU device, most free: n1 0)"),
    ("busy_gpu_memory", "1 has 43.6 GB free on its best shared GPU (need 70)"),
    ("busy_memory", "1 has 1/8 GB free RAM (need 2)"),
    ("busy_pool", "1 has GPUs in use (exclusive use holds the node's whole GPU pool)"),
    ("busy_pool_shared", "1 has every GPU held exclusively"),
    ("busy_shared", "1 has too few devices not held exclusively (need a GPU device, most: n1 0)"),
    ("cc", "1 has compute capability < 10.0 (best: n1 9.0)"),
    ("cc_unknown", "1 has unknown compute capability"),
    (
        "container_runtime_failed",
        "1 has a container runtime that failed its self-test: self-test failed (podman run "
        "--rootfs with a static busybox) ... ng container init: error setting rlimits for ready "
        "process: error setting rlimit type 7: operation not permitted: OCI permission denied",
    ),
    ("cores", "1 has < 2 cores for jobs (best: n1 1)"),
    ("count", "1 has < 2 usable GPU devices (best: n1 1)"),
    ("driver", "1 has NVIDIA driver not matching >=560 (seen: 550.54.15)"),
    ("driver_unknown", "1 has unknown NVIDIA driver version"),
    ("executor_down", "1 has no running executor (its heartbeats stopped)"),
    ("framework", "1 has torch not matching >=2 (seen: 1.13)"),
    ("framework_capability", "1 lacks torch.cuda"),
    ("framework_unknown", "1 has unknown torch version (not reported)"),
    ("host_memory", "1 has < 2 GB of RAM for jobs (best: n1 1 GB)"),
    ("launcher", "1 lacks the torchrun launcher"),
    ("matrix", "1 can't take distributed cpu work (support matrix)"),
    ("memory", "1 has < 100 GB per GPU (best: n1 85.5 GB (81559 MiB))"),
    ("memory_kind", "1 has no unified-memory GPU device"),
    ("memory_kind_unknown", "1 has unknown GPU memory kind"),
    ("memory_unknown", "1 has unknown GPU memory"),
    (
        "mig",
        "1 has only MIG instances (seen: 1g.10gb), which a job gets only with gpu_count = 1 and gpu_memory_gb set",
    ),
    ("no_device", "1 has no GPU device (cuda or mps)"),
    ("no_slot", "1 has no free job slot"),
    ("no_container_runtime", "1 has no container runtime"),
    ("not_usable", "1 has GPU devices that can't run work (execution not supported)"),
    ("offline", "1 is offline"),
    ("os", "1 has an operating system other than linux (seen: darwin)"),
    ("os_unknown", "1 has unknown operating system"),
    ("python", "1 has Python not matching >=3.13 (seen: 3.11.9)"),
    ("python_unknown", "1 has unknown Python version"),
    (
        "unhealthy",
        "1 has GPUs kept from new grants by their health (unhealthy or degraded) (seen: n1 GPU 0: XID 79)",
    ),
]


def test_every_example_has_its_words() -> None:
    assert {name for name, _ in WORDS} == set(EXAMPLES)


@pytest.mark.parametrize(("name", "reason"), WORDS)
def test_words(name: str, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job, view = EXAMPLES[name](monkeypatch)
    assert explain(job, [view]).reasons == [reason]

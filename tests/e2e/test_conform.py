"""``gpulayer conform`` on this machine, its node class simulated with recorded-tool fakes
(nvidia-smi, vulkaninfo and clinfo first on PATH): a CPU workload passes against its golden, a
CUDA one is skipped with the reason, changed output is a mismatch with a diff, and the golden
is picked per node class by the host's GPU APIs."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from tests.helpers import PROFILES_FILE, gpulayer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
CONFORM = ROOT / "examples" / "conform"
CPU = str(CONFORM / "cpu-primes.toml")
RUNNER = str(CONFORM / "gpu-runner.toml")


async def conform(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    return await gpulayer("conform", *args, "--python", sys.executable, env=env, timeout=120)


def host(tmp_path: Path, *, nvidia: str, vulkan: str = "llvmpipe-only") -> dict[str, str]:
    """This machine as a node of one class: nvidia-smi, vulkaninfo and clinfo replaced by
    recordings (``nvidia``: a tests/fixtures/nvidia-smi scenario; ``vulkan``: a vulkaninfo one;
    clinfo finds no platform), so that the host's real tools don't decide its class."""
    tools = tmp_path / f"bin-{nvidia}-{vulkan}"
    tools.mkdir()
    shutil.copy(FIXTURES / "nvidia-smi" / "fake-nvidia-smi", tools / "nvidia-smi")
    for name, recording in (
        ("vulkaninfo", FIXTURES / "vulkaninfo" / f"{vulkan}.txt"),
        ("clinfo", FIXTURES / "clinfo" / "no-platforms.txt"),
    ):
        (tools / name).write_text(f"#!/bin/sh\ncat '{recording}'\n")
    for tool in tools.iterdir():
        tool.chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
        FAKE_NVIDIA_SMI_DIR=str(FIXTURES / "nvidia-smi" / nvidia),
        GPULAYER_PROFILES=str(PROFILES_FILE),
    )


async def test_cpu_example_passes_against_its_golden(tmp_path: Path) -> None:
    code, out, err = await conform(CPU, "--json", env=host(tmp_path, nvidia="no-devices"))
    assert code == 0, out + err
    answer = json.loads(out)
    assert answer["result"] == "passed"
    assert answer["node_class"] == "host-none_containers-none"
    assert answer["golden"] == str(CONFORM / "cpu-primes.golden" / "default.txt")


async def test_cuda_example_is_skipped_with_the_reason(tmp_path: Path) -> None:
    env = host(tmp_path, nvidia="no-devices")
    code, out, err = await conform(str(ROOT / "examples" / "cuda-a100-class.toml"), env=env)
    assert code == 0, out + err
    assert out.strip() == "skipped: 0/1 nodes can run this job: 1 has no cuda device"
    # A GPU that doesn't meet the job is a skip too, with the rule that failed.
    env = host(tmp_path, nvidia="t4-2x")
    code, out, _ = await conform(str(ROOT / "examples" / "cuda-a100-class.toml"), env=env)
    assert code == 0
    assert out.startswith("skipped: 0/1 nodes can run this job: 1 has < 40 GB per GPU"), out


async def test_changed_output_is_a_mismatch_with_a_diff(tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    shutil.copytree(CONFORM / "cpu-primes.golden", golden)
    text = (golden / "default.txt").read_text()
    (golden / "default.txt").write_text(text.replace("53, 59]", "53, 57]"))
    env = host(tmp_path, nvidia="no-devices")
    code, out, _ = await conform(CPU, "--golden", str(golden), env=env)
    assert code == 1, out
    assert "mismatch" in out
    assert (
        "-primes below 60: [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 57]" in out
    )
    assert (
        "+primes below 60: [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]" in out
    )
    code, out, _ = await conform(CPU, "--golden", str(golden), "--json", env=env)
    assert code == 1
    assert json.loads(out)["result"] == "mismatch"
    assert "+primes below 60" in json.loads(out)["diff"]


async def test_the_golden_is_picked_by_the_hosts_gpu_apis(tmp_path: Path) -> None:
    golden = CONFORM / "gpu-runner.golden"
    cuda = host(tmp_path, nvidia="rtx-4090")
    code, out, err = await conform(RUNNER, "--json", env=cuda)
    assert code == 0, out + err
    answer = json.loads(out)
    assert (answer["result"], answer["node_class"]) == ("passed", "host-cuda_containers-none")
    assert answer["golden"] == str(golden / "host-cuda_containers-none.txt")
    vulkan = host(tmp_path, nvidia="no-devices", vulkan="nvidia-and-llvmpipe")
    code, out, err = await conform(RUNNER, "--json", env=vulkan)
    assert code == 0, out + err
    answer = json.loads(out)
    assert (answer["result"], answer["node_class"]) == ("passed", "host-vulkan_containers-none")
    assert answer["golden"] == str(golden / "host-vulkan_containers-none.txt")
    # The two classes' outputs differ: the other class's golden would not pass.
    only_cuda = tmp_path / "only-cuda"
    only_cuda.mkdir()
    shutil.copy(golden / "host-cuda_containers-none.txt", only_cuda / "default.txt")
    code, out, _ = await conform(RUNNER, "--golden", str(only_cuda), env=vulkan)
    assert code == 1
    assert "+tracked GPU granted: no (API only)" in out
    # Both together (cuda and vulkan): no golden of its own, so the default one.
    both = host(tmp_path, nvidia="rtx-4090", vulkan="nvidia-and-llvmpipe")
    code, out, _ = await conform(RUNNER, "--json", env=both)
    answer = json.loads(out)
    assert (answer["node_class"], answer["golden"]) == (
        "host-cuda+vulkan_containers-none",
        str(golden / "default.txt"),
    )
    assert code == 0
    # None of the APIs: skipped with the reason.
    code, out, _ = await conform(RUNNER, env=host(tmp_path, nvidia="no-devices"))
    assert code == 0
    assert out.strip() == (
        "skipped: 0/1 nodes can run this job: 1 has none of the GPU APIs cuda / vulkan / metal "
        "on the host"
    )


async def test_update_writes_this_class_golden_and_failures_exit_1(tmp_path: Path) -> None:
    env = host(tmp_path, nvidia="rtx-4090")
    folder = tmp_path / "new-golden"
    code, out, _ = await conform(RUNNER, "--golden", str(folder), env=env)
    assert code == 2  # nothing to compare with
    code, out, _ = await conform(RUNNER, "--golden", str(folder), "--update", env=env)
    assert code == 0, out
    written = folder / "host-cuda_containers-none.txt"
    assert (
        written.read_text()
        == "tracked GPU granted: yes\nCUDA_VISIBLE_DEVICES matches the grant: True\n"
    )
    code, out, _ = await conform(RUNNER, "--golden", str(folder), env=env)
    assert code == 0, out
    assert out.startswith("passed"), out
    failing = tmp_path / "failing.json"
    failing.write_text(
        json.dumps({"job_id": "f", "command": ["sh", "-c", "echo oops >&2; exit 3"]})
    )
    code, out, _ = await conform(str(failing), "--golden", str(folder), "--update", env=env)
    assert code == 1
    assert "failed: exited with 3" in out
    assert "oops" in out
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"job_id": "s", "command": ["sleep", "30"], "timeout_s": 0.5}))
    code, out, _ = await conform(str(slow), "--golden", str(folder), "--update", env=env)
    assert code == 1
    assert "failed: timed out after 0.5 s" in out


async def test_invalid_input_exits_2(tmp_path: Path) -> None:
    env = host(tmp_path, nvidia="no-devices")
    bad = tmp_path / "bad.json"
    bad.write_text('{"job_id": "b", "command": ["true"], "requirements": {"accelerator": "tpu"}}')
    code, _, err = await conform(str(bad), env=env)
    assert code == 2
    assert "$.requirements.accelerator" in err
    clash = tmp_path / "clash.json"
    clash.write_text(
        json.dumps(
            {
                "job_id": "c",
                "command": ["true"],
                "profile": "python-linux@1",
                "requirements": {"os": "darwin"},
            }
        )
    )
    code, _, err = await conform(str(clash), env=env)
    assert code == 2
    assert "conflicts with profile python-linux@1's 'linux'" in err
    code, _out, err = await conform(str(ROOT / "examples" / "cpu-profile.toml"), env=env)
    assert code == 2  # expanded and qualifies, but the example has no golden
    assert "no golden for node class host-none_containers-none" in err

"""A job's limits from its grant, the cgroup files they go to, and what the kernel's counters
say afterwards. Pure (one test makes device nodes, as root)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec
import pytest
from tests.unit.executor.fakes import grant

from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobs import Requirements, Sandbox, SandboxDevices
from gpulayer_executor import cgroups
from gpulayer_executor.cgroups import _own_paths, v1_enforcement, v2_enforcement
from gpulayer_executor.limits import (
    MAX_PIDS,
    DeviceNode,
    JobLimits,
    NvidiaNodes,
    allowed_nvidia,
    counter,
    cpu_quota_us,
    device_writes,
    job_limits,
    memory_bytes,
    oom_reason,
    resource_writes,
    scan_nvidia,
)

CHR = stat.S_IFCHR | 0o666
NODES = (DeviceNode(0, 195, 0), DeviceNode(1, 195, 1), DeviceNode(2, 195, 2))


def gpu_grant(
    devices: list[int],
    *,
    accelerator: str = "cuda",
    compute: bool = True,
    requirements: Requirements | None = None,
) -> Grant:
    g = grant("g1")
    job = msgspec.structs.replace(
        g.job,
        sandbox=Sandbox(devices=SandboxDevices(gpu="compute")) if compute else Sandbox(),
        requirements=requirements or Requirements(),
    )
    return msgspec.structs.replace(g, job=job, accelerator=accelerator, devices=devices)


def test_memory_is_bytes_of_10_to_the_9_rounded_up_exactly() -> None:
    # 0.2 * 1e9 is 200000000.00000003 in floats: no spurious extra byte.
    assert memory_bytes(0.2) == 200_000_000
    assert memory_bytes(1.0) == 10**9
    assert memory_bytes(1.5e-9) == 2
    assert memory_bytes(1e-12) == 1
    assert memory_bytes(1e9) == 10**18  # the contracts' upper bound
    assert [memory_bytes(v) for v in (0.0, -1.0, float("nan"), float("inf"))] == [None] * 4


def test_cpu_cores_are_a_quota_of_a_100_ms_period() -> None:
    assert cpu_quota_us(2) == 200_000
    assert cpu_quota_us(0.3) == 30_000  # not 30001
    assert cpu_quota_us(0.001) == 1_000  # the kernel's smallest quota
    assert cpu_quota_us(65536) == 6_553_600_000
    assert [cpu_quota_us(v) for v in (0.0, -2.0, float("nan"), float("inf"))] == [None] * 4


def test_only_granted_cuda_devices_with_the_sandbox_grant_may_be_opened() -> None:
    assert allowed_nvidia(gpu_grant([1, 3])) == {1, 3}
    # As the visibility variables: without the sandbox grant, no GPU at all.
    assert allowed_nvidia(gpu_grant([1], compute=False)) == set()
    assert allowed_nvidia(gpu_grant([1], accelerator="rocm")) == set()
    assert allowed_nvidia(grant("g1")) == set()  # a CPU job


def test_job_limits_deny_every_nvidia_node_not_granted() -> None:
    g = gpu_grant([1], requirements=Requirements(cpu_cores=1.5, memory_gb=0.25))
    limits = job_limits(g, pids_max=64, nodes=NODES)
    assert limits == JobLimits(
        memory_gb=0.25,
        memory_bytes=250_000_000,
        cpu_quota_us=150_000,
        pids_max=64,
        deny=((195, 0), (195, 2)),
    )
    cpu_job = job_limits(grant("g2"), pids_max=0, nodes=NODES)
    assert cpu_job.deny == ((195, 0), (195, 1), (195, 2))
    assert cpu_job.pids_max is None  # 0: no limit
    # Defaults of a job that asks nothing: 1 core, 1 GB.
    assert (cpu_job.cpu_quota_us, cpu_job.memory_bytes) == (100_000, 10**9)
    assert job_limits(grant("g3"), pids_max=2**40, nodes=()).pids_max == MAX_PIDS


def test_nvidia_nodes_are_the_numbered_character_devices() -> None:
    entries = [
        ("nvidia1", CHR, os.makedev(195, 1)),
        ("nvidiactl", CHR, os.makedev(195, 255)),  # control nodes stay allowed
        ("nvidia-uvm", CHR, os.makedev(510, 0)),
        ("nvidia-caps", stat.S_IFDIR | 0o755, 0),
        ("nvidia12", CHR, os.makedev(195, 12)),
        ("nvidia3", stat.S_IFREG | 0o644, 0),  # a plain file named like one is not a device
        ("nvidia0", CHR, os.makedev(195, 0)),
    ]
    assert scan_nvidia(entries) == (
        DeviceNode(0, 195, 0),
        DeviceNode(1, 195, 1),
        DeviceNode(12, 195, 12),
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_nvidia_nodes_made_after_the_first_look_are_seen(tmp_path: Path) -> None:
    nodes = NvidiaNodes(tmp_path)
    os.mknod(tmp_path / "nvidia0", CHR, os.makedev(195, 0))
    assert nodes.nodes() == (DeviceNode(0, 195, 0),)
    # The driver makes nodes on first use: one made after the executor looked still counts.
    os.mknod(tmp_path / "nvidia1", CHR, os.makedev(195, 1))
    assert nodes.nodes() == (DeviceNode(0, 195, 0), DeviceNode(1, 195, 1))
    assert NvidiaNodes(tmp_path / "missing").nodes() == ()


def test_device_writes_are_one_deny_line_per_device() -> None:
    limits = JobLimits(deny=((195, 0), (195, 2)))
    assert device_writes(limits) == [
        ("devices", "devices.deny", "c 195:0 rwm"),
        ("devices", "devices.deny", "c 195:2 rwm"),
    ]
    assert device_writes(JobLimits()) == []


def test_resource_writes_per_cgroup_version() -> None:
    limits = JobLimits(memory_gb=0.2, memory_bytes=200_000_000, cpu_quota_us=50_000, pids_max=64)
    every = frozenset({"memory", "cpu", "pids", "devices"})
    assert resource_writes(limits, "v1", every, memsw=True) == [
        ("memory", "memory.limit_in_bytes", "200000000"),
        ("memory", "memory.memsw.limit_in_bytes", "200000000"),  # swap doesn't extend it
        ("cpu", "cpu.cfs_period_us", "100000"),
        ("cpu", "cpu.cfs_quota_us", "50000"),
        ("pids", "pids.max", "64"),
    ]
    assert resource_writes(limits, "v2", every, memsw=True) == [
        ("memory", "memory.max", "200000000"),
        ("memory", "memory.swap.max", "0"),
        ("cpu", "cpu.max", "50000 100000"),
        ("pids", "pids.max", "64"),
    ]
    # Only what the hierarchy enforces, and nothing for what is not limited.
    assert resource_writes(limits, "v1", frozenset({"pids"})) == [("pids", "pids.max", "64")]
    assert resource_writes(JobLimits(), "v2", every) == []


def test_oom_counters_and_reasons() -> None:
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"
    v2 = "low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 0\n"
    assert counter(v1, "oom_kill") == 2
    assert (counter(v2, "oom"), counter(v2, "oom_kill")) == (1, 1)
    assert counter("oom_kill_disable 0\nunder_oom 0\n", "oom_kill") is None  # before Linux 4.13
    assert counter("oom_kill x\n", "oom_kill") is None
    limits = JobLimits(memory_gb=0.2, memory_bytes=200_000_000)
    assert oom_reason(limits, "limit") == (
        "out of memory: the job passed its memory_gb = 0.2 (200000000 bytes)"
    )
    assert oom_reason(limits, "node").startswith("out of memory: the node ran out of memory")


def test_own_cgroup_paths_and_the_enforcement_words() -> None:
    text = "9:name=systemd:/\n4:memory:/a/b\n2:cpu,cpuacct:/c\n0::/u\nbad line\n"
    assert _own_paths(text) == {
        "name=systemd": "/",
        "memory": "/a/b",
        "cpu": "/c",
        "cpuacct": "/c",
        "": "/u",
    }
    every = ["memory", "cpu", "pids", "devices"]
    assert v1_enforcement(every) == "cgroup v1: memory cpu pids devices"
    assert (
        v1_enforcement(["pids", "memory"]) == "cgroup v1: memory pids (not enforced: cpu devices)"
    )
    assert v2_enforcement(["pids", "cpu", "memory"]) == (
        "cgroup v2: memory cpu pids (devices not enforced: needs eBPF)"
    )
    # A container given the memory controller alone (as a cloud GPU machine's was).
    assert v2_enforcement(["memory"]) == (
        "cgroup v2: memory (not enforced: cpu pids; devices: needs eBPF)"
    )


def fake_cgroupfs(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_v2_enforces_the_controllers_its_cgroup_offers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The executor's cgroup is offered memory alone (cpu and pids are not delegated).
    fake_cgroupfs(
        tmp_path,
        {
            "cgroup.controllers": "cpu memory pids io",
            "svc/cgroup.controllers": "memory io",
            "svc/cgroup.subtree_control": "",
            "svc/gpulayer/cgroup.subtree_control": "",
        },
    )
    monkeypatch.setattr(cgroups, "_ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_own", lambda: {"": "/svc"})
    found, why = cgroups.v2_enforcing.__wrapped__()
    assert found is not None, why
    parent = tmp_path / "svc" / "gpulayer"
    assert (found.version, found.parent, found.controllers) == ("v2", parent, {"memory": parent})
    assert found.enforcement == "cgroup v2: memory (not enforced: cpu pids; devices: needs eBPF)"
    # Enabled for the job cgroups: below the executor's cgroup, and below gpulayer.
    assert (tmp_path / "svc/cgroup.subtree_control").read_text() == "+memory"
    assert (parent / "cgroup.subtree_control").read_text() == "+memory"
    monkeypatch.setattr(cgroups, "_own", lambda: {"": "/other"})
    fake_cgroupfs(tmp_path, {"other/cgroup.controllers": "io"})
    assert cgroups.v2_enforcing.__wrapped__() == (
        None,
        f"v2: {tmp_path}/other offers none of the memory, cpu, pids controllers",
    )


def test_v1_enforces_the_writable_controllers_and_tracks_in_pids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cgroupfs(
        tmp_path, {"memory/cgroup.procs": "", "memory/a/cgroup.procs": "", "pids/cgroup.procs": ""}
    )
    monkeypatch.setattr(cgroups, "_ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_own", lambda: {"memory": "/a", "pids": "/", "cpu": "/"})
    found, why = cgroups.v1_enforcing.__wrapped__()
    assert found is not None, why
    assert found.parent == tmp_path / "pids" / "gpulayer"
    assert found.controllers == {
        "memory": tmp_path / "memory" / "a" / "gpulayer",
        "pids": tmp_path / "pids" / "gpulayer",
    }
    assert found.enforcement == "cgroup v1: memory pids (not enforced: cpu devices)"
    # The executor goes back to its own cgroup in each hierarchy after a spawn.
    assert found.homes[tmp_path / "memory" / "a" / "gpulayer"] == tmp_path / "memory" / "a"

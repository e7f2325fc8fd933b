"""A container job's podman argv, devices, limits and environment (pure), and how the shim
words its end."""

from __future__ import annotations

import os
import resource
import stat
from pathlib import Path

import msgspec
import pytest
from tests.wsl_roots import wsl_root

from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobs import (
    Container,
    GpuUsage,
    JobRequest,
    Requirements,
    Sandbox,
    SandboxDevices,
)
from gpulayer_detection.cdi import parse_cdi_devices
from gpulayer_executor import container as ctr
from gpulayer_executor.config import ExecutorConfig
from gpulayer_executor.container_jobs import RanImages, launch_argv
from gpulayer_executor.limits import JobLimits
from gpulayer_executor.shim import ShimSpec
from gpulayer_executor.shim_container import explain, supervise
from gpulayer_executor.state import Outcome

INF = resource.RLIM_INFINITY
CDI = """
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
  - name: "0"
    containerEdits: {deviceNodes: [{path: /dev/nvidia0}]}
  - name: "1"
    containerEdits: {deviceNodes: [{path: /dev/nvidia1}]}
  - name: GPU-aaaa
    containerEdits: {deviceNodes: [{path: /dev/nvidia1}]}
  - name: MIG-bbbb
    containerEdits: {deviceNodes: [{path: /dev/nvidia-caps/nvidia-cap12}]}
"""


def grant(
    devices: list[int], *, compute: bool = True, instance_uuids: list[str] | None = None
) -> Grant:
    sandbox = Sandbox(devices=SandboxDevices(gpu="compute" if compute else None))
    job = JobRequest(job_id="j", command=["x"], sandbox=sandbox)
    return Grant(
        grant_id="g",
        job=job,
        node_id="n",
        accelerator="cuda",
        devices=devices,
        instance_uuids=instance_uuids or [],
    )


def test_ulimits_are_what_the_machine_allows() -> None:
    assert ctr.ulimits(20000, 96365, 32768) == [
        "--ulimit",
        "nofile=20000:20000",
        "--ulimit",
        "nproc=32768:32768",  # podman caps processes at pid_max
    ]
    assert ctr.ulimits(INF, INF, 4194304) == ["--ulimit", "nproc=4194304:4194304"]
    assert ctr.ulimits(1024, 500, 32768)[-1] == "nproc=500:500"


def test_granted_devices_by_cdi_name_only_those() -> None:
    cdi = parse_cdi_devices(CDI)
    assert ctr.device_args(grant([1]), cdi, Path("/nonexistent")) == [
        "--device",
        "nvidia.com/gpu=1",
    ]
    # No GPU asked for, or not granted compute: nothing, whatever the node has.
    assert ctr.device_args(grant([]), cdi, Path("/dev")) == []
    assert ctr.device_args(grant([0], compute=False), cdi, Path("/dev")) == []
    # A MIG instance only by its own name, never its parent's whole GPU.
    mig = grant([0], instance_uuids=["MIG-bbbb"])
    assert ctr.device_args(mig, cdi, Path("/dev")) == ["--device", "nvidia.com/gpu=MIG-bbbb"]
    with pytest.raises(ctr.ContainerError, match="MIG-cccc has no CDI device"):
        ctr.device_args(grant([0], instance_uuids=["MIG-cccc"]), cdi, Path("/dev"))


def test_without_a_cdi_spec_the_device_nodes_and_control_nodes(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        os.mknod(tmp_path / name, 0o600 | stat.S_IFREG)
    assert ctr.device_args(grant([1]), [], tmp_path) == [
        "--device",
        str(tmp_path / "nvidia1"),
        "--device",
        str(tmp_path / "nvidiactl"),
        "--device",
        str(tmp_path / "nvidia-uvm"),
    ]
    with pytest.raises(ctr.ContainerError, match="device 3: neither a CDI device nor"):
        ctr.device_args(grant([3]), [], tmp_path)


def test_limits_become_podman_options() -> None:
    limits = JobLimits(memory_gb=0.5, memory_bytes=500_000_000, cpu_quota_us=150_000, pids_max=64)
    assert ctr.limit_args(limits) == [
        "--memory",
        "500000000",
        "--memory-swap",
        "500000000",
        "--cpus",
        "1.5",
        "--pids-limit",
        "64",
    ]
    assert ctr.limit_args(None) == []
    assert ctr.limit_args(JobLimits()) == []


def test_a_job_folder_volume_cannot_carry_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ctr.ContainerError, match="holds ':' or ','"):
        _argv(tmp_path / "a:b", [])


def _argv(cwd: Path, command: list[str]) -> list[str]:
    return ctr.run_argv(
        podman="podman",
        runtime=None,
        name="n",
        labels={},
        image="i",
        command=command,
        user=(1, 1),
        cwd=cwd,
        env_file=cwd / "env",
        devices=[],
        limits=[],
        ulimit=[],
        network="host",
    )


def test_the_image_is_last_and_the_command_follows_it_untouched(tmp_path: Path) -> None:
    command = ["--privileged", "-v", "/:/host", "--", "$HOME"]
    argv = ctr.run_argv(
        podman="/usr/bin/podman",
        runtime="runc",
        name="gpulayer-x",
        labels={ctr.LABEL_GRANT: "g"},
        image="localhost/img:1",
        command=command,
        user=(3000001, 3000001),
        cwd=tmp_path,
        env_file=tmp_path / "env",
        devices=["--device", "nvidia.com/gpu=1"],
        limits=[],
        ulimit=[],
        network="none",
    )
    at = argv.index("localhost/img:1")
    assert argv[at + 1 :] == command  # podman reads nothing after the image as its own
    assert argv[:4] == ["/usr/bin/podman", "--runtime", "runc", "run"]
    for option in (
        ["--user", "3000001:3000001"],
        ["--security-opt", "no-new-privileges"],
        ["--cap-drop", "all"],
        ["--network", "none"],
        ["--pull", "never"],
        ["--workdir", str(tmp_path)],
        ["--volume", f"{tmp_path}:{tmp_path}:rw"],
        ["--env-file", str(tmp_path / "env")],
    ):
        i = argv.index(option[0], 0, at) if option[0] != "--volume" else argv.index(option[0])
        while argv[i + 1] != option[1]:
            i = argv.index(option[0], i + 1, at)
        assert i < at
    # No value of the job's environment on the argv (other users read it in /proc).
    assert not any(a.startswith("-e") for a in argv[:at])


def test_the_jobs_env_goes_in_less_the_hosts_path(tmp_path: Path) -> None:
    env = {"PATH": "/host/bin", "HOME": "/home/x", "A": "1", "GPULAYER_GRANT_ID": "g"}
    got = ctr.container_env(env, {"A": "1"}, tmp_path)
    assert got == {"HOME": str(tmp_path), "A": "1", "GPULAYER_GRANT_ID": "g"}
    # The job's own PATH goes in.
    assert ctr.container_env(env, {"PATH": "/host/bin"}, tmp_path)["PATH"] == "/host/bin"
    with pytest.raises(ctr.ContainerError, match="env: B holds a line break"):
        ctr.container_env({"B": "x\nC=evil"}, {}, tmp_path)
    for bad in ("#A", "A B", "A\tB"):
        with pytest.raises(ctr.ContainerError, match="is not a name a container job can pass"):
            ctr.container_env({bad: "1"}, {}, tmp_path)
    assert ctr.env_file_text({"A": "1", "B": "a b=c"}) == "A=1\nB=a b=c\n"
    big = {f"V{i}": "x" * 10_000 for i in range(300)}  # 3 MB: over ARG_MAX on an argv
    assert len(ctr.env_file_text(ctr.container_env(big, {}, tmp_path))) > 3_000_000


def test_podman_gets_the_executors_path_never_the_jobs() -> None:
    env = ctr.podman_env({"PATH": "/usr/bin", "LANG": "C.UTF-8", "HOME": "/root"}, "g1", "M")
    assert env == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "M": "g1"}


def test_names_and_labels_are_per_executor_and_grant(tmp_path: Path) -> None:
    a = ctr.container_name(tmp_path / "a", "g1")
    assert a.startswith("gpulayer-")
    assert a == ctr.container_name(tmp_path / "a", "g1")
    assert a != ctr.container_name(tmp_path / "b", "g1")
    assert a != ctr.container_name(tmp_path / "a", "g2")
    assert ctr.executor_label(tmp_path / "a") != ctr.executor_label(tmp_path / "b")


def test_architecture_and_pull_reasons_name_the_image() -> None:
    ctr.check_arch("img:1", "amd64", "amd64")
    with pytest.raises(ctr.ContainerError, match="image img:1 is for arm64, this node is amd64"):
        ctr.check_arch("img:1", "arm64", "amd64")
    err = ctr.pull_failed("r.example/x:1", 125, "Trying to pull...\nError: connection refused\n")
    assert str(err) == "image r.example/x:1: pull failed: Error: connection refused"
    assert "pull policy is never" in str(ctr.never_pulled("img:1"))


def box(limits: JobLimits | None) -> ctr.ContainerRun:
    return ctr.ContainerRun(
        podman="podman", name="n", image="i", argv=[], env={}, podman_env={}, limits=limits
    )


def test_a_container_sigkilled_with_a_memory_limit_ran_out_of_memory() -> None:
    limits = JobLimits(memory_gb=0.03, memory_bytes=30_000_000)
    killed = Outcome(state="failed", exit_code=137, reason="exit code 137")
    assert explain(killed, box(limits)).reason == (
        "out of memory: the job passed its memory_gb = 0.03 (30000000 bytes)"
    )
    assert explain(killed, box(None)) == killed  # no limit: no such guess
    timed_out = Outcome(state="failed", exit_code=137, reason="timeout")
    assert explain(timed_out, box(limits)) == timed_out
    cancelled = Outcome(state="cancelled", exit_code=137, reason="by admin")
    assert explain(cancelled, box(limits)) == cancelled
    seven = Outcome(state="failed", exit_code=7, reason="exit code 7")
    assert explain(seven, box(limits)) == seven
    podman = explain(Outcome(state="failed", exit_code=125, reason="exit code 125"), box(None))
    assert podman.exit_code == 125
    assert "podman could not run the container" in (podman.reason or "")


def test_a_container_job_without_podman_or_without_a_shim_fails_naming_why(
    tmp_path: Path,
) -> None:
    job = JobRequest(job_id="j", command=["x"], container=Container(image="localhost/i:1"))
    g = Grant(grant_id="g", job=job, node_id="n", accelerator="cpu")
    base = ExecutorConfig(node_id="n", workdir=tmp_path, base_env={"PATH": "/usr/bin"})
    with pytest.raises(ctr.ContainerError, match="image localhost/i:1: podman is not on this"):
        launch_argv(base, tmp_path, g, None, tmp_path, {})
    no_shim = msgspec.structs.replace(base, podman="/usr/bin/podman", shim=False)
    with pytest.raises(ctr.ContainerError, match="container jobs run under a shim"):
        launch_argv(no_shim, tmp_path, g, None, tmp_path, {})
    ok = msgspec.structs.replace(base, podman="/usr/bin/podman", container_runtime="runc")
    argv, extra = launch_argv(ok, tmp_path, g, None, tmp_path / "jobs" / "g", {"A": "1"})
    assert argv == ["x"]
    run = extra["container"]
    assert run.argv[-2:] == ["localhost/i:1", "x"]
    assert run.env == {"A": "1", "HOME": str(tmp_path / "jobs" / "g")}
    assert run.podman_env == {"PATH": "/usr/bin", "GPULAYER_GRANT_ID": "g"}
    # A bare job: its argv alone.
    assert launch_argv(
        base,
        tmp_path,
        msgspec.structs.replace(g, job=JobRequest(job_id="j", command=["x"])),
        None,
        tmp_path,
        {},
    ) == (["x"], {})


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["/usr/bin/conmon", "-c", "abc", "-n", "gpulayer-aa", "--exit-dir", "/x"], True),
        (["/usr/bin/conmon", "--name=gpulayer-aa"], True),
        (["/usr/bin/conmon", "-n", "gpulayer-aab"], False),  # another container
        (["/usr/bin/conmon", "-c", "gpulayer-aa"], False),  # not its name
        (["/usr/bin/conmon", "-n"], False),
        ([], False),
    ],
)
def test_a_monitor_is_found_by_the_containers_name_alone(argv: list[str], named: bool) -> None:
    assert ctr._named(argv, "gpulayer-aa") is named


def wsl2_devices(tmp_path: Path) -> tuple[Path, Path]:
    """A WSL2 machine's device folder (``dxg`` a character device) and its ``/usr/lib/wsl``."""
    root = wsl_root(tmp_path / "host", "nvidia")
    return root / "dev", root / "usr" / "lib" / "wsl"


def test_in_wsl2_a_granted_gpu_is_dxg_and_the_wsl_folder_read_only(tmp_path: Path) -> None:
    dev, wsl = wsl2_devices(tmp_path)
    exactly = ["--device", str(dev / "dxg"), "--volume", f"{wsl}:{wsl}:ro"]
    assert ctr.device_args(grant([0]), [], dev, wsl_dir=wsl) == exactly
    # Every GPU is behind the one device: two granted GPUs pass it once.
    assert ctr.device_args(grant([0, 1]), [], dev, wsl_dir=wsl) == exactly
    # nvidia-ctk's WSL spec names "all" alone: no device of its own for GPU 0.
    spec = Path(__file__).resolve().parents[2] / "fixtures" / "cdi" / "wsl" / "nvidia-wsl.yaml"
    cdi = parse_cdi_devices(spec.read_text())
    assert ctr.device_args(grant([0]), cdi, dev, wsl_dir=wsl) == exactly
    # No GPU asked for, or none granted to the sandbox: nothing.
    assert ctr.device_args(grant([]), [], dev, wsl_dir=wsl) == []
    assert ctr.device_args(grant([0], compute=False), [], dev, wsl_dir=wsl) == []


def test_in_wsl2_a_job_placed_on_directml_alone_gets_dxg(tmp_path: Path) -> None:
    """An AMD machine's GPU is tracked by no device: a job placed on its API alone holds none,
    and still gets /dev/dxg (placement's pool placement, docs/placement-rules.md)."""
    dev, wsl = wsl2_devices(tmp_path)
    g = grant([])
    job = msgspec.structs.replace(g.job, gpu=GpuUsage(use="shared", apis_any=["directml"]))
    assert ctr.device_args(msgspec.structs.replace(g, job=job), [], dev, wsl_dir=wsl) == [
        "--device",
        str(dev / "dxg"),
        "--volume",
        f"{wsl}:{wsl}:ro",
    ]


def test_a_dxg_that_is_no_device_is_not_wsl2(tmp_path: Path) -> None:
    dev, wsl = wsl2_devices(tmp_path)
    (dev / "dxg").unlink()
    (dev / "dxg").write_text("")
    with pytest.raises(ctr.ContainerError, match="device 0: neither a CDI device nor"):
        ctr.device_args(grant([0]), [], dev, wsl_dir=wsl)
    dev2, _ = wsl2_devices(tmp_path / "b")
    with pytest.raises(ctr.ContainerError, match="is not \\(WSL2's libraries\\)"):
        ctr.device_args(grant([0]), [], dev2, wsl_dir=tmp_path / "no-wsl")


def test_the_podman_argv_of_a_wsl2_container_job(tmp_path: Path) -> None:
    dev, wsl = wsl2_devices(tmp_path)
    job = JobRequest(
        job_id="j",
        command=["python", "train.py"],
        container=Container(image="localhost/dml:1"),
        sandbox=Sandbox(devices=SandboxDevices(gpu="compute")),
        requirements=Requirements(gpu_count=1),
    )
    g = Grant(grant_id="g", job=job, node_id="n", accelerator="cuda", devices=[0])
    config = ExecutorConfig(
        node_id="n",
        workdir=tmp_path,
        base_env={"PATH": "/usr/bin"},
        podman="/usr/bin/podman",
        device_dir=dev,
        wsl_dir=wsl,
        cdi_dirs=(),
    )
    _, extra = launch_argv(config, tmp_path, g, None, tmp_path / "jobs" / "g", {})
    argv = extra["container"].argv
    image = argv.index("localhost/dml:1")
    devices = [argv[i + 1] for i, a in enumerate(argv[:image]) if a == "--device"]
    volumes = [argv[i + 1] for i, a in enumerate(argv[:image]) if a == "--volume"]
    assert devices == [str(dev / "dxg")]
    assert volumes == [f"{tmp_path / 'jobs' / 'g'}:{tmp_path / 'jobs' / 'g'}:rw", f"{wsl}:{wsl}:ro"]
    assert argv[image - 4 : image] == ["--device", str(dev / "dxg"), "--volume", f"{wsl}:{wsl}:ro"]
    assert argv[image:] == ["localhost/dml:1", "python", "train.py"]


def test_an_image_that_ran_is_known_until_podman_cannot_run_it(tmp_path: Path) -> None:
    def of(image: str, pull: str = "missing") -> Grant:
        job = JobRequest(
            job_id="j",
            command=["x"],
            container=Container(image=image, pull=pull),  # type: ignore[arg-type]
        )
        return Grant(grant_id="g", job=job, node_id="n", accelerator="cpu")

    ran = RanImages(limit=2)
    ran.record(of("a"), Outcome(state="failed", reason="spawn: x"))  # no container ran
    ran.record(of("a"), Outcome(state="failed", exit_code=-9))  # podman killed, maybe before
    assert "a" not in ran
    ran.record(of("a"), Outcome(state="failed", exit_code=7))  # the command's own code
    assert "a" in ran
    ran.record(of("a"), Outcome(state="failed", exit_code=ctr.PODMAN_FAILED))
    assert "a" not in ran
    for image in ("a", "b", "a", "c"):  # "a" ran again: "b" is the oldest
        ran.record(of(image), Outcome(state="succeeded", exit_code=0))
    assert ("a" in ran, "b" in ran, "c" in ran) == (True, False, True)
    bare = Grant(
        grant_id="g", job=JobRequest(job_id="j", command=["b"]), node_id="n", accelerator="cpu"
    )
    ran.record(bare, Outcome(state="succeeded", exit_code=0))  # no image: nothing learnt
    assert ("a" in ran, "c" in ran) == (True, True)

    config = ExecutorConfig(node_id="n", workdir=tmp_path, base_env={}, podman="/usr/bin/podman")
    known = launch_argv(config, tmp_path, of("a"), None, tmp_path, {}, ran)[1]["container"]
    assert known.image_known
    assert not launch_argv(config, tmp_path, of("a"), None, tmp_path, {})[1][
        "container"
    ].image_known
    always = launch_argv(config, tmp_path, of("a", "always"), None, tmp_path, {}, ran)
    assert not always[1]["container"].image_known  # pulled each time, as asked


# A podman that holds the image while ``present`` exists; ``pull`` makes it; each call's argv
# is a line of ``calls``.
FAKE_PODMAN = """#!/bin/sh
echo "$*" >> {dir}/calls
case "$1 $2" in
  "image inspect") [ -e {dir}/present ] && echo {arch} && exit 0; exit 125 ;;
  "pull "*) touch {dir}/present; exit 0 ;;
esac
exit 0
"""


class _Flags:
    look = False


def _box(tmp_path: Path, *, pull: str, known: bool, present: bool) -> ctr.ContainerRun:
    podman = tmp_path / "podman"
    podman.write_text(FAKE_PODMAN.format(dir=tmp_path, arch=ctr.host_arch()))
    podman.chmod(0o755)
    if present:
        (tmp_path / "present").touch()
    return ctr.ContainerRun(
        podman=str(podman),
        name="gpulayer-x",
        image="localhost/i:1",
        pull=pull,  # type: ignore[arg-type]
        argv=[str(podman), "run", "localhost/i:1", "x"],
        env={"A": "1"},
        podman_env={"PATH": "/usr/bin:/bin"},
        image_known=known,
    )


def _supervised(
    tmp_path: Path, box: ctr.ContainerRun, codes: list[int]
) -> tuple[Outcome, list[str], list[str]]:
    """The shim's container steps with ``process`` answering ``codes`` in turn: the outcome,
    podman's calls, and what each run found in the env file."""
    run = tmp_path / "run"
    run.mkdir()
    spec = ShimSpec(
        grant_id="g", job_id="j", run_dir=str(run), argv=["x"], env={}, cwd=str(tmp_path)
    )
    seen: list[str] = []

    def process(s: ShimSpec) -> Outcome:
        assert s.argv == box.argv
        seen.append((run / ctr.ENV_FILE).read_text())
        code = codes[len(seen) - 1]
        return Outcome(state="succeeded" if code == 0 else "failed", exit_code=code)

    outcome = supervise(spec, box, run, _Flags(), process)
    assert not (run / ctr.ENV_FILE).exists()  # removed once the job is over
    calls = (tmp_path / "calls").read_text().splitlines()
    return outcome, [c.split(" localhost")[0].split(" gpulayer-x")[0] for c in calls], seen


def test_a_known_image_goes_straight_to_podman_run(tmp_path: Path) -> None:
    box = _box(tmp_path, pull="missing", known=True, present=True)
    outcome, calls, seen = _supervised(tmp_path, box, [0])
    assert (outcome.state, outcome.exit_code) == ("succeeded", 0)
    assert seen == ["A=1\n"]
    assert calls == ["rm --force --ignore --time 0"]  # no image inspect before the run


def test_an_unknown_image_is_checked_first(tmp_path: Path) -> None:
    box = _box(tmp_path, pull="missing", known=False, present=True)
    outcome, calls, _ = _supervised(tmp_path, box, [0])
    assert outcome.state == "succeeded"
    assert calls == ["image inspect --format {{.Architecture}}", "rm --force --ignore --time 0"]


def test_a_known_image_removed_since_is_pulled_and_the_job_run_again(tmp_path: Path) -> None:
    box = _box(tmp_path, pull="missing", known=True, present=False)
    outcome, calls, seen = _supervised(tmp_path, box, [ctr.PODMAN_FAILED, 0])
    assert (outcome.state, outcome.exit_code) == ("succeeded", 0)
    assert seen == ["A=1\n", "A=1\n"]
    assert calls == [
        "image inspect --format {{.Architecture}}",  # gone: no container ever ran
        "rm --force --ignore --time 0",
        "image inspect --format {{.Architecture}}",
        "pull --quiet",
        "image inspect --format {{.Architecture}}",
        "rm --force --ignore --time 0",
    ]


def test_a_known_image_removed_since_with_pull_never_fails_naming_it(tmp_path: Path) -> None:
    box = _box(tmp_path, pull="never", known=True, present=False)
    outcome, _, seen = _supervised(tmp_path, box, [ctr.PODMAN_FAILED])
    assert (outcome.state, outcome.reason) == ("failed", str(ctr.never_pulled("localhost/i:1")))
    assert len(seen) == 1  # never run again


def test_podman_failing_with_the_image_present_is_not_run_again(tmp_path: Path) -> None:
    box = _box(tmp_path, pull="missing", known=True, present=True)
    outcome, calls, seen = _supervised(tmp_path, box, [ctr.PODMAN_FAILED])
    assert (outcome.state, outcome.exit_code) == ("failed", ctr.PODMAN_FAILED)
    assert str(outcome.reason).startswith("exit code 125")
    assert len(seen) == 1
    assert calls[0] == "image inspect --format {{.Architecture}}"

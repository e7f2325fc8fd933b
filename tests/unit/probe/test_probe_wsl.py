"""WSL2 and DirectML from host roots laid out as WSL2 lays them out (tests/wsl_roots.py): NVIDIA,
AMD, only the software adapter, no /dev/dxg, and damaged layouts, each a note and never an
exception."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest
from tests.wsl_roots import AMD_PACKAGE, NVIDIA_PACKAGE, char_device, kernel_text, wsl_root

from gpulayer_contracts.bounds import validate_capabilities
from gpulayer_detection.base import Finding, ProbeContext
from gpulayer_detection.host import HostProbe
from gpulayer_detection.registry import (
    build_capabilities,
    collect,
    default_probes,
    host_root_from_env,
    make_context,
)
from gpulayer_detection.runner import RunResult, with_tool_dirs
from gpulayer_detection.wsl import WslProbe, is_wsl1, is_wsl2, judge, read_layout
from gpulayer_probe.__main__ import read_settings
from gpulayer_runtime.settings import ConfigError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


async def _no_tools(argv: Sequence[str], timeout: float) -> RunResult:
    return RunResult(tuple(argv), None, error=f"{argv[0]} not found on PATH")


def ctx(root: Path, system: str = "linux") -> ProbeContext:
    return ProbeContext(
        run=_no_tools, timeout=5, system=system, machine="x86_64", host_root=str(root)
    )


async def wsl(root: Path, system: str = "linux") -> Finding:
    return await WslProbe().probe(ctx(root, system))


@pytest.mark.parametrize(
    ("recording", "wsl2", "wsl1"),
    [
        ("wsl2-version", True, False),
        ("wsl2-osrelease", True, False),
        ("wsl1-version", False, True),
        ("wsl1-osrelease", False, True),
        ("linux-version", False, False),
        ("linux-osrelease", False, False),
    ],
)
def test_the_kernel_says_whether_this_is_wsl2(recording: str, wsl2: bool, wsl1: bool) -> None:
    text = kernel_text(recording)
    assert is_wsl2(text) is wsl2
    assert is_wsl1(text) is wsl1


async def test_an_nvidia_machine_counts_directml_and_names_all_three(tmp_path: Path) -> None:
    found = await wsl(wsl_root(tmp_path, "nvidia"))
    why = found.host_apis["directml"]
    assert why.startswith("/dev/dxg (character device); /usr/lib/wsl/lib: libd3d12.so, ")
    assert "libdxcore.so" in why
    assert f"driver store: {NVIDIA_PACKAGE} (NVIDIA: libnvwgf2umx.so)" in why
    # Containers get what the executor passes: /dev/dxg and /usr/lib/wsl, libcuda among it.
    assert sorted(found.container_apis) == ["cuda", "directml"]
    assert "--device /dev/dxg" in found.container_apis["directml"]
    assert found.notes == []
    assert "directml" not in found.evidence


async def test_an_amd_machine_counts_directml_and_no_cuda(tmp_path: Path) -> None:
    found = await wsl(wsl_root(tmp_path, "amd"))
    assert f"driver store: {AMD_PACKAGE} (AMD: amdxc64.so)" in found.host_apis["directml"]
    assert sorted(found.container_apis) == ["directml"]


async def test_only_the_software_adapter_says_so_and_counts_nothing(tmp_path: Path) -> None:
    found = await wsl(wsl_root(tmp_path, "none"))
    assert found.host_apis == {}
    assert found.container_apis == {}
    assert found.evidence["directml"] == (
        "not counted: only the software adapter (Microsoft Basic Render Driver): the driver "
        "store /usr/lib/wsl/drivers is empty, so no hardware adapter's user-mode driver"
    )
    assert found.notes == [f"wsl: directml {found.evidence['directml']}"]


async def test_without_dev_dxg_it_says_that_instead(tmp_path: Path) -> None:
    found = await wsl(wsl_root(tmp_path, "nvidia", dxg=False))
    assert found.host_apis == {}
    assert found.container_apis == {}  # libcuda is there, but nothing reaches the GPU
    assert found.evidence["directml"].startswith("not counted: no /dev/dxg: ")
    assert "software adapter" not in found.evidence["directml"]
    assert len(found.notes) == 1
    assert found.notes[0].startswith("wsl: directml not counted: no /dev/dxg")


def damage(root: Path, how: str) -> None:
    """Break ``root``'s WSL layout as ``how`` says."""
    dxg = root / "dev" / "dxg"
    wsl_dir = root / "usr" / "lib" / "wsl"
    package = wsl_dir / "drivers" / NVIDIA_PACKAGE
    if how.startswith("dxg-"):
        dxg.unlink()
    if how == "dxg-file":
        dxg.write_text("")
    elif how == "dxg-folder":
        dxg.mkdir()
    elif how == "dxg-dangling":
        dxg.symlink_to(root / "nowhere")
    elif how in ("empty-package", "no-store", "store-is-a-file"):
        for f in package.iterdir():
            f.unlink()
        if how != "empty-package":
            package.rmdir()
            (wsl_dir / "drivers").rmdir()
        if how == "store-is-a-file":
            (wsl_dir / "drivers").write_text("")
    elif how == "no-d3d12":
        (wsl_dir / "lib" / "libd3d12.so").unlink()
    elif how == "no-lib-folder":
        for f in (wsl_dir / "lib").iterdir():
            f.unlink()
        (wsl_dir / "lib").rmdir()


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("dxg-file", "/dev/dxg is a regular file, not a character device"),
        ("dxg-folder", "/dev/dxg is a folder, not a character device"),
        ("dxg-dangling", "/dev/dxg is a dangling link, not a character device"),
        ("empty-package", f"the driver store's {NVIDIA_PACKAGE} hold no driver library"),
        ("no-store", "no driver store (/usr/lib/wsl/drivers)"),
        ("store-is-a-file", "no driver store (/usr/lib/wsl/drivers)"),
        ("no-d3d12", "/usr/lib/wsl/lib lacks libd3d12.so"),
        ("no-lib-folder", "/usr/lib/wsl/lib (missing) lacks libd3d12.so, libdxcore.so"),
    ],
)
async def test_a_damaged_layout_is_a_note_never_an_exception(
    tmp_path: Path, how: str, said: str
) -> None:
    root = wsl_root(tmp_path, "nvidia")
    damage(root, how)
    found = await wsl(root)
    assert "directml" not in found.host_apis
    assert said in found.evidence["directml"]
    assert any(said in n for n in found.notes)


async def test_a_plain_linux_says_why_without_a_note(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "version").write_text(kernel_text("linux-version"))
    found = await wsl(root)
    assert found.evidence["directml"].startswith("not available: no /dev/dxg")
    assert found.notes == []
    assert found.host_apis == {}
    assert found.container_apis == {}


async def test_wsl1_says_no_gpu_reaches_it(tmp_path: Path) -> None:
    (tmp_path / "proc" / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "proc" / "sys" / "kernel" / "osrelease").write_text(kernel_text("wsl1-osrelease"))
    found = await wsl(tmp_path)
    assert found.notes == [
        "wsl: WSL1 (kernel 4.4.0-19041-Microsoft): no GPU reaches it; WSL 2 shares it"
    ]


@pytest.mark.parametrize(
    ("system", "evidence"),
    [
        ("darwin", "not available: DirectML exists on Windows and WSL2 only"),
        ("windows", "unknown: a native Windows probe is not implemented (run the probe in WSL2)"),
    ],
)
async def test_elsewhere_directml_is_named(tmp_path: Path, system: str, evidence: str) -> None:
    found = await wsl(wsl_root(tmp_path, "nvidia"), system)
    assert found.evidence["directml"] == evidence
    assert found.host_apis == {}


def test_the_device_check_can_be_handed_in(tmp_path: Path) -> None:
    root = wsl_root(tmp_path, "amd", dxg=False)
    assert read_layout(str(root)).dxg == "missing"
    layout = read_layout(str(root), kind_of=lambda path: "device")
    assert judge(layout, wsl2=True).host is not None


def test_a_real_character_device_node_counts(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    root = wsl_root(tmp_path, "amd", dxg=False)
    char_device(root / "dev" / "dxg")
    assert stat.S_ISCHR(os.lstat(root / "dev" / "dxg").st_mode)
    assert read_layout(str(root)).dxg == "device"


async def test_the_host_says_wsl2_read_under_the_root(tmp_path: Path) -> None:
    found = await HostProbe().probe(ctx(wsl_root(tmp_path, "none")))
    assert found.host is not None
    assert found.host.wsl2 is True
    plain = await HostProbe().probe(ctx(wsl_root(tmp_path / "p", "none", wsl2=False)))
    assert plain.host is not None
    assert plain.host.wsl2 is False


async def test_cuda_is_read_from_the_wsl_library_as_on_linux(tmp_path: Path) -> None:
    """nvidia-smi is off PATH, in /usr/lib/wsl/lib: the probe finds it there and reads it as on
    Linux (the same output format; the rtx-4090 recording)."""
    root = wsl_root(tmp_path, "nvidia")
    lib = root / "usr" / "lib" / "wsl" / "lib"
    (lib / "nvidia-smi").chmod(0o755)
    smi = FIXTURES / "nvidia-smi" / "rtx-4090"
    asked: list[str] = []

    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        asked.append(argv[0])
        if argv[0] != str(lib / "nvidia-smi"):
            return RunResult(tuple(argv), None, error=f"{argv[0]} not found on PATH")
        name = "query.txt" if any(a.startswith("--query-gpu") for a in argv) else "smi.txt"
        return RunResult(tuple(argv), 0, (smi / name).read_text())

    context = make_context(run=run, timeout=5, host_root=str(root), tool_dirs=[str(lib)])
    assert context.dev_dir == str(root / "dev")
    findings = await collect(context, default_probes(frameworks=False, include_containers=False))
    caps = build_capabilities("wsl-box", findings)
    assert caps.host.wsl2 is (os.uname().sysname == "Linux")
    assert [(d.accelerator, d.name) for d in caps.accelerators] == [
        ("cuda", "NVIDIA GeForce RTX 4090")
    ]
    if context.system == "linux":
        assert {"cuda", "directml"} <= set(caps.gpu_apis.host)
        assert {"cuda", "directml"} <= set(caps.gpu_apis.containers)
    assert "vulkaninfo" in asked  # off PATH here and not in the WSL folder: asked as given


async def test_a_tool_on_path_or_named_by_path_is_run_as_given(tmp_path: Path) -> None:
    seen: list[str] = []

    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        seen.append(argv[0])
        return RunResult(tuple(argv), 0)

    for name in ("sh", "gpulayer-test-tool"):
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0o755)
    searching = with_tool_dirs(run, [str(tmp_path)])
    await searching(["sh", "-c", "true"], 1)  # on PATH: PATH wins
    await searching(["gpulayer-test-tool"], 1)  # off PATH, in the folder
    await searching(["/no/such/tool"], 1)
    await searching(["no-such-tool-anywhere"], 1)
    assert seen == [
        "sh",
        str(tmp_path / "gpulayer-test-tool"),
        "/no/such/tool",
        "no-such-tool-anywhere",
    ]
    assert with_tool_dirs(run, []) is run


def test_the_host_root_setting(tmp_path: Path) -> None:
    assert host_root_from_env({}) == "/"
    assert host_root_from_env({"GPULAYER_PROBE_HOST_ROOT": str(tmp_path)}) == str(tmp_path)
    for bad in ("relative/host", str(tmp_path / "missing")):
        with pytest.raises(ValueError, match="GPULAYER_PROBE_HOST_ROOT="):
            host_root_from_env({"GPULAYER_PROBE_HOST_ROOT": bad})


def test_the_service_reads_the_host_root_and_its_dev_folder(tmp_path: Path) -> None:
    _, _, settings = read_settings({"GPULAYER_PROBE_HOST_ROOT": str(tmp_path)})
    assert (settings.host_root, settings.dev_dir) == (str(tmp_path), str(tmp_path / "dev"))
    _, _, own = read_settings(
        {"GPULAYER_PROBE_HOST_ROOT": str(tmp_path), "GPULAYER_PROBE_DEVICE_DIR": "/srv/dev"}
    )
    assert own.dev_dir == "/srv/dev"
    assert read_settings({})[2].dev_dir == "/dev"
    with pytest.raises(ConfigError, match="GPULAYER_PROBE_HOST_ROOT="):
        read_settings({"GPULAYER_PROBE_HOST_ROOT": "host"})


async def test_odd_driver_store_names_still_make_a_report_placement_takes(tmp_path: Path) -> None:
    """Folder names are the host's: long ones and undecodable bytes stay within the bounds a
    capabilities report must keep (placement refuses one that doesn't)."""
    root = wsl_root(tmp_path, "none")
    store = root / "usr" / "lib" / "wsl" / "drivers"
    for i in range(5):
        (store / f"{'x' * 200}{i}.inf_amd64_0a1b2c3d").mkdir()
    os.mkdir(os.path.join(os.fsencode(store), b"bad\xff.inf_amd64_0a1b2c3d"))
    found = await wsl(root)
    caps = build_capabilities("n", [found])
    assert validate_capabilities(caps) == []
    assert "hold no driver library" in found.evidence["directml"]
    (store / f"{'x' * 200}0.inf_amd64_0a1b2c3d" / "libvendor.so").touch()
    found = await wsl(root)
    assert validate_capabilities(build_capabilities("n", [found])) == []
    assert "(1 library)" in found.host_apis["directml"]

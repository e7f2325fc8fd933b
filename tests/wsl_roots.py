"""Host roots laid out as WSL2 lays out a Linux's GPU files (Microsoft's DirectX blog post
"DirectX ❤ Linux" and WSL's GPU compute docs), for the probe's host root, the executor's
device folder and ``gpulayer check``. tests/fixtures/README.md ("wsl/") says where each name
comes from.

- ``/dev/dxg``: a character device (a real node where mknod is allowed, else a link to
  ``/dev/null``, which is one);
- ``/usr/lib/wsl/lib``: the D3D12 and DXCore libraries, and NVIDIA's WSL libraries with
  ``nvidia-smi`` on an NVIDIA machine;
- ``/usr/lib/wsl/drivers/<inf>.inf_amd64_<hash>/``: the vendor's user-mode driver.

The files are empty: the probe reads their names, never their contents.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Literal

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "wsl"

Gpu = Literal["nvidia", "amd", "none"]

D3D12 = ("libd3d12.so", "libd3d12core.so", "libdxcore.so")
NVIDIA_LIB = (
    "libcuda.so",
    "libcuda.so.1",
    "libcuda.so.1.1",
    "libnvidia-ml.so.1",
    "nvidia-smi",
)
NVIDIA_PACKAGE = "nv_dispi.inf_amd64_5f3c9a1e0b7d2c46"
NVIDIA_DRIVER = (
    "libcuda.so.1.1",
    "libcuda_loader.so",
    "libnvidia-ml.so.1",
    "libnvidia-ml_loader.so",
    "libnvwgf2umx.so",
    "nvcubins.bin",
    "nvidia-smi",
)
AMD_PACKAGE = "u0198633.inf_amd64_3e81d0c4a9b2f657"
AMD_DRIVER = ("B025777/amdxc64.so",)


def kernel_text(name: str) -> str:
    """A recorded kernel string: ``wsl2-version``, ``wsl2-osrelease``, ``wsl1-version``,
    ``linux-version``."""
    return (FIXTURES / f"{name}.txt").read_text().strip()


def char_device(path: Path) -> None:
    """A character device at ``path``: a node of its own where this user may make one (root),
    else a link to ``/dev/null``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        path.symlink_to("/dev/null")


def _files(folder: Path, names: tuple[str, ...]) -> None:
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def wsl_root(base: Path, gpu: Gpu = "nvidia", *, dxg: bool = True, wsl2: bool = True) -> Path:
    """A host root under ``base``: WSL2's kernel (``wsl2=False``: a plain Linux kernel),
    ``/dev/dxg`` (unless ``dxg`` is False), the D3D12 libraries, and the driver of ``gpu``
    (``none``: only the software adapter, an empty driver store)."""
    (base / "proc" / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    kernel = "wsl2" if wsl2 else "linux"
    (base / "proc" / "version").write_text(kernel_text(f"{kernel}-version") + "\n")
    (base / "proc" / "sys" / "kernel" / "osrelease").write_text(
        kernel_text(f"{kernel}-osrelease") + "\n"
    )
    (base / "dev").mkdir(exist_ok=True)
    if dxg:
        char_device(base / "dev" / "dxg")
    lib = base / "usr" / "lib" / "wsl" / "lib"
    drivers = base / "usr" / "lib" / "wsl" / "drivers"
    lib.mkdir(parents=True, exist_ok=True)
    drivers.mkdir(parents=True, exist_ok=True)
    _files(lib, D3D12)
    if gpu == "nvidia":
        _files(lib, NVIDIA_LIB)
        _files(drivers / NVIDIA_PACKAGE, NVIDIA_DRIVER)
    elif gpu == "amd":
        _files(drivers / AMD_PACKAGE, AMD_DRIVER)
    return base

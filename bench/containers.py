"""The full loop with container jobs: a busybox image made here (``podman import`` of a root
filesystem holding Debian's busybox-static; never pulled), the node's GPUs as device nodes the
bench makes (``/dev/null``'s 1:3, harmless), handed to each container by path."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tarfile
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import msgspec

from bench.fleet import GPUS_PER_CUDA_NODE, cuda_job, cuda_node
from gpulayer_contracts import JobRequest
from gpulayer_contracts.capabilities import ContainerRuntime, WorkerCapabilities
from gpulayer_contracts.jobs import Container
from gpulayer_detection.containers import is_static_elf

BUSYBOX = "/bin/busybox"
COMMAND = (BUSYBOX, "true")


def missing() -> str | None:
    """Why container jobs can't run here, or None."""
    if os.geteuid() != 0:
        return "container jobs need a root executor (rootful podman)"
    if not all(shutil.which(p) for p in ("podman", "runc")) or not is_static_elf(BUSYBOX):
        return "no podman, runc or static busybox: apt-get install podman runc busybox-static"
    return None


@contextlib.contextmanager
def bench_image(folder: Path) -> Iterator[str]:
    """A busybox image of the bench's own, removed afterwards: its name."""
    name = f"localhost/gpulayer-bench-{uuid.uuid4().hex[:10]}:1"
    root = folder / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy(BUSYBOX, root / "bin" / "busybox")
    tar = folder / "rootfs.tar"
    with tarfile.open(tar, "w") as t:
        t.add(root, arcname=".")
    done = subprocess.run(
        ["podman", "--runtime", "runc", "import", str(tar), name], capture_output=True, timeout=120
    )
    if done.returncode != 0:
        raise OSError(f"podman import: {done.stderr.decode(errors='replace')[-300:]}")
    try:
        yield name
    finally:
        subprocess.run(["podman", "rmi", "--force", name], capture_output=True, timeout=120)


def device_dir(folder: Path) -> Path:
    """``nvidia<N>`` for each of the bench node's GPUs (no CDI spec: passed by path)."""
    dev = folder / "dev"
    dev.mkdir()
    for i in range(GPUS_PER_CUDA_NODE):
        os.mknod(dev / f"nvidia{i}", 0o666 | 0o020000, os.makedev(1, 3))
    return dev


def container_node(node: str, at: datetime) -> WorkerCapabilities:
    """The bench's CUDA node with a container runtime that passed its self-test: placement
    sends a job naming an image only to such a node."""
    runtime = ContainerRuntime(name="podman", oci_runtime="runc", works=True)
    return msgspec.structs.replace(cuda_node(node, at), container_runtime=runtime)


def job_maker(image: str) -> Callable[[str, list[str]], JobRequest]:
    def make(job_id: str, command: list[str]) -> JobRequest:
        job = cuda_job(job_id, command)
        return msgspec.structs.replace(job, container=Container(image=image, pull="never"))

    return make

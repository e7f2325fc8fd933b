"""The node's container runtime: podman, the OCI runtime it starts containers with, whether a
container actually starts here (a bounded self-test), and the devices the node's CDI specs name.

The self-test runs ``podman run --rm --rootfs <dir>`` on a folder holding a static busybox (or,
without one, the host's ``/usr`` and ``/lib*`` bound read-only), so it never pulls an image. It
takes a second or two, so its answer is kept while podman's path, version and OCI runtime stay
the same (a failure is tried again after ``retest_failed_s``). Nothing here raises for what it
finds: a missing podman, a runtime that refuses this kernel, a self-test that hangs are notes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import shutil
import struct
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec

from gpulayer_contracts.bounds import (
    MAX_CDI_DEVICES,
    MAX_NOTE_BYTES,
    MAX_NOTES,
    MAX_SHORT_TEXT_BYTES,
)
from gpulayer_contracts.capabilities import ContainerRuntime
from gpulayer_detection.base import Finding, ProbeContext
from gpulayer_detection.cdi import read_cdi_devices
from gpulayer_detection.podman_machine import (
    INSPECT_ARGV,
    MachineInspectError,
    machine_container_apis,
    parse_machine_inspect,
)
from gpulayer_detection.runner import RunResult, resolve
from gpulayer_runtime.settings import env_float

__all__ = [
    "INSTALL_HINT",
    "SELFTEST_MARKER",
    "ContainerRuntimeProbe",
    "ContainerSettings",
    "host_ulimit_args",
    "is_static_elf",
    "parse_podman_version",
    "runtime_pending",
    "selftest_argv",
    "settings_from_env",
    "ulimit_args",
]

INSTALL_HINT: Final = "apt-get install podman runc"
SELFTEST_MARKER: Final = "gpulayer-selftest-ok"
# podman's own default for open files; an unlimited hard limit is not passed on as such.
_NOFILE_DEFAULT: Final = 1048576
# runc also lives in sbin, which a service's PATH may lack; podman looks there itself.
_SBIN: Final = ("/usr/local/sbin", "/usr/sbin", "/sbin")
# Host folders a self-test without a static busybox binds read-only to run /usr/bin/true.
_HOST_DIRS: Final = ("/usr", "/lib", "/lib64", "/lib32", "/bin")


@dataclass(frozen=True, slots=True)
class ContainerSettings:
    """``podman``: the program (a name on PATH or a path); None: don't look (the node offers
    no container runtime). ``oci_runtime``: what podman is told to start containers with;
    None: runc when installed (crun refuses some kernels' hybrid cgroup layout, runc works),
    else podman's default. ``test_timeout``: the self-test's bound, seconds."""

    podman: str | None = "podman"
    oci_runtime: str | None = None
    test_timeout: float = 20.0
    retest_failed_s: float = 600.0
    busybox: str = "/bin/busybox"
    tmp_dir: str | None = None


def settings_from_env(env: Mapping[str, str]) -> ContainerSettings:
    """GPULAYER_PROBE_PODMAN (``none``: don't look), GPULAYER_OCI_RUNTIME and
    GPULAYER_PROBE_CONTAINER_TEST_S from ``env``, for the edges that read it (the probe's
    ``__main__``, ``gpulayer probe``, ``check``). Raises ValueError naming a bad value."""
    podman = env.get("GPULAYER_PROBE_PODMAN", "").strip() or "podman"
    return ContainerSettings(
        podman=None if podman.lower() == "none" else podman,
        oci_runtime=env.get("GPULAYER_OCI_RUNTIME", "").strip() or None,
        test_timeout=env_float(env, "GPULAYER_PROBE_CONTAINER_TEST_S", 20.0, high=3600.0),
    )


def parse_podman_version(text: str) -> str | None:
    """podman's version from ``podman version --format json`` (its client's) or from
    ``podman --version`` (``podman version 4.3.1``); None when neither shape."""
    text = text.strip()
    if text.startswith("{"):
        try:
            doc = msgspec.json.decode(text)
        except msgspec.DecodeError:
            return None
        for side in ("Client", "Server"):
            part = doc.get(side) if isinstance(doc, dict) else None
            version = part.get("Version") if isinstance(part, dict) else None
            if isinstance(version, str) and version.strip():
                return version.strip()
        return None
    words = text.split()
    if len(words) >= 3 and words[1] == "version":
        return words[2]
    return None


def ulimit_args(nofile_hard: int, nproc_hard: int, pid_max: int | None) -> list[str]:
    """``--ulimit`` options within the limits this machine allows. podman asks runc for more
    open files and processes than some machines' hard limits (runc then fails with "rlimit type
    7", then "type 6"), and caps the process limit at ``pid_max`` itself."""
    inf = resource.RLIM_INFINITY
    nofile = _NOFILE_DEFAULT if nofile_hard in (inf, -1) else nofile_hard
    nproc_limits = [n for n in (nproc_hard, pid_max) if n is not None and n not in (inf, -1)]
    args = ["--ulimit", f"nofile={nofile}:{nofile}"]
    if nproc_limits:
        nproc = min(nproc_limits)
        args += ["--ulimit", f"nproc={nproc}:{nproc}"]
    return args


def host_ulimit_args() -> list[str]:
    """``ulimit_args`` for this process's hard limits (its children, podman among them, get
    the same) and the kernel's ``pid_max``."""
    pid_max: int | None = None
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read().strip())
    return ulimit_args(
        resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        resource.getrlimit(resource.RLIMIT_NPROC)[1],
        pid_max,
    )


def is_static_elf(path: str) -> bool:
    """Is ``path`` an ELF executable without a program interpreter (runs alone in an empty
    root filesystem)? False for anything it can't read or parse."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF":
                return False
            bits, order = head[4], head[5]
            end = "<" if order == 1 else ">"
            if bits == 2:
                phoff, phentsize, phnum = (
                    struct.unpack_from(end + "Q", head, 32)[0],
                    *struct.unpack_from(end + "HH", head, 54),
                )
            elif bits == 1:
                phoff, phentsize, phnum = (
                    struct.unpack_from(end + "I", head, 28)[0],
                    *struct.unpack_from(end + "HH", head, 42),
                )
            else:
                return False
            if phnum == 0 or phnum > 512 or phentsize < 4:
                return False
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except (OSError, struct.error):
        return False
    if len(table) < phentsize * phnum:
        return False
    pt_interp = 3
    return all(
        struct.unpack_from(end + "I", table, i * phentsize)[0] != pt_interp for i in range(phnum)
    )


def selftest_argv(
    podman: str,
    oci_runtime: str | None,
    name: str,
    rootfs: str,
    ulimits: Sequence[str],
    *,
    static_busybox: bool,
) -> list[str]:
    """The self-test's command: a container from a local root filesystem, no network, no pull,
    that prints SELFTEST_MARKER and exits."""
    argv = [podman]
    if oci_runtime:
        argv += ["--runtime", oci_runtime]
    argv += ["run", "--rm", "--name", name, "--network", "none", *ulimits]
    if static_busybox:
        return [*argv, "--rootfs", rootfs, "/bin/busybox", "echo", SELFTEST_MARKER]
    for d in _HOST_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            argv += ["-v", f"{d}:{d}:ro"]
        elif os.path.islink(d):
            # merged /usr: /lib -> usr/lib, kept as the same link inside
            argv += ["-v", f"{os.path.realpath(d)}:{d}:ro"]
    return [*argv, "--rootfs", rootfs, "/usr/bin/echo", SELFTEST_MARKER]


def _clip(text: str, most: int) -> str:
    data = text.replace("\x00", "\\x00").encode("utf-8", "replace")
    if len(data) <= most:
        return data.decode("utf-8", "replace")
    return data[: most - 3].decode("utf-8", "ignore") + "..."


@dataclass(slots=True)
class _Verdict:
    works: bool
    note: str | None
    at: float


@dataclass(slots=True)
class ContainerRuntimeProbe:
    """One detection source, kept by its caller across detections so that its self-test runs
    once per podman (path, version, OCI runtime) rather than at every refresh."""

    settings: ContainerSettings = field(default_factory=ContainerSettings)
    clock: Callable[[], float] = time.monotonic
    ulimits: Callable[[], list[str]] = host_ulimit_args
    name: str = "containers"
    selftests: int = 0  # self-tests run, for tests
    _verdicts: dict[tuple[str, str | None, str | None], _Verdict] = field(default_factory=dict)

    def forget(self) -> None:
        """The next detection runs the self-test again (a doctor request: an admin fixed
        something)."""
        self._verdicts = {}

    def time_limit(self, ctx: ProbeContext) -> float:
        """Its commands' bounds in a row: version (twice at worst), info, a Mac's machine
        inspect, the self-test, and removing a self-test container that outlived it."""
        return 5 * ctx.timeout + self.settings.test_timeout

    async def probe(self, ctx: ProbeContext) -> Finding:
        found = Finding(self.name)
        s = self.settings
        if s.podman is None:
            found.note(
                "not looked for (GPULAYER_PROBE_PODMAN=none): container jobs are not placed here"
            )
            return found
        exe = resolve(s.podman)
        if exe is None:
            found.note(
                f"{s.podman} not found on PATH: container jobs are not placed here "
                f"(install: {INSTALL_HINT})"
            )
            return found
        notes: list[str] = []
        version = await self._version(ctx, exe, notes)
        oci = s.oci_runtime or self._runc()
        reported_oci = oci
        if oci is None:
            reported_oci = await self._default_oci(ctx, exe, notes)
        cdi, cdi_notes = await asyncio.to_thread(_cdi_names, ctx.cdi_dirs)
        notes += cdi_notes
        provider = await self._machine(ctx, exe, found) if ctx.system == "darwin" else None
        key = (exe, version, oci)
        verdict = self._verdicts.get(key)
        if verdict is None or (
            not verdict.works and self.clock() - verdict.at >= s.retest_failed_s
        ):
            verdict = await self._selftest(ctx, exe, oci)
            self._verdicts = {key: verdict}  # only the current podman's answer is kept
        if verdict.note is not None:
            notes.append(verdict.note)
        found.container_runtime = ContainerRuntime(
            name=_clip(os.path.basename(s.podman), MAX_SHORT_TEXT_BYTES),
            version=None if version is None else _clip(version, MAX_SHORT_TEXT_BYTES),
            oci_runtime=None if reported_oci is None else _clip(reported_oci, MAX_SHORT_TEXT_BYTES),
            works=verdict.works,
            notes=[_clip(n, MAX_NOTE_BYTES) for n in notes[:MAX_NOTES]],
            cdi_devices=cdi,
            machine_provider=provider,
        )
        return found

    @staticmethod
    async def _machine(ctx: ProbeContext, exe: str, found: Finding) -> str | None:
        """On macOS, containers run in a podman machine: its provider, and the GPU APIs that
        gives them (``podman_machine``). Texts are clipped: the machine's name is the user's."""
        most = MAX_NOTE_BYTES - len(found.source) - 2
        result = await ctx.run([exe, *INSPECT_ARGV], ctx.timeout)
        try:
            if not result.ok:
                raise MachineInspectError(_describe(result))
            info = parse_machine_inspect(result.stdout)
        except MachineInspectError as err:
            found.note(_clip(f"podman machine unknown: podman machine inspect: {err}", most))
            return None
        apis, note = machine_container_apis(info)
        found.container_apis.update({k: _clip(v, MAX_NOTE_BYTES) for k, v in apis.items()})
        if note is not None:
            found.note(_clip(note, most))
        return None if info.provider is None else _clip(info.provider, MAX_SHORT_TEXT_BYTES)

    @staticmethod
    def _runc() -> str | None:
        path = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
        return "runc" if shutil.which("runc", path=path) else None

    async def _version(self, ctx: ProbeContext, exe: str, notes: list[str]) -> str | None:
        result = await ctx.run([exe, "version", "--format", "json"], ctx.timeout)
        version = parse_podman_version(result.stdout) if result.ok else None
        if version is None:
            # Older podman has no --format on version; --version always answers.
            plain = await ctx.run([exe, "--version"], ctx.timeout)
            version = parse_podman_version(plain.stdout) if plain.ok else None
            if version is None:
                notes.append(f"version unknown: podman --version: {_describe(plain)}")
        return version

    async def _default_oci(self, ctx: ProbeContext, exe: str, notes: list[str]) -> str | None:
        result = await ctx.run([exe, "info", "--format", "{{.Host.OCIRuntime.Name}}"], ctx.timeout)
        name = result.stdout.strip() if result.ok else ""
        if not name or len(name.split()) != 1:
            notes.append(f"OCI runtime unknown: podman info: {_describe(result)}")
            return None
        return name

    async def _selftest(self, ctx: ProbeContext, exe: str, oci: str | None) -> _Verdict:
        self.selftests += 1
        s = self.settings
        name = f"gpulayer-selftest-{uuid.uuid4().hex[:12]}"
        rootfs = await asyncio.to_thread(tempfile.mkdtemp, "", "gpulayer-selftest-", s.tmp_dir)
        try:
            static = await asyncio.to_thread(_prepare_rootfs, rootfs, s.busybox)
            argv = selftest_argv(exe, oci, name, rootfs, self.ulimits(), static_busybox=static)
            remove = [exe, "rm", "--force", "--time", "0", name]
            try:
                result = await ctx.run(argv, s.test_timeout)
            except asyncio.CancelledError:
                # Stopped meanwhile (the service stops, a doctor asks again): the podman the
                # runner killed may leave its container behind.
                await asyncio.shield(ctx.run(remove, ctx.timeout))
                raise
            if result.error is not None:
                # A killed podman may leave its container behind: remove it, bounded too.
                await ctx.run(remove, ctx.timeout)
        finally:
            await asyncio.to_thread(shutil.rmtree, rootfs, True)
        works = result.ok and SELFTEST_MARKER in result.stdout
        note = None
        if not works:
            how = "a static busybox" if static else "the host's /usr and /lib read-only"
            note = f"self-test failed (podman run --rootfs with {how}): {_describe(result)}"
        return _Verdict(works, note, self.clock())


def runtime_pending() -> Finding:
    """The note for a container runtime not detected yet (the service's first publish)."""
    found = Finding("containers")
    found.note("detection pending: no container runtime reported yet")
    return found


def _describe(result: RunResult) -> str:
    if result.ok:
        return "answered without the expected output"
    return result.describe()


def _prepare_rootfs(rootfs: str, busybox: str) -> bool:
    """Copy a static busybox into ``rootfs``; False when there is none (the host's folders
    are bound instead)."""
    if not is_static_elf(busybox):
        return False
    os.makedirs(os.path.join(rootfs, "bin"), exist_ok=True)
    shutil.copy2(busybox, os.path.join(rootfs, "bin", "busybox"))
    return True


def _cdi_names(dirs: Sequence[str]) -> tuple[list[str], list[str]]:
    """The qualified names the CDI specs in ``dirs`` name (each once, bounded), and notes."""
    devices, problems = read_cdi_devices(dirs)
    notes = [f"CDI: {p}" for p in problems]
    names: list[str] = []
    seen: set[str] = set()
    too_long = 0
    for d in devices:
        q = d.qualified
        if len(q.encode()) > MAX_SHORT_TEXT_BYTES:
            too_long += 1
        elif q not in seen:
            seen.add(q)
            names.append(q)
    if too_long:
        notes.append(f"CDI: {too_long} device name(s) over {MAX_SHORT_TEXT_BYTES} bytes left out")
    if len(names) > MAX_CDI_DEVICES:
        notes.append(f"CDI: {len(names) - MAX_CDI_DEVICES} more device(s) not listed")
        names = names[:MAX_CDI_DEVICES]
    return names, notes

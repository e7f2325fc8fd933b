"""GPU nodes on hosts of their own, for the deployment test: each node is a podman container
running systemd as PID 1 (``--systemd=always``), on the test's podman network, where gpulayer
is installed as a team installs it on a machine: ``deploy/install-node`` from the wheels
``make wheels`` made, the units of ``deploy/systemd``, NATS over TLS.

Not collected by pytest (no ``test_`` prefix): ``make deploy-test`` drives it. Every podman
call runs with ``CONTAINERS_CONF`` set to deploy/podman/containers.conf (runc: crun refuses
this host's hybrid cgroups). Each wait is bounded; its error says what it waited for and
shows the unit's journal.

**cgroups.** On a cgroup v1 (hybrid) host, podman mounts the v1 controllers read-only in a
systemd container (only systemd's own ``name=systemd`` hierarchy is writable), so an executor
there can make no job cgroup, enforces nothing and says ``enforcement: none`` in its heartbeat
(jobs still run, and are tracked by their ``GPULAYER_GRANT_ID``). A real node's executor runs
under the host's systemd with ``Delegate=yes`` and writable controllers. ``start_node`` gives
the node that by default (``writable_cgroups=True``): the host's ``/sys/fs/cgroup`` bound
read-write, so the node's systemd makes its units' cgroups below the container's own
(``/libpod_parent/libpod-<id>/...``; the node's processes can't name any other, the host's
cgroup namespace being the node's), the executor's ``Delegate=yes`` subtree is writable, and
its jobs get memory, CPU, pids and device limits, ``cgroup v1: memory cpu pids devices`` in its
heartbeat. That is the node under test. The price: a root process in the node could write any
cgroup of the host (move itself out of its limits, change another container's); the node is
a test fixture on a test machine, so that is accepted. ``writable_cgroups=False`` keeps
podman's read-only mounts, for the ``enforcement: none`` case.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = REPO / "deploy" / "podman" / "containers.conf"
FIXTURES = REPO / "tests" / "fixtures"

HOST_IMAGE = "localhost/gpulayer-node-host:bookworm"
# What a node host adds to deploy/image/base's bookworm (python3, its venv module, useradd,
# the CA certificates): systemd as init, the bus systemctl talks to, ps and friends.
HOST_PACKAGES = ("systemd", "systemd-sysv", "dbus", "procps")
# Units that fail in a container and are of no use to a node; masked in the image. None fails
# on this host (systemctl is-system-running says "running"); a host where one does lists it
# here, and the image's digest changes with it.
MASKED_UNITS: tuple[str, ...] = ()
# The image's build, after the base: systemd as the command, and the stop signal systemd
# takes as "shut down" (SIGTERM would only make it re-execute itself).
HOST_CONTAINERFILE = """\
FROM {raw}
RUN {mask}
STOPSIGNAL SIGRTMIN+3
CMD ["/sbin/init"]
LABEL {label}={digest}
"""
LABEL = "org.gpulayer.node-host"
NODE_LABEL = "org.gpulayer.deploy-test.node"

# The units install-node sets up, and where it and its inputs are copied to in a node (the
# repository's layout, so install-node finds dist/wheels and deploy/systemd by itself).
UNITS = ("gpulayer-probe", "gpulayer-executor")
INSTALL_ROOT = "/root/gpulayer"

# Where a fake GPU's nvidia-smi goes: on the units' PATH (both have /usr/local/bin).
FAKE_SMI_BIN = "/usr/local/bin/nvidia-smi"
FAKE_SMI_SHARE = "/usr/local/share/gpulayer-fake-gpu"


class NodeError(RuntimeError):
    """A node did not do what it was asked, or not in time; the message says what and shows
    the output or journal that tells why."""


@dataclass(frozen=True)
class Node:
    """A node container: ``name`` is podman's, ``hostname`` the node's own (and its default
    GPULAYER_NODE_ID)."""

    name: str
    hostname: str


def podman_env() -> dict[str, str]:
    """The environment for every podman call here."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def command(
    argv: Sequence[str | Path],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    check: bool = True,
    input: str | None = None,
    cwd: Path | None = None,
    error: type[Exception] = NodeError,
) -> subprocess.CompletedProcess[str]:
    """One command, its output captured (``env`` default: ``podman_env()``); ``check``: a
    failure, or no answer within ``timeout``, is an ``error`` with the command and its output."""
    args = [str(a) for a in argv]
    try:
        done = subprocess.run(
            args,
            env=dict(env) if env is not None else podman_env(),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise error(f"{shlex.join(args)}: no answer within {timeout:g} s") from err
    if check and done.returncode != 0:
        raise error(
            f"{shlex.join(args)}: exit status {done.returncode}\n{done.stdout}{done.stderr}"
        )
    return done


def podman(
    *args: str, timeout: float = 120, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """One podman call; ``check``: a failure is a NodeError with its output."""
    return command(["podman", *args], timeout=timeout, check=check, input=input)


def _image_label(image: str) -> str:
    done = podman(
        "image", "inspect", "--format", f'{{{{index .Labels "{LABEL}"}}}}', image, check=False
    )
    return done.stdout.strip() if done.returncode == 0 else ""


def host_image_digest() -> str:
    """What the node host image is made of: deploy/image/base, its packages and the build."""
    parts = [
        (REPO / "deploy" / "image" / "base").read_bytes(),
        ",".join(HOST_PACKAGES).encode(),
        " ".join(MASKED_UNITS).encode(),
        HOST_CONTAINERFILE.encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def make_host_image(*, force: bool = False, timeout: float = 600) -> str:
    """``localhost/gpulayer-node-host:bookworm``, made once: deploy/image/base's bookworm
    (mmdebstrap, EXTRA=systemd,...) and a build on it. An image whose label carries the current
    digest is kept (``force``: made again). Returns the tag."""
    digest = host_image_digest()
    if not force and _image_label(HOST_IMAGE) == digest:
        return HOST_IMAGE
    before = podman("image", "inspect", "--format", "{{.Id}}", HOST_IMAGE, check=False)
    raw = f"localhost/gpulayer-node-host:raw-{digest}"
    base = subprocess.run(
        ["bash", str(REPO / "deploy" / "image" / "base"), "podman", raw],
        env={**podman_env(), "EXTRA": ",".join(HOST_PACKAGES)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if base.returncode != 0:
        raise NodeError(
            f"deploy/image/base podman {raw}: exit status {base.returncode}\n{base.stderr}"
        )
    mask = f"systemctl mask {' '.join(MASKED_UNITS)}" if MASKED_UNITS else "true"
    containerfile = HOST_CONTAINERFILE.format(raw=raw, mask=mask, label=LABEL, digest=digest)
    podman(
        "build",
        "-t",
        HOST_IMAGE,
        "-f",
        "-",
        str(REPO / "deploy" / "podman"),
        input=containerfile,
        timeout=timeout,
    )
    podman("rmi", raw, check=False)  # the build's layers keep what it needs
    after = podman("image", "inspect", "--format", "{{.Id}}", HOST_IMAGE).stdout.strip()
    if before.returncode == 0 and before.stdout.strip() != after:
        # The image it replaces, untagged now (kept while a node still uses it).
        podman("rmi", before.stdout.strip(), check=False)
    return HOST_IMAGE


def fake_gpu_files(folder: Path, scenario: str = "h200-1x") -> dict[str, Path]:
    """The files that give a node a recorded GPU: tests/fixtures/nvidia-smi's fake tool and
    ``scenario``'s recordings under /usr/local/share, and /usr/local/bin/nvidia-smi, a wrapper
    (written into ``folder``) that runs the tool with ``FAKE_NVIDIA_SMI_DIR`` set, so the units
    need no setting of their own. The tool is a /bin/sh script (dash on bookworm). For
    ``start_node(files=...)``."""
    recordings = FIXTURES / "nvidia-smi" / scenario
    if not (recordings / "query.txt").is_file():
        raise NodeError(f"no nvidia-smi recording {recordings}")
    wrapper = folder / f"nvidia-smi-{scenario}"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"# A recorded {scenario} (tests/fixtures/nvidia-smi): the deployment test's fake GPU.\n"
        f"FAKE_NVIDIA_SMI_DIR={FAKE_SMI_SHARE}/{scenario} "
        f'exec {FAKE_SMI_SHARE}/fake-nvidia-smi "$@"\n'
    )
    wrapper.chmod(0o755)
    return {
        f"{FAKE_SMI_SHARE}/fake-nvidia-smi": FIXTURES / "nvidia-smi" / "fake-nvidia-smi",
        f"{FAKE_SMI_SHARE}/{scenario}": recordings,
        FAKE_SMI_BIN: wrapper,
    }


def start_node(
    name: str,
    hostname: str,
    network: str,
    *,
    files: Mapping[str, Path] | None = None,
    writable_cgroups: bool = True,
    image: str = HOST_IMAGE,
    timeout: float = 60,
) -> Node:
    """A node container, booted: ``podman run --systemd=always --hostname H --network NET``
    (a container of that name left by an earlier run is removed first). ``files``: node path
    -> host file or folder, copied in (mode kept, owner root) before systemd starts.
    ``writable_cgroups``: see the module's docstring. Returns once systemd says the system is
    running."""
    podman("rm", "--force", "--time", "5", name, check=False)
    args = [
        "create",
        "--systemd=always",
        "--hostname",
        hostname,
        "--network",
        network,
        "--name",
        name,
        "--label",
        f"{NODE_LABEL}={hostname}",
    ]
    if writable_cgroups:
        args += ["--volume", "/sys/fs/cgroup:/sys/fs/cgroup:rw"]
    podman(*args, image)
    node = Node(name, hostname)
    try:
        for dest, source in (files or {}).items():
            if not source.exists():
                raise NodeError(f"{name}: no file {source} to copy to {dest}")
            parent = str(Path(dest).parent)
            if parent != "/":
                _mkdir_in_created(name, parent)
            podman("cp", str(source), f"{name}:{dest}")
        podman("start", name)
        wait_booted(node, timeout=timeout)
    except BaseException:
        podman("rm", "--force", "--time", "5", name, check=False)
        raise
    return node


def _mkdir_in_created(name: str, folder: str) -> None:
    """``mkdir -p`` in a container not started yet (podman exec can't run there, and podman cp
    needs the parent to exist): an empty folder copied to each level, which makes a missing
    one and leaves one that exists as it is."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp).chmod(0o755)  # copied with it: readable by the node's service accounts
        path = Path("/")
        for part in Path(folder).parts[1:]:
            path /= part
            podman("cp", f"{tmp}/.", f"{name}:{path}")


def wait_booted(node: Node, *, timeout: float = 60) -> None:
    """Until ``systemctl is-system-running`` says running. Degraded is an error naming the
    failed units (mask harmless ones in MASKED_UNITS)."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        done = run(node, ["systemctl", "is-system-running"], check=False, timeout=15)
        state = done.stdout.strip()
        if state == "running":
            return
        if state == "degraded":
            failed = run(node, ["systemctl", "--failed", "--no-pager", "--plain"], check=False)
            raise NodeError(
                f"{node.name}: systemd is degraded, failed units:\n{failed.stdout}"
                "(mask those that are harmless in a container: tests/deploy/nodes.py MASKED_UNITS)"
            )
        time.sleep(0.5)
    logs = podman("logs", "--tail", "40", node.name, check=False)
    raise NodeError(
        f"{node.name}: systemd not running after {timeout:g} s "
        f"(is-system-running: {state or 'no answer'})\n{logs.stdout}{logs.stderr}"
    )


def run(
    node: Node,
    argv: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 60,
    user: str | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """A command in the node (``podman exec``), as root unless ``user``."""
    args = ["exec"]
    if input is not None:
        args.append("--interactive")
    if user is not None:
        args += ["--user", user]
    for key, value in (env or {}).items():
        args += ["--env", f"{key}={value}"]
    return podman(*args, node.name, *argv, check=check, timeout=timeout, input=input)


def install(
    node: Node,
    *,
    nats_url: str,
    creds: Path,
    placement_keys: str,
    ca: Path | None,
    wheels: Path = REPO / "dist" / "wheels",
    node_id: str | None = None,
    settings: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> str:
    """gpulayer installed on the node as a team does it: the wheels, deploy/install-node and
    deploy/systemd copied to /root/gpulayer (the repository's layout), the credential and CA
    beside them, then ``deploy/install-node`` with those. ``ca`` None: none given (the system's
    CAs check NATS's certificate). ``settings``: ``--set NAME=VALUE`` each. Returns its output;
    a failure is a NodeError with it."""
    if not (wheels / "constraints.txt").is_file():
        raise NodeError(f"no wheels in {wheels}: make wheels")
    run(node, ["rm", "-rf", INSTALL_ROOT])
    run(node, ["mkdir", "-p", f"{INSTALL_ROOT}/deploy", f"{INSTALL_ROOT}/dist"])
    copies = {
        REPO / "deploy" / "install-node": f"{INSTALL_ROOT}/deploy/install-node",
        REPO / "deploy" / "systemd": f"{INSTALL_ROOT}/deploy/systemd",
        wheels: f"{INSTALL_ROOT}/dist/wheels",
        creds: f"{INSTALL_ROOT}/node.creds",
    }
    if ca is not None:
        copies[ca] = f"{INSTALL_ROOT}/ca.crt"
    for source, dest in copies.items():
        podman("cp", str(source), f"{node.name}:{dest}")
    argv = [
        f"{INSTALL_ROOT}/deploy/install-node",
        "--nats-url",
        nats_url,
        "--creds",
        f"{INSTALL_ROOT}/node.creds",
        "--placement-keys",
        placement_keys,
    ]
    if ca is not None:
        argv += ["--ca", f"{INSTALL_ROOT}/ca.crt"]
    if node_id is not None:
        argv += ["--node-id", node_id]
    for key, value in (settings or {}).items():
        argv += ["--set", f"{key}={value}"]
    done = run(node, argv, check=False, timeout=timeout)
    if done.returncode != 0:
        raise NodeError(
            f"{node.name}: install-node failed (exit status {done.returncode})\n"
            f"{done.stdout}{done.stderr}"
        )
    return done.stdout + done.stderr


def journal(node: Node, unit: str, *, lines: int | None = None, since: float | None = None) -> str:
    """``journalctl -u UNIT --no-pager`` in the node: the last ``lines`` only, and only what
    was logged from ``since`` on (a ``time.time()``: the node's clock is the host's), if given.
    The journal keeps what earlier runs of the unit said: ``since`` keeps a wait from taking
    their lines for news."""
    argv = ["journalctl", "-u", unit, "--no-pager"]
    if lines is not None:
        argv += ["-n", str(lines)]
    if since is not None:
        argv += ["--since", f"@{since:.6f}"]
    return run(node, argv, check=False, timeout=30).stdout


def systemctl(node: Node, verb: str, *units: str, check: bool = True) -> str:
    """``systemctl VERB UNIT...`` in the node (restart, stop, start, is-active, ...)."""
    return run(node, ["systemctl", verb, *units], check=check, timeout=120).stdout


def wait_active(node: Node, units: Iterable[str] = UNITS, *, timeout: float = 60) -> None:
    """Until every unit is active (started and not failed, not restarting)."""
    deadline = time.monotonic() + timeout
    pending = list(units)
    while pending and time.monotonic() < deadline:
        state = run(node, ["systemctl", "is-active", *pending], check=False).stdout.split()
        pending = [u for u, s in zip(pending, state, strict=False) if s != "active"]
        if pending:
            time.sleep(0.5)
    if pending:
        raise NodeError(
            f"{node.name}: {', '.join(pending)} not active after {timeout:g} s\n"
            + "".join(_status_and_journal(node, u) for u in pending)
        )


def wait_journal(
    node: Node, unit: str, text: str, *, since: float | None = None, timeout: float = 60
) -> str:
    """Until a line of the unit's journal (from ``since`` on, if given) holds ``text``;
    returns that line."""
    deadline = time.monotonic() + timeout
    while True:
        for line in journal(node, unit, since=since).splitlines():
            if text in line:
                return line
        if time.monotonic() >= deadline:
            raise NodeError(
                f"{node.name}: no {text!r} in {unit}'s journal after {timeout:g} s\n"
                + _status_and_journal(node, unit)
            )
        time.sleep(0.5)


def _status_and_journal(node: Node, unit: str) -> str:
    status = run(node, ["systemctl", "status", "--no-pager", "--lines=0", unit], check=False)
    return f"--- {unit}:\n{status.stdout}{journal(node, unit, lines=40)}"


def remove_node(node: Node | str) -> None:
    """The node container gone (``podman rm --force``), its cgroups with it."""
    name = node.name if isinstance(node, Node) else node
    podman("rm", "--force", "--time", "5", name, check=False, timeout=60)


def nodes_left() -> list[str]:
    """Names of node containers this module started that still exist (any run's)."""
    done = podman("ps", "--all", "--filter", f"label={NODE_LABEL}", "--format", "{{.Names}}")
    return done.stdout.split()

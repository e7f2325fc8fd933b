"""A test's own network namespace, linked to this one by a veth pair on a private /30: a host
of the test's own to run a node's services in, and to cut off (the link taken down on the
namespace's side) and bring back. Nothing leaves the machine: the namespace has no other link
and no route but the one to this end of the pair.

Needs root and ``ip`` (iproute2); ``nsenter`` (util-linux) runs a command inside, in this mount
namespace (``ip netns exec`` would remount /sys, hiding the cgroup hierarchies from the
executor run there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from types import TracebackType


def unavailable() -> str | None:
    """Why a namespace can't be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 util-linux)"
    probe = f"glp{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


class NetNs:
    """``with NetNs() as ns``: the namespace ``ns.name``, reached from here at ``ns.host_ip``
    (this end of the link, where servers listen for it); ``ns.argv(cmd)`` runs a command
    inside; ``cut()`` and ``restore()`` take its link down and up again."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:8]
        self.name = f"gpulayer-test-{tag}"
        self.host_if, self.ns_if = f"glh{tag}", f"gln{tag}"
        # A /30 of 10.231.0.0/16 picked at random: two runs at once (pytest-xdist) get their
        # own (a clash only makes the second one fail to add its address, loudly).
        block = int(tag[:4], 16) % (1 << 14)
        base = f"10.231.{block >> 6}.{(block & 63) * 4}"
        prefix = base.rsplit(".", 1)[0]
        last = int(base.rsplit(".", 1)[1])
        self.host_ip, self.ns_ip = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"

    def __enter__(self) -> NetNs:
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            _ip("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if, ns=self.name)
            _ip("link", "set", self.ns_if, "up", ns=self.name)
            _ip("link", "set", "lo", "up", ns=self.name)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def argv(self, command: list[str]) -> list[str]:
        """``command`` run inside the namespace (and nothing else changed)."""
        return ["nsenter", f"--net=/run/netns/{self.name}", "--", *command]

    def cut(self) -> None:
        """The namespace loses its link: its connections go silent, new ones can't be made."""
        _ip("link", "set", self.ns_if, "down", ns=self.name)

    def restore(self) -> None:
        _ip("link", "set", self.ns_if, "up", ns=self.name)

    def close(self) -> None:
        # Deleting one end of a veth pair deletes both.
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

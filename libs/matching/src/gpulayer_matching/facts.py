"""What a node offers, derived once per ``WorkerCapabilities`` object, and the parsing caches the
rules share (the same specifiers and versions recur across jobs and nodes).

A fleet keeps its capabilities objects across calls (``fleet.Fleet`` does), so everything derived
from them (parsed compute capabilities, canonical framework names, the verdict of each job shape)
is computed once per node and shape.
"""

from __future__ import annotations

import functools
import itertools

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_contracts.jobs import MemoryKind
from gpulayer_contracts.validation import parse_compute_capability
from gpulayer_matching.verdicts import Cap

__all__ = ["FACTS", "Device", "Facts", "facts_of", "satisfies", "specifier", "version_key"]


@functools.lru_cache(maxsize=4096)
def specifier(text: str) -> SpecifierSet | None:
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        return None


@functools.lru_cache(maxsize=16384)
def satisfies(spec: str, version: str) -> bool | None:
    """Does ``version`` satisfy ``spec``? None when the version can't be parsed.

    Pre-releases count: a node that has ``torch 2.6.0a0+git...`` installed (NVIDIA's containers
    do) has a torch >= 2.5; ``>=2.6`` still excludes it, as PEP 440 orders 2.6.0a0 < 2.6.
    """
    parsed = specifier(spec)
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return parsed is not None and parsed.contains(v, prereleases=True)


def version_key(text: str) -> tuple[int, Version | str]:
    """Sort key: versions in PEP 440 order, after anything that isn't one."""
    try:
        return 1, Version(text)
    except InvalidVersion:
        return 0, text


@functools.lru_cache(maxsize=1024)
def _device_cc(text: str) -> tuple[int, int] | None:
    try:
        return parse_compute_capability(text)
    except ValueError:
        return None


class Device:
    __slots__ = ("cc", "driver", "index", "kind", "mib", "mig")

    def __init__(
        self,
        index: int,
        mib: int | None,
        kind: MemoryKind | None,
        cc: tuple[int, int] | None,
        driver: str | None,
        mig: str | None = None,
    ) -> None:
        self.index = index
        self.mib = mib
        self.kind = kind
        self.cc = cc
        self.driver = driver
        self.mig = mig  # the MIG profile when this device is a MIG instance


class Facts:
    __slots__ = (
        "apis_containers",
        "apis_host",
        "backends",
        "caps",
        "family",
        "frameworks",
        "fwcaps",
        "launchers",
        "mib",
        "python",
        "results",
        "unusable",
        "usable",
    )

    def __init__(self, caps: WorkerCapabilities) -> None:
        self.caps = caps
        self.family = caps.platform_family
        usable: dict[str, list[Device]] = {}
        unusable: set[str] = set()
        seen: set[int] = set()
        for d in sorted(caps.accelerators, key=lambda d: d.index):
            # Holds are kept per node by index alone, so an index reported twice is ambiguous:
            # the first report wins.
            if d.index in seen:
                continue
            seen.add(d.index)
            if not d.execution_supported:
                unusable.add(d.accelerator)
                continue
            cc = _device_cc(d.compute_capability) if d.compute_capability is not None else None
            mig = (d.mig_profile or "MIG") if d.mig_parent is not None else None
            usable.setdefault(d.accelerator, []).append(
                Device(d.index, d.memory_mib, d.memory_kind, cc, d.driver_version, mig)
            )
        self.usable = {acc: tuple(devs) for acc, devs in usable.items()}
        # Each usable device's memory, for shared jobs' reservations (index -> MiB).
        self.mib = {d.index: d.mib for devs in usable.values() for d in devs if d.mib is not None}
        self.unusable = frozenset(unusable)
        self.frameworks = {canonicalize_name(k): v for k, v in caps.frameworks.items()}
        self.python = caps.workload_python_version
        self.fwcaps = frozenset(caps.framework_capabilities)
        self.apis_host = frozenset(caps.gpu_apis.host)
        self.apis_containers = frozenset(caps.gpu_apis.containers)
        self.backends = frozenset(caps.distributed_backends)
        self.launchers = frozenset(caps.launchers)
        # The per-node result cache: job shape key (``Plan.key``) -> verdict.
        self.results: dict[int, Cap] = {}


# Keyed by id(): WorkerCapabilities isn't hashable. The entry keeps its object alive, so the id
# can't be reused by another object while the entry exists; ``facts.caps is caps`` re-checks.
FACTS: dict[int, Facts] = {}
_FACTS_MAX = 32_768


def facts_of(caps: WorkerCapabilities) -> Facts:
    facts = FACTS.get(id(caps))
    if facts is not None and facts.caps is caps:
        return facts
    if len(FACTS) >= _FACTS_MAX:
        # Oldest quarter first: nodes that re-detected left their old objects behind.
        for k in list(itertools.islice(FACTS, _FACTS_MAX // 4)):
            del FACTS[k]
    facts = FACTS[id(caps)] = Facts(caps)
    return facts

"""The matcher: a pure function from a job and node states to a placement or the reasons why not.

No I/O. The placement service fetches node views, calls :func:`match`, persists and publishes.
The rules are written down in ``docs/placement-rules.md``; this module is their only
implementation: :func:`match`, :func:`explain` and :func:`would_fit_when_idle` all go through
the same two steps, so a placement and its explanation can never disagree.

1. ``_capability``: does the node, idle and online, offer what the job needs? (What it offers
   is fixed until the node re-detects, so the answer is cached per capabilities object and job
   shape.) A node that fails says which rule failed first, in ``_R_*`` rank order, and its value for
   the nearest miss.
2. ``_place``: given that, which free devices does the job get now?

Speed: a fleet keeps its ``WorkerCapabilities`` objects across calls (``fleet.Fleet`` does), so
everything derived from them (parsed compute capabilities, canonical framework names, the
verdict of each job shape) is computed once per node and shape; the hot loop is a dict lookup
and a few set tests per node. Explanation strings are only built when no node fits.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Final, TypeVar

import msgspec
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from gpulayer_contracts import matrix
from gpulayer_contracts.capabilities import WorkerCapabilities
from gpulayer_contracts.jobs import Accelerator, GpuUse, JobRequest, MemoryKind
from gpulayer_contracts.validation import (
    effective_gpu,
    effective_use,
    parse_compute_capability,
    requested_gpu_count,
)
from gpulayer_matching.resources import job_memory_bytes, job_millicores, need_mib

__all__ = [
    "Decision",
    "NoPlacement",
    "NodeView",
    "Placement",
    "explain",
    "match",
    "would_fit_when_idle",
]

_Num = TypeVar("_Num", int, tuple[int, int])

MIB: Final = 1 << 20
GB: Final = 10**9
# Order in which GPU accelerators are tried when a job names none. ROCm stays in the list so
# that it starts being used the day the support matrix raises it.
GPU_ORDER: Final[tuple[Accelerator, ...]] = ("cuda", "mps", "rocm")


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """What the matcher knows of one node at this moment."""

    node_id: str
    capabilities: WorkerCapabilities
    online: bool = True
    # The node's executor sent heartbeats and then stopped: grants would only queue there.
    # (A node whose executor was never heard from, e.g. one placement just started, counts
    # as having one.)
    executor_down: bool = False
    # Device indices held by an exclusive allocation, and those used by shared jobs.
    exclusive: frozenset[int] = frozenset()
    shared: frozenset[int] = frozenset()
    # Host resources jobs may hold (``resources``: cores in millicores, RAM in bytes, the
    # executor's job slots): what the node offers in all (its report less the executor's
    # reserve) and what is free now. None: the node hasn't said, and no limit is applied.
    cpu_total: int | None = None
    cpu_free: int | None = None
    memory_total: int | None = None
    memory_free: int | None = None
    slots_total: int | None = None
    slots_free: int | None = None
    # MiB of GPU memory shared jobs hold, per device index (only devices with any).
    gpu_reserved: dict[int, int] = {}
    # Devices that get no new grants for their health (unhealthy or degraded, from the probe's
    # observations; a sick GPU's MIG instances too), and why, per device index. Kept here, not
    # in the capabilities: health changes far more often, and the capability verdicts cached
    # per capabilities object stay valid.
    sick: frozenset[int] = frozenset()
    health: dict[int, str] = {}


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where the job goes. ``devices``: sorted indices it holds (none for ``use = "none"``)."""

    node_id: str
    accelerator: Accelerator
    devices: list[int]
    use: GpuUse


class NoPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """Why a job can't be placed now. ``unsatisfiable``: no node in the fleet could ever run it,
    even with every device free and every node online.

    ``reasons`` has one entry per rule that ruled nodes out, in rule order; each node is counted
    under the first rule it fails, so the counts add up to ``total - can_run_now``.
    ``ruled_out`` has the same counts keyed by rule name (stable, usable as a metric label).
    """

    summary: str
    reasons: list[str]
    unsatisfiable: bool
    total: int = 0
    can_run_now: int = 0
    could_run: int = 0
    ruled_out: dict[str, int] = {}


Decision = Placement | NoPlacement


def match(job: JobRequest, nodes: Sequence[NodeView]) -> Decision:
    """First node, in the order given, that satisfies every requirement of ``job`` now.

    The caller orders (rotates) the nodes; the first that fits wins, so a fitting node near the
    front costs O(1). When none fits, the answer is :func:`explain`'s breakdown.
    """
    plan = _compile(job)
    if plan.failure is None:
        key = plan.key
        for view in nodes:
            if not view.online or view.executor_down:
                continue
            caps = view.capabilities
            facts = _FACTS.get(id(caps))
            if facts is None or facts.caps is not caps:
                facts = _facts(caps)
            cap = facts.results.get(key)
            if cap is None:
                cap = _capability(plan, facts)
            if cap.ok and _host_miss(plan, view) is None:
                placed = _place(plan, cap, view)
                if isinstance(placed, Placement):
                    return placed
    return _explain(plan, nodes)


def explain(job: JobRequest, nodes: Sequence[NodeView]) -> NoPlacement:
    """The full per-rule breakdown over ``nodes``, also when some node could take the job now
    (then ``can_run_now`` > 0 and the summary starts with that count)."""
    return _explain(_compile(job), nodes)


def would_fit_when_idle(job: JobRequest, node: NodeView | WorkerCapabilities) -> bool:
    """True when the node, online and with every device free, satisfies every requirement.

    ``gpulayer check`` asks this of the local probe's capabilities; :class:`NoPlacement`'s
    ``unsatisfiable`` is this being false for every node.
    """
    plan = _compile(job)
    if plan.failure is not None:
        return False
    if isinstance(node, NodeView):
        caps = node.capabilities
        cpu, memory = node.cpu_total, node.memory_total
    else:
        caps = node
        cpu = None if caps.host.cpu_cores is None else caps.host.cpu_cores * 1000
        memory = caps.host.memory_bytes
    if (cpu is not None and plan.millicores > cpu) or (
        memory is not None and plan.mem_bytes > memory
    ):
        return False
    return _cached_capability(plan, caps).ok


# --- Parsing, cached: the same specifiers and versions recur across jobs and nodes. ---


@functools.lru_cache(maxsize=4096)
def _specifier(text: str) -> SpecifierSet | None:
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        return None


@functools.lru_cache(maxsize=16384)
def _satisfies(spec: str, version: str) -> bool | None:
    """Does ``version`` satisfy ``spec``? None when the version can't be parsed.

    Pre-releases count: a node that has ``torch 2.6.0a0+git...`` installed (NVIDIA's containers
    do) has a torch >= 2.5; ``>=2.6`` still excludes it, as PEP 440 orders 2.6.0a0 < 2.6.
    """
    parsed = _specifier(spec)
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    return parsed is not None and parsed.contains(v, prereleases=True)


@functools.lru_cache(maxsize=1024)
def _device_cc(text: str) -> tuple[int, int] | None:
    try:
        return parse_compute_capability(text)
    except ValueError:
        return None


# --- What a node offers, derived once per capabilities object. ---


class _Device:
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


class _Cap:
    """A node's verdict for one job shape, with every device free and the node online.

    ok: every capability rule passes. ``pools``: per accelerator that passes, the indices of
    the devices that satisfy the per-device rules, in index order. When not ok: ``rank`` and
    ``rule`` name the first rule failed, ``value`` is the node's nearest-miss value for it.
    """

    __slots__ = ("mib", "mode", "ok", "pools", "rank", "rule", "use", "value")

    def __init__(
        self,
        *,
        ok: bool,
        use: GpuUse = "none",
        mode: int = 0,
        pools: tuple[tuple[Accelerator, tuple[int, ...], frozenset[int]], ...] = (),
        rank: int = 0,
        rule: str = "",
        value: object = None,
        mib: dict[int, int] | None = None,
    ) -> None:
        self.ok = ok
        self.mib = mib if mib is not None else {}
        self.use = use
        self.mode = mode
        self.pools = pools
        self.rank = rank
        self.rule = rule
        self.value = value


class _Facts:
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
        usable: dict[str, list[_Device]] = {}
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
                _Device(d.index, d.memory_mib, d.memory_kind, cc, d.driver_version, mig)
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
        self.results: dict[int, _Cap] = {}


# Keyed by id(): WorkerCapabilities isn't hashable. The entry keeps its object alive, so the id
# can't be reused by another object while the entry exists; ``facts.caps is caps`` re-checks.
_FACTS: dict[int, _Facts] = {}
_FACTS_MAX = 32_768
_RESULTS_MAX = 256


def _facts(caps: WorkerCapabilities) -> _Facts:
    facts = _FACTS.get(id(caps))
    if facts is not None and facts.caps is caps:
        return facts
    if len(_FACTS) >= _FACTS_MAX:
        # Oldest quarter first: nodes that re-detected left their old objects behind.
        for k in list(itertools.islice(_FACTS, _FACTS_MAX // 4)):
            del _FACTS[k]
    facts = _FACTS[id(caps)] = _Facts(caps)
    return facts


def _cached_capability(plan: _Plan, caps: WorkerCapabilities) -> _Cap:
    facts = _facts(caps)
    cap = facts.results.get(plan.key)
    return cap if cap is not None else _capability(plan, facts)


# --- What the job needs, compiled once per call. ---


class _Gpu:
    __slots__ = ("apis", "in_container", "use")

    def __init__(self, use: GpuUse, apis: tuple[str, ...], in_container: bool) -> None:
        self.use = use
        self.apis = apis
        self.in_container = in_container


_SHAPES: dict[tuple[object, ...], int] = {}
_SHAPE_IDS = itertools.count()

# Modes: how a job holds devices on a node (its `use` can differ per platform variant).
_COUNT = 1  # gpu_count (or a named GPU accelerator): that many devices
_POOL = 2  # no count, use shared/exclusive (the apis_any runner style): the node's GPU pool
_CPU = 3  # no count, use none: no devices

# Rule ranks: a node is counted under the first rule it fails, in this order; the reasons are
# listed in it. Capability rules come first, then offline, then occupancy.
_R_OS_UNKNOWN = 40
_R_OS = 41
_R_MATRIX = 50
_R_NO_DEVICE = 100
_R_NOT_USABLE = 101
_R_COUNT = 200
_R_MIG = 210  # only MIG instances, and the job can't take one (see _Plan.mig_ok)
_R_KIND_UNKNOWN = 300
_R_KIND = 301
_R_MEM_UNKNOWN = 400
_R_MEM = 401
_R_CC_UNKNOWN = 500
_R_CC = 501
_R_DRIVER_UNKNOWN = 550
_R_DRIVER = 551
_R_APIS = 600
_R_PY_UNKNOWN = 700
_R_PY = 701
_R_FW = 10_000  # + 2 * i (+1 for a version that doesn't match)
_R_FWCAP = 20_000  # + i
_R_BACKEND = 30_000
_R_LAUNCHER = 30_001
_R_CORES = 30_100  # the node offers fewer cores (or less RAM) in all than the job needs
_R_HOST_MEMORY = 30_101
_R_OFFLINE = 40_000
_R_EXECUTOR = 40_001
_R_UNHEALTHY = 40_050  # would fit but for devices kept from new grants by their health
_R_BUSY = 40_100
_R_OK = 1 << 30


class _Plan:
    __slots__ = (
        "acc",
        "backend",
        "candidates",
        "cc",
        "cpu_ok",
        "device_rules",
        "driver",
        "failure",
        "frameworks",
        "from_profile",
        "fwcaps",
        "gb",
        "gpus",
        "job",
        "key",
        "kind",
        "launcher",
        "mem_bytes",
        "mig_ok",
        "millicores",
        "mode_name",
        "n",
        "need_mib",
        "os",
        "profile",
        "python",
    )

    def __init__(self, job: JobRequest) -> None:
        req = job.requirements
        self.job = job
        self.failure: str | None = None
        self.acc = req.accelerator
        self.n = requested_gpu_count(job)
        self.mode_name: matrix.Mode = (
            "distributed" if job.distributed is not None else "independent"
        )
        self.kind = req.gpu_memory_kind
        self.gb = req.gpu_memory_gb
        self.need_mib = None if req.gpu_memory_gb is None else need_mib(req.gpu_memory_gb)
        # A MIG instance goes only to a job that asks for one device and says how much memory
        # it needs: a job without a memory figure expects a whole GPU, and CUDA enumerates one
        # MIG instance per process at most.
        self.mig_ok = self.n == 1 and self.need_mib is not None
        self.millicores = job_millicores(job)
        self.mem_bytes = job_memory_bytes(job)
        self.cc: tuple[int, int] | None = None
        try:
            self.cc = parse_compute_capability(req.min_cuda_compute_capability)
        except ValueError as err:
            self.failure = f"requirements.min_cuda_compute_capability: {err}"
        self.driver = req.driver
        self.os = req.os
        # Which requirements the job's profile supplied: explanations name it for them.
        self.profile = job.profile
        self.from_profile = frozenset(job.profile_fields)
        self.device_rules = (
            self.kind is not None
            or self.gb is not None
            or self.cc is not None
            or self.driver is not None
        )
        self.python = req.python
        self.frameworks = [(canonicalize_name(k), k, v) for k, v in sorted(req.frameworks.items())]
        self.fwcaps = tuple(req.framework_capabilities)
        dist = job.distributed
        self.backend = dist.backend if dist is not None else None
        self.launcher = dist.launcher if dist is not None else None
        self.cpu_ok = matrix.is_schedulable("cpu", self.mode_name)

        if self.acc is None:
            # A compute capability and the NVIDIA driver are CUDA notions: asking for one means
            # asking for CUDA.
            cuda = self.cc is not None or self.driver is not None
            pool: tuple[Accelerator, ...] = ("cuda",) if cuda else GPU_ORDER
        elif self.acc == "cpu":
            pool = ()
        else:
            pool = (self.acc,)
        self.candidates = tuple(a for a in pool if matrix.is_schedulable(a, self.mode_name))
        self.gpus: dict[str | None, _Gpu] = {}

        if self.failure is None:
            self.failure = self._job_failure()
        shape = (
            self.n,
            self.acc,
            self.candidates,
            self.cpu_ok,
            self.kind,
            self.need_mib,
            self.cc,
            self.driver,
            self.os,
            self.python,
            tuple(self.frameworks),
            self.fwcaps,
            self.backend,
            self.launcher,
            self._gpu_shape(job),
        )
        key = _SHAPES.get(shape)
        if key is None:
            if len(_SHAPES) >= 65_536:
                # Ids are never reused (a fresh counter value each time), so forgetting shapes
                # only costs a recomputation of their cached verdicts.
                _SHAPES.clear()
            key = _SHAPES[shape] = next(_SHAPE_IDS)
        self.key = key

    @staticmethod
    def _gpu_shape(job: JobRequest) -> tuple[object, ...]:
        sections = [(None, job.gpu), *sorted((p, v.gpu) for p, v in job.variants.items())]
        return tuple(
            (p, g.use, tuple(g.apis_any), g.in_container) if g is not None else (p,)
            for p, g in sections
        )

    def _job_failure(self) -> str | None:
        """Reasons no node could ever satisfy, whatever it offers."""
        dist = self.job.distributed
        if self.acc is not None and not matrix.is_schedulable(self.acc, self.mode_name):
            level = matrix.support_level(self.acc, self.mode_name)
            return f"{self.acc} is {level} in the support matrix for {self.mode_name} jobs"
        if dist is not None and not self.cpu_ok and not self.candidates:
            return "distributed jobs are not schedulable for any accelerator in the support matrix"
        if self.acc == "cpu" and (self.n > 0 or self.device_rules):
            return "a cpu job cannot ask for GPU devices or GPU memory"
        for field, spec in (("python", self.python), ("driver", self.driver)):
            if spec is not None and _specifier(spec) is None:
                return f"requirements.{field}: {spec!r} is not a PEP 440 version specifier"
        for _, name, spec in self.frameworks:
            if _specifier(spec) is None:
                return (
                    f"requirements.frameworks.{name}: {spec!r} is not a PEP 440 version specifier"
                )
        return None

    def gpu_for(self, family: str | None) -> _Gpu:
        gpu = self.gpus.get(family)
        if gpu is None:
            section = effective_gpu(self.job, family)
            gpu = _Gpu(
                effective_use(self.job, section), tuple(section.apis_any), section.in_container
            )
            self.gpus[family] = gpu
        return gpu


def _compile(job: JobRequest) -> _Plan:
    return _Plan(job)


# --- Step 1: capability rules (node idle and online). ---


def _chain(
    plan: _Plan, facts: _Facts, acc: Accelerator, n: int
) -> tuple[int, str, object, tuple[int, ...]]:
    """Per-device rules for ``n`` devices of ``acc``: (rank reached, rule, value, eligible).

    Each device stands on its own: a node of mixed models passes when ``n`` of its devices each
    satisfy every per-device rule. The value is what the node could give all ``n`` devices: the
    n-th best device. A device whose value is unknown ranks below those that pass and above
    those known to fall short, so a shortfall that an unknown might cover reads "unknown".
    """
    devs = facts.usable.get(acc, ())
    if not devs:
        if acc in facts.unusable:
            return _R_NOT_USABLE, "not_usable", None, ()
        return _R_NO_DEVICE, "no_device", None, ()
    if not plan.mig_ok and any(d.mig is not None for d in devs):
        whole = tuple(d for d in devs if d.mig is None)
        if len(whole) < n and len(devs) >= n:
            profiles = sorted({d.mig for d in devs if d.mig is not None})
            return _R_MIG, "mig", ", ".join(profiles), ()
        devs = whole
    if len(devs) < n:
        return _R_COUNT, "count", len(devs), ()
    if plan.kind is not None:
        kind = plan.kind
        passing = [d for d in devs if d.kind == kind]
        if len(passing) < n:
            unknown = sum(1 for d in devs if d.kind is None)
            if len(passing) + unknown >= n:
                return _R_KIND_UNKNOWN, "memory_kind_unknown", None, ()
            return _R_KIND, "memory_kind", None, ()
        devs = tuple(passing)
    if plan.need_mib is not None:
        need = plan.need_mib
        passing = [d for d in devs if d.mib is not None and d.mib >= need]
        if len(passing) < n:
            miss = _nth_miss([d.mib for d in devs], len(passing), n)
            if miss is None:
                return _R_MEM_UNKNOWN, "memory_unknown", None, ()
            return _R_MEM, "memory", miss, ()
        devs = tuple(passing)
    if plan.cc is not None:
        need_cc = plan.cc
        passing = [d for d in devs if d.cc is not None and d.cc >= need_cc]
        if len(passing) < n:
            cc_miss = _nth_miss([d.cc for d in devs], len(passing), n)
            if cc_miss is None:
                return _R_CC_UNKNOWN, "cc_unknown", None, ()
            return _R_CC, "cc", cc_miss, ()
        devs = tuple(passing)
    if plan.driver is not None:
        spec = plan.driver
        verdicts = [None if d.driver is None else _satisfies(spec, d.driver) for d in devs]
        passing = [d for d, ok in zip(devs, verdicts, strict=True) if ok]
        if len(passing) < n:
            if len(passing) + verdicts.count(None) >= n:
                return _R_DRIVER_UNKNOWN, "driver_unknown", None, ()
            short = [
                d.driver
                for d, ok in zip(devs, verdicts, strict=True)
                if ok is False and d.driver is not None
            ]
            return _R_DRIVER, "driver", max(short, key=_version_key), ()
        devs = tuple(passing)
    return _R_OK, "", None, tuple(d.index for d in devs)


def _nth_miss(values: Sequence[_Num | None], passing: int, n: int) -> _Num | None:
    """The n-th entry of: passing devices, then unknown ones, then the rest best first."""
    unknown = sum(1 for v in values if v is None)
    if passing + unknown >= n:
        return None
    # Passing values are known and larger than every short one, so the short ones are the known
    # values after the top ``passing``.
    known = sorted((v for v in values if v is not None), reverse=True)
    return known[n - 1 - unknown]


def _capability(plan: _Plan, facts: _Facts) -> _Cap:
    cap = _evaluate(plan, facts)
    if len(facts.results) >= _RESULTS_MAX:
        facts.results.clear()
    facts.results[plan.key] = cap
    return cap


def _evaluate(plan: _Plan, facts: _Facts) -> _Cap:
    gpu = plan.gpu_for(facts.family)
    use = gpu.use
    if plan.os is not None and facts.family != plan.os:
        if facts.family is None:
            return _Cap(ok=False, use=use, rank=_R_OS_UNKNOWN, rule="os_unknown")
        return _Cap(ok=False, use=use, rank=_R_OS, rule="os", value=facts.family)
    n = plan.n
    mode = _COUNT if n >= 1 else (_POOL if use != "none" else _CPU)
    pools: list[tuple[Accelerator, tuple[int, ...], frozenset[int]]] = []
    # A cpu-mode job only looks at devices to check per-device rules; it holds none.
    need_devices = mode == _COUNT or plan.device_rules or (mode == _POOL and use == "exclusive")
    if need_devices or mode == _POOL:
        worst: tuple[int, str, object] = (_R_NO_DEVICE, "no_device", None)
        for acc in plan.candidates:
            rank, rule, value, eligible = _chain(plan, facts, acc, max(n, 1))
            if rank == _R_OK:
                pools.append((acc, eligible, frozenset(eligible)))
                if mode != _COUNT:
                    break  # the pool is the first accelerator that has one
            elif rank > worst[0] or (rank == worst[0] and worst[2] is None):
                worst = (rank, rule, value)
        if need_devices and not pools:
            return _Cap(ok=False, use=use, rank=worst[0], rule=worst[1], value=worst[2])
    if (mode == _CPU or not pools) and not plan.cpu_ok:
        # Placed as cpu work (no devices held), which the support matrix may forbid.
        return _Cap(ok=False, use=use, rank=_R_MATRIX, rule="matrix", value=None)

    if gpu.apis:
        offered = facts.apis_containers if gpu.in_container else facts.apis_host
        if not any(a in offered for a in gpu.apis):
            where = "in containers" if gpu.in_container else "on the host"
            value = f"{' / '.join(gpu.apis)} {where}"
            return _Cap(ok=False, use=use, rank=_R_APIS, rule="apis", value=value)
    if plan.python is not None:
        if facts.python is None:
            return _Cap(ok=False, use=use, rank=_R_PY_UNKNOWN, rule="python_unknown")
        ok = _satisfies(plan.python, facts.python)
        if ok is None:
            return _Cap(ok=False, use=use, rank=_R_PY_UNKNOWN, rule="python_unknown")
        if not ok:
            return _Cap(ok=False, use=use, rank=_R_PY, rule="python", value=facts.python)
    for i, (canon, name, spec) in enumerate(plan.frameworks):
        version = facts.frameworks.get(canon)
        ok = None if version is None else _satisfies(spec, version)
        if ok is None:
            return _Cap(
                ok=False, use=use, rank=_R_FW + 2 * i, rule=f"framework_unknown:{name}", value=None
            )
        if not ok:
            return _Cap(
                ok=False, use=use, rank=_R_FW + 2 * i + 1, rule=f"framework:{name}", value=version
            )
    for i, fwcap in enumerate(plan.fwcaps):
        if fwcap not in facts.fwcaps:
            return _Cap(ok=False, use=use, rank=_R_FWCAP + i, rule=f"framework_capability:{fwcap}")
    if plan.backend is not None and plan.backend not in facts.backends:
        return _Cap(ok=False, use=use, rank=_R_BACKEND, rule="backend")
    if plan.launcher is not None and plan.launcher not in facts.launchers:
        return _Cap(ok=False, use=use, rank=_R_LAUNCHER, rule="launcher")
    return _Cap(ok=True, use=use, mode=mode, pools=tuple(pools), mib=facts.mib)


# --- Step 2: occupancy. ---


class _Miss:
    """Why a node that could run the job can't now: one of _BUSY_RULES, and its nearest miss."""

    __slots__ = ("rule", "value")

    def __init__(self, rule: str, value: object) -> None:
        self.rule = rule
        self.value = value


def _host_miss(plan: _Plan, view: NodeView) -> tuple[int, str, object] | None:
    """The first host resource the node can't give the job: what it offers in all (a capability
    rule: never on this node) or what is free now (occupancy). None when all fit or are unknown."""
    total = view.cpu_total
    if total is not None and plan.millicores > total:
        return _R_CORES, "cores", total
    total = view.memory_total
    if total is not None and plan.mem_bytes > total:
        return _R_HOST_MEMORY, "host_memory", total
    free = view.slots_free
    if free is not None and free < 1:
        return _R_BUSY + _BUSY_RULES.index("no_slot"), "no_slot", view.slots_total
    free = view.cpu_free
    if free is not None and plan.millicores > free:
        return _R_BUSY + _BUSY_RULES.index("busy_cores"), "busy_cores", (free, view.cpu_total)
    free = view.memory_free
    if free is not None and plan.mem_bytes > free:
        return _R_BUSY + _BUSY_RULES.index("busy_memory"), "busy_memory", (free, view.memory_total)
    return None


def _roomy(
    plan: _Plan, cap: _Cap, view: NodeView, free: Sequence[int], n: int
) -> Sequence[int] | _Miss:
    """``free`` less the devices where a shared job's ``gpu_memory_gb`` no longer fits beside
    what other shared jobs reserved; a miss when fewer than ``n`` remain."""
    need = plan.need_mib
    reserved = view.gpu_reserved
    if need is None or not reserved:
        return free
    mib = cap.mib
    left = [mib.get(i, 0) - reserved.get(i, 0) for i in free]
    roomy = [i for i, room in zip(free, left, strict=True) if room >= need]
    if len(roomy) >= n:
        return roomy
    return _Miss("busy_gpu_memory", sorted(left, reverse=True)[n - 1] if len(left) >= n else 0)


def _place(plan: _Plan, cap: _Cap, view: NodeView) -> Placement | _Miss:
    """The devices the job gets on this node now, or why not (with the nearest miss)."""
    use = cap.use
    ex = view.exclusive
    if view.sick:
        ex = ex | view.sick  # no new grant on a sick device, in any mode
    sh = view.shared
    if cap.mode == _COUNT:
        n = plan.n
        if use == "none":
            return Placement(node_id=view.node_id, accelerator=cap.pools[0][0], devices=[], use=use)
        most = 0
        memory_miss: _Miss | None = None
        free: Sequence[int]
        for acc, eligible, members in cap.pools:
            if use == "exclusive":
                if ex or sh:
                    taken = members.difference(ex, sh)  # set arithmetic in C: busy nodes are cheap
                    if len(taken) < n:
                        most = max(most, len(taken))
                        continue
                    free = sorted(taken)
                else:
                    free = eligible
                # Lowest free indices: predictable, and leaves the high end contiguous.
                return Placement(
                    node_id=view.node_id, accelerator=acc, devices=list(free[:n]), use=use
                )
            free = sorted(members.difference(ex)) if ex else eligible
            if len(free) < n:
                most = max(most, len(free))
                continue
            roomy = _roomy(plan, cap, view, free, n)
            if isinstance(roomy, _Miss):
                memory_miss = roomy
                continue
            free = roomy
            if sh:
                # Pack shared jobs onto devices already shared, so that whole devices stay free
                # for exclusive jobs; lowest indices within each group.
                free = sorted(free, key=lambda i: i not in sh)
            return Placement(
                node_id=view.node_id, accelerator=acc, devices=sorted(free[:n]), use=use
            )
        if memory_miss is not None:
            return memory_miss
        return _Miss(_busy_rule(cap), most)
    if cap.mode == _POOL:
        if not cap.pools:
            # API alone, on a node with no GPU gpulayer tracks: nothing to hold or show.
            return Placement(node_id=view.node_id, accelerator="cpu", devices=[], use=use)
        acc, eligible, members = cap.pools[0]
        if use == "exclusive":
            if ex or sh:
                free_count = len(members.difference(ex, sh))
                if free_count < len(eligible):
                    return _Miss(_busy_rule(cap), free_count)
            return Placement(node_id=view.node_id, accelerator=acc, devices=list(eligible), use=use)
        free = sorted(members.difference(ex)) if ex else eligible
        if not free:
            return _Miss(_busy_rule(cap), 0)
        roomy = _roomy(plan, cap, view, free, 1)
        if isinstance(roomy, _Miss):
            return roomy
        return Placement(node_id=view.node_id, accelerator=acc, devices=list(roomy), use=use)
    return Placement(node_id=view.node_id, accelerator="cpu", devices=[], use="none")


# --- Explanations: built only when asked or when nothing fits. ---


class _Tally:
    __slots__ = ("best", "best_node", "count", "rank", "seen")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.count = 0
        self.best: object = None
        self.best_node = ""
        self.seen: list[str] = []


def _explain(plan: _Plan, nodes: Sequence[NodeView]) -> NoPlacement:
    total = len(nodes)
    if plan.failure is not None:
        return NoPlacement(
            summary=f"0/{total} nodes can run this job: {plan.failure}",
            reasons=[plan.failure],
            unsatisfiable=True,
            total=total,
            ruled_out={"job": total},
        )
    if total == 0:
        return NoPlacement(
            summary="0/0 nodes can run this job: no nodes in the fleet",
            reasons=["no nodes in the fleet"],
            unsatisfiable=True,
        )
    tallies: dict[str, _Tally] = {}
    fit = could = 0
    key = plan.key
    for view in nodes:
        caps = view.capabilities
        facts = _FACTS.get(id(caps))
        if facts is None or facts.caps is not caps:
            facts = _facts(caps)
        cap = facts.results.get(key)
        if cap is None:
            cap = _capability(plan, facts)
        if not cap.ok:
            _count(tallies, cap.rank, cap.rule, view.node_id, cap.value)
            continue
        miss = _host_miss(plan, view)
        if miss is not None and miss[0] < _R_OFFLINE:
            _count(tallies, miss[0], miss[1], view.node_id, miss[2])
            continue
        could += 1
        if not view.online:
            _count(tallies, _R_OFFLINE, "offline", view.node_id, None)
            continue
        if view.executor_down:
            _count(tallies, _R_EXECUTOR, "executor_down", view.node_id, None)
            continue
        if miss is not None:
            _count(tallies, miss[0], miss[1], view.node_id, miss[2])
            continue
        placed = _place(plan, cap, view)
        if isinstance(placed, Placement):
            fit += 1
        elif view.sick and isinstance(
            _place(plan, cap, msgspec.structs.replace(view, sick=frozenset())), Placement
        ):
            # One node counted; every sick device's reason shown.
            reasons = _sick_reasons(view)
            _count(tallies, _R_UNHEALTHY, "unhealthy", view.node_id, reasons[0])
            seen = tallies["unhealthy"].seen
            seen.extend(r for r in reasons[1:] if r not in seen)
        else:
            rank = _R_BUSY + _BUSY_RULES.index(placed.rule)
            _count(tallies, rank, placed.rule, view.node_id, placed.value)
    ordered = sorted(tallies.items(), key=lambda kv: kv[1].rank)
    reasons = [_reason(plan, rule, t) for rule, t in ordered]
    summary = f"{fit}/{total} nodes can run this job"
    if fit:
        summary += " now"
    if reasons:
        summary += (": " if not fit else "; ruled out: ") + ", ".join(reasons)
    return NoPlacement(
        summary=summary,
        reasons=reasons,
        unsatisfiable=could == 0,
        total=total,
        can_run_now=fit,
        could_run=could,
        ruled_out={rule: t.count for rule, t in ordered},
    )


def _sick_reasons(view: NodeView) -> list[str]:
    """``<node> GPU <i>: <health reason>`` for each sick device, in index order."""
    return [
        f"{view.node_id} GPU {i}: {view.health.get(i, 'unhealthy')}" for i in sorted(view.sick)
    ][:8]


# Occupancy rules, in the order a node is checked: its job slots, cores and RAM, then devices.
_BUSY_RULES = (
    "no_slot",
    "busy_cores",
    "busy_memory",
    "busy_exclusive",
    "busy_shared",
    "busy_pool",
    "busy_pool_shared",
    "busy_gpu_memory",
)


def _busy_rule(cap: _Cap) -> str:
    if cap.mode == _POOL:
        return "busy_pool" if cap.use == "exclusive" else "busy_pool_shared"
    return "busy_exclusive" if cap.use == "exclusive" else "busy_shared"


def _count(tallies: dict[str, _Tally], rank: int, rule: str, node_id: str, value: object) -> None:
    t = tallies.get(rule)
    if t is None:
        t = tallies[rule] = _Tally(rank)
    t.count += 1
    if isinstance(value, str):
        if value not in t.seen:
            t.seen.append(value)
    elif isinstance(value, int):
        if not isinstance(t.best, int) or value > t.best:
            t.best, t.best_node = value, node_id
    elif isinstance(value, tuple) and (not isinstance(t.best, tuple) or value > t.best):
        t.best, t.best_node = value, node_id


_VERBS = {"have": "has", "are": "is", "lack": "lacks", "can't": "can't"}


def _reason(plan: _Plan, rule: str, t: _Tally) -> str:
    verb, rest = _message(plan, rule, t)
    text = f"{t.count} {verb if t.count != 1 else _VERBS[verb]} {rest}"
    if plan.profile is not None and _rule_field(rule) in plan.from_profile:
        text += f" (profile {plan.profile})"
    return text


_RULE_FIELDS = {
    "os": "os",
    "os_unknown": "os",
    "no_device": "accelerator",
    "not_usable": "accelerator",
    "cc": "min_cuda_compute_capability",
    "cc_unknown": "min_cuda_compute_capability",
    "driver": "driver",
    "driver_unknown": "driver",
    "python": "python",
    "python_unknown": "python",
}


def _rule_field(rule: str) -> str | None:
    """The requirement a rule checks, as ``JobRequest.profile_fields`` names it."""
    kind, _, name = rule.partition(":")
    if kind in ("framework", "framework_unknown"):
        return f"frameworks.{name}"
    if kind == "framework_capability":
        return f"framework_capabilities.{name}"
    return _RULE_FIELDS.get(rule)


def _fmt_gb(gb: float) -> str:
    return f"{gb:g}"


def _fmt_cores(millicores: int) -> str:
    return f"{millicores / 1000:g}"


def _fmt_bytes(n: int) -> str:
    """GB of 10^9 bytes, to a tenth (never shown as more than it is)."""
    return f"{math.floor(n / GB * 10) / 10:g}"


def _fmt_mib(mib: int) -> str:
    return f"{mib * MIB / GB:.1f} GB ({mib} MiB)"


def _seen(t: _Tally) -> str:
    shown = sorted(t.seen, key=_version_key, reverse=True)[:3]
    more = ", ..." if len(t.seen) > 3 else ""
    return f" (seen: {', '.join(shown)}{more})"


def _seen_all(t: _Tally) -> str:
    """The values seen, in the order met (at most 3, then a count)."""
    shown = t.seen[:3]
    more = f", ... ({len(t.seen) - 3} more)" if len(t.seen) > 3 else ""
    return f" (seen: {'; '.join(shown)}{more})" if shown else ""


def _version_key(text: str) -> tuple[int, Version | str]:
    try:
        return 1, Version(text)
    except InvalidVersion:
        return 0, text


def _message(plan: _Plan, rule: str, t: _Tally) -> tuple[str, str]:
    """(verb, rest) of one reason; the verb agrees with the count."""
    n = plan.n
    label = plan.acc if plan.acc is not None and plan.acc != "cpu" else "GPU"
    gpus = f"{n} {label} devices" if n > 1 else f"a {label} device"
    if rule == "os_unknown":
        return "have", "unknown operating system"
    if rule == "os":
        return "have", f"an operating system other than {plan.os}{_seen(t)}"
    if rule == "matrix":
        return "can't", f"take {plan.mode_name} cpu work (support matrix)"
    if rule == "no_device":
        if not plan.candidates:
            return "have", "no GPU device this job may use"
        if len(plan.candidates) == 1:
            return "have", f"no {plan.candidates[0]} device"
        return "have", f"no GPU device ({' or '.join(plan.candidates)})"
    if rule == "not_usable":
        return "have", f"{label} devices that can't run work (execution not supported)"
    if rule == "count":
        return "have", f"< {n} usable {label} devices (best: {t.best_node} {t.best})"
    if rule == "mig":
        return "have", (
            f"only MIG instances{_seen_all(t)}, which a job gets only with gpu_count = 1 "
            "and gpu_memory_gb set"
        )
    if rule == "memory_kind_unknown":
        return "have", "unknown GPU memory kind"
    if rule == "memory_kind":
        return "have", f"no {plan.kind}-memory {label} device" + (
            f" for {n} devices" if n > 1 else ""
        )
    if rule == "memory_unknown":
        return "have", "unknown GPU memory"
    if rule == "memory":
        on = f" on {n} GPUs" if n > 1 else ""
        assert plan.gb is not None
        assert isinstance(t.best, int)
        return (
            "have",
            f"< {_fmt_gb(plan.gb)} GB per GPU{on} (best: {t.best_node} {_fmt_mib(t.best)})",
        )
    if rule == "cc_unknown":
        return "have", "unknown compute capability"
    if rule == "cc":
        assert plan.cc is not None
        assert isinstance(t.best, tuple)
        want = f"{plan.cc[0]}.{plan.cc[1]}"
        got = f"{t.best[0]}.{t.best[1]}"
        return "have", f"compute capability < {want} (best: {t.best_node} {got})"
    if rule == "driver_unknown":
        return "have", "unknown NVIDIA driver version"
    if rule == "driver":
        return "have", f"NVIDIA driver not matching {plan.driver}{_seen(t)}"
    if rule == "python_unknown":
        return "have", "unknown Python version"
    if rule == "python":
        return "have", f"Python not matching {plan.python}{_seen(t)}"
    if rule.startswith("framework_unknown:"):
        return "have", f"unknown {rule.partition(':')[2]} version (not reported)"
    if rule.startswith("framework:"):
        name = rule.partition(":")[2]
        spec = dict((k, v) for _, k, v in plan.frameworks)[name]
        return "have", f"{name} not matching {spec}{_seen(t)}"
    if rule.startswith("framework_capability:"):
        return "lack", rule.partition(":")[2]
    if rule == "apis":
        return "have", f"none of the GPU APIs {' or '.join(t.seen)}"
    if rule == "backend":
        return "lack", f"the {plan.backend} distributed backend"
    if rule == "launcher":
        return "lack", f"the {plan.launcher} launcher"
    if rule == "offline":
        return "are", "offline"
    if rule == "executor_down":
        return "have", "no running executor (its heartbeats stopped)"
    if rule == "unhealthy":
        return "have", (
            f"GPUs kept from new grants by their health (unhealthy or degraded){_seen_all(t)}"
        )
    if rule == "busy_exclusive":
        return "have", f"too few free devices (need {gpus}, most free: {t.best_node} {t.best})"
    if rule == "busy_shared":
        return "have", (
            f"too few devices not held exclusively (need {gpus}, most: {t.best_node} {t.best})"
        )
    if rule == "busy_pool":
        return "have", "GPUs in use (exclusive use holds the node's whole GPU pool)"
    if rule == "busy_pool_shared":
        return "have", "every GPU held exclusively"
    if rule == "cores":
        assert isinstance(t.best, int)
        return "have", (
            f"< {_fmt_cores(plan.millicores)} cores for jobs "
            f"(best: {t.best_node} {_fmt_cores(t.best)})"
        )
    if rule == "host_memory":
        assert isinstance(t.best, int)
        return "have", (
            f"< {_fmt_bytes(plan.mem_bytes)} GB of RAM for jobs "
            f"(best: {t.best_node} {_fmt_bytes(t.best)} GB)"
        )
    if rule == "no_slot":
        return "have", "no free job slot"
    if rule == "busy_cores":
        assert isinstance(t.best, tuple)
        free, total = t.best
        return "have", (
            f"{_fmt_cores(free)}/{_fmt_cores(total)} free cores (need {_fmt_cores(plan.millicores)})"
        )
    if rule == "busy_memory":
        assert isinstance(t.best, tuple)
        free, total = t.best
        return "have", (
            f"{_fmt_bytes(free)}/{_fmt_bytes(total)} GB free RAM "
            f"(need {_fmt_bytes(plan.mem_bytes)})"
        )
    if rule == "busy_gpu_memory":
        assert plan.gb is not None
        assert isinstance(t.best, int)
        whose = "its" if t.count == 1 else "their"
        where = (
            f"on {whose} best shared GPU" if n <= 1 else f"per GPU on {whose} best {n} shared GPUs"
        )
        room = max(t.best, 0) * MIB / GB
        return "have", f"{room:.1f} GB free {where} (need {_fmt_gb(plan.gb)})"
    return "have", rule  # pragma: no cover - every rule above has a message

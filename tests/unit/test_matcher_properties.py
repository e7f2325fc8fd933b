"""Property test of the matcher against a straightforward oracle, per device.

The oracle restates docs/placement-rules.md in the plainest code possible (no caching, no
precomputation, its own compute-capability and memory arithmetic), then checks for random jobs
and fleets that:
- a Placement goes to the first node (in the order given) the oracle says can take the job now,
  and the devices it names satisfy every requirement, are distinct, free, of the right count and
  on the right accelerator;
- a NoPlacement means no node can take the job now; ``unsatisfiable`` means no node could even
  when idle and online; the per-rule counts add up to the fleet size;
- explain and would_fit_when_idle agree with the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TypeVar

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from gpulayer_contracts.capabilities import AcceleratorDevice, GpuApis, HostInfo, WorkerCapabilities
from gpulayer_contracts.jobs import Accelerator, GpuUsage, JobRequest, Requirements, Variant
from gpulayer_contracts.validation import validate_job
from gpulayer_matching import (
    NodeView,
    NoPlacement,
    Placement,
    explain,
    match,
    would_fit_when_idle,
)

T = TypeVar("T")

GPU_KINDS = ("cuda", "mps", "rocm")
SCHEDULABLE_GPUS = ("cuda", "mps")  # the support matrix today, for independent jobs


# --- the oracle ---


def cc_tuple(value: object) -> tuple[int, int] | None:
    text = str(value).strip()
    major, _, minor = text.partition(".")
    if not major.isdigit() or (minor and not minor.isdigit()):
        return None
    return int(major), int(minor or 0)


def devices_needed(job: JobRequest) -> int:
    r = job.requirements
    if r.gpu_count == 0 and r.accelerator in GPU_KINDS:
        return 1
    return r.gpu_count


def has_device_rules(job: JobRequest) -> bool:
    r = job.requirements
    return (
        r.gpu_memory_gb is not None
        or r.gpu_memory_kind is not None
        or r.min_cuda_compute_capability is not None
    )


def gpu_section(job: JobRequest, caps: WorkerCapabilities) -> GpuUsage:
    family = (caps.host.platform or "").split("-")[0]
    for platform, variant in job.variants.items():
        if platform == family:
            return variant.gpu
    return job.gpu or GpuUsage()


def use_of(job: JobRequest, section: GpuUsage) -> str:
    if section.use is not None:
        return section.use
    return "exclusive" if devices_needed(job) > 0 else "none"


def accelerators_for(job: JobRequest) -> list[str]:
    r = job.requirements
    if r.accelerator is None:
        return ["cuda"] if r.min_cuda_compute_capability is not None else list(SCHEDULABLE_GPUS)
    return [r.accelerator] if r.accelerator in SCHEDULABLE_GPUS else []


def device_ok(job: JobRequest, d: AcceleratorDevice, acc: str) -> bool:
    r = job.requirements
    if d.accelerator != acc or not d.execution_supported:
        return False
    if r.gpu_memory_kind is not None and d.memory_kind != r.gpu_memory_kind:
        return False
    if r.gpu_memory_gb is not None and (
        d.memory_mib is None or d.memory_mib * 1024 * 1024 < r.gpu_memory_gb * 1e9
    ):
        return False
    if r.min_cuda_compute_capability is not None:
        have = cc_tuple(d.compute_capability) if d.compute_capability is not None else None
        want = cc_tuple(r.min_cuda_compute_capability)
        if have is None or want is None or have < want:
            return False
    return True


def version_ok(spec: str, version: str | None) -> bool:
    if version is None:
        return False
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def node_rules_ok(job: JobRequest, caps: WorkerCapabilities) -> bool:
    r = job.requirements
    section = gpu_section(job, caps)
    if section.apis_any:
        offered = caps.gpu_apis.containers if section.in_container else caps.gpu_apis.host
        if not set(section.apis_any) & set(offered):
            return False
    if r.python is not None and not version_ok(r.python, caps.workload_python_version):
        return False
    for name, spec in r.frameworks.items():
        if not version_ok(spec, caps.frameworks.get(name)):
            return False
    return all(c in caps.framework_capabilities for c in r.framework_capabilities)


def good_devices(job: JobRequest, caps: WorkerCapabilities) -> dict[str, list[int]]:
    return {
        acc: [d.index for d in caps.accelerators if device_ok(job, d, acc)]
        for acc in accelerators_for(job)
    }


def pool_of(good: dict[str, list[int]]) -> tuple[str, list[int]] | None:
    for acc, indices in good.items():
        if indices:
            return acc, indices
    return None


def can_take(job: JobRequest, view: NodeView, *, idle: bool) -> bool:
    """Could this node run the job now (or, with ``idle``, when online with every device free)?"""
    caps = view.capabilities
    if not idle and not view.online:
        return False
    if not node_rules_ok(job, caps):
        return False
    excl = frozenset() if idle else view.exclusive
    shrd = frozenset() if idle else view.shared
    use = use_of(job, gpu_section(job, caps))
    n = devices_needed(job)
    if job.requirements.accelerator == "cpu" and (n > 0 or has_device_rules(job)):
        return False
    good = good_devices(job, caps)
    if n > 0:
        for indices in good.values():
            if use == "exclusive":
                free = [i for i in indices if i not in excl and i not in shrd]
            elif use == "shared":
                free = [i for i in indices if i not in excl]
            else:
                free = indices
            if len(free) >= n:
                return True
        return False
    if use in ("shared", "exclusive"):
        pool = pool_of(good)
        if pool is None:
            return use == "shared" and not has_device_rules(job)
        if use == "exclusive":
            return all(i not in excl and i not in shrd for i in pool[1])
        return any(i not in excl for i in pool[1])
    return not has_device_rules(job) or any(good.values())


def check_placement(job: JobRequest, view: NodeView, p: Placement) -> None:
    caps = view.capabilities
    assert view.online
    assert node_rules_ok(job, caps)
    use = use_of(job, gpu_section(job, caps))
    assert p.use == use
    assert p.devices == sorted(set(p.devices)), "devices sorted and distinct"
    by_index = {d.index: d for d in caps.accelerators}
    good = good_devices(job, caps)
    n = devices_needed(job)
    for i in p.devices:
        assert i in by_index
        assert device_ok(job, by_index[i], p.accelerator), (i, p)
        assert i not in view.exclusive, "never on a device held exclusively"
        if use == "exclusive":
            assert i not in view.shared, "exclusive never on a shared device"
    if n > 0:
        assert p.accelerator in accelerators_for(job)
        if use == "none":
            assert p.devices == []
            assert len(good[p.accelerator]) >= n
        else:
            assert len(p.devices) == n
    elif use in ("shared", "exclusive"):
        pool = pool_of(good)
        if pool is None:
            assert (p.accelerator, p.devices, use) == ("cpu", [], "shared")
            assert not has_device_rules(job)
        else:
            acc, indices = pool
            assert p.accelerator == acc
            if use == "exclusive":
                assert p.devices == indices, "exclusive use holds the whole pool"
            else:
                assert p.devices == [i for i in indices if i not in view.exclusive]
                assert p.devices
    else:
        assert (p.accelerator, p.devices) == ("cpu", [])
        assert not has_device_rules(job) or any(good.values())


# --- random jobs and fleets ---

# Hypothesis favours the first entry of each list: it is the common, usable value.
# 38147 MiB is the least that holds 40 GB, 15259 the least for 16 GB.
MIBS = [81559, None, 38146, 38147, 15258, 15259, 15360, 24576, 81559]
CCS = ["9.0", None, "7.5", "8.0", "8.6", "9.0", "10.0", "12.0", "n/a"]


@st.composite
def devices(draw: st.DrawFn) -> list[AcceleratorDevice]:
    # Mostly one accelerator per node, as real nodes are, with now and then an odd device.
    main = draw(st.sampled_from(["cuda", "mps", "cuda", "rocm", "cpu"]))
    count = draw(st.sampled_from([1, 4, 0, 2, 4])) if main != "mps" else 1
    kinds = ["unified", None, "dedicated"] if main == "mps" else ["dedicated", None, "unified"]
    return [
        AcceleratorDevice(
            accelerator=draw(st.sampled_from([main, main, main, "cuda", "mps", "rocm", "cpu"])),
            index=i,
            memory_mib=draw(st.sampled_from(MIBS)),
            memory_kind=draw(st.sampled_from(kinds)),
            compute_capability=draw(st.sampled_from(CCS)),
            execution_supported=draw(st.sampled_from([True, True, True, False])),
        )
        for i in range(count)
    ]


def subset(items: list[str]) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(items), unique=True, max_size=len(items))


@st.composite
def nodes(draw: st.DrawFn) -> list[NodeView]:
    fleet = []
    for k in range(draw(st.sampled_from([3, 0, 1, 2, 3, 4, 5, 6]))):
        devs = draw(devices())
        torch = draw(st.sampled_from(["2.5.1+cu124", None, "2.1.0", "2.6.0a0+git1", "2.7.0", "x"]))
        caps = WorkerCapabilities(
            node_id=f"n{k}",
            agent_version="0.1.0",
            detected_at=datetime(2025, 1, 1, tzinfo=UTC),
            host=HostInfo(platform=draw(st.sampled_from(["linux-x86_64", "darwin-arm64", None]))),
            accelerators=devs,
            workload_python_version=draw(st.sampled_from(["3.12.1", None, "3.10.12", "3.12.1"])),
            frameworks={} if torch is None else {"torch": torch},
            framework_capabilities=draw(subset(["torch.cuda", "torch.mps"])),
            gpu_apis=GpuApis(
                host=draw(subset(["cuda", "vulkan", "metal"])),
                containers=draw(subset(["cuda", "vulkan"])),
            ),
        )
        holds = [draw(st.sampled_from(["free", "free", "exclusive", "shared"])) for _ in devs]
        fleet.append(
            NodeView(
                node_id=f"n{k}",
                capabilities=caps,
                online=draw(st.booleans() | st.just(True)),
                exclusive=frozenset(i for i, h in enumerate(holds) if h == "exclusive"),
                shared=frozenset(i for i, h in enumerate(holds) if h == "shared"),
            )
        )
    return fleet


def gpu_usages() -> st.SearchStrategy[GpuUsage | None]:
    return st.none() | st.builds(
        GpuUsage,
        use=st.sampled_from(["exclusive", "shared", None, "none"]),
        apis_any=st.sampled_from([[], ["cuda"], [], ["vulkan", "metal"], ["metal"]]),
        in_container=st.sampled_from([False, False, True]),
    )


def sometimes(values: Sequence[T]) -> st.SearchStrategy[T | None]:
    """None three times in four, else one of ``values``: most jobs ask for little, so that a
    good share of the examples can be placed."""
    return st.sampled_from([None, None, None, "some"]).flatmap(
        lambda x: st.none() if x is None else st.sampled_from(values)
    )


@st.composite
def jobs(draw: st.DrawFn) -> JobRequest:
    acc: Accelerator | None = draw(st.sampled_from([None, "cuda", None, "cuda", "mps", "cpu"]))
    ccs: list[float | str] = [8.0, "9.0", "7.5", 10.0]
    cc = draw(sometimes(ccs)) if acc in (None, "cuda") else None
    darwin = draw(gpu_usages())
    return JobRequest(
        job_id="p1",
        command=["run"],
        requirements=Requirements(
            accelerator=acc,
            gpu_count=0 if acc == "cpu" else draw(st.sampled_from([0, 1, 0, 1, 2, 3])),
            gpu_memory_gb=draw(sometimes([16, 40, 80, 22.5])),
            gpu_memory_kind=draw(sometimes(["dedicated", "unified"])),
            min_cuda_compute_capability=cc,
            frameworks={"torch": spec} if (spec := draw(sometimes([">=2.1", ">=2.6"]))) else {},
            python=draw(sometimes([">=3.11", "<3.11"])),
            framework_capabilities=["torch.cuda"] if draw(sometimes([True])) else [],
        ),
        gpu=draw(gpu_usages()),
        variants={} if darwin is None else {"darwin": Variant(gpu=darwin)},
    )


def agrees_with_oracle(job: JobRequest, fleet: list[NodeView]) -> None:
    decision = match(job, fleet)
    now = [can_take(job, v, idle=False) for v in fleet]
    ever = [can_take(job, v, idle=True) for v in fleet]
    if isinstance(decision, Placement):
        assert any(now)
        first = now.index(True)
        assert decision.node_id == fleet[first].node_id, "first fit in the order given"
        check_placement(job, fleet[first], decision)
    else:
        assert isinstance(decision, NoPlacement)
        assert not any(now), "a node could take the job, but match refused"
        assert decision.unsatisfiable == (not any(ever))
        assert decision.can_run_now == 0
        assert decision.could_run == sum(ever)
        assert sum(decision.ruled_out.values()) == len(fleet)
        assert len(decision.reasons) == (len(decision.ruled_out) if fleet else 1)
        assert decision.summary.startswith(f"0/{len(fleet)} nodes can run this job: ")

    full = explain(job, fleet)
    assert full.can_run_now == sum(now)
    assert full.could_run == sum(ever)
    assert sum(full.ruled_out.values()) == len(fleet) - sum(now)
    for view, ok in zip(fleet, ever, strict=True):
        assert would_fit_when_idle(job, view) == ok


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(job=jobs().filter(lambda j: validate_job(j).ok), fleet=nodes())
def test_match_agrees_with_the_oracle(job: JobRequest, fleet: list[NodeView]) -> None:
    agrees_with_oracle(job, fleet)


@settings(max_examples=150, deadline=None)
@given(
    use=st.sampled_from(["exclusive", "shared"]),
    apis=st.sampled_from([[], ["cuda"], ["vulkan", "metal"]]),
    memory=st.sampled_from([None, 16, 40]),
    fleet=nodes(),
)
def test_pool_jobs_agree_with_the_oracle(
    use: str, apis: list[str], memory: float | None, fleet: list[NodeView]
) -> None:
    """The runner style: no accelerator, no count, the node's GPU pool held or shared."""
    job = JobRequest(
        job_id="p2",
        command=["run"],
        requirements=Requirements(gpu_memory_gb=memory),
        gpu=GpuUsage(use=use, apis_any=apis),  # type: ignore[arg-type]
    )
    agrees_with_oracle(job, fleet)


@st.composite
def single_devices(draw: st.DrawFn) -> AcceleratorDevice:
    major, minor = draw(st.integers(3, 12)), draw(st.integers(0, 9))
    return AcceleratorDevice(
        accelerator=draw(st.sampled_from(["cuda", "cuda", "mps", "rocm"])),
        index=0,
        memory_mib=draw(st.sampled_from(MIBS) | st.integers(1, 250_000)),
        memory_kind=draw(st.sampled_from(["dedicated", "unified", None])),
        compute_capability=draw(st.sampled_from([f"{major}.{minor}", None, "n/a"])),
        execution_supported=draw(st.sampled_from([True, True, False])),
    )


@settings(max_examples=300, deadline=None)
@given(
    device=single_devices(),
    acc=st.sampled_from([None, "cuda", "mps"]),
    gb=st.none() | st.sampled_from([16, 40, 80, 0.5]) | st.floats(0.01, 300),
    kind=st.sampled_from([None, "dedicated", "unified"]),
    cc=st.none() | st.tuples(st.integers(3, 12), st.integers(0, 9)),
    cc_as_text=st.booleans(),
)
def test_one_device_verdict_agrees_with_the_oracle(
    device: AcceleratorDevice,
    acc: str | None,
    gb: float | None,
    kind: str | None,
    cc: tuple[int, int] | None,
    cc_as_text: bool,
) -> None:
    """Per-device rules, densely: memory arithmetic, numeric compute capability, memory kind."""
    minimum: float | str | None = None
    if cc is not None and acc != "mps":
        minimum = f"{cc[0]}.{cc[1]}" if cc_as_text else float(f"{cc[0]}.{cc[1]}")
    job = JobRequest(
        job_id="p3",
        command=["run"],
        requirements=Requirements(
            accelerator=acc,  # type: ignore[arg-type]
            gpu_count=1,
            gpu_memory_gb=gb,
            gpu_memory_kind=kind,  # type: ignore[arg-type]
            min_cuda_compute_capability=minimum,
        ),
    )
    caps = WorkerCapabilities(
        node_id="one",
        agent_version="0.1.0",
        detected_at=datetime(2025, 1, 1, tzinfo=UTC),
        accelerators=[device],
    )
    expected = any(device_ok(job, device, a) for a in accelerators_for(job))
    assert would_fit_when_idle(job, caps) == expected
    agrees_with_oracle(job, [NodeView(node_id="one", capabilities=caps)])


@settings(max_examples=100, deadline=None)
@given(fleet=nodes(), job=jobs().filter(lambda j: validate_job(j).ok))
def test_placing_until_full_never_double_books(fleet: list[NodeView], job: JobRequest) -> None:
    """Apply each placement to the fleet and match again: no device is ever held by an exclusive
    job and anyone else, and the loop ends (each placement holds something or the job is cpu)."""
    views = {v.node_id: v for v in fleet}
    for _ in range(12):
        decision = match(job, list(views.values()))
        if not isinstance(decision, Placement):
            break
        v = views[decision.node_id]
        got = set(decision.devices)
        assert not got & v.exclusive
        if decision.use == "exclusive":
            assert not got & v.shared
            views[v.node_id] = NodeView(
                node_id=v.node_id,
                capabilities=v.capabilities,
                online=v.online,
                exclusive=v.exclusive | got,
                shared=v.shared,
            )
        elif decision.use == "shared":
            views[v.node_id] = NodeView(
                node_id=v.node_id,
                capabilities=v.capabilities,
                online=v.online,
                exclusive=v.exclusive,
                shared=v.shared | got,
            )
        if not got:
            break  # holds nothing: would be placed again and again

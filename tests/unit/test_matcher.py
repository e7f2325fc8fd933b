"""The matcher: each placement rule with its edge cases, and the explanations."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import pytest

from gpulayer_contracts import matrix
from gpulayer_contracts.capabilities import AcceleratorDevice, GpuApis, HostInfo, WorkerCapabilities
from gpulayer_contracts.jobs import (
    Accelerator,
    Distributed,
    GpuUsage,
    JobRequest,
    MemoryKind,
    Requirements,
    Variant,
)
from gpulayer_matching import (
    NodeView,
    NoPlacement,
    Placement,
    explain,
    match,
    would_fit_when_idle,
)

H100_MIB = 81559  # nvidia-smi's memory.total for an H100 80GB HBM3
T4_MIB = 15360  # and for a 16GB T4


def gpu(
    index: int,
    *,
    mib: int | None = H100_MIB,
    cc: str | None = "9.0",
    acc: Accelerator = "cuda",
    usable: bool = True,
    kind: MemoryKind | None = "dedicated",
) -> AcceleratorDevice:
    return AcceleratorDevice(
        accelerator=acc,
        index=index,
        memory_mib=mib,
        memory_kind=kind,
        compute_capability=cc,
        execution_supported=usable,
    )


def mps() -> AcceleratorDevice:
    return gpu(0, mib=65536, cc=None, acc="mps", kind="unified")


def node(
    node_id: str,
    devices: Iterable[AcceleratorDevice] = (),
    *,
    platform: str = "linux-x86_64",
    online: bool = True,
    executor_down: bool = False,
    exclusive: Iterable[int] = (),
    shared: Iterable[int] = (),
    **caps: Any,
) -> NodeView:
    capabilities = WorkerCapabilities(
        node_id=node_id,
        agent_version="0.1.0",
        detected_at=datetime(2025, 1, 1, tzinfo=UTC),
        host=HostInfo(platform=platform),
        accelerators=list(devices),
        **caps,
    )
    return NodeView(
        node_id=node_id,
        capabilities=capabilities,
        online=online,
        executor_down=executor_down,
        exclusive=frozenset(exclusive),
        shared=frozenset(shared),
    )


def job(
    *,
    gpu_section: GpuUsage | None = None,
    variants: dict[str, GpuUsage] | None = None,
    distributed: Distributed | None = None,
    **requirements: Any,
) -> JobRequest:
    return JobRequest(
        job_id="j1",
        command=["python", "x.py"],
        requirements=Requirements(**requirements),
        gpu=gpu_section,
        variants={p: Variant(gpu=g) for p, g in (variants or {}).items()},  # type: ignore[misc]
        distributed=distributed,
    )


def placed(decision: object) -> Placement:
    assert isinstance(decision, Placement), decision
    return decision


def refused(decision: object) -> NoPlacement:
    assert isinstance(decision, NoPlacement), decision
    return decision


def h100(node_id: str = "h100", n: int = 8, **kw: Any) -> NodeView:
    return node(node_id, [gpu(i) for i in range(n)], **kw)


def t4(node_id: str = "t4", n: int = 2, **kw: Any) -> NodeView:
    return node(node_id, [gpu(i, mib=T4_MIB, cc="7.5") for i in range(n)], **kw)


def apple(node_id: str = "mac", **kw: Any) -> NodeView:
    kw.setdefault("gpu_apis", GpuApis(host=["metal"]))
    return node(node_id, [mps()], platform="darwin-arm64", **kw)


# --- GPU memory: GB of 10^9 bytes against MiB ---


@pytest.mark.parametrize(
    ("gb", "mib", "fits"),
    [
        (80, 81559, True),  # an "80GB" H100 as nvidia-smi shows it
        (16, 15360, True),  # a "16GB" T4
        (85.5, 81559, True),  # 81559 MiB = 85.52e9 bytes
        (85.53, 81559, False),
        (40, 38147, True),  # 38147 MiB = 40.0009e9 bytes: the smallest that holds 40 GB
        (40, 38146, False),  # 39.9998e9 bytes
        (16, 15258, False),  # 15.9995e9 bytes: MiB are not GB
        (0.5, 477, True),
        (0.5, 476, False),
    ],
)
def test_gpu_memory_is_gb_of_10_9_bytes_per_device(gb: float, mib: int, fits: bool) -> None:
    decision = match(job(accelerator="cuda", gpu_memory_gb=gb), [node("n", [gpu(0, mib=mib)])])
    assert isinstance(decision, Placement) is fits
    if not fits:
        assert f"< {gb:g} GB per GPU" in refused(decision).summary


def test_unknown_memory_says_unknown_not_too_small() -> None:
    d = refused(match(job(accelerator="cuda", gpu_memory_gb=8), [node("n", [gpu(0, mib=None)])]))
    assert d.reasons == ["1 has unknown GPU memory"]
    assert d.unsatisfiable
    assert d.ruled_out == {"memory_unknown": 1}


def test_shortfall_an_unknown_device_might_cover_reads_unknown() -> None:
    # One device known to fit, one unknown: two are needed, so the unknown is the reason.
    n = node("n", [gpu(0), gpu(1, mib=None), gpu(2, mib=8000)])
    d = refused(match(job(accelerator="cuda", gpu_count=2, gpu_memory_gb=40), [n]))
    assert d.ruled_out == {"memory_unknown": 1}
    # Three needed: the unknown can't cover it; the third-best is known and too small.
    d = refused(match(job(accelerator="cuda", gpu_count=4, gpu_memory_gb=40), [n]))
    assert d.ruled_out == {"count": 1}


def test_memory_nearest_miss_names_the_best_node_for_the_whole_request() -> None:
    # For 2 devices, a node's offer is its second-best device.
    fleet = [
        node("a", [gpu(0, mib=H100_MIB), gpu(1, mib=T4_MIB)]),
        node("b", [gpu(0, mib=24576), gpu(1, mib=24576)]),
        t4("c"),
    ]
    d = refused(match(job(accelerator="cuda", gpu_count=2, gpu_memory_gb=40), fleet))
    assert d.reasons == ["3 have < 40 GB per GPU on 2 GPUs (best: b 25.8 GB (24576 MiB))"]


# --- memory kind ---


@pytest.mark.parametrize(
    ("want", "device_kind", "fits"),
    [
        ("dedicated", "dedicated", True),
        ("unified", "unified", True),
        ("dedicated", "unified", False),
        ("unified", "dedicated", False),
        ("dedicated", None, False),
    ],
)
def test_memory_kind(want: MemoryKind, device_kind: MemoryKind | None, fits: bool) -> None:
    n = node("n", [gpu(0, kind=device_kind)])
    decision = match(job(gpu_count=1, gpu_memory_kind=want), [n])
    assert isinstance(decision, Placement) is fits
    if device_kind is None:
        assert refused(decision).reasons == ["1 has unknown GPU memory kind"]


def test_unified_memory_without_accelerator_finds_the_apple_node() -> None:
    p = placed(match(job(gpu_count=1, gpu_memory_kind="unified"), [h100(), apple()]))
    assert (p.node_id, p.accelerator, p.devices) == ("mac", "mps", [0])


# --- compute capability ---


@pytest.mark.parametrize(
    ("minimum", "device", "fits"),
    [
        (8.0, "8.6", True),
        ("8.0", "8.0", True),
        (8.6, "8.0", False),
        (9.0, "10.0", True),  # numeric, not string order
        ("10.0", "9.0", False),
        (7.5, "7.5", True),
        ("12", "12.0", True),
        (8.0, "7.5", False),
    ],
)
def test_compute_capability_compares_numerically(
    minimum: float | str, device: str, fits: bool
) -> None:
    n = node("n", [gpu(0, cc=device)])
    decision = match(job(accelerator="cuda", min_cuda_compute_capability=minimum), [n])
    assert isinstance(decision, Placement) is fits


@pytest.mark.parametrize("device_cc", [None, "garbage"])
def test_unknown_compute_capability_says_unknown(device_cc: str | None) -> None:
    d = refused(
        match(
            job(accelerator="cuda", min_cuda_compute_capability=8.0),
            [node("n", [gpu(0, cc=device_cc)])],
        )
    )
    assert d.reasons == ["1 has unknown compute capability"]


def test_compute_capability_nearest_miss() -> None:
    fleet = [t4("a"), node("b", [gpu(0, cc="8.0")]), node("c", [gpu(0, cc="8.6")])]
    d = refused(match(job(accelerator="cuda", min_cuda_compute_capability=9.0), fleet))
    assert d.reasons == ["3 have compute capability < 9.0 (best: c 8.6)"]


def test_compute_capability_without_accelerator_means_cuda() -> None:
    d = refused(match(job(gpu_count=1, min_cuda_compute_capability=8.0), [apple()]))
    assert d.reasons == ["1 has no cuda device"]
    p = placed(match(job(gpu_count=1, min_cuda_compute_capability=8.0), [apple(), h100()]))
    assert p.node_id == "h100"


# --- counting devices, mixed models ---


def test_only_execution_supported_devices_count() -> None:
    n = node("n", [gpu(0), gpu(1, usable=False), gpu(2)])
    p = placed(match(job(accelerator="cuda", gpu_count=2), [n]))
    assert p.devices == [0, 2]
    d = refused(match(job(accelerator="cuda", gpu_count=3), [n]))
    assert d.reasons == ["1 has < 3 usable cuda devices (best: n 2)"]


def test_node_whose_devices_cannot_execute_is_named_so() -> None:
    d = refused(match(job(accelerator="cuda"), [node("n", [gpu(0, usable=False)])]))
    assert d.reasons == ["1 has cuda devices that can't run work (execution not supported)"]


def test_mixed_model_node_gives_each_device_its_own_check() -> None:
    # T4, A100 80GB, T4, A100 80GB, on one node.
    n = node(
        "mixed",
        [
            gpu(0, mib=T4_MIB, cc="7.5"),
            gpu(1, mib=81920, cc="8.0"),
            gpu(2, mib=T4_MIB, cc="7.5"),
            gpu(3, mib=81920, cc="8.0"),
        ],
    )
    big = job(accelerator="cuda", gpu_count=2, gpu_memory_gb=40)
    assert placed(match(big, [n])).devices == [1, 3]
    by_cc = job(accelerator="cuda", gpu_count=2, min_cuda_compute_capability=8.0)
    assert placed(match(by_cc, [n])).devices == [1, 3]
    # Memory of one device and capability of another don't add up to a fitting device.
    split = node("split", [gpu(0, mib=81920, cc="7.0"), gpu(1, mib=T4_MIB, cc="9.0")])
    both = job(accelerator="cuda", gpu_memory_gb=40, min_cuda_compute_capability=8.0)
    assert refused(match(both, [split])).ruled_out == {"cc": 1}
    assert (
        placed(
            match(
                big,
                [n, split],
            )
        ).node_id
        == "mixed"
    )
    three = job(accelerator="cuda", gpu_count=3, gpu_memory_gb=40)
    assert refused(match(three, [n])).reasons == [
        "1 has < 40 GB per GPU on 3 GPUs (best: mixed 16.1 GB (15360 MiB))"
    ]
    # With device 1 held, only device 3 of the big ones is free.
    busy = node("mixed", n.capabilities.accelerators, exclusive=[1])
    assert refused(match(big, [busy])).reasons == [
        "1 has too few free devices (need 2 cuda devices, most free: mixed 1)"
    ]


def test_accelerator_named_without_count_means_one_device() -> None:
    p = placed(match(job(accelerator="cuda"), [h100()]))
    assert (p.devices, p.use) == ([0], "exclusive")


# --- accelerators and the support matrix ---


def test_cuda_never_on_mps_and_mps_never_on_cuda() -> None:
    assert refused(match(job(accelerator="cuda"), [apple()])).reasons == ["1 has no cuda device"]
    assert refused(match(job(accelerator="mps"), [h100()])).reasons == ["1 has no mps device"]
    assert placed(match(job(accelerator="mps"), [h100(), apple()])).node_id == "mac"


def test_rocm_is_detection_only() -> None:
    amd = node("amd", [gpu(0, acc="rocm", cc=None, usable=True)])
    d = refused(match(job(accelerator="rocm"), [amd]))
    assert d.unsatisfiable
    assert d.reasons == ["rocm is detection-only in the support matrix for independent jobs"]
    # Nor do its devices serve a job that names no accelerator.
    assert refused(match(job(gpu_count=1), [amd])).ruled_out == {"no_device": 1}


def test_no_accelerator_named_takes_any_schedulable_gpu() -> None:
    p = placed(match(job(gpu_count=1), [node("cpu"), apple()]))
    assert (p.node_id, p.accelerator) == ("mac", "mps")
    d = refused(match(job(gpu_count=2), [node("cpu"), apple()]))
    assert d.reasons == [
        "1 has no GPU device (cuda or mps)",
        "1 has < 2 usable GPU devices (best: mac 1)",
    ]


def test_cpu_job_goes_anywhere_online_and_holds_nothing() -> None:
    fleet = [h100("gpu-node", exclusive=range(8)), node("cpu-node")]
    p = placed(match(job(), fleet))
    assert p == Placement(node_id="gpu-node", accelerator="cpu", devices=[], use="none")
    p = placed(match(job(accelerator="cpu"), [apple()]))
    assert (p.accelerator, p.devices) == ("cpu", [])


def test_cpu_job_waits_when_every_node_is_offline_but_is_not_unsatisfiable() -> None:
    d = refused(match(job(), [node("a", online=False), node("b", online=False)]))
    assert d.reasons == ["2 are offline"]
    assert not d.unsatisfiable
    assert d.could_run == 2


def test_cpu_job_asking_for_gpu_memory_is_unsatisfiable() -> None:
    d = refused(match(job(accelerator="cpu", gpu_memory_gb=8), [h100()]))
    assert d.unsatisfiable
    assert d.reasons == ["a cpu job cannot ask for GPU devices or GPU memory"]


def test_per_device_requirement_without_count_filters_but_holds_nothing() -> None:
    # No count and no `use`: a cpu-mode job that still wants a node with such a GPU.
    p = placed(match(job(gpu_memory_gb=40), [t4(), h100(exclusive=range(8))]))
    assert p == Placement(node_id="h100", accelerator="cpu", devices=[], use="none")


def test_distributed_jobs_follow_the_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = Distributed(nodes=1, backend="nccl", launcher="torchrun")
    monkeypatch.setitem(matrix.SUPPORT_MATRIX["cuda"], "distributed", "unsupported")
    monkeypatch.setitem(matrix.SUPPORT_MATRIX["cpu"], "distributed", "unsupported")
    d = refused(match(job(accelerator="cuda", distributed=dist), [h100()]))
    assert d.unsatisfiable
    assert d.reasons == ["cuda is unsupported in the support matrix for distributed jobs"]
    assert refused(match(job(distributed=dist), [h100()])).unsatisfiable

    monkeypatch.setitem(matrix.SUPPORT_MATRIX["cuda"], "distributed", "implemented")
    n = h100(distributed_backends=["nccl", "gloo"], launchers=["torchrun"])
    assert placed(match(job(accelerator="cuda", distributed=dist), [n])).node_id == "h100"
    d = refused(match(job(accelerator="cuda", distributed=dist), [h100("bare")]))
    assert d.reasons == ["1 lacks the nccl distributed backend"]


# --- exclusive and shared use ---


def test_exclusive_takes_lowest_free_devices() -> None:
    n = h100(n=4, exclusive=[0], shared=[2])
    p = placed(match(job(accelerator="cuda", gpu_count=2), [n]))
    assert (p.devices, p.use) == ([1, 3], "exclusive")


def test_exclusive_never_takes_a_shared_device() -> None:
    n = h100(n=2, exclusive=[0], shared=[1])
    d = refused(match(job(accelerator="cuda"), [n]))
    assert not d.unsatisfiable
    assert d.reasons == ["1 has too few free devices (need a cuda device, most free: h100 0)"]


def test_shared_shares_with_shared_but_not_exclusive_and_packs() -> None:
    n = h100(n=4, exclusive=[0], shared=[3])
    shared = job(accelerator="cuda", gpu_section=GpuUsage(use="shared"))
    p = placed(match(shared, [n]))
    assert (p.devices, p.use) == ([3], "shared")  # packed onto the device already shared
    p = placed(match(job(accelerator="cuda", gpu_count=2, gpu_section=GpuUsage(use="shared")), [n]))
    assert p.devices == [1, 3]
    d = refused(match(shared, [h100(n=2, exclusive=[0, 1])]))
    assert d.ruled_out == {"busy_shared": 1}
    assert d.reasons == [
        "1 has too few devices not held exclusively (need a cuda device, most: h100 0)"
    ]


def test_use_none_with_devices_requested_holds_nothing() -> None:
    p = placed(
        match(job(accelerator="cuda", gpu_section=GpuUsage(use="none")), [h100(exclusive=range(8))])
    )
    assert (p.accelerator, p.devices, p.use) == ("cuda", [], "none")


# --- GPU APIs, the runner style ---


def runner(
    use: str = "shared", apis: list[str] | None = None, in_container: bool = False
) -> JobRequest:
    return job(gpu_section=GpuUsage(use=use, apis_any=apis or ["cuda"], in_container=in_container))  # type: ignore[arg-type]


def test_apis_checked_on_host_or_in_containers() -> None:
    n = h100(gpu_apis=GpuApis(host=["cuda", "vulkan"], containers=["vulkan"]))
    assert placed(match(runner(apis=["cuda"]), [n])).node_id == "h100"
    d = refused(match(runner(apis=["cuda"], in_container=True), [n]))
    assert d.reasons == ["1 has none of the GPU APIs cuda in containers"]
    assert placed(match(runner(apis=["metal", "vulkan"], in_container=True), [n])).node_id == "h100"
    d = refused(match(runner(apis=["metal", "directml"]), [n]))
    assert d.reasons == ["1 has none of the GPU APIs metal / directml on the host"]


def test_exclusive_api_job_holds_the_whole_pool_and_waits_for_all_of_it() -> None:
    apis = GpuApis(host=["cuda"])
    p = placed(match(runner("exclusive"), [h100(n=4, gpu_apis=apis)]))
    assert (p.accelerator, p.devices, p.use) == ("cuda", [0, 1, 2, 3], "exclusive")
    d = refused(match(runner("exclusive"), [h100(n=4, gpu_apis=apis, shared=[2])]))
    assert d.reasons == ["1 has GPUs in use (exclusive use holds the node's whole GPU pool)"]
    assert not d.unsatisfiable


def test_exclusive_api_job_needs_a_gpu_gpulayer_tracks() -> None:
    igpu = node("igpu", gpu_apis=GpuApis(host=["vulkan"]))
    d = refused(match(runner("exclusive", ["vulkan"]), [igpu]))
    assert d.unsatisfiable
    assert d.ruled_out == {"no_device": 1}


def test_shared_api_job_gets_the_devices_not_held_exclusively() -> None:
    n = h100(n=4, gpu_apis=GpuApis(host=["cuda"]), exclusive=[1], shared=[2])
    p = placed(match(runner("shared"), [n]))
    assert (p.accelerator, p.devices, p.use) == ("cuda", [0, 2, 3], "shared")
    d = refused(
        match(runner("shared"), [h100(n=2, gpu_apis=GpuApis(host=["cuda"]), exclusive=[0, 1])])
    )
    assert d.reasons == ["1 has every GPU held exclusively"]


def test_shared_api_job_on_a_node_without_tracked_gpu_is_placed_by_api_alone() -> None:
    igpu = node("igpu", gpu_apis=GpuApis(host=["vulkan"]))
    p = placed(match(runner("shared", ["vulkan"]), [igpu]))
    assert p == Placement(node_id="igpu", accelerator="cpu", devices=[], use="shared")


def test_variant_replaces_gpu_section_whole_per_platform() -> None:
    seed_style = job(
        gpu_section=GpuUsage(use="exclusive", apis_any=["cuda"]),
        variants={"darwin": GpuUsage(use="shared", apis_any=["metal"])},
    )
    p = placed(match(seed_style, [apple()]))
    assert (p.accelerator, p.devices, p.use) == ("mps", [0], "shared")
    linux = h100(n=2, gpu_apis=GpuApis(host=["cuda", "metal"]))
    p = placed(match(seed_style, [linux]))
    assert (p.devices, p.use) == ([0, 1], "exclusive")
    # The variant replaces apis too: the darwin node's metal doesn't satisfy the linux section.
    linux_only = job(
        gpu_section=GpuUsage(use="shared", apis_any=["metal"]),
        variants={"darwin": GpuUsage(use="shared", apis_any=["cuda"])},
    )
    assert refused(match(linux_only, [apple()])).ruled_out == {"apis": 1}


# --- frameworks, python, framework capabilities ---


@pytest.mark.parametrize(
    ("spec", "installed", "fits"),
    [
        (">=2.1", "2.5.1+cu124", True),
        ("==2.5.1", "2.5.1+cu124", True),
        (">=2.5", "2.6.0a0+ecf3bae40a", True),  # NVIDIA container builds are pre-releases
        (">=2.6", "2.6.0a0+ecf3bae40a", False),  # 2.6.0a0 < 2.6
        ("<2", "2.0.0", False),
        ("~=2.4.0", "2.4.1", True),
        (">=2,<3", "3.0.0", False),
    ],
)
def test_framework_specifiers(spec: str, installed: str, fits: bool) -> None:
    n = h100(frameworks={"torch": installed})
    decision = match(job(frameworks={"torch": spec}), [n])
    assert isinstance(decision, Placement) is fits
    if not fits:
        assert refused(decision).reasons == [f"1 has torch not matching {spec} (seen: {installed})"]


def test_framework_names_are_compared_canonically() -> None:
    n = h100(frameworks={"scikit_learn": "1.5.0", "Torch": "2.5.0"})
    assert placed(match(job(frameworks={"scikit-learn": ">=1.4", "torch": ">=2"}), [n]))


@pytest.mark.parametrize("installed", [None, "not-a-version"])
def test_unknown_framework_version_says_unknown(installed: str | None) -> None:
    frameworks = {} if installed is None else {"torch": installed}
    d = refused(match(job(frameworks={"torch": ">=2"}), [h100(frameworks=frameworks)]))
    assert d.reasons == ["1 has unknown torch version (not reported)"]


def test_python_specifier_and_unknown_python() -> None:
    fleet = [
        h100("old", workload_python_version="3.9.18"),
        h100("older", workload_python_version="3.8.10"),
        h100("unknown"),
    ]
    d = refused(match(job(python=">=3.11"), fleet))
    assert d.reasons == [
        "1 has unknown Python version",
        "2 have Python not matching >=3.11 (seen: 3.9.18, 3.8.10)",
    ]
    new = h100("new", workload_python_version="3.13.0rc2")
    assert placed(match(job(python=">=3.12"), [*fleet, new])).node_id == "new"


def test_framework_capabilities_must_all_be_reported() -> None:
    n = h100(framework_capabilities=["torch.cuda"])
    assert placed(match(job(framework_capabilities=["torch.cuda"]), [n]))
    d = refused(match(job(framework_capabilities=["torch.cuda", "torch.mps"]), [n, apple()]))
    assert d.reasons == ["1 lacks torch.cuda", "1 lacks torch.mps"]


@pytest.mark.parametrize(
    ("requirements", "field"),
    [
        ({"python": "three"}, "requirements.python"),
        ({"frameworks": {"torch": "=>2"}}, "requirements.frameworks.torch"),
    ],
)
def test_unparsable_specifier_is_unsatisfiable_naming_the_field(
    requirements: dict[str, Any], field: str
) -> None:
    d = refused(match(job(**requirements), [h100()]))
    assert d.unsatisfiable
    assert d.reasons[0].startswith(f"{field}: ")


# --- node choice and state ---


def test_first_fit_in_the_order_given() -> None:
    fleet = [t4("a"), h100("b"), h100("c")]
    assert placed(match(job(accelerator="cuda"), fleet)).node_id == "a"
    assert placed(match(job(accelerator="cuda"), fleet[::-1])).node_id == "c"
    assert placed(match(job(accelerator="cuda", gpu_memory_gb=40), fleet)).node_id == "b"


def test_offline_node_is_skipped_but_counts_for_could_ever_run() -> None:
    fleet = [h100("off", online=False), t4("small")]
    d = refused(match(job(accelerator="cuda", gpu_memory_gb=40), fleet))
    assert not d.unsatisfiable
    assert d.reasons == ["1 has < 40 GB per GPU (best: small 16.1 GB (15360 MiB))", "1 is offline"]


def test_node_whose_executor_stopped_gets_no_grants_and_says_so() -> None:
    fleet = [h100("no-executor", executor_down=True), t4("busy", exclusive=range(2))]
    d = refused(match(job(accelerator="cuda", gpu_count=1), fleet))
    assert not d.unsatisfiable  # it may come back
    assert d.could_run == 2
    assert d.reasons == [
        "1 has no running executor (its heartbeats stopped)",
        "1 has too few free devices (need a cuda device, most free: busy 0)",
    ]
    assert d.ruled_out == {"executor_down": 1, "busy_exclusive": 1}
    # Offline is said first: a node that is down has no executor either.
    d = refused(match(job(), [node("both", online=False, executor_down=True)]))
    assert d.reasons == ["1 is offline"]
    p = placed(match(job(accelerator="cuda"), [*fleet, h100("fine")]))
    assert p.node_id == "fine"


def test_redetected_node_gets_a_fresh_verdict() -> None:
    before = node("n", [gpu(0, cc="7.5")])
    after = node("n", [gpu(0, cc="8.0")])
    wants = job(accelerator="cuda", min_cuda_compute_capability=8.0)
    assert isinstance(match(wants, [before]), NoPlacement)
    assert placed(match(wants, [after])).node_id == "n"
    assert isinstance(match(wants, [before]), NoPlacement)


def test_would_fit_when_idle_ignores_occupancy_and_liveness() -> None:
    busy = h100(n=2, exclusive=[0, 1], online=False)
    assert isinstance(match(job(accelerator="cuda"), [busy]), NoPlacement)
    assert would_fit_when_idle(job(accelerator="cuda"), busy)
    assert would_fit_when_idle(job(accelerator="cuda"), busy.capabilities)
    assert not would_fit_when_idle(job(accelerator="mps"), busy)
    assert not would_fit_when_idle(job(accelerator="rocm"), busy)


# --- explanations ---


def test_explanation_counts_each_node_under_its_first_failing_rule() -> None:
    fleet = [
        node("cpu-1"),
        node("cpu-2"),
        apple(),
        t4("t4-a"),
        node("l4", [gpu(0, mib=23034, cc="8.9")]),
        h100("h100-off", online=False),
        h100("h100-busy", n=2, exclusive=[0, 1]),
        # Too small and too old: counted under memory only, which comes first.
        node("old", [gpu(0, mib=8192, cc="6.1")]),
    ]
    d = refused(
        match(job(accelerator="cuda", gpu_memory_gb=40, min_cuda_compute_capability=8.0), fleet)
    )
    assert d.summary == (
        "0/8 nodes can run this job: 3 have no cuda device, "
        "3 have < 40 GB per GPU (best: l4 24.2 GB (23034 MiB)), 1 is offline, "
        "1 has too few free devices (need a cuda device, most free: h100-busy 0)"
    )
    assert d.ruled_out == {"no_device": 3, "memory": 3, "offline": 1, "busy_exclusive": 1}
    assert sum(d.ruled_out.values()) == d.total == len(fleet)
    assert (d.could_run, d.can_run_now, d.unsatisfiable) == (2, 0, False)


def test_unsatisfiable_with_nearest_miss() -> None:
    fleet = [h100(), t4(), node("cpu")]
    d = refused(match(job(accelerator="cuda", gpu_memory_gb=200), fleet))
    assert d.unsatisfiable
    assert d.summary == (
        "0/3 nodes can run this job: 1 has no cuda device, "
        "2 have < 200 GB per GPU (best: h100 85.5 GB (81559 MiB))"
    )


def test_empty_fleet_is_unsatisfiable() -> None:
    d = refused(match(job(), []))
    assert d.unsatisfiable
    assert d.summary == "0/0 nodes can run this job: no nodes in the fleet"
    assert d.reasons == ["no nodes in the fleet"]


def test_explain_reports_nodes_that_fit_now() -> None:
    fleet = [h100(), t4(), apple()]
    d = explain(job(accelerator="cuda", gpu_memory_gb=40), fleet)
    assert d.summary == (
        "1/3 nodes can run this job now; ruled out: 1 has no cuda device, "
        "1 has < 40 GB per GPU (best: t4 16.1 GB (15360 MiB))"
    )
    assert (d.can_run_now, d.could_run, d.unsatisfiable) == (1, 1, False)


def test_explain_matches_match_when_nothing_fits() -> None:
    fleet = [h100(exclusive=range(8)), t4(online=False)]
    wants = job(accelerator="cuda", gpu_count=2)
    assert explain(wants, fleet) == match(wants, fleet)

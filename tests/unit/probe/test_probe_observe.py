"""Observations, health and MIG instances from recorded nvidia-smi output (no subprocess).

Sources of the recordings: tests/fixtures/README.md (which is our own capture, which are
rebuilt in the shape of public outputs, which are transcribed, which are synthetic).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
from tests.unit.placement.placement_fakes import gpu_node

from gpulayer_contracts.capabilities import grant_devices, mig_index
from gpulayer_contracts.health import DeviceObservation
from gpulayer_contracts.validation import visibility_env
from gpulayer_detection.base import ProbeContext
from gpulayer_detection.health import Tracker, classify
from gpulayer_detection.nvidia import NvidiaProbe, mig_devices, parse_nvidia_smi
from gpulayer_detection.observe import (
    OBSERVE_FIELDS,
    gpu_device_files,
    mig_shares,
    observe,
    parse_mig_listing,
    parse_mig_memory,
    parse_mig_table,
    parse_observations,
)
from gpulayer_detection.runner import Runner, RunResult
from gpulayer_probe.observer import Observer

RECORDINGS = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-smi"


def text(scenario: str, name: str) -> str:
    return (RECORDINGS / scenario / name).read_text()


def runner(scenario: str) -> Runner:
    """Answers like tests/fixtures/nvidia-smi/fake-nvidia-smi, from memory."""
    folder = RECORDINGS / scenario

    async def run(argv: Sequence[str], timeout: float) -> RunResult:
        joined = " ".join(argv)
        if argv[1:] == ["-L"]:
            name = "list"
        elif "--query-gpu=index,pci.bus_id" in joined:
            name = "observe"
        elif "--query-gpu=" in joined:
            name = "query"
        else:
            name = "smi"
        if not (folder / f"{name}.txt").exists():
            return RunResult(tuple(argv), 99, "", f"no recording {name}.txt")
        rc = folder / f"{name}.rc"
        code = int(rc.read_text()) if rc.exists() else 0
        return RunResult(tuple(argv), code, (folder / f"{name}.txt").read_text())

    return run


def test_every_observation_field_is_read() -> None:
    # Values of the real H200 capture's plain nvidia-smi, in the query's CSV.
    (d,) = parse_observations(text("h200-1x", "observe.txt")).devices
    assert d == DeviceObservation(
        index=0,
        uuid="GPU-eb696b50-658e-e81a-d4c1-c87b51f46e54",
        memory_used_mib=0,
        memory_free_mib=143156,
        utilization_pct=0,
        temperature_c=37,
        power_w=91.35,
        throttle_reasons=0,
        ecc_uncorrected_volatile=0,
        ecc_uncorrected_aggregate=0,
        retired_pages_pending=None,  # [N/A]: Hopper remaps rows instead
        remapped_rows_pending=False,
    )
    assert classify(d) == ("healthy", None)


def test_unknown_values_are_none() -> None:
    a, b = parse_observations(text("unknown-values", "observe.txt")).devices
    assert a.ecc_uncorrected_volatile is None
    assert a.remapped_rows_pending is None
    assert a.throttle_reasons == 1  # GPU idle: not a slowdown
    assert b.uuid is None
    assert b.utilization_pct is None
    assert b.temperature_c is None
    assert b.power_w is None
    assert b.throttle_reasons is None
    assert classify(a)[0] == classify(b)[0] == "healthy"


def test_uncorrected_ecc_pending_repairs_and_thermal_slowdown() -> None:
    ecc, hot, retired = parse_observations(text("ecc-uncorrected", "observe.txt")).devices
    assert (ecc.ecc_uncorrected_volatile, ecc.ecc_uncorrected_aggregate) == (2, 7)
    assert classify(ecc) == ("unhealthy", "2 uncorrected ECC errors since the driver loaded")
    assert hot.throttle_reasons == 0x60
    assert classify(hot) == (
        "degraded",
        "clocks slowed: software thermal slowdown, hardware thermal slowdown",
    )
    # Lifetime (aggregate) errors alone never make a device unhealthy: only pending repairs.
    assert retired.ecc_uncorrected_aggregate == 3
    assert retired.retired_pages_pending is True
    assert classify(retired) == (
        "degraded",
        "retired pages pending (applied at the next GPU reset)",
    )


def test_gpu_is_lost_names_the_device_by_its_bus_id() -> None:
    first = parse_observations(text("h100-dgx-8x", "observe.txt"))
    assert len(first.devices) == 8
    # Without an earlier pass the lost GPU's index is unknown: a note, the others stand.
    alone = parse_observations(text("gpu-lost", "observe.txt"))
    assert [d.index for d in alone.devices] == [0, 2]
    assert any("GPU is lost" in n and "index is unknown" in n for n in alone.notes)
    # With the bus ids of an earlier pass (0000:4F:00.0 was index 1) it is device 1, lost.
    seen = parse_observations(text("gpu-lost", "observe.txt"), buses={"00000000:4F:00.0": 1})
    lost = seen.devices[1]
    assert (lost.index, lost.state) == (1, "lost")
    assert classify(lost)[0] == "unhealthy"
    assert "GPU is lost" in (classify(lost)[1] or "")


def test_requires_reset() -> None:
    # As public notes show it: some fields of the row read "[GPU requires reset]" while others
    # still answer (memory.used 0); one such field is enough, and what did answer is kept.
    reset, ok = parse_observations(text("requires-reset", "observe.txt")).devices
    assert reset.state == "reset_required"
    assert classify(reset) == ("unhealthy", "nvidia-smi: GPU requires reset")
    assert reset.memory_used_mib == 0
    assert (reset.utilization_pct, reset.temperature_c, reset.power_w) == (None, None, None)
    assert reset.retired_pages_pending is None
    assert (ok.state, ok.memory_used_mib, ok.utilization_pct, ok.temperature_c) == (
        "ok",
        61210,
        97,
        71,
    )
    assert classify(ok) == ("healthy", None)


def test_detection_skips_a_lost_gpu_and_keeps_the_others() -> None:
    devices = parse_nvidia_smi(text("gpu-lost", "query.txt"))
    assert [d.index for d in devices] == [0, 2]


async def test_probe_offers_the_answering_gpus_when_one_is_lost() -> None:
    ctx = ProbeContext(run=runner("gpu-lost"), timeout=5, system="linux", machine="x86_64")
    found = await NvidiaProbe().probe(ctx)
    assert [d.index for d in found.accelerators] == [0, 2]
    assert any("GPU is lost" in n for n in found.notes)


async def test_observe_runs_the_query_and_keeps_going_on_a_lost_gpu() -> None:
    seen, result = await observe(runner("gpu-lost"), 5, {"00000000:4F:00.0": 1})
    assert result.returncode == 15
    assert [(d.index, d.state) for d in seen.devices] == [(0, "ok"), (1, "lost"), (2, "ok")]
    assert result.argv[1] == f"--query-gpu={','.join(OBSERVE_FIELDS)}"


def test_a_recorded_double_bit_error_then_the_reset_that_cleared_it() -> None:
    # An RTX PRO 6000 Blackwell whose GPU 1 had a DRAM double-bit error (2 volatile, 2
    # aggregate, a row remap pending), then the same GPUs after `nvidia-smi -i 1 -r`: values
    # transcribed from the public post named in tests/fixtures/README.md.
    before = parse_observations(text("ecc-dbe-rtx-pro-6000", "observe.txt"))
    ok, dbe = before.devices
    assert before.buses == {"00000000:54:00.0": 0, "00000000:55:00.0": 1}
    assert (ok.temperature_c, ok.power_w, ok.memory_used_mib) == (27, 34.0, 0)
    assert (dbe.ecc_uncorrected_volatile, dbe.ecc_uncorrected_aggregate) == (2, 2)
    assert dbe.remapped_rows_pending is True
    assert dbe.memory_free_mib is None  # a column the transcription doesn't have
    assert classify(ok) == ("healthy", None)
    assert classify(dbe) == ("unhealthy", "2 uncorrected ECC errors since the driver loaded")
    # After the reset: volatile back to 0, the lifetime count stays 2, the remap applied.
    after = parse_observations(text("ecc-dbe-rtx-pro-6000", "observe-after-reset.txt"))
    cleared = after.devices[1]
    assert (cleared.ecc_uncorrected_volatile, cleared.ecc_uncorrected_aggregate) == (0, 2)
    assert cleared.remapped_rows_pending is False
    assert classify(cleared) == ("healthy", None)  # the lifetime count alone never judges
    t = Tracker(recover_after=2)
    assert [d.health for d in t.update(before.devices)] == ["healthy", "unhealthy"]
    assert t.update(after.devices)[1].health == "unhealthy"  # 1 clean observation
    assert t.update(after.devices)[1].health == "healthy"  # 2: recovered


def test_hysteresis_recovers_after_clean_observations_only() -> None:
    sick = DeviceObservation(index=3, ecc_uncorrected_volatile=1)
    clean = DeviceObservation(index=3, ecc_uncorrected_volatile=0)
    t = Tracker(recover_after=3)
    assert t.update([sick])[0].health == "unhealthy"
    assert t.update([clean])[0].health == "unhealthy"  # 1 clean
    assert t.update([clean])[0].health == "unhealthy"  # 2 clean
    assert t.update([sick])[0].health == "unhealthy"  # worse again: the count starts over
    assert [t.update([clean])[0].health for _ in range(3)] == ["unhealthy", "unhealthy", "healthy"]
    # Worse takes effect at once.
    assert t.update([sick])[0].health == "unhealthy"


def test_mig_listing_a100_seven_1g10gb() -> None:
    # `nvidia-smi -L` rebuilt in the shape DataDog/datadog-agent#33120 shows (UUIDs ours).
    listing = parse_mig_listing(text("a100-sxm4-80gb-mig7-1g10gb", "list.txt"))
    (instances,) = listing.values()
    assert [(i.parent, i.device, i.profile) for i in instances] == [
        (0, n, "1g.10gb") for n in range(7)
    ]
    assert instances[0].uuid == "MIG-67698fbe-852f-4983-a8ef-9a403b08c456"


def test_mig_listings_with_mixed_gpus_and_profiles() -> None:
    # telegraf#5812: GPU 0 in MIG with 4x 1g.20gb, GPUs 1-3 whole.
    mixed = parse_mig_listing(text("mig-listings", "a100-80gb-4x1g20gb-and-3-whole.txt"))
    assert list(mixed) == [0]
    assert [i.profile for i in mixed[0]] == ["1g.20gb"] * 4
    # nvidia-container-toolkit#203: 2x 3g.40gb on an A100 80GB PCIe.
    big = parse_mig_listing(text("mig-listings", "a100-80gb-pcie-2x3g40gb.txt"))
    assert [(i.device, i.profile) for i in big[0]] == [(0, "3g.40gb"), (1, "3g.40gb")]


def test_mig_listing_h100_mixed_profiles() -> None:
    # NVIDIA's MIG user guide (R570): one H100 with a 3g.40gb GPU instance split into three
    # 1c compute instances, and two 1g.10gb instances.
    listing = parse_mig_listing(text("mig-listings", "h100-80gb-3x1c3g40gb-2x1g10gb.txt"))
    (instances,) = listing.values()
    assert [(i.parent, i.device, i.profile) for i in instances] == [
        (0, 0, "1c.3g.40gb"),
        (0, 1, "1c.3g.40gb"),
        (0, 2, "1c.3g.40gb"),
        (0, 3, "1g.10gb"),
        (0, 4, "1g.10gb"),
    ]
    assert instances[3].uuid == "MIG-1d9f0039-f917-49a1-84e0-e13e97c13889"


def test_mig_listing_a100_seven_1g5gb_and_every_r470_shape() -> None:
    # NVIDIA's MIG user guide (R470): eight A100-SXM4-40GB configured differently, GPU lines
    # indented as the guide prints them (the parser used to find no GPU line there at all).
    listing = parse_mig_listing(text("mig-listings", "a100-40gb-8x-r470.txt"))
    assert sorted(listing) == list(range(8))
    assert [i.profile for i in listing[0]] == ["1g.5gb"] * 7
    assert [i.device for i in listing[0]] == list(range(7))
    assert [i.profile for i in listing[6]] == ["1c.7g.40gb", "2c.7g.40gb", "3c.7g.40gb"]
    assert [i.profile for i in listing[7]] == ["4g.20gb", "2g.10gb", "1g.5gb"]
    assert sum(len(v) for v in listing.values()) == 7 + 3 + 2 + 1 + 6 + 1 + 3 + 3


def test_mig_memory_from_the_mig_devices_table() -> None:
    # Rows as nvitop#8 shows them (A100-SXM4-80GB, 19968 MiB instances).
    memory = parse_mig_memory(text("a100-sxm4-80gb-mig-2g20gb", "smi.txt"))
    assert memory == {(1, 0): 19968, (1, 1): 19968, (1, 2): 19968}
    assert parse_mig_memory(text("h200-1x", "smi.txt")) == {}
    # R535's table (plain nvidia-smi rebuilt from a public post): 1g.10gb is 9728 MiB on an
    # A100 80GB.
    r535 = parse_mig_memory(text("a100-pcie-80gb-2x-whole-2x-mig7-1g10gb", "smi.txt"))
    assert r535 == {(g, d): 9728 for g in (2, 3) for d in range(7)}
    # R570's wider table, four profiles on one GPU (all-balanced on an A100 80GB PCIe).
    r570 = parse_mig_memory(text("mig-listings", "smi-a100-80gb-pcie-r570-all-balanced.txt"))
    assert r570 == {(0, 0): 40192, (0, 1): 19968, (0, 2): 9728, (0, 3): 9728}


def test_compute_instances_of_one_gpu_instance_share_its_memory() -> None:
    # In the shape of NVIDIA's MIG user guide: GPU instance 2 (3g.20gb, 20224 MiB) split into
    # three compute instances; nvidia-smi prints the memory on the first row only.
    rows = parse_mig_table(text("mig-listings", "smi-a100-40gb-gi2-3ci.txt"))
    assert [(r.gi, r.ci, r.device, r.total_mib) for r in rows] == [
        (2, 0, 0, 20224),
        (2, 1, 1, None),
        (2, 2, 2, None),
    ]
    shares = mig_shares(rows)
    assert shares == {(0, 0): (1, 2), (0, 1): (0, 2), (0, 2): (0, 1)}
    # Three 1c.3g.20gb devices (their -L lines as the guide lists them for its GPU 4): only
    # the one with the memory figure is offered, so no two jobs are promised the same 20 GB.
    listing = parse_mig_listing(text("mig-listings", "a100-40gb-8x-r470.txt"))
    parent = parse_nvidia_smi(
        "0, GPU-0dab02e1-2285-4b0d-9b5a-2f1d3b02ac82, A100-SXM4-40GB, 40960, 8.0, 470.42.01,"
        " Default, Enabled\n"
    )[0]
    instances = [dataclasses.replace(i, parent=0) for i in listing[4][:3]]
    memory = {(r.gpu, r.device): r.total_mib for r in rows if r.total_mib}
    first, second, third = mig_devices(parent, instances, memory, shares)
    assert (first.mig_profile, first.memory_mib, first.execution_supported) == (
        "1c.3g.20gb",
        20224,
        True,
    )
    assert "shares its GPU instance's 20224 MiB with MIG device(s) 1, 2" in first.notes[0]
    for d in (second, third):
        assert (d.memory_mib, d.execution_supported) == (None, False)
        assert "not offered: shares its GPU instance's memory with MIG device 0" in d.notes[0]


async def test_mig_instances_are_devices_of_their_own() -> None:
    ctx = ProbeContext(
        run=runner("a100-sxm4-80gb-mig-2g20gb"), timeout=5, system="linux", machine="x86_64"
    )
    found = await NvidiaProbe().probe(ctx)
    whole, parent, *instances = found.accelerators
    assert (whole.index, whole.execution_supported) == (0, True)
    assert (parent.index, parent.execution_supported) == (1, False)  # never granted whole
    assert [(d.index, d.mig_parent, d.mig_profile, d.memory_mib) for d in instances] == [
        (mig_index(1, n), 1, "2g.20gb", 19968) for n in range(3)
    ]
    assert all(d.execution_supported and d.uuid and d.uuid.startswith("MIG-") for d in instances)
    assert "3 MIG instance(s)" in found.host_apis["cuda"]
    # A grant of instance 1 opens GPU 1's device node and shows CUDA the instance by UUID.
    devices, uuids = grant_devices(found.accelerators, [mig_index(1, 1)])
    assert devices == [1]
    assert uuids == [instances[1].uuid]
    env = visibility_env("cuda", devices, True, uuids)
    assert env["CUDA_VISIBLE_DEVICES"] == instances[1].uuid
    assert env["GPULAYER_DEVICES"] == "1"
    assert visibility_env("cuda", devices, False, uuids)["CUDA_VISIBLE_DEVICES"] == ""


async def test_a_1g10gb_table_gives_each_instance_its_memory() -> None:
    # Two whole A100 80GB PCIe and two in MIG with 7x 1g.10gb each: plain nvidia-smi rebuilt
    # in the shape of a public post, -L and the query around it (tests/fixtures/README.md).
    ctx = ProbeContext(
        run=runner("a100-pcie-80gb-2x-whole-2x-mig7-1g10gb"),
        timeout=5,
        system="linux",
        machine="x86_64",
    )
    found = await NvidiaProbe().probe(ctx)
    whole = [d for d in found.accelerators if d.mig_parent is None]
    instances = [d for d in found.accelerators if d.mig_parent is not None]
    assert [(d.index, d.execution_supported) for d in whole] == [
        (0, True),
        (1, True),
        (2, False),
        (3, False),
    ]
    assert [(d.index, d.mig_profile, d.memory_mib) for d in instances] == [
        (mig_index(g, n), "1g.10gb", 9728) for g in (2, 3) for n in range(7)
    ]
    assert all(d.execution_supported and not d.notes for d in instances)
    assert "2 usable whole, 14 MIG instance(s)" in found.host_apis["cuda"]


async def test_mig_instances_without_a_memory_row_have_unknown_memory() -> None:
    # The 1g.10gb recording has no "MIG devices" table: memory unknown, and said.
    ctx = ProbeContext(
        run=runner("a100-sxm4-80gb-mig7-1g10gb"), timeout=5, system="linux", machine="x86_64"
    )
    found = await NvidiaProbe().probe(ctx)
    parent, *instances = found.accelerators
    assert len(instances) == 7
    assert parent.execution_supported is False
    assert all(d.memory_mib is None for d in instances)
    assert all("memory unknown" in d.notes[0] for d in instances)


async def test_mig_listing_missing_is_a_note() -> None:
    ctx = ProbeContext(
        run=runner("a100-sxm4-80gb-mig"), timeout=5, system="linux", machine="x86_64"
    )
    found = await NvidiaProbe().probe(ctx)
    assert len(found.accelerators) == 2
    assert any("MIG instances unknown" in n for n in found.notes)


@pytest.mark.parametrize("names", [["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"], []])
def test_gpu_device_files(tmp_path: Path, names: list[str]) -> None:
    for n in names:
        (tmp_path / n).touch()
    assert gpu_device_files(str(tmp_path)) == [n for n in names if n[6:].isdigit()]
    assert gpu_device_files(str(tmp_path / "missing")) == []


def test_observation_bounds_refuse_nan_and_huge_values() -> None:
    from datetime import UTC, datetime

    from gpulayer_contracts.bounds import validate_observations
    from gpulayer_contracts.health import NodeObservations

    good = NodeObservations(node_id="n", observed_at=datetime.now(UTC), devices=[])
    assert validate_observations(good) == []
    bad = msgspec.structs.replace(
        good,
        devices=[
            DeviceObservation(
                index=0,
                power_w=float("nan"),
                temperature_c=10**9,
                ecc_uncorrected_volatile=-1,
                reason="x\x00",
            )
        ],
    )
    errors = validate_observations(bad)
    assert any("power_w" in e for e in errors)
    assert any("temperature_c" in e for e in errors)
    assert any("ecc_uncorrected_volatile" in e for e in errors)
    assert any("NUL" in e for e in errors)


def test_drift_between_two_detections_of_a_recorded_node() -> None:
    from datetime import UTC, datetime

    from gpulayer_contracts.capabilities import WorkerCapabilities
    from gpulayer_contracts.health import drift, vanished

    def caps(query: str) -> WorkerCapabilities:
        return WorkerCapabilities(
            node_id="n",
            agent_version="test",
            detected_at=datetime.now(UTC),
            accelerators=parse_nvidia_smi(query),
        )

    before = text("h100-dgx-8x", "query.txt")
    # After a driver update GPU 5 no longer answers and GPU 2 reports less memory (ECC mode
    # toggled, say): each is drift, and only the vanished one loses its jobs.
    rows = before.replace("535.129.03", "550.54.15").splitlines()
    rows = [r for r in rows if not r.startswith("5,")]
    rows = [r.replace("81559", "80000") if r.startswith("2,") else r for r in rows]
    old, new = caps(before), caps("\n".join(rows) + "\n")
    changes = drift(old, new)
    assert len([c for c in changes if "driver 535.129.03 -> 550.54.15" in c]) == 7
    assert [c for c in changes if "vanished" in c] == [
        "cuda device 5 (GPU, GPU-8d116ece-1738-f7d9-3d9c-172411e20b8f) vanished from node n"
    ]
    assert any(c.startswith("cuda device 2 ") and "memory 81559 -> 80000 MiB" in c for c in changes)
    assert list(vanished(old, new)) == [5]
    assert drift(old, old) == []
    # MIG turned on for GPUs 2 and 3: neither is usable whole any more, and nothing else moved.
    query = text("a100-pcie-80gb-2x-whole-2x-mig7-1g10gb", "query.txt")
    changes = drift(caps(query.replace("Enabled", "Disabled")), caps(query))
    assert [c.split(" (", 1)[0] + ": " + c.rsplit(": ", 1)[1] for c in changes] == [
        "cuda device 2: no longer usable",
        "cuda device 3: no longer usable",
    ]


def test_one_job_per_gpu_instance_split_into_compute_instances() -> None:
    # GI 2 in the guide's shape (three compute instances, 20224 MiB between them) as detection
    # offers it: a 10 GB job gets the instance holding the memory; while it runs, a second
    # 10 GB job gets none of the other two, which would share that memory.
    from datetime import UTC, datetime

    from gpulayer_contracts.capabilities import WorkerCapabilities
    from gpulayer_contracts.jobs import JobRequest, Requirements
    from gpulayer_matching import NodeView, Placement, match

    rows = parse_mig_table(text("mig-listings", "smi-a100-40gb-gi2-3ci.txt"))
    listing = parse_mig_listing(text("mig-listings", "a100-40gb-8x-r470.txt"))
    (parent,) = parse_nvidia_smi(
        "0, GPU-0dab02e1-2285-4b0d-9b5a-2f1d3b02ac82, A100-SXM4-40GB, 40960, 8.0, 470.42.01,"
        " Default, Enabled\n"
    )
    instances = [dataclasses.replace(i, parent=0) for i in listing[4][:3]]
    memory = {(r.gpu, r.device): r.total_mib for r in rows if r.total_mib}
    caps = WorkerCapabilities(
        node_id="ci",
        agent_version="t",
        detected_at=datetime.now(UTC),
        accelerators=[parent, *mig_devices(parent, instances, memory, mig_shares(rows))],
    )
    ten = JobRequest(
        job_id="j",
        command=["true"],
        requirements=Requirements(accelerator="cuda", gpu_count=1, gpu_memory_gb=10),
    )
    placed = match(ten, [NodeView(node_id="ci", capabilities=caps)])
    assert isinstance(placed, Placement)
    assert placed.devices == [mig_index(0, 0)]
    busy = NodeView(node_id="ci", capabilities=caps, exclusive=frozenset({mig_index(0, 0)}))
    assert not isinstance(match(ten, [busy]), Placement)


async def test_a_mismatch_that_stays_asks_for_one_redetection_not_one_per_period() -> None:
    """A node whose observation query fails while detection works (the MIG scenario records
    no observation) used to re-detect every period, forever."""
    caps = await NvidiaProbe().probe(
        ProbeContext(
            run=runner("a100-pcie-80gb-2x-whole-2x-mig7-1g10gb"),
            timeout=5,
            system="linux",
            machine="x86_64",
        )
    )
    node = msgspec.structs.replace(gpu_node("n", 0), accelerators=caps.accelerators)
    asked: list[int] = []
    observer = Observer(
        None,  # type: ignore[arg-type]  # observe_once publishes nothing
        "n",
        run=runner("a100-pcie-80gb-2x-whole-2x-mig7-1g10gb"),
        timeout=5,
        interval_s=1,
        recover_after=2,
        dev_dir="/nonexistent",
        capabilities=lambda: current,
        redetect=lambda: asked.append(1),
    )
    current = node
    for _ in range(3):
        await observer.observe_once()
    assert len(asked) == 1
    # Another detection result is another mismatch: asked once more.
    current = msgspec.structs.replace(node, accelerators=node.accelerators[:1])
    await observer.observe_once()
    await observer.observe_once()
    assert len(asked) == 2

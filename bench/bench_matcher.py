"""Micro-benchmark of the pure matcher: placements per second over simulated fleets.

Prints ``name=value unit`` lines; figures only, nothing is asserted. Run with
``.venv/bin/python bench/bench_matcher.py`` (``--quick`` for fewer rounds).

Fleets: 8x H100-class CUDA nodes, rotated each call the way the placement service rotates them.
- typical: 30% of the devices held (random), every node a candidate;
- mostly_busy: 95% of the nodes fully held, the free ones spread out, so first-fit scans
  about twenty nodes per placement;
- none_free: every device held, so each call scans the whole fleet and builds the explanation
  (the worst case: a job that must wait).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime

from gpulayer_contracts.capabilities import AcceleratorDevice, GpuApis, HostInfo, WorkerCapabilities
from gpulayer_contracts.jobs import GpuUsage, JobRequest, Requirements
from gpulayer_matching import NodeView, Placement, explain, match

DEVICES = 8


def _caps(node_id: str) -> WorkerCapabilities:
    return WorkerCapabilities(
        node_id=node_id,
        agent_version="0.1.0",
        detected_at=datetime.now(UTC),
        host=HostInfo(platform="linux-x86_64", python_version="3.11.9"),
        accelerators=[
            AcceleratorDevice(
                accelerator="cuda",
                index=i,
                name="NVIDIA H100 80GB HBM3",
                memory_mib=81559,
                memory_kind="dedicated",
                compute_capability="9.0",
                execution_supported=True,
            )
            for i in range(DEVICES)
        ],
        workload_python_version="3.11.9",
        frameworks={"torch": "2.5.1+cu124", "numpy": "2.1.3"},
        framework_capabilities=["torch.cuda"],
        gpu_apis=GpuApis(host=["cuda", "vulkan", "opencl"], containers=["cuda"]),
    )


def fleet(size: int, scenario: str, rng: random.Random) -> list[NodeView]:
    nodes = []
    for i in range(size):
        held: frozenset[int]
        if scenario == "typical":
            held = frozenset(d for d in range(DEVICES) if rng.random() < 0.3)
        elif scenario == "mostly_busy":
            held = frozenset() if i % 20 == 19 else frozenset(range(DEVICES))
        else:
            held = frozenset(range(DEVICES))
        nodes.append(NodeView(node_id=f"n{i:05d}", capabilities=_caps(f"n{i:05d}"), exclusive=held))
    return nodes


class Rotated(Sequence[NodeView]):
    """The service's rotation (fleet.Rotated), reimplemented so the bench stands alone."""

    def __init__(self, items: list[NodeView], start: int) -> None:
        self._items, self._start = items, start % len(items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # unused by the matcher
        raise NotImplementedError

    def __iter__(self) -> Iterator[NodeView]:
        yield from self._items[self._start :]
        yield from self._items[: self._start]


def cuda_job(i: int) -> JobRequest:
    return JobRequest(
        job_id=f"bench-{i}",
        command=["python", "train.py"],
        requirements=Requirements(
            accelerator="cuda",
            gpu_count=1,
            gpu_memory_gb=40,
            min_cuda_compute_capability=8.0,
            frameworks={"torch": ">=2.1"},
            framework_capabilities=["torch.cuda"],
            python=">=3.10",
        ),
        gpu=GpuUsage(use="exclusive"),
    )


def rate(nodes: list[NodeView], rounds: int) -> tuple[float, int]:
    """Placements (or refusals) per second, and how many calls placed."""
    jobs = [cuda_job(i) for i in range(rounds)]  # a new job object each call, as in the service
    explain(jobs[0], nodes)  # warm the per-node caches, as a running service has them
    placed = 0
    start = time.perf_counter()
    for i, job in enumerate(jobs):
        if isinstance(match(job, Rotated(nodes, i * 7919)), Placement):
            placed += 1
    return rounds / (time.perf_counter() - start), placed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    args = parser.parse_args(argv)
    rng = random.Random(6)
    for size in (1_000, 10_000):
        for scenario in ("typical", "mostly_busy", "none_free"):
            nodes = fleet(size, scenario, rng)
            rounds = 2_000 if scenario != "none_free" else max(20, 200_000 // size)
            if args.quick:
                rounds //= 10
            per_s, placed = rate(nodes, rounds)
            print(f"matcher_cpu_{size}_nodes_{scenario}={per_s:.0f} placements/s")
            if scenario != "none_free" and placed != rounds:
                print(f"# {scenario}: only {placed}/{rounds} calls placed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

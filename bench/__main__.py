"""``python -m bench [--full]``: every figure of issue 7, one ``name=value unit`` line each,
then a summary table with the goals. Quick mode stays under 3 minutes on a 2-core machine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import asyncpg
import msgspec

from bench import containers, harness
from bench.figures import (
    REPO,
    Sizes,
    full_loop,
    jobs_throughput,
    naive_postgres,
    observations_under_load,
    output_flood,
    placement_memory,
    placement_throughput,
    probe_figures,
    publish_cost,
    raw_jetstream,
    signing_cost,
    submit_to_grant_latency,
    telemetry_noop_cost,
)
from bench.figures import capability_ingest as ingest_figure
from bench.fleet import FleetShape, cuda_job, encoded, fleet, gpu_jobs_for, job_mix
from bench.harness import BenchError, Scenario, load_fleet, scenario
from bench.peers import ray_figures
from bench.quiet import SETTLED_ENV, settle
from bench.report import Figure, Report, dump, judge, print_summary, unavailable
from bench.strip_telemetry import stripped_placement
from gpulayer_contracts import JobRequest, WorkerCapabilities
from gpulayer_contracts.jobs import Distributed, GpuUsage
from gpulayer_runtime.pgserver import EmbeddedPostgres
from gpulayer_runtime.servers import ServerStartError

T = TypeVar("T")

# Goals from issue 7 (figures, never tests).
GOAL_PLACEMENT_1K = 2_500.0
GOAL_PLACEMENT_10K = 0.8 * GOAL_PLACEMENT_1K
GOAL_NAIVE_RATIO = 3.0
GOAL_P99_MS = 25.0
GOAL_INGEST = 10_000.0
GOAL_LOOP = 500.0
GOAL_LOOP_P99_MS = 50.0
GOAL_PROBE_MS = 150.0
GOAL_RSS_MB = 300.0
# Hostile-input issue: a job printing 200 MB no slower than 2x the same job printing to /dev/null.
GOAL_FLOOD_RATIO = 2.0
# Security issue: placement with NATS auth and grant signing on at least 0.9x its throughput
# with both off.
GOAL_SIGNING_RATIO = 0.9
# Fleet page issue (29): the fleet page at 1,000 nodes and the jobs page at 10,000 jobs.
GOAL_WEB_PAGE_MS = 200.0
# Container start (issue 49): a container job's start p50 within 1.15x of `podman run --rm`'s.
GOAL_CONTAINER_START = 1.15


# The peer workload's size (issue 19): 5,000 jobs, as the issue measured Ray.
PEER_LOOP_JOBS = 5_000
PEER_LOOP_PACED = 1_000


class Run:
    def __init__(self, sizes: Sizes, root: Path, admin_url: str, profile: Path | None) -> None:
        self.sizes = sizes
        self.root = root
        self.admin_url = admin_url
        self.profile = profile
        self.figures: list[Figure] = []
        # --peers: Ray on the loop's workload after it (the loop then runs at the peer size).
        self.peers = False

    def loop_size(self) -> tuple[int, int]:
        """(burst, paced) jobs of the measured full loop: the peer workload's with --peers."""
        if self.peers:
            return max(self.sizes.loop_jobs, PEER_LOOP_JOBS), max(
                self.sizes.loop_paced, PEER_LOOP_PACED
            )
        return self.sizes.loop_jobs, self.sizes.loop_paced

    def add(self, *figs: Figure) -> None:
        for f in figs:
            self.figures.append(f)
            print(f.line(), flush=True)

    def get(self, name: str) -> float | None:
        for f in self.figures:
            if f.name == name:
                return f.value
        return None

    @contextlib.asynccontextmanager
    async def scenario(
        self,
        name: str,
        placement_env: dict[str, str] | None = None,
        replicas: int = 1,
        auth: bool = True,
    ) -> AsyncIterator[Scenario]:
        async with scenario(
            name,
            self.root,
            self.admin_url,
            profile_dir=self.profile,
            placement_env=placement_env,
            replicas=replicas,
            auth=auth,
        ) as s:
            yield s


async def _guard(
    run: Run, names: list[tuple[str, str]], work: Callable[[], Awaitable[None]]
) -> None:
    """Run a group of figures; if it fails, each figure it would have printed and hasn't yet
    becomes ``unavailable`` with the reason."""
    try:
        await work()
    except (BenchError, ServerStartError, asyncpg.PostgresError, OSError, TimeoutError) as err:
        reason = f"{type(err).__name__}: {err}"
        for name, unit in names:
            if run.get(name) is None and not any(f.name == name for f in run.figures):
                run.add(unavailable(name, unit, reason))


async def placement_group(run: Run, n: int, tag: str) -> None:
    sz = run.sizes
    shape = FleetShape.of(n)
    tp_name = f"placement_{tag}_nodes"
    cpu_parts = ("placement", "postgres", "nats", "load_generator", "total")
    names = [(tp_name, "jobs/s")]
    names += [(f"placement_{tag}_cpu_us_per_job_{part}", "us") for part in cpu_parts]
    if tag == "10k":
        names += [
            ("capability_ingest_10k", "events/s"),
            ("capability_staleness_p99_10k", "ms"),
            ("placement_rss_peak", "MB"),
        ]

    async def work() -> None:
        async with run.scenario(f"n{tag}") as s:
            initial = await load_fleet(s, fleet(f"n{tag}", n), timeout=max(30.0, n / 200))
            run.add(Figure(f"capability_initial_load_{tag}", initial, "events/s"))
            after_fleet = s.placement.sample_rss()
            tp = await placement_throughput(s, f"tp{tag}", sz.jobs, shape)
            note = f"{tp.granted}/{tp.submitted} granted in {tp.seconds:.1f}s"
            run.add(
                Figure(tp_name, tp.rate, "jobs/s", note=note),
                Figure(f"submit_publish_rate_{tag}", tp.publish_rate, "jobs/s"),
                # CPU per job, all processes first publish to last grant: steadier than the
                # rate on a shared machine, and it says which part a change moved.
                *(
                    Figure(f"placement_{tag}_cpu_us_per_job_{part}", tp.cpu_us_per_job[part], "us")
                    for part in cpu_parts
                ),
            )
            if tp.granted < tp.submitted:
                print(f"# {tp_name}: {note}", flush=True)
            if tag != "10k":
                return
            ing = await ingest_figure(s, f"n{tag}", n)
            run.add(
                Figure("capability_ingest_10k", ing.rate, "events/s"),
                Figure("capability_publish_rate_10k", ing.publish_rate, "events/s"),
                Figure("capability_staleness_p50_10k", ing.stale_p50, "ms"),
                Figure("capability_staleness_p99_10k", ing.stale_p99, "ms"),
                Figure("capability_staleness_max_10k", ing.stale_max, "ms"),
            )
            mem = await placement_memory(s, sz.pending, after_fleet)
            run.add(
                Figure("placement_rss_after_fleet_10k", mem.after_fleet_mb, "MB"),
                Figure(
                    "placement_rss_peak",
                    mem.peak_mb,
                    "MB",
                    note=f"10,000 nodes, {sz.jobs} placed + {mem.pending} pending jobs",
                ),
                Figure("pending_jobs_considered", mem.pending / mem.seconds, "jobs/s"),
            )

    await _guard(run, names, work)


async def replicas_group(run: Run) -> None:
    """The 1k throughput run with two placement replicas sharing the consumers and database."""
    sz = run.sizes
    shape = FleetShape.of(sz.small_nodes)

    async def work() -> None:
        async with run.scenario("r2", replicas=2) as s:
            # Both replicas must hold the fleet before jobs arrive, or one places against a
            # partial view; each absorbs capabilities on its own ordered consumer.
            await load_fleet(s, fleet("r2", sz.small_nodes), timeout=60)
            await asyncio.sleep(2.0)
            tp = await placement_throughput(s, "r2", sz.jobs, shape)
            run.add(
                Figure(
                    "placement_1k_nodes_2_replicas",
                    tp.rate,
                    "jobs/s",
                    note=f"{tp.granted}/{tp.submitted} granted in {tp.seconds:.1f}s",
                )
            )

    await _guard(run, [("placement_1k_nodes_2_replicas", "jobs/s")], work)


async def latency_group(run: Run) -> None:
    sz = run.sizes
    n = sz.small_nodes
    names = [("submit_to_grant_p50", "ms"), ("submit_to_grant_p99", "ms")]

    async def work() -> None:
        async with run.scenario("latency") as s:
            await load_fleet(s, fleet("lat", n), timeout=60)
            lat = await submit_to_grant_latency(s, sz.latency_rate, sz.latency_s, FleetShape.of(n))
            run.add(
                Figure("submit_to_grant_offered", lat.offered, "jobs/s"),
                Figure("submit_to_grant_p50", lat.p50, "ms"),
                Figure("submit_to_grant_p99", lat.p99, "ms"),
                Figure("submit_to_grant_max", lat.max, "ms"),
            )
            if lat.granted < lat.submitted:
                print(f"# latency: only {lat.granted}/{lat.submitted} granted", flush=True)

    await _guard(run, names, work)


async def loop_group(run: Run) -> None:
    sz = run.sizes
    names = [
        ("full_loop_jobs_per_s", "jobs/s"),
        ("full_loop_submit_to_start_p50", "ms"),
        ("full_loop_submit_to_start_p99", "ms"),
    ]

    async def work() -> None:
        if harness.CPROFILE_DIR is None and SHIM_AB:  # a profiled run measures the loop alone
            await _shim_ab(run)
        async with run.scenario("loop") as s:
            burst, paced = run.loop_size()
            limit = 120.0 if sz.full or burst > sz.loop_jobs else 40.0
            fl = await full_loop(s, burst, paced, limit, LOOP_ENV or None)
            note = f"{fl.completed}/{fl.submitted} finished, {fl.failed} not succeeded"
            run.add(Figure("full_loop_jobs_per_s", fl.rate, "jobs/s", note=note))
            if fl.failed or fl.completed < fl.submitted:
                print(f"# full loop: {note}", flush=True)
            run.add(
                Figure("full_loop_paced_offered", fl.start_rate, "jobs/s"),
                Figure("full_loop_submit_to_start_p50", fl.start_p50, "ms"),
                Figure("full_loop_submit_to_start_p99", fl.start_p99, "ms"),
                Figure("full_loop_burst_submit_to_start_p50", fl.queued_start_p50, "ms"),
                Figure("full_loop_burst_submit_to_start_p99", fl.queued_start_p99, "ms"),
            )
            # Where the loop's CPU goes (bench/cpu.py): µs per job of the burst, per process.
            for part, us in fl.cpu_us_per_job.items():
                run.add(Figure(f"full_loop_cpu_us_per_job_{part}", us, "us"))

    await _guard(run, names, work)


# The container loop: a container start costs about a second here, so the loop is small.
CONTAINER_BURST = 24
CONTAINER_PACED = 12


def _no_podman(run: Run, names: list[tuple[str, str]]) -> bool:
    """Whether podman can't run a container here: each of ``names`` is then unavailable, why."""
    why = containers.missing()
    if why is None:
        return False
    for name, unit in names:
        run.add(unavailable(name, unit, why))
    return True


@contextlib.asynccontextmanager
async def _container_scenario(
    run: Run, name: str
) -> AsyncIterator[tuple[Scenario, str, dict[str, str]]]:
    """Scenario ``name`` with the bench's busybox image built in a folder of its own: the
    scenario, the image, and the executor's environment (its fake device folder)."""
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=run.root))
    with containers.bench_image(folder) as image:
        env = {"GPULAYER_EXECUTOR_DEVICE_DIR": str(containers.device_dir(folder))}
        async with run.scenario(name) as s:
            yield s, image, env


async def loop_container_group(run: Run) -> None:
    """The full loop with every job in a container (podman, a busybox image made here), beside
    the bare loop's figures: what a container start costs."""
    names = [
        ("full_loop_container_jobs_per_s", "jobs/s"),
        ("full_loop_container_submit_to_start_p50", "ms"),
    ]
    if _no_podman(run, names):
        return

    async def work() -> None:
        async with _container_scenario(run, "loop_container") as (s, image, env):
            fl = await full_loop(
                s,
                CONTAINER_BURST,
                CONTAINER_PACED,
                120.0,
                env,
                make_job=containers.job_maker(image),
                command=containers.COMMAND,
                paced_floor=0.5,
                node_caps=containers.container_node,
            )
        note = f"{fl.completed}/{fl.submitted} finished, {fl.failed} not succeeded"
        if fl.failed or fl.completed < fl.submitted:
            print(f"# container loop: {note}", flush=True)
        run.add(
            Figure("full_loop_container_jobs_per_s", fl.rate, "jobs/s", note=note),
            Figure("full_loop_container_paced_offered", fl.start_rate, "jobs/s"),
            Figure("full_loop_container_submit_to_start_p50", fl.start_p50, "ms"),
            Figure("full_loop_container_submit_to_start_p99", fl.start_p99, "ms"),
        )

    await _guard(run, names, work)


async def container_start_group(run: Run) -> None:
    """A container job's start against ``podman run --rm`` of the same image and command
    alone, alternating (bench/container_start.py)."""
    from bench.container_start import container_start

    names = [
        ("container_start_p50_ms", "ms"),
        ("container_start_p99_ms", "ms"),
        ("podman_run_p50_ms", "ms"),
        ("podman_run_p99_ms", "ms"),
        ("container_start_over_podman", "x"),
    ]
    if _no_podman(run, names):
        return

    async def work() -> None:
        async with _container_scenario(run, "container_start") as (s, image, env):
            cs = await container_start(s, image, env)
        run.add(*cs.figures())

    await _guard(run, names, work)


# Rounds of the shim A/B: each is two full loops (about 20 s).
SHIM_ROUNDS = 3
# --no-shim-ab: the full loop alone; --loop-env: added to its executor's environment.
SHIM_AB = True
LOOP_ENV: dict[str, str] = {}


async def _shim_ab(run: Run) -> None:
    """The full loop's burst rate with each job under a shim (the default) and without
    (``GPULAYER_EXECUTOR_SHIM=off``), alternating on/off so drift hits both alike; medians and
    their ratio (goal: at least 0.8)."""
    sz = run.sizes
    limit = 120.0 if sz.full else 40.0
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for round_ in range(SHIM_ROUNDS):
        for variant in ("on", "off"):
            async with run.scenario(f"shim{round_}{variant}") as s:
                env = {"GPULAYER_EXECUTOR_SHIM": variant}
                fl = await full_loop(s, sz.loop_jobs, sz.loop_paced, limit, env)
                if fl.failed or fl.completed < fl.submitted:
                    raise BenchError(f"shim {variant}: {fl.completed}/{fl.submitted} finished")
                rates[variant].append(fl.rate)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print(f"# full loop runs, jobs/s: shim on {rates['on']}, shim off {rates['off']}", flush=True)
    run.add(
        Figure("full_loop_shim_on_jobs_per_s", on, "jobs/s", note=f"runs {rates['on']}"),
        Figure("full_loop_shim_off_jobs_per_s", off, "jobs/s", note=f"runs {rates['off']}"),
        Figure("full_loop_shim_on_over_off", on / off, "x"),
    )


async def peers_group(run: Run) -> None:
    """Ray on the full loop's workload, right after gpulayer's loop in the same run
    (``--peers``), and gpulayer's figures over Ray's (bench/peers.py)."""
    burst, paced = run.loop_size()
    figs = await ray_figures(
        run.root,
        burst,
        paced,
        run.get("full_loop_jobs_per_s"),
        run.get("full_loop_submit_to_start_p99"),
    )
    run.add(*figs)


async def limits_group(run: Run) -> None:
    sz = run.sizes
    shape = FleetShape.of(sz.small_nodes)
    jobs = encoded(job_mix("raw", sz.jobs, gpu_jobs_for(sz.jobs, shape)))
    run.add(await raw_jetstream(run.root, jobs))
    for f in await publish_cost(run.root, jobs):
        run.add(f)
    for f in await naive_postgres(run.admin_url, sz.naive_serial, sz.naive_concurrent):
        run.add(f)


# Single placement runs vary by +-30% on this machine (disk): the A/B takes the median of several.
ROUNDS = 5


async def telemetry_group(run: Run) -> None:
    """Placement throughput with no OTLP endpoint against the same service with its telemetry
    code removed (bench/strip_telemetry.py), alternating A/B/A/B so drift hits both alike."""
    sz = run.sizes
    shape = FleetShape.of(sz.small_nodes)
    names = [("placement_1k_telemetry_off", "jobs/s"), ("placement_1k_telemetry_removed", "jobs/s")]

    async def work() -> None:
        # Inside the guard: a rewrite that fails costs this group's figures, not the whole run.
        try:
            stripped, removed = stripped_placement(run.root / "stripped")
        except (SyntaxError, RuntimeError) as err:
            raise BenchError(f"placement with telemetry removed: {err}") from err
        path = os.pathsep.join(p for p in (str(stripped), os.environ.get("PYTHONPATH", "")) if p)
        variants = {"telemetry_off": None, "telemetry_removed": {"PYTHONPATH": path}}
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for round_ in range(ROUNDS):
            for variant, env in variants.items():
                async with run.scenario(f"tel{round_}{variant[10:]}", placement_env=env) as s:
                    await load_fleet(s, fleet(f"t{round_}", sz.small_nodes), timeout=60)
                    tp = await placement_throughput(s, f"t{round_}{variant[10:13]}", sz.jobs, shape)
                    rates[variant].append(tp.rate)
        off, cut = (
            statistics.median(rates["telemetry_off"]),
            statistics.median(rates["telemetry_removed"]),
        )
        run.add(
            Figure(
                "placement_1k_telemetry_off", off, "jobs/s", note=f"runs {rates['telemetry_off']}"
            )
        )
        run.add(
            Figure(
                "placement_1k_telemetry_removed",
                cut,
                "jobs/s",
                note=f"placement with {removed} AST nodes of telemetry removed; runs {rates['telemetry_removed']}",
            )
        )
        run.add(Figure("placement_telemetry_off_over_removed", off / cut, "x"))

    await _guard(run, names, work)


# Rounds of the signing A/B: each is two 1k placement runs (about 10 s).
SIGNING_ROUNDS = ROUNDS


async def signing_group(run: Run) -> None:
    """Placement throughput secure (NATS auth and grant signing on: the default) and open (no
    auth, ``GPULAYER_GRANT_SIGNING=off``), alternating on/off/on/off so drift hits both alike;
    the medians and their ratio. Then the cost of one signature and one check, in microseconds."""
    sz = run.sizes
    shape = FleetShape.of(sz.small_nodes)
    variants = {"on": (None, True), "off": ({"GPULAYER_GRANT_SIGNING": "off"}, False)}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    names = [
        ("placement_auth_signing_on_jobs_per_s", "jobs/s"),
        ("placement_auth_signing_off_jobs_per_s", "jobs/s"),
    ]

    async def work() -> None:
        for round_ in range(SIGNING_ROUNDS):
            for variant, (env, auth) in variants.items():
                async with run.scenario(f"sig{round_}{variant}", placement_env=env, auth=auth) as s:
                    await load_fleet(s, fleet(f"s{round_}", sz.small_nodes), timeout=60)
                    tp = await placement_throughput(s, f"s{round_}{variant}", sz.jobs, shape)
                    if tp.granted < tp.submitted:
                        raise BenchError(f"signing {variant}: {tp.granted}/{tp.submitted} granted")
                    rates[variant].append(tp.rate)
        on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
        print(f"# auth + signing runs, jobs/s: on {rates['on']}, off {rates['off']}", flush=True)
        run.add(
            Figure(
                "placement_auth_signing_on_jobs_per_s", on, "jobs/s", note=f"runs {rates['on']}"
            ),
            Figure(
                "placement_auth_signing_off_jobs_per_s", off, "jobs/s", note=f"runs {rates['off']}"
            ),
            Figure("auth_signing_on_over_off", on / off, "x"),
        )

    await _guard(run, names, work)
    for f in signing_cost():
        run.add(f)


def _with_requests(job: JobRequest) -> JobRequest:
    """Every job names its cores and RAM; CUDA jobs share their GPU with 40 GB reserved."""
    req = msgspec.structs.replace(job.requirements, cpu_cores=2.0, memory_gb=4.0)
    if req.gpu_count:
        return msgspec.structs.replace(job, requirements=req, gpu=GpuUsage(use="shared"))
    return msgspec.structs.replace(job, requirements=req)


def _no_host_report(caps: WorkerCapabilities) -> WorkerCapabilities:
    host = msgspec.structs.replace(caps.host, cpu_cores=None, memory_bytes=None)
    return msgspec.structs.replace(caps, host=host)


async def requests_group(run: Run) -> None:
    """Placement throughput with every job's cores, RAM and (for CUDA jobs) shared GPU memory
    checked against nodes that report them, against the same run where nodes report no host
    cores or RAM and jobs share no GPU memory (nothing binds but devices and the default slot
    rows); alternating, medians and their ratio. Both write every job's reservation rows, the
    part that can't be switched off: docs/performance.md has the run before accounting."""
    sz = run.sizes
    shape = FleetShape.of(sz.small_nodes)
    rates: dict[str, list[float]] = {"with": [], "without": []}
    names = [
        ("placement_requests_with_jobs_per_s", "jobs/s"),
        ("placement_requests_without_jobs_per_s", "jobs/s"),
    ]

    async def work() -> None:
        for round_ in range(ROUNDS):
            for variant in ("with", "without"):
                async with run.scenario(f"req{round_}{variant}") as s:
                    nodes = fleet(f"q{round_}", sz.small_nodes)
                    if variant == "without":
                        nodes = [_no_host_report(c) for c in nodes]
                    await load_fleet(s, nodes, timeout=60)
                    adjust = _with_requests if variant == "with" else None
                    tp = await placement_throughput(
                        s, f"q{round_}{variant}", sz.jobs, shape, adjust
                    )
                    if tp.granted < tp.submitted:
                        raise BenchError(f"requests {variant}: {tp.granted}/{tp.submitted} granted")
                    rates[variant].append(tp.rate)
        on, off = statistics.median(rates["with"]), statistics.median(rates["without"])
        print(f"# requests runs, jobs/s: with {rates['with']}, without {rates['without']}")
        run.add(
            Figure(
                "placement_requests_with_jobs_per_s", on, "jobs/s", note=f"runs {rates['with']}"
            ),
            Figure(
                "placement_requests_without_jobs_per_s",
                off,
                "jobs/s",
                note=f"runs {rates['without']}",
            ),
            Figure("requests_with_over_without", on / off, "x"),
        )

    await _guard(run, names, work)


POLICY_OWNERS = [f"team{i}" for i in range(10)]


def _with_priority(job: JobRequest) -> JobRequest:
    """A priority from -5 to 5, spread over the mix by the job's id."""
    return msgspec.structs.replace(job, priority=zlib.crc32(job.job_id.encode()) % 11 - 5)


async def _set_quotas(s: Scenario) -> None:
    """A quota for each owner and a default, high enough that every job fits: each placement
    is still checked against them, in memory and by PostgreSQL's trigger."""
    rows = [("*", "jobs", 10**6)]
    for owner in POLICY_OWNERS:
        rows += [(owner, "gpus:cuda", 10**6), (owner, "cores", 10**9), (owner, "jobs", 10**6)]
    await s.db.executemany("INSERT INTO quotas (owner, resource, max) VALUES ($1, $2, $3)", rows)


async def policy_group(run: Run) -> None:
    """Issue 15 part A: the 1k placement run from 10 owners with a priority and quotas on every
    job, against the same 10 owners with neither; alternating, medians and their ratio."""
    sz = run.sizes
    shape = FleetShape.of(sz.small_nodes)
    rates: dict[str, list[float]] = {"with": [], "without": []}
    names = [
        ("placement_policy_with_jobs_per_s", "jobs/s"),
        ("placement_policy_without_jobs_per_s", "jobs/s"),
    ]

    async def work() -> None:
        for round_ in range(ROUNDS):
            for variant in ("with", "without"):
                async with run.scenario(f"pol{round_}{variant}") as s:
                    await load_fleet(s, fleet(f"o{round_}", sz.small_nodes), timeout=60)
                    if variant == "with":
                        await _set_quotas(s)
                    adjust = _with_priority if variant == "with" else None
                    tp = await placement_throughput(
                        s, f"o{round_}{variant}", sz.jobs, shape, adjust, owners=POLICY_OWNERS
                    )
                    if tp.granted < tp.submitted:
                        raise BenchError(f"policy {variant}: {tp.granted}/{tp.submitted} granted")
                    rates[variant].append(tp.rate)
        on, off = statistics.median(rates["with"]), statistics.median(rates["without"])
        print(f"# policy runs, jobs/s: with {rates['with']}, without {rates['without']}")
        run.add(
            Figure("placement_policy_with_jobs_per_s", on, "jobs/s", note=f"runs {rates['with']}"),
            Figure(
                "placement_policy_without_jobs_per_s",
                off,
                "jobs/s",
                note=f"runs {rates['without']}",
            ),
            Figure("policy_with_over_without", on / off, "x"),
        )

    await _guard(run, names, work)


GANG_ROUNDS = 3


def _gang_jobs(prefix: str, gangs: int) -> list[JobRequest]:
    """``gangs`` distributed jobs of 2 nodes with one CUDA GPU each (nccl, torchrun)."""
    return [
        msgspec.structs.replace(
            cuda_job(f"{prefix}-{i:06d}"),
            distributed=Distributed(nodes=2, backend="nccl", launcher="torchrun"),
        )
        for i in range(gangs)
    ]


async def gang_group(run: Run) -> None:
    """Issue 14: 2-node gangs (one CUDA GPU per node) placed on the 1k-node fleet, against as
    many one-GPU jobs as the gangs have ranks (the same devices held); alternating, medians.
    A gang counts once its two ranks' grants went out."""
    sz = run.sizes
    shape = FleetShape.of(sz.small_nodes)
    gangs = min(sz.jobs // 2, int(shape.cuda_gpus * 0.9) // 2)
    rates: dict[str, list[float]] = {"gangs": [], "singles": []}
    names = [("placement_gangs_2node_per_s", "gangs/s"), ("placement_gang_singles_per_s", "jobs/s")]

    async def work() -> None:
        for round_ in range(GANG_ROUNDS):
            for variant in ("gangs", "singles"):
                async with run.scenario(f"gang{round_}{variant}") as s:
                    await load_fleet(s, fleet(f"g{round_}", sz.small_nodes), timeout=60)
                    prefix = f"g{round_}{variant[0]}"
                    if variant == "gangs":
                        jobs = _gang_jobs(prefix, gangs)
                    else:
                        jobs = [cuda_job(f"{prefix}-{i:06d}") for i in range(2 * gangs)]
                    tp = await jobs_throughput(s, jobs, 2 * gangs)
                    if tp.granted < tp.submitted:
                        raise BenchError(f"gang {variant}: {tp.granted}/{tp.submitted} granted")
                    # Grants per second; a gang is two of them.
                    rates[variant].append(tp.rate / 2 if variant == "gangs" else tp.rate)
        g, one = statistics.median(rates["gangs"]), statistics.median(rates["singles"])
        print(f"# gang runs: gangs/s {rates['gangs']}, single jobs/s {rates['singles']}")
        run.add(
            Figure(
                "placement_gangs_2node_per_s",
                g,
                "gangs/s",
                note=f"{gangs} gangs of 2 nodes x 1 GPU on {sz.small_nodes} nodes; runs {rates['gangs']}",
            ),
            Figure(
                "placement_gang_singles_per_s",
                one,
                "jobs/s",
                note=f"{2 * gangs} one-GPU jobs; runs {rates['singles']}",
            ),
            Figure("gang_ranks_over_single_jobs", 2 * g / one, "x"),
        )

    await _guard(run, names, work)


async def observations_group(run: Run) -> None:
    """Placement on the 10k fleet while every node publishes observations every 5 s (issue
    17): observations applied/s against published/s, and placement's throughput meanwhile,
    next to the same run with no observations (alternating)."""
    sz = run.sizes
    n = sz.large_nodes
    shape = FleetShape.of(n)
    names = [
        ("observations_applied_per_s", "msgs/s"),
        ("placement_10k_with_observations", "jobs/s"),
    ]

    async def work() -> None:
        with_obs: list[float] = []
        without: list[float] = []
        for round_ in range(2):
            async with run.scenario(f"obs{round_}") as s:
                nodes = fleet(f"o{round_}", n)
                await load_fleet(s, nodes, timeout=max(30.0, n / 200))
                tp = await placement_throughput(s, f"o{round_}plain", sz.jobs, shape)
                without.append(tp.rate)
                load = await observations_under_load(s, nodes, f"o{round_}obs", sz.jobs, shape)
                with_obs.append(load.placement.rate)
            print(
                f"# observations round {round_}: published {load.published} in "
                f"{load.seconds:.1f}s, applied {load.applied}, dropped {load.dropped}; "
                f"placement {load.placement.rate:.0f} jobs/s with, {tp.rate:.0f} without",
                flush=True,
            )
        on, off = statistics.median(with_obs), statistics.median(without)
        run.add(
            Figure("observations_published_per_s", load.published / load.seconds, "msgs/s"),
            Figure(
                "observations_applied_per_s",
                load.applied / load.seconds,
                "msgs/s",
                note=f"{load.applied}/{load.published} applied, {load.dropped} dropped",
            ),
            Figure("observations_applied_share", load.applied / max(load.published, 1), "x"),
            Figure("placement_10k_with_observations", on, "jobs/s", note=f"runs {with_obs}"),
            Figure("placement_10k_without_observations", off, "jobs/s", note=f"runs {without}"),
            Figure("observations_placement_with_over_without", on / off, "x"),
        )

    await _guard(run, names, work)


async def web_group(run: Run) -> None:
    """The fleet page's answer times at 1,000 nodes and 10,000 jobs, and what 50 viewers cost
    placement (bench/web.py)."""
    from bench.web import refresh_through_placement, web_figures

    for f in await web_figures():
        run.add(f)

    async def work() -> None:
        async with run.scenario("web") as s:
            run.add(await refresh_through_placement(s))

    await _guard(run, [("web_refresh_through_placement_1k_nodes", "ms")], work)


async def shim_group(run: Run) -> None:
    """The executor's shim path alone: jobs of ``true`` through the shim pool (bench/shim_path.py)."""
    from bench.shim_path import shim_path

    for f in await shim_path(run.root):
        run.add(f)


async def output_group(run: Run) -> None:
    """A job printing 200 MB through the executor's pipes against the same job with its output
    to /dev/null (bench/figures.py ``output_flood``)."""
    for f in await output_flood(run.root):
        run.add(f)


async def c1m_group(run: Run) -> None:
    """A million jobs on 10,000 simulated nodes (bench/c1m.py), then, in the same run, what
    bounds it: raw JetStream and PostgreSQL's commits on this machine, and the ratios."""
    from bench.c1m import C1mSize, c1m, placement_env

    names = [
        ("c1m_placed_s", "s"),
        ("c1m_running_s", "s"),
        ("c1m_jobs_page_ms", "ms"),
        ("c1m_explain_ms", "ms"),
        ("c1m_other_owner_wait_ms", "ms"),
    ]

    async def work() -> None:
        async with run.scenario("c1m", placement_env=placement_env()) as s:
            await c1m(s, C1mSize.scaled(), run.add)

    await _guard(run, names, work)
    # The bounds, on the same machine right after: one consumer's raw JetStream rate, and
    # PostgreSQL's transactions per grant as a naive service commits them.
    shape = FleetShape.of(1_000)
    jobs = encoded(job_mix("raw", 20_000, gpu_jobs_for(20_000, shape)))
    run.add(await raw_jetstream(run.root, jobs))
    for f in await naive_postgres(run.admin_url, 5_000, 10_000):
        run.add(f)
    placed, n = run.get("c1m_placed_s"), run.get("c1m_jobs")
    raw, pg8 = run.get("jetstream_raw_publish_pull_ack"), run.get("pg_naive_tx_per_grant_8conn")
    if placed and n and placed == placed:  # not NaN
        rate = n / placed
        run.add(Figure("c1m_jobs_per_s", rate, "jobs/s"))
        if raw:
            run.add(Figure("c1m_over_raw_jetstream", rate / raw, "x"))
        if pg8:
            run.add(Figure("c1m_over_pg_commits_8conn", rate / pg8, "x"))


def judge_all(run: Run) -> None:
    """Goals and ratios, appended after the measured figures."""
    by = {f.name: f for f in run.figures}

    def goal(name: str, op: str, target: float, text: str | None = None) -> None:
        if name in by:
            judge(by[name], op, target, text)

    goal("placement_1k_nodes", ">=", GOAL_PLACEMENT_1K)
    goal("placement_10k_nodes", ">=", GOAL_PLACEMENT_10K, ">= 2000 jobs/s (0.8x 2500)")
    goal("submit_to_grant_p99", "<=", GOAL_P99_MS)
    goal("capability_ingest_10k", ">=", GOAL_INGEST)
    goal("full_loop_jobs_per_s", ">=", GOAL_LOOP)
    goal("full_loop_submit_to_start_p99", "<=", GOAL_LOOP_P99_MS)
    goal("full_loop_shim_on_over_off", ">=", 0.8)
    goal("full_loop_over_ray", ">=", 1.0, ">= 1.0 x (Ray, worker reuse)")
    goal("start_p99_over_ray", "<=", 2.0, "<= 2.0 x (Ray, worker reuse)")
    goal("probe_no_torch", "<=", GOAL_PROBE_MS)
    goal("probe_no_torch_8gpu_recorded", "<=", GOAL_PROBE_MS)
    goal("placement_rss_peak", "<=", GOAL_RSS_MB)
    goal("telemetry_noop_share_of_placement", "<=", 5.0)
    goal("placement_telemetry_off_over_removed", ">=", 0.95, ">= 0.95 x (within 5%)")
    goal("executor_output_flood_over_devnull", "<=", GOAL_FLOOD_RATIO)
    goal("auth_signing_on_over_off", ">=", GOAL_SIGNING_RATIO, ">= 0.9 x (auth and signing off)")
    goal("requests_with_over_without", ">=", 0.9, ">= 0.9 x (no host requests bind)")
    goal("observations_applied_share", ">=", 0.95, ">= 0.95 (placement keeps up)")
    goal("policy_with_over_without", ">=", 0.8, ">= 0.8 x (no priorities or quotas)")
    goal("web_fleet_page_1k_nodes_p99", "<=", GOAL_WEB_PAGE_MS)
    goal("web_jobs_page_10k_jobs_p99", "<=", GOAL_WEB_PAGE_MS)
    goal("web_placement_requests_from_50_viewers", "<=", 0.0)
    goal("container_start_over_podman", "<=", GOAL_CONTAINER_START, "<= 1.15 x (podman run --rm)")
    p1k = run.get("placement_1k_nodes")
    p10k = run.get("placement_10k_nodes")
    if p1k and p10k:
        run.add(Figure("placement_10k_over_1k", p10k / p1k, "x"))
        judge(run.figures[-1], ">=", 0.8)
    naive = [
        v
        for v in (run.get("pg_naive_tx_per_grant_1conn"), run.get("pg_naive_tx_per_grant_8conn"))
        if v
    ]
    if p1k and naive:
        run.add(
            Figure(
                "placement_over_naive_pg", p1k / max(naive), "x", note="best of 1 and 8 connections"
            )
        )
        judge(run.figures[-1], ">=", GOAL_NAIVE_RATIO)
    serial = run.get("pg_naive_tx_per_grant_1conn")
    if p1k and serial:
        run.add(Figure("placement_over_naive_pg_1conn", p1k / serial, "x"))
    raw = run.get("jetstream_raw_publish_pull_ack")
    if p1k and raw:
        run.add(Figure("placement_over_raw_jetstream", p1k / raw, "x"))


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10, check=False,
        ).stdout.strip() or commit  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
            timeout=10, check=False,
        ).stdout.strip()  # fmt: skip
        if dirty:
            commit += " (dirty working tree)"
    return (
        f"{os.cpu_count()} cores, {model}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}, commit {commit}"
    )


async def amain(args: argparse.Namespace) -> list[Figure]:
    sizes = Sizes.big() if args.full else Sizes.quick()
    if not os.environ.get(SETTLED_ENV):  # make bench-ab settles before each run itself
        settle()  # what was removed just before written back (bench/quiet.py)
    root = Path(tempfile.mkdtemp(prefix="gpulayer-bench-"))
    started = time.perf_counter()
    pg = EmbeddedPostgres(root / "pg", fast=args.fast_pg)
    try:
        pg.start()
        run = Run(sizes, root, pg.url, args.profile)
        run.peers = args.peers
        only = set(args.only.split(",")) if args.only else None
        groups: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("limits", lambda: limits_group(run)),
            ("placement1k", lambda: placement_group(run, sizes.small_nodes, "1k")),
            ("replicas", lambda: replicas_group(run)),
            ("latency", lambda: latency_group(run)),
            ("placement10k", lambda: placement_group(run, sizes.large_nodes, "10k")),
            ("loop", lambda: loop_group(run)),
            ("loop_container", lambda: loop_container_group(run)),
            ("container_start", lambda: container_start_group(run)),
            ("peers", lambda: peers_group(run)),
            ("shim", lambda: shim_group(run)),
            ("output", lambda: output_group(run)),
            ("signing", lambda: signing_group(run)),
            ("requests", lambda: requests_group(run)),
            ("observations", lambda: observations_group(run)),
            ("policy", lambda: policy_group(run)),
            ("gang", lambda: gang_group(run)),
            ("web", lambda: web_group(run)),
            ("c1m", lambda: c1m_group(run)),
        ]
        for name, group in groups:
            if name == "peers" and not args.peers:
                continue
            if name in NAMED_ONLY and (only is None or name not in only):
                continue
            if only is None or name in only or (name == "peers" and "loop" in only):
                t0 = time.perf_counter()
                await group()
                print(f"# {name} took {time.perf_counter() - t0:.1f}s", flush=True)
        if only is None or "telemetry" in only:
            t0 = time.perf_counter()
            await telemetry_group(run)
            for f in telemetry_noop_cost(run.get("placement_1k_nodes")):
                run.add(f)
            print(f"# telemetry took {time.perf_counter() - t0:.1f}s", flush=True)
        print(f"# measured in {time.perf_counter() - started:.1f}s", flush=True)
        return run.figures
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


# Groups run only when --only names them: container_start needs rootful podman and times
# podman's own runs, which a whole bench run's other groups would disturb; c1m takes 15 minutes
# or more (make bench-scale).
NAMED_ONLY = frozenset({"container_start", "c1m"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--full", action="store_true", help="the full sizes (make bench FULL=1)")
    p.add_argument(
        "--fast-pg",
        action="store_true",
        help="PostgreSQL with fsync and synchronous_commit off (default: durable, as in production)",
    )
    p.add_argument(
        "--only",
        help=(
            "comma-separated groups: probe,limits,placement1k,replicas,latency,placement10k,requests,observations,"
            "loop,loop_container,container_start,peers,shim,output,signing,policy,gang,web,telemetry,c1m; peers "
            "needs --peers and runs with loop; container_start and c1m (a million jobs, make bench-scale) run only "
            "when named"
        ),
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help=(
            "after the full loop, the same workload in Ray (installed from the package registry "
            "into a venv under the bench's temp folder) and the ratios (make bench PEERS=1)"
        ),
    )
    p.add_argument(
        "--cprofile",
        metavar="DIR",
        help="run placement and the executor under cProfile; one .prof file per process in DIR",
    )
    p.add_argument("--profile", metavar="DIR", help="attach py-spy to placement; raw stacks in DIR")
    p.add_argument(
        "--json",
        metavar="FILE",
        type=Path,
        help="also write every figure (value, unit, note, goal, met) to FILE as JSON (bench/ab.py reads it)",
    )
    p.add_argument(
        "--no-shim-ab",
        action="store_true",
        help="the full loop alone, without the shim on/off runs before it (2 minutes less)",
    )
    p.add_argument(
        "--loop-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=(
            "added to the full loop's executor environment (repeatable), to measure what one "
            "feature costs, e.g. GPULAYER_EXECUTOR_ENFORCE=off"
        ),
    )
    args = p.parse_args(argv)
    global SHIM_AB
    SHIM_AB = not args.no_shim_ab
    for item in args.loop_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            p.error(f"--loop-env {item!r}: expected NAME=VALUE")
        LOOP_ENV[name] = value
    if args.cprofile:
        harness.CPROFILE_DIR = Path(args.cprofile).resolve()
        harness.CPROFILE_DIR.mkdir(parents=True, exist_ok=True)
    if args.profile:
        args.profile = Path(args.profile).resolve()
        args.profile.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    header = machine()
    print(f"# gpulayer bench ({'full' if args.full else 'quick'}): {header}", flush=True)
    print(
        f"# PostgreSQL: {'fsync off (scratch)' if args.fast_pg else 'durable defaults'}", flush=True
    )
    figures: list[Figure] = []
    only = set(args.only.split(",")) if args.only else None
    if only is None or "probe" in only:
        # Before the event loop: the probe's CLI runs its own.
        sizes = Sizes.big() if args.full else Sizes.quick()
        for f in probe_figures(sizes.probe_runs):
            figures.append(f)
            print(f.line(), flush=True)
    figures += asyncio.run(amain(args))
    run = Run(Sizes.quick(), Path("."), "", None)
    run.figures = figures
    judge_all(run)
    print(f"# total {time.perf_counter() - t0:.1f}s", flush=True)
    print_summary(run.figures, f"gpulayer bench — {header}")
    if args.json:
        args.json.write_bytes(dump(Report(header, run.figures)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

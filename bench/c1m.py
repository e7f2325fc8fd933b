"""``python -m bench --only c1m`` (``make bench-scale``): a million jobs on ten thousand
simulated nodes, against one placement replica with its real PostgreSQL and NATS, as Nomad's
C1M put a million containers on 5,000 hosts.

- **The fleet**: 10,000 nodes (bench/fleet.py's shapes: half 8-GPU CUDA nodes, 30% CPU, 20%
  Apple), simulated by one process (bench/c1m_nodes.py) that publishes their capabilities and
  executor heartbeats, takes each grant and reports it ``running``, and runs nothing.
- **The jobs**: 1,000,000 submits from ten owners, each its own JetStream publish on its
  owner's subject, sized to fit the fleet at once: 94.78% CPU jobs (a quarter core, half a GB),
  3.2% one-GPU jobs, 2% shared GPU slices (16 GB of an 80 GB GPU), 200 two-node gangs. The
  GPU jobs hold 93.5% of the fleet's CUDA GPUs.
- **Bad input on the way**: one owner floods 20,000 submits as fast as it can, past the run's
  rate limit (refused as always), and one node loses power half way (its jobs are lost, and
  counted).
- **Depth**: then one of the owners queues 900,000 one-GPU jobs; they fill the GPUs left and
  the rest wait. Another owner submits one job; one whole-GPU job ends; the time from that
  end to the newcomer's grant is ``c1m_other_owner_wait_ms`` (fair share over the whole
  queue).

Figures: ``c1m_jobs``, ``c1m_nodes``, ``c1m_placed_s`` (first submit to last grant),
``c1m_running_s`` (to the last ``running`` stored), ``c1m_placement_rss_mb`` (peak),
``c1m_pg_size_mb``, ``c1m_jobs_page_ms`` (p99 of ``gpulayer jobs``'s request),
``c1m_explain_ms`` (p99 of ``gpulayer explain`` on a waiting job), ``c1m_other_owner_wait_ms``,
and what bounds them: CPU seconds per process, and the same run's raw JetStream and
PostgreSQL commit rates. ``GPULAYER_C1M_SCALE`` (e.g. 0.01) shrinks every count, for trying
the bench itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from bench.cpu import loop_cpu
from bench.fleet import GPUS_PER_CUDA_NODE, FleetShape, cuda_job
from bench.harness import (
    BenchError,
    Scenario,
    ServiceProcess,
    percentile,
    rss_sampler,
    tail,
)
from bench.report import Figure
from gpulayer_cli.client import api
from gpulayer_contracts import JobRequest, Requirements, encode
from gpulayer_contracts.jobs import Distributed, GpuUsage
from gpulayer_contracts.subjects import ANONYMOUS, API_EXPLAIN, API_JOBS, MSG_ID_HEADER, jobs_submit
from gpulayer_placement.store import QUERIES
from gpulayer_runtime.nats import connect

# Goals (issue 49), on this machine's 2 cores.
GOAL_PLACED_S = 300.0
GOAL_RUNNING_S = 600.0
GOAL_RSS_MB = 4096.0
GOAL_OTHER_OWNER_WAIT_MS = 1000.0
GOAL_PAGE_MS = 1000.0

OWNERS = [f"team{i}" for i in range(10)]
DEEP_OWNER = OWNERS[0]
NEWCOMER = "newcomer"
FLOODER = "flood"
# The run's rate limit per owner: a team running sweeps of this size is given it; the load
# generator keeps each owner under it, the flood goes over it.
SUBMIT_RATE = 5_000
SUBMIT_BURST = 10_000
TEAM_PACE = 0.6 * SUBMIT_RATE  # each owner's publish rate at most, jobs/s
WINDOW = 512  # publishes in flight
ID = b"@@JOB@@"


@dataclass(frozen=True)
class C1mSize:
    nodes: int = 10_000
    jobs: int = 1_000_000
    depth: int = 900_000
    flood: int = 20_000
    gangs: int = 200

    @classmethod
    def scaled(cls) -> C1mSize:
        scale = float(os.environ.get("GPULAYER_C1M_SCALE", "1") or 1)
        if not 0 < scale <= 1:
            raise BenchError(f"GPULAYER_C1M_SCALE={scale}: expected a number in (0, 1]")
        d = cls()
        return cls(
            nodes=max(10, int(d.nodes * scale)),
            jobs=max(100, int(d.jobs * scale)),
            depth=max(100, int(d.depth * scale)),
            flood=max(50, int(d.flood * scale)),
            gangs=max(1, int(d.gangs * scale)),
        )


@dataclass(frozen=True)
class Mix:
    """How many jobs of each kind; GPUs the GPU jobs hold."""

    cpu: int
    whole_gpu: int
    shared: int
    gangs: int

    @classmethod
    def of(cls, size: C1mSize) -> Mix:
        gpus = FleetShape.of(size.nodes).cuda_gpus
        gangs = size.gangs
        shared = int(size.jobs * 0.02)
        # 93.5% of the GPUs: gangs' ranks, shared slices four to a GPU, then whole GPUs.
        whole = max(0, int(gpus * 0.935) - 2 * gangs - shared // 4)
        whole = min(whole, int(size.jobs * 0.032))
        return cls(
            cpu=size.jobs - whole - shared - gangs, whole_gpu=whole, shared=shared, gangs=gangs
        )

    @property
    def grants(self) -> int:
        return self.cpu + self.whole_gpu + self.shared + 2 * self.gangs


def _template(job: JobRequest) -> bytes:
    body = encode(msgspec.structs.replace(job, job_id=ID.decode()))
    assert body.count(ID) == 1
    return body


def cpu_template() -> bytes:
    return _template(
        JobRequest(
            job_id="x",
            command=["python3", "preprocess.py", "--shard", "7"],
            requirements=Requirements(accelerator="cpu", cpu_cores=0.25, memory_gb=0.5),
            timeout_s=86_400,
        )
    )


def gpu_template() -> bytes:
    return _template(msgspec.structs.replace(cuda_job("x"), timeout_s=86_400))


def shared_template() -> bytes:
    job = cuda_job("x")
    req = msgspec.structs.replace(job.requirements, gpu_memory_gb=16)
    return _template(
        msgspec.structs.replace(job, requirements=req, gpu=GpuUsage(use="shared"), timeout_s=86_400)
    )


def gang_template() -> bytes:
    return _template(
        msgspec.structs.replace(
            cuda_job("x"),
            distributed=Distributed(nodes=2, backend="nccl", launcher="torchrun"),
            timeout_s=86_400,
        )
    )


def main_wave(mix: Mix) -> list[tuple[str, bytes, str]]:
    """(owner, template, job id) of the million, kinds spread evenly through the order, owners
    in turn."""
    kinds = [
        (mix.whole_gpu, gpu_template()),
        (mix.shared, shared_template()),
        (mix.gangs, gang_template()),
    ]
    total = mix.cpu + sum(n for n, _ in kinds)
    cpu = cpu_template()
    out: list[tuple[str, bytes, str]] = []
    placed = [0] * len(kinds)
    for i in range(total):
        tmpl = cpu
        for k, (n, t) in enumerate(kinds):
            # Bresenham: kind k's i-th job when its running share falls behind.
            if placed[k] < n and placed[k] * total < (i + 1) * n:
                placed[k] += 1
                tmpl = t
                break
        owner = OWNERS[i % len(OWNERS)]
        out.append((owner, tmpl, f"c1m-{owner}-{i:07d}"))
    return out


class Nodes:
    """The simulated nodes' process (bench/c1m_nodes.py) and its answers."""

    def __init__(self, s: Scenario, prefix: str, count: int) -> None:
        creds = s.auth.mint("admin", "c1m-nodes") if s.auth is not None else ""
        self.log = s.workdir / "c1m-nodes.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.c1m_nodes", s.nats.url, str(creds), prefix, str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "ab"),  # noqa: SIM115 - closed with the process
        )
        self.lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def start(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        assert self.proc.stdout is not None
        out = self.proc.stdout

        def read() -> None:
            for raw in out:
                obj = json.loads(raw)
                target = self.events if "event" in obj else self.lines
                loop.call_soon_threadsafe(target.put_nowait, obj)

        self._reader = asyncio.ensure_future(asyncio.to_thread(read))
        ready = await self.event(timeout)
        if ready.get("event") != "ready":
            raise BenchError(f"simulated nodes: {ready}")

    async def event(self, timeout: float) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self.events.get(), timeout)
        except TimeoutError:
            self.check_alive()
            raise BenchError(f"simulated nodes said nothing in {timeout:g}s") from None

    async def ask(self, cmd: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        try:
            return await asyncio.wait_for(self.lines.get(), timeout)
        except TimeoutError:
            self.check_alive()
            raise BenchError(f"simulated nodes did not answer {cmd} in {timeout:g}s") from None

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(f"simulated nodes exited ({self.proc.returncode}): {tail(self.log)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"op": "quit"}\n')
                self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def publish_paced(
    s: Scenario,
    items: list[tuple[str, bytes, str]],
    progress: Callable[[int], None],
    pace: float,
) -> int:
    """Each (owner, template, id) published on the owner's submit subject with Nats-Msg-Id, a
    window in flight; at most ``pace`` jobs/s per owner. Returns how many JetStream stored."""
    owners = max(1, len({o for o, _, _ in items[: 10 * len(OWNERS)]}))
    min_chunk_s = WINDOW / (pace * owners)
    stored = 0
    for start in range(0, len(items), WINDOW):
        t0 = time.perf_counter()
        chunk = items[start : start + WINDOW]
        acks = await asyncio.gather(
            *(
                s.js.publish(
                    jobs_submit(owner), tmpl.replace(ID, job_id.encode()), timeout=60,
                    headers={MSG_ID_HEADER: job_id},
                )
                for owner, tmpl, job_id in chunk
            ),
            return_exceptions=True,
        )  # fmt: skip
        stored += sum(1 for a in acks if not isinstance(a, BaseException))
        progress(start + len(chunk))
        spent = time.perf_counter() - t0
        if spent < min_chunk_s:
            await asyncio.sleep(min_chunk_s - spent)
    return stored


async def flood(s: Scenario, n: int, tmpl: bytes) -> int:
    """One owner's submits as fast as its connection takes them, past the rate limit: plain
    NATS publishes on the submit subject (the JOBS stream stores them), no ack awaited, as a
    runaway script would send them. Returns how many were sent."""
    subject = jobs_submit(FLOODER)
    for i in range(n):
        job_id = f"c1m-flood-{i:07d}"
        await s.nc.publish(
            subject, tmpl.replace(ID, job_id.encode()), headers={MSG_ID_HEADER: job_id}
        )
    await s.nc.flush(timeout=60)
    return n


async def _count(s: Scenario, sql: str, *args: Any) -> int:
    return int(await s.db.fetchval(sql, *args))


async def _api_ms(
    s: Scenario, user: str, subject: str, payload: dict[str, Any], n: int
) -> list[float]:
    """``n`` requests as the plain user ``user`` (the CLI's call), each one's milliseconds."""
    creds = s.auth.mint("user", user) if s.auth is not None else None
    nc = await connect(s.nats.url, f"bench-c1m-{user}", creds=str(creds) if creds else None)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            await api(nc, subject, payload, timeout=30.0, caller=user if creds else ANONYMOUS)
            out.append((time.perf_counter() - t0) * 1000)
    finally:
        await nc.close()
    return out


class Progress:
    def __init__(self, what: str, total: int, every_s: float = 10.0) -> None:
        self.what, self.total, self.every = what, total, every_s
        self.t0 = time.perf_counter()
        self.next = self.t0 + every_s

    def __call__(self, done: int, extra: str = "") -> None:
        now = time.perf_counter()
        if now >= self.next or done >= self.total:
            self.next = now + self.every
            rate = done / max(now - self.t0, 1e-9)
            print(
                f"# c1m {self.what}: {done:,}/{self.total:,} ({rate:,.0f}/s, "
                f"{now - self.t0:.0f}s){' ' + extra if extra else ''}",
                flush=True,
            )


def _api_figure(name: str, samples: list[float], note: str) -> Figure:
    """An API call's p99 in ms (``samples``), against GOAL_PAGE_MS; its p50 in the note."""
    p99 = percentile(samples, 99)
    return Figure(
        name,
        p99,
        "ms",
        note=f"p50 {percentile(samples, 50):.1f} ms, {note}",
        goal=f"<= {GOAL_PAGE_MS:g}",
        met=p99 <= GOAL_PAGE_MS,
    )


async def c1m(s: Scenario, size: C1mSize, add: Callable[..., None]) -> None:
    mix = Mix.of(size)
    print(
        f"# c1m: {size.nodes:,} nodes ({FleetShape.of(size.nodes).cuda_gpus:,} CUDA GPUs), "
        f"{size.jobs:,} jobs: {mix.cpu:,} CPU, {mix.whole_gpu:,} one-GPU, {mix.shared:,} shared "
        f"slices, {mix.gangs:,} gangs of 2; then {size.depth:,} waiting; flood {size.flood:,}",
        flush=True,
    )
    items = main_wave(mix)
    nodes = Nodes(s, "c1m", size.nodes)
    stop_rss = asyncio.Event()
    sampler = asyncio.create_task(rss_sampler(s.placement, stop_rss, period=1.0))
    try:
        await nodes.start(timeout=120)
        t0 = time.perf_counter()
        while await _count(s, "SELECT count(*) FROM nodes") < size.nodes:
            if time.perf_counter() - t0 > max(60, size.nodes / 100):
                raise BenchError("the simulated fleet was not stored in time")
            await asyncio.sleep(0.5)
        # Every node's executor beat (its slots) must be in before jobs arrive.
        await asyncio.sleep(6.0)
        add(Figure("c1m_nodes", size.nodes, "nodes"))
        pids = ([s.placement.pid], nodes.pid, s.nats.proc.pid if s.nats.proc else 0)
        cpu0 = loop_cpu(*pids)
        wall0 = time.time()
        t_first = time.time()
        pub = Progress("submitted", len(items))
        vanished = f"c1m-{5:05d}"  # a CPU node
        flood_task: asyncio.Task[int] | None = None

        def progress(done: int) -> None:
            nonlocal flood_task
            pub(done)
            if flood_task is None and done >= len(items) // 3:
                flood_task = asyncio.create_task(flood(s, size.flood, cpu_template()))

        vanish_at = len(items) // 2
        first, second = items[:vanish_at], items[vanish_at:]
        stored = await publish_paced(s, first, progress, TEAM_PACE)
        await nodes.ask({"op": "vanish", "node": vanished})
        print(f"# c1m: node {vanished} lost power (no heartbeats, no reports)", flush=True)
        stored += await publish_paced(s, second, lambda d: progress(vanish_at + d), TEAM_PACE)
        flooded = await flood_task if flood_task is not None else 0
        published_s = time.time() - t_first
        print(
            f"# c1m: {stored:,} team submits stored by JetStream and {flooded:,} flood submits sent "
            f"in {published_s:.0f}s",
            flush=True,
        )
        # Every submit stored in PostgreSQL or refused; then every grant out.
        wait = Progress("granted", mix.grants + size.flood, every_s=10.0)
        deadline = time.perf_counter() + 3600
        admitted_flood = 0
        while True:
            st = await nodes.ask({"op": "stats"})
            want = mix.grants
            if st["grants"] >= mix.grants:
                # The teams' jobs all out: then the flood's admitted ones, and nothing waiting.
                # (Counted only now: a count of the flood's rows reads the whole table, and
                # polling it every second was PostgreSQL's own load in the run.)
                admitted_flood = await _count(
                    s, "SELECT count(*) FROM jobs WHERE owner = $1", FLOODER
                )
                want += admitted_flood
                pending = await _count(s, "SELECT count(*) FROM jobs WHERE state = 'pending'")
                if st["grants"] >= want and pending == 0:
                    break
            wait(min(int(st["grants"]), want), f"running reported {int(st['running']):,}")
            if time.perf_counter() > deadline:
                raise BenchError(f"only {st['grants']:,}/{want:,} grants after an hour")
            s.placement.check_alive()
            nodes.check_alive()
            await asyncio.sleep(1.0)
        placed_s = float(st["last"]) - wall0
        cpu1 = loop_cpu(*pids)
        # Then every grant's running stored (or lost with its node).
        deadline = time.perf_counter() + 1800
        while await _count(s, "SELECT count(*) FROM jobs WHERE state = 'placed'") > 0:
            if time.perf_counter() > deadline:
                raise BenchError("placed jobs never all reported running")
            await asyncio.sleep(1.0)
        rows = await s.db.fetch("SELECT state, count(*) AS n FROM jobs GROUP BY state")
        states = {str(r["state"]): int(r["n"]) for r in rows}
        print(f"# c1m: job states {states}", flush=True)
        last_running = await s.db.fetchval(
            "SELECT extract(epoch FROM max(updated_at)) FROM jobs WHERE state = 'running'"
        )
        if last_running is None:
            raise BenchError(
                f"no job is running: {states}; placement: {tail(s.placement.log)}; "
                f"nodes: {tail(nodes.log)}"
            )
        running_s = float(last_running) - wall0
        lost = await _count(s, "SELECT count(*) FROM jobs WHERE state = 'lost'")
        refused = size.flood - admitted_flood
        add(
            Figure(
                "c1m_jobs", stored, "jobs", note=f"{mix.grants:,} grants (gang ranks count each)"
            ),
            Figure(
                "c1m_placed_s",
                placed_s,
                "s",
                note=f"{(mix.grants + admitted_flood) / placed_s:,.0f} grants/s",
                goal=f"<= {GOAL_PLACED_S:g}",
                met=placed_s <= GOAL_PLACED_S,
            ),
            Figure(
                "c1m_running_s",
                running_s,
                "s",
                goal=f"<= {GOAL_RUNNING_S:g}",
                met=running_s <= GOAL_RUNNING_S,
            ),
            Figure("c1m_lost_jobs", lost, "jobs", note=f"node {vanished} lost power half way"),
            Figure(
                "c1m_flood_refused",
                refused,
                "submits",
                note=f"{admitted_flood:,} of {size.flood:,} admitted at {SUBMIT_RATE}/s, burst {SUBMIT_BURST}",
            ),
        )
        span = placed_s
        for part, secs in cpu1.items():
            used = secs - cpu0[part]
            if part in ("placement", "postgres", "nats", "executor", "load_generator"):
                name = "simulated_nodes" if part == "executor" else part
                add(
                    Figure(
                        f"c1m_cpu_share_{name}",
                        used / span,
                        "cores",
                        note=f"{used:.0f} CPU s over the {span:.0f} s to the last grant",
                    )
                )
        # Pages with the million stored.
        page = await _api_ms(s, OWNERS[1], API_JOBS, {"state": None, "limit": 50}, 30)
        add(_api_figure("c1m_jobs_page_ms", page, "30 requests"))
        await depth(s, size, nodes, add)
        add(
            Figure(
                "c1m_pg_size_mb",
                await s.db.fetchval("SELECT pg_database_size(current_database())") / 1e6,
                "MB",
            )
        )
    finally:
        stop_rss.set()
        await sampler
        rss = s.placement.peak_rss() / 1e6
        if rss:
            add(
                Figure(
                    "c1m_placement_rss_mb",
                    rss,
                    "MB",
                    note="peak (VmHWM)",
                    goal=f"<= {GOAL_RSS_MB:g}",
                    met=rss <= GOAL_RSS_MB,
                )
            )
        nodes.stop()


async def depth(s: Scenario, size: C1mSize, nodes: Nodes, add: Callable[..., None]) -> None:
    """One owner queues ``size.depth`` one-GPU jobs with the fleet's GPUs nearly full; another
    owner's one job then gets the next GPU that frees."""
    tmpl = gpu_template()
    items = [(DEEP_OWNER, tmpl, f"c1m-deep-{i:07d}") for i in range(size.depth)]
    pub = Progress("queued", len(items))
    t0 = time.perf_counter()
    # One owner, kept under its rate limit: every one of its submits is stored.
    await publish_paced(s, items, pub, pace=0.9 * SUBMIT_RATE)
    target = size.depth
    stored_p = Progress("deep jobs stored", target)
    while True:
        n = await _count(
            s, "SELECT count(*) FROM jobs WHERE owner = $1 AND job_id LIKE 'c1m-deep-%'", DEEP_OWNER
        )
        stored_p(n)
        if n >= target:
            break
        if time.perf_counter() - t0 > 3600:
            raise BenchError(f"only {n:,}/{target:,} waiting jobs stored after an hour")
        s.placement.check_alive()
        await asyncio.sleep(2.0)
    add(Figure("c1m_depth_stored_s", time.perf_counter() - t0, "s", note=f"{target:,} jobs"))
    # Every submit announced and acked (placement acks a batch once its events are out): the
    # newcomer's grant is not to queue behind the deep jobs' `accepted` events.
    t1 = time.perf_counter()
    while True:
        info = await s.js.consumer_info("JOBS", "placement-jobs")
        if not info.num_pending and not info.num_ack_pending:
            break
        if time.perf_counter() - t1 > 1800:
            raise BenchError(f"placement's JOBS consumer still busy after 30 min: {info}")
        s.placement.check_alive()
        await asyncio.sleep(1.0)
    print(f"# c1m: every submit acked {time.perf_counter() - t0:.0f}s after the first", flush=True)
    # Let the GPUs the deep queue could take be granted: nothing waiting may still fit.
    await asyncio.sleep(5.0)
    waiting_n = await _count(s, "SELECT count(*) FROM jobs WHERE state = 'pending'")
    print(f"# c1m: {waiting_n:,} jobs waiting", flush=True)
    newcomer = "c1m-newcomer-0000001"
    await s.js.publish(
        jobs_submit(NEWCOMER),
        gpu_template().replace(ID, newcomer.encode()),
        headers={MSG_ID_HEADER: newcomer},
    )
    await nodes.ask({"op": "watch", "job_id": newcomer})
    deadline = time.perf_counter() + 60
    while (
        await s.db.fetchval(
            "SELECT reason FROM jobs WHERE job_id = $1 AND state = 'pending'", newcomer
        )
    ) is None:
        if time.perf_counter() > deadline:
            state = await s.db.fetchval("SELECT state FROM jobs WHERE job_id = $1", newcomer)
            raise BenchError(f"the newcomer's job never waited with a reason (state {state})")
        await asyncio.sleep(0.1)
    deep_waiting = await s.db.fetchval(
        "SELECT job_id FROM jobs WHERE owner = $1 AND state = 'pending' ORDER BY submitted_at DESC LIMIT 1",
        DEEP_OWNER,
    )
    explain = await _api_ms(s, NEWCOMER, API_EXPLAIN, {"job_id": newcomer}, 10)
    explain += await _api_ms(s, DEEP_OWNER, API_EXPLAIN, {"job_id": deep_waiting}, 10)
    add(_api_figure("c1m_explain_ms", explain, f"20 requests, {waiting_n:,} waiting"))
    page = await _api_ms(s, DEEP_OWNER, API_JOBS, {"state": "pending", "limit": 50}, 10)
    add(
        Figure(
            "c1m_waiting_page_ms", percentile(page, 99), "ms", note="gpulayer jobs --state pending"
        )
    )
    for state in (None, "pending", "failed"):
        await print_plan(s, "list_jobs", state, 50, 0)
    spy = _spy_on("c1m-depth-end.txt", s.placement.pid)
    ended = await nodes.ask({"op": "end_one"})
    if "error" in ended:
        raise BenchError(f"no job to end: {ended['error']}")
    try:
        grant = await nodes.event(30.0)
    except BenchError:
        who = await s.db.fetchval(
            "SELECT owner || ' ' || job_id FROM jobs WHERE node_id = $1 AND state IN ('placed', 'running') "
            "AND updated_at > now() - interval '30 seconds' LIMIT 1",
            ended["node"],
        )
        add(
            Figure(
                "c1m_other_owner_wait_ms",
                float("nan"),
                "ms",
                note=f"not granted in 30 s; the freed GPU went to {who}",
                goal=f"<= {GOAL_OTHER_OWNER_WAIT_MS:g}",
                met=False,
            )
        )
        return
    wait_ms = (float(grant["at"]) - float(ended["at"])) * 1000
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    # Where the wait went: the grant made (after the placing commit), stored, fetched.
    print(
        f"# c1m: from the end's publish, the newcomer's grant made "
        f"{(float(grant['granted_at']) - float(ended['at'])) * 1000:.0f} ms, stored "
        f"{wait_ms:.0f} ms, fetched {(float(grant['arrived']) - float(ended['at'])) * 1000:.0f} ms",
        flush=True,
    )
    add(
        Figure(
            "c1m_other_owner_wait_ms",
            wait_ms,
            "ms",
            note=f"{waiting_n:,} of {DEEP_OWNER}'s jobs waiting ahead of it",
            goal=f"<= {GOAL_OTHER_OWNER_WAIT_MS:g}",
            met=wait_ms <= GOAL_OTHER_OWNER_WAIT_MS,
        )
    )


def _spy_on(name: str, pid: int) -> subprocess.Popen[bytes] | None:
    """With ``GPULAYER_C1M_SPY=DIR``: py-spy (when installed in this venv) on placement from
    now until stopped, into DIR/name: what placement does between a job's end and the
    newcomer's grant."""
    out = os.environ.get("GPULAYER_C1M_SPY")
    spy = Path(sys.executable).parent / "py-spy"
    if not out or not spy.exists():
        return None
    return subprocess.Popen(
        [str(spy), "record", "-p", str(pid), "-r", "200", "-f", "raw", "-o", str(Path(out) / name)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def print_plan(s: Scenario, query: str, *args: Any) -> None:
    """PostgreSQL's plan of one of placement's queries, as run, for the profile."""
    rows = await s.db.fetch(f"EXPLAIN (ANALYZE, COSTS OFF) {QUERIES[query]}", *args)
    print(f"# plan of {query}{args}:", flush=True)
    for r in rows:
        print(f"#   {r[0]}", flush=True)


def placement_env() -> dict[str, str]:
    """The run's placement: production defaults (node timeout, grant re-sending), the rate
    limit a team running sweeps is given."""
    return {
        "GPULAYER_NODE_TIMEOUT_S": "15",
        "GPULAYER_GRANT_RESEND_S": "30",
        "GPULAYER_SUBMIT_RATE": str(SUBMIT_RATE),
        "GPULAYER_SUBMIT_BURST": str(SUBMIT_BURST),
    }


__all__ = ["GPUS_PER_CUDA_NODE", "C1mSize", "Mix", "ServiceProcess", "c1m", "placement_env"]

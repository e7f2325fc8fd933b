"""The fault run: steady submits through the real services while a fault schedule runs, then a
checker that counts every job (``fault_checker``).

The stack, all on loopback: three NATS servers (R3 streams, auth as in the other tests), an own
PostgreSQL, two placement replicas, two GPU nodes (recorded nvidia-smi: 2 T4s and 8 H100s),
each with its probe and its executor (jobs under shims). Jobs take one GPU each; their command
decides how they end (most succeed, some exit 3, some sleep until cancelled) and writes a
marker per run (node, devices, start, end). The schedule, while jobs keep coming:

- kill -9 one NATS server of three, and start it again; from a little before the kill until
  every stream took a write after it, a write to every stream each 0.1 s
  (``tests/faults/write_gaps.py``): each stream's write gap is printed, at most
  ``NO_ELECTION_LIMIT_S`` where its leader lived on and ``ELECTION_LIMIT_S`` (its group's raft
  election) where the killed server led it;
- kill -9 one placement replica of two, and start it again;
- kill -9 an executor, and start it again (its running jobs go on under their shims);
- restart PostgreSQL;
- cut a third node off the network for longer than the node timeout, then bring it back (its
  probe and executor run in a network namespace of the test's own, linked to this one by a
  veth pair: tests/faults/netns.py; as root, where ``ip netns`` works, else said and left out).

Then every accepted job's stored events are read: each ended exactly once and as its command
says, none ran twice, no device was held by two runs at once; the counts are printed (``make
faults`` shows them) and written to ``fault-run.txt`` in the test's folder. No node goes away
for good, so no job may be ``lost``, but those placed on the cut node: placement gives them up
at the node timeout (``lost``, counted apart), and what they held there stays fenced until the
node's executor, back, has stopped them and said so (docs/operations.md, "A node cut off"):
no device used twice, even by a job that ran on unseen. At the end no fence is left, and what
nodes and owners were counted as using always summed what their jobs held
(``tests/faults/holds.py``, looked at each second and at the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from tests.faults import netns
from tests.faults.fault_checker import check, read_markers
from tests.faults.holds import HoldsWatch
from tests.faults.write_gaps import (
    CONSUMED,
    ELECTION_LIMIT_S,
    NO_ELECTION_LIMIT_S,
    Gap,
    WriteProbe,
    placements,
    targets,
)
from tests.helpers import Services, service_env, with_fake_nvidia_smi

from gpulayer_cli.client import ApiFailed, api
from gpulayer_contracts.subjects import (
    ANONYMOUS,
    API_CANCEL,
    API_NODES,
    JOB_WILDCARD_EVENTS,
    JOBS_SUBMIT,
    MSG_ID_HEADER,
    STREAMS,
)
from gpulayer_runtime.auth import AuthStore
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.pgserver import EmbeddedPostgres
from gpulayer_runtime.servers import EmbeddedNats, EmbeddedNatsCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NODES = {"fr-t4": "t4-2x", "fr-h100": "h100-dgx-8x"}
# The node cut off the network (in a namespace of its own), where one can be made.
CUT_NODE, CUT_RECORDING = "fr-cut", "h100-dgx-8x"
NODE_TIMEOUT_S = 15.0  # placement's default
# Cut for longer than the node timeout (its last heartbeat may be up to a beat before the cut).
CUT_AT_S, CUT_FOR_S = 14.0, NODE_TIMEOUT_S + 9.0
RATE = 5.0  # jobs per second
LOAD_S = 50.0
# After the load: how long the accepted jobs may take to end.
DRAIN_S = 150.0
TERMINAL = {"succeeded", "failed", "cancelled", "lost", "rejected"}
ANNOUNCED = {"accepted", "rejected"}


def command(markers: Path, job_id: str, kind: str) -> list[str]:
    """A job that writes its run's marker (its start, then its end) and ends as ``kind`` says.
    Every kind writes its end on SIGTERM too: a run stopped early (a cancel, or a grant
    placement gave up with its node, started when the node came back) says when it ended,
    else the checker would hold its device forever."""
    m = f"{markers}/{job_id}.$$"
    now = "$(date +%s.%N)"
    start = f'echo "$PWD|$GPULAYER_DEVICES|{now}" > {m}'
    end = f"echo {now} >> {m}"
    trap = f"trap '{end}; exit 143' TERM"
    if kind == "cancelled":  # until its SIGTERM, which the trap answers
        script = f"{start}; {trap}; sleep 120 & wait $!; {end}"
    else:
        code = 0 if kind == "succeeded" else 3
        pause = f"{random.uniform(0.2, 1.5):.2f}"
        script = f"{start}; {trap}; sleep {pause} & wait $!; {end}; exit {code}"
    return ["sh", "-c", script]


async def retry(what: Callable[[], Awaitable[object]], limit_s: float) -> None:
    """``what`` until it works (a server or placement may be down for a moment)."""
    async with asyncio.timeout(limit_s):
        while True:
            try:
                await what()
                return
            except Exception:
                await asyncio.sleep(0.2)


async def declare_streams(js: JetStreamContext) -> None:
    await retry(lambda: ensure_streams(js, replicas=3), 60)


class NatsKill:
    """The NATS server killed, and each stream's write gap after the kill: writes to every
    stream (those placement consumes refused by a condition, nothing stored: ``write_gaps``)
    from ``start()`` until each took one after ``kill()``."""

    PERIOD_S = 0.1

    def __init__(self, js: JetStreamContext, server: EmbeddedNats) -> None:
        self.js = js
        self.server = server
        assert server.cluster is not None
        self.name = server.cluster.server_name
        names = [s.name for s in STREAMS]
        self.probe = WriteProbe(js, targets(names, refused=CONSUMED), period_s=self.PERIOD_S)
        self.leaders: dict[str, str] = {}
        self.gaps: dict[str, Gap] = {}
        self.lines: list[str] = []  # one per stream: its gap, its leader before the kill
        self.problems: list[str] = []
        self._measured: asyncio.Task[None] | None = None

    async def __aenter__(self) -> NatsKill:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._measured is not None and not self._measured.done():
            self._measured.cancel()
        await self.probe.__aexit__()

    async def start(self) -> None:
        await self.probe.__aenter__()
        try:
            await self.probe.until_started(20)
        except AssertionError as err:
            self.problems.append(str(err))

    async def kill(self) -> None:
        """Each stream's leader, then the kill, the writes after it measured aside."""
        groups = await placements(self.js, self.probe.targets, limit_s=10)
        self.leaders = {stream: group.leader for stream, group in groups.items()}
        wrong = {
            s: (g.replicas, g.peers) for s, g in groups.items() if (g.replicas, g.peers) != (3, 3)
        }
        if wrong:
            self.problems.append(f"streams not R3 on 3 servers (replicas, peers): {wrong}")
        self.probe.mark()
        self.server.kill()
        self._measured = asyncio.create_task(self._measure())

    async def _measure(self) -> None:
        try:
            await self.probe.until_written(ELECTION_LIMIT_S + 5)
        except AssertionError as err:
            self.problems.append(str(err))
        finally:
            await self.probe.__aexit__()
        self.gaps = self.probe.gaps()
        for stream, gap in sorted(self.gaps.items()):
            led = self.leaders.get(stream) == self.name
            limit = ELECTION_LIMIT_S if led else NO_ELECTION_LIMIT_S
            how = f"led by {self.name}" if led else f"led by {self.leaders.get(stream)}"
            self.lines.append(f"write gap after the kill of NATS {self.name}: {gap.line()}, {how}")
            print(f"fault run: {self.lines[-1]}")
            if gap.seconds > limit:
                self.problems.append(f"{stream} ({how}) took no write for {gap.seconds:.2f} s")

    async def result(self) -> list[str]:
        """The problems seen, once the measure is over (none when it never started)."""
        if self._measured is not None:
            await self._measured
        return self.problems


class Stack:
    """The services of the run, each startable again after a kill."""

    def __init__(
        self, services: Services, cluster_url: str, db: str, tmp: Path, ns: netns.NetNs | None
    ) -> None:
        self.services = services
        self.tmp = tmp
        self.ns = ns
        self.envs: dict[str, tuple[str, dict[str, str]]] = {}
        for replica in ("a", "b"):
            env = service_env(cluster_url, db, tmp / "placement", "unused")
            env["GPULAYER_STREAM_REPLICAS"] = "3"
            env["GPULAYER_NODE_TIMEOUT_S"] = f"{NODE_TIMEOUT_S:g}"
            self.envs[f"placement-{replica}"] = ("gpulayer-placement", env)
        for node, recording in self.nodes.items():
            env = service_env(cluster_url, db, tmp / node, node, GPULAYER_STREAM_REPLICAS="3")
            with_fake_nvidia_smi(env, tmp / f"{node}-bin", recording)
            self.envs[f"probe-{node}"] = ("gpulayer-probe", env)
            self.envs[f"executor-{node}"] = ("gpulayer-executor", env)

    @property
    def nodes(self) -> dict[str, str]:
        return {**NODES, CUT_NODE: CUT_RECORDING} if self.ns is not None else NODES

    async def start(self, key: str) -> None:
        name, env = self.envs[key]
        # The cut node's services run in its namespace, reaching NATS over its link.
        prefix = self.ns.argv([]) if self.ns is not None and key.endswith(CUT_NODE) else []
        await self.services.start(name, env, self.tmp / f"{key}.log", key=key, prefix=prefix)

    async def kill(self, key: str) -> None:
        proc = self.services.procs[key]
        proc.kill()
        await proc.wait()


async def until_nodes_known(nc: Client, caller: str, names: set[str]) -> None:
    async with asyncio.timeout(60):
        while True:
            with contextlib.suppress(Exception):
                nodes = await api(nc, API_NODES, timeout=1, caller=caller)
                if {n["node_id"] for n in nodes} >= names:
                    return
            await asyncio.sleep(0.2)


async def stored_events(
    js: JetStreamContext, jobs: set[str], lost_on: dict[str, str]
) -> dict[str, list[str]]:
    """Every stored event of ``jobs``, read until each one was announced and has ended (and
    one second more: a duplicate would come next). An announcement whose replica stopped
    while NATS could not store it comes when JetStream delivers its submit again, after the
    ack wait. ``lost_on`` gets the node each ``lost`` event names."""
    seen: dict[str, list[str]] = {j: [] for j in jobs}
    done = asyncio.Event()

    def all_ended() -> bool:
        return all(TERMINAL & set(t) and ANNOUNCED & set(t) for t in seen.values())

    async def cb(msg: Msg) -> None:
        event = json.loads(msg.data)
        if event["job_id"] in seen:
            seen[event["job_id"]].append(event["type"])
            if event["type"] == "lost":
                lost_on[event["job_id"]] = event.get("node_id", "")
            if all_ended():
                done.set()

    sub = await subscribe_retrying(js, cb)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), DRAIN_S)
        await asyncio.sleep(1.0)
    finally:
        await sub.unsubscribe()
    return seen


async def subscribe_retrying(
    js: JetStreamContext, cb: Callable[[Msg], Awaitable[None]]
) -> JetStreamContext.PushSubscription:
    """An ordered consumer over every job's events; its creation retried (JetStream may answer
    slowly for a moment after a server came back)."""
    async with asyncio.timeout(60):
        while True:
            try:
                return await js.subscribe(JOB_WILDCARD_EVENTS, cb=cb, ordered_consumer=True)
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                await asyncio.sleep(0.5)


@pytest.fixture
def cut_off() -> Iterator[netns.NetNs | None]:
    """The cut node's namespace, or None (said) where none can be made here."""
    why = netns.unavailable()
    if why is not None:
        print(f"fault run: no network partition ({why})")
        yield None
        return
    with netns.NetNs() as ns:
        yield ns


async def test_fault_run(
    auth_store: AuthStore,
    nats_creds: str | None,
    tmp_path: Path,
    cut_off: netns.NetNs | None,
    record_property: Callable[[str, object], None],
) -> None:
    # Three servers, listening where the cut node reaches them (this end of its link).
    host = cut_off.host_ip if cut_off is not None else "127.0.0.1"
    auth_conf = auth_store.server_conf if nats_creds else None
    nats_cluster = EmbeddedNatsCluster(tmp_path / "cluster", auth_conf=auth_conf, host=host)
    nats_cluster.start()
    pg = EmbeddedPostgres(tmp_path / "pg", fast=True).start()
    db = await pg.service_database()
    caller = "admin" if nats_creds else ANONYMOUS
    nc = await connect(nats_cluster.url, "test-fault-run", creds=nats_creds)
    markers = tmp_path / "markers"
    markers.mkdir()
    lost_on: dict[str, str] = {}
    try:
        js = nc.jetstream()
        await declare_streams(js)
        nats_kill = NatsKill(js, nats_cluster.servers[1])
        async with Services() as services, HoldsWatch(db) as holds, nats_kill:
            stack = Stack(services, nats_cluster.url, db, tmp_path, cut_off)
            for key in stack.envs:
                await stack.start(key)
            await until_nodes_known(nc, caller, set(stack.nodes))
            submitted, expected = await run_load(nc, js, stack, nats_kill, pg, markers, caller)
            write_gap_problems = await nats_kill.result()
            events = await stored_events(js, submitted, lost_on)
            for key, proc in services.procs.items():
                assert proc.returncode is None, f"{key} exited with {proc.returncode}"
            fences = await until_no_fence(db)
            conn = await asyncpg.connect(db)
            try:
                await holds.look(conn)  # every job ended: nothing may be held or counted
            finally:
                await conn.close()
        node_of = {str(tmp_path / node): node for node in stack.nodes}
        cut = frozenset({CUT_NODE} if cut_off is not None else ())
        counts = check(
            submitted, expected, events, read_markers(markers, node_of), cut, lost_on=lost_on
        )
        partition = "with" if cut_off is not None else "without"
        line = f"fault run ({partition} the partition): {counts.line()}"
        print(line)
        record_property("summary_line", line)  # shown at the end of `make test`
        (tmp_path / "fault-run.txt").write_text(
            "\n".join([line, *nats_kill.lines, *write_gap_problems, *counts.problems]) + "\n"
        )
        assert counts.accepted == counts.submitted == len(expected), (line, counts.problems[:20])
        assert counts.ended == counts.accepted, (line, counts.problems[:20])
        assert counts.lost == counts.duplicated == counts.double_booked == 0, (
            line,
            counts.problems[:20],
        )
        assert counts.wrong_outcome == 0, (line, counts.problems[:20])
        # Every fence was lifted: the cut node's executor reported each grant it was given.
        assert fences == [], fences
        # What nodes and owners were counted as using was what their jobs held, in each look
        # during the faults and after them (tests/faults/holds.py).
        print(
            f"fault run: {holds.looks} looks at the holds, at most {holds.most_held} devices held"
        )
        assert holds.looks > 10, holds.looks
        assert holds.most_held > 0, holds.most_held  # it looked while jobs held devices
        assert holds.problems == [], holds.problems[:20]
        # Every stream took writes again after the NATS server was killed: at once where its
        # leader lived on, after its group's election where the killed server led it.
        assert write_gap_problems == [], write_gap_problems
    finally:
        await nc.close()
        pg.stop()
        nats_cluster.stop()


async def until_no_fence(db: str, limit_s: float = 60.0) -> list[str]:
    """The fences still held once none is left or ``limit_s`` has passed (their grants).
    Looked at again on each change placement announces (release_fences notifies)."""
    conn = await asyncpg.connect(db)
    changed = asyncio.Event()
    await conn.add_listener("gpulayer_allocations", lambda *_: changed.set())
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                while True:
                    changed.clear()
                    if not await conn.fetchval("SELECT count(*) FROM fences"):
                        break
                    await changed.wait()
        rows = await conn.fetch("SELECT DISTINCT grant_id, node_id FROM fences ORDER BY 1")
        return [f"{r['grant_id']} on {r['node_id']}" for r in rows]
    finally:
        await conn.close()


# (at second, what, how): a fault schedule.
Fault = tuple[float, str, Callable[[], Awaitable[None]]]


async def steady_load(
    nc: Client,
    js: JetStreamContext,
    markers: Path,
    caller: str,
    schedule: list[Fault],
    *,
    prefix: str,
    label: str,
    load_s: float,
    faults_in_background: bool = False,
    started: dict[str, float] | None = None,
    acked: dict[str, float] | None = None,
    cancel_within_s: float = 90,
) -> tuple[set[str], dict[str, str]]:
    """Submit ``<prefix>NNNNN`` jobs at ``RATE`` for ``load_s`` (every tenth cancelled 3 s after
    its submit, two in ten failing) while ``schedule`` runs: each fault awaited in turn, or
    with ``faults_in_background`` each in a task of its own, so that the submits never wait
    for one (awaited at the end). ``started``: when each fault began; ``acked``: when each
    submit was acked. The jobs whose submit was acked, and how each should end."""
    expected: dict[str, str] = {}
    submitted: set[str] = set()
    tasks: list[asyncio.Task[None]] = []
    running: list[asyncio.Future[None]] = []

    async def submit(job_id: str, kind: str) -> None:
        body = {
            "job_id": job_id,
            "command": command(markers, job_id, kind),
            "requirements": {"accelerator": "cuda", "gpu_count": 1},
            "sandbox": {"devices": {"gpu": "compute"}},
        }
        data = json.dumps(body).encode()
        headers = {MSG_ID_HEADER: job_id}
        await retry(lambda: js.publish(JOBS_SUBMIT, data, headers=headers, timeout=2), 90)
        if acked is not None:
            acked[job_id] = time.monotonic()
        submitted.add(job_id)
        if kind == "cancelled":
            await asyncio.sleep(3.0)
            await cancel(job_id)

    async def cancel(job_id: str) -> None:
        async def once() -> None:
            try:
                await api(nc, API_CANCEL, {"job_id": job_id}, timeout=2, caller=caller)
            except ApiFailed as err:
                if str(err).startswith(("no job", "internal error")):
                    # Acked by JOBS, not yet read by placement, or placement could not publish
                    # the cancel while a NATS server or its database was away (a fault slowed
                    # it): again, as a user would.
                    raise
                print(f"cancel {job_id}: {err}")  # refused: the checker will see the outcome

        await retry(once, cancel_within_s)

    schedule = list(schedule)
    t0 = time.monotonic()
    i = 0
    while (elapsed := time.monotonic() - t0) < load_s:
        while schedule and schedule[0][0] <= elapsed:
            _, name, action = schedule.pop(0)
            print(f"{label}: t={elapsed:.1f}s {name}")
            if started is not None:
                started[name] = time.monotonic()
            if faults_in_background:
                running.append(asyncio.ensure_future(action()))
            else:
                await action()
        due = int(elapsed * RATE) + 1
        while i < due:
            kind = "cancelled" if i % 10 == 9 else "failed" if i % 10 in (3, 7) else "succeeded"
            job_id = f"{prefix}{i:05d}"
            expected[job_id] = kind
            tasks.append(asyncio.create_task(submit(job_id, kind)))
            i += 1
        await asyncio.sleep(0.05)
    await asyncio.gather(*running)
    await asyncio.gather(*tasks)
    return submitted, expected


async def run_load(
    nc: Client,
    js: JetStreamContext,
    stack: Stack,
    nats_kill: NatsKill,
    pg: EmbeddedPostgres,
    markers: Path,
    caller: str,
) -> tuple[set[str], dict[str, str]]:
    """The fault run's load: ``steady_load`` while the fault schedule runs."""
    schedule = faults(stack, nats_kill, pg)
    return await steady_load(
        nc, js, markers, caller, schedule, prefix="fr-", label="fault run", load_s=LOAD_S
    )


def faults(
    stack: Stack, nats_kill: NatsKill, pg: EmbeddedPostgres
) -> list[tuple[float, str, Callable[[], Awaitable[None]]]]:
    """(at second, what, how): one of each fault the issue names, each repaired."""

    async def nats_back() -> None:
        await asyncio.to_thread(nats_kill.server.start)

    async def pg_restart() -> None:
        await asyncio.to_thread(pg.stop)
        await asyncio.to_thread(pg.start)

    schedule = [
        (3.0, "writes to every stream begin", nats_kill.start),
        (5.0, f"kill -9 NATS server {nats_kill.name}", nats_kill.kill),
        (12.0, f"NATS server {nats_kill.name} back", nats_back),
        (16.0, "kill -9 placement replica a", lambda: stack.kill("placement-a")),
        (21.0, "placement replica a back", lambda: stack.start("placement-a")),
        (26.0, "kill -9 the executor of fr-h100", lambda: stack.kill("executor-fr-h100")),
        (31.0, "executor of fr-h100 back", lambda: stack.start("executor-fr-h100")),
        (37.0, "restart PostgreSQL", pg_restart),
    ]
    if (ns := stack.ns) is not None:

        async def cut() -> None:
            ns.cut()

        async def restore() -> None:
            ns.restore()

        schedule += [
            (CUT_AT_S, f"{CUT_NODE} cut off the network", cut),
            (CUT_AT_S + CUT_FOR_S, f"{CUT_NODE} back on the network", restore),
        ]
    return sorted(schedule, key=lambda item: item[0])

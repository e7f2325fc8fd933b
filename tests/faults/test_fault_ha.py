"""The HA fault run (``make faults-ha``): the fault run's load (steady submits, executors running
jobs, cancels) through two placement replicas whose database is a Patroni cluster
(``tests/faults/patroni_cluster.py``: etcd, two members, a synchronous standby), reached by a
multi-host URL with ``target_session_attrs=read-write``. While jobs keep coming:

1. the leader's PostgreSQL is killed with SIGKILL; its Patroni, alive, fails over at once
   (``primary_start_timeout`` 0) and Patroni promotes the synchronous standby; the old leader
   rejoins as a standby (pg_rewind where its WAL went past the new timeline's start);
2. ``patronictl switchover`` moves the leader back to it;
3. the leader's Patroni and PostgreSQL are both killed (a machine's crash): the standby is
   promoted once the leader key's ttl has passed; the crashed member, started again, rejoins
   as a standby with pg_rewind.

Placement is never restarted. Then it counts, as the fault run does (``fault_checker``):
every acknowledged submit is in the last leader's ``jobs`` table and ended exactly once (its
events and its row), none ran twice, no device was held by two runs at once; and the
failovers seen (leader changes) and the longest stall (the longest time with no grant made
while a job waited). Last line: ``ha fault run: submitted=N accepted=N ended=N lost=0
duplicated=0 double-booked=0 failovers=K stall_max_s=S``.

``GPULAYER_HA_ASYNC=1`` (``make faults-ha ASYNC=1``) runs the same with ``synchronous_mode``
off and asserts nothing on ``lost``: what it prints is what asynchronous replication lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.faults import patroni_cluster
from tests.faults.fault_checker import check, longest_stall, read_markers
from tests.faults.patroni_cluster import PatroniCluster
from tests.faults.test_fault_run import (
    NODES,
    TERMINAL,
    retry,
    steady_load,
    stored_events,
    until_nodes_known,
)
from tests.helpers import Services, service_env, with_fake_nvidia_smi

from gpulayer_contracts.subjects import (
    ANONYMOUS,
    JOB_WILDCARD_EVENTS,
)
from gpulayer_runtime.database import replace_url
from gpulayer_runtime.nats import ensure_streams

ASYNC_ENV = "GPULAYER_HA_ASYNC"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(600),
    patroni_cluster.only_in_make_faults_ha("the HA fault run (etcd, Patroni's venv, ~3 min) is"),
]

# The schedule, in seconds from the first submit.
KILL_PG_AT_S = 8.0
SWITCHOVER_AT_S = 24.0
CRASH_AT_S = 40.0
LOAD_S = 66.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[PatroniCluster]:
    why = patroni_cluster.unavailable()
    if why is not None:
        pytest.fail(f"make faults-ha needs {why}")
    synchronous = os.environ.get(ASYNC_ENV) != "1"
    with PatroniCluster(tmp_path / "ha", synchronous=synchronous) as running:
        yield running


class Leaders:
    """Patroni's leader, looked at every 0.25 s in a thread: each change (a failover or a
    switchover) with when it was seen."""

    def __init__(self, cluster: PatroniCluster) -> None:
        self.cluster = cluster
        self.changes: list[tuple[float, str | None, str]] = []  # (when, from, to)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Leaders:
        self.current = await asyncio.to_thread(self.cluster.leader)
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _watch(self) -> None:
        while not self._stop.is_set():
            leader = await asyncio.to_thread(self.cluster.leader)
            if leader is not None and leader != self.current:
                self.changes.append((time.monotonic(), self.current, leader))
                print(f"ha fault run: leader {self.current} -> {leader}")
                self.current = leader
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.25)


class Grants:
    """Every job's events as they come (a plain subscription, so the time seen is the time
    placement published): when each job stopped waiting (its grant, or its end without one)
    and when each grant was made."""

    def __init__(self) -> None:
        self.acked: dict[str, float] = {}
        self.stopped: dict[str, float] = {}
        self.grants: list[float] = []

    async def cb(self, msg: Msg) -> None:
        event = json.loads(msg.data)
        now = time.monotonic()
        if event["type"] == "placed":
            self.grants.append(now)
        if event["type"] == "placed" or event["type"] in TERMINAL:
            self.stopped.setdefault(event["job_id"], now)

    def stall(self, end: float, since: float = 0.0, until: float = float("inf")) -> float:
        """The longest stall within [since, until): the waits cut to it."""
        waits = [
            (max(t, since), min(self.stopped.get(job, end), until)) for job, t in self.acked.items()
        ]
        return longest_stall([(s, e) for s, e in waits if s < e], self.grants)


async def test_fault_ha(
    cluster: PatroniCluster, nc: Client, nats_url: str, nats_creds: str | None, tmp_path: Path
) -> None:
    db = await cluster.service_database()
    caller = "admin" if nats_creds else ANONYMOUS
    markers = tmp_path / "markers"
    markers.mkdir()
    js = nc.jetstream()
    await retry(lambda: ensure_streams(js), 60)
    grants = Grants()
    sub = await nc.subscribe(JOB_WILDCARD_EVENTS, cb=grants.cb)
    async with Services() as services, Leaders(cluster) as leaders:
        for replica in ("a", "b"):
            env = service_env(nats_url, db, tmp_path / "placement", "unused")
            await services.start(
                "gpulayer-placement", env, tmp_path / f"placement-{replica}.log", key=replica
            )
        for node, recording in NODES.items():
            env = service_env(nats_url, db, tmp_path / node, node)
            with_fake_nvidia_smi(env, tmp_path / f"{node}-bin", recording)
            for service in ("probe", "executor"):
                await services.start(
                    f"gpulayer-{service}", env, tmp_path / f"{service}-{node}.log",
                    key=f"{service}-{node}",
                )  # fmt: skip
        await until_nodes_known(nc, caller, set(NODES))
        fault_started: dict[str, float] = {}
        submitted, expected = await run_load(nc, cluster, grants, markers, caller, fault_started)
        load_end = time.monotonic()
        events = await stored_events(js, submitted, {})
        stall = grants.stall(load_end)
        # Each fault's own: from it to the next one.
        starts = sorted(fault_started.items(), key=lambda kv: kv[1])
        for (name, at), (_, upto) in zip(starts, [*starts[1:], ("", load_end)], strict=True):
            print(f"ha fault run: stall after {name}: {grants.stall(load_end, at, upto):.1f} s")
        # Every member back: the crashed one rejoined as a standby.
        await cluster.until_async(
            lambda c: len(c.streaming()) == len(c.members) - 1,
            "every member streaming from the leader again",
            90,
        )
        for key, proc in services.procs.items():
            assert proc.returncode is None, f"{key} exited with {proc.returncode}"
        rows = await rows_on_leader(cluster, submitted)
    await sub.unsubscribe()

    node_of = {str(tmp_path / node): node for node in NODES}
    counts = check(submitted, expected, events, read_markers(markers, node_of))
    missing = sorted(j for j in submitted if j not in rows)
    unended = sorted(j for j, state in rows.items() if state not in TERMINAL)
    gone = {j for j in submitted if "accepted" not in events.get(j, [])}
    gone |= {j for j, types in events.items() if not TERMINAL & set(types)}
    lost = gone | set(missing) | set(unended) | {j for j, t in events.items() if "lost" in t}
    logs = "".join(m.log.read_text(errors="replace") for m in cluster.members.values())
    rewinds = logs.count("pg_rewind exit code=0")
    failed_rewinds = logs.count("pg_rewind exit code=") - rewinds
    mode = "synchronous" if cluster.synchronous else "asynchronous"
    print(
        f"ha fault run ({mode}): leader changes {[(a, b) for _, a, b in leaders.changes]}, "
        f"pg_rewind runs {rewinds} (failed: {failed_rewinds}), timeline {cluster.timeline()}; "
        f"missing from the leader's jobs table: {missing[:20]} ({len(missing)}); not ended there: {unended[:20]}; "
        f"problems: {counts.problems[:20]}"
    )
    line = (
        f"ha fault run: submitted={counts.submitted} accepted={counts.accepted} "
        f"ended={counts.ended} lost={len(lost)} duplicated={counts.duplicated} "
        f"double-booked={counts.double_booked} failovers={len(leaders.changes)} "
        f"stall_max_s={stall:.1f}"
    )
    (tmp_path / "ha-fault-run.txt").write_text("\n".join([line, *counts.problems]) + "\n")
    print(line)
    assert counts.duplicated == counts.double_booked == 0, (line, counts.problems[:20])
    assert len(leaders.changes) >= 3, leaders.changes
    if not cluster.synchronous:
        return  # what asynchronous replication lost is the result, printed above
    assert counts.accepted == counts.submitted == len(expected), (line, counts.problems[:20])
    assert counts.ended == counts.accepted, (line, counts.problems[:20])
    assert not lost, (line, sorted(lost)[:20], counts.problems[:20])
    assert counts.wrong_outcome == 0, (line, counts.problems[:20])


async def rows_on_leader(cluster: PatroniCluster, jobs: set[str]) -> dict[str, str]:
    """Each job's state in the leader's ``jobs`` table, once none of them is still placed or
    running there (an executor's last report is applied when placement consumes it), or after
    60 s: job -> state, missing jobs absent."""
    leader = cluster.leader()
    assert leader is not None, cluster.members_state()
    conn = await asyncpg.connect(replace_url(cluster.member_url(leader), database="gpulayer"))
    try:
        query = "SELECT job_id, state FROM jobs WHERE job_id = ANY($1::text[])"
        changed = asyncio.Event()
        await conn.add_listener("gpulayer_allocations", lambda *_: changed.set())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(60):
                while True:
                    changed.clear()
                    rows = {r["job_id"]: r["state"] for r in await conn.fetch(query, list(jobs))}
                    if all(state in TERMINAL for state in rows.values()):
                        break
                    await changed.wait()
        return {r["job_id"]: r["state"] for r in await conn.fetch(query, list(jobs))}
    finally:
        await conn.close()


async def run_load(
    nc: Client,
    cluster: PatroniCluster,
    grants: Grants,
    markers: Path,
    caller: str,
    started: dict[str, float],
) -> tuple[set[str], dict[str, str]]:
    """The fault run's load (``steady_load``) for ``LOAD_S`` while the schedule runs, each fault
    in a task of its own (the submits never wait for one); the jobs whose submit was acked,
    and how each should end."""
    return await steady_load(
        nc,
        nc.jetstream(),
        markers,
        caller,
        faults(cluster),
        prefix="ha-",
        label="ha fault run",
        load_s=LOAD_S,
        faults_in_background=True,
        started=started,
        acked=grants.acked,
        cancel_within_s=120,
    )


def faults(cluster: PatroniCluster) -> list[tuple[float, str, Callable[[], Awaitable[None]]]]:
    """(at second, what, how): the three faults of issue 48, each waiting (bounded) for the
    cluster state it needs."""
    state: dict[str, str] = {}

    async def kill_pg() -> None:
        leader = cluster.leader()
        assert leader is not None, cluster.members_state()
        state["first"] = leader
        await asyncio.to_thread(cluster.kill_postgres, leader)
        print(f"ha fault run: killed {leader}'s PostgreSQL")
        await cluster.until_async(
            lambda c: c.leader() not in (None, leader), "promotion after the kill", 60
        )

    async def switchover() -> None:
        back = state["first"]
        await cluster.until_async(
            lambda c: back in c.streaming() and (not c.synchronous or c.sync_standby() == back),
            f"{back} rejoined as the synchronous standby",
            60,
        )
        out = await asyncio.to_thread(cluster.switchover, back)
        said = [line for line in out.splitlines() if "switch" in line.lower()]
        print(f"ha fault run: switchover to {back}: {said[-1:]}")
        await cluster.until_async(lambda c: c.leader() == back, f"{back} leading", 60)

    async def crash() -> None:
        await cluster.until_async(
            lambda c: c.streaming() and (not c.synchronous or c.sync_standby()),
            "a (synchronous) standby streaming before the crash",
            60,
        )
        leader = cluster.leader()
        assert leader is not None, cluster.members_state()
        await asyncio.to_thread(cluster.kill_member, leader)
        print(f"ha fault run: killed {leader}'s Patroni and PostgreSQL")
        # Started again only once another member leads: before the leader key's ttl ran out,
        # its Patroni would find the key its own and lead again, with no failover.
        await cluster.until_async(
            lambda c: c.leader() not in (None, leader),
            f"a leader other than {leader} (after the ttl, {patroni_cluster.TTL_S} s)",
            90,
        )
        await asyncio.to_thread(cluster.start_member, leader)
        print(f"ha fault run: {leader}'s Patroni started again")

    return [
        (KILL_PG_AT_S, "kill -9 the leader's PostgreSQL", kill_pg),
        (SWITCHOVER_AT_S, "patronictl switchover back to the first leader", switchover),
        (CRASH_AT_S, "kill -9 the leader's Patroni and PostgreSQL", crash),
    ]

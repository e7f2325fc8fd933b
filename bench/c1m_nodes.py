"""Simulated nodes for the c1m bench: one process standing in for many nodes' probes and
executors, and never running a job.

``python -m bench.c1m_nodes URL CREDS PREFIX NODES`` publishes each node's capabilities (the
bench fleet's shapes, bench/fleet.py), then sends each node's probe and executor heartbeats every
``HEARTBEAT_S`` (slots, reserved cores, enforcement, as an executor's beat says them), takes
every grant from the GRANTS stream on one pull consumer and reports it ``running`` as an
executor does: a ``JobStatus`` to the node's status subject for placement and a ``Running``
event to the job's events, each a JetStream publish with the executor's message id.

It is driven on stdin, one JSON object a line, and answers on stdout, one JSON object a line:

- ``{"op": "stats"}``: grants taken, when the first and last arrived (wall clock), runnings
  reported, grants dropped (their node vanished).
- ``{"op": "watch", "job_id": J}``: answered at once, then a line
  ``{"event": "grant", "job_id": J, "at": T, "arrived": A}`` once J's grant arrives (at once if
  it has): T when the GRANTS stream stored it, A when this process fetched it.
- ``{"op": "end_one"}``: one running job holding one whole GPU (not shared, not a rank) ends
  ``succeeded``; answers with its id and when its end was sent.
- ``{"op": "vanish", "node": N}``: node N stops heartbeating and reporting, as a machine that
  lost power; its grants are taken and never answered.
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import deque
from datetime import UTC, datetime

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import FetchTimeoutError

from bench.fleet import fleet
from gpulayer_contracts import Heartbeat, __version__, encode
from gpulayer_contracts.events import JobStatus, Running, Succeeded
from gpulayer_contracts.subjects import (
    MSG_ID_HEADER,
    NODE_WILDCARD_GRANTS,
    end_msg_id,
    job_events,
    node_capabilities,
    node_heartbeat,
    node_status,
    valid_owner,
)
from gpulayer_runtime.nats import connect

HEARTBEAT_S = 5.0  # the executor's default beat
SLOTS = 256  # jobs each simulated executor runs at once (GPULAYER_EXECUTOR_MAX_JOBS)
FETCH = 512
ENFORCEMENT = "cgroup v1: memory cpu pids devices"


class _Gpu(msgspec.Struct):
    use: str | None = None


class _Job(msgspec.Struct):
    job_id: str
    gpu: _Gpu | None = None


class _Gang(msgspec.Struct):
    rank: int


class _Grant(msgspec.Struct):
    """The fields of a grant an executor's report needs (the rest is skipped when decoding)."""

    grant_id: str
    node_id: str
    job: _Job
    devices: list[int] = []
    owner: str = "anonymous"
    gang: _Gang | None = None
    granted_at: datetime | None = None


_grant = msgspec.json.Decoder(_Grant)


class Nodes:
    def __init__(self, nc: Client, js: JetStreamContext, prefix: str, count: int) -> None:
        self.nc = nc
        self.js = js
        self.nodes = [c.node_id for c in fleet(prefix, count)]
        self.prefix = prefix
        self.count = count
        self.vanished: set[str] = set()
        self.grants = 0
        self.first = 0.0
        self.last = 0.0
        self.running = 0
        self.dropped = 0
        self.failed_publishes = 0
        self.watched: set[str] = set()
        # Running jobs that hold one whole GPU: (job_id, grant_id, node, owner), for end_one.
        self.whole_gpu: deque[tuple[str, str, str, str]] = deque()
        self.granted: dict[str, float] = {}  # watched job -> when its grant arrived
        self.stop = asyncio.Event()

    async def publish_capabilities(self) -> None:
        caps = fleet(self.prefix, self.count)
        for start in range(0, len(caps), 512):
            chunk = caps[start : start + 512]
            await asyncio.gather(
                *(self.js.publish(node_capabilities(c.node_id), encode(c)) for c in chunk)
            )

    async def heartbeats(self) -> None:
        """Every node's executor beat once per HEARTBEAT_S, spread over the period in tenths."""
        tenth = max(1, len(self.nodes) // 10)
        while not self.stop.is_set():
            for start in range(0, len(self.nodes), tenth):
                now = datetime.now(UTC)
                for node in self.nodes[start : start + tenth]:
                    if node in self.vanished:
                        continue
                    beat = Heartbeat(
                        node_id=node,
                        sent_at=now,
                        source="executor",
                        agent_version=__version__,
                        slots=SLOTS,
                        reserved_cores=2.0,
                        reserved_memory_gb=4.0,
                        enforcement=ENFORCEMENT,
                    )
                    # The probe's beat keeps the node online; the executor's says what it
                    # offers (placement's liveness takes them apart).
                    probe = Heartbeat(node_id=node, sent_at=now, agent_version=__version__)
                    with contextlib.suppress(nats.errors.Error, OSError):
                        await self.nc.publish(node_heartbeat(node), encode(probe))
                        await self.nc.publish(node_heartbeat(node), encode(beat))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), HEARTBEAT_S / 10)
                if self.stop.is_set():
                    return

    async def publish(self, subject: str, body: bytes, msg_id: str) -> None:
        for _ in range(20):
            try:
                await self.js.publish(subject, body, headers={MSG_ID_HEADER: msg_id}, timeout=30)
                return
            except (nats.errors.Error, OSError):
                await asyncio.sleep(0.2)
        self.failed_publishes += 1

    async def take_grants(self) -> None:
        sub = await self.js.pull_subscribe(
            NODE_WILDCARD_GRANTS,
            durable="c1m-nodes",
            stream="GRANTS",
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, ack_wait=120, max_ack_pending=50_000
            ),
        )
        while not self.stop.is_set():
            try:
                msgs = await sub.fetch(FETCH, timeout=1.0)
            except (FetchTimeoutError, TimeoutError):
                continue
            except nats.errors.Error:
                await asyncio.sleep(0.2)
                continue
            now = time.time()
            reports = []
            for msg in msgs:
                try:
                    g = _grant.decode(msg.data)
                except msgspec.DecodeError:
                    continue
                self.grants += 1
                if not self.first:
                    self.first = now
                self.last = now
                if g.job.job_id in self.watched:
                    # When GRANTS stored the grant, placement's publish: this loop's own fetch
                    # (up to a second's wait for a batch) is not the grant's time.
                    stored = msg.metadata.timestamp.timestamp()
                    self.granted[g.job.job_id] = stored
                    say(
                        {
                            "event": "grant",
                            "job_id": g.job.job_id,
                            "at": stored,
                            "arrived": now,
                            "granted_at": g.granted_at.timestamp() if g.granted_at else now,
                        }
                    )
                if g.node_id in self.vanished:
                    self.dropped += 1
                    continue
                owner = valid_owner(g.owner)
                rank = g.gang.rank if g.gang is not None else None
                shared = g.job.gpu is not None and g.job.gpu.use == "shared"
                if len(g.devices) == 1 and rank is None and not shared:
                    self.whole_gpu.append((g.job.job_id, g.grant_id, g.node_id, owner))
                at = datetime.now(UTC)
                msg_id = f"{g.grant_id}:running"
                status = JobStatus(
                    job_id=g.job.job_id,
                    grant_id=g.grant_id,
                    node_id=g.node_id,
                    state="running",
                    pid=4242,
                    at=at,
                )
                event = Running(
                    job_id=g.job.job_id, node_id=g.node_id, pid=4242, at=at, owner=owner, rank=rank
                )
                reports.append(self.publish(node_status(g.node_id), encode(status), msg_id))
                reports.append(self.publish(job_events(g.job.job_id, owner), encode(event), msg_id))
            await asyncio.gather(*reports)
            self.running += len(reports) // 2
            await asyncio.gather(*(m.ack() for m in msgs))

    async def end_one(self) -> dict[str, object]:
        """A running whole-GPU job's executor reports it succeeded."""
        while self.whole_gpu:
            job_id, grant_id, node, owner = self.whole_gpu.popleft()
            if node in self.vanished:
                continue
            at = datetime.now(UTC)
            status = JobStatus(
                job_id=job_id,
                grant_id=grant_id,
                node_id=node,
                state="succeeded",
                exit_code=0,
                at=at,
            )
            event = Succeeded(job_id=job_id, node_id=node, exit_code=0, at=at, owner=owner)
            sent = time.time()
            await asyncio.gather(
                self.publish(node_status(node), encode(status), f"{grant_id}:succeeded"),
                self.publish(job_events(job_id, owner), encode(event), end_msg_id(grant_id)),
            )
            return {"op": "end_one", "job_id": job_id, "node": node, "at": sent}
        return {"op": "end_one", "error": "no running job holds one whole GPU"}

    def stats(self) -> dict[str, object]:
        return {
            "op": "stats",
            "grants": self.grants,
            "first": self.first,
            "last": self.last,
            "running": self.running,
            "dropped": self.dropped,
            "failed_publishes": self.failed_publishes,
        }


def say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def commands(nodes: Nodes) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            return
        try:
            cmd = json.loads(line)
            op = cmd["op"]
        except (ValueError, KeyError, TypeError) as err:
            say({"error": f"bad command {line[:80]!r}: {err}"})
            continue
        if op == "quit":
            return
        if op == "stats":
            say(nodes.stats())
        elif op == "watch":
            job_id = str(cmd["job_id"])
            nodes.watched.add(job_id)
            say({"op": "watch", "job_id": job_id})
            if job_id in nodes.granted:
                say({"event": "grant", "job_id": job_id, "at": nodes.granted[job_id]})
        elif op == "end_one":
            say(await nodes.end_one())
        elif op == "vanish":
            nodes.vanished.add(str(cmd["node"]))
            say({"op": "vanish", "node": cmd["node"]})
        else:
            say({"error": f"unknown op {op!r}"})


async def amain(url: str, creds: str, prefix: str, count: int) -> int:
    nc = await connect(url, "bench-c1m-nodes", creds=creds or None)
    js = nc.jetstream()
    nodes = Nodes(nc, js, prefix, count)
    try:
        await nodes.publish_capabilities()
        tasks = [
            asyncio.create_task(nodes.heartbeats()),
            asyncio.create_task(nodes.take_grants()),
        ]
        say({"event": "ready", "nodes": count})
        await commands(nodes)
        nodes.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return 0


def main(argv: list[str]) -> int:
    url, creds, prefix, count = argv
    return asyncio.run(amain(url, creds, prefix, int(count)))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

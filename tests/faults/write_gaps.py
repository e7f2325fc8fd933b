"""Writes to every gpulayer stream at a steady pace, and each stream's write gap around a
moment (a NATS server killed): from the last write acked before it to the first write acked
after it, read from the times the acks came (not from a sleep).

A write is either stored (a message on a subject of the stream that no service reads) or, on a
stream whose every subject a service consumes (JOBS, NODES, STATUS: a stored probe there would
be a bad job or report), ``refused``: a publish with a condition it can't meet
(``Nats-Expected-Last-Subject-Sequence``). JetStream checks that condition on the stream's
leader, before proposing the message to its group, and answers "wrong last sequence": the answer
comes only from a leader that takes writes, and nothing is stored.

Why the gap of a stream whose leader was on the killed server is seconds long: its followers
notice the leader is gone only when their raft election timer fires, a random 4 to 9 s after the
leader's last heartbeat (nats-server's ``minElectionTimeout`` / ``maxElectionTimeout``, fixed in
``server/raft.go``, with no setting); the vote itself takes milliseconds. Until then a publish
finds no stream leader subscribed to the subject and NATS answers "no responders"
(``NoStreamResponseError``). A stream whose leader is on a surviving server has no election and
no gap (one publish period), whichever server the client was connected to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from gpulayer_contracts.subjects import STREAMS

PERIOD_S = 0.05
# The longest write gap of a stream whose leader lives on (it has no election; the client, when
# its own server died, reconnects to another within a publish timeout).
NO_ELECTION_LIMIT_S = 2.0
# The longest write gap of a stream whose leader died: nats-server's election timer (4 to 9 s,
# restarted by each append from the leader, which the probe's writes keep coming), then a vote
# (milliseconds). Where both followers' timers fire together, each votes for itself, neither wins,
# and a second round waits another 4 to 9 s: two rounds are up to 18 s (seen once in CI: 15.3 s).
# The bound allows two rounds and a little room for a machine whose cores the test keeps busy; a
# third round (both timers together twice) is rare enough to read as a failure.
ELECTION_LIMIT_S = 20.0
# JetStream's error code for a failed Nats-Expected-Last-Subject-Sequence.
WRONG_LAST_SEQUENCE = 10071
# A subject sequence no stream reaches: the condition always fails.
_REFUSED = {"Nats-Expected-Last-Subject-Sequence": str(1 << 62)}
# The stored probes read as job events with a job id no job has (readers of JOB_EVENTS skip it).
PROBE_ID = "gap-probe"
_PAYLOAD = json.dumps({"job_id": PROBE_ID, "type": PROBE_ID}).encode()
# Every subject of these streams is consumed by placement.
CONSUMED = frozenset({"JOBS", "NODES", "STATUS"})


async def close(nc: Client, limit_s: float = 5.0) -> None:
    """``nc.close()``, bounded: once in a few dozen runs of ``nats_failover`` one never returned
    after its server was killed (nats-py 2.16)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), limit_s)


class Target(msgspec.Struct, frozen=True, kw_only=True):
    subject: str
    refused: bool = False


def probe_subject(stream: str) -> str:
    """The stream's first subject with each wildcard token named ``gap-probe``."""
    spec = next(s for s in STREAMS if s.name == stream)
    return ".".join(PROBE_ID if t in ("*", ">") else t for t in spec.subjects[0].split("."))


def targets(streams: Iterable[str], *, refused: Iterable[str] = ()) -> dict[str, Target]:
    """A target per stream; those in ``refused`` get the refused publish."""
    refuse = set(refused)
    return {s: Target(subject=probe_subject(s), refused=s in refuse) for s in streams}


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where a stream's group is: its leader, its configured replicas, its peers (leader too)."""

    leader: str
    replicas: int
    peers: int


async def placements(
    js: JetStreamContext, streams: Iterable[str], limit_s: float = 60.0
) -> dict[str, Placement]:
    """Each stream's group, once each has a leader (a group just made, or one that just lost
    its leader, has none for a moment)."""
    found: dict[str, Placement] = {}
    async with asyncio.timeout(limit_s):
        for stream in streams:
            while True:
                with contextlib.suppress(nats.errors.Error):
                    info = await js.stream_info(stream)
                    if info.cluster is not None and info.cluster.leader:
                        found[stream] = Placement(
                            leader=info.cluster.leader,
                            replicas=info.config.num_replicas or 1,
                            peers=1 + len(info.cluster.replicas or []),
                        )
                        break
                await asyncio.sleep(0.1)
    return found


class Gap(msgspec.Struct, frozen=True, kw_only=True):
    stream: str
    seconds: float  # last write acked before the mark to the first acked after it
    after_mark: float  # the mark to the first write acked after it
    failures: dict[str, int]  # failed publishes after the mark, by outcome

    def line(self) -> str:
        fails = ", ".join(f"{n} {k}" for k, n in sorted(self.failures.items())) or "none failed"
        return f"{self.stream} {self.seconds:.2f} s ({fails})"


class WriteProbe:
    """One task per stream publishing each ``period_s`` (one publish at a time, each waited
    for up to ``timeout_s``); ``mark()`` the moment of the fault, ``until_written()`` waits for
    a write after it on every stream, ``gaps()`` says how long each stream took none."""

    def __init__(
        self,
        js: JetStreamContext,
        targets: Mapping[str, Target],
        *,
        period_s: float = PERIOD_S,
        timeout_s: float = 1.0,
        on_outcome: Callable[[str, float, float, str], None] | None = None,
    ) -> None:
        self.js = js
        # Each publish as it ends: stream, sent, done (monotonic), outcome ("ok" or the failure).
        self.on_outcome = on_outcome
        self.targets = dict(targets)
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.acks: dict[str, list[float]] = {s: [] for s in self.targets}
        self.failures: dict[str, Counter[str]] = {s: Counter() for s in self.targets}
        self.marked: float | None = None
        self._written = {s: asyncio.Event() for s in self.targets}
        self._first = {s: asyncio.Event() for s in self.targets}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False

    async def __aenter__(self) -> WriteProbe:
        self._tasks = [asyncio.create_task(self._run(s)) for s in self.targets]
        return self

    async def __aexit__(self, *exc: object) -> None:
        # The flag too: Python 3.11's wait_for (inside nats-py's publish) drops a cancel that
        # comes as the ack does, and the loop would go on publishing, never to be gathered.
        self._stopped = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def until_started(self, limit_s: float = 30.0) -> None:
        """Until every stream took a write (before any fault)."""
        await self._wait(self._first, limit_s, "before the fault")

    def mark(self) -> float:
        """Now is the fault: writes acked from now on count as after it."""
        self.marked = time.monotonic()
        for event in self._written.values():
            event.clear()
        return self.marked

    async def until_written(self, limit_s: float) -> None:
        """Until every stream took a write after ``mark()``; an ``AssertionError`` naming the
        streams still without one (and how their publishes failed) after ``limit_s``."""
        await self._wait(self._written, limit_s, "after the fault")

    def gaps(self) -> dict[str, Gap]:
        """Each stream's write gap around the mark (streams with a write after it)."""
        assert self.marked is not None, "mark() first"
        mark = self.marked
        gaps = {}
        for stream, acks in self.acks.items():
            before = [t for t in acks if t <= mark]
            after = [t for t in acks if t > mark]
            if not after:
                continue
            last = before[-1] if before else mark
            gaps[stream] = Gap(
                stream=stream,
                seconds=after[0] - last,
                after_mark=after[0] - mark,
                failures=dict(self.failures[stream]),
            )
        return gaps

    async def _wait(self, events: dict[str, asyncio.Event], limit_s: float, when: str) -> None:
        waits = [asyncio.create_task(e.wait()) for e in events.values()]
        try:
            _, pending = await asyncio.wait(waits, timeout=limit_s)
        finally:
            for w in waits:
                w.cancel()
        if pending:
            missing = sorted(s for s, e in events.items() if not e.is_set())
            raise AssertionError(
                f"no write acked {when} within {limit_s:g} s on "
                + ", ".join(f"{s} (failed: {dict(self.failures[s]) or 'none'})" for s in missing)
            )

    async def _run(self, stream: str) -> None:
        target = self.targets[stream]
        headers = dict(_REFUSED) if target.refused else None
        while not self._stopped:
            sent = time.monotonic()
            outcome = await self._publish(target.subject, headers)
            done = time.monotonic()
            if self.on_outcome is not None:
                self.on_outcome(stream, sent, done, outcome or "ok")
            if outcome is None:
                self.acks[stream].append(done)
                self._first[stream].set()
                if self.marked is not None and done > self.marked:
                    self._written[stream].set()
            elif self.marked is not None and done > self.marked:
                self.failures[stream][outcome] += 1
            await asyncio.sleep(max(0.0, self.period_s - (done - sent)))

    async def _publish(self, subject: str, headers: dict[str, str] | None) -> str | None:
        """None when the stream's leader answered as a stored write (or, refused, with the
        failed condition); else what happened."""
        try:
            await self.js.publish(subject, _PAYLOAD, timeout=self.timeout_s, headers=headers)
            return None if headers is None else "stored despite its condition"
        except NoStreamResponseError:
            return "no responders"
        except nats.errors.TimeoutError:
            return "timeout"
        except APIError as err:
            if headers is not None and err.err_code == WRONG_LAST_SEQUENCE:
                return None
            return f"error {err.err_code}"
        except Exception as err:  # anything else, counted by its kind (the loop goes on)
            return type(err).__name__

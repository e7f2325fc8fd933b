"""The observations part alone: what it applied and dropped is logged every SUMMARY_S, so an
operator (and ``make bench``) can tell whether placement keeps up with the probes."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from tests.unit.placement.placement_fakes import FakeJetStream, FakePool, gpu_node

from gpulayer_contracts import encode
from gpulayer_contracts.health import DeviceObservation, NodeObservations
from gpulayer_contracts.subjects import node_observations
from gpulayer_placement import observations
from gpulayer_placement.fleet import Fleet
from gpulayer_placement.publisher import Publisher
from gpulayer_placement.settings import Settings
from gpulayer_placement.wake import Wake


class _Msg:
    def __init__(self, subject: str, data: bytes) -> None:
        self.subject = subject
        self.data = data


async def test_applied_and_dropped_messages_are_summed_in_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = Fleet()
    fleet.upsert(gpu_node("g", 2))
    pool = cast(Any, FakePool())
    stop = asyncio.Event()
    obs = observations.Observations(
        nc=cast(Any, None),
        pool=pool,
        fleet=fleet,
        wake=Wake(),
        publisher=Publisher(cast(Any, FakeJetStream(ack_after=1)), pool, Settings()),
        stop=stop,
    )
    monkeypatch.setattr(observations, "SUMMARY_S", 0.0)
    good = NodeObservations(
        node_id="g",
        observed_at=datetime.now(UTC),
        devices=[DeviceObservation(index=0), DeviceObservation(index=1)],
    )
    caplog.set_level(logging.INFO, logger=observations.log.name)
    good_msg = _Msg(node_observations("g"), encode(good))
    bad_msg = _Msg(node_observations("g"), b"not json")
    await obs.apply([obs.read(cast(Any, good_msg)), obs.read(cast(Any, bad_msg))])
    obs._summarize()
    obs._summarize()  # nothing new came: no line
    lines = [r.getMessage() for r in caplog.records if "observations:" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith("observations: 1 applied, 1 dropped in the last ")
    stop.set()

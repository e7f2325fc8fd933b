"""Observations the web service keeps: good ones; a bad or forged one skipped, not fatal."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from gpulayer_contracts.health import DeviceObservation, NodeObservations
from gpulayer_web.cache import FleetCache
from gpulayer_web.reader import take_observation


async def _never(*args: object) -> object:
    raise AssertionError("no API request expected")


def _obs(node: str) -> bytes:
    return msgspec.json.encode(
        NodeObservations(
            node_id=node,
            observed_at=datetime.now(UTC),
            devices=[DeviceObservation(index=0, utilization_pct=50)],
        )
    )


@pytest.mark.parametrize(
    ("subject", "data"),
    [
        ("gpulayer.node.n1.observations", b"not json"),
        ("gpulayer.node.n1.observations", b'{"node_id": "n1"}'),  # no observed_at
        ("gpulayer.node.n1.observations", b"[" * 10_000),
        # Another node's report on this node's subject: a forged sender.
        ("gpulayer.node.n1.observations", _obs("n2")),
        ("gpulayer.node.n1.observations", _obs("a.b")),
    ],
)
def test_a_bad_or_forged_observation_is_skipped(subject: str, data: bytes) -> None:
    cache = FleetCache(_never, _never)  # type: ignore[arg-type]
    assert take_observation(cache, subject, data) is False
    assert cache.observations("n1") == []
    assert cache.observations("n2") == []


def test_an_observation_is_kept() -> None:
    cache = FleetCache(_never, _never)  # type: ignore[arg-type]
    assert take_observation(cache, "gpulayer.node.n1.observations", _obs("n1"))
    (kept,) = cache.observations("n1")
    assert kept.devices[0].utilization_pct == 50

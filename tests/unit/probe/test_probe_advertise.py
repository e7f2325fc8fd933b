"""A node's advertise address (issue 14): GPULAYER_ADVERTISE_ADDRESS, else detected, else the
loopback address; in ``host.advertise_address``, where placement reads rank 0's rendezvous."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gpulayer_detection import host as host_module
from gpulayer_detection.base import ProbeContext
from gpulayer_detection.host import HostProbe
from gpulayer_detection.registry import build_capabilities
from gpulayer_detection.runner import RunResult
from gpulayer_probe.__main__ import read_settings
from gpulayer_runtime.settings import ConfigError


async def _no_run(argv: Sequence[str], timeout: float) -> RunResult:
    return RunResult(tuple(argv), None, error="not found")


def ctx(advertise: str | None = None) -> ProbeContext:
    return ProbeContext(
        run=_no_run, timeout=0.2, system="linux", machine="x86_64", advertise_address=advertise
    )


async def test_the_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_module, "route_address", lambda: "10.9.9.9")
    found = await HostProbe().probe(ctx("node-a.cluster"))
    caps = build_capabilities("n1", [found])
    assert caps.host.advertise_address == "node-a.cluster"
    assert caps.advertise_address == "node-a.cluster"


async def test_detected_from_the_default_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_module, "route_address", lambda: "10.9.9.9")
    found = await HostProbe().probe(ctx())
    assert build_capabilities("n1", [found]).host.advertise_address == "10.9.9.9"
    assert not any("advertise" in n for n in found.notes)


@pytest.mark.parametrize("route", [None, "127.0.1.1", "169.254.3.3"])
async def test_loopback_when_nothing_else(
    monkeypatch: pytest.MonkeyPatch, route: str | None
) -> None:
    monkeypatch.setattr(host_module, "route_address", lambda: route)
    found = await HostProbe().probe(ctx())
    assert build_capabilities("n1", [found]).host.advertise_address == "127.0.0.1"
    assert any("advertise address 127.0.0.1" in n for n in found.notes), found.notes


@pytest.mark.parametrize(
    ("value", "expected"), [("", None), ("  ", None), (" 10.0.0.7 ", "10.0.0.7")]
)
def test_the_setting_is_read_in_main(value: str, expected: str | None) -> None:
    _, _, settings = read_settings({"GPULAYER_ADVERTISE_ADDRESS": value})
    assert settings.advertise_address == expected


@pytest.mark.parametrize("bad", ["-host", "a b", "10.0.0.1:29500", "host/x"])
def test_a_bad_setting_stops_the_start_naming_it(bad: str) -> None:
    with pytest.raises(ConfigError) as err:
        read_settings({"GPULAYER_ADVERTISE_ADDRESS": bad})
    assert str(err.value).startswith("GPULAYER_ADVERTISE_ADDRESS: ")
    assert "neither an IP address nor a host name" in str(err.value)

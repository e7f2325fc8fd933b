"""The peer figures' parsing and ratios (bench/peers.py), without Ray: the script's output line
is written here as ``bench/ray_peer.py`` prints it."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from bench.peers import MARK, NAMES, PeerError, parse_peer_output, peer_figures
from bench.report import Figure


def _line(**over: Any) -> str:
    result: dict[str, Any] = {
        "ray_version": "2.60.0",
        "fast_jobs": 5000,
        "fast_seconds": 4.0,  # 1,250 jobs/s
        "paced_offered": 625.0,
        # 100 starts: 1..100 ms; the bench's percentile (harness.percentile): p50 50 ms, p99 100 ms.
        "paced_start_seconds": [i / 1000 for i in range(100, 0, -1)],
        "default_jobs": 50,
        "default_seconds": 12.5,  # 4 jobs/s
    }
    result.update(over)
    return MARK + json.dumps(result)


def _by_name(figs: list[Figure]) -> dict[str, Figure]:
    return {f.name: f for f in figs}


def test_the_mark_line_is_found_among_ray_log_lines() -> None:
    out = "2026-11-30 INFO worker.py -- Started a local Ray instance.\n" + _line() + "\n"
    run = parse_peer_output(out)
    assert run.ray_version == "2.60.0"
    assert run.fast_jobs == 5000
    assert len(run.paced_start_seconds) == 100


def test_figures_and_ratios_against_the_fast_mode() -> None:
    figs = _by_name(peer_figures(parse_peer_output(_line()), 500.0, 200.0))
    assert figs["ray_fast_jobs_per_s"].value == pytest.approx(1250.0)
    assert figs["ray_fast_submit_to_start_p50"].value == pytest.approx(50.0)
    assert figs["ray_fast_submit_to_start_p99"].value == pytest.approx(100.0)
    assert figs["ray_default_jobs_per_s"].value == pytest.approx(4.0)
    assert figs["ray_fast_paced_offered"].value == pytest.approx(625.0)
    # gpulayer over Ray: 500 / 1,250 jobs/s and 200 / 100 ms.
    assert figs["full_loop_over_ray"].value == pytest.approx(0.4)
    assert figs["start_p99_over_ray"].value == pytest.approx(2.0)
    assert "max_calls=0" in figs["ray_fast_jobs_per_s"].note
    assert "max_calls=1" in figs["ray_default_jobs_per_s"].note
    assert {name for name, _ in NAMES} <= set(figs)


def test_ratios_unavailable_without_gpulayer_figures() -> None:
    figs = _by_name(peer_figures(parse_peer_output(_line()), None, None))
    assert figs["full_loop_over_ray"].value is None
    assert figs["start_p99_over_ray"].value is None
    assert figs["full_loop_over_ray"].line().startswith("full_loop_over_ray=unavailable (")
    assert figs["ray_fast_jobs_per_s"].value == pytest.approx(1250.0)


def test_the_last_mark_line_wins() -> None:
    out = _line(fast_seconds=10.0) + "\n" + _line(fast_seconds=2.0)
    assert parse_peer_output(out).fast_seconds == 2.0


@pytest.mark.parametrize(
    ("out", "says"),
    [
        ("Ray crashed\n", "no RAY_PEER line"),
        (MARK + "{not json", "bad RAY_PEER line"),
        (MARK + json.dumps({"ray_version": "2.60.0"}), "bad RAY_PEER line"),
        (_line(fast_jobs="many"), "bad RAY_PEER line"),
        (_line(fast_seconds=0.0), "fast_seconds = 0.0"),
        (_line(default_seconds=-1.0), "default_seconds = -1.0"),
        (_line(paced_offered=math.inf).replace("Infinity", "1e999"), "paced_offered"),
        (_line(paced_start_seconds=[]), "no paced start"),
    ],
)
def test_bad_output_is_refused_naming_what_is_wrong(out: str, says: str) -> None:
    with pytest.raises(PeerError, match=says):
        parse_peer_output(out)

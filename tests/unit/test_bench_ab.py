"""``make bench-ab`` (bench/ab.py), its pure parts: the run order, reading a bench's --help, its
text lines and its --json file, and the medians/ratio table. No bench runs here."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from bench.ab import (
    Reading,
    better,
    compare,
    markdown,
    parse_help,
    parse_json,
    parse_lines,
    plan,
    schedule,
)
from bench.figures import REPO
from bench.report import Figure, Report, dump, judge

# `python -m bench --help` of commit 8d73258 (COLUMNS=10000), as recorded.
BASE_HELP = """\
usage: python -m bench [-h] [--full] [--fast-pg] [--only ONLY] [--profile DIR]

``python -m bench [--full]``: every figure of issue 7, one ``name=value unit`` line each, then a \
summary table with the goals. Quick mode stays under 3 minutes on a 2-core machine.

options:
  -h, --help     show this help message and exit
  --full         the full sizes (make bench FULL=1)
  --fast-pg      PostgreSQL with fsync and synchronous_commit off (default: durable, as in production)
  --only ONLY    comma-separated groups: probe,limits,placement1k,replicas,latency,placement10k,loop,telemetry
  --profile DIR  attach py-spy to placement; raw stacks in DIR
"""

# Lines of a real run's output (make bench at 7001211), with a failed group and the summary.
OUTPUT = """\
.venv/bin/python -m bench
# gpulayer bench (quick): 2 cores, Intel(R) Xeon(R) Processor, Python 3.11.7, commit 7001211
# PostgreSQL: durable defaults
probe_no_torch=27.4 ms
jetstream_raw_publish_pull_ack=5087 msgs/s
placement_1k_nodes=881 jobs/s
# placement1k took 10.9s
full_loop_jobs_per_s=unavailable (BenchError: loop: 12/400 finished)
full_loop_shim_on_over_off=0.93 x
placement_telemetry_off_over_removed=nan x
placement_1k_nodes=900 jobs/s
│ placement_1k_nodes            │   881 │ jobs/s │ >= 2500 jobs/s │ not met │
"""


def test_the_order_alternates_and_swaps_which_side_goes_first_every_other_pair() -> None:
    assert schedule(3) == [
        (0, "base"),
        (0, "head"),
        (1, "head"),
        (1, "base"),
        (2, "base"),
        (2, "head"),
    ]


@pytest.mark.parametrize("pairs", [2, 4, 6])
def test_an_even_count_of_pairs_cancels_a_steady_drift(pairs: int) -> None:
    """On a machine that slows by the same step at every run, both sides' mean position in the
    run order is the same, so neither is favoured."""
    order = schedule(pairs)
    at = {side: [n for n, (_, s) in enumerate(order) if s == side] for side in ("base", "head")}
    assert len(at["base"]) == len(at["head"]) == pairs
    assert sum(at["base"]) == sum(at["head"])


@pytest.mark.parametrize("pairs", [0, -1])
def test_no_pairs_is_an_error(pairs: int) -> None:
    with pytest.raises(ValueError, match="pairs must be at least 1"):
        schedule(pairs)


def test_an_old_bench_help_gives_its_groups_and_options() -> None:
    cli = parse_help(BASE_HELP)
    assert cli.groups == (
        "probe",
        "limits",
        "placement1k",
        "replicas",
        "latency",
        "placement10k",
        "loop",
        "telemetry",
    )
    assert "--full" in cli.options
    assert "--json" not in cli.options
    assert "--no-shim-ab" not in cli.options


def test_this_bench_help_names_its_groups_and_json() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--help"],
        cwd=REPO,
        env={**os.environ, "COLUMNS": "10000"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    cli = parse_help(done.stdout)
    assert {"placement1k", "loop", "telemetry", "gang"} <= set(cli.groups)
    assert {"--json", "--no-shim-ab", "--full"} <= cli.options


def test_a_help_without_groups_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="names no groups"):
        parse_help("usage: python -m bench [-h]\n")


def test_a_side_runs_only_what_its_bench_knows() -> None:
    old = plan(REPO, parse_help(BASE_HELP), ["placement1k", "gang", "loop"], full=True)
    assert old.groups == ("placement1k", "loop")
    assert old.args == ("--full",)
    assert not old.json


def test_text_lines_give_values_units_and_unavailable() -> None:
    got = parse_lines(OUTPUT)
    assert got["probe_no_torch"] == Reading(27.4, "ms")
    assert got["jetstream_raw_publish_pull_ack"] == Reading(5087.0, "msgs/s")
    # The last line of a name wins; the summary table's row is no figure line.
    assert got["placement_1k_nodes"] == Reading(900.0, "jobs/s")
    assert got["full_loop_jobs_per_s"].value is None
    assert got["full_loop_jobs_per_s"].note == "BenchError: loop: 12/400 finished"
    assert got["full_loop_shim_on_over_off"] == Reading(0.93, "x")
    assert got["placement_telemetry_off_over_removed"].value is None
    assert set(got) == {
        "probe_no_torch",
        "jetstream_raw_publish_pull_ack",
        "placement_1k_nodes",
        "full_loop_jobs_per_s",
        "full_loop_shim_on_over_off",
        "placement_telemetry_off_over_removed",
    }


def test_json_gives_exact_values_goals_and_nulls() -> None:
    figs = [
        judge(Figure("placement_1k_nodes", 3053.25, "jobs/s"), ">=", 2500.0),
        judge(Figure("start_p99_over_ray", 1.5, "x"), "<=", 2.0),
        Figure("full_loop_jobs_per_s", None, "jobs/s", note="BenchError: stopped"),
        Figure("a_ratio", math.nan, "x"),
    ]
    got = parse_json(dump(Report("header", figs)))
    assert got["placement_1k_nodes"] == Reading(3053.25, "jobs/s", ">= 2500 jobs/s")
    assert got["start_p99_over_ray"].goal.startswith("<=")
    assert got["full_loop_jobs_per_s"] == Reading(None, "jobs/s", note="BenchError: stopped")
    assert got["a_ratio"].value is None


@pytest.mark.parametrize(
    ("name", "unit", "goal", "want"),
    [
        ("placement_1k_nodes", "jobs/s", "", "higher"),
        ("capability_ingest_10k", "events/s", "", "higher"),
        ("full_loop_submit_to_start_p99", "ms", "", "lower"),
        ("full_loop_cpu_us_per_job_total", "us", "", "lower"),
        ("placement_rss_peak", "MB", "", "lower"),
        ("full_loop_shim_on_over_off", "x", ">= 0.8", "higher"),
        ("executor_output_flood_over_devnull", "x", "<= 2", "lower"),
        ("some_ratio", "x", "", None),
        ("full_loop_paced_offered", "jobs/s", "", None),
    ],
)
def test_which_way_is_better(name: str, unit: str, goal: str, want: str | None) -> None:
    assert better(name, unit, goal) == want


def test_medians_ratio_and_one_sided_figures() -> None:
    base = [
        {"placement_1k_nodes": Reading(3000.0, "jobs/s"), "old_only": Reading(1.0, "ms")},
        {"placement_1k_nodes": Reading(3200.0, "jobs/s"), "old_only": Reading(3.0, "ms")},
        {"placement_1k_nodes": Reading(2000.0, "jobs/s"), "old_only": Reading(2.0, "ms")},
    ]
    head = [
        {"placement_1k_nodes": Reading(1500.0, "jobs/s"), "cpu": Reading(16.0, "ms")},
        {"placement_1k_nodes": Reading(1800.0, "jobs/s"), "cpu": Reading(None, "")},
        {"placement_1k_nodes": Reading(2100.0, "jobs/s"), "cpu": Reading(14.0, "ms")},
    ]
    rows = {r.name: r for r in compare({"base": base, "head": head})}
    assert list(rows) == ["placement_1k_nodes", "cpu", "old_only"]
    p = rows["placement_1k_nodes"]
    assert (p.base_median, p.head_median) == (3000.0, 1800.0)
    assert p.ratio == pytest.approx(0.6)
    assert p.verdict() == "head worse by 40%"
    cpu = rows["cpu"]
    assert cpu.base == []
    assert cpu.head == [16.0, None, 14.0]
    assert cpu.head_median == 15.0
    assert cpu.ratio is None
    assert cpu.verdict() == "head only"
    old = rows["old_only"]
    assert old.head == []
    assert old.base_median == 2.0
    assert old.verdict() == "base only"
    table = markdown(list(rows.values()), "8d732585", "19daf8d")
    assert (
        "| placement_1k_nodes (jobs/s) | higher | 3000 | 1800 | 0.60x | head worse by 40% |"
        in table
    )
    assert "| cpu (ms) | lower | - | 15.0 | - | head only |  | 16.0, -, 14.0 |" in table


def test_lower_is_better_and_a_failed_run_counts_as_missing() -> None:
    base = [{"p99": Reading(20.0, "ms")}, {"p99": Reading(30.0, "ms")}]
    # The second head run's group failed: it printed nothing for p99.
    head = [{"p99": Reading(10.0, "ms")}, {}]
    row = compare({"base": base, "head": head})[0]
    assert row.head == [10.0, None]
    assert row.ratio == pytest.approx(0.4)
    assert row.verdict() == "head better by 60%"


def test_a_figure_unavailable_in_every_run_of_a_side() -> None:
    base = [{"loop": Reading(None, "", note="failed")}]
    head = [{"loop": Reading(100.0, "jobs/s")}]
    row = compare({"base": base, "head": head})[0]
    assert row.unit == "jobs/s"
    assert row.base_median is None
    assert row.verdict() == "no base value"

"""The fault run's checker (pure): from every job's stored events and the markers its runs
wrote, the counts the fault run prints and asserts on.

A run's marker is one file ``<job>.<pid>`` holding ``<job folder>|<devices>|<start>`` and, when
the run ended by itself or by SIGTERM, a line ``<end>`` (Unix seconds) after it (the last
non-empty one: a trap interrupted by a second SIGTERM may have written an empty line first). The job folder
names the node (each executor has its own work folder); the devices are what the job saw in
``GPULAYER_DEVICES``.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "lost", "rejected"})


@dataclass(frozen=True)
class Run:
    """One run of a job, from its marker."""

    job_id: str
    node: str
    devices: tuple[str, ...]
    start: float
    end: float  # +inf: the run never said it ended (killed)


@dataclass
class Counts:
    submitted: int = 0
    accepted: int = 0
    ended: int = 0
    lost: int = 0
    lost_gone_node: int = 0  # lost with a node that went away: counted apart, not a failure
    duplicated: int = 0
    double_booked: int = 0
    wrong_outcome: int = 0
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"submitted={self.submitted} accepted={self.accepted} ended={self.ended} "
            f"lost={self.lost} (node gone: {self.lost_gone_node}) duplicated={self.duplicated} "
            f"double-booked={self.double_booked} wrong-outcome={self.wrong_outcome}"
        )


def parse_marker(name: str, text: str, node_of: dict[str, str]) -> Run:
    """A marker file's run. ``node_of`` maps a work folder prefix to its node's name."""
    job_id = name.rsplit(".", 1)[0]
    lines = text.splitlines()
    folder, devices, start = lines[0].split("|")
    node = next((n for prefix, n in node_of.items() if folder.startswith(prefix)), folder)
    ends = [line for line in lines[1:] if line.strip()]
    end = float(ends[-1]) if ends else math.inf
    return Run(job_id, node, tuple(d for d in devices.split(",") if d), float(start), end)


def read_markers(folder: Path, node_of: dict[str, str]) -> list[Run]:
    return [parse_marker(p.name, p.read_text(), node_of) for p in sorted(folder.iterdir())]


def double_bookings(runs: list[Run]) -> list[tuple[Run, Run]]:
    """Pairs of runs that held the same device of the same node at the same time."""
    by_device: dict[tuple[str, str], list[Run]] = defaultdict(list)
    for run in runs:
        for device in run.devices:
            by_device[(run.node, device)].append(run)
    pairs = []
    for held in by_device.values():
        held.sort(key=lambda r: r.start)
        for before, after in itertools.pairwise(held):
            if after.start < before.end:
                pairs.append((before, after))
    return pairs


def check(
    submitted: set[str],
    expected: dict[str, str],
    events: dict[str, list[str]],
    runs: list[Run],
    gone_nodes: frozenset[str] = frozenset(),
    lost_on: Mapping[str, str] | None = None,
) -> Counts:
    """The counts: every accepted job ended exactly once, as ``expected`` says (its command
    decides: succeeded, failed or cancelled); ``lost`` only for jobs on ``gone_nodes`` (nodes
    gone, or cut off past the node timeout), counted apart from the others: a job whose every
    run was there, or, with no run, whose ``lost`` event named one (``lost_on``: job -> node;
    a grant stopped before it started leaves no marker); no job ran twice; no device held
    twice at once."""
    lost_on = lost_on or {}
    c = Counts(submitted=len(submitted))
    runs_of: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        runs_of[run.job_id].append(run)
    for job in sorted(submitted):
        types = events.get(job, [])
        if "accepted" not in types:
            # Named, with what did arrive: a job can run and end with its announcement lost.
            c.problems.append(f"{job}: no accepted event ({types})")
            continue
        c.accepted += 1
        ends = [t for t in types if t in TERMINAL]
        if ends:
            c.ended += 1
        else:
            c.problems.append(f"{job}: never ended ({types})")
        if len(ends) > 1 or len(runs_of[job]) > 1:
            c.duplicated += 1
            c.problems.append(f"{job}: ended {ends}, ran {len(runs_of[job])} times")
        if "lost" in ends:
            nodes = {r.node for r in runs_of[job]} or {lost_on.get(job, "")}
            if nodes <= gone_nodes:
                c.lost_gone_node += 1
            else:
                c.lost += 1
                c.problems.append(f"{job}: lost ({types})")
        elif ends and ends[0] != expected[job]:
            c.wrong_outcome += 1
            c.problems.append(f"{job}: {ends[0]}, expected {expected[job]}")
    for before, after in double_bookings(runs):
        c.double_booked += 1
        c.problems.append(f"{before.node} {before.devices}: {before.job_id} and {after.job_id}")
    return c


def longest_stall(waits: list[tuple[float, float]], grants: list[float]) -> float:
    """The longest time in which no grant was made while a job waited: ``waits`` are the
    (from, until) each job waited (its submit's ack to its grant, or to its end when it never
    got one), ``grants`` the times grants were made. Between two grants in a row (or before
    the first, after the last), the stall runs from the earliest wait then under way to the
    next grant or the latest end of those waits, whichever came first."""
    best = 0.0
    edges = [-math.inf, *sorted(grants), math.inf]
    for before, after in itertools.pairwise(edges):
        inside = [(max(s, before), min(e, after)) for s, e in waits if s < after and e > before]
        if inside:
            best = max(best, max(e for _, e in inside) - min(s for s, _ in inside))
    return best

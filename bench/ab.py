"""``python -m bench.ab --base REV [--only GROUPS] [--pairs N]`` (``make bench-ab``): a change's
cost, measured. The base commit is checked out in a git worktree of its own under
``.gpulayer/bench-ab/`` with its own venv (``uv sync --locked``; kept and reused), then the chosen
bench groups run alternating base and head (this checkout, as it is): A, B, A, B, ... so drift on
a shared machine hits both alike. Each figure's medians and the head/base ratio are printed.

Each side runs its own ``python -m bench`` with the groups and options it knows (read from its
``--help``): an old base lacks newer groups and figures, which are shown as one side's only.
Figures are read from ``--json`` where the side's bench has it, else from its
``name=value unit`` lines."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
from rich.console import Console
from rich.table import Table

from bench.figures import REPO
from bench.quiet import SETTLED_ENV, settle
from bench.report import fmt, load

Side = Literal["base", "head"]
Better = Literal["higher", "lower"] | None

DEFAULT_GROUPS = "placement1k,loop"
# Options passed to a side's bench when it knows them: the shim on/off runs are an A/B of their
# own (six more full loops) that would only lengthen each run.
QUIET_OPTIONS = ("--no-shim-ab",)


@dataclass(frozen=True)
class Reading:
    value: float | None  # None: unavailable in that run (``note`` says why)
    unit: str
    goal: str = ""
    note: str = ""


@dataclass(frozen=True)
class BenchCli:
    """What one side's ``python -m bench`` accepts."""

    groups: tuple[str, ...]
    options: frozenset[str]


_GROUPS = re.compile(r"groups:\s*([a-z0-9_]+(?:,[a-z0-9_]+)*)")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_LINE = re.compile(r"([a-z][a-z0-9_]*)=(\S+)(?: (.*))?")


def parse_help(text: str) -> BenchCli:
    """Groups and options from a bench's ``--help`` (printed unwrapped: ``COLUMNS`` large)."""
    found = _GROUPS.search(text)
    if found is None:
        raise ValueError("the bench's --help names no groups (expected 'groups: a,b,...')")
    return BenchCli(tuple(found.group(1).split(",")), frozenset(_OPTION.findall(text)))


def parse_lines(text: str) -> dict[str, Reading]:
    """The ``name=value unit`` and ``name=unavailable (why)`` lines of a bench's output; the
    last of a name wins. Comment lines and the summary table don't match."""
    out: dict[str, Reading] = {}
    for line in text.splitlines():
        m = _LINE.fullmatch(line.strip())
        if m is None:
            continue
        name, raw, rest = m.group(1), m.group(2), m.group(3) or ""
        if raw == "unavailable":
            out[name] = Reading(None, "", note=rest.strip().removeprefix("(").removesuffix(")"))
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        out[name] = Reading(value if math.isfinite(value) else None, rest.strip())
    return out


def parse_json(data: bytes) -> dict[str, Reading]:
    """A bench's ``--json`` file."""
    return {
        f.name: Reading(f.value, f.unit, f.goal, f.note)
        for f in load(data).figures
        if f.value is None or math.isfinite(f.value)
    }


def schedule(pairs: int) -> list[tuple[int, Side]]:
    """Run order: ``pairs`` pairs, the sides' order swapped every other pair (A, B, B, A, A,
    B, ...). The machine's speed drifts within a run of pairs (a 7-pair run's base went from
    207 to 135 jobs/s); with base always first, each head run came later than its base in
    every pair, and a slowing machine read as head's cost. Swapped, an even count of pairs
    cancels a steady drift."""
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    sides: tuple[Side, Side] = ("base", "head")
    return [(i, side) for i in range(pairs) for side in (sides if i % 2 == 0 else sides[::-1])]


def better(name: str, unit: str, goal: str = "") -> Better:
    """Which way is better for a figure: rates higher; times, CPU and memory lower; a ratio
    as its goal says. None where neither is (an offered rate is the bench's input)."""
    if "offered" in name:
        return None
    if goal.startswith(">="):
        return "higher"
    if goal.startswith("<="):
        return "lower"
    if unit.endswith("/s"):
        return "higher"
    if unit in {"ms", "us", "s", "MB"}:
        return "lower"
    return None


@dataclass
class Row:
    name: str
    unit: str
    better: Better
    base: list[float | None] = field(default_factory=list)
    head: list[float | None] = field(default_factory=list)

    @staticmethod
    def _median(values: list[float | None]) -> float | None:
        have = [v for v in values if v is not None]
        return statistics.median(have) if have else None

    @property
    def base_median(self) -> float | None:
        return self._median(self.base)

    @property
    def head_median(self) -> float | None:
        return self._median(self.head)

    @property
    def ratio(self) -> float | None:
        b, h = self.base_median, self.head_median
        if b is None or h is None or b == 0:
            return None
        return h / b

    def verdict(self) -> str:
        """``head better``/``head worse`` by how much, or which side lacks the figure."""
        if not self.base:
            return "head only"
        if not self.head:
            return "base only"
        b, h, r = self.base_median, self.head_median, self.ratio
        if b is None or h is None:
            return "no base value" if b is None else "no head value"
        if r is None or self.better is None:
            return ""
        change = r - 1.0
        if abs(change) < 0.01:
            return "same"
        good = (change > 0) == (self.better == "higher")
        return f"head {'better' if good else 'worse'} by {abs(change):.0%}"


def compare(runs: Mapping[Side, Sequence[Mapping[str, Reading]]]) -> list[Row]:
    """One row per figure either side printed, head's order first. A side that never printed a
    figure has no values for it (an older base: not a crash); a run of a side that printed it
    elsewhere but not there (its group failed) counts as None."""
    rows: dict[str, Row] = {}
    sides: tuple[Side, Side] = ("head", "base")
    for side in sides:
        for reading in runs.get(side, ()):
            for name, r in reading.items():
                row = rows.get(name)
                if row is None:
                    rows[name] = row = Row(name, r.unit, better(name, r.unit, r.goal))
                if r.unit and not row.unit:
                    row.unit = r.unit
                if r.goal and row.better is None:
                    row.better = better(name, row.unit, r.goal)
    for side in reversed(sides):
        seen = {name for reading in runs.get(side, ()) for name in reading}
        for reading in runs.get(side, ()):
            for name in seen:
                got = reading.get(name)
                getattr(rows[name], side).append(None if got is None else got.value)
    return list(rows.values())


def _cell(v: float | None) -> str:
    return "-" if v is None else fmt(v)


def _runs(values: list[float | None]) -> str:
    return ", ".join(_cell(v) for v in values)


def table(rows: Sequence[Row], base: str, head: str) -> Table:
    t = Table(title=f"bench A/B: head {head} against base {base} (medians of the runs)")
    for col, justify in (
        ("figure", "left"),
        ("unit", "left"),
        ("better", "left"),
        (f"base {base}", "right"),
        (f"head {head}", "right"),
        ("head/base", "right"),
        ("", "left"),
        ("base runs", "left"),
        ("head runs", "left"),
    ):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        t.add_row(
            r.name,
            r.unit,
            r.better or "-",
            _cell(r.base_median),
            _cell(r.head_median),
            ratio,
            r.verdict(),
            _runs(r.base),
            _runs(r.head),
        )
    return t


def markdown(rows: Sequence[Row], base: str, head: str) -> str:
    """The same table for a closing note."""
    lines = [
        f"| figure | better | base {base} | head {head} | head/base | | base runs | head runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        name = f"{r.name} ({r.unit})" if r.unit else r.name
        lines.append(
            f"| {name} | {r.better or '-'} | {_cell(r.base_median)} | {_cell(r.head_median)} "
            f"| {ratio} | {r.verdict()} | {_runs(r.base)} | {_runs(r.head)} |"
        )
    return "\n".join(lines) + "\n"


# ---- the runs (I/O) ----


def _git(*args: str, cwd: Path = REPO) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode:
        raise SystemExit(f"bench-ab: git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def _clean_env() -> dict[str, str]:
    """The environment for a side's processes: no PYTHONPATH or VIRTUAL_ENV from this one, so
    each side runs its own code from its own venv."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV"}}
    env["PYTHONUNBUFFERED"] = "1"
    env[SETTLED_ENV] = "1"  # settled before each run here (main)
    env.setdefault("UV_PYTHON_DOWNLOADS", "never")
    return env


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One build of a base at a time (two checkouts asking for the same commit)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_base(rev: str, where: Path) -> Path:
    """The base commit's checkout with its own venv, made once and reused."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    checkout = where / sha[:12]
    ready = checkout / ".venv" / ".bench-ab-ready"
    with _locked(where / f"{sha[:12]}.lock"):
        if ready.exists():
            print(f"# base {sha[:12]}: reusing {checkout}", flush=True)
            return checkout
        if not (checkout / ".git").exists():
            _git("worktree", "prune")  # a checkout removed by hand (make clean) is still listed
            _git("worktree", "add", "--detach", str(checkout), sha)
        uv = shlex.split(os.environ.get("UV") or "uv")
        python = os.environ.get("PYTHON") or "python3"
        cmd = [*uv, "sync", "--locked", "--all-groups", "--python", python]
        print(f"# base {sha[:12]}: {' '.join(cmd)} in {checkout}", flush=True)
        done = subprocess.run(cmd, cwd=checkout, env=_clean_env(), check=False, timeout=1800)
        if done.returncode:
            raise SystemExit(f"bench-ab: uv sync in {checkout} failed (exit {done.returncode})")
        ready.touch()
    return checkout


def bench_cli(checkout: Path) -> BenchCli:
    env = {**_clean_env(), "COLUMNS": "10000"}
    done = subprocess.run(
        [str(checkout / ".venv" / "bin" / "python"), "-m", "bench", "--help"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"bench-ab: python -m bench --help in {checkout}: {done.stderr[-2000:]}")
    try:
        return parse_help(done.stdout)
    except ValueError as err:
        raise SystemExit(f"bench-ab: {checkout}: {err}") from err


@dataclass(frozen=True)
class Plan:
    checkout: Path
    groups: tuple[str, ...]
    args: tuple[str, ...]  # options beyond --only and --json
    json: bool


def plan(checkout: Path, cli: BenchCli, wanted: Sequence[str], full: bool) -> Plan:
    """The groups of ``wanted`` this side's bench knows, and the options it takes."""
    args = tuple(o for o in QUIET_OPTIONS if o in cli.options)
    if full and "--full" in cli.options:
        args += ("--full",)
    groups = tuple(g for g in wanted if g in cli.groups)
    return Plan(checkout, groups, args, "--json" in cli.options)


def run_once(p: Plan, label: str, log: Path) -> tuple[dict[str, Reading], int]:
    """One ``python -m bench`` of a side; its figure lines echoed as they come."""
    out = log.with_suffix(".json")
    out.unlink(missing_ok=True)
    cmd = [str(p.checkout / ".venv" / "bin" / "python"), "-m", "bench", "--only"]
    cmd += [",".join(p.groups), *p.args, *(["--json", str(out)] if p.json else [])]
    with log.open("w") as f, subprocess.Popen(
        cmd, cwd=p.checkout, env=_clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                f.write(line)
                if _LINE.fullmatch(line.strip()) or line.startswith("# "):
                    print(f"[{label}] {line.rstrip()}", flush=True)
        except BaseException:
            # Ctrl-C or a kill of this one: the bench stops its servers on SIGINT; kill it only
            # when it doesn't.
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    text = log.read_text()
    if out.exists():
        try:
            return parse_json(out.read_bytes()), proc.returncode
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            print(f"[{label}] {out}: {err}; reading its text lines instead", flush=True)
    return parse_lines(text), proc.returncode


def _head_label() -> str:
    head = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain")
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    p.add_argument("--base", required=True, help="the base commit (any git revision)")
    p.add_argument(
        "--only",
        default=DEFAULT_GROUPS,
        help=f"comma-separated bench groups (default {DEFAULT_GROUPS}); see python -m bench --help",
    )
    p.add_argument("--pairs", type=int, default=3, help="base/head pairs to run (default 3)")
    p.add_argument("--full", action="store_true", help="the bench's full sizes on both sides")
    p.add_argument(
        "--dir",
        type=Path,
        default=REPO / ".gpulayer" / "bench-ab",
        help="where base checkouts and run logs go (default .gpulayer/bench-ab)",
    )
    args = p.parse_args(argv)
    if args.pairs < 3:
        print(f"# {args.pairs} pair(s): fewer than 3 gives a median of little worth", flush=True)
    try:
        order = schedule(args.pairs)
    except ValueError as err:
        p.error(str(err))
    wanted = [g for g in args.only.split(",") if g]
    head_cli = bench_cli(REPO)
    unknown = [g for g in wanted if g not in head_cli.groups]
    if not wanted or unknown:
        p.error(f"--only {args.only!r}: unknown group(s) {unknown}; known: {head_cli.groups}")
    if "peers" in wanted:
        p.error("--only peers: the Ray peer installs Ray and runs once; not for an A/B")
    where = args.dir.resolve()
    base_checkout = build_base(args.base, where)
    plans: dict[Side, Plan] = {
        "base": plan(base_checkout, bench_cli(base_checkout), wanted, args.full),
        "head": plan(REPO, head_cli, wanted, args.full),
    }
    missing = [g for g in wanted if g not in plans["base"].groups]
    if missing:
        print(f"# base has no group {','.join(missing)}: those figures are head's only", flush=True)
    base_label = _git("rev-parse", "--short", "HEAD", cwd=base_checkout)
    head_label = _head_label()
    logs = where / "runs" / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{base_label}"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"# logs: {logs}", flush=True)
    runs: dict[Side, list[dict[str, Reading]]] = {"base": [], "head": []}
    failed = ""
    started = time.monotonic()
    for i, side in order:
        pl = plans[side]
        if not pl.groups:
            continue
        label = f"{side} {i + 1}/{args.pairs}"
        settle()  # the run before's removal of its folders written back (bench/quiet.py)
        print(f"# {label}: {' '.join(pl.groups)} ({time.monotonic() - started:.0f}s)", flush=True)
        readings, rc = run_once(pl, label, logs / f"{side}-{i + 1}.log")
        runs[side].append(readings)
        if rc:
            tail = "".join((logs / f"{side}-{i + 1}.log").read_text().splitlines(True)[-30:])
            failed = f"{label} exited {rc}; the end of its output:\n{tail}"
            break
    rows = compare(runs)
    Console(width=200).print(table(rows, base_label, head_label))
    md = markdown(rows, base_label, head_label)
    (logs / "ab.md").write_text(md)
    done = sum(len(v) for v in runs.values())
    print(f"# {done} runs in {time.monotonic() - started:.0f}s; table in {logs / 'ab.md'}")
    if failed:
        print(f"bench-ab: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

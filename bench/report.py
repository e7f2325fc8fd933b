"""Figures, their goals, the ``name=value unit`` lines and the summary table."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from rich.console import Console
from rich.table import Table


@dataclass
class Figure:
    name: str
    value: float | None
    unit: str
    note: str = ""  # why it is unavailable, or what limits it
    goal: str = ""
    met: bool | None = None

    def line(self) -> str:
        if self.value is None:
            return f"{self.name}=unavailable ({self.note})"
        return f"{self.name}={fmt(self.value)} {self.unit}".rstrip()


@dataclass
class Report:
    """``python -m bench --json FILE``: the header line and every figure, as the run ended
    (goals judged). A value that isn't finite is written as null."""

    header: str
    figures: list[Figure]


def dump(report: Report) -> bytes:
    return msgspec.json.encode(report)


def load(data: bytes) -> Report:
    """A ``--json`` file; a clear ``msgspec.ValidationError``/``DecodeError`` when it isn't."""
    return msgspec.json.decode(data, type=Report)


def fmt(v: float) -> str:
    if v == 0 or abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}" if abs(v) >= 0.01 else f"{v:.2g}"


_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le}


def judge(fig: Figure, op: str, target: float, text: str | None = None) -> Figure:
    """Attach a goal ("op target unit") and whether this run met it. Never raises."""
    fig.goal = text or f"{op} {fmt(target)} {fig.unit}"
    fig.met = None if fig.value is None else _OPS[op](fig.value, target)
    return fig


def unavailable(name: str, unit: str, reason: str) -> Figure:
    return Figure(name, None, unit, note=" ".join(reason.split())[:300])


def table(figures: list[Figure], title: str) -> Table:
    t = Table(title=title)
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("unit")
    t.add_column("goal")
    t.add_column("met")
    for f in figures:
        value = "unavailable" if f.value is None else fmt(f.value)
        if f.met is None:
            met = "-" if not f.goal else "n/a"
        else:
            met = "[green]met[/green]" if f.met else "[red]not met[/red]"
        t.add_row(f.name, value, f.unit, f.goal, met)
    return t


def print_summary(figures: list[Figure], title: str) -> None:
    Console(width=140).print(table(figures, title))

"""Human-readable output for events, nodes and jobs."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from gpulayer_contracts import (
    Accepted,
    Cancelled,
    Failed,
    JobEvent,
    Lost,
    Pending,
    Placed,
    Rejected,
    Running,
    Succeeded,
)

_STYLE = {
    "accepted": "cyan",
    "rejected": "bold red",
    "pending": "yellow",
    "placed": "blue",
    "running": "magenta",
    "succeeded": "bold green",
    "failed": "bold red",
    "cancelled": "red",
    "lost": "bold red",
}


def event_tag(event: JobEvent) -> str:
    return str(type(event).__struct_config__.tag)


def describe_event(event: JobEvent) -> str:
    match event:
        case Accepted(warnings=warnings):
            return "accepted" + "".join(f"\n    warning: {w}" for w in warnings)
        case Rejected(reasons=reasons):
            return "rejected" + "".join(f"\n    {r}" for r in reasons)
        case Pending(summary=summary, reasons=reasons, unsatisfiable=unsat):
            head = "pending (unsatisfiable)" if unsat else "pending"
            return f"{head}: {summary}"
        case Placed(node_id=node, accelerator=acc, devices=devices):
            on = f" devices {','.join(map(str, devices))}" if devices else ""
            return f"placed on {node} ({acc}{on})"
        case Running(node_id=node, pid=pid):
            return f"running on {node} (pid {pid})"
        case Succeeded(node_id=node, exit_code=code):
            return f"succeeded on {node} (exit {code})"
        case Failed(node_id=node, exit_code=code, signal=sig, reason=reason):
            why = reason or (f"signal {sig}" if sig else f"exit {code}")
            return f"failed on {node}: {why}"
        case Cancelled(reason=reason):
            return f"cancelled: {reason}"
        case Lost(node_id=node, reason=reason):
            return f"lost on {node}: {reason}"
    return event_tag(event)


def print_event(console: Console, event: JobEvent) -> None:
    tag = event_tag(event)
    ts = event.at.strftime("%H:%M:%S.%f")[:-3]
    console.print(
        f"[dim]{ts}[/dim] [bold]{event.job_id}[/bold] [{_STYLE.get(tag, 'white')}]{describe_event(event)}[/]",
        highlight=False,
    )


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.0f} GiB"


def nodes_table(nodes: list[dict[str, Any]]) -> Table:
    t = Table(title="nodes")
    for col in (
        "node",
        "platform",
        "accelerators",
        "host APIs",
        "container APIs",
        "state",
        "last seen",
    ):
        t.add_column(col)
    for n in nodes:
        caps = n["capabilities"]
        devs = caps.get("accelerators", [])
        parts = []
        for d in devs:
            mem = d.get("memory_mib")
            mem_s = (
                "memory unknown"
                if mem is None
                else f"{mem} MiB {d.get('memory_kind') or ''}".strip()
            )
            usable = "" if d.get("execution_supported") else " (detection only)"
            parts.append(f"{d['accelerator']}:{d['index']} {d.get('name') or '?'} {mem_s}{usable}")
        t.add_row(
            n["node_id"],
            caps.get("host", {}).get("platform") or "?",
            "\n".join(parts) or "cpu only",
            ", ".join(caps.get("gpu_apis", {}).get("host", [])) or "-",
            ", ".join(caps.get("gpu_apis", {}).get("containers", [])) or "-",
            "online" if n["online"] else "offline",
            str(n["last_seen"])[:19],
        )
    return t


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    t = Table(title="jobs")
    for col in ("job", "state", "node", "devices", "exit", "submitted", "reason"):
        t.add_column(col)
    for j in jobs:
        t.add_row(
            j["job_id"],
            j["state"],
            j.get("node_id") or "-",
            ",".join(map(str, j.get("devices") or [])) or "-",
            "-" if j.get("exit_code") is None else str(j["exit_code"]),
            str(j["submitted_at"])[:19],
            (j.get("reason") or "")[:80],
        )
    return t


def matrix_table(matrix: dict[str, dict[str, str]]) -> Table:
    t = Table(title="support matrix")
    t.add_column("accelerator")
    t.add_column("independent")
    t.add_column("distributed")
    for acc, modes in matrix.items():
        t.add_row(acc, modes["independent"], modes["distributed"])
    return t

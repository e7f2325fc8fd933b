"""``gpulayer doctor NODE`` and ``gpulayer nodes --devices``: a node's health and its devices.

The doctor asks the node's probe to detect again now (after a driver install, say) on
``gpulayer.node.<node>.doctor`` and prints what changed since the detection before, the node's
health (healthy, degraded, unhealthy, or undetected where GPU device files exist but no GPU API
answers) and each device's latest observation.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from gpulayer_contracts.codec import doctor_decoder
from gpulayer_contracts.health import DoctorReport
from gpulayer_contracts.subjects import node_doctor

_HEALTH_STYLE = {
    "healthy": "green",
    "degraded": "yellow",
    "unhealthy": "bold red",
    "undetected": "dim",
}


def _num(value: object, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}{unit}"
    return f"{value}{unit}"


def devices_table(node: str, devices: list[dict[str, Any]], held: dict[str, str]) -> Table:
    """One row per observed device: health (and why), load, memory, temperature, power, ECC."""
    t = Table(title=f"{node}: devices", title_justify="left")
    for col in ("GPU", "health", "util", "memory used", "temp", "power", "ECC uncorr.", "why"):
        t.add_column(col, no_wrap=col in ("GPU", "health"))
    for d in devices:
        health = str(d.get("health", "healthy"))
        if d.get("state") not in (None, "ok"):
            health += f" ({d['state']})"
        ecc = (
            f"{_num(d.get('ecc_uncorrected_volatile'))}/{_num(d.get('ecc_uncorrected_aggregate'))}"
        )
        why = d.get("reason") or held.get(str(d.get("index"))) or ""
        t.add_row(
            str(d.get("index")),
            f"[{_HEALTH_STYLE.get(str(d.get('health')), 'white')}]{health}[/]",
            _num(d.get("utilization_pct"), "%"),
            f"{_num(d.get('memory_used_mib'))} MiB"
            if d.get("memory_used_mib") is not None
            else "-",
            _num(d.get("temperature_c"), "C"),
            _num(d.get("power_w"), " W"),
            ecc,
            str(why),
        )
    return t


def render_node_devices(console: Console, nodes: list[dict[str, Any]]) -> None:
    """``gpulayer nodes --devices``: per node, its health and the devices table."""
    for node in nodes:
        health = node.get("health")
        if not health:
            console.print(f"[bold]{node['node_id']}[/]: no observations yet")
            continue
        state = str(health["health"])
        console.print(
            f"[bold]{node['node_id']}[/]: [{_HEALTH_STYLE.get(state, 'white')}]{state}[/]"
            f" (observed {str(health.get('observed_at', ''))[:19]})"
        )
        if health["devices"]:
            console.print(devices_table(node["node_id"], health["devices"], health["held_back"]))
        for note in health.get("notes") or []:
            console.print(f"  note: {note}")


def render_report(console: Console, report: DoctorReport) -> None:
    state = report.health
    console.print(
        f"[bold]{report.node_id}[/]: [{_HEALTH_STYLE.get(state, 'white')}]{state}[/]"
        + (" (GPU device files exist, but no GPU API answers)" if state == "undetected" else "")
    )
    if report.changes:
        console.print("changed since the detection before:")
        for change in report.changes:
            console.print(f"  - {change}")
    else:
        console.print("nothing changed since the detection before")
    if report.capabilities is not None:
        n = len(report.capabilities.accelerators)
        console.print(
            f"{n} device(s) detected; API(s): {', '.join(report.capabilities.gpu_apis.host) or 'none'}"
        )
        from gpulayer_cli.render import container_runtime_text

        runtime = report.capabilities.container_runtime
        console.print(
            f"containers: {container_runtime_text(msgspec.to_builtins(report.capabilities))}"
        )
        for note in runtime.notes if runtime is not None else []:
            console.print(f"  container note: {note}")
    if report.devices:
        console.print(devices_table(report.node_id, msgspec.to_builtins(report.devices), {}))
    for note in report.notes:
        console.print(f"  note: {note}")


async def ask_doctor(nc: Any, node: str, timeout: float) -> DoctorReport:
    """The node's probe re-detects and replies. Raises TimeoutError / NoRespondersError."""
    reply = await nc.request(node_doctor(node), b"", timeout=timeout)
    report = doctor_decoder.decode(reply.data)
    if not report.node_id:
        report = msgspec.structs.replace(report, node_id=node)
    return report


def print_report(console: Console, report: DoctorReport, as_json: bool) -> int:
    """Exit status: 0 healthy or undetected (not an alert), 1 degraded or unhealthy."""
    if as_json:
        print(json.dumps(msgspec.to_builtins(report), indent=2))
    else:
        render_report(console, report)
    return 0 if report.health in ("healthy", "undetected") else 1

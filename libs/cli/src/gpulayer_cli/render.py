"""Human-readable output for events, nodes and jobs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
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
    Requeued,
    Running,
    Succeeded,
    Warned,
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
    "requeued": "yellow",
    "warning": "bold yellow",
}


def event_tag(event: JobEvent) -> str:
    return str(type(event).__struct_config__.tag)


def describe_event(event: JobEvent) -> str:
    match event:
        case Accepted(warnings=warnings, profile=profile):
            return f"accepted{_profile(profile)}" + "".join(f"\n    warning: {w}" for w in warnings)
        case Rejected(reasons=reasons, profile=profile):
            return f"rejected{_profile(profile)}" + "".join(f"\n    {r}" for r in reasons)
        case Pending(summary=summary, reasons=reasons, unsatisfiable=unsat):
            head = "pending (unsatisfiable)" if unsat else "pending"
            return f"{head}: {summary}"
        case Placed(accelerator=acc, profile=profile, ranks=ranks) if ranks:
            # A distributed job: every rank's node and devices.
            each = ", ".join(
                f"rank {r.rank} on {r.node_id}"
                + (f" (devices {','.join(map(str, r.devices))})" if r.devices else "")
                for r in ranks
            )
            return f"placed on {len(ranks)} nodes ({acc}): {each}{_profile(profile)}"
        case Placed(node_id=node, accelerator=acc, devices=devices, profile=profile):
            on = f" devices {','.join(map(str, devices))}" if devices else ""
            return f"placed on {node} ({acc}{on}){_profile(profile)}"
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
        case Requeued(reason=reason):
            return f"waits again: {reason}"
        case Warned(node_id=node, reason=reason):
            return f"warning on {node}: {reason}"
    return event_tag(event)


def ranks_table(ranks: list[dict[str, Any]]) -> Table:
    """A distributed job's ranks (``gpulayer job``): rank, its job id, node, devices, state,
    exit code, reason."""
    t = Table(title="ranks")
    t.add_column("rank", justify="right", no_wrap=True)
    _id_column(t, "job", [r["job_id"] for r in ranks])
    t.add_column("node", no_wrap=True)
    t.add_column("devices", no_wrap=True)
    t.add_column("state", no_wrap=True)
    t.add_column("exit", no_wrap=True)
    t.add_column("reason")
    for r in ranks:
        t.add_row(
            str(r["rank"]),
            r["job_id"],
            r.get("node_id") or "-",
            ",".join(map(str, r.get("devices") or [])) or "-",
            r["state"],
            "-" if r.get("exit_code") is None else str(r["exit_code"]),
            _shorten(r.get("reason") or "", 160),
        )
    return t


def _profile(ref: str | None) -> str:
    return f" (profile {ref})" if ref else ""


def print_event(console: Console, event: JobEvent) -> None:
    tag = event_tag(event)
    ts = event.at.strftime("%H:%M:%S.%f")[:-3]
    console.print(
        f"[dim]{ts}[/dim] [bold]{event.job_id}[/bold] [{_STYLE.get(tag, 'white')}]{describe_event(event)}[/]",
        highlight=False,
    )


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.0f} GiB"


def ago(iso: str | None, now: datetime | None = None) -> str:
    """``"12s ago"``, ``"5m ago"``, ``"3h ago"``, ``"2d ago"`` for an ISO timestamp."""
    if not iso:
        return "-"
    try:
        then = datetime.fromisoformat(str(iso))
    except ValueError:
        return str(iso)
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    secs = max(((now or datetime.now(UTC)) - then).total_seconds(), 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{int(secs // size)}{unit} ago"
    return f"{int(secs)}s ago"


def _shorten(text: str, limit: int) -> str:
    """At most ``limit`` characters, cut at a word and marked with an ellipsis."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " …"


def _id_column(t: Table, title: str, values: list[str]) -> None:
    """Identifiers are never cut or wrapped (people copy them into the next command); the
    free-text columns wrap instead."""
    width = max([len(title), *(len(v) for v in values)])
    t.add_column(title, no_wrap=True, min_width=width)


def _node_state(node: dict[str, Any]) -> str:
    if not node["online"]:
        return "offline"
    if node.get("executor") == "down":
        return "online, executor down"
    return "online"


def _index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 3, 5]`` → ``"0-3,5"``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def device_groups(devices: list[dict[str, Any]]) -> list[str]:
    """One line per group of identical devices: ``cuda:0-7 NVIDIA H100 80GB HBM3, 85.5 GB,
    cc 9.0``. Memory in GB of 10^9 bytes, the unit of ``gpu_memory_gb``."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for d in devices:
        key = (
            d.get("accelerator"),
            d.get("name") or "?",
            d.get("memory_mib"),
            d.get("memory_kind"),
            d.get("compute_capability"),
            bool(d.get("execution_supported")),
        )
        groups.setdefault(key, []).append(int(d.get("index", 0)))
    lines = []
    for (acc, name, mib, kind, cc, usable), indices in groups.items():
        memory = "memory unknown" if mib is None else f"{mib * 2**20 / 1e9:.1f} GB"
        if kind == "unified":
            memory += " unified"
        facts = [memory] + ([f"cc {cc}"] if cc else [])
        if not usable:
            facts.append("detection only")
        lines.append(f"{acc}:{_index_ranges(indices)} {name}, {', '.join(facts)}")
    return lines


def container_runtime_label(caps: dict[str, Any]) -> str:
    """A node's container runtime: ``podman 4.3.1/runc``, ``... (self-test failed)``, or
    ``none`` when its probe reports none (the CLI's column and the fleet page's)."""
    rt = caps.get("container_runtime")
    if not isinstance(rt, dict):
        return "none"
    text = " ".join(str(rt[k]) for k in ("name", "version") if rt.get(k))
    if rt.get("oci_runtime"):
        text += f"/{rt['oci_runtime']}"
    if rt.get("machine_provider"):
        text += f" (machine: {rt['machine_provider']})"
    return text if rt.get("works") else f"{text} (self-test failed)"


def platform_label(caps: dict[str, Any]) -> str:
    """A node's platform, with ``(WSL2)`` where its probe runs in WSL2 (the CLI's column and
    the fleet page's)."""
    host = caps.get("host") or {}
    platform = str(host.get("platform") or "?")
    return f"{platform} (WSL2)" if host.get("wsl2") else platform


def container_runtime_text(caps: dict[str, Any]) -> str:
    """``container_runtime_label`` in one cell, with the node's CDI devices counted."""
    text = container_runtime_label(caps)
    rt = caps.get("container_runtime")
    if not isinstance(rt, dict):
        return text
    cdi = rt.get("cdi_devices") or []
    if cdi:
        text += f", {len(cdi)} CDI device{'s' if len(cdi) != 1 else ''}"
    return text


def nodes_table(nodes: list[dict[str, Any]]) -> Table:
    t = Table(title="nodes")
    _id_column(t, "node", [n["node_id"] for n in nodes])
    _id_column(t, "platform", [platform_label(n["capabilities"]) for n in nodes])
    t.add_column("accelerators", min_width=20)
    for col in ("host APIs", "container APIs", "containers"):
        t.add_column(col)
    for col in ("cores", "RAM GB", "slots"):
        t.add_column(col, no_wrap=True, justify="right")
    t.add_column("enforcement")
    t.add_column("state", min_width=8)
    t.add_column("last seen", no_wrap=True)
    for n in nodes:
        caps = n["capabilities"]
        res = n.get("resources") or {}
        t.add_row(
            n["node_id"],
            platform_label(caps),
            "\n".join(device_groups(caps.get("accelerators", []))) or "cpu only",
            ", ".join(caps.get("gpu_apis", {}).get("host", [])) or "-",
            ", ".join(caps.get("gpu_apis", {}).get("containers", [])) or "-",
            container_runtime_text(caps),
            in_use(res.get("cores_used"), res.get("cores")),
            in_use(res.get("memory_gb_used"), res.get("memory_gb")),
            in_use(res.get("slots_used"), res.get("slots")),
            res.get("enforcement") or "?",
            _node_state(n),
            ago(n.get("last_seen")),
        )
    return t


def in_use(used: float | None, total: float | None) -> str:
    """``used/total`` (``3/8``, ``12.5/64``); ``?`` for a total the node hasn't said."""
    if used is None:
        return "-"
    shown = f"{math.floor(used * 10) / 10:g}" if used else "0"
    return f"{shown}/{'?' if total is None else f'{math.floor(total * 10) / 10:g}'}"


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    t = Table(title="jobs")
    _id_column(t, "job", [j["job_id"] for j in jobs])
    t.add_column("state", no_wrap=True)
    _id_column(t, "node", [j.get("node_id") or "-" for j in jobs])
    devices = [",".join(map(str, j.get("devices") or [])) or "-" for j in jobs]
    _id_column(t, "devices", devices)
    exits = ["-" if j.get("exit_code") is None else str(j["exit_code"]) for j in jobs]
    _id_column(t, "exit", exits)
    t.add_column("submitted", no_wrap=True)
    # Queue policy: priority, and the owner's recent GPU-seconds (fair share: least goes first).
    t.add_column("prio", justify="right", no_wrap=True)
    t.add_column("owner (GPU-s)", no_wrap=True)
    t.add_column("reason")
    for j, devs, code in zip(jobs, devices, exits, strict=True):
        usage = j.get("owner_usage_gpu_s")
        t.add_row(
            j["job_id"],
            j["state"],
            j.get("node_id") or ("(distributed)" if j.get("is_gang") else "-"),
            devs,
            code,
            ago(j.get("submitted_at")),
            str(j.get("priority") or 0),
            f"{j.get('owner') or '-'} ({usage:g})" if usage is not None else j.get("owner") or "-",
            _shorten(j.get("reason") or "", 160),
        )
    return t


def fold_arrays(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs of each array (``array_id`` set) folded into one line where the first of them
    stands: ``<array> [n jobs]``, its state the count per state (``running 2, succeeded 18``),
    its node the one they share or how many. Other jobs unchanged."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        if j.get("array_id"):
            groups.setdefault(j["array_id"], []).append(j)
    out: list[dict[str, Any]] = []
    for j in jobs:
        array = j.get("array_id")
        if not array:
            out.append(j)
            continue
        members = groups.pop(array, None)
        if members is None:
            continue  # folded where the first of its jobs stood
        states: dict[str, int] = {}
        for m in members:
            states[m["state"]] = states.get(m["state"], 0) + 1
        nodes = {m.get("node_id") for m in members if m.get("node_id")}
        out.append(
            {
                "job_id": f"{array} [{len(members)} jobs]",
                "state": ", ".join(f"{k} {v}" for k, v in sorted(states.items())),
                "node_id": next(iter(nodes)) if len(nodes) == 1 else f"{len(nodes)} nodes",
                "submitted_at": min(str(m.get("submitted_at") or "") for m in members) or None,
                "reason": "",
            }
        )
    return out


def services_table(services: list[dict[str, Any]]) -> Table:
    t = Table(title="services")
    _id_column(t, "service", [s["job_id"] for s in services])
    t.add_column("state", no_wrap=True)
    _id_column(t, "node", [s.get("node_id") or "-" for s in services])
    t.add_column("restarts", no_wrap=True, justify="right")
    t.add_column("policy", no_wrap=True)
    t.add_column("submitted", no_wrap=True)
    t.add_column("reason")
    for s in services:
        restart = s.get("restart") or {}
        t.add_row(
            s["job_id"],
            s["state"],
            s.get("node_id") or "-",
            str(s.get("restarts", 0)),
            restart.get("policy", "always"),
            ago(s.get("submitted_at")),
            _shorten(s.get("reason") or "", 160),
        )
    return t


def quotas_table(rows: list[dict[str, Any]]) -> Table:
    """``gpulayer quota list``: one row per owner and resource, with what it holds now."""
    t = Table(title="quotas")
    t.add_column("owner")
    t.add_column("resource")
    t.add_column("held / max", justify="right")
    for r in rows:
        resource, held, most = r["resource"], r["used"], r["max"]
        if resource == "cores":
            held, most = f"{held / 1000:g}", f"{most / 1000:g}"
        t.add_row(r["owner"], resource, f"{held} / {most}")
    return t


def matrix_table(matrix: Mapping[Any, Mapping[Any, str]]) -> Table:
    t = Table(title="support matrix")
    t.add_column("accelerator")
    t.add_column("independent")
    t.add_column("distributed")
    for acc, modes in matrix.items():
        t.add_row(acc, modes["independent"], modes["distributed"])
    return t


def api_matrix_table(levels: Mapping[str, str]) -> Table:
    """The support matrix's GPU API table: the level of each API ``gpu.apis_any`` may name."""
    t = Table(title="GPU APIs (gpu.apis_any)")
    t.add_column("API")
    t.add_column("level")
    for api, level in levels.items():
        t.add_row(api, level)
    return t


def profiles_table(profiles: list[dict[str, Any]]) -> Table:
    """``gpulayer profiles``: each profile, its requirements, and the nodes satisfying it now."""
    t = Table(title="runtime profiles")
    _id_column(t, "profile", [p["profile"] for p in profiles])
    t.add_column("satisfy", no_wrap=True)
    t.add_column("requirements")
    t.add_column("description")
    for p in profiles:
        reqs = ", ".join(f"{k} {_requirement(v)}" for k, v in p["requirements"].items())
        t.add_row(
            p["profile"],
            f"{p['satisfy']}/{p['nodes']}",
            _shorten(reqs, 200),
            _shorten(p.get("description") or "", 120),
        )
    return t


def _requirement(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}{v}" for k, v in value.items())
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)

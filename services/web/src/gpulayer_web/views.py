"""What each page shows, from the API's plain data: pure functions, no I/O, so the pages are
tested without servers. Templates get strings and numbers only; Jinja escapes them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from gpulayer_cli.render import ago, container_runtime_label, platform_label
from gpulayer_contracts.health import NodeObservations
from gpulayer_contracts.matrix import API_SUPPORT, SUPPORT_MATRIX

T = TypeVar("T")
PAGE_SIZE = 100
TERMINAL = ("succeeded", "failed", "cancelled", "lost", "rejected")


def page_of(items: Sequence[T], page: int, size: int = PAGE_SIZE) -> tuple[list[T], int, int]:
    """The items of 1-based ``page`` (clamped), that page and the number of pages."""
    pages = max(1, math.ceil(len(items) / size))
    page = min(max(page, 1), pages)
    return list(items[(page - 1) * size : page * size]), page, pages


def _gib(mib: Any) -> str:
    return "memory ?" if not isinstance(mib, int | float) else f"{mib / 1024:.0f} GiB"


def _in_use(used: Any, total: Any) -> str:
    if used is None:
        return "-"
    shown = f"{math.floor(used * 10) / 10:g}" if used else "0"
    return f"{shown}/{'?' if total is None else f'{math.floor(total * 10) / 10:g}'}"


def node_state(node: dict[str, Any]) -> str:
    if not node.get("online"):
        return "offline"
    if node.get("executor") == "down":
        return "executor down"
    return "online"


def _devices(node: dict[str, Any]) -> list[dict[str, Any]]:
    return list((node.get("capabilities") or {}).get("accelerators") or [])


def accelerators(devices: Iterable[dict[str, Any]]) -> list[str]:
    """``4 x NVIDIA H100 80GB HBM3, 80 GiB`` per group of like devices (MIG instances apart)."""
    groups: Counter[tuple[str, str, str]] = Counter()
    for d in devices:
        if d.get("mig_parent") is not None:
            continue
        memory = _gib(d.get("memory_mib")) + (
            " unified" if d.get("memory_kind") == "unified" else ""
        )
        groups[(str(d.get("accelerator") or "?"), str(d.get("name") or "?"), memory)] += 1
    return [f"{n} x {name}, {memory}" for (_acc, name, memory), n in groups.items()]


def gpu_counts(node: dict[str, Any]) -> tuple[int, int]:
    """(free, total) GPUs: usable devices, less those held by jobs or kept back for health."""
    usable = [
        d["index"]
        for d in _devices(node)
        if d.get("execution_supported") and d.get("accelerator") != "cpu"
    ]
    busy = set(node.get("busy_devices") or [])
    held = {int(i) for i in ((node.get("health") or {}).get("held_back") or {})}
    return sum(1 for i in usable if i not in busy and i not in held), len(usable)


def _container_gpu(caps: dict[str, Any], container_apis: list[str]) -> str:
    """The devices the node's CDI specs name, counted; else whether containers get a GPU API."""
    rt = caps.get("container_runtime")
    cdi = (rt.get("cdi_devices") or []) if isinstance(rt, dict) else []
    if cdi:
        return f"yes ({len(cdi)} CDI device{'s' if len(cdi) != 1 else ''})"
    return "yes" if container_apis else "no"


def fleet_row(node: dict[str, Any], now: datetime | None = None) -> dict[str, Any]:
    caps = node.get("capabilities") or {}
    apis = caps.get("gpu_apis") or {}
    res = node.get("resources") or {}
    free, total = gpu_counts(node)
    containers = list(apis.get("containers") or [])
    return {
        "node_id": node["node_id"],
        "platform": platform_label(caps),
        "host_apis": list(apis.get("host") or []),
        "container_apis": containers,
        "container_gpu": _container_gpu(caps, containers),
        "container_runtime": container_runtime_label(caps),
        "accelerators": accelerators(_devices(node)) or ["cpu only"],
        "gpus": f"{free}/{total}",
        "cores": _in_use(res.get("cores_used"), res.get("cores")),
        "ram": _in_use(res.get("memory_gb_used"), res.get("memory_gb")),
        "health": (node.get("health") or {}).get("health") or "unknown",
        "state": node_state(node),
        "last_seen": ago(node.get("last_seen"), now),
    }


def fleet_filters(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The values each filter offers, from the fleet rows: those present in the fleet."""
    apis = {a for r in rows for a in (*r["host_apis"], *r["container_apis"])}
    return {
        "platform": sorted({r["platform"] for r in rows}),
        "api": sorted(apis),
        "state": sorted({r["state"] for r in rows}),
    }


def filter_fleet(
    rows: list[dict[str, Any]], platform: str = "", api: str = "", state: str = ""
) -> list[dict[str, Any]]:
    return [
        r
        for r in rows
        if (not platform or r["platform"] == platform)
        and (not api or api in r["host_apis"] or api in r["container_apis"])
        and (not state or r["state"] == state)
    ]


def fleet_rows(
    nodes: list[dict[str, Any]], platform: str = "", api: str = "", state: str = ""
) -> list[dict[str, Any]]:
    return filter_fleet([fleet_row(n) for n in nodes], platform, api, state)


def matrix(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """The support matrix (accelerators and GPU APIs), and per platform in the fleet which
    accelerators and GPU APIs its nodes have, with their levels."""
    platforms: dict[str, set[str]] = {}
    apis: dict[str, set[str]] = {}
    for n in nodes:
        caps = n.get("capabilities") or {}
        platform = platform_label(caps)
        accs = {str(d.get("accelerator")) for d in _devices(n)} or {"cpu"}
        platforms.setdefault(platform, set()).update(accs | {"cpu"})
        offered = caps.get("gpu_apis") or {}
        apis.setdefault(platform, set()).update(
            str(a) for a in (*(offered.get("host") or []), *(offered.get("containers") or []))
        )
    return {
        "levels": [
            {"accelerator": acc, "independent": m["independent"], "distributed": m["distributed"]}
            for acc, m in SUPPORT_MATRIX.items()
        ],
        "api_levels": [{"api": api, "level": level} for api, level in API_SUPPORT.items()],
        "platforms": [
            {
                "platform": p,
                "accelerators": [
                    {"name": a, "level": SUPPORT_MATRIX.get(a, {}).get("independent", "unknown")}  # type: ignore[call-overload]
                    for a in sorted(accs)
                ],
                "apis": [
                    {"name": a, "level": API_SUPPORT.get(a, "unknown")}
                    for a in sorted(apis.get(p, ()))
                ],
            }
            for p, accs in sorted(platforms.items())
        ],
    }


def device_rows(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Each device of the node: model, memory, compute capability, driver, MIG, health."""
    health = node.get("health") or {}
    observed = {int(d.get("index", -1)): d for d in health.get("devices") or []}
    held = {int(i): why for i, why in (health.get("held_back") or {}).items()}
    devices = _devices(node)
    rows = []
    for d in devices:
        index = int(d.get("index", -1))
        obs = observed.get(index) or {}
        state = obs.get("health") or ("unknown" if not observed else "healthy")
        reason = obs.get("reason") or held.get(index) or ""
        mig = [
            str(m.get("mig_profile") or m.get("name") or m.get("index"))
            for m in devices
            if m.get("mig_parent") == index
        ]
        rows.append(
            {
                "index": index,
                "accelerator": d.get("accelerator") or "?",
                "name": d.get("name") or "?",
                "memory": _gib(d.get("memory_mib")),
                "cc": d.get("compute_capability") or "-",
                "driver": d.get("driver_version") or "-",
                "mig": d.get("mig_mode") or "-",
                "mig_instances": mig,
                "mig_parent": d.get("mig_parent"),
                "usable": bool(d.get("execution_supported")),
                "health": state,
                "reason": reason,
                "busy": index in set(node.get("busy_devices") or []),
            }
        )
    return rows


def api_rows(node: dict[str, Any]) -> list[dict[str, str]]:
    apis = (node.get("capabilities") or {}).get("gpu_apis") or {}
    evidence = apis.get("evidence") or {}
    names = sorted({*apis.get("host", []), *apis.get("containers", []), *evidence})
    return [
        {
            "api": a,
            "host": "yes" if a in apis.get("host", []) else "no",
            "containers": "yes" if a in apis.get("containers", []) else "no",
            "evidence": str(evidence.get(a) or ""),
        }
        for a in names
    ]


# CDI device names the node page lists; the rest are counted.
_CDI_SHOWN = 64


def container_detail(node: dict[str, Any]) -> dict[str, Any]:
    """The node page's container runtime: what it is, why its self-test failed, the CDI
    devices its specs name (the first ``_CDI_SHOWN``, the rest counted)."""
    caps = node.get("capabilities") or {}
    rt = caps.get("container_runtime")
    cdi = [str(n) for n in ((rt.get("cdi_devices") or []) if isinstance(rt, dict) else [])]
    return {
        "runtime": container_runtime_label(caps),
        "notes": [str(n) for n in (rt.get("notes") or [])] if isinstance(rt, dict) else [],
        "cdi": cdi[:_CDI_SHOWN],
        "cdi_more": max(0, len(cdi) - _CDI_SHOWN),
    }


# Each measure the node page draws per device, and its full scale: utilization in percent,
# memory used against the device's memory, temperature up to 100 °C (or the hottest sample).
_SERIES = (("utilization_pct", "utilization", "%"), ("memory_used_mib", "memory used", " MiB"),
           ("temperature_c", "temperature", " °C"))  # fmt: skip


def sparklines(
    samples: list[NodeObservations],
    memory_mib: dict[int, int] | None = None,
    width: int = 120,
    height: int = 24,
) -> dict[int, list[dict[str, Any]]]:
    """Per device, one small SVG line per measure over the samples kept (oldest left, full
    scale at the top), with its last value."""
    if not samples:
        return {}
    start = samples[0].observed_at.timestamp()
    span = max(samples[-1].observed_at.timestamp() - start, 1.0)
    out: dict[int, list[dict[str, Any]]] = {}
    for index in sorted({d.index for s in samples for d in s.devices}):
        for field, label, unit in _SERIES:
            points = [
                (s.observed_at.timestamp(), getattr(d, field))
                for s in samples
                for d in s.devices
                if d.index == index and getattr(d, field) is not None
            ]
            if not points:
                continue
            top = {"utilization_pct": 100, "temperature_c": 100}.get(field)
            if field == "memory_used_mib":
                top = (memory_mib or {}).get(index)
            top = max(top or 1, *(v for _, v in points))
            line = " ".join(
                f"{(t - start) / span * width:.1f},{height - 1 - v / top * (height - 2):.1f}"
                for t, v in points
            )
            out.setdefault(index, []).append(
                {"label": label, "points": line, "last": f"{points[-1][1]:g}{unit}",
                 "width": width, "height": height}
            )  # fmt: skip
    return out


def job_row(job: dict[str, Any], now: datetime | None = None) -> dict[str, Any]:
    return {
        "job_id": str(job.get("job_id")),
        "state": str(job.get("state")),
        "owner": str(job.get("owner") or "anonymous"),
        "priority": job.get("priority") or 0,
        "node": str(job.get("node_id") or "-"),
        "devices": ",".join(map(str, job.get("devices") or [])) or "-",
        "age": ago(job.get("submitted_at"), now),
        "reason": str(job.get("reason") or ""),
        "kind": str(job.get("kind") or "job"),
        "name": str(job.get("name") or (job.get("request") or {}).get("name") or ""),
    }


def timeline(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each event with ``text``: what follows its type (`` on vm: why (exit 3)``)."""
    out = []
    for e in events:
        text = f" on {e['node_id']}" if e.get("node_id") else ""
        why = e.get("summary") or e.get("reason")
        text += f": {why}" if why else ""
        if e.get("exit_code") is not None:
            text += f" (exit {e['exit_code']})"
        reasons = [] if e.get("type") == "pending" else list(e.get("reasons") or [])
        out.append({**e, "text": text, "reasons": reasons})
    return out


def job_rows(
    jobs: list[dict[str, Any]], state: str = "", owner: str = "", node: str = ""
) -> list[dict[str, Any]]:
    """Waiting jobs first (the queue), then the others, newest first within each."""
    return [job_row(j) for j in select_jobs(jobs, state, owner, node)]


def select_jobs(
    jobs: list[dict[str, Any]], state: str = "", owner: str = "", node: str = ""
) -> list[dict[str, Any]]:
    """The jobs ``job_rows`` shows, in its order, as they came (rows made only for one page)."""
    picked = [
        j
        for j in jobs
        if (not state or j.get("state") == state)
        and (not owner or (j.get("owner") or "anonymous") == owner)
        and (not node or j.get("node_id") == node)
    ]
    return [j for j in picked if j.get("state") == "pending"] + [
        j for j in picked if j.get("state") != "pending"
    ]


def owners(jobs: list[dict[str, Any]], quotas: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Per owner: its jobs by state, its recent GPU-seconds (fair share: least used goes first,
    so its standing is its rank by usage), and its quotas (``used/max`` per resource)."""
    by_owner: dict[str, dict[str, Any]] = {}
    for j in jobs:
        name = str(j.get("owner") or "anonymous")
        o = by_owner.setdefault(name, {"owner": name, "states": Counter(), "usage": 0.0})
        o["states"][str(j.get("state"))] += 1
        o["usage"] = max(o["usage"], float(j.get("owner_usage_gpu_s") or 0.0))
    limits: dict[str, list[str]] = {}
    for q in quotas or []:
        limits.setdefault(str(q.get("owner")), []).append(
            f"{q.get('resource')}: {q.get('used')}/{q.get('max')}"
        )
    for name in limits:
        if name != "default":
            by_owner.setdefault(name, {"owner": name, "states": Counter(), "usage": 0.0})
    ranked = sorted(by_owner.values(), key=lambda o: (o["usage"], o["owner"]))
    return [
        {
            "owner": o["owner"],
            "standing": rank,
            "usage": f"{o['usage']:g}",
            "waiting": o["states"].get("pending", 0),
            "active": o["states"].get("placed", 0) + o["states"].get("running", 0),
            "done": sum(n for s, n in o["states"].items() if s in TERMINAL),
            "quotas": limits.get(o["owner"], [])
            or [f"default: {q}" for q in limits.get("default", [])],
        }
        for rank, o in enumerate(ranked, 1)
    ]

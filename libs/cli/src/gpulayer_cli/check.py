"""``gpulayer check JOBFILE``: would this machine get the job? No running stack needed.

Runs the placement rules against this machine's own probe: exit 0 when it would get the job,
1 with the reasons when not, 2 when the job file itself is invalid.
"""

from __future__ import annotations

import asyncio
import json
import sys

import msgspec
from rich.console import Console

from gpulayer_contracts import InvalidInput, load_job_file, validate_job
from gpulayer_detection import detect_capabilities
from gpulayer_matching import NodeView, Placement, explain, match
from gpulayer_runtime.settings import node_id


def run_check(file: str, *, python: str | None, as_json: bool, console: Console) -> int:
    try:
        job = load_job_file(file)
    except (InvalidInput, OSError) as err:
        print(f"gpulayer check: {file}: {err}", file=sys.stderr)
        return 2
    result = validate_job(job)
    if result.errors:
        for e in result.errors:
            print(f"gpulayer check: {file}: {e}", file=sys.stderr)
        return 2
    caps = asyncio.run(detect_capabilities(node_id(), python=python))
    # Idle, as placement would see it with nothing running: every core and all the RAM the
    # probe found (an executor's reserve for the system, if it has one, is not known here).
    cores = caps.host.cpu_cores * 1000 if caps.host.cpu_cores is not None else None
    view = NodeView(
        node_id=caps.node_id,
        capabilities=caps,
        online=True,
        cpu_total=cores,
        cpu_free=cores,
        memory_total=caps.host.memory_bytes,
        memory_free=caps.host.memory_bytes,
    )
    decision = match(job, [view])
    if isinstance(decision, Placement):
        if as_json:
            print(json.dumps({"fits": True, "placement": msgspec.to_builtins(decision)}))
        else:
            devices = ",".join(map(str, decision.devices)) or "none"
            console.print(
                f"[green]yes[/]: {caps.node_id} would get {job.job_id} "
                f"({decision.accelerator}, devices {devices}, use {decision.use})"
            )
        return 0
    why = explain(job, [view])
    if as_json:
        print(json.dumps({"fits": False, "summary": why.summary, "reasons": why.reasons}))
    else:
        console.print(f"[red]no[/]: {why.summary}")
        for reason in why.reasons:
            console.print(f"  - {reason}")
    return 1

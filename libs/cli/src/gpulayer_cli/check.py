"""``gpulayer check JOBFILE``: would this machine get the job? No running stack needed.

Runs the placement rules against this machine's own probe: exit 0 when it would get the job,
1 with the reasons when not, 2 when the job file itself is invalid.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import msgspec
from rich.console import Console

from gpulayer_contracts import (
    InvalidInput,
    JobRequest,
    WorkerCapabilities,
    load_job_file,
    validate_job,
)
from gpulayer_contracts.profiles import expand_profile, load_profiles
from gpulayer_detection import detect_capabilities
from gpulayer_detection.containers import ContainerSettings, settings_from_env
from gpulayer_detection.registry import host_root_from_env
from gpulayer_matching import NodeView, Placement, explain, match
from gpulayer_runtime.settings import node_id


def container_settings_for(job: JobRequest, console: Console) -> ContainerSettings | None:
    """How to look for a container runtime for ``job``: not at all unless it names an image
    (the self-test takes a second); None, the reason printed, when the settings are bad."""
    if job.container is None:
        return ContainerSettings(podman=None)
    try:
        return settings_from_env(os.environ)
    except ValueError as err:
        console.print(f"[red]{err}[/]")
        return None


def load_checked_job(file: str, profiles: str | None, command: str) -> JobRequest | None:
    """The job in ``file``, its profile expanded from the ``profiles`` file, valid; None (each
    problem printed as ``gpulayer <command>: <file>: ...``) when it is not."""
    try:
        job = load_job_file(file)
    except (InvalidInput, OSError) as err:
        print(f"gpulayer {command}: {file}: {err}", file=sys.stderr)
        return None
    errors: list[str] = []
    if job.profile is not None:
        if not profiles:
            print(
                f"gpulayer {command}: {file}: names profile {job.profile}, but no profiles file "
                "was given (--profiles or GPULAYER_PROFILES)",
                file=sys.stderr,
            )
            return None
        try:
            known = load_profiles(profiles)
        except InvalidInput as err:
            print(f"gpulayer {command}: {err}", file=sys.stderr)
            return None
        job, errors = expand_profile(job, known)
    errors += validate_job(job).errors
    for e in errors:
        print(f"gpulayer {command}: {file}: {e}", file=sys.stderr)
    return None if errors else job


def detect_here(
    python: str | None, containers: ContainerSettings, console: Console
) -> WorkerCapabilities | None:
    """This machine's capabilities, the host's files read under GPULAYER_PROBE_HOST_ROOT;
    None, the reason printed, when that setting is bad."""
    try:
        root = host_root_from_env(os.environ)
    except ValueError as err:
        console.print(f"[red]{err}[/]")
        return None
    return asyncio.run(
        detect_capabilities(node_id(), python=python, containers=containers, host_root=root)
    )


def local_view(caps: WorkerCapabilities) -> NodeView:
    """This machine as placement would see it idle, with nothing running: every core and all
    the RAM the probe found (an executor's reserve for the system, if it has one, is not known
    here)."""
    cores = caps.host.cpu_cores * 1000 if caps.host.cpu_cores is not None else None
    return NodeView(
        node_id=caps.node_id,
        capabilities=caps,
        online=True,
        cpu_total=cores,
        cpu_free=cores,
        memory_total=caps.host.memory_bytes,
        memory_free=caps.host.memory_bytes,
    )


def run_check(
    file: str,
    *,
    python: str | None,
    as_json: bool,
    console: Console,
    profiles: str | None = None,
) -> int:
    job = load_checked_job(file, profiles, "check")
    if job is None:
        return 2
    containers = container_settings_for(job, console)
    if containers is None:
        return 2
    caps = detect_here(python, containers, console)
    if caps is None:
        return 2
    view = local_view(caps)
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

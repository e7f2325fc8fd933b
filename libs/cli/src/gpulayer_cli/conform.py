"""``gpulayer conform JOBFILE [--golden DIR]``: run a workload here and compare its output with
the golden for this machine's node class.

Decides like ``gpulayer check``: where this machine would not get the job, it prints
``skipped: <reason>`` and exits 0 (a host that lacks what the job needs is no failure). Where it
would, the job runs here by the executor's rules (argv without a shell, the minimal base
environment, its own env, the visibility variables for the devices it would get, its timeout,
a fresh working folder) and its stdout is compared with the golden.

Goldens are per node class, keyed by the GPU APIs the host and its containers provide
(``host-cuda+vulkan_containers-cuda.txt``), with ``default.txt`` for every other class.
Exit 0 passed (or skipped, or ``--update`` recorded the golden), 1 a mismatch or a failed run,
2 invalid input (a bad job file, no golden to compare with).
"""

from __future__ import annotations

import contextlib
import difflib
import getpass
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from gpulayer_cli.check import container_settings_for, detect_here, load_checked_job, local_view
from gpulayer_contracts import JobRequest, WorkerCapabilities
from gpulayer_contracts.jobenv import base_environment, job_environment
from gpulayer_matching import Placement, explain, match

__all__ = ["DEFAULT_GOLDEN", "golden_dir", "node_class", "run_conform"]

DEFAULT_GOLDEN = "default"
# Output kept per stream: a golden is a workload's summary, not a log. Past this, the run fails.
MAX_OUTPUT_BYTES = 4 << 20
_UNSAFE = re.compile(r"[^a-z0-9]+")


def node_class(caps: WorkerCapabilities) -> str:
    """This machine's node class: the GPU APIs its host and its containers provide, sorted,
    e.g. ``host-cuda+vulkan_containers-none``; a golden file is named by it."""

    def part(apis: list[str]) -> str:
        names = sorted({_UNSAFE.sub("", a.lower()) for a in apis} - {""})
        return "+".join(names) or "none"

    return f"host-{part(caps.gpu_apis.host)}_containers-{part(caps.gpu_apis.containers)}"


def golden_dir(file: str, golden: str | None) -> Path:
    """``--golden`` when given, else ``<job file without its suffix>.golden`` beside it."""
    if golden:
        return Path(golden)
    p = Path(file)
    return p.with_name(p.stem + ".golden")


@dataclass
class Outcome:
    result: str  # passed, mismatch, failed, skipped, updated, invalid
    node_class: str = ""
    reason: str = ""
    golden: str = ""
    diff: str = ""
    exit_code: int | None = None
    stderr: str = ""

    @property
    def status(self) -> int:
        return {"mismatch": 1, "failed": 1, "invalid": 2}.get(self.result, 0)


def run_conform(
    file: str,
    *,
    golden: str | None,
    update: bool,
    python: str | None,
    profiles: str | None,
    as_json: bool,
    console: Console,
    environ: Mapping[str, str],
) -> int:
    job = load_checked_job(file, profiles, "conform")
    if job is None:
        return 2
    containers = container_settings_for(job, console)
    if containers is None:
        return 2
    caps = detect_here(python, containers, console)
    if caps is None:
        return 2
    outcome = conform(job, caps, golden_dir(file, golden), update=update, environ=environ)
    _report(outcome, as_json, console)
    return outcome.status


def conform(
    job: JobRequest,
    caps: WorkerCapabilities,
    folder: Path,
    *,
    update: bool,
    environ: Mapping[str, str],
) -> Outcome:
    """Decide, run, compare. ``environ``: this process' environment, the base's source."""
    cls = node_class(caps)
    view = local_view(caps)
    decision = match(job, [view])
    if not isinstance(decision, Placement):
        return Outcome("skipped", cls, reason=explain(job, [view]).summary)
    own = folder / f"{cls}.txt"
    expected_at = own if own.exists() else folder / f"{DEFAULT_GOLDEN}.txt"
    if not update and not expected_at.exists():
        return Outcome(
            "invalid",
            cls,
            reason=f"no golden for node class {cls} in {folder} (looked for {own.name} and "
            f"{DEFAULT_GOLDEN}.txt); --update records one",
        )
    ran = _run(job, decision, environ)
    if ran.result == "failed":
        ran.node_class = cls
        return ran
    actual = ran.reason
    if update:
        folder.mkdir(parents=True, exist_ok=True)
        own.write_text(actual)
        return Outcome("updated", cls, golden=str(own), exit_code=0)
    expected = expected_at.read_text(errors="replace")
    if actual == expected:
        return Outcome("passed", cls, golden=str(expected_at), exit_code=0)
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            actual.splitlines(keepends=True),
            fromfile=str(expected_at),
            tofile="output",
        )
    )
    return Outcome("mismatch", cls, golden=str(expected_at), diff=diff, exit_code=0)


def _run(job: JobRequest, placed: Placement, environ: Mapping[str, str]) -> Outcome:
    """Run the job as the executor would; on success ``reason`` holds its stdout."""
    with tempfile.TemporaryDirectory(prefix=f"gpulayer-conform-{job.job_id}-") as cwd:
        try:
            env = job_environment(
                job,
                accelerator=placed.accelerator,
                devices=placed.devices,
                grant_id=f"conform-{job.job_id}",
                base=base_environment(environ, user=getpass.getuser(), home=cwd),
            )
        except ValueError as err:
            return Outcome("failed", reason=str(err))
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err_file:
            try:
                proc = subprocess.Popen(
                    job.command,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err_file,
                    start_new_session=True,  # its own process group: a timeout ends all of it
                )
            except OSError as e:
                return Outcome("failed", reason=f"could not start {job.command[0]!r}: {e}")
            timed_out = False
            try:
                code = proc.wait(timeout=job.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                code = None
            # Whatever the job left behind in its group goes with it, as on a node.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if code is None:
                code = proc.wait()
            stdout, out_over = _read(out)
            stderr, _ = _read(err_file)
    if timed_out:
        return Outcome("failed", reason=f"timed out after {job.timeout_s:g} s", stderr=stderr)
    if code != 0:
        why = f"exited with {code}" if code > 0 else f"killed by signal {-code}"
        return Outcome("failed", reason=why, exit_code=code, stderr=stderr)
    if out_over:
        return Outcome("failed", reason=f"stdout passed {MAX_OUTPUT_BYTES} bytes", exit_code=code)
    return Outcome("ran", reason=stdout, exit_code=code, stderr=stderr)


def _read(f: IO[bytes]) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(MAX_OUTPUT_BYTES + 1)
    return data[:MAX_OUTPUT_BYTES].decode("utf-8", "replace"), len(data) > MAX_OUTPUT_BYTES


def _report(o: Outcome, as_json: bool, console: Console) -> None:
    if as_json:
        data: dict[str, Any] = {"result": o.result, "node_class": o.node_class}
        for key in ("reason", "golden", "diff", "stderr"):
            if getattr(o, key):
                data[key] = getattr(o, key)
        if o.exit_code is not None:
            data["exit_code"] = o.exit_code
        print(json.dumps(data))
        return
    if o.result == "invalid":
        print(f"gpulayer conform: {o.reason}", file=sys.stderr)
    elif o.result == "skipped":
        console.print(f"skipped: {o.reason}")
    elif o.result == "passed":
        console.print(f"[green]passed[/]: node class {o.node_class}, golden {o.golden}")
    elif o.result == "updated":
        console.print(f"updated: {o.golden} (node class {o.node_class})")
    elif o.result == "mismatch":
        console.print(f"[red]mismatch[/]: node class {o.node_class}, golden {o.golden}")
        sys.stdout.write(o.diff)
    else:
        console.print(f"[red]failed[/]: {o.reason} (node class {o.node_class})")
        if o.stderr:
            sys.stdout.write(o.stderr[-4000:])

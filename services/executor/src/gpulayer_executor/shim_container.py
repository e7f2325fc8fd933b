"""The shim's steps around a container job (``container.ContainerRun``), synchronous as the
shim is: the image made ready before ``podman run`` (present, pulled within its bound, for this
machine's architecture), the container stopped with a grace, its outcome explained, and the
container removed once the job is over, whatever ended it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from gpulayer_executor import container as ctr
from gpulayer_executor.limits import oom_reason
from gpulayer_executor.shim import ShimSpec, read_stop
from gpulayer_executor.state import Outcome

log = logging.getLogger(__name__)

# How often a pull is looked at (its end, its bound, a stop).
PULL_POLL_S = 0.2
# After ``podman stop``'s own grace: how long podman gets to kill the container and return.
STOP_MARGIN_S = 5.0


class Flags(Protocol):
    """The shim's ``Signals``: ``look`` set when a stop may have been asked."""

    look: bool


class _Look:
    """Whether a stop was asked, without taking the flag: the job's own loop looks again once
    the container runs."""

    def __init__(self, signals: Flags) -> None:
        self._signals = signals

    def request(self, run: Path) -> Outcome | None:
        if not self._signals.look:
            return None
        request = read_stop(run)
        if request is None:
            return None
        return Outcome(state=request.state, reason=request.reason)


def prepare(
    box: ctr.ContainerRun, run: Path, signals: Flags, *, check: bool = True
) -> Outcome | None:
    """Make the image ready (unless ``check`` is False) and write the job's env file; the
    job's outcome when it can't run (failed, naming the image) or was stopped meanwhile, None
    when ``podman run`` may go."""
    look = _Look(signals)
    try:
        if check:
            stopped = _image_ready(box, run, look)
            if stopped is not None:
                return stopped
        _write_env(run / ctr.ENV_FILE, ctr.env_file_text(box.env))
    except ctr.ContainerError as err:
        return Outcome(state="failed", reason=str(err))
    except OSError as err:
        return Outcome(state="failed", reason=f"image {box.image}: podman: {err}")
    return look.request(run)


def _image_ready(box: ctr.ContainerRun, run: Path, look: _Look) -> Outcome | None:
    """The image present (pulled by its policy) and for this machine's architecture; raises
    ContainerError; the outcome of a stop asked during a pull."""
    arch = ctr.image_arch(box.podman, box.image)
    if box.pull == "always" or (arch is None and box.pull == "missing"):
        stopped = _pull(box, run, look)
        if stopped is not None:
            return stopped
        arch = ctr.image_arch(box.podman, box.image)
    if arch is None:
        if box.pull == "never":
            raise ctr.never_pulled(box.image)
        raise ctr.ContainerError(f"image {box.image}: not on this node after its pull")
    ctr.check_arch(box.image, arch, ctr.host_arch())
    return None


def _image_gone(box: ctr.ContainerRun, outcome: Outcome) -> bool:
    """Whether ``podman run`` of an image not checked failed for want of it: podman's own
    failure, and the image not on this node now (so no container of the job ever ran)."""
    if not box.image_known or outcome.exit_code != ctr.PODMAN_FAILED:
        return False
    try:
        return ctr.image_arch(box.podman, box.image) is None
    except (ctr.ContainerError, OSError):
        return False


def supervise(
    spec: ShimSpec,
    box: ctr.ContainerRun,
    run: Path,
    signals: Flags,
    process: Callable[[ShimSpec], Outcome],
) -> Outcome:
    """The container job of ``spec``: the image made ready, then ``podman run`` supervised by
    ``process`` as a job's process is, then the container removed whatever ended it."""
    early = prepare(box, run, signals, check=not box.image_known)
    if early is not None:
        return early
    # podman runs as the shim's user (rootful) with its own environment; the job's account,
    # env and limits are its options. The job's cgroup holds podman's client, not the job.
    podman = msgspec.structs.replace(
        spec, argv=box.argv, env=box.podman_env, run_as=None, limits=None
    )
    try:
        outcome = process(podman)
        if _image_gone(box, outcome):
            # An image that ran here before, removed since: as for a first run, checked and
            # pulled by its policy (or the job fails naming why), then run again.
            ctr.remove(box.podman, box.name)
            early = prepare(box, run, signals)
            if early is not None:
                return early
            outcome = process(podman)
    finally:
        finish(box, run)
    return explain(outcome, box)


def _write_env(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _pull(box: ctr.ContainerRun, run: Path, look: _Look) -> Outcome | None:
    """``podman pull`` within ``box.pull_timeout_s``; raises ContainerError when it fails or
    takes longer; the outcome of a stop asked meanwhile."""
    proc = subprocess.Popen(
        ctr.pull_argv(box.podman, box.image),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=box.podman_env,
    )
    deadline = time.monotonic() + box.pull_timeout_s
    while True:
        try:
            _, err = proc.communicate(timeout=PULL_POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        stopped = look.request(run)
        if stopped is not None or time.monotonic() >= deadline:
            proc.kill()
            proc.communicate()
            if stopped is not None:
                return stopped
            raise ctr.ContainerError(
                f"image {box.image}: its pull took longer than {box.pull_timeout_s:g} s "
                "(GPULAYER_EXECUTOR_CONTAINER_PULL_TIMEOUT_S)"
            )
    if proc.returncode != 0:
        raise ctr.pull_failed(box.image, proc.returncode, err or "")
    return None


def start_stop(box: ctr.ContainerRun, grace_s: float) -> subprocess.Popen[bytes] | None:
    """``podman stop``: the container's stop signal, ``grace_s`` for it to go, then SIGKILL.
    Started, not awaited: the shim reads the job's output meanwhile."""
    try:
        return subprocess.Popen(
            [box.podman, "stop", "--ignore", "--time", str(math.ceil(grace_s)), box.name],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=box.podman_env,
        )
    except OSError as err:
        log.warning("podman stop %s: %s", box.name, err)
        return None


def reap(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    try:
        proc.wait(STOP_MARGIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def finish(box: ctr.ContainerRun, run: Path) -> None:
    """Nothing of the job left: its container (killed if it still runs) and what podman mounted
    for it removed, its env file deleted."""
    with contextlib.suppress(FileNotFoundError):
        (run / ctr.ENV_FILE).unlink()
    error = ctr.remove(box.podman, box.name)
    if error is not None:
        log.warning("container %s not removed: %s", box.name, error)


def explain(outcome: Outcome, box: ctr.ContainerRun) -> Outcome:
    """The outcome in a container's words: a container killed by SIGKILL that nobody stopped,
    with a memory limit, ran out of memory (podman's own OOM flag is not set on every cgroup
    layout); podman's own exit codes say what they mean."""
    if outcome.state != "failed" or outcome.reason == "timeout" or outcome.exit_code is None:
        return outcome
    code = outcome.exit_code
    limits = box.limits
    if code == 137 and limits is not None and limits.memory_bytes is not None:
        return Outcome(state="failed", exit_code=code, reason=oom_reason(limits, "limit"))
    if code in ctr.PODMAN_CODES:
        why = f"{ctr.PODMAN_CODES[code]}, or the command's own code; see the job's log"
        return Outcome(state="failed", exit_code=code, reason=f"exit code {code} ({why})")
    return outcome

"""How a job is launched: its argv, and for a container job what the shim is given to run it (``ContainerRun``,
from the grant and the executor's settings) and the removal of a lost job's container. Kept
apart from ``container`` (which the shim imports) so the shim never loads the CDI reader."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpulayer_contracts.events import Grant
from gpulayer_contracts.jobenv import DEFAULT_PATH
from gpulayer_detection.cdi import read_cdi_devices
from gpulayer_executor import container as ctr
from gpulayer_executor.config import ExecutorConfig
from gpulayer_executor.env import RunAs
from gpulayer_executor.gang import job_argv
from gpulayer_executor.limits import job_limits
from gpulayer_executor.runner import MARKER
from gpulayer_executor.state import Outcome, grant_key

log = logging.getLogger("gpulayer_executor.service")


# Images remembered as run (``RanImages``): a node holds a few; the oldest is forgotten first.
RAN_IMAGES_MAX = 256


class RanImages:
    """The images a container of this executor ran from: present on this node and runnable on
    it. A job of one of them skips the shim's image check (``ContainerRun.image_known``). An
    image is forgotten when podman could not run a container of it."""

    def __init__(self, limit: int = RAN_IMAGES_MAX) -> None:
        self._ran: dict[str, None] = {}
        self._limit = limit

    def __contains__(self, image: str) -> bool:
        return image in self._ran

    def record(self, grant: Grant, outcome: Outcome) -> None:
        """Learn from a job's outcome, for a container job: an exit code of the container's
        (podman's own 125 aside; a negative one is podman killed, maybe before the container
        ran) means podman found the image and ran it."""
        code = outcome.exit_code
        if grant.job.container is None or code is None or code < 0:
            return
        image = grant.job.container.image
        if code == ctr.PODMAN_FAILED:
            self._ran.pop(image, None)
            return
        self._ran.pop(image, None)
        self._ran[image] = None
        while len(self._ran) > self._limit:
            del self._ran[next(iter(self._ran))]


def launch_argv(
    config: ExecutorConfig,
    run_root: Path,
    grant: Grant,
    run_as: RunAs | None,
    cwd: Path,
    env: dict[str, str],
    ran: RanImages | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """What the executor starts for ``grant`` (``gang.job_argv``) and, for a container job, the
    launch's ``container=``. Raises LaunchRefused or ContainerError (the job's reason)."""
    in_container = grant.job.container is not None
    path = env.get("PATH", DEFAULT_PATH)
    argv = job_argv(
        grant, workload_python=config.workload_python, path=path, in_container=in_container
    )
    if not in_container:
        return argv, {}
    box = container_run(config, run_root, grant, run_as, cwd, env, argv, ran)
    return argv, {"container": box}


def container_run(
    config: ExecutorConfig,
    run_root: Path,
    grant: Grant,
    run_as: RunAs | None,
    cwd: Path,
    env: dict[str, str],
    argv: list[str],
    ran: RanImages | None = None,
) -> ctr.ContainerRun:
    """How the shim runs the job's container; its image not checked again where ``ran`` holds
    it (never with pull ``always``). Raises ContainerError (the job's reason)."""
    spec = grant.job.container
    assert spec is not None
    if config.podman is None:
        raise ctr.ContainerError(f"image {spec.image}: podman is not on this node")
    if not config.shim:
        raise ctr.ContainerError(
            f"image {spec.image}: container jobs run under a shim (GPULAYER_EXECUTOR_SHIM=on)"
        )
    cdi, _ = read_cdi_devices(config.cdi_dirs) if grant.devices else ([], [])
    limits = job_limits(grant, pids_max=config.job_pids_max, nodes=()) if config.enforce else None
    name = ctr.container_name(config.workdir, grant.grant_id)
    return ctr.ContainerRun(
        podman=config.podman,
        name=name,
        image=spec.image,
        pull=spec.pull,
        pull_timeout_s=config.container_pull_timeout_s,
        argv=ctr.run_argv(
            podman=config.podman,
            runtime=config.container_runtime,
            name=name,
            labels={
                ctr.LABEL_GRANT: grant.grant_id,
                ctr.LABEL_EXECUTOR: ctr.executor_label(config.workdir),
            },
            image=spec.image,
            command=argv,
            user=ctr.job_user(run_as),
            cwd=cwd,
            env_file=run_root / grant_key(grant.grant_id) / ctr.ENV_FILE,
            devices=ctr.device_args(grant, cdi, config.device_dir, config.cdi_kind, config.wsl_dir),
            limits=ctr.limit_args(limits),
            ulimit=ctr.machine_ulimits(),
            network=config.container_network,
        ),
        env=ctr.container_env(env, grant.job.env, cwd),
        podman_env=ctr.podman_env(config.base_env, grant.grant_id, MARKER),
        limits=limits,
        image_known=spec.pull != "always" and ran is not None and spec.image in ran,
    )


def remove_lost(config: ExecutorConfig, grant: Grant) -> None:
    """A container job lost with its shim: its container goes too (the shim would have removed
    it), so that nothing of it runs on devices placement gives to others. Blocking."""
    if config.podman is None:
        return
    name = ctr.container_name(config.workdir, grant.grant_id)
    error = ctr.remove(config.podman, name)
    if error is not None:
        log.warning("container %s of lost job %s not removed: %s", name, grant.job.job_id, error)

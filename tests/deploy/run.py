"""``make deploy-test``: gpulayer installed as a team would, on this machine, with podman.

1. ``make image`` (cached by content: a rerun doesn't rebuild).
2. The compose stack up with ``deploy/up`` (the documented steps: gen-env, the credentials, the
   signing key, a CA and NATS's certificate, ``podman-compose up -d``), in a copy of deploy/
   under .gpulayer/deploy-test/, NATS over TLS. The third-party images this machine can't pull
   are replaced by tests/deploy/compose.stand-ins.yaml; gpulayer's services run as shipped.
   Every service healthy, in its start order; a user's credential from the host submits a job
   that succeeds; ``gpulayer nodes`` shows the node and the fleet page answers.
3. Two GPU nodes on hosts of their own (tests/deploy/nodes.py): containers running systemd as
   PID 1 on the compose network, gpulayer installed from the built wheels with
   deploy/install-node, joining NATS over TLS (a node without the CA, and a revoked node, are
   refused, their journals say why). A CUDA job lands on the node with the recorded GPU and CPU
   jobs on the other; ``systemctl restart gpulayer-executor`` during a running job leaves it
   running, and it ends once; ``systemctl stop gpulayer-probe`` takes its node offline.
4. ``deploy/down`` then ``deploy/up`` keeps jobs, their events and credentials (a revocation
   too); ``deploy/down -v`` removes the volumes.

It ends with one line, ``deploy-test: passed: ...``. Each wait is bounded and says what it
waited for. KEEP=1 leaves the stack and the nodes up at the end (``make deploy-test-clean``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WORK = ROOT / ".gpulayer" / "deploy-test"
PROJECT = "gpulayer-deploytest"
CONTAINERS_CONF = ROOT / "deploy" / "podman" / "containers.conf"
VENV_BIN = ROOT / ".venv" / "bin"
# compose.yaml's services without a profile, in the order their dependencies start them.
SERVICES = (
    "nats",
    "postgres",
    "jaeger",
    "otel-collector",
    "prometheus",
    "grafana",
    "placement",
    "probe",
    "executor",
    "web",
)
# Who must be up before whom (compose.yaml's depends_on).
STARTS_AFTER = {
    "placement": ("nats", "postgres"),
    "probe": ("nats", "placement"),
    "executor": ("nats", "placement"),
    "web": ("nats", "placement"),
}
T = TypeVar("T")


class DeployTestError(Exception):
    pass


def log(msg: str) -> None:
    print(f"deploy-test: {msg}", file=sys.stderr, flush=True)


def podman_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["CONTAINERS_CONF"] = str(CONTAINERS_CONF)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra or {})
    return env


def run(
    args: Sequence[str | Path],
    *,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    timeout: float = 300,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``args``, its output captured; a failure raises with the command and what it printed."""
    try:
        done = subprocess.run(
            [str(a) for a in args],
            env=dict(env) if env is not None else podman_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise DeployTestError(f"{' '.join(map(str, args))}: no answer in {timeout:.0f} s") from err
    if check and done.returncode != 0:
        raise DeployTestError(
            f"{' '.join(map(str, args))}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        )
    return done


def until(what: str, probe: Callable[[], T | None], timeout: float, every: float = 0.5) -> T:
    """``probe()`` again until it returns something (not None), for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = probe()
        except (DeployTestError, OSError, ValueError) as err:
            value, last_error = None, err
        if value is not None:
            return value
        if time.monotonic() > deadline:
            detail = f"; last error: {last_error}" if last_error else ""
            raise DeployTestError(f"waited {timeout:.0f} s for {what}{detail}")
        time.sleep(every)


@dataclass
class Stack:
    """The compose stack of this test: its deploy/ copy, project and compose files."""

    deploy: Path
    project: str = PROJECT
    files: tuple[Path, ...] = (HERE / "compose.stand-ins.yaml",)
    summary: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return podman_env(
            {
                "COMPOSE": f"podman-compose -p {self.project}",
                "TLS": "1",
                "GPULAYER_STAND_INS": str(HERE / "stand-ins"),
            }
        )

    def file_args(self) -> list[str]:
        return [a for f in self.files for a in ("-f", str(f))]

    def up(self) -> None:
        args: list[str | Path] = [self.deploy / "up", *self.file_args()]
        run(args, env=self.env(), timeout=600)

    def down(self, volumes: bool = False) -> None:
        args: list[str | Path] = [self.deploy / "down", *(["-v"] if volumes else [])]
        args += self.file_args()
        run(args, env=self.env(), timeout=300)

    def cli_env(self, creds: str) -> dict[str, str]:
        """What a user's shell on this host sets to reach the stack: TLS with the stack's CA."""
        return podman_env(
            {
                "GPULAYER_NATS_URL": "tls://127.0.0.1:4222",
                "GPULAYER_NATS_TLS_CA": str(self.deploy / "tls" / "ca.pem"),
                "GPULAYER_NATS_CREDS": str(self.deploy / "auth" / "creds" / creds),
            }
        )

    def gpulayer(self, creds: str, *args: str, timeout: float = 60) -> str:
        return run(["gpulayer", *args], env=self.cli_env(creds), timeout=timeout).stdout

    def auth(self, *args: str) -> str:
        """``gpulayer auth`` in the stack's auth folder, reaching the running servers over TLS."""
        env = self.cli_env("placement.creds")
        return run(["gpulayer", "auth", "--dir", str(self.deploy / "auth"), *args], env=env).stdout

    def containers(self) -> dict[str, dict[str, Any]]:
        """Each service's container, inspected."""
        names = run(
            [
                "podman",
                "ps",
                "-a",
                "--format",
                "{{.Names}}",
                "--filter",
                f"label=io.podman.compose.project={self.project}",
            ]
        ).stdout.split()
        if not names:
            return {}
        found = json.loads(run(["podman", "inspect", *names]).stdout)
        by_service: dict[str, dict[str, Any]] = {}
        for c in found:
            service = c["Config"]["Labels"].get("com.docker.compose.service")
            if service:
                by_service[service] = c
        return by_service

    def volumes(self) -> list[str]:
        return run(
            [
                "podman",
                "volume",
                "ls",
                "--format",
                "{{.Name}}",
                "--filter",
                f"label=io.podman.compose.project={self.project}",
            ]
        ).stdout.split()


def submit(stack: Stack, creds: str, job: Mapping[str, object], wait: bool = True) -> str:
    """Submit ``job`` (a job file's fields) as ``creds``; with ``wait``, until it ends (its
    events printed on failure)."""
    path = WORK / f"{job['job_id']}.json"
    path.write_text(json.dumps(job))
    args = ["submit", *(["--wait"] if wait else []), str(path)]
    return stack.gpulayer(creds, *args, timeout=180)


def job_record(stack: Stack, creds: str, job_id: str) -> dict[str, object]:
    record: dict[str, object] = json.loads(stack.gpulayer(creds, "job", "--json", job_id))
    return record


def event_types(record: Mapping[str, object]) -> list[str]:
    events = record.get("events") or []
    assert isinstance(events, list)
    return [str(e.get("type")) for e in events if isinstance(e, dict)]


def nodes(stack: Stack, creds: str) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in json.loads(stack.gpulayer(creds, "nodes", "--json"))}


# ---- the steps ------------------------------------------------------------------------------


def build_image() -> str:
    start = time.monotonic()
    done = run(["bash", ROOT / "deploy/image/build"], timeout=1800)
    seconds = time.monotonic() - start
    version = run(
        ["podman", "run", "--rm", "localhost/gpulayer:dev", "gpulayer", "--version"]
    ).stdout.split()[-1]
    cached = "up to date" in done.stderr
    log(f"image localhost/gpulayer:{version} {'cached' if cached else 'built'} in {seconds:.0f} s")
    return version


def clean(stack: Stack) -> None:
    """What an earlier run left: its project's containers and volumes, and the copy."""
    if stack.containers() or stack.volumes():
        log(f"removing what an earlier run left of {stack.project}")
        if (stack.deploy / "up").exists():
            stack.down(volumes=True)
        for name in stack.volumes():
            run(["podman", "volume", "rm", "-f", name], check=False)
    shutil.rmtree(WORK, ignore_errors=True)


def copy_deploy(stack: Stack) -> None:
    """deploy/ as a clone has it: no .env, auth, keys or tls of the checkout's own."""
    shutil.copytree(
        ROOT / "deploy",
        stack.deploy,
        ignore=shutil.ignore_patterns(".env", "auth", "keys", "tls", "__pycache__"),
    )


def healthy(stack: Stack) -> int:
    """Every service's container running; those with a healthcheck pass it (podman 4.3 runs no
    healthcheck by itself without systemd, and podman-compose then doesn't wait on one: it is
    run here); started in compose.yaml's order. Returns how many services."""

    def every_container() -> dict[str, dict[str, Any]] | None:
        found = stack.containers()
        return found if set(SERVICES) <= set(found) else None

    containers = until("every service's container", every_container, timeout=60)
    for service in SERVICES:
        name = str(containers[service]["Name"])

        def running(name: str = name) -> bool | None:
            state = json.loads(run(["podman", "inspect", name]).stdout)[0]["State"]
            return True if state["Status"] == "running" else None

        def passes(name: str = name) -> bool | None:
            check = run(["podman", "healthcheck", "run", name], check=False)
            return True if check.returncode == 0 else None

        until(f"{service} running", running, timeout=60)
        if containers[service]["Config"].get("Healthcheck"):
            until(f"{service}'s healthcheck", passes, timeout=90, every=1)
    containers = stack.containers()
    started = {s: str(containers[s]["State"]["StartedAt"]) for s in SERVICES}
    for service, before in STARTS_AFTER.items():
        for other in before:
            if started[other] > started[service]:
                raise DeployTestError(
                    f"{service} started at {started[service]}, before {other} "
                    f"({started[other]}): compose.yaml's start order not kept"
                )
    return len(SERVICES)


def compose_phase(stack: Stack) -> int:
    stack.up()
    count = healthy(stack)
    log(f"compose services healthy {count}/{len(SERVICES)}, in their start order")
    stack.auth("add-user", "alice")
    node = until(
        "compose-node online in `gpulayer nodes` (as alice)",
        lambda: nodes(stack, "user-alice.creds").get("compose-node") or None,
        timeout=60,
    )
    if not node.get("online") or node.get("executor") != "up":
        raise DeployTestError(f"compose-node: {node}")
    submit(
        stack,
        "user-alice.creds",
        {"job_id": "compose-hello", "command": ["sh", "-c", "echo hello"]},
    )
    record = job_record(stack, "user-alice.creds", "compose-hello")
    if event_types(record)[-1] != "succeeded":
        raise DeployTestError(f"compose-hello: {event_types(record)}")
    with urllib.request.urlopen("http://127.0.0.1:8470/", timeout=10) as page:
        body = page.read().decode()
    if page.status != 200 or "compose-node" not in body:
        raise DeployTestError(f"fleet page: {page.status}, compose-node not on it")
    log(
        "a user's job from the host succeeded; `gpulayer nodes` and the fleet page show compose-node"
    )
    return count


def keep_phase(stack: Stack, jobs: Sequence[str], revoked: str | None) -> None:
    """down, then up: jobs, their events and credentials are kept; down -v removes them."""
    before = {j: event_types(job_record(stack, "user-alice.creds", j)) for j in jobs}
    stack.down()
    if stack.containers():
        raise DeployTestError(f"containers left after down: {sorted(stack.containers())}")
    stack.up()
    healthy(stack)
    after = until(
        "the jobs' records after down and up",
        lambda: {j: event_types(job_record(stack, "user-alice.creds", j)) for j in jobs},
        timeout=60,
    )
    if after != before:
        raise DeployTestError(f"jobs changed across down/up: {before} -> {after}")
    if revoked is not None:
        creds = str(stack.deploy / "auth" / "creds" / revoked)
        env = stack.cli_env("user-alice.creds") | {"GPULAYER_NATS_CREDS": creds}
        done = run(["gpulayer", "nodes"], env=env, check=False, timeout=60)
        if done.returncode == 0:
            raise DeployTestError(f"{revoked} works again after down/up: its revocation was lost")
    log(
        f"down/up kept {len(jobs)} jobs with their events, alice's credential"
        + (f", and {revoked}'s revocation" if revoked else "")
    )
    stack.down(volumes=True)
    if stack.volumes():
        raise DeployTestError(f"volumes left after down -v: {stack.volumes()}")
    log("down -v removed the volumes")


def main(argv: Sequence[str]) -> int:
    stack = Stack(deploy=WORK / "deploy")
    if list(argv) == ["--clean"]:
        clean(stack)
        return 0
    if shutil.which("podman") is None:
        log("podman is needed (apt-get install podman runc)")
        return 1
    version = build_image()
    clean(stack)
    WORK.mkdir(parents=True, exist_ok=True)
    copy_deploy(stack)
    try:
        services = compose_phase(stack)
        jobs = ["compose-hello"]
        keep_phase(stack, jobs, revoked=None)
    except DeployTestError as err:
        log(f"FAILED: {err}")
        log(f"left up for a look: podman ps; {stack.deploy}; make deploy-test-clean removes it")
        return 1
    print(
        f"deploy-test: passed: image localhost/gpulayer:{version}, compose services healthy "
        f"{services}/{len(SERVICES)}, state kept across down/up"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

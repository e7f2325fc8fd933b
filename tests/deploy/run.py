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

from tests.deploy import nodes as fleet

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
TERMINAL = {"succeeded", "failed", "cancelled", "lost", "rejected"}
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
    env = env if env is not None else podman_env()
    return fleet.command(
        args, env=env, check=check, timeout=timeout, cwd=cwd, error=DeployTestError
    )


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
    restarts = {s: int(containers[s].get("RestartCount") or 0) for s in SERVICES}
    if any(restarts.values()):
        # podman 4.3 doesn't hold a service back until its dependencies are healthy: one that
        # started before NATS or PostgreSQL answered exited and its restart policy ran it again.
        log(
            "restarted while the servers came up: "
            + ", ".join(f"{s} {n}x" for s, n in restarts.items() if n)
        )
    started = {s: str(containers[s]["State"]["StartedAt"]) for s in SERVICES}
    for service, before in STARTS_AFTER.items():
        for other in before:
            if started[other] > started[service]:
                raise DeployTestError(
                    f"{service} started at {started[service]}, before {other} "
                    f"({started[other]}): compose.yaml's start order not kept"
                )
    return len(SERVICES)


def refuses_without_env(stack: Stack) -> None:
    """compose itself, before deploy/up made deploy/.env: it refuses, naming the command to
    run, and starts nothing."""
    compose: list[str | Path] = [
        "podman-compose",
        "-p",
        stack.project,
        "-f",
        stack.deploy / "compose.yaml",
    ]
    done = run([*compose, "up", "-d"], env=stack.env(), check=False, timeout=120)
    said = done.stdout + done.stderr
    if done.returncode == 0 and "run deploy/gen-env first" not in said:
        raise DeployTestError(f"compose without deploy/.env did not refuse:\n{said}")
    if "run deploy/gen-env first" not in said:
        raise DeployTestError(
            f"compose without deploy/.env refused without naming gen-env:\n{said}"
        )
    if stack.containers():
        raise DeployTestError(f"compose without deploy/.env started {sorted(stack.containers())}")
    log("compose without deploy/.env refuses: " + said.strip().splitlines()[-1][-80:])


def compose_phase(stack: Stack) -> int:
    refuses_without_env(stack)
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


def job_node(record: Mapping[str, Any]) -> str:
    """The node the job ran on, from its ``running`` event."""
    for event in record.get("events") or []:
        if event.get("type") == "running" and event.get("node_id"):
            return str(event["node_id"])
    raise DeployTestError(f"no running event with a node: {event_types(record)}")


def output(stack: Stack, creds: str, job_id: str) -> str:
    return stack.gpulayer(creds, "logs", job_id).strip()


def ran_where_granted(stack: Stack, job: dict[str, Any]) -> str:
    """Submit ``job``, whose command prints its host's name, as alice; it succeeds, on the node
    placement granted it (its output names that host). Returns the node."""
    submit(stack, "user-alice.creds", job)
    record = job_record(stack, "user-alice.creds", str(job["job_id"]))
    if event_types(record)[-1] != "succeeded":
        raise DeployTestError(f"{job['job_id']}: {event_types(record)}")
    node = job_node(record)
    said = output(stack, "user-alice.creds", str(job["job_id"]))
    if not said.startswith(node):
        raise DeployTestError(f"{job['job_id']} was granted {node} but ran on {said!r}")
    return node


def placement_keys(stack: Stack) -> str:
    for line in (stack.deploy / ".env").read_text().splitlines():
        if line.startswith("GPULAYER_PLACEMENT_PUBLIC_KEYS="):
            return line.split("=", 1)[1]
    raise DeployTestError(f"no GPULAYER_PLACEMENT_PUBLIC_KEYS in {stack.deploy / '.env'}")


@dataclass
class Fleet:
    """What the nodes phase counts for the closing line."""

    joined: int = 0
    jobs: list[str] = field(default_factory=list)
    restarts: int = 0


def online(stack: Stack, node_id: str, want: bool = True) -> Callable[[], dict[str, Any] | None]:
    def probe() -> dict[str, Any] | None:
        node = nodes(stack, "user-alice.creds").get(node_id)
        if want:
            return node if node and node.get("online") and node.get("executor") == "up" else None
        return node if node is not None and not node.get("online") else None

    return probe


def nodes_phase(stack: Stack, result: Fleet) -> None:
    """Two nodes on hosts of their own join over TLS; jobs land where they should; the
    executor restarts under a running job; a stopped probe takes its node offline; a node
    without the CA, and a revoked one, are refused and their journals say why."""
    start = time.monotonic()
    fleet.make_host_image()
    # With the caller's PATH: the wheels are for the machine's python3, not the venv's.
    run(["make", "-s", "wheels"], env=os.environ, timeout=900, cwd=ROOT)
    log(f"node host image and wheels ready in {time.monotonic() - start:.0f} s")
    # The fleet's nodes are hosts of their own: compose's node (probe and executor in the
    # control plane's host) is stopped, so every job goes to them.
    run(
        [
            "podman",
            "stop",
            "--time",
            "10",
            *(f"{stack.project}_{s}_1" for s in ("probe", "executor")),
        ]
    )
    network = f"{stack.project}_control"
    ca = stack.deploy / "tls" / "ca.pem"
    keys = placement_keys(stack)
    for name in ("gpu-node", "cpu-node"):
        stack.auth("add-node", name)
    creds = {
        n: stack.deploy / "auth" / "creds" / f"node-{n}.creds" for n in ("gpu-node", "cpu-node")
    }
    gpu = fleet.start_node(
        f"{stack.project}-gpu-node", "gpu-node", network, files=fleet.fake_gpu_files(WORK)
    )
    cpu = fleet.start_node(f"{stack.project}-cpu-node", "cpu-node", network)
    nats_url = "tls://nats:4222"
    # First without the CA: NATS's certificate can't be checked, and the node says so.
    since = time.time()
    fleet.install(cpu, nats_url=nats_url, creds=creds["cpu-node"], placement_keys=keys, ca=None)
    line = fleet.wait_journal(cpu, "gpulayer-probe", "CERTIFICATE_VERIFY_FAILED", since=since)
    if "cpu-node" in nodes(stack, "user-alice.creds"):
        raise DeployTestError("cpu-node joined without the CA")
    log(f"a node without the CA is refused; its journal: {line.strip()[-120:]}")
    for node in (cpu, gpu):
        fleet.install(
            node, nats_url=nats_url, creds=creds[node.hostname], placement_keys=keys, ca=ca
        )
        fleet.wait_active(node)
    for node in (cpu, gpu):
        until(f"{node.hostname} online over TLS", online(stack, node.hostname), timeout=90)
    until("compose-node offline", online(stack, "compose-node", want=False), timeout=60)
    result.joined = 2
    log("gpu-node and cpu-node joined over TLS (systemd units, installed from the wheels)")

    cuda = {
        "job_id": "fleet-cuda",
        "command": ["sh", "-c", "echo $(hostname) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"],
        "requirements": {"accelerator": "cuda", "gpu_count": 1},
        # What the job's processes may open of its GPU (examples/cuda-a100-class.toml).
        "sandbox": {"devices": {"gpu": "compute"}},
    }
    if ran_where_granted(stack, cuda) != "gpu-node":
        raise DeployTestError("the CUDA job ran elsewhere than the node with the GPU")
    if "CUDA_VISIBLE_DEVICES=0" not in output(stack, "user-alice.creds", "fleet-cuda"):
        raise DeployTestError(f"fleet-cuda: {output(stack, 'user-alice.creds', 'fleet-cuda')}")
    result.jobs.append("fleet-cuda")
    # CPU jobs spread over the nodes that fit (placement starts each match one node further):
    # submitted one after another, one lands on cpu-node within two.
    where: list[str] = []
    for i in range(4):
        job_id = f"fleet-cpu-{i}"
        where.append(ran_where_granted(stack, {"job_id": job_id, "command": ["hostname"]}))
        result.jobs.append(job_id)
        if where[-1] == "cpu-node":
            break
    else:
        raise DeployTestError(f"no CPU job ran on cpu-node: {where}")
    log(f"the CUDA job ran on gpu-node; CPU jobs on {', '.join(where)}")

    # An executor restarted under a running job: the job goes on, and ends once.
    submit(
        stack, "user-alice.creds", {"job_id": "fleet-sleep", "command": ["sleep", "12"]}, wait=False
    )
    record = until(
        "fleet-sleep running",
        lambda: (
            r
            if "running" in event_types(r := job_record(stack, "user-alice.creds", "fleet-sleep"))
            else None
        ),
        timeout=60,
    )
    host = {"gpu-node": gpu, "cpu-node": cpu}[job_node(record)]
    since = time.time()
    fleet.systemctl(host, "restart", "gpulayer-executor")
    fleet.wait_journal(host, "gpulayer-executor", "re-attaching", since=since)
    done = until(
        "fleet-sleep ended",
        lambda: (
            r
            if event_types(r := job_record(stack, "user-alice.creds", "fleet-sleep"))[-1]
            in TERMINAL
            else None
        ),
        timeout=60,
    )
    types = event_types(done)
    if types.count("running") != 1 or [t for t in types if t in TERMINAL] != ["succeeded"]:
        raise DeployTestError(f"fleet-sleep across the executor's restart: {types}")
    result.restarts = 1
    result.jobs.append("fleet-sleep")
    log(
        f"systemctl restart gpulayer-executor on {host.hostname} under a running job: it ended once, succeeded"
    )

    # A stopped probe: its node goes offline.
    fleet.systemctl(cpu, "stop", "gpulayer-probe")
    until(
        "cpu-node offline after its probe stopped",
        online(stack, "cpu-node", want=False),
        timeout=90,
    )
    log("systemctl stop gpulayer-probe took cpu-node offline")
    # A revoked node: the servers close its connections, and its journal says why.
    since = time.time()
    stack.auth("revoke", "node", "gpu-node")
    line = fleet.wait_journal(gpu, "gpulayer-probe", "authentication revoked", since=since)
    log(f"a revoked node is refused; its journal: {line.strip()[-120:]}")
    for node in (gpu, cpu):
        fleet.remove_node(node)


def refused(stack: Stack, creds: Path) -> str | None:
    """What the CLI says when the server refuses ``creds`` (None: it was let in)."""
    env = stack.cli_env("user-alice.creds") | {"GPULAYER_NATS_CREDS": str(creds)}
    done = run(["gpulayer", "jobs"], env=env, check=False, timeout=60)
    if done.returncode == 0:
        return None
    said = (done.stderr or done.stdout).strip()
    if "no such file" in said:
        raise DeployTestError(f"{creds}: {said}")
    return said


def revoke_a_user(stack: Stack) -> Path:
    """mallory's credential works, then is revoked and refused: a copy of it, as one that
    leaked would be (revoke deletes the auth folder's own). keep_phase checks that the
    revocation outlives down/up."""
    stack.auth("add-user", "mallory")
    copy = WORK / "mallory-leaked.creds"
    shutil.copy(stack.deploy / "auth" / "creds" / "user-mallory.creds", copy)
    if (said := refused(stack, copy)) is not None:
        raise DeployTestError(f"mallory's new credential refused: {said}")
    stack.auth("revoke", "user", "mallory")
    said = until("mallory refused", lambda: refused(stack, copy), timeout=30)
    log(f"mallory's revoked credential is refused: {said[-200:]}")
    return copy


def keep_phase(stack: Stack, jobs: Sequence[str], revoked: Path | None) -> None:
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
    if revoked is not None and refused(stack, revoked) is None:
        raise DeployTestError(f"{revoked} works again after down/up: its revocation was lost")
    log(
        f"down/up kept {len(jobs)} jobs with their events, alice's credential"
        + (f", and the revocation of {revoked.name}" if revoked else "")
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
    result = Fleet()
    try:
        services = compose_phase(stack)
        nodes_phase(stack, result)
        revoked = revoke_a_user(stack)
        keep_phase(stack, ["compose-hello", *result.jobs], revoked=revoked)
    except (DeployTestError, fleet.NodeError) as err:
        log(f"FAILED: {err}")
        log(f"left up for a look: podman ps; {stack.deploy}; make deploy-test-clean removes it")
        return 1
    if os.environ.get("KEEP") != "1":
        clean(stack)
    print(
        f"deploy-test: passed: image localhost/gpulayer:{version}, compose services healthy "
        f"{services}/{len(SERVICES)}, nodes joined {result.joined} over TLS, jobs succeeded "
        f"{1 + len(result.jobs)}, executor restarts survived {result.restarts}, state kept "
        "across down/up"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

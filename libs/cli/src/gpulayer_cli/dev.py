"""``gpulayer dev up``: the whole stack on this machine, no Docker.

Starts nats-server and PostgreSQL from their wheels (unless GPULAYER_NATS_URL /
GPULAYER_DATABASE_URL point elsewhere), the three services as separate processes, submits the
example jobs and prints their events.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import msgspec
from rich.console import Console

from gpulayer_cli.client import follow_events, submit
from gpulayer_cli.render import event_tag, print_event
from gpulayer_contracts import InvalidInput, JobEvent, JobRequest, is_terminal, load_job_file
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.servers import (
    EmbeddedNats,
    EmbeddedPostgres,
    ServerStartError,
    preferred_port,
)
from gpulayer_runtime.settings import DEFAULT_NATS_URL, default_node_id
from gpulayer_runtime.signing import (
    PUBLIC_KEYS_SETTING,
    SIGNING_KEY_SETTING,
    generate_key_pair,
    signing_required,
)

SERVICES = ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe")


@dataclass
class Example:
    path: Path
    job: JobRequest
    expect: str


@dataclass
class Stack:
    data_dir: Path
    nats_url: str = ""
    database_url: str = ""
    node_id: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    servers: list[EmbeddedNats | EmbeddedPostgres] = field(default_factory=list)


def load_examples(folder: Path, run_tag: str) -> list[Example]:
    """Job files in ``folder`` with the outcome ``expectations.toml`` names for each.

    Each run gets fresh job ids (``<id>-<run_tag>``): a job id is the dedupe key, so re-running
    the examples against the same stack would otherwise be one job.
    """
    expectations = tomllib.loads((folder / "expectations.toml").read_text())["expect"]
    examples = []
    for path in sorted(folder.iterdir()):
        if path.suffix not in (".toml", ".json") or path.name == "expectations.toml":
            continue
        job = load_job_file(path)
        expect = expectations.get(path.name)
        if expect is None:
            raise InvalidInput(
                f"{path.name}: no expected outcome in {folder / 'expectations.toml'}"
            )
        job = msgspec.structs.replace(job, job_id=f"{job.job_id}-{run_tag}")
        examples.append(Example(path=path, job=job, expect=expect))
    return examples


def _bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _cli_command() -> str:
    """How to call this CLI from another shell: ``gpulayer`` when that is what PATH finds, else
    its path (``.venv/bin/gpulayer`` after ``make run``, with no virtualenv activated)."""
    ours = Path(_bin("gpulayer"))
    found = shutil.which("gpulayer")
    if found is not None and Path(found).resolve() == ours.resolve():
        return "gpulayer"
    with contextlib.suppress(ValueError):
        return str(ours.relative_to(Path.cwd()))
    return str(ours)


async def _ensure_database(url: str) -> None:
    """Create the database named in ``url`` if the server lacks it."""
    base, _, name = url.rpartition("/")
    try:
        conn = await asyncpg.connect(url)
        await conn.close()
        return
    except asyncpg.InvalidCatalogNameError:
        pass
    admin = await asyncpg.connect(f"{base}/postgres")
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


NATS_DEFAULT_PORT = 4222


def start_stack(data_dir: Path, console: Console, env: dict[str, str]) -> Stack:
    """Start the embedded servers the environment doesn't point at. If one fails to start, the
    ones already started are stopped before ServerStartError propagates."""
    stack = Stack(data_dir=data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "logs").mkdir(exist_ok=True)
    try:
        _start_servers(stack, data_dir, env)
    except BaseException:
        stop_stack(stack, console)
        raise
    stack.node_id = env.get("GPULAYER_NODE_ID") or default_node_id()
    console.print(f"NATS        [bold]{stack.nats_url}[/bold]")
    console.print(f"PostgreSQL  [bold]{stack.database_url}[/bold]")
    console.print(f"node        [bold]{stack.node_id}[/bold]")
    return stack


def _start_servers(stack: Stack, data_dir: Path, env: dict[str, str]) -> None:
    if env.get("GPULAYER_NATS_URL"):
        stack.nats_url = env["GPULAYER_NATS_URL"]
    else:
        # NATS on its usual port when it is free, so the CLI's default URL reaches it.
        nats = EmbeddedNats(data_dir / "nats", port=preferred_port(NATS_DEFAULT_PORT))
        stack.servers.append(nats)  # before start: a half-started server is stopped too
        stack.nats_url = nats.start().url
    if env.get("GPULAYER_DATABASE_URL"):
        stack.database_url = env["GPULAYER_DATABASE_URL"]
    else:
        pg = EmbeddedPostgres(data_dir / "postgres")
        stack.servers.append(pg)
        stack.database_url = pg.start().url.rsplit("/", 1)[0] + "/gpulayer"


def start_services(stack: Stack, console: Console, env: dict[str, str]) -> None:
    child_env = dict(env)
    child_env.update(
        GPULAYER_NATS_URL=stack.nats_url,
        GPULAYER_DATABASE_URL=stack.database_url,
        GPULAYER_NODE_ID=stack.node_id,
    )
    child_env.setdefault("GPULAYER_EXECUTOR_WORKDIR", str(stack.data_dir / "executor"))
    own = signing_settings(stack.data_dir, env)
    for name in SERVICES:
        log_path = stack.data_dir / "logs" / f"{name}.log"
        with open(log_path, "ab") as log:
            stack.procs[name] = subprocess.Popen(
                [_bin(name)],
                env={**child_env, **own.get(name, {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        console.print(f"started {name} (pid {stack.procs[name].pid}, log {log_path})")


def signing_settings(data_dir: Path, env: dict[str, str]) -> dict[str, dict[str, str]]:
    """Grant signing settings per service: placement gets the seed file, the executor the
    public key, nobody else either. The key pair is made under ``data_dir/keys`` on first run;
    a signing key or public keys set in the environment are used as they are instead."""
    if not signing_required(env) or SIGNING_KEY_SETTING in env or PUBLIC_KEYS_SETTING in env:
        return {}
    seed, public = generate_key_pair(data_dir / "keys")
    return {
        "gpulayer-placement": {SIGNING_KEY_SETTING: str(seed)},
        "gpulayer-executor": {PUBLIC_KEYS_SETTING: public},
    }


def stop_stack(stack: Stack, console: Console) -> None:
    for proc in stack.procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for name, proc in stack.procs.items():
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            console.print(f"{name} did not stop in time; killing it")
            proc.kill()
            proc.wait()
    for server in reversed(stack.servers):
        server.stop()


def _crashed(stack: Stack) -> Iterator[str]:
    for name, proc in stack.procs.items():
        if proc.poll() is not None:
            yield f"{name} exited with {proc.returncode} (log: {stack.data_dir / 'logs' / (name + '.log')})"


def _settled(example: Example, event: JobEvent) -> bool:
    """The example reached its expected outcome, or an outcome it can't move on from."""
    tag = event_tag(event)
    return tag == example.expect or is_terminal(event)


def run_dev(
    *, once: bool, examples_dir: Path, data_dir: Path, timeout_s: float, console: Console
) -> int:
    env = dict(os.environ)
    run_tag = time.strftime("%H%M%S")
    try:
        examples = load_examples(examples_dir, run_tag) if examples_dir.exists() else []
    except (InvalidInput, OSError, KeyError, tomllib.TOMLDecodeError) as err:
        console.print(f"[bold red]examples in {examples_dir} are invalid:[/] {err}")
        return 2
    try:
        stack = start_stack(data_dir, console, env)
    except (ServerStartError, OSError) as err:
        console.print(f"[bold red]could not start the stack in {data_dir}:[/] {err}")
        return 1
    try:
        return asyncio.run(
            _run(stack, examples, env, once=once, timeout_s=timeout_s, console=console)
        )
    finally:
        console.print("stopping the stack")
        stop_stack(stack, console)


async def _run(
    stack: Stack,
    examples: list[Example],
    env: dict[str, str],
    *,
    once: bool,
    timeout_s: float,
    console: Console,
) -> int:
    await _ensure_database(stack.database_url)
    start_services(stack, console, env)
    nc = await connect(stack.nats_url, "gpulayer-dev")
    try:
        await ensure_streams(nc.jetstream())
        # Ready means placement answers and knows this machine: before the examples, and
        # before "serving" tells someone to use the stack.
        await _wait_for_node(nc, stack, console)
        ok = await _run_examples(
            nc, stack, examples, once=once, timeout_s=timeout_s, console=console
        )
        if once:
            return 0 if ok else 1
        console.print("serving; publish jobs to [bold]gpulayer.jobs.submit[/bold]. Ctrl-C stops.")
        cli = _cli_command()
        if stack.nats_url == DEFAULT_NATS_URL:
            console.print(f"in another shell: [bold]{cli} nodes[/bold], [bold]{cli} jobs[/bold]")
        else:
            console.print(
                f"in another shell: [bold]export GPULAYER_NATS_URL={stack.nats_url}[/bold], "
                f"then [bold]{cli} nodes[/bold], [bold]{cli} jobs[/bold]"
            )
        await _serve(nc, stack, console)
        return 0
    finally:
        await nc.drain()


async def _run_examples(
    nc: object,
    stack: Stack,
    examples: list[Example],
    *,
    once: bool,
    timeout_s: float,
    console: Console,
) -> bool:
    if not examples:
        return True
    by_id = {e.job.job_id: e for e in examples}
    for e in examples:
        console.print(
            f"submitting {e.path.name} as [bold]{e.job.job_id}[/bold] (expect: {e.expect})"
        )
        await submit(nc, e.job)  # type: ignore[arg-type]
    outcome: dict[str, str] = {}

    async def watch() -> None:
        async for event in follow_events(
            nc,  # type: ignore[arg-type]
            list(by_id),
            stop_when=lambda ev: _settled(by_id[ev.job_id], ev),
        ):
            print_event(console, event)
            if _settled(by_id[event.job_id], event):
                outcome[event.job_id] = event_tag(event)

    async def health() -> None:
        while True:
            crashed = list(_crashed(stack))
            if crashed:
                raise RuntimeError("; ".join(crashed))
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    checker = asyncio.create_task(health())
    done, _ = await asyncio.wait(
        {watcher, checker}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    for task in (watcher, checker):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if checker in done and checker.exception():
        console.print(f"[bold red]a service stopped:[/] {checker.exception()}")
        return False
    good = True
    for job_id, e in by_id.items():
        got = outcome.get(job_id, "no outcome within timeout")
        mark = "[green]ok[/]" if got == e.expect else "[bold red]UNEXPECTED[/]"
        console.print(f"{mark} {e.path.name}: expected {e.expect}, got {got}")
        good &= got == e.expect
    return good


async def _wait_for_node(
    nc: object, stack: Stack, console: Console, timeout_s: float = 30.0
) -> None:
    """Wait until placement answers and knows this machine (the examples are matched against
    it; "serving" should mean usable)."""
    from gpulayer_cli.client import ApiUnavailable, api
    from gpulayer_contracts.subjects import API_NODES

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        crashed = list(_crashed(stack))
        if crashed:
            raise RuntimeError("; ".join(crashed))
        with contextlib.suppress(ApiUnavailable):
            nodes = await api(nc, API_NODES, timeout=1.0)  # type: ignore[arg-type]
            if any(n["node_id"] == stack.node_id for n in nodes):
                console.print(f"placement knows node {stack.node_id}")
                return
        await asyncio.sleep(0.1)
    console.print(
        f"[yellow]node {stack.node_id} not registered after {timeout_s:g}s; submitting anyway[/]"
    )


async def _serve(nc: object, stack: Stack, console: Console) -> None:
    from gpulayer_contracts.codec import event_decoder

    async def cb(msg: object) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            print_event(console, event_decoder.decode(msg.data))  # type: ignore[attr-defined]

    await nc.subscribe("gpulayer.job.*.events", cb=cb)  # type: ignore[attr-defined]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        crashed = list(_crashed(stack))
        if crashed:
            console.print(f"[bold red]a service stopped:[/] {'; '.join(crashed)}")
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)

"""``gpulayer dev up``: the whole stack on this machine, no Docker.

Starts nats-server and PostgreSQL from their wheels (unless GPULAYER_NATS_URL /
GPULAYER_DATABASE_URL point elsewhere), the three services as separate processes, submits the
example jobs and prints their events.

NATS is locked by default: the first run makes an operator, an account and a credential per role
under ``<data dir>/auth`` (kept for later runs), starts nats-server with that config and gives
each service its own credential. ``--no-auth`` or ``GPULAYER_AUTH=off`` starts NATS open.
PostgreSQL is always locked (``gpulayer_runtime.pgserver``): placement alone gets its URL, as
the services' role, the password in a passfile the URL names.
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
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import msgspec
from rich.console import Console

from gpulayer_cli.client import follow_events, submit
from gpulayer_cli.dev_examples import (
    PROFILES,
    Example,
    load_examples,
    settled,
)
from gpulayer_cli.identity import DEFAULT_DATA_DIR, DEV_USER, auth_off, dev_store
from gpulayer_cli.render import event_tag, print_event
from gpulayer_contracts import InvalidInput
from gpulayer_contracts.subjects import ANONYMOUS, JOB_WILDCARD_EVENTS
from gpulayer_runtime.database import SERVICE_ROLE, replace_url
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.pgserver import EmbeddedPostgres
from gpulayer_runtime.servers import EmbeddedNats, ServerStartError, preferred_port
from gpulayer_runtime.settings import DEFAULT_NATS_URL, default_node_id, stream_replicas
from gpulayer_runtime.signing import (
    PUBLIC_KEYS_SETTING,
    SIGNING_KEY_SETTING,
    generate_key_pair,
    signing_required,
)

# dev up's own connection: it declares the streams and watches every job's events.
DEV_ADMIN = "admin"

SERVICES = ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe", "gpulayer-web")
# The fleet page's viewer credential (read-only), and its usual port.
WEB_VIEWER = "web"
WEB_DEFAULT_PORT = 8470


@dataclass
class Stack:
    data_dir: Path
    nats_url: str = ""
    database_url: str = ""
    node_id: str = ""
    # Credentials per service and for dev up itself; empty when NATS is open (auth off) or
    # external (the environment's GPULAYER_NATS_CREDS, if any, is passed on as it is).
    creds: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    servers: list[EmbeddedNats | EmbeddedPostgres] = field(default_factory=list)
    # The embedded PostgreSQL, when the stack started it.
    pg: EmbeddedPostgres | None = None
    web_url: str = ""
    web_host: str = "127.0.0.1"
    web_port: int = 0


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


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when it is under it."""
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


async def _ensure_database(url: str) -> None:
    """Create the database named in ``url`` if the server lacks it (a server of the
    environment's: GPULAYER_DATABASE_URL)."""
    try:
        conn = await asyncpg.connect(url)
        await conn.close()
        return
    except asyncpg.InvalidCatalogNameError:
        pass
    name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.lstrip("/"))
    admin = await asyncpg.connect(replace_url(url, database="postgres"))
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
    console.print(f"NATS        [bold]{stack.nats_url}[/bold]")
    console.print(f"PostgreSQL  [bold]{stack.database_url}[/bold]")
    if stack.pg is not None:
        console.print(
            f"            the services' role {SERVICE_ROLE}, its password in the passfile named "
            f"there; the superuser's in {_shown(stack.pg.passfile)} (both 0600)"
        )
    console.print(f"node        [bold]{stack.node_id}[/bold]")
    return stack


def _credentials(stack: Stack, data_dir: Path) -> Path:
    """The auth folder's server config, made on the first run; a credential per service (the
    node's named by this machine), an admin for dev up, and the user the CLI finds by itself."""
    store = dev_store(data_dir).init()
    stack.creds = {
        "gpulayer-placement": str(store.ensure("placement")),
        "gpulayer-executor": str(store.ensure("node", stack.node_id)),
        "gpulayer-probe": str(store.ensure("node", stack.node_id)),
        "dev": str(store.ensure("admin", DEV_ADMIN)),
        "user": str(store.ensure("user", DEV_USER)),
        "gpulayer-web": str(store.ensure("viewer", WEB_VIEWER)),
    }
    return store.server_conf


def _start_servers(stack: Stack, data_dir: Path, env: dict[str, str]) -> None:
    stack.node_id = env.get("GPULAYER_NODE_ID") or default_node_id()
    if env.get("GPULAYER_NATS_URL"):
        stack.nats_url = env["GPULAYER_NATS_URL"]
    else:
        auth_conf = None if auth_off(env) else _credentials(stack, data_dir)
        # NATS on its usual port when it is free, so the CLI's default URL reaches it.
        nats = EmbeddedNats(
            data_dir / "nats", port=preferred_port(NATS_DEFAULT_PORT), auth_conf=auth_conf
        )
        stack.servers.append(nats)  # before start: a half-started server is stopped too
        stack.nats_url = nats.start().url
    if env.get("GPULAYER_DATABASE_URL"):
        stack.database_url = env["GPULAYER_DATABASE_URL"]
    else:
        pg = EmbeddedPostgres(data_dir / "postgres")
        stack.servers.append(pg)
        stack.pg = pg.start()
        try:
            # The services' own role, no superuser: placement can't run programs or read the
            # server's files with its connection.
            stack.database_url = asyncio.run(pg.service_database())
        except (asyncpg.PostgresError, OSError) as err:
            raise ServerStartError(
                f"PostgreSQL in {pg.data_dir}: could not make the role and database of the "
                f"services: {err}"
            ) from None


def start_services(stack: Stack, console: Console, env: dict[str, str]) -> None:
    child_env = dict(env)
    child_env.update(
        GPULAYER_NATS_URL=stack.nats_url,
        GPULAYER_DATABASE_URL=stack.database_url,
        GPULAYER_NODE_ID=stack.node_id,
    )
    child_env.setdefault("GPULAYER_EXECUTOR_WORKDIR", str(stack.data_dir / "executor"))
    if stack.creds:
        child_env.setdefault("GPULAYER_ADMINS", DEV_ADMIN)
    own = signing_settings(stack.data_dir, env)
    # The fleet page on loopback, on its usual port when free (GPULAYER_WEB_PORT wins).
    host = env.get("GPULAYER_WEB_HOST") or "127.0.0.1"
    port = env.get("GPULAYER_WEB_PORT") or str(preferred_port(WEB_DEFAULT_PORT, host))
    own["gpulayer-web"] = {"GPULAYER_WEB_HOST": host, "GPULAYER_WEB_PORT": port}
    shown = f"[{host}]" if ":" in host else host
    stack.web_url = f"http://{shown}:{port}"
    # Looked for before "serving" (0: a port the page picks itself, or one it will refuse).
    stack.web_host, stack.web_port = host, int(port) if port.isdigit() else 0
    for name in SERVICES:
        log_path = stack.data_dir / "logs" / f"{name}.log"
        service_env = dict(child_env)
        if name in stack.creds:
            service_env["GPULAYER_NATS_CREDS"] = stack.creds[name]
        if name != "gpulayer-placement":  # the others never touch the database
            service_env.pop("GPULAYER_DATABASE_URL", None)
        with open(log_path, "ab") as log:
            stack.procs[name] = subprocess.Popen(
                [_bin(name)],
                env={**service_env, **own.get(name, {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        console.print(f"started {name} (pid {stack.procs[name].pid}, log {log_path})")
    console.print(f"web         [bold]{stack.web_url}[/bold]")


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


def run_dev(
    *,
    once: bool,
    examples_dir: Path,
    data_dir: Path,
    timeout_s: float,
    console: Console,
    auth: bool = True,
) -> int:
    env = dict(os.environ)
    if not auth:
        env["GPULAYER_AUTH"] = "off"
    if (examples_dir / PROFILES).is_file():
        env.setdefault("GPULAYER_PROFILES", str((examples_dir / PROFILES).resolve()))
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
    if stack.pg is None:
        await _ensure_database(stack.database_url)
    start_services(stack, console, env)
    nc = await connect(
        stack.nats_url,
        "gpulayer-dev",
        creds=stack.creds.get("dev") or env.get("GPULAYER_NATS_CREDS") or None,
    )
    try:
        await ensure_streams(nc.jetstream(), replicas=stream_replicas(env))
        # Ready means placement answers and knows this machine: before the examples, and
        # before "serving" tells someone to use the stack.
        await _wait_for_node(nc, stack, console)
        await _wait_for_web(stack, console)
        ok = await _run_examples(
            nc, stack, examples, once=once, timeout_s=timeout_s, console=console
        )
        if once:
            return 0 if ok else 1
        console.print(_serving_line(stack))
        console.print(_hint(stack))
        await _serve(nc, stack, console)
        return 0
    finally:
        await nc.drain()


def _serving_line(stack: Stack) -> str:
    if "user" not in stack.creds:
        return "serving; publish jobs to [bold]gpulayer.jobs.submit[/bold]. Ctrl-C stops."
    auth = Path(stack.creds["user"]).parent
    return (
        f"serving, locked: NATS wants credentials ({auth}: user-{DEV_USER}.creds for you, one "
        f"per service, admin-{DEV_ADMIN}.creds); as {DEV_USER}, publish jobs to "
        f"[bold]gpulayer.jobs.submit.{DEV_USER}[/bold]. Ctrl-C stops."
    )


def _hint(stack: Stack) -> str:
    """What another shell needs: the URL when NATS isn't on its usual port, the user's
    credential when the CLI won't find it by itself (a data folder other than ./.gpulayer)."""
    exports = []
    if stack.nats_url != DEFAULT_NATS_URL:
        exports.append(f"export GPULAYER_NATS_URL={stack.nats_url}")
    user = stack.creds.get("user")
    found_alone = dev_store(DEFAULT_DATA_DIR).creds_path("user", DEV_USER).absolute()
    if user and Path(user).absolute() != found_alone:
        exports.append(f"export GPULAYER_NATS_CREDS={user}")
    cli = _cli_command()
    then = "then " if exports else ""
    steps = "".join(f"[bold]{e}[/bold], " for e in exports)
    return f"in another shell: {steps}{then}[bold]{cli} nodes[/bold], [bold]{cli} jobs[/bold]"


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
    owner = DEV_USER if "user" in stack.creds else ANONYMOUS
    by_id = {e.job.job_id: e for e in examples}
    for e in examples:
        console.print(
            f"submitting {e.path.name} as [bold]{e.job.job_id}[/bold] (expect: {e.expect})"
        )
        # As the dev user when NATS is locked: the jobs are the user's, seen by the CLI as its own.
        await submit(nc, e.job, owner=owner)  # type: ignore[arg-type]
    outcome: dict[str, str] = {}

    async def watch() -> None:
        async for event in follow_events(
            nc,  # type: ignore[arg-type]
            list(by_id),
            stop_when=lambda ev: settled(by_id[ev.job_id], ev),
            owner=owner,
        ):
            print_event(console, event)
            if settled(by_id[event.job_id], event):
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


async def _wait_for_web(stack: Stack, console: Console, timeout_s: float = 30.0) -> None:
    """Wait until the fleet page listens (its URL was printed as it started): a short
    ``--once`` run ended before a slow start had it serving (and its log said nothing)."""
    host, port = stack.web_host, stack.web_port
    if not port:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        crashed = list(_crashed(stack))
        if crashed:
            raise RuntimeError("; ".join(crashed))
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.1)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
    console.print(f"[yellow]the fleet page did not answer within {timeout_s:g}s[/]")


async def _serve(nc: object, stack: Stack, console: Console) -> None:
    from gpulayer_contracts.codec import event_decoder

    async def cb(msg: object) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            print_event(console, event_decoder.decode(msg.data))  # type: ignore[attr-defined]

    await nc.subscribe(JOB_WILDCARD_EVENTS, cb=cb)  # type: ignore[attr-defined]
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

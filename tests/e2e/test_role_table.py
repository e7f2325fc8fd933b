"""The role table (``gpulayer_cli.role_table``, shown in docs/security.md) walked over one real
stack: placement, executor and probe as processes with their own credentials against a
nats-server with the generated auth config, and the ``gpulayer`` command line run with a user's,
a viewer's, an admin's and a node's credential. Every (command, role) cell must do what the table says:
``works`` exits as the command does, ``partial`` works and names on stderr the permission it
lacks, ``denied`` exits 4 with one line naming it, ``local`` works with NATS unreachable; never
a traceback or a bare ``nats: timeout``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client
from tests.helpers import Postgres, SecureNats, gpulayer, secure_server, secure_stack

from gpulayer_cli.client import ApiDenied, ApiFailed, api, follow_events, submit
from gpulayer_cli.denials import Denials, PermissionDenied, watch
from gpulayer_cli.role_table import ROLES_SHOWN, TABLE, Row
from gpulayer_contracts import HostInfo, JobRequest, WorkerCapabilities, __version__, encode
from gpulayer_contracts.subjects import ANONYMOUS, API_VERBS, api_subject
from gpulayer_runtime.auth import AuthStore
from gpulayer_runtime.nats import connect
from gpulayer_runtime.roles import Role

pytestmark = pytest.mark.e2e

NODE = "roles-node"
# Who acts in each role: the user alice, the read-only viewer eve, the admin root, the node's
# own credential. bob owns "another user's" jobs.
NAMES = {"user": "alice", "viewer": "eve", "admin": "root", "node": NODE}
SECRET = "hf_role_table_secret"
SLEEPERS = {o: (f"{o}-sleep", f"{o}-sleep-api") for o in ("alice", "bob", "root")}
DENIED = 4
# A node placement knows, silent for an hour: what `node forget` may release (nothing held).
GHOST = "roles-ghost"
# Long enough that a user's doctor waiting for the probe's answer (before issue 31: it waited
# this long, then said "no probe answered") is told from one refused at once.
DOCTOR_TIMEOUT_S = 45


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stack's folder, where the cells write their job files, keys and goldens."""
    return tmp_path_factory.mktemp("roles")


@pytest.fixture(scope="module")
async def stack(
    folder: Path, auth_store: AuthStore, postgres: Postgres
) -> AsyncIterator[SecureNats]:
    """One stack for the whole table, with the jobs its cells are about: a finished job of
    alice, of root and of bob (each with a secret in its env), and sleeping ones to cancel."""
    async with (
        postgres.database() as db,
        secure_server(folder, auth_store) as nats,
        secure_stack(nats, db, folder, NODE) as stack,
    ):
        await _ghost(db)
        await _jobs(stack)
        try:
            yield stack
        finally:
            await _cancel_sleepers(stack)


async def _ghost(database_url: str) -> None:
    """A node that reported once, an hour ago, and was never heard from again (placement has
    migrated the database by now)."""
    caps = WorkerCapabilities(
        node_id=GHOST,
        agent_version=__version__,
        detected_at=datetime.now(UTC) - timedelta(hours=1),
        host=HostInfo(platform="linux-x86_64", os="linux", cpu_cores=2),
    )
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "INSERT INTO nodes (node_id, capabilities, platform, detected_at, last_seen, online) "
            "VALUES ($1, $2::jsonb, 'linux-x86_64', $3, $3, false)",
            GHOST,
            encode(caps).decode(),
            caps.detected_at,
        )
    finally:
        await conn.close()


async def _jobs(stack: SecureNats) -> None:
    owners: tuple[tuple[str, Role], ...] = (("alice", "user"), ("bob", "user"), ("root", "admin"))
    for owner, role in owners:
        nc = await stack.connect(role, owner)
        try:
            done = JobRequest(
                job_id=f"{owner}-done", command=["echo", f"out of {owner}"], env={"T": SECRET}
            )
            await submit(nc, done, owner=owner)
            async for event in follow_events(nc, [done.job_id], owner=owner):
                last = event.__struct_config__.tag
            assert last == "succeeded"
        finally:
            await nc.close()
    # After the finished ones: these may hold every core of the node (or wait for one).
    for owner, role in owners:
        nc = await stack.connect(role, owner)
        try:
            for job_id in SLEEPERS[owner]:
                await submit(nc, JobRequest(job_id=job_id, command=["sleep", "300"]), owner=owner)
        finally:
            await nc.close()


async def _cancel_sleepers(stack: SecureNats) -> None:
    """Whatever the cells left running: no job outlives the test."""
    root = await stack.connect("admin", "root")
    try:
        for job_id in (j for jobs in SLEEPERS.values() for j in jobs):
            with contextlib.suppress(ApiFailed):
                await api(root, "gpulayer.api.cancel", {"job_id": job_id}, caller="root")
    finally:
        await root.close()


def _own(role: str) -> str:
    """The job the role owns ("own job" cells); a viewer or a node owns none: alice's."""
    return {"user": "alice", "admin": "root"}.get(role, "alice")


def _argv(row: Row, role: str, folder: Path) -> list[str]:
    own, case = _own(role), row.case
    job_file = folder / f"submit-{role}.toml"
    job_file.write_text(f'job_id = "roles-submit-{role}"\ncommand = ["true"]\n')
    return {
        "submit": ["submit", str(job_file)],
        "nodes": ["nodes", "--devices"],
        "doctor": ["doctor", NODE, "--timeout", str(DOCTOR_TIMEOUT_S)],
        "doctor-last": ["doctor", NODE, "--last"],
        "jobs": ["jobs"],
        "services": ["services"],
        "job-own": ["job", f"{own}-done", "--json"],
        "job-other": ["job", "bob-done", "--json"],
        "explain": ["explain", "bob-done"],
        "cancel-own": ["cancel", f"{own}-sleep"],
        "cancel-other": ["cancel", "bob-sleep"],
        "logs-own": ["logs", f"{own}-done"],
        "logs-other": ["logs", "bob-done"],
        "quota-list": ["quota", "list"],
        "quota-set": ["quota", "set", "roles-somebody", "--jobs", "100"],
        "node-forget": ["node", "forget", GHOST],
        "dlq": ["dlq"],
        "audit": ["audit"],
        "profiles": ["profiles"],
        "matrix": ["matrix", "--json"],
        "schema": ["schema"],
        "check": ["check", str(job_file)],
        "conform": [
            "conform",
            str(job_file),
            "--golden",
            str(folder / f"golden-{role}"),
            "--update",
        ],
        "probe": ["probe"],
        "keys": ["keys", "generate", str(folder / f"keys-{role}")],
        "auth": ["auth", "--dir", str(folder / f"auth-{role}"), "init"],
    }[case]


# `dev up` starts NATS, PostgreSQL and the services itself: tests/e2e/test_stack.py runs it.
NOT_WALKED = {"dev"}
CLI_ROWS = [r for r in TABLE if r.kind == "cli" and r.case not in NOT_WALKED]
API_ROWS = [r for r in TABLE if r.kind == "api"]


def _check_cli(row: Row, role: str, rc: int, out: str, err: str) -> list[str]:
    """What is wrong with one cell's run (empty: it did what the table says)."""
    expected, wrong = row.outcome(role), []
    where = f"{row.case} as {role}: rc {rc}, stderr {err.strip()[-400:]!r}"
    if "Traceback" in out + err or "nats: timeout" in err:
        wrong.append(f"{where}: a traceback or a bare timeout")
    if expected in ("works", "local"):
        ok_rc = (0, 1) if row.case.startswith("doctor") else (0,)  # doctor: 1 is "degraded"
        if rc not in ok_rc or "permission denied" in err:
            wrong.append(f"{where}: expected {expected}")
    elif expected == "partial":
        if rc not in (0, 1) or "permission denied" not in err:
            wrong.append(f"{where}: expected partial (works, naming what it lacks)")
    elif rc != DENIED or "permission denied" not in err:
        wrong.append(f"{where}: expected denied (exit {DENIED}, naming the permission)")
    return wrong


@pytest.mark.parametrize("row", CLI_ROWS, ids=[r.case for r in CLI_ROWS])
async def test_each_command_for_each_role(stack: SecureNats, folder: Path, row: Row) -> None:
    async def run(role: str) -> tuple[str, int, str, str, float]:
        # A local command must not need NATS: it runs against a port nothing listens on.
        url = "nats://127.0.0.1:1" if row.outcome(role) == "local" else None
        argv = _argv(row, role, folder)
        started = time.monotonic()
        env = stack.env(role, NAMES[role], url)  # type: ignore[arg-type]
        rc, out, err = await gpulayer(*argv, env=env, timeout=90)
        return role, rc, out, err, time.monotonic() - started

    results = await asyncio.gather(*(run(role) for role in ROLES_SHOWN))
    wrong = [w for role, rc, out, err, _ in results for w in _check_cli(row, role, rc, out, err)]
    assert not wrong, "\n".join(wrong)
    by_role = {role: (rc, out, err) for role, rc, out, err, _ in results}
    _check_details(row, by_role)
    if row.case == "doctor":  # refused at once, not after waiting out the doctor's timeout
        took = {role: s for role, *_, s in results}
        assert max(took["user"], took["viewer"]) < DOCTOR_TIMEOUT_S, took


def _check_details(row: Row, by_role: dict[str, tuple[int, str, str]]) -> None:
    """What each cell's output says, for the cells issue 31 names and the other partial ones."""
    if row.case == "doctor":
        # A user: one line naming the doctor subject, then the node's last health at once
        # (not "no probe answered" after the timeout).
        for role in ("user", "viewer"):
            _, out, err = by_role[role]
            assert f"may not publish to gpulayer.node.{NODE}.doctor" in err, err
            assert "no probe answered" not in err
            assert NODE in out
        _, out, err = by_role["admin"]  # the probe re-detected
        assert "permission denied" not in err
        assert "detection before" in out, out
    if row.case in ("job-other", "job-own"):
        for role in ("user", "viewer", "admin"):
            rc, out, err = by_role[role]
            shown = json.loads(out)
            env = shown["job"]["request"]["env"]
            owns = row.case == "job-own" and role in ("user", "admin")
            assert env == ({"T": SECRET} if owns or role == "admin" else {"T": "<redacted>"}), (
                role,
                env,
            )
            if row.case == "job-own" or role != "user":  # a viewer reads any job's events
                assert shown["events"][-1]["type"] == "succeeded", (role, shown)
            else:
                assert shown["events"] is None
                assert "$JS.API.CONSUMER.CREATE.JOB_EVENTS." in shown["note"]
                assert ".gpulayer.job.bob.bob-done.events" in err, err
                assert SECRET not in out
    if row.case == "logs-own":
        for role in ("user", "admin"):
            assert f"out of {_own(role)}" in by_role[role][1]
    if row.case == "logs-other":
        assert "out of bob" in by_role["admin"][1]
        # Its events come first (a distributed job's ranks are named there): either refusal.
        assert ".gpulayer.job.bob.bob-done." in by_role["user"][2]
    if row.case in ("cancel-other", "quota-set", "node-forget"):
        assert "permission denied" in by_role["user"][2]
    if row.case == "node-forget":  # an admin's: released (nothing was held), said in one line
        assert f"node {GHOST} forgotten after" in by_role["admin"][1]
        assert "only admins may forget a node" in by_role["user"][2]
    for rc, _, err in by_role.values():
        if rc == DENIED:  # the line names who lacks what
            assert "may not" in err or "only" in err, err


async def _watched(stack: SecureNats, role: str) -> Client:
    denials = Denials(f"{role} {NAMES[role]}")
    nc = await connect(
        stack.url,
        f"roles-api-{role}",
        creds=stack.creds(role, NAMES[role]),  # type: ignore[arg-type]
        error_cb=denials.on_error,
    )
    watch(nc, denials)
    return nc


@pytest.mark.parametrize("row", API_ROWS, ids=[r.case for r in API_ROWS])
async def test_each_api_verb_for_each_role(stack: SecureNats, row: Row) -> None:
    verb = row.command.split()[0]
    assert f"gpulayer.api.{verb}" in API_VERBS

    async def ask(role: str) -> tuple[str, Any]:
        nc = await _watched(stack, role)
        job = "bob" if row.case.endswith("-other") else _own(role)
        payload: dict[str, Any] = {
            "job": {"job_id": f"{job}-done"},
            "explain": {"job_id": "bob-done"},
            "cancel": {"job_id": f"{job}-sleep-api"},
            "quota": {"op": "list"},
            "node": {"op": "forget", "node_id": GHOST},
        }.get(verb, {})
        caller = NAMES[role] if role != "node" else ANONYMOUS
        try:
            return role, await api(nc, f"gpulayer.api.{verb}", payload, timeout=10, caller=caller)
        except (PermissionDenied, ApiDenied) as err:
            return role, err
        finally:
            await nc.close()

    results = dict(await asyncio.gather(*(ask(role) for role in ROLES_SHOWN)))
    for role, got in results.items():
        expected = row.outcome(role)
        denied = isinstance(got, (PermissionDenied, ApiDenied))
        assert denied == (expected == "denied"), (row.case, role, got)
        if isinstance(got, PermissionDenied):
            caller = NAMES[role] if role != "node" else ANONYMOUS
            assert got.subject == api_subject(f"gpulayer.api.{verb}", caller), got  # as spelt
            assert got.action == "publish"
        whose = row.case.rsplit("-", 1)[-1]
        if verb == "job" and not denied:  # env values: the owner's and admins' alone
            owns = whose == "own" and role in ("user", "admin")
            secret = {"T": SECRET} if owns or role == "admin" else {"T": "<redacted>"}
            assert got["request"]["env"] == secret, (row.case, role, got)

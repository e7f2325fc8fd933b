"""Jobs of an executor running as root run unprivileged, and can't reach its state or each
other (issue 12): each job is started as a real job against a real NATS server, and tries."""

from __future__ import annotations

import asyncio
import io
import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from tests.helpers import TEST_PUBLIC_KEYS, connect_args
from tests.integration.test_executor import job_events_until_terminal, make_grant, publish_grant

from gpulayer_cli.logs import run_logs
from gpulayer_contracts.events import AnyJobEvent, Grant
from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_executor.__main__ import settings
from gpulayer_executor.env import RunAs
from gpulayer_executor.service import Executor
from gpulayer_executor.state import grant_key
from gpulayer_runtime.nats import ensure_streams
from gpulayer_runtime.signing import PUBLIC_KEYS_SETTING

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="switching to a job user needs root"),
]

NODE = "node-a"
TOKEN = "hf_0123456789abcdefSECRET"

StartExecutor = Callable[..., Awaitable[Executor]]


def _nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' account here to run jobs as")


def _unused_uid(start: int) -> int:
    """A uid no account has: a job can run as a bare uid (the executor only needs numbers),
    so a second job user needs no change to this machine's accounts."""
    uid = start
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    js = nc.jetstream()
    await ensure_streams(js)
    return js


@pytest.fixture
async def start_executor(nc: Client, tmp_path: Path) -> AsyncIterator[StartExecutor]:
    """An executor configured as ``gpulayer-executor`` configures itself (``settings``), as
    root, from ``env``; ``overrides`` replace fields of that configuration."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(env: dict[str, str] | None = None, **overrides: Any) -> Executor:
        base = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": "/root",
            "GPULAYER_NODE_ID": NODE,
            "GPULAYER_EXECUTOR_WORKDIR": str(tmp_path / "executor"),
            PUBLIC_KEYS_SETTING: ",".join(TEST_PUBLIC_KEYS),
        }
        config = settings({**base, **(env or {})}, euid=0)
        config = msgspec.structs.replace(config, kill_grace_s=0.5, fetch_timeout_s=0.2, **overrides)
        executor = Executor(nc, config)
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(executor.run(stop))))
        await asyncio.wait_for(executor.ready.wait(), 10)
        return executor

    yield start
    for stop, _ in running:
        stop.set()
    await asyncio.gather(*(task for _, task in running))


@pytest.fixture
def reachable_workdir() -> Iterator[Path]:
    """An executor folder the job account can reach by its absolute path, as a node's
    /var/lib/gpulayer is (pytest's temporary folders are 0700, root's alone): for what a job
    uses by absolute path, its HOME and TMPDIR."""
    root = Path(tempfile.mkdtemp(prefix="gpulayer-test-"))
    root.chmod(0o711)
    yield root / "executor"
    shutil.rmtree(root, ignore_errors=True)


async def run_job(js: JetStreamContext, grant: Grant) -> AnyJobEvent:
    await publish_grant(js, grant)
    return (await job_events_until_terminal(js, grant.job.job_id, owner=grant.owner))[-1]


async def logs(nats_url: str, job_id: str, owner: str = ANONYMOUS) -> str:
    out = io.StringIO()
    code = await run_logs(
        nats_url, job_id, follow=False, out=out, owner=owner, connect_args=connect_args()
    )
    assert code == 0
    return out.getvalue()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_a_job_cannot_read_the_executors_state(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor
) -> None:
    _nobody()
    executor = await start_executor()
    # A first job with a token in its env: the grant (env included) is in the state database.
    first = make_grant(["true"], env={"HF_TOKEN": TOKEN})
    assert (await run_job(js, first)).__struct_config__.tag == "succeeded"
    root = executor.store.root
    wal = root / "state.db-wal"
    on_disk = b"".join(p.read_bytes() for p in sorted(root.glob("state.db*")))
    assert TOKEN.encode() in on_disk  # so the attempt below goes for a real secret
    for path in (root / "state.db", wal, root / "state.db-shm"):
        assert (mode(path), path.stat().st_uid) == (0o600, 0), path
    assert mode(root) == mode(executor.store.jobs_dir) == 0o711  # pass through, never list

    # The attack, from the job's working folder <root>/jobs/<grant>/.
    thief = make_grant(["cat", "../../state.db-wal", "../../state.db", "../../state.db-shm"])
    end = await run_job(js, thief)
    assert end.__struct_config__.tag == "failed"
    assert getattr(end, "exit_code", None) == 1
    said = await logs(nats_url, thief.job.job_id)
    assert said.count("Permission denied") == 3, said
    assert TOKEN not in said

    lister = make_grant(["ls", "../.."])
    assert (await run_job(js, lister)).__struct_config__.tag == "failed"
    assert "Permission denied" in await logs(nats_url, lister.job.job_id)


async def test_a_job_cannot_read_another_owners_job_folder(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor
) -> None:
    _nobody()
    alice_uid = _unused_uid(61000)
    bob_uid = _unused_uid(alice_uid + 1)
    alice = RunAs(name="gl-test-alice", uid=alice_uid, gid=alice_uid, home="")
    bob = RunAs(name="gl-test-bob", uid=bob_uid, gid=bob_uid, home="")
    executor = await start_executor(user_map={"alice": alice, "bob": bob})

    theirs = msgspec.structs.replace(
        make_grant(["sh", "-c", f"echo {TOKEN} > secret.txt"]), owner="alice"
    )
    assert (await run_job(js, theirs)).__struct_config__.tag == "succeeded"
    folder = executor.store.job_dir(theirs.grant_id)
    assert (folder / "secret.txt").read_text().strip() == TOKEN
    assert (mode(folder), folder.stat().st_uid) == (0o700, alice_uid)
    assert mode(folder / "secret.txt") == 0o600  # the job's umask: 077

    reader = msgspec.structs.replace(
        make_grant(["cat", f"../{grant_key(theirs.grant_id)}/secret.txt"]), owner="bob"
    )
    end = await run_job(js, reader)
    assert end.__struct_config__.tag == "failed"
    said = await logs(nats_url, reader.job.job_id, owner="bob")
    assert "Permission denied" in said
    assert TOKEN not in said
    whoami = msgspec.structs.replace(make_grant(["sh", "-c", "id -u > uid.txt"]), owner="bob")
    assert (await run_job(js, whoami)).__struct_config__.tag == "succeeded"
    assert (executor.store.job_dir(whoami.grant_id) / "uid.txt").read_text().strip() == str(bob_uid)


async def test_a_job_runs_as_the_job_user_with_none_of_the_executors_secrets(
    js: JetStreamContext, start_executor: StartExecutor, reachable_workdir: Path
) -> None:
    nobody = _nobody()
    secrets = {
        "GPULAYER_NATS_CREDS": "/etc/gpulayer/node.creds",
        "GPULAYER_DATABASE_URL": "postgresql://gpulayer:pw-in-url@db/gpulayer",
        "NATS_TOKEN": "nats-token-value",
        "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
    }
    executor = await start_executor(
        {
            "GPULAYER_EXECUTOR_JOB_USER": "nobody",
            "GPULAYER_EXECUTOR_WORKDIR": str(reachable_workdir),
            **secrets,
        }
    )
    assert executor.config.run_as is not None
    assert executor.config.run_as.uid == nobody.pw_uid
    grant = make_grant(
        [
            "sh",
            "-c",
            "id -u > id.txt; id -G >> id.txt; umask >> id.txt; env > env.txt;"
            ' stat -c "%u %a" "$TMPDIR" > tmp.txt; mkdir -p "$TMPDIR/a/b"; touch "$TMPDIR/a/b/f"',
        ]
    )
    assert (await run_job(js, grant)).__struct_config__.tag == "succeeded"
    folder = executor.store.job_dir(grant.grant_id)
    # Its TMPDIR was its own (nobody's, 0700) inside its folder, and is gone once the end is
    # reported, whatever the job left in it; its folder stays.
    assert (folder / "tmp.txt").read_text().split() == [str(nobody.pw_uid), "700"]
    assert not (folder / "tmp").exists()
    uid, groups, umask = (folder / "id.txt").read_text().splitlines()
    assert uid == str(nobody.pw_uid)
    assert groups.split() == [str(nobody.pw_gid)]  # supplementary groups dropped
    assert umask == "0077"
    assert (folder / "env.txt").stat().st_uid == nobody.pw_uid
    env_text = (folder / "env.txt").read_text()
    env = dict(line.split("=", 1) for line in env_text.splitlines() if "=" in line)
    assert (env["USER"], env["LOGNAME"]) == ("nobody", "nobody")
    # nobody's home doesn't exist: the job's own folder is its HOME, never the executor's.
    assert env["HOME"] == str(folder)
    assert env["TMPDIR"] == str(folder / "tmp")
    for name, value in secrets.items():
        assert name not in env
        assert value not in env_text


async def test_a_job_keeps_no_way_back_to_root(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    """The shim takes on the job's account around the spawn and keeps root's saved ids to come
    back (shim_job._credentials): the job itself must have the account's ids in all four
    places (real, effective, saved, filesystem) and no supplementary group, or it could
    setuid(0) its way back."""
    nobody = _nobody()
    executor = await start_executor({"GPULAYER_EXECUTOR_JOB_USER": "nobody"})
    assert executor.config.shim
    grant = make_grant(["sh", "-c", "grep -E '^(Uid|Gid|Groups):' /proc/self/status > ids.txt"])
    assert (await run_job(js, grant)).__struct_config__.tag == "succeeded"
    lines = (executor.store.job_dir(grant.grant_id) / "ids.txt").read_text().splitlines()
    fields = {k: v.split() for k, v in (line.split(":", 1) for line in lines)}
    assert fields["Uid"] == [str(nobody.pw_uid)] * 4
    assert fields["Gid"] == [str(nobody.pw_gid)] * 4
    assert fields["Groups"] == []
    # and the shim that spawned it is root again: the next job (as another owner) starts too
    second = make_grant(["sh", "-c", "id -u > id.txt"])
    assert (await run_job(js, second)).__struct_config__.tag == "succeeded"
    assert (executor.store.job_dir(second.grant_id) / "id.txt").read_text().strip() == str(
        nobody.pw_uid
    )


async def test_a_program_the_job_user_may_not_execute_fails_the_start_naming_it(
    js: JetStreamContext, start_executor: StartExecutor, tmp_path: Path
) -> None:
    await start_executor({"GPULAYER_EXECUTOR_JOB_USER": "nobody"})
    program = tmp_path / "root-only"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o700)  # root's alone
    ended = await run_job(js, make_grant([str(program)]))
    assert ended.__struct_config__.tag == "failed"
    reason = getattr(ended, "reason", "")
    assert "root-only" in reason
    assert "Permission denied" in reason


async def test_owners_get_uids_of_their_own_by_default(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor
) -> None:
    """As root with no job user named, each owner's jobs run as a uid of its own: no passwd
    entry needed, and one owner's jobs can't read (or signal) another's."""
    _nobody()
    executor = await start_executor()
    assert executor.config.owner_uids is not None
    first, _ = executor.config.owner_uids

    def owned(owner: str, argv: list[str]) -> Grant:
        return msgspec.structs.replace(make_grant(argv), owner=owner)

    alice = owned("alice", ["sh", "-c", f"echo {TOKEN} > secret.txt; id -u > uid.txt"])
    assert (await run_job(js, alice)).__struct_config__.tag == "succeeded"
    alice_dir = executor.store.job_dir(alice.grant_id)
    alice_uid = int((alice_dir / "uid.txt").read_text())
    assert alice_uid >= first
    assert alice_dir.stat().st_uid == alice_uid

    bob = owned("bob", ["sh", "-c", f"id -u; cat ../{grant_key(alice.grant_id)}/secret.txt"])
    end = await run_job(js, bob)
    assert end.__struct_config__.tag == "failed"
    said = await logs(nats_url, bob.job.job_id, owner="bob")
    bob_uid = int(said.splitlines()[0])
    assert bob_uid >= first
    assert bob_uid != alice_uid
    assert "Permission denied" in said
    assert TOKEN not in said

    again = owned("alice", ["sh", "-c", "id -u > uid.txt"])
    assert (await run_job(js, again)).__struct_config__.tag == "succeeded"
    assert int((executor.store.job_dir(again.grant_id) / "uid.txt").read_text()) == alice_uid

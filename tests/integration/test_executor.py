"""The executor against a real NATS server: grants published directly (no placement needed),
outcomes read back from the job events, status and logs streams."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from tests.helpers import TEST_PUBLIC_KEYS, connect_args, pid_alive, publish_cancel, reason
from tests.helpers import publish_grant as signed_grant
from tests.workload import Workload

from gpulayer_cli.logs import run_logs
from gpulayer_contracts.codec import event_decoder, status_decoder
from gpulayer_contracts.events import (
    AnyJobEvent,
    CancelJob,
    Grant,
    JobStatus,
    is_terminal,
)
from gpulayer_contracts.jobenv import base_environment
from gpulayer_contracts.jobs import JobRequest, Sandbox, SandboxDevices
from gpulayer_contracts.subjects import (
    ANONYMOUS,
    STREAMS,
    job_events,
    node_grants,
    node_status,
)
from gpulayer_executor.env import RunAs
from gpulayer_executor.service import Executor, ExecutorConfig
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.integration

NODE = "node-a"
COMPUTE = Sandbox(devices=SandboxDevices(gpu="compute"))


def make_grant(
    command: list[str],
    *,
    job_id: str | None = None,
    node_id: str = NODE,
    accelerator: Any = "cpu",
    devices: list[int] | None = None,
    sandbox: Sandbox | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    visible_env: dict[str, str] | None = None,
) -> Grant:
    job = JobRequest(
        job_id=job_id or f"job-{uuid.uuid4().hex[:10]}",
        command=command,
        env=env or {},
        timeout_s=timeout_s,
        sandbox=sandbox or Sandbox(),
    )
    return Grant(
        grant_id=f"g-{uuid.uuid4().hex[:12]}",
        job=job,
        node_id=node_id,
        accelerator=accelerator,
        devices=devices or [],
        visible_env=visible_env or {},
    )


async def publish_grant(js: JetStreamContext, grant: Grant, node: str = NODE) -> None:
    """Signed as placement signs it, for the node whose subject it goes to."""
    await signed_grant(js, grant, node)


def cancel_of(grant: Grant, reason: str = "cancelled by user") -> CancelJob:
    return CancelJob(job_id=grant.job.job_id, reason=reason, grant_id=grant.grant_id)


async def job_events_until_terminal(
    js: JetStreamContext, job_id: str, timeout: float = 20.0, owner: str = ANONYMOUS
) -> list[AnyJobEvent]:
    """Every event of the job from the start of its history up to its terminal one."""
    sub = await js.subscribe(job_events(job_id, owner), ordered_consumer=True)
    events: list[AnyJobEvent] = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = await sub.next_msg(timeout=timeout)
                event = event_decoder.decode(msg.data)
                events.append(event)
                if is_terminal(event):
                    return events
    finally:
        await sub.unsubscribe()


async def wait_for_event(
    js: JetStreamContext, job_id: str, kind: str, timeout: float = 20.0
) -> None:
    sub = await js.subscribe(job_events(job_id), ordered_consumer=True)
    try:
        async with asyncio.timeout(timeout):
            while True:
                msg = await sub.next_msg(timeout=timeout)
                if msgspec.json.decode(msg.data)["type"] == kind:
                    return
    finally:
        await sub.unsubscribe()


async def statuses(js: JetStreamContext, node: str = NODE) -> list[JobStatus]:
    """What placement would read from the node's status subject (read without consuming it:
    STATUS is a work queue, so messages are fetched by sequence)."""
    state = (await js.stream_info("STATUS")).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1) if state.messages else ():
        msg = await js.get_msg("STATUS", seq)
        if msg.subject == node_status(node) and msg.data:
            out.append(status_decoder.decode(msg.data))
    return out


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


async def eventually(check: Callable[[], Awaitable[object]], timeout: float = 10.0) -> None:
    """Poll ``check`` until it is truthy: for state outside NATS (files written by jobs,
    consumer counters), which nothing can be subscribed to."""
    async with asyncio.timeout(timeout):
        while True:
            if await check():
                return
            await asyncio.sleep(0.02)


async def wait_for_file(path: Path) -> str:
    async def written() -> bool:
        return bool(read_text(path))

    await eventually(written)
    return read_text(path)


async def reported(executor: Executor, grant: Grant) -> None:
    """Until the executor has marked the grant's final state reported: it does so once both the
    status (STATUS stream) and the job event (JOB_EVENTS stream) were acked. The two streams are
    separate, so seeing the event says nothing yet about the status being stored."""

    async def done() -> bool:
        rec = executor.store.load(grant.grant_id)
        return rec is not None and rec.reported

    await eventually(done)


async def pid_gone(pid: int) -> None:
    """Until ``pid`` has exited. The executor waits for the job's main process only: the rest of
    its group was sent SIGKILL, and a killed process exits when the kernel next schedules it."""

    async def gone() -> bool:
        return not pid_alive(pid)

    await eventually(gone)


async def grants_settled(js: JetStreamContext, stream: str, durable: str) -> None:
    """Every message of the stream's consumer delivered and acked, the last one stored on its
    subject by now included: the consumer's info can lag a message just stored (no message
    pending and none waiting for an ack, before the consumer has counted it)."""
    subject = (await js.consumer_info(stream, durable)).config.filter_subject
    try:
        last = (await js.get_last_msg(stream, subject)).seq if subject else 0
    except NotFoundError:
        last = 0  # nothing stored on it

    async def settled() -> bool:
        info = await js.consumer_info(stream, durable)
        acked = info.ack_floor.stream_seq if info.ack_floor else 0
        return not info.num_pending and not info.num_ack_pending and (acked or 0) >= (last or 0)

    await eventually(settled)


StartExecutor = Callable[..., Awaitable[Executor]]


@pytest.fixture
async def js(nc: Client) -> JetStreamContext:
    js = nc.jetstream()
    await ensure_streams(js)
    return js


@pytest.fixture
async def start_executor(
    nc: Client, js: JetStreamContext, tmp_path: Path
) -> AsyncIterator[StartExecutor]:
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(node: str = NODE, **overrides: Any) -> Executor:
        base = base_environment(os.environ, user="tester", home=str(tmp_path))
        config = ExecutorConfig(
            node_id=node,
            workdir=overrides.pop("workdir", tmp_path / f"executor-{node}"),
            base_env=base,
            kill_grace_s=overrides.pop("kill_grace_s", 0.5),
            fetch_timeout_s=0.2,
            placement_public_keys=overrides.pop("placement_public_keys", TEST_PUBLIC_KEYS),
            **overrides,
        )
        executor = Executor(nc, config)
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(executor.run(stop))))
        await asyncio.wait_for(executor.ready.wait(), 10)
        return executor

    yield start
    for stop, _ in running:
        stop.set()
    await asyncio.gather(*(task for _, task in running))


def env_from_log(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


async def job_env(js: JetStreamContext, grant: Grant, executor: Executor) -> dict[str, str]:
    await publish_grant(js, grant)
    events = await job_events_until_terminal(js, grant.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["running", "succeeded"]
    return env_from_log((executor.store.job_dir(grant.grant_id) / "env.txt").read_text())


PRINT_ENV = ["sh", "-c", "env > env.txt"]


async def test_cpu_job_sees_no_gpu_and_a_minimal_env(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    executor = await start_executor()
    grant = make_grant(PRINT_ENV, env={"MY_SETTING": "x y"})
    env = await job_env(js, grant, executor)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["GPULAYER_JOB_ID"] == grant.job.job_id
    assert env["GPULAYER_DEVICES"] == ""
    assert env["MY_SETTING"] == "x y"
    # Its own temporary folder, inside its working folder.
    assert env["TMPDIR"] == str(executor.store.job_dir(grant.grant_id) / "tmp")
    # Nothing of the executor's own environment leaks in beyond the chosen base.
    leaked = set(env) - {
        *executor.config.base_env,
        "TMPDIR",
        "MY_SETTING",
        "CUDA_VISIBLE_DEVICES",
        "GPULAYER_JOB_ID",
        "GPULAYER_GRANT_ID",
        "GPULAYER_DEVICES",
        "PWD",  # set by sh itself
        "SHLVL",
        "_",
        "OLDPWD",
    }
    assert not leaked


async def test_cuda_job_with_sandbox_sees_exactly_its_devices(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    executor = await start_executor()
    grant = make_grant(PRINT_ENV, accelerator="cuda", devices=[2, 5], sandbox=COMPUTE)
    env = await job_env(js, grant, executor)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["GPULAYER_DEVICES"] == "2,5"


async def test_cuda_job_without_sandbox_grant_sees_none_whatever_the_payload_says(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    executor = await start_executor()
    # A (buggy or forged) payload claiming visibility: the executor applies the rule itself.
    grant = make_grant(
        PRINT_ENV,
        accelerator="cuda",
        devices=[2, 5],
        visible_env={"CUDA_VISIBLE_DEVICES": "2,5", "GPULAYER_DEVICES": "2,5"},
    )
    env = await job_env(js, grant, executor)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["GPULAYER_DEVICES"] == ""


async def test_rocm_job_gets_rocm_visibility(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    executor = await start_executor()
    grant = make_grant(PRINT_ENV, accelerator="rocm", devices=[1], sandbox=COMPUTE)
    env = await job_env(js, grant, executor)
    assert env["ROCR_VISIBLE_DEVICES"] == "1"
    assert env["HIP_VISIBLE_DEVICES"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == ""


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "LD_PRELOAD"])
async def test_job_setting_a_protected_variable_is_refused_by_name(
    js: JetStreamContext, start_executor: StartExecutor, tmp_path: Path, name: str
) -> None:
    executor = await start_executor()
    marker = tmp_path / "started"
    grant = make_grant(["touch", str(marker)], env={name: "0"})
    await publish_grant(js, grant)
    events = await job_events_until_terminal(js, grant.job.job_id)
    assert len(events) == 1
    failed = events[0]
    assert failed.__struct_config__.tag == "failed"
    assert reason(failed) == f"env: {name} is set by gpulayer, a job may not set it"
    assert not marker.exists()
    await reported(executor, grant)
    (status,) = await statuses(js)
    assert (status.state, status.grant_id, status.reason) == (
        "failed",
        grant.grant_id,
        reason(failed),
    )


async def test_arguments_arrive_literally_never_through_a_shell(
    js: JetStreamContext, start_executor: StartExecutor, tmp_path: Path
) -> None:
    executor = await start_executor()
    canary = tmp_path / "canary"
    canary.write_text("still here")
    grant = make_grant(
        ["sh", "-c", 'printf "%s|%s" "$0" "$1" > args.txt', "; rm -rf " + str(canary), "$(id)"]
    )
    await publish_grant(js, grant)
    events = await job_events_until_terminal(js, grant.job.job_id)
    assert events[-1].__struct_config__.tag == "succeeded"
    seen = (executor.store.job_dir(grant.grant_id) / "args.txt").read_text()
    assert seen == f"; rm -rf {canary}|$(id)"
    assert canary.read_text() == "still here"


async def test_exit_codes_and_missing_programs_are_reported(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    await start_executor()
    bad_exit = make_grant(["sh", "-c", "exit 3"])
    missing = make_grant(["/nonexistent/program"])
    await publish_grant(js, bad_exit)
    await publish_grant(js, missing)
    events = await job_events_until_terminal(js, bad_exit.job.job_id)
    assert (getattr(events[-1], "exit_code", None), reason(events[-1])) == (3, "exit code 3")
    (failed,) = await job_events_until_terminal(js, missing.job.job_id)
    assert str(reason(failed)).startswith("spawn: could not start '/nonexistent/program'")


# SIGTERM is ignored before the grandchild starts, so both ignore it: only SIGKILL ends them.
GRANDCHILD = """
trap '' TERM
sleep 600 &
echo $! > grandchild.pid
wait
"""


async def test_timeout_kills_the_job_and_its_grandchildren(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    executor = await start_executor(kill_grace_s=0.3)
    # The job ignores SIGTERM, so only the SIGKILL after the grace ends it.
    grant = make_grant(["sh", "-c", GRANDCHILD], timeout_s=1.0)
    await publish_grant(js, grant)
    pid_file = executor.store.job_dir(grant.grant_id) / "grandchild.pid"
    grandchild = int(await wait_for_file(pid_file))
    assert pid_alive(grandchild)
    events = await job_events_until_terminal(js, grant.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["running", "failed"]
    assert reason(events[-1]) == "timeout"
    assert getattr(events[-1], "signal", None) == 9
    await pid_gone(grandchild)


async def test_cancel_stops_a_running_job_and_its_group(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    executor = await start_executor()
    grant = make_grant(["sh", "-c", "sleep 600 & echo $! > grandchild.pid; wait"])
    await publish_grant(js, grant)
    grandchild = int(await wait_for_file(executor.store.job_dir(grant.grant_id) / "grandchild.pid"))
    await publish_cancel(js, NODE, cancel_of(grant, "user asked"))
    events = await job_events_until_terminal(js, grant.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["running", "cancelled"]
    assert reason(events[-1]) == "user asked"
    await pid_gone(grandchild)
    await reported(executor, grant)
    assert [s.state for s in await statuses(js)] == ["running", "cancelled"]


async def test_cancel_of_a_queued_grant_never_starts_it(
    js: JetStreamContext, start_executor: StartExecutor, tmp_path: Path
) -> None:
    executor = await start_executor(max_jobs=1)
    blocker = make_grant(["sleep", "600"])
    await publish_grant(js, blocker)
    await wait_for_event(js, blocker.job.job_id, "running")
    marker = tmp_path / "queued-started"
    queued = make_grant(["touch", str(marker)])
    await publish_grant(js, queued)

    # Wait until the executor holds the queued grant (recorded before it is acked).
    async def held() -> bool:
        return executor.store.load(queued.grant_id) is not None

    await eventually(held)
    await publish_cancel(js, NODE, cancel_of(queued))
    events = await job_events_until_terminal(js, queued.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["cancelled"]
    assert not marker.exists()
    await publish_cancel(js, NODE, cancel_of(blocker))
    await job_events_until_terminal(js, blocker.job.job_id)


async def test_cancel_arriving_before_its_grant_still_applies(
    js: JetStreamContext, start_executor: StartExecutor, tmp_path: Path
) -> None:
    await start_executor()
    marker = tmp_path / "late-started"
    grant = make_grant(["touch", str(marker)])
    await publish_cancel(js, NODE, cancel_of(grant))
    await grants_settled(js, "CONTROL", f"executor-{NODE}-control")
    await publish_grant(js, grant)
    events = await job_events_until_terminal(js, grant.job.job_id)
    assert [e.__struct_config__.tag for e in events] == ["cancelled"]
    assert not marker.exists()


async def test_a_grant_delivered_twice_runs_once(
    js: JetStreamContext, start_executor: StartExecutor, tmp_path: Path
) -> None:
    executor = await start_executor()
    starts = tmp_path / "starts"
    grant = make_grant(["sh", "-c", f'echo start >> "{starts}"'])
    await publish_grant(js, grant)
    await publish_grant(js, grant)
    await job_events_until_terminal(js, grant.job.job_id)
    # A third copy after the job finished: still recognised, still not run.
    await publish_grant(js, grant)
    await grants_settled(js, "GRANTS", f"executor-{NODE}")
    await reported(executor, grant)
    assert starts.read_text() == "start\n"
    # One end; a "running" only if the job still ran when the executor first looked (placement
    # takes an end of a job it has as placed).
    assert [s.state for s in await statuses(js)] in (["running", "succeeded"], ["succeeded"])


async def test_grants_fetched_together_each_run_once_copies_included(
    js: JetStreamContext, start_executor: StartExecutor, tmp_path: Path
) -> None:
    """Published before the executor starts, so its first fetch holds them all and their
    records are created in one commit: the copies of a grant inside it still start it once."""
    starts = tmp_path / "starts"
    grants = [
        make_grant(["sh", "-c", f'echo {i} >> "{starts}"'], job_id=f"batch-{i}") for i in range(5)
    ]
    for grant in [*grants, grants[0], grants[0]]:
        await publish_grant(js, grant)
    executor = await start_executor()
    for grant in grants:
        await job_events_until_terminal(js, grant.job.job_id)
    await grants_settled(js, "GRANTS", f"executor-{NODE}")
    for grant in grants:
        await reported(executor, grant)
    assert sorted(starts.read_text().split()) == ["0", "1", "2", "3", "4"]


async def test_grant_for_another_node_is_refused_and_malformed_grants_are_dropped(
    js: JetStreamContext, start_executor: StartExecutor, tmp_path: Path
) -> None:
    # Signing off (unsafe): the payload's node is still checked, and the refusal reported.
    # With signing on, such a grant is dropped unreported (tests/integration/test_signed_grants.py).
    await start_executor(require_signatures=False, placement_public_keys=())
    await js.publish(node_grants(NODE), b"{not json")
    await js.publish(node_grants(NODE), b'{"grant_id": "x"}')
    marker = tmp_path / "foreign-started"
    foreign = make_grant(["touch", str(marker)], node_id="node-b")
    await signed_grant(js, foreign, node=NODE, signer=None)
    (failed,) = await job_events_until_terminal(js, foreign.job.job_id)
    assert failed.__struct_config__.tag == "failed"
    assert "node-b" in str(reason(failed))
    assert NODE in str(reason(failed))
    assert not marker.exists()
    # The loop survived the bad messages: a good grant still runs.
    ok = make_grant(["true"])
    await publish_grant(js, ok)
    assert (await job_events_until_terminal(js, ok.job.job_id))[-1].__struct_config__.tag == (
        "succeeded"
    )


async def test_many_jobs_run_at_once(js: JetStreamContext, start_executor: StartExecutor) -> None:
    await start_executor(max_jobs=8)
    # Each job waits until all of them have started: only possible if they run concurrently.
    barrier = Path(os.environ.get("TMPDIR", "/tmp")) / f"barrier-{uuid.uuid4().hex}"
    barrier.mkdir()
    try:
        script = f'touch "{barrier}/$GPULAYER_JOB_ID"; while [ $(ls "{barrier}" | wc -l) -lt 8 ]; do sleep 0.02; done'
        grants = [make_grant(["sh", "-c", script], timeout_s=15) for _ in range(8)]
        for g in grants:
            await publish_grant(js, g)
        ends = await asyncio.gather(*(job_events_until_terminal(js, g.job.job_id) for g in grants))
        assert all(r[-1].__struct_config__.tag == "succeeded" for r in ends)
    finally:
        shutil.rmtree(barrier, ignore_errors=True)


async def test_logs_of_a_finished_job_and_following_a_running_one(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor
) -> None:
    executor = await start_executor()
    done = make_grant(["sh", "-c", "echo one; echo two >&2; printf 'no newline'"])
    await publish_grant(js, done)
    await job_events_until_terminal(js, done.job.job_id)
    out = io.StringIO()
    assert (
        await run_logs(
            nats_url, done.job.job_id, follow=False, out=out, connect_args=connect_args()
        )
        == 0
    )
    assert sorted(out.getvalue().splitlines()) == ["no newline", "one", "two"]

    # Follow: the job prints, waits for a go file, prints again; run_logs returns at its end.
    live = make_grant(
        ["sh", "-c", "echo first; while [ ! -e go ]; do sleep 0.02; done; echo last"],
        timeout_s=20,
    )
    await publish_grant(js, live)
    followed = io.StringIO()
    follower = asyncio.create_task(
        run_logs(nats_url, live.job.job_id, follow=True, out=followed, connect_args=connect_args())
    )

    async def printed_first() -> bool:
        return "first" in followed.getvalue()

    await eventually(printed_first)
    assert not follower.done()
    (executor.store.job_dir(live.grant_id) / "go").touch()
    assert await asyncio.wait_for(follower, 15) == 0
    assert followed.getvalue().splitlines() == ["first", "last"]


async def test_unknown_job_logs_say_so(nats_url: str, js: JetStreamContext) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert (
        await run_logs(
            nats_url, "no-such-job", follow=False, out=out, err=err, connect_args=connect_args()
        )
        == 1
    )
    assert "no-such-job" in err.getvalue()


async def test_a_flood_of_output_is_bounded(
    nats_url: str, js: JetStreamContext, start_executor: StartExecutor
) -> None:
    await start_executor(max_log_backlog_bytes=64 * 1024, max_line_bytes=1000)
    # One 1 MB line, then 200k lines, far faster than they can be published one by one.
    script = (
        f'"{sys.executable}" -c "'
        "import sys; w = sys.stdout.write; w('y' * 1000000 + chr(10)); "
        "[w('x' * 50 + chr(10)) for _ in range(200000)]\""
    )
    grant = make_grant(["sh", "-c", script], timeout_s=30)
    await publish_grant(js, grant)
    events = await job_events_until_terminal(js, grant.job.job_id, timeout=40)
    assert events[-1].__struct_config__.tag == "succeeded"
    out = io.StringIO()
    assert (
        await run_logs(
            nats_url, grant.job.job_id, follow=False, out=out, connect_args=connect_args()
        )
        == 0
    )
    lines = out.getvalue().splitlines()
    # LOGS keeps a job's last lines only: the first is there unless the executor got that many
    # through (it may, on a machine where the job itself is slow).
    kept = next(s.max_msgs_per_subject for s in STREAMS if s.name == "LOGS")
    assert len(lines) <= kept
    if len(lines) < kept:
        assert lines[0] == "y" * 1000 + " [gpulayer: line truncated, 999000 bytes dropped]"
    # Dropped and counted, not buffered: far fewer lines stored, with markers saying so.
    dropped = [line for line in lines if line.startswith("[gpulayer: ")]
    assert dropped
    assert all("lines dropped" in line for line in dropped)
    assert all(len(line) <= 1100 for line in lines)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
async def test_jobs_run_as_the_configured_unprivileged_user(
    js: JetStreamContext, start_executor: StartExecutor
) -> None:
    import pwd
    import shutil
    import tempfile

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user here")
    run_as = RunAs(name="nobody", uid=nobody.pw_uid, gid=nobody.pw_gid, home=nobody.pw_dir)
    # pytest's own temp folders are private to root; the job's user must reach its folder.
    workdir = Path(tempfile.mkdtemp(prefix="gpulayer-executor-"))
    os.chmod(workdir, 0o711)
    try:
        executor = await start_executor(node="node-u", run_as=run_as, workdir=workdir / "wd")
        grant = make_grant(["sh", "-c", "id -u > uid.txt; id -G > groups.txt"], node_id="node-u")
        await publish_grant(js, grant, node="node-u")
        events = await job_events_until_terminal(js, grant.job.job_id)
        assert events[-1].__struct_config__.tag == "succeeded"
        job_dir = executor.store.job_dir(grant.grant_id)
        assert read_text(job_dir / "uid.txt").strip() == str(nobody.pw_uid)
        assert read_text(job_dir / "groups.txt").split() == [str(nobody.pw_gid)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def test_a_job_running_torchrun_itself_names_the_worker_that_failed(
    js: JetStreamContext, start_executor: StartExecutor, workload_venv: Workload
) -> None:
    """torchrun exits 1 whatever its worker did: the job's reason also names the worker that
    failed first and its own code, from torchrun's summary on the job's stderr (real torchrun,
    torch 2.13.0; single-node training runs torchrun as its command, not as a gpulayer rank)."""
    workload_venv.need_torch()
    await start_executor()
    torchrun = str(Path(workload_venv.python).parent / "torchrun")
    worker = "import os, sys; sys.exit(3 if os.environ['LOCAL_RANK'] == '1' else 0)"
    argv = [torchrun, "--standalone", "--nproc-per-node", "2", "--no-python", "--"]
    grant = make_grant([*argv, workload_venv.python, "-c", worker], timeout_s=120)
    await publish_grant(js, grant)
    failed = (await job_events_until_terminal(js, grant.job.job_id))[-1]
    assert failed.__struct_config__.tag == "failed"
    assert getattr(failed, "exit_code", None) == 1
    assert getattr(failed, "reason", None) == (
        "exit code 1; torchrun: its worker of global rank 1 (local 1) exited with code 3"
    )

"""The shim's pieces: its output file (format, bounds, one write per turn), the stop request,
the pokes, the fork server, and the executor's pool of idle shims it hands jobs to (real
processes, no NATS)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from tests.unit.executor.fakes import until

from gpulayer_executor import cgroups, shim_pool
from gpulayer_executor.lines import LineSplitter, consume
from gpulayer_executor.runner import StopRequest
from gpulayer_executor.shim import (
    EXIT_FILE,
    FRAME,
    IDLE,
    OUTPUT_FILE,
    SHIM_FILE,
    STARTED_FILE,
    STATUS_FILE,
    STOP_FILE,
    FileSink,
    Notifier,
    ShimInfo,
    ShimSpec,
    StatusLine,
    has_status,
    hierarchy_spec,
    read_status,
    read_stop,
    record,
    status_line,
)
from gpulayer_executor.shim_client import Follower
from gpulayer_executor.shim_pool import ForkServer
from gpulayer_executor.state import Outcome, ProcessInfo

# --- the output file ----------------------------------------------------------------------------


def test_a_record_is_its_stream_letter_the_text_and_a_newline() -> None:
    assert record("stdout", "hello") == b"ohello\n"
    assert record("stderr", "é") == b"e\xc3\xa9\n"


def pokes(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""


def sink_on(tmp_path: Path, **bounds: int) -> tuple[FileSink, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    defaults = {"max_bytes_per_s": 1 << 20, "max_file_bytes": 1 << 20}
    return FileSink(tmp_path / OUTPUT_FILE, "j", Notifier(w), **{**defaults, **bounds}), r


def test_lines_are_written_once_per_flush_with_one_poke(tmp_path: Path) -> None:
    sink, r = sink_on(tmp_path)
    for i in range(100):
        sink.offer("stdout", str(i))
    assert not (tmp_path / OUTPUT_FILE).exists()  # buffered until the turn ends
    assert pokes(r) == b""
    sink.flush()
    assert (tmp_path / OUTPUT_FILE).read_bytes() == b"".join(b"o%d\n" % i for i in range(100))
    assert pokes(r) == b"o"
    sink.flush()  # nothing new: no write, no poke
    assert pokes(r) == b""
    sink.close()


def test_a_flood_is_cut_by_the_rate_and_counted_in_one_marker(tmp_path: Path) -> None:
    sink, _ = sink_on(tmp_path, max_bytes_per_s=1000)
    for _ in range(100):
        sink.offer("stdout", "x" * 36)  # 100 bytes each, as the sink counts them
    sink.close()
    lines = (tmp_path / OUTPUT_FILE).read_bytes().splitlines()
    assert lines == [b"o" + b"x" * 36] * 10 + [b"e[gpulayer: 90 lines dropped]"]


def test_a_flood_read_from_a_pipe_is_split_only_as_far_as_it_fits(tmp_path: Path) -> None:
    sink, _ = sink_on(tmp_path, max_bytes_per_s=1000)
    consume(b"z" * 36 + b"\n" * 1 + (b"z" * 36 + b"\n") * 99, LineSplitter(1024), sink, "stderr")
    sink.flush()
    sink.offer("stdout", "later")  # the bucket is empty for a second: dropped as well
    sink.close()
    lines = (tmp_path / OUTPUT_FILE).read_bytes().splitlines()
    assert lines == [b"e" + b"z" * 36] * 10 + [b"e[gpulayer: 91 lines dropped]"]


def test_a_silent_job_makes_no_output_file(tmp_path: Path) -> None:
    sink, r = sink_on(tmp_path)
    sink.flush()
    sink.close()
    assert not (tmp_path / OUTPUT_FILE).exists()
    assert pokes(r) == b""


def test_a_job_started_again_appends_within_the_same_cap(tmp_path: Path) -> None:
    (tmp_path / OUTPUT_FILE).write_bytes(b"o" + b"a" * 899 + b"\n")  # its first start's 900
    sink, _ = sink_on(tmp_path, max_file_bytes=1000)
    for _ in range(10):
        sink.offer("stdout", "b" * 49)  # 50 bytes a record: 500 in all, 100 bytes of room
    sink.close()
    data = (tmp_path / OUTPUT_FILE).read_bytes()
    assert len(data) <= 1000
    assert data.startswith(b"o" + b"a" * 899 + b"\n")
    assert 1 <= data.count(b"b" * 49) <= 2


def test_the_file_never_grows_past_its_cap(tmp_path: Path) -> None:
    sink, _ = sink_on(tmp_path, max_file_bytes=1000)
    for _ in range(1000):
        sink.offer("stdout", "y" * 50)
    sink.close()
    assert (tmp_path / OUTPUT_FILE).stat().st_size <= 1000


def test_a_poke_to_an_executor_that_is_gone_is_dropped_quietly() -> None:
    r, w = os.pipe()
    os.close(r)
    previous = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        notify = Notifier(w)
        notify(b"o")  # EPIPE: the shim goes on without its executor
        assert notify.fd is None
        notify(b"e")
    finally:
        signal.signal(signal.SIGPIPE, previous)


# --- the stop request ---------------------------------------------------------------------------


def test_a_stop_without_a_request_is_none_and_a_garbled_one_a_cancel(tmp_path: Path) -> None:
    assert read_stop(tmp_path) is None
    request = StopRequest(state="cancelled", reason="user")
    (tmp_path / STOP_FILE).write_bytes(msgspec.json.encode(request))
    assert read_stop(tmp_path) == request
    (tmp_path / STOP_FILE).write_bytes(b"{not json")
    garbled = read_stop(tmp_path)
    assert garbled is not None
    assert garbled.state == "cancelled"


# --- the fork server and its shims ---------------------------------------------------------------


# --- the status file ----------------------------------------------------------------------------


def test_status_is_read_line_by_line_and_a_line_not_yet_whole_waits(tmp_path: Path) -> None:
    shim = ShimInfo(pid=11, start_ticks=5, boot_id="b")
    started = ProcessInfo(pid=12, pgid=12, start_ticks=6, boot_id="b")
    ended = Outcome(state="succeeded", exit_code=0)
    whole = status_line(StatusLine(shim=shim)) + status_line(StatusLine(started=started))
    last = status_line(StatusLine(exit=ended))
    assert not has_status(tmp_path)
    (tmp_path / STATUS_FILE).write_bytes(whole + last[:-1])  # its newline not written yet
    got = read_status(tmp_path)
    assert (got.shim, got.started, got.exit) == (shim, started, None)
    assert has_status(tmp_path)
    (tmp_path / STATUS_FILE).write_bytes(whole + b'{"exit": {"state": "no-such"}}\n' + last)
    got = read_status(tmp_path)  # the garbled line passed over (and logged), not the rest
    assert (got.shim, got.started, got.exit) == (shim, started, ended)


def test_the_files_of_a_shim_from_before_the_status_file_are_still_read(tmp_path: Path) -> None:
    # A shim an older executor started outlives its upgrade: the new executor follows it.
    shim = ShimInfo(pid=21)
    started = ProcessInfo(pid=22, pgid=22)
    (tmp_path / SHIM_FILE).write_bytes(msgspec.json.encode(shim))
    assert has_status(tmp_path)
    (tmp_path / STARTED_FILE).write_bytes(msgspec.json.encode(started))
    got = read_status(tmp_path)
    assert (got.shim, got.started, got.exit) == (shim, started, None)
    (tmp_path / EXIT_FILE).write_bytes(b"{half")  # unreadable: no outcome yet, logged
    assert read_status(tmp_path).exit is None
    ended = Outcome(state="failed", exit_code=3)
    (tmp_path / EXIT_FILE).write_bytes(msgspec.json.encode(ended))
    assert read_status(tmp_path).exit == ended


@pytest.fixture
async def server() -> AsyncIterator[ForkServer]:
    fs = ForkServer()
    fs.start()
    yield fs
    await fs.close()


def spec(run: Path, argv: list[str], **fields: object) -> ShimSpec:
    run.mkdir(parents=True, exist_ok=True)
    # Unique: with no cgroup, a shim finds its job's escaped processes by this marker in
    # their environment, machine-wide. A short name ("slow") shared with a job of another
    # test running at the same time had that job killed too.
    grant_id = f"{run.name}-{uuid.uuid4().hex[:12]}"
    env = {"PATH": os.environ["PATH"], "GPULAYER_GRANT_ID": grant_id}
    return ShimSpec(
        grant_id=grant_id,
        job_id=run.name,
        run_dir=str(run),
        argv=argv,
        env=env,
        cwd=str(run),
        **fields,  # type: ignore[arg-type]
    )


async def ended(notify_fd: int) -> bytes:
    """The shim's pokes until its end (``e``) or EOF."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        data = os.read(notify_fd, 4096)
        got.extend(data)
        if (not data or b"e" in data) and not done.done():
            done.set_result(None)

    os.set_blocking(notify_fd, False)
    loop.add_reader(notify_fd, readable)
    try:
        async with asyncio.timeout(20):
            await done
    finally:
        loop.remove_reader(notify_fd)
        os.close(notify_fd)
    return bytes(got)


def outcome(run: Path) -> Outcome:
    got = read_status(run).exit
    assert got is not None, f"no outcome in {run / STATUS_FILE}"
    return got


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_a_shim_runs_its_job_and_is_handed_the_next(
    server: ForkServer, tmp_path: Path
) -> None:
    py = sys.executable
    script = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    first = spec(tmp_path / "g1", [py, "-c", script])
    lease = await server.fork(first)
    pid = lease.pid
    said = await ended(lease.notify)
    server.done(lease)
    # Started, output (once per turn of the shim's loop that wrote some), ended.
    assert said[:1] == b"s"
    assert said[-1:] == b"e"
    assert set(said[1:-1]) == {ord("o")}
    got = outcome(tmp_path / "g1")
    assert (got.state, got.exit_code, got.reason) == ("failed", 3, "exit code 3")
    assert (tmp_path / "g1" / OUTPUT_FILE).read_bytes() in (b"oout\neerr\n", b"eerr\noout\n")
    status = read_status(tmp_path / "g1")
    assert status.shim is not None
    assert status.shim.pid == pid
    assert status.started is not None
    assert status.started.pid != pid
    # One file made for the job's state, no other (a silent job has no output file).
    assert sorted(p.name for p in (tmp_path / "g1").iterdir()) == [OUTPUT_FILE, STATUS_FILE]
    # In the executor's cgroups where this machine has them (a job's cgroup files and the
    # hierarchy's own are opened in the shim).
    found = cgroups.hierarchy(True)
    hierarchy = hierarchy_spec(found) if found is not None else None
    fds = []
    for i in range(2, 10):
        again = await server.fork(spec(tmp_path / f"g{i}", ["true"], hierarchy=hierarchy))
        assert again.pid == pid  # the idle shim took it: no fork
        await ended(again.notify)
        server.done(again)
        assert server.idle_pids() == [pid]
        assert outcome(tmp_path / f"g{i}").state == "succeeded"
        fds.append(open_fds(pid))
    # Nothing a job opened stays open in the shim that ran it (one may be the next job's
    # notify pipe, or this one's not closed yet: counted while the shim winds up).
    assert fds[-1] - fds[0] <= 1, fds


async def test_jobs_at_once_get_shims_of_their_own(server: ForkServer, tmp_path: Path) -> None:
    go = tmp_path / "go"
    wait = f"while [ ! -e {go} ]; do sleep 0.01; done"
    forks = [await server.fork(spec(tmp_path / f"p{i}", ["sh", "-c", wait])) for i in range(3)]
    assert len({lease.pid for lease in forks}) == 3
    go.touch()
    for lease in forks:
        await ended(lease.notify)
        server.done(lease)
    assert sorted(server.idle_pids()) == sorted(lease.pid for lease in forks)


async def test_a_sigterm_without_a_stop_request_is_ignored_and_with_one_stops(
    server: ForkServer, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    wait = f"while [ ! -e {go} ]; do sleep 0.01; done"
    run = tmp_path / "t1"
    lease = await server.fork(spec(run, ["sh", "-c", wait], kill_grace_s=1.0))
    pid, notify = lease.pid, lease.notify
    os.kill(pid, signal.SIGTERM)  # e.g. a late stop of the job this shim ran before
    await asyncio.sleep(0.3)  # nothing to await: the signal must have no effect
    assert read_status(run).exit is None
    request = StopRequest(state="cancelled", reason="user changed their mind")
    (run / STOP_FILE).write_bytes(msgspec.json.encode(request))
    os.kill(pid, signal.SIGTERM)
    await ended(notify)
    got = outcome(run)
    assert got.state == "cancelled"
    assert got.reason == "user changed their mind"


async def test_a_timeout_ends_the_job_as_failed(server: ForkServer, tmp_path: Path) -> None:
    run = tmp_path / "slow"
    lease = await server.fork(spec(run, ["sleep", "30"], timeout_s=0.3, kill_grace_s=1.0))
    await ended(lease.notify)
    assert outcome(run).state == "failed"
    assert outcome(run).reason == "timeout"


async def test_a_program_that_is_not_there_fails_to_spawn(
    server: ForkServer, tmp_path: Path
) -> None:
    run = tmp_path / "missing"
    lease = await server.fork(spec(run, ["no-such-program-here"]))
    await ended(lease.notify)
    got = outcome(run)
    assert got.state == "failed"
    assert got.reason is not None
    assert got.reason.startswith("spawn: could not start 'no-such-program-here'")


def test_a_bad_request_is_refused_and_the_server_goes_on(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    proc = __import__("subprocess").Popen(
        [sys.executable, "-m", "gpulayer_executor.shim_server"],
        stdin=theirs.fileno(),
        stderr=__import__("subprocess").DEVNULL,
    )
    theirs.close()
    try:
        r, w = os.pipe()
        bad = b"{not a spec"
        socket.send_fds(ours, [FRAME.pack(len(bad)) + bad], [w])
        assert ours.recv(FRAME.size) == FRAME.pack(0)
        body = msgspec.json.encode(spec(tmp_path / "ok", ["true"]))
        ours.sendall(FRAME.pack(len(body)) + body)  # no notify pipe attached: refused too
        assert ours.recv(FRAME.size) == FRAME.pack(0)
        socket.send_fds(ours, [FRAME.pack(len(body)) + body], [w])
        reply, fds, _, _ = socket.recv_fds(ours, FRAME.size, 2)
        (pid,) = FRAME.unpack(reply)
        assert pid > 0
        assert len(fds) == 1  # the shim's control socket: ours from now on
        os.close(w)
        os.read(r, 16)
        with socket.socket(fileno=fds[0]) as ctl:
            assert ctl.recv(8) == IDLE  # its job is over: it may take the next
    finally:
        ours.close()  # the server exits
        proc.wait(10)


async def gone(pid: int) -> None:
    """Until process ``pid`` (not our child) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        async with asyncio.timeout(10):
            await exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_an_idle_shim_that_died_is_passed_over(server: ForkServer, tmp_path: Path) -> None:
    first = await server.fork(spec(tmp_path / "d1", ["true"]))
    await ended(first.notify)
    server.done(first)
    assert server.idle_pids() == [first.pid]
    os.kill(first.pid, signal.SIGKILL)
    await gone(first.pid)
    second = await server.fork(spec(tmp_path / "d2", ["true"]))
    assert second.pid != first.pid  # a new shim, forked: the dead one's socket said EPIPE
    await ended(second.notify)
    server.done(second)
    assert outcome(tmp_path / "d2").state == "succeeded"
    assert server.idle_pids() == [second.pid]


async def test_idle_shims_are_let_go_after_their_time_and_beyond_the_most_kept(
    server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shim_pool, "MAX_IDLE", 1)
    monkeypatch.setattr(shim_pool, "IDLE_S", 0.3)
    go = tmp_path / "go"
    wait = f"while [ ! -e {go} ]; do sleep 0.01; done"
    a = await server.fork(spec(tmp_path / "a", ["sh", "-c", wait]))
    b = await server.fork(spec(tmp_path / "b", ["sh", "-c", wait]))
    go.touch()
    for lease in (a, b):
        await ended(lease.notify)
        server.done(lease)
    # Looked at before anything is awaited: b's IDLE_S can't have passed yet on a slow machine.
    assert server.idle_pids() == [b.pid]
    await gone(a.pid)  # one too many: let go at once
    await gone(b.pid)  # idle past IDLE_S
    assert server.idle_pids() == []


async def test_a_lease_given_back_while_its_job_runs_lets_the_shim_go_after_it(
    server: ForkServer, tmp_path: Path
) -> None:
    # The executor stopping leaves running jobs to their shims: each finishes its job (its
    # outcome written for the next executor), then exits instead of waiting for another.
    go = tmp_path / "go"
    run = tmp_path / "left"
    lease = await server.fork(spec(run, ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.01; done"]))
    server.done(lease)
    assert server.idle_pids() == []
    go.touch()
    await ended(lease.notify)
    await gone(lease.pid)
    assert outcome(run).state == "succeeded"


class QuietSink:
    """What a follower needs of a log sink, for a job that prints nothing."""

    job_id = "quiet"
    msg_prefix = ""
    acked_mark = 0

    def offer_marked(self, stream: str, line: str, mark: int) -> bool:
        return True

    async def close(self) -> None:
        pass


async def test_a_stop_asked_while_the_running_report_is_still_out_reaches_the_job(
    server: ForkServer, tmp_path: Path
) -> None:
    # The job's "running" report can take seconds (NATS can't store it for a moment: the
    # follower awaits it). A cancel meanwhile must still stop the job, not wait for it to end
    # by itself (the suite's fault run saw a cancelled job run its 120 s to the end).
    run = tmp_path / "slow"
    lease = await server.fork(spec(run, ["sleep", "30"], kill_grace_s=1.0))
    pid, notify = lease.pid, lease.notify
    stop: asyncio.Future[StopRequest] = asyncio.get_running_loop().create_future()
    reported = asyncio.Event()

    async def on_started(info: ProcessInfo, ended: bool) -> None:
        stop.set_result(StopRequest(state="cancelled", reason="user asked"))  # while reporting
        await asyncio.sleep(0.2)  # the report still out: the loop turns, the stop's wake runs
        reported.set()

    follower = Follower(run, run.name, cast(Any, QuietSink()), notify, None)
    async with asyncio.timeout(20):
        got = await follower.follow(stop, on_started, pid)
    assert reported.is_set()
    assert (got.state, got.reason) == ("cancelled", "user asked")


async def test_the_follower_says_whether_the_job_had_ended_when_it_saw_it_start(
    server: ForkServer, tmp_path: Path
) -> None:
    """A job over before the follower's first look (its pokes waiting in the pipe): started and
    ended are read in one look, and ``on_started`` is told the job has ended. A job still running
    at that look: told it has not (the job waits for the report to end)."""
    told: list[bool] = []

    async def on_started(info: ProcessInfo, ended: bool) -> None:
        told.append(ended)
        (tmp_path / "go").touch()

    async def follow(run: Path, lease: shim_pool.Lease) -> Outcome:
        stop: asyncio.Future[StopRequest] = asyncio.get_running_loop().create_future()
        follower = Follower(run, run.name, cast(Any, QuietSink()), lease.notify, None)
        async with asyncio.timeout(20):
            got = await follower.follow(stop, on_started, lease.pid)
        server.done(lease)
        return got

    short = await server.fork(spec(tmp_path / "short", ["true"]))
    await until(lambda: read_status(tmp_path / "short").exit is not None)
    assert (await follow(tmp_path / "short", short)).state == "succeeded"
    (tmp_path / "go").unlink()  # the short job's look made it: the next job must wait for its own
    wait = f"while [ ! -e {tmp_path / 'go'} ]; do sleep 0.01; done"
    waiting = await server.fork(spec(tmp_path / "waiting", ["sh", "-c", wait]))
    assert (await follow(tmp_path / "waiting", waiting)).state == "succeeded"
    assert told == [True, False]

"""Splitting output into bounded lines, the sink's watch, and the /proc stat parser (pure)."""

from __future__ import annotations

from typing import Any, cast

from gpulayer_executor.cgroups import _own_paths
from gpulayer_executor.output import LineSplitter, LogSink
from gpulayer_executor.procs import parse_stat
from gpulayer_executor.runner import _exit_outcome


def test_lines_across_chunks() -> None:
    s = LineSplitter(100)
    assert s.feed(b"one\ntw") == ["one"]
    assert s.feed(b"o\r\nthr") == ["two"]
    assert s.feed(b"ee") == []
    assert s.close() == ["three"]
    assert s.close() == []


def test_long_lines_are_truncated_with_a_count() -> None:
    s = LineSplitter(10)
    out = s.feed(b"a" * 25 + b"\nshort\n")
    assert out == ["a" * 10 + " [gpulayer: line truncated, 15 bytes dropped]", "short"]


def test_an_endless_line_never_grows_the_buffer() -> None:
    s = LineSplitter(10)
    for _ in range(1000):
        assert s.feed(b"x" * 1000) == []
    assert len(s._buf) == 10
    assert s.feed(b"\n") == ["x" * 10 + " [gpulayer: line truncated, 999990 bytes dropped]"]


def test_invalid_utf8_is_replaced() -> None:
    assert LineSplitter(100).feed(b"caf\xe9\n") == ["caf\ufffd"]


def test_parse_stat_with_odd_command_names() -> None:
    text = "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 " + " ".join(["0"] * 12) + " 987654 0"
    st = parse_stat(text)
    assert (st.state, st.pgid, st.sid, st.start_ticks) == ("S", 4242, 4242, 987654)


def test_exit_outcomes() -> None:
    assert _exit_outcome(0).state == "succeeded"
    assert (_exit_outcome(3).state, _exit_outcome(3).exit_code) == ("failed", 3)
    killed = _exit_outcome(-9)
    assert (killed.state, killed.signal, killed.reason) == ("failed", 9, "killed by SIGKILL")


def test_skip_counts_lines_and_keeps_the_partial_one() -> None:
    s = LineSplitter(100)
    assert s.feed(b"kept\npart") == ["kept"]
    assert s.skip(b"ial\nx\ny\nne") == 3
    assert s.skip(b"w") == 0
    assert s.feed(b" line\n") == ["new line"]


def test_feed_mixes_short_and_truncated_lines_in_one_chunk() -> None:
    s = LineSplitter(4)
    assert s.feed(b"ab\nabcdefg\nxy\r\n") == [
        "ab",
        "abcd [gpulayer: line truncated, 3 bytes dropped]",
        "xy",
    ]


def test_own_cgroup_paths() -> None:
    text = "9:name=systemd:/\n4:memory,pids:/a/b\n0::/svc\n"
    assert _own_paths(text) == {"name=systemd": "/", "memory": "/a/b", "pids": "/a/b", "": "/svc"}


class Seen:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def feed(self, line: str) -> None:
        self.lines.append(line)


def test_the_sinks_watch_sees_the_stderr_lines_it_takes() -> None:
    # Not started: nothing is published, only queued (NATS is never touched here).
    sink = LogSink(cast(Any, None), cast(Any, None), "j", max_backlog_bytes=300)
    sink.watch = seen = Seen()
    sink.offer("stdout", "out")
    sink.offer("stderr", "err 1")
    assert sink.offer_marked("stderr", "err 2", 10)
    sink.offer("stderr", "x" * 300)  # no room: dropped, never seen
    sink.offer("stderr", "late")  # still no room for the marker and the line: dropped
    assert seen.lines == ["err 1", "err 2"]
    assert sink.dropped_total == 2

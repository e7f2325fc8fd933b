"""What the executor sends stays within placement's bounds."""

from __future__ import annotations

from pathlib import Path

from gpulayer_contracts.bounds import MIN_MAX_PAYLOAD
from gpulayer_contracts.codec import encode
from gpulayer_contracts.events import LogLine
from gpulayer_executor.config import ExecutorConfig
from gpulayer_executor.output import LineSplitter
from gpulayer_executor.reporter import int32_exit_code


def test_exit_codes_are_reported_as_signed_int32() -> None:
    assert int32_exit_code(0xC0000005) == -1073741819  # a Windows access violation
    assert int32_exit_code(2**32 - 1) == -1
    assert [int32_exit_code(c) for c in (0, 1, 255, -9, None)] == [0, 1, 255, -9, None]


def test_the_longest_log_line_fits_the_smallest_max_payload() -> None:
    """A line is cut at max_line_bytes of output; what JSON makes of it is at most 6 bytes a
    byte (a control character as ``\\u0001``), plus the truncation note: under 128 KiB."""
    limit = ExecutorConfig(node_id="n", workdir=Path("/tmp"), base_env={}).max_line_bytes
    for worst in (b"\x01", b"\xff"):  # escaped in JSON; invalid UTF-8 (U+FFFD, 3 bytes)
        lines = LineSplitter(limit).feed(worst * (limit * 3) + b"\n")
        assert len(lines) == 1
        assert "line truncated" in lines[0]
        message = LogLine(job_id="j" * 128, stream="stdout", line=lines[0])
        assert len(encode(message)) < MIN_MAX_PAYLOAD

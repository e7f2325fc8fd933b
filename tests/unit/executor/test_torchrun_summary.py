"""The worker that failed first, from torchrun's own stderr (recorded here with torch 2.13.0,
tests/fixtures/torchrun/), and what forged or odd lines do to it. Pure."""

from __future__ import annotations

from pathlib import Path

from gpulayer_executor.torchrun import RootCause

TORCHRUN_RECORDINGS = Path(__file__).resolve().parents[2] / "fixtures" / "torchrun"


def read_stderr(name: str) -> RootCause:
    root = RootCause()
    for line in (TORCHRUN_RECORDINGS / name).read_text().splitlines():
        root.feed(line)
    return root


def test_the_worker_that_failed_first_from_torchruns_summary() -> None:
    # torch 2.13.0's own stderr: local rank 1 exited 3, torchrun then sent local rank 0 SIGTERM
    # (listed under "Failures", not the root cause) and exited 1 itself.
    root = read_stderr("worker-exit-3.stderr")
    assert (root.rank, root.local_rank, root.exit_code) == (1, 1, 3)
    assert root.summary() == "torchrun: its worker of global rank 1 (local 1) exited with code 3"


def test_a_worker_killed_by_a_signal() -> None:
    root = read_stderr("worker-sigkill.stderr")
    assert (root.rank, root.exit_code) == (0, -9)
    assert root.summary() == "torchrun: its worker of global rank 0 (local 0) was killed by SIGKILL"


def test_no_summary_without_torchruns_root_cause() -> None:
    root = RootCause()
    for line in ["  rank      : 1 (local_rank: 1)", "  exitcode  : 3 (pid: 10) ", "plain output"]:
        root.feed(line)
    assert root.summary() is None  # lines like its own, but not under "Root Cause"
    root.feed("Root Cause (first observed failure):")
    root.feed("  rank      : 99999999999999999999 (local_rank: 1)")  # too long a number
    root.feed("  exitcode  : 3 (pid: 10) ")
    assert root.summary() is None
    root.feed("x" * 600 + "  rank      : 1 (local_rank: 1)")  # an overlong line is skipped
    assert root.summary() is None
    # A later summary (torchrun restarted by the job itself) replaces an earlier one.
    for line in [
        "Root Cause (first observed failure):",
        "  rank      : 5 (local_rank: 1)",
        "  exitcode  : -99 (pid: 10) ",
        "============================================================",
        "  exitcode  : 7 (pid: 11) ",  # after the border: not part of the summary
    ]:
        root.feed(line)
    assert (
        root.summary() == "torchrun: its worker of global rank 5 (local 1) was killed by signal 99"
    )

"""asyncio's note on every close of a NATS connection upgraded to TLS is dropped; anything else
asyncio logs still shows."""

from __future__ import annotations

import logging

import pytest

import gpulayer_runtime.nats  # noqa: F401  (installs the filter)


def test_only_the_start_tls_eof_note_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("asyncio")
    with caplog.at_level(logging.WARNING, logger="asyncio"):
        log.warning("returning true from eof_received() has no effect when using ssl")
        log.warning("Task was destroyed but it is pending!")
    assert [r.getMessage() for r in caplog.records] == ["Task was destroyed but it is pending!"]

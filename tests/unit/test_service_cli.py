"""Each service's command line (``gpulayer_runtime.settings.service_arguments``): ``--version``
and ``--help`` answer and exit 0 before any setting is read; any other argument is a usage error
naming it, exit 2. The installed console scripts are run as an operator (or systemd) would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gpulayer_contracts
from gpulayer_executor.__main__ import main as executor_main
from gpulayer_placement.__main__ import main as placement_main
from gpulayer_probe.__main__ import main as probe_main
from gpulayer_runtime import settings
from gpulayer_web.__main__ import main as web_main

SERVICES = ("gpulayer-placement", "gpulayer-probe", "gpulayer-executor", "gpulayer-web")
MAINS = {
    "gpulayer-placement": placement_main,
    "gpulayer-probe": probe_main,
    "gpulayer-executor": executor_main,
    "gpulayer-web": web_main,
}
# The console scripts beside this interpreter (the workspace's venv).
BIN = Path(sys.executable).parent

# A setting every service would refuse at start (exit 2): an answer to --version or a bad
# argument must come before the environment is read.
BAD_ENV = {"GPULAYER_NATS_URL": "nats://127.0.0.1:4222", "GPULAYER_NATS_CREDS": "/nonexistent"}


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **BAD_ENV},
    )


@pytest.mark.parametrize("script", SERVICES)
def test_version_is_the_contracts_version(script: str) -> None:
    done = _run(script, "--version")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"{script} {gpulayer_contracts.__version__}\n"


@pytest.mark.parametrize("script", SERVICES)
def test_an_unknown_argument_is_a_usage_error_naming_it(script: str) -> None:
    done = _run(script, "--no-such-option")
    assert done.returncode == 2
    assert done.stdout == ""
    assert f"usage: {script} " in done.stderr
    assert "unrecognized arguments: --no-such-option" in done.stderr


@pytest.mark.parametrize("script", SERVICES)
def test_help_names_the_service_and_where_settings_come_from(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [f"/opt/gpulayer/bin/{script}", "--help"])
    with pytest.raises(SystemExit) as stopped:
        MAINS[script]()
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {script} [-h] [--version]\n")
    assert "GPULAYER_* environment variables" in out
    # The service's own description, not an empty one.
    description = out.split("\n\n")[1]
    assert len(description.split()) >= 8, out


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What run_service did, in order: logging set up (recorded, not done: it would replace
    the root logger's handlers for the tests after), the service's coroutine run."""
    done: list[str] = []
    monkeypatch.setattr(settings, "setup_logging", lambda service, fmt: done.append("logging"))
    return done


def test_a_positional_argument_is_refused_and_the_service_never_starts(
    steps: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def amain() -> None:
        steps.append("started")

    monkeypatch.setattr(sys, "argv", ["gpulayer-test", "placement.toml"])
    with pytest.raises(SystemExit) as stopped:
        settings.run_service("gpulayer-test", amain, "A test service.")
    assert stopped.value.code == 2
    assert "unrecognized arguments: placement.toml" in capsys.readouterr().err
    assert steps == []


def test_no_argument_runs_the_service(steps: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    async def amain() -> None:
        steps.append("started")

    monkeypatch.setattr(sys, "argv", ["gpulayer-test"])
    settings.run_service("gpulayer-test", amain)
    assert steps == ["logging", "started"]

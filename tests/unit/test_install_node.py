"""deploy/install-node checks every argument and file before it changes anything: a missing or
wrong one is named, exit status 2. (Installing is tested on systemd nodes: tests/deploy.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "install-node"
CREDS = "-----BEGIN NATS USER JWT-----\neyJ0eXAi\n------END NATS USER JWT------\n"


def install_node(*args: str) -> subprocess.CompletedProcess[str]:
    # --wheels names no folder: were every other check to pass, it would still stop there.
    argv = ["bash", str(SCRIPT), *args, "--wheels", "/nonexistent/wheels"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    path = tmp_path / "node.creds"
    path.write_text(CREDS)
    return path


def test_help_lists_every_option() -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0
    for option in ("--nats-url", "--creds", "--placement-keys", "--ca", "--node-id", "--set"):
        assert option in done.stdout


def test_the_missing_arguments_are_named() -> None:
    done = install_node()
    assert done.returncode == 2
    assert "missing --nats-url --creds --placement-keys" in done.stderr


def test_an_unknown_argument_is_named() -> None:
    done = install_node("--nats", "tls://x:4222")
    assert done.returncode == 2
    assert "unknown argument --nats" in done.stderr


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--creds", "/nonexistent/node.creds"], "--creds /nonexistent/node.creds: no such file"),
        (["--ca", "/nonexistent/ca.crt"], "--ca /nonexistent/ca.crt: no such file"),
        (["--node-id", "gpu.01"], "node id 'gpu.01': must be one NATS subject token"),
        (["--placement-keys", "not a key"], "--placement-keys: base64url keys"),
        (["--set", "lower=1"], "--set lower=1: NAME=VALUE"),
    ],
)
def test_a_wrong_argument_is_named(creds: Path, extra: list[str], said: str) -> None:
    args = {"--nats-url": "tls://nats:4222", "--creds": str(creds), "--placement-keys": "abc_-="}
    for name, value in zip(extra[::2], extra[1::2], strict=True):
        args[name] = value
    done = install_node(*(x for pair in args.items() for x in pair))
    assert done.returncode == 2, done.stderr
    assert said in done.stderr


def test_a_file_that_is_no_credential_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("hello\n")
    done = install_node(
        "--nats-url", "tls://nats:4222", "--creds", str(other), "--placement-keys", "k"
    )
    assert done.returncode == 2
    assert "not a NATS credential" in done.stderr


def test_a_ca_without_a_certificate_is_refused(creds: Path, tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("not pem\n")
    done = install_node(
        "--nats-url", "tls://nats:4222", "--creds", str(creds), "--placement-keys", "k",
        "--ca", str(ca),
    )  # fmt: skip
    assert done.returncode == 2
    assert "no PEM certificate" in done.stderr


def test_without_the_wheels_it_stops_before_changing_anything(creds: Path) -> None:
    done = install_node(
        "--nats-url", "tls://nats:4222", "--creds", str(creds), "--placement-keys", "k"
    )
    assert done.returncode == 2
    assert "--wheels /nonexistent/wheels: no such folder" in done.stderr

"""The whole way, with the services as separate processes against real NATS and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import stat
import sys
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from tests.helpers import Services, bin_path, dev_up, events_until, service_env

from gpulayer_contracts.subjects import JOBS_SUBMIT, MSG_ID_HEADER
from gpulayer_runtime.database import pgpass_line, replace_url
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def stack(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client
) -> AsyncIterator[dict[str, str]]:
    await ensure_streams(nc.jetstream())
    env = service_env(nats_url, database_url, tmp_path / "work", "e2e-node")
    async with Services() as services:
        for name in ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe"):
            await services.start(name, env, tmp_path / f"{name}.log")
        yield env
    for name, proc in services.procs.items():
        # A clean shutdown on SIGTERM, not a crash.
        assert proc.returncode == 0, (
            f"{name} exited {proc.returncode}: " + (tmp_path / f"{name}.log").read_text()[-2000:]
        )


async def test_cpu_job_runs_end_to_end(stack: dict[str, str], nc: Client, tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    job = {
        "job_id": "e2e-cpu",
        "command": [
            sys.executable,
            "-c",
            f"import os; open({str(out)!r}, 'w').write(repr(os.environ['CUDA_VISIBLE_DEVICES']))",
        ],
    }
    waiter = asyncio.create_task(events_until(nc, {"e2e-cpu"}))
    await asyncio.sleep(0)  # let the subscription register before publishing
    await nc.flush()
    await nc.jetstream().publish(
        JOBS_SUBMIT, json.dumps(job).encode(), headers={MSG_ID_HEADER: "e2e-cpu"}
    )
    seen = await waiter
    types = seen["e2e-cpu"]
    assert types[0] == "accepted"
    assert types[-1] == "succeeded", types
    assert "placed" in types
    assert "running" in types
    assert out.read_text() == "''"  # a CPU job sees CUDA_VISIBLE_DEVICES set and empty


async def test_duplicate_id_runs_once_and_garbage_is_rejected(
    stack: dict[str, str], nc: Client, tmp_path: Path
) -> None:
    counter = tmp_path / "count.txt"
    body = json.dumps(
        {"job_id": "e2e-dup", "command": ["sh", "-c", f"echo run >> {counter}"]}
    ).encode()
    waiter = asyncio.create_task(events_until(nc, {"e2e-dup", "e2e-bad", "e2e-next"}))
    await asyncio.sleep(0)
    await nc.flush()
    js = nc.jetstream()
    # Different message ids: JetStream's dedupe window doesn't hide the copy, placement must.
    await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "copy-1"})
    await js.publish(JOBS_SUBMIT, body, headers={MSG_ID_HEADER: "copy-2"})
    await js.publish(JOBS_SUBMIT, b"this is not json")
    await js.publish(JOBS_SUBMIT, b'{"job_id": "e2e-bad", "command": "ls -l"}')
    await js.publish(JOBS_SUBMIT, json.dumps({"job_id": "e2e-next", "command": ["true"]}).encode())
    seen = await waiter
    assert seen["e2e-dup"].count("accepted") == 1
    assert seen["e2e-dup"].count("running") == 1
    assert seen["e2e-dup"][-1] == "succeeded"
    assert counter.read_text() == "run\n"
    assert seen["e2e-bad"] == ["rejected"]
    assert seen["e2e-next"][-1] == "succeeded"


async def test_dev_up_once_runs_the_examples(tmp_path: Path) -> None:
    """As `make run` starts it: the default, relative data folder (.gpulayer) under the cwd."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    proc = await asyncio.create_subprocess_exec(
        bin_path("gpulayer"), "dev", "up", "--once",
        "--examples", str(ROOT / "examples"), "--timeout", "90",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 150)
    text = out.decode()
    assert proc.returncode == 0, text
    assert re.search(r"cpu-hello-\d+ succeeded", text), text
    assert "ok cpu-hello.toml: expected succeeded, got succeeded" in text
    # A job by profile: dev up gave placement examples/profiles.toml.
    assert "ok cpu-profile.toml: expected succeeded, got succeeded" in text
    assert (tmp_path / ".gpulayer" / "postgres" / "pgdata" / "PG_VERSION").exists()
    # The examples ran with signed grants: dev up made placement's key, readable by its owner.
    seed = tmp_path / ".gpulayer" / "keys" / "placement.seed"
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    executor_log = (tmp_path / ".gpulayer" / "logs" / "gpulayer-executor.log").read_text()
    assert "signed grants=required (1 keys" in executor_log
    assert "refused grant" not in executor_log
    # The fleet page: its URL on a line of its own, served there, as the read-only viewer.
    url = re.search(r"^web {9}(http://127\.0\.0\.1:\d+)$", text, re.MULTILINE)
    assert url, text
    web_log = (tmp_path / ".gpulayer" / "logs" / "gpulayer-web.log").read_text()
    assert f"Uvicorn running on {url.group(1)}" in web_log
    assert "caller=web" in web_log


async def test_readme_snippet_runs_against_dev_up(tmp_path: Path) -> None:
    """The nats-py example in the README, unchanged but for the URL, against `gpulayer dev up`."""
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S)
    assert snippet is not None
    async with dev_up(tmp_path) as stack:
        hint = stack.lines[-1]
        url, cli_env = stack.nats_url, stack.cli_env
        # The hint it prints is enough for the CLI in another shell to reach the stack.
        assert cli_env.get("GPULAYER_NATS_URL", "nats://127.0.0.1:4222") == url, hint
        # The stack is locked, and the hint names the user's credential (the data folder is not
        # ./.gpulayer, where the CLI would find it by itself).
        creds = cli_env["GPULAYER_NATS_CREDS"]
        assert creds.endswith("auth/creds/user-dev.creds"), hint
        # The command as printed (gpulayer, or its path when PATH doesn't find this one), run
        # from the folder dev up runs in, with PATH as the test has it.
        nodes = await asyncio.create_subprocess_exec(
            stack.cli, "nodes", "--json", env=cli_env, cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        listed, problem = await asyncio.wait_for(nodes.communicate(), 30)
        assert nodes.returncode == 0, (hint, problem.decode())
        assert isinstance(json.loads(listed), list)
        # The newcomer's path, with the stack locked: submit and wait, as the dev user.
        submitted = await asyncio.create_subprocess_exec(
            stack.cli, "submit", str(ROOT / "examples" / "cpu-hello.toml"), "--wait", "--json",
            env=cli_env, cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        printed, problem = await asyncio.wait_for(submitted.communicate(), 60)
        assert submitted.returncode == 0, (printed.decode(), problem.decode())
        followed = [json.loads(line) for line in printed.decode().splitlines()]
        assert followed[-1]["type"] == "succeeded"
        assert {e["owner"] for e in followed} == {"dev"}
        script = tmp_path / "snippet.py"
        script.write_text(
            snippet[1]
            .replace("nats://127.0.0.1:4222", url)
            .replace(".gpulayer/auth/creds/user-dev.creds", creds)
        )
        # Only nats-py: the snippet imports nothing of gpulayer.
        assert "gpulayer_" not in snippet[1]
        run = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(run.communicate(), 60)
        text = out.decode()
        assert run.returncode == 0, text
        types = [line.split()[0] for line in text.splitlines() if line]
        assert types[0] == "accepted"
        assert types[-1] == "succeeded", text


async def test_dev_up_says_why_the_stack_could_not_start(tmp_path: Path) -> None:
    """A data folder that can't be one (here: a file) is a one-line error and exit 1, no traceback."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    proc = await asyncio.create_subprocess_exec(
        bin_path("gpulayer"), "dev", "up", "--once", "--data-dir", str(blocker),
        "--examples", str(ROOT / "examples"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 1, text
    assert f"could not start the stack in {blocker}" in text, text
    assert "Traceback" not in text, text


async def _exits_2(service: str, env: dict[str, str], tmp_path: Path) -> str:
    """What ``service`` said as it refused to start: exit 2, no traceback."""
    proc = await asyncio.create_subprocess_exec(
        bin_path(service), env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    return text


@pytest.mark.parametrize("service", ["gpulayer-placement", "gpulayer-executor", "gpulayer-probe"])
async def test_a_bad_setting_is_one_line_and_exit_2(service: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    env |= {"GPULAYER_NODE_ID": "n1", "GPULAYER_HEARTBEAT_S": "often"}
    env |= {"GPULAYER_NODE_TIMEOUT_S": "soon", "GPULAYER_EXECUTOR_WORKDIR": str(tmp_path / "w")}
    text = await _exits_2(service, env, tmp_path)
    assert re.search(r"GPULAYER_(HEARTBEAT|NODE_TIMEOUT)_S", text), text


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('[profiles."x@1"]\npython = "3.10+"', "profiles.\"x@1\".python: '3.10+' is not a PEP 440"),
        ("[profiles", "not valid TOML"),
        (None, "cannot read the profiles file"),
    ],
)
async def test_placement_refuses_to_start_with_a_bad_profiles_file(
    content: str | None, expected: str, tmp_path: Path
) -> None:
    profiles = tmp_path / "profiles.toml"
    if content is not None:
        profiles.write_text(content)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    env["GPULAYER_PROFILES"] = str(profiles)
    text = await _exits_2("gpulayer-placement", env, tmp_path)
    assert f"configuration: GPULAYER_PROFILES: {profiles}" in text, text
    assert expected in text, text


async def test_placement_names_the_database_setting_it_is_refused_for(
    nats_url: str, database_url: str, tmp_path: Path
) -> None:
    """A passfile libpq would skip, and a password PostgreSQL refuses: each one line naming
    GPULAYER_DATABASE_URL and exit 2, never a traceback or a wait."""
    passfile = urllib.parse.parse_qs(urllib.parse.urlsplit(database_url).query).get("passfile")
    if not passfile:
        pytest.skip("the database URL of the environment names no passfile")
    copy = tmp_path / "open.pgpass"
    shutil.copyfile(passfile[0], copy)
    copy.chmod(0o644)
    env = service_env(nats_url, replace_url(database_url, passfile=copy), tmp_path / "w", "n1")
    text = await _exits_2("gpulayer-placement", env, tmp_path)
    assert f"GPULAYER_DATABASE_URL: the URL's passfile {copy} has mode 0644" in text, text
    copy.chmod(0o600)
    copy.write_text(pgpass_line("gpulayer", "a-guess"))
    text = await _exits_2("gpulayer-placement", env, tmp_path)
    assert re.search(r"GPULAYER_DATABASE_URL \(postgresql://\S+\): password authentication", text)

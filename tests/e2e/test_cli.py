"""The `gpulayer` command line against a running stack, and `gpulayer check` without one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import Services, bin_path, gpulayer, service_env

from gpulayer_contracts.subjects import node_grants
from gpulayer_runtime.nats import ensure_streams

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture
async def stack(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client
) -> AsyncIterator[dict[str, str]]:
    await ensure_streams(nc.jetstream())
    env = service_env(
        nats_url, database_url, tmp_path / "work", "cli-node", GPULAYER_KILL_GRACE_S="0.5"
    )
    async with Services() as services:
        for name in ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe"):
            await services.start(name, env, tmp_path / f"{name}.log")
        async with asyncio.timeout(30):
            while True:  # until placement answers, knows this node and hears its executor
                code, out, _ = await gpulayer("nodes", "--json", env=env)
                nodes = {n["node_id"]: n for n in json.loads(out)} if code == 0 else {}
                if nodes.get("cli-node", {}).get("executor") == "up":
                    break
                await asyncio.sleep(0.1)
        yield env


def write_job(path: Path, job: Mapping[str, object]) -> str:
    path.write_text(json.dumps(job))
    return str(path)


async def test_submit_wait_follows_the_job(stack: dict[str, str], tmp_path: Path) -> None:
    ok = write_job(tmp_path / "ok.json", {"job_id": "cli-ok", "command": ["echo", "hi"]})
    code, out, err = await gpulayer("submit", ok, "--wait", env=stack)
    assert code == 0, out + err
    assert "cli-ok" in out
    assert "succeeded" in out
    bad = write_job(tmp_path / "bad.json", {"job_id": "cli-bad", "command": ["sh", "-c", "exit 4"]})
    code, out, _ = await gpulayer("submit", bad, "--wait", "--json", env=stack)
    assert code == 1  # the exit code follows the job
    last = json.loads(out.strip().splitlines()[-1])
    assert last["type"] == "failed"
    assert last["exit_code"] == 4
    code, out, _ = await gpulayer("logs", "cli-ok", env=stack)
    assert code == 0
    assert "hi" in out
    # The job's events come from the executor; its row is updated when placement has consumed
    # the executor's status reports, which may be later: poll until placement has recorded it.
    async with asyncio.timeout(20):
        while True:
            code, out, _ = await gpulayer("job", "cli-bad", "--json", env=stack)
            assert code == 0
            record = json.loads(out)
            if record["job"]["state"] == "failed":
                break
            assert record["job"]["state"] in ("placed", "running"), record["job"]
            await asyncio.sleep(0.1)
    types = [e["type"] for e in record["events"]]
    assert types[0] == "accepted"
    assert types[-1] == "failed"
    assert "placed" in types
    code, _, err = await gpulayer("job", "no-such-job", env=stack)
    assert code == 1
    assert "no job 'no-such-job'" in err


async def test_nodes_show_what_the_node_offers_and_how_it_enforces(
    stack: dict[str, str],
) -> None:
    """The executor's heartbeat reaches placement: its job slots and enforcement mode, and the
    probe's cores and RAM less the executor's reserve, with what a running job holds."""
    code, out, err = await gpulayer("nodes", "--json", env=stack)
    assert code == 0, err
    (node,) = [n for n in json.loads(out) if n["node_id"] == "cli-node"]
    res = node["resources"]
    assert res["slots"] == 64  # GPULAYER_EXECUTOR_MAX_JOBS' default
    assert res["cores"] == node["capabilities"]["host"]["cpu_cores"]  # no cores reserved
    memory = node["capabilities"]["host"]["memory_bytes"] / 1e9
    assert res["memory_gb"] == pytest.approx(memory - 1.0)  # 1 GB reserved by default
    assert res["enforcement"] == "none" or res["enforcement"].startswith("cgroup v")
    assert (res["cores_used"], res["slots_used"]) == (0, 0)
    text_code, text, _ = await gpulayer("nodes", env=dict(stack, COLUMNS="250"))
    assert text_code == 0
    assert res["enforcement"] in " ".join(text.split())


async def test_a_job_id_names_one_job(stack: dict[str, str], tmp_path: Path) -> None:
    """Submitting a known id again follows that job; a changed job under a used id is refused
    before anything is published (placement would ignore it)."""
    job = {"job_id": "cli-once", "command": ["echo", "first"]}
    code, out, err = await gpulayer(
        "submit", write_job(tmp_path / "a.json", job), "--wait", env=stack
    )
    assert code == 0, out + err
    code, out, err = await gpulayer(
        "submit", write_job(tmp_path / "b.json", job), "--wait", env=stack
    )
    assert code == 0, out + err
    # (The record may still say placed or running: placement stores the executor's reports
    # after the events the first --wait followed to the end.)
    said = r"cli-once was already submitted \((placed|running|succeeded)\); not submitting"
    assert re.search(said, err), err
    assert out.count("succeeded") == 1  # the same job's history, once
    changed = {**job, "command": ["echo", "second"]}
    code, out, err = await gpulayer("submit", write_job(tmp_path / "c.json", changed), env=stack)
    assert code == 2, out + err
    assert "job id 'cli-once' already names a different job (" in err
    assert "choose a new job_id" in err
    code, out, _ = await gpulayer("logs", "cli-once", env=stack)
    assert out.strip() == "first"


async def test_a_job_by_profile_and_gpulayer_profiles(
    stack: dict[str, str], tmp_path: Path
) -> None:
    """The stack's placement has the shipped profiles (examples/profiles.toml): a job naming
    one runs with the profile named in its events and record, submitting it again is the same
    job (the record holds it expanded), and ``gpulayer profiles`` counts this one-node fleet."""
    example = str(FIXTURES.parent.parent / "examples" / "cpu-profile.toml")
    code, out, err = await gpulayer("submit", example, "--wait", env=stack)
    assert code == 0, out + err
    assert "accepted (profile python-linux@1)" in out
    assert "(profile python-linux@1)" in out.split("placed on", 1)[1].splitlines()[0]
    code, out, err = await gpulayer("submit", example, env=stack)
    assert code == 0, out + err
    assert "cpu-profile was already submitted" in err
    code, out, _ = await gpulayer("job", "cpu-profile", env=stack)
    assert code == 0
    assert "profile python-linux@1" in out.splitlines()[0]
    code, out, err = await gpulayer("profiles", "--json", env=stack)
    assert code == 0, out + err
    entries = {e["profile"]: e for e in json.loads(out)}
    assert set(entries) == {"python-linux@1", "torch-2.5-cu124@1", "torch-2.5-cu124@2"}
    linux = entries["python-linux@1"]
    assert (linux["satisfy"], linux["nodes"], linux["reasons"]) == (1, 1, [])
    torch = entries["torch-2.5-cu124@1"]
    if torch["satisfy"] == 0:  # this machine has no CUDA GPU with torch 2.5 (the usual case)
        assert all(r.endswith("(profile torch-2.5-cu124@1)") for r in torch["reasons"]), torch
    code, out, _ = await gpulayer("profiles", env=stack)
    assert code == 0
    assert "python-linux@1" in out
    assert "1/1" in out


# Execs argv[1:] with SIGINT's default disposition (a handler or SIG_DFL, never SIG_IGN, is
# what exec resets).
SIGINT_DEFAULT_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


async def test_ctrl_c_stops_following_not_the_job(stack: dict[str, str], tmp_path: Path) -> None:
    job = write_job(tmp_path / "long.json", {"job_id": "cli-long", "command": ["sleep", "60"]})
    # As a terminal starts it: SIGINT at its default. A suite started in the background by a
    # non-interactive shell (`make test &`) has SIGINT ignored, and an ignored signal stays
    # ignored across exec: the CLI would never see this Ctrl-C (3 of 3 runs of such a
    # test-repeat failed here, 30 s after the signal).
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SIGINT_DEFAULT_EXEC,
        bin_path("gpulayer"), "submit", job, "--wait",
        env={**stack, "PYTHONFAULTHANDLER": "1"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        while "cli-long running" not in (line := (await proc.stdout.readline()).decode()):
            assert line, "submit --wait ended before the job ran"
    proc.send_signal(signal.SIGINT)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    except TimeoutError:
        # Still running (or a child of it holds its pipes): say which, with the CLI's stacks.
        exited = proc.returncode
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack to stderr
        assert proc.stderr is not None
        err = await asyncio.wait_for(proc.stderr.read(1 << 16), 10)
        raise AssertionError(
            f"30 s after Ctrl-C: exit code {exited}, stderr:\n{err.decode()}"
        ) from None
    assert proc.returncode == 130
    assert "stopped following cli-long; the job itself goes on" in err.decode()
    assert "Traceback" not in err.decode()
    code, out, _ = await gpulayer("job", "cli-long", "--json", env=stack)
    assert json.loads(out)["job"]["state"] in ("placed", "running")
    code, _, _ = await gpulayer("cancel", "cli-long", env=stack)
    assert code == 0


async def test_submit_carries_the_callers_trace(
    stack: dict[str, str], nc: Client, tmp_path: Path
) -> None:
    """With TRACEPARENT set (CI systems, otel-cli), the job's grant travels under that trace."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    granted: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_grant(msg: Msg) -> None:
        if b'"cli-traced"' in msg.data and not granted.done():
            granted.set_result((msg.headers or {}).get("traceparent", ""))

    sub = await nc.subscribe(node_grants("cli-node"), cb=on_grant)
    try:
        job = write_job(tmp_path / "t.json", {"job_id": "cli-traced", "command": ["true"]})
        env = {**stack, "TRACEPARENT": f"00-{trace_id}-00f067aa0ba902b7-01"}
        code, out, err = await gpulayer("submit", job, "--wait", env=env)
        assert code == 0, out + err
        traceparent = await asyncio.wait_for(granted, 10)
    finally:
        await sub.unsubscribe()
    assert traceparent.split("-")[1] == trace_id


async def test_invalid_job_file_exits_2_naming_the_field(
    stack: dict[str, str], tmp_path: Path
) -> None:
    f = tmp_path / "typo.toml"
    f.write_text('job_id = "t"\ncommand = ["true"]\n[requirements]\ngpu_cont = 1\n')
    code, _, err = await gpulayer("submit", str(f), env=stack)
    assert code == 2
    assert "$.requirements.gpu_cont: unknown field" in err


async def test_jobs_explain_and_cancel(stack: dict[str, str], tmp_path: Path) -> None:
    waiting = write_job(
        tmp_path / "w.json",
        {
            "job_id": "cli-wait",
            "command": ["true"],
            "requirements": {"accelerator": "cuda", "gpu_count": 1},
        },
    )
    code, _, _ = await gpulayer("submit", waiting, env=stack)
    assert code == 0
    async with asyncio.timeout(20):
        while True:
            code, out, _ = await gpulayer("explain", "cli-wait", "--json", env=stack)
            if (
                code == 0
                and json.loads(out)["state"] == "pending"
                and json.loads(out).get("reasons")
            ):
                break
            await asyncio.sleep(0.1)
    explained = json.loads(out)
    assert explained["summary"].startswith("0/1 nodes can run this job")
    assert any("cuda" in r for r in explained["reasons"])
    code, out, _ = await gpulayer("cancel", "cli-wait", "--json", env=stack)
    assert code == 0
    assert json.loads(out)["state"] == "cancelled"

    sleeper = write_job(tmp_path / "s.json", {"job_id": "cli-sleep", "command": ["sleep", "60"]})
    follow = asyncio.create_task(gpulayer("submit", sleeper, "--wait", "--json", env=stack))
    async with asyncio.timeout(20):
        while True:
            code, out, _ = await gpulayer("jobs", "--json", "--state", "running", env=stack)
            if code == 0 and any(j["job_id"] == "cli-sleep" for j in json.loads(out)):
                break
            await asyncio.sleep(0.1)
    code, out, _ = await gpulayer("cancel", "cli-sleep", "--json", env=stack)
    assert code == 0
    assert json.loads(out)["state"] == "cancelling"
    code, out, _ = await follow
    assert code == 1
    assert json.loads(out.strip().splitlines()[-1])["type"] == "cancelled"
    async with asyncio.timeout(20):
        while True:  # placement records the executor's report
            code, out, _ = await gpulayer("jobs", "--json", "--state", "cancelled", env=stack)
            if code == 0 and any(j["job_id"] == "cli-sleep" for j in json.loads(out)):
                break
            await asyncio.sleep(0.1)
    code, out, err = await gpulayer("cancel", "cli-sleep", env=stack)
    assert code == 1  # already finished: a clear refusal
    assert "already cancelled" in err


async def test_unreachable_nats_exits_3(tmp_path: Path) -> None:
    env = dict(os.environ, GPULAYER_NATS_URL="nats://127.0.0.1:1")
    code, _, err = await gpulayer("nodes", env=env, timeout=30)
    assert code == 3
    assert "cannot reach NATS" in err


def _fake_nvidia(tmp_path: Path, recording: str) -> dict[str, str]:
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    shutil.copy(FIXTURES / "nvidia-smi" / "fake-nvidia-smi", tools / "nvidia-smi")
    (tools / "nvidia-smi").chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
        FAKE_NVIDIA_SMI_DIR=str(FIXTURES / "nvidia-smi" / recording),
    )


async def test_check_answers_for_this_machine(tmp_path: Path) -> None:
    cuda = write_job(
        tmp_path / "cuda.json",
        {
            "job_id": "chk",
            "command": ["true"],
            "requirements": {
                "accelerator": "cuda",
                "gpu_count": 2,
                "min_cuda_compute_capability": 8.0,
            },
        },
    )
    env = _fake_nvidia(tmp_path, "h100-dgx-8x")
    code, out, err = await gpulayer("check", cuda, "--python", sys.executable, env=env)
    assert code == 0, out + err
    assert "yes" in out
    env = _fake_nvidia(tmp_path, "t4-2x")
    code, out, _ = await gpulayer("check", cuda, "--json", env=env)
    assert code == 1
    answer = json.loads(out)
    assert answer["fits"] is False
    assert any("compute capability" in r for r in answer["reasons"]), answer
    invalid = tmp_path / "invalid.json"
    invalid.write_text(
        '{"job_id": "x", "command": ["true"], "requirements": {"accelerator": "tpu"}}'
    )
    code, _, err = await gpulayer("check", str(invalid), env=env)
    assert code == 2
    assert "$.requirements.accelerator" in err
    # Host cores and RAM count too: more than this machine has, then what it has.
    cores = os.cpu_count() or 1
    greedy = write_job(
        tmp_path / "greedy.json",
        {"job_id": "g", "command": ["true"], "requirements": {"cpu_cores": cores + 1}},
    )
    code, out, _ = await gpulayer("check", greedy, "--json", env=env)
    assert code == 1
    (reason,) = json.loads(out)["reasons"]
    assert reason.startswith(f"1 has < {cores + 1} cores for jobs (best: "), reason
    assert reason.endswith(f" {cores})"), reason
    ram = write_job(
        tmp_path / "ram.json",
        {"job_id": "r", "command": ["true"], "requirements": {"memory_gb": 1e6}},
    )
    code, out, _ = await gpulayer("check", ram, "--json", env=env)
    assert code == 1
    assert "GB of RAM for jobs" in json.loads(out)["reasons"][0]
    fits = write_job(
        tmp_path / "fits.json",
        {"job_id": "f", "command": ["true"], "requirements": {"cpu_cores": cores}},
    )
    code, out, err = await gpulayer("check", fits, env=env)
    assert code == 0, out + err

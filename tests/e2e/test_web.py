"""The fleet page in a real browser, through the whole stack: placement, executor and probe
(a recorded 8-GPU nvidia-smi first on its PATH, one GPU with uncorrected ECC errors) and
gpulayer-web as processes, its viewer credential, Playwright driving Debian's chromium.

``GPULAYER_WEB_SCREENSHOTS=<folder>`` saves a screenshot of each page there (docs/web/ holds
the ones docs/web.md shows)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from tests.helpers import Services, gpulayer, role_creds, service_env

from gpulayer_contracts.subjects import node_capabilities
from gpulayer_runtime.nats import ensure_streams
from gpulayer_runtime.servers import free_port

pytestmark = pytest.mark.e2e

NVIDIA = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL = "apt-get install -y chromium"
NODE = "web-node"
# A value no page may show: a job's env value (its name may be shown).
SECRET = "s3cr3t-web-value-9731"
HTML_NAME = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=1</script>'
SHOTS = os.environ.get("GPULAYER_WEB_SCREENSHOTS")


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if CHROMIUM is None:
        pytest.skip(f"no chromium for the browser tests: {INSTALL}")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM)
        try:
            yield b
        finally:
            await b.close()


def _tail(log: Path) -> str:
    return log.read_text()[-2000:]


def _whole(log: Path) -> str:
    return log.read_text()


def _folder(path: str) -> Path:
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


async def _listening(port: int, proc: asyncio.subprocess.Process, log: Path) -> None:
    """Until something accepts on ``port`` (the web service is up), or it died."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        assert proc.returncode is None, _tail(log)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            assert asyncio.get_running_loop().time() < deadline, _tail(log)
            await asyncio.sleep(0.1)
            continue
        writer.close()
        await writer.wait_closed()
        return


@pytest.fixture
async def stack(
    nats_url: str, database_url: str, tmp_path: Path, nc: Client
) -> AsyncIterator[dict[str, str]]:
    """The services and the web page; ``url`` is the page's address, the rest the CLI's env."""
    await ensure_streams(nc.jetstream())
    scenario = tmp_path / "h100"
    shutil.copytree(NVIDIA / "h100-dgx-8x", scenario)
    observe = scenario / "observe.txt"
    rows = observe.read_text().splitlines()
    sick = rows[4].replace("0x0000000000000000, 0, 0,", "0x0000000000000000, 2, 2,")
    assert sick != rows[4]
    assert sick.startswith("3,")
    observe.write_text("\n".join([*rows[:4], sick, *rows[5:]]) + "\n")
    tools = tmp_path / "bin"
    tools.mkdir()
    shutil.copy(NVIDIA / "fake-nvidia-smi", tools / "nvidia-smi")
    (tools / "nvidia-smi").chmod(0o755)
    env = service_env(
        nats_url,
        database_url,
        tmp_path / "work",
        NODE,
        PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
        FAKE_NVIDIA_SMI_DIR=str(scenario),
        GPULAYER_PROBE_OBSERVE_S="0.5",
    )
    port = free_port()
    web_env = dict(env, GPULAYER_WEB_PORT=str(port), GPULAYER_WEB_REFRESH_S="0.5")
    web_env.pop("GPULAYER_DATABASE_URL")  # it never reads the database
    viewer = role_creds("viewer", "web")
    if viewer is None:
        web_env.pop("GPULAYER_NATS_CREDS", None)
    else:
        web_env["GPULAYER_NATS_CREDS"] = viewer
    published: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await nc.subscribe(node_capabilities(NODE), cb=published.put)
    async with Services() as services:
        for name in ("gpulayer-placement", "gpulayer-executor", "gpulayer-probe"):
            await services.start(name, env, tmp_path / f"{name}.log")
        await services.start("gpulayer-web", web_env, tmp_path / "gpulayer-web.log")
        await asyncio.wait_for(published.get(), 60)
        await sub.unsubscribe()
        log = tmp_path / "gpulayer-web.log"
        await _listening(port, services.procs["gpulayer-web"], log)
        yield dict(env, url=f"http://127.0.0.1:{port}")
    web = services.procs["gpulayer-web"]
    assert web.returncode == 0, _tail(log)
    assert "caller=" + ("web" if viewer else "anonymous") in _whole(log)


def _job(path: Path, job: dict[str, Any]) -> str:
    path.write_text(json.dumps(job))
    return str(path)


async def _shot(page: Any, name: str) -> None:
    if SHOTS:
        await page.screenshot(path=str(_folder(SHOTS) / f"{name}.png"), full_page=True)


async def _no_secret(page: Any) -> None:
    html = await page.content()
    assert SECRET not in html, page.url


async def test_the_fleet_page_through_the_whole_stack(
    browser: Any, stack: dict[str, str], tmp_path: Path
) -> None:
    url = stack["url"]
    page = await browser.new_page(viewport={"width": 1440, "height": 900})
    dialogs: list[str] = []
    page.on("dialog", lambda d: dialogs.append(d.message))

    # Fleet: the node, its platform and its APIs, the support matrix beside it.
    await page.goto(url + "/")
    row = page.locator(f'tr[data-node="{NODE}"]')
    await row.wait_for(timeout=30_000)
    assert await row.locator("td.platform").inner_text() == "linux-x86_64"
    assert "cuda" in await row.locator("td.host-apis").inner_text()
    assert "8 x NVIDIA H100 80GB HBM3" in await row.inner_text()
    assert "hardware-validated" in await page.locator("#matrix").inner_text()
    # Its health arrives with the probe's observations: the page shows it without a reload.
    await page.evaluate("window.__same_page = true")
    await row.locator("td.health.h-unhealthy").wait_for(timeout=30_000)
    await _shot(page, "fleet")

    # Node: every device of the recorded nvidia-smi, GPU 3 unhealthy with its reason.
    await page.goto(f"{url}/nodes/{NODE}")
    devices = page.locator("#devices tbody tr")
    assert await devices.count() == 8
    bad = page.locator('#devices tr[data-index="3"]')
    assert await bad.locator("td.health").inner_text() == "unhealthy"
    assert "ECC" in await bad.inner_text()
    assert await page.locator("#devices td.h-unhealthy").count() == 1
    assert await page.locator("#devices td.h-healthy").count() == 7
    # The observations charted (a flat line of idle GPUs has no height: attached, not visible).
    await page.locator("svg polyline").first.wait_for(state="attached", timeout=30_000)
    assert "nvidia-smi" in await page.locator("#apis").inner_text()
    await _shot(page, "node")

    # Jobs: a job submitted with the CLI appears and succeeds on the open page, no reload.
    await page.goto(f"{url}/jobs")
    await page.evaluate("window.__same_page = true")
    ok = {"job_id": "web-ok", "command": [sys.executable, "-c", "import time; time.sleep(1)"],
          "name": HTML_NAME, "env": {"WEB_TEST_TOKEN": SECRET}}  # fmt: skip
    code, _, err = await gpulayer("submit", _job(tmp_path / "ok.json", ok), env=stack)
    assert code == 0, err
    done = page.locator('tr[data-job="web-ok"] td.state.js-succeeded')
    await done.wait_for(timeout=60_000)
    assert await page.evaluate("window.__same_page") is True
    # A job that waits: more GPUs than the node has.
    wait = {"job_id": "web-wait", "command": ["true"],
            "requirements": {"accelerator": "cuda", "gpu_count": 9}}  # fmt: skip
    code, _, err = await gpulayer("submit", _job(tmp_path / "wait.json", wait), env=stack)
    assert code == 0, err
    await page.locator('tr[data-job="web-wait"] td.state.js-pending').wait_for(timeout=30_000)
    await _no_secret(page)
    await _shot(page, "jobs")

    # A waiting job's page: the explanation, requirement by requirement.
    await page.goto(f"{url}/jobs/web-wait")
    explain = page.locator("#explain")
    await explain.wait_for(timeout=30_000)
    text = await explain.inner_text()
    assert "Why it waits" in text
    assert "0/1 nodes can run this job" in text
    assert await page.locator("#explain ul.reasons li").count() >= 1
    await _shot(page, "job-waiting")

    # A job named with HTML shows that text; nothing in it ran.
    await page.goto(f"{url}/jobs/web-ok")
    assert await page.locator("#job-name").inner_text() == HTML_NAME
    assert await page.locator("#job-state").inner_text() == "succeeded"
    assert "WEB_TEST_TOKEN" in await page.content()  # the env's name, never its value
    await _no_secret(page)
    timeline = await page.locator("#timeline").inner_text()
    for step in ("accepted", "placed", "running", "succeeded"):
        assert step in timeline
    await _shot(page, "job")

    # Owners: a quota an admin sets shows, listed to the viewer by placement's API.
    code, _, err = await gpulayer("quota", "set", "admin", "--gpus", "cuda=16", "--jobs", "100",
                                  env=stack)  # fmt: skip
    assert code == 0, err
    await page.goto(f"{url}/owners")
    admin = page.locator("#owners tr", has_text="admin")
    await admin.locator("td", has_text="/100").wait_for(timeout=30_000)
    assert "/16" in await admin.inner_text()
    await _shot(page, "owners")
    for path in ("/", f"/nodes/{NODE}", "/jobs", "/jobs/web-ok", "/jobs/web-wait", "/owners"):
        await page.goto(url + path)
        await _no_secret(page)
    assert await page.evaluate("window.__pwned === undefined")
    assert dialogs == []


async def test_the_page_serves_before_placement_and_refuses_other_roles(
    nats_url: str, nc: Client, tmp_path: Path
) -> None:
    """Started before placement (as `gpulayer dev up` may start it), the page answers and says
    placement is silent; once the streams exist its live feed starts. A credential of any
    role but viewer stops it at start (exit 2, naming the setting)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    env.update(GPULAYER_NATS_URL=nats_url, GPULAYER_WEB_PORT=str(port))
    viewer = role_creds("viewer", "web")
    if viewer is not None:
        env["GPULAYER_NATS_CREDS"] = viewer
    log = tmp_path / "web.log"
    async with Services() as services:
        await services.start("gpulayer-web", env, log)
        await _listening(port, services.procs["gpulayer-web"], log)
        page = await _http_get(port, "/")
        assert "200 OK" in page.split("\r\n", 1)[0]
        assert "placement did not answer" in page or "updated never" in page
        await ensure_streams(nc.jetstream())
        await asyncio.wait_for(_logged(log, "live feed on"), 30)
    assert services.procs["gpulayer-web"].returncode == 0, _tail(log)
    admin = role_creds("admin", "admin")
    if admin is None:
        return
    bad = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpulayer_web", env=dict(env, GPULAYER_NATS_CREDS=admin),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(bad.communicate(), 30)
    assert bad.returncode == 2, out
    assert b"GPULAYER_NATS_CREDS" in out
    assert b"its role is admin" in out


async def _http_get(port: int, path: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    body = await reader.read()
    writer.close()
    await writer.wait_closed()
    return body.decode()


async def _logged(log: Path, text: str) -> None:
    """Until ``text`` is in the log (the service's own account of what it did)."""
    while True:
        if text in _whole(log):
            return
        await asyncio.sleep(0.1)

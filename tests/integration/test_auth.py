"""NATS authentication and per-role permissions against a real nats-server started with the
generated auth config: one test per threat, each asserting the server's refusal and that
nothing was stored or delivered."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from tests.helpers import SecureNats, subscribed

from gpulayer_contracts.subjects import (
    JOB_WILDCARD_EVENTS,
    MAX_DELIVERIES_ADVISORY,
    MSG_ID_HEADER,
    jobs_submit,
    node_capabilities,
    node_grants,
    node_heartbeat,
    node_status,
)
from gpulayer_runtime.auth import AuthError, AuthStore, decode_jwt_claims, identity_of
from gpulayer_runtime.nats import connect, ensure_streams
from gpulayer_runtime.roles import ROLES, inbox_prefix, permissions
from gpulayer_runtime.servers import EmbeddedNats, NatsTls

pytestmark = pytest.mark.integration


class Watched:
    """A client whose asynchronous errors (permission violations) are kept to be awaited."""

    def __init__(self) -> None:
        self.errors: asyncio.Queue[str] = asyncio.Queue()
        self.nc: Client

    async def on_error(self, err: Exception) -> None:
        await self.errors.put(str(err))

    async def violation(self, action: str, subject: str, timeout: float = 5.0) -> str:
        """Wait for the server's permission violation for ``action`` on ``subject``."""
        # nats-py lowercases the server's -ERR line.
        want = f'permissions violation for {action} to "{subject}"'.lower()
        while True:
            err = await asyncio.wait_for(self.errors.get(), timeout)
            if want in err.lower():
                return err


@asynccontextmanager
async def client(secure: SecureNats, role: str, name: str = "") -> AsyncIterator[Watched]:
    watched = Watched()
    watched.nc = await connect(
        secure.url,
        f"t-{role}-{name}",
        creds=secure.creds(role, name),  # type: ignore[arg-type]
        error_cb=watched.on_error,
    )
    try:
        yield watched
    finally:
        await watched.nc.close()


@pytest.fixture
async def admin(secure_nats: SecureNats) -> AsyncIterator[Client]:
    """An admin connection with the streams declared."""
    nc = await secure_nats.connect("admin", "root")
    await ensure_streams(nc.jetstream())
    yield nc
    await nc.close()


async def stored(admin: Client, stream: str, subject: str) -> int:
    info = await admin.jetstream().stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


# nats-py leaves the socket of a refused connection to the garbage collector: collected (and
# its warning dropped) inside the test that caused it.
_refused_socket = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_refused_socket
async def test_anonymous_connect_is_refused(secure_nats: SecureNats) -> None:
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(
            secure_nats.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2
        )
    gc.collect()


@_refused_socket
async def test_a_forged_or_foreign_credential_is_refused(
    secure_nats: SecureNats, tmp_path: Path
) -> None:
    """Credentials of another operator (a look-alike made by an attacker) don't connect."""
    other = AuthStore(tmp_path / "other").init()
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await connect(
            secure_nats.url,
            "forger",
            creds=str(other.ensure("admin", "root")),
            allow_reconnect=False,
            max_reconnect_attempts=0,
        )
    gc.collect()


@pytest.mark.parametrize(
    ("kind", "subject_of", "stream"),
    [
        ("capabilities", node_capabilities, "NODES"),
        ("heartbeat", node_heartbeat, None),
        ("status", node_status, "STATUS"),
    ],
)
async def test_node_cannot_publish_as_another_node(
    secure_nats: SecureNats, admin: Client, kind: str, subject_of: object, stream: str | None
) -> None:
    assert callable(subject_of)
    seen: list[str] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(msg.subject)

    await admin.subscribe(subject_of("node-b"), cb=on_msg)
    await subscribed(admin)
    async with client(secure_nats, "node", "node-a") as node_a:
        await node_a.nc.publish(subject_of("node-b"), b'{"forged": true}')
        await node_a.violation("Publish", subject_of("node-b"))
        # Its own subject is fine (the same client, after the refusal: nothing else closed).
        await node_a.nc.publish(subject_of("node-a"), b"{}")
        await node_a.nc.flush()
    await admin.flush()
    assert seen == []
    if stream is not None:
        assert await stored(admin, stream, subject_of("node-b")) == 0
        assert await stored(admin, stream, subject_of("node-a")) == 1


async def test_node_cannot_read_another_nodes_grants(
    secure_nats: SecureNats, admin: Client
) -> None:
    await admin.jetstream().publish(node_grants("node-b"), b'{"grant": "for b"}')
    async with client(secure_nats, "node", "node-a") as node_a:
        js = node_a.nc.jetstream()
        # A plain subscription on the subject.
        await node_a.nc.subscribe(node_grants("node-b"))
        await node_a.violation("Subscription", node_grants("node-b"))
        # Node b's consumer.
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await js.pull_subscribe(
                node_grants("node-b"), durable="executor-node-b", stream="GRANTS"
            )
        await node_a.violation("Publish", "$JS.API.CONSUMER.INFO.GRANTS.executor-node-b")
        # Its own consumer name, on node b's subject: the subject names the filter.
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await js.add_consumer(
                "GRANTS",
                ConsumerConfig(name="executor-node-a", filter_subject=node_grants("node-b")),
                timeout=1,
            )
        await node_a.violation(
            "Publish", f"$JS.API.CONSUMER.CREATE.GRANTS.executor-node-a.{node_grants('node-b')}"
        )
        # Its own consumer subject, with node b's filter in the body: the server checks both.
        body = {
            "stream_name": "GRANTS",
            "config": {"name": "executor-node-a", "filter_subject": node_grants("node-b")},
        }
        reply = await node_a.nc.request(
            f"$JS.API.CONSUMER.CREATE.GRANTS.executor-node-a.{node_grants('node-a')}",
            json.dumps(body).encode(),
            timeout=5,
        )
        assert "error" in json.loads(reply.data)
        # Reading a stored message by subject.
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await js.get_last_msg("GRANTS", node_grants("node-b"))
    # Nothing consumed: b's grant is still there, and no consumer was made.
    assert await stored(admin, "GRANTS", node_grants("node-b")) == 1
    assert (await admin.jetstream().stream_info("GRANTS")).state.consumer_count == 0


async def test_node_pulls_its_own_grants(secure_nats: SecureNats, admin: Client) -> None:
    """The control for the test above: the executor's own consumer works with its rights."""
    await admin.jetstream().publish(node_grants("node-a"), b'{"grant": "for a"}')
    async with client(secure_nats, "node", "node-a") as node_a:
        sub = await node_a.nc.jetstream().pull_subscribe(
            node_grants("node-a"),
            durable="executor-node-a",
            stream="GRANTS",
            config=ConsumerConfig(durable_name="executor-node-a"),
        )
        (msg,) = await sub.fetch(1, timeout=5)
        assert msg.data == b'{"grant": "for a"}'
        await msg.ack_sync()
    assert await stored(admin, "GRANTS", node_grants("node-a")) == 0


async def test_user_cannot_submit_as_another_user(secure_nats: SecureNats, admin: Client) -> None:
    async with client(secure_nats, "user", "alice") as alice:
        js = alice.nc.jetstream()
        for subject in (jobs_submit("bob"), jobs_submit()):
            with pytest.raises(nats.errors.Error):
                await js.publish(subject, b'{"job_id": "x", "command": ["true"]}', timeout=1)
            await alice.violation("Publish", subject)
        ack = await js.publish(
            jobs_submit("alice"), b'{"job_id": "mine", "command": ["true"]}',
            headers={MSG_ID_HEADER: "mine"},
        )  # fmt: skip
        assert ack.stream == "JOBS"
    assert await stored(admin, "JOBS", jobs_submit("bob")) == 0
    assert await stored(admin, "JOBS", jobs_submit()) == 0
    assert await stored(admin, "JOBS", jobs_submit("alice")) == 1


async def test_user_cannot_read_another_users_events_or_logs(
    secure_nats: SecureNats, admin: Client
) -> None:
    js_admin = admin.jetstream()
    await js_admin.publish("gpulayer.job.bob.j1.events", b'{"type": "accepted"}')
    await js_admin.publish("gpulayer.job.bob.j1.logs", b'{"line": "HF_TOKEN=secret"}')
    await js_admin.publish("gpulayer.job.alice.j2.events", b'{"type": "accepted"}')
    async with client(secure_nats, "user", "alice") as alice:
        js = alice.nc.jetstream()
        for subject in ("gpulayer.job.bob.>", "gpulayer.job.>", "_INBOX.>", "_INBOX.user-bob.>"):
            await alice.nc.subscribe(subject)
            await alice.violation("Subscription", subject)
        for stream, subject in (
            ("JOB_EVENTS", "gpulayer.job.bob.j1.events"),
            ("LOGS", "gpulayer.job.bob.j1.logs"),
        ):
            # An ordered consumer (no filter in the API subject) is not allowed at all.
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
                await js.add_consumer(stream, ConsumerConfig(filter_subject=subject), timeout=1)
            await alice.violation("Publish", f"$JS.API.CONSUMER.CREATE.{stream}")
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
                await js.add_consumer(
                    stream, ConsumerConfig(name="peek", filter_subject=subject), timeout=1
                )
            await alice.violation("Publish", f"$JS.API.CONSUMER.CREATE.{stream}.peek.{subject}")
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
                await js.get_last_msg(stream, subject)
        # Its own consumer subject, someone else's filter in the body: the server refuses both a
        # different filter and a list of filters (which the subject could not name).
        own = "$JS.API.CONSUMER.CREATE.JOB_EVENTS.sly.gpulayer.job.alice.j2.events"
        for config in (
            {"name": "sly", "filter_subject": "gpulayer.job.bob.j1.events"},
            {"name": "sly", "filter_subjects": ["gpulayer.job.bob.j1.events"]},
            {"name": "sly"},
        ):
            body = {"stream_name": "JOB_EVENTS", "config": {**config, "deliver_subject": "x"}}
            reply = await alice.nc.request(own, json.dumps(body).encode(), timeout=5)
            assert "error" in json.loads(reply.data), config
        # Its own job's events: a named consumer filtered to its own prefix, on its inbox.
        inbox = alice.nc.new_inbox()
        assert inbox.startswith(inbox_prefix("user", "alice") + ".")
        sub = await alice.nc.subscribe(inbox)
        await js.add_consumer(
            "JOB_EVENTS",
            ConsumerConfig(
                name="own",
                filter_subject="gpulayer.job.alice.j2.events",
                deliver_subject=inbox,
                deliver_policy=DeliverPolicy.ALL,
            ),
        )
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b'{"type": "accepted"}'
    consumers = (await js_admin.stream_info("JOB_EVENTS")).state.consumer_count
    assert consumers == 1  # only alice's own
    assert (await js_admin.stream_info("LOGS")).state.consumer_count == 0


async def test_viewer_reads_but_cannot_submit_cancel_or_publish(
    secure_nats: SecureNats, admin: Client
) -> None:
    """The fleet page's read-only role: the API's reads and any job's events; the server
    refuses submitting, cancelling, publishing node or job subjects, and reading logs."""
    js_admin = admin.jetstream()
    await js_admin.publish("gpulayer.job.bob.j1.events", b'{"type": "accepted"}')
    await js_admin.publish("gpulayer.job.bob.j1.logs", b'{"line": "HF_TOKEN=secret"}')
    asked = await admin.subscribe("gpulayer.api.*.web")
    async with client(secure_nats, "viewer", "web") as web:
        js = web.nc.jetstream()
        for subject in (jobs_submit("web"), jobs_submit(), jobs_submit("bob")):
            with pytest.raises(nats.errors.Error):
                await js.publish(subject, b'{"job_id": "x", "command": ["true"]}', timeout=1)
            await web.violation("Publish", subject)
        for subject in (
            "gpulayer.api.cancel.web",
            "gpulayer.api.cancel",
            "gpulayer.api.nodes",  # the bare subject is the anonymous caller: every right
            "gpulayer.api.nodes.alice",
            node_capabilities("n1"),
            node_heartbeat("n1"),
            node_status("n1"),
            node_grants("n1"),
            "gpulayer.node.n1.control",
            "gpulayer.job.bob.j1.events",
            "gpulayer.job.bob.j1.logs",
            "gpulayer.dlq.x",
        ):
            await web.nc.publish(subject, b"{}")
            await web.violation("Publish", subject)
        for subject in ("gpulayer.job.>", "gpulayer.node.*.grants", "_INBOX.>", "gpulayer.api.>"):
            await web.nc.subscribe(subject)
            await web.violation("Subscription", subject)
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await js.add_consumer(
                "LOGS", ConsumerConfig(name="peek", filter_subject="gpulayer.job.bob.j1.logs"),
                timeout=1,
            )  # fmt: skip
        await web.violation("Publish", "$JS.API.CONSUMER.CREATE.LOGS.peek.gpulayer.job.bob.j1.logs")
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await js.purge_stream("JOB_EVENTS")
        await web.violation("Publish", "$JS.API.STREAM.PURGE.JOB_EVENTS")
        # What it may do: ask the API's reads as itself, read any job's events on its inbox.
        for verb in ("nodes", "jobs", "job", "explain", "matrix", "quota"):
            await web.nc.publish(f"gpulayer.api.{verb}.web", b"{}")
        await web.nc.flush()
        got = [(await asked.next_msg(timeout=5)).subject for _ in range(6)]
        assert got == [
            f"gpulayer.api.{v}.web" for v in ("nodes", "jobs", "job", "explain", "matrix", "quota")
        ]
        inbox = web.nc.new_inbox()
        assert inbox.startswith(inbox_prefix("viewer", "web") + ".")
        sub = await web.nc.subscribe(inbox)
        await js.add_consumer(
            "JOB_EVENTS",
            ConsumerConfig(
                name="timeline",
                filter_subject="gpulayer.job.bob.j1.events",
                deliver_subject=inbox,
                deliver_policy=DeliverPolicy.ALL,
            ),
        )
        assert (await sub.next_msg(timeout=5)).data == b'{"type": "accepted"}'
        # Every job's new events at once (the page refreshes on them): a wildcard filter.
        every = web.nc.new_inbox()
        woken = await web.nc.subscribe(every)
        await js.add_consumer(
            "JOB_EVENTS",
            ConsumerConfig(name="wake", filter_subject=JOB_WILDCARD_EVENTS, deliver_subject=every,
                           deliver_policy=DeliverPolicy.NEW),
        )  # fmt: skip
        await js_admin.publish("gpulayer.job.carol.j9.events", b'{"type": "placed"}')
        assert (await woken.next_msg(timeout=5)).subject == "gpulayer.job.carol.j9.events"
        assert web.nc.is_connected
    for stream in ("JOBS", "GRANTS", "STATUS", "CONTROL"):
        assert (await js_admin.stream_info(stream)).state.messages == 0, stream
    assert (await js_admin.stream_info("JOB_EVENTS")).state.messages == 2
    assert (await js_admin.stream_info("LOGS")).state.consumer_count == 0


async def test_user_cannot_purge_or_delete_a_stream(secure_nats: SecureNats, admin: Client) -> None:
    await admin.jetstream().publish(jobs_submit("alice"), b"{}")
    async with client(secure_nats, "user", "alice") as alice:
        js = alice.nc.jetstream()
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await js.purge_stream("JOBS")
        await alice.violation("Publish", "$JS.API.STREAM.PURGE.JOBS")
        with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
            await js.delete_stream("JOB_EVENTS")
        await alice.violation("Publish", "$JS.API.STREAM.DELETE.JOB_EVENTS")
    assert (await admin.jetstream().stream_info("JOBS")).state.messages == 1
    assert (await admin.jetstream().stream_info("JOB_EVENTS")).config.name == "JOB_EVENTS"


async def test_only_placement_and_admins_create_streams(secure_nats: SecureNats) -> None:
    for role, name in (("node", "node-a"), ("user", "alice")):
        async with client(secure_nats, role, name) as c:
            with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
                await ensure_streams(c.nc.jetstream())
            await c.violation("Publish", "$JS.API.STREAM.CREATE.NODES")
    async with client(secure_nats, "placement") as placement:
        await ensure_streams(placement.nc.jetstream())
        # Twice: the second call updates what exists.
        await ensure_streams(placement.nc.jetstream())


async def test_credentials_carry_the_roles_permissions(auth_store: AuthStore) -> None:
    """What the server is given is what ``roles.permissions`` says (docs/security.md shows it)."""
    for role, name in (
        ("placement", ""), ("node", "n1"), ("user", "u1"), ("admin", "a1"), ("viewer", "v1")
    ):  # fmt: skip
        path = auth_store.ensure(role, name)  # type: ignore[arg-type]
        assert path.stat().st_mode & 0o077 == 0
        lines = path.read_text().splitlines()
        claims = decode_jwt_claims(lines[1])
        perms = permissions(role, name)  # type: ignore[arg-type]
        assert claims["nats"]["pub"]["allow"] == list(perms.publish)
        assert claims["nats"]["sub"]["allow"] == list(perms.subscribe)
        assert ("resp" in claims["nats"]) == perms.allow_responses
        assert identity_of(path) == (role, "placement" if role == "placement" else name)
    assert set(ROLES) == {"placement", "node", "user", "admin", "viewer"}


def test_names_that_would_break_subjects_or_identities_are_refused(auth_store: AuthStore) -> None:
    for bad in ("", "a.b", "*", ">", "a b", "-lead", "x" * 65, "anonymous"):
        with pytest.raises(ValueError, match="name"):
            auth_store.mint("user", bad)
    for bad in ("", "a.b", "*", "anonymous"):
        with pytest.raises(ValueError, match="name"):
            auth_store.mint("viewer", bad)
    auth_store.mint("admin", "ops")
    with pytest.raises(AuthError, match="already an admin"):
        auth_store.mint("user", "ops")
    # A viewer is known to the API by name too: it never shares one with a user or an admin.
    with pytest.raises(AuthError, match="already an admin"):
        auth_store.mint("viewer", "ops")
    auth_store.mint("viewer", "board")
    with pytest.raises(AuthError, match="already a viewer"):
        auth_store.mint("user", "board")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_test_pki(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server certificate for 127.0.0.1, as docs/security.md shows."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca = folder / "ca.key", folder / "ca.pem"
    key, csr, cert = folder / "server.key", folder / "server.csr", folder / "server.pem"
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    new_key = ["-newkey", "rsa:2048", "-nodes"]
    _openssl("req", "-x509", *new_key, "-days", "2", "-subj", "/CN=gpulayer test CA",
             "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    _openssl("req", *new_key, "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return ca, cert, key


@_refused_socket
async def test_tls_with_a_self_signed_ca(tmp_path: Path, auth_store: AuthStore) -> None:
    ca, cert, key = make_test_pki(tmp_path / "pki")
    tls = NatsTls(cert=cert, key=key)
    with EmbeddedNats(tmp_path / "nats", auth_conf=auth_store.server_conf, tls=tls) as server:
        assert server.url.startswith("tls://")
        creds = str(auth_store.ensure("user", "alice"))
        nc = await connect(server.url, "tls-ok", creds=creds, tls_ca=str(ca))
        try:
            assert nc.is_connected
        finally:
            await nc.close()
        # Without the CA, the server's certificate is not trusted.
        with pytest.raises((nats.errors.Error, OSError)):
            await connect(
                server.url, "tls-no-ca", creds=creds, allow_reconnect=False,
                max_reconnect_attempts=0, connect_timeout=2,
            )  # fmt: skip
        gc.collect()


async def test_a_list_of_servers_is_accepted(secure_nats: SecureNats) -> None:
    dead = "nats://127.0.0.1:1"
    nc = await connect(
        f"{dead}, {secure_nats.url}", "list", creds=secure_nats.creds("admin", "root")
    )
    try:
        assert nc.connected_url is not None
        assert nc.connected_url.port == secure_nats.server.port
    finally:
        await nc.close()


async def test_the_auth_command_mints_credentials_a_running_server_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpulayer auth init` once, then nodes and users added while the server runs: no config
    change, no restart."""
    from gpulayer_cli.main import main

    folder = tmp_path / "auth"
    assert main(["auth", "--dir", str(folder), "init"]) == 0
    store = AuthStore(folder)
    with EmbeddedNats(tmp_path / "nats", auth_conf=store.server_conf) as server:
        assert main(["auth", "--dir", str(folder), "add-node", "gpu-7"]) == 0
        node_creds = capsys.readouterr().out.strip().splitlines()[-1]
        assert main(["auth", "--dir", str(folder), "add-user", "carol"]) == 0
        assert main(["auth", "--dir", str(folder), "add-viewer", "board"]) == 0
        viewer_creds = capsys.readouterr().out.strip().splitlines()[-1]
        assert identity_of(viewer_creds) == ("viewer", "board")
        assert main(["auth", "--dir", str(folder), "add-user", "bad.name"]) == 2
        assert "bad.name" in capsys.readouterr().err
        nc = await connect(server.url, "minted", creds=node_creds)
        try:
            assert identity_of(node_creds) == ("node", "gpu-7")
            await nc.publish("gpulayer.node.gpu-7.heartbeat", b"{}")
            await nc.flush()
            assert nc.is_connected
        finally:
            await nc.close()
    assert main(["auth", "--dir", str(tmp_path / "none"), "add-user", "dave"]) == 2


async def test_placement_hears_the_max_deliveries_advisory(secure_nats: SecureNats) -> None:
    """Placement dead-letters a message left at a consumer's max_deliver when the server's
    advisory arrives (dead_letters.py): its credential must let it subscribe to that."""
    async with (
        client(secure_nats, "placement", "") as placement,
        client(secure_nats, "admin", "root") as admin,
    ):
        heard: asyncio.Queue[str] = asyncio.Queue()

        async def on_advisory(msg: Msg) -> None:
            await heard.put(msg.subject)

        await placement.nc.subscribe(
            MAX_DELIVERIES_ADVISORY, queue="placement-advisories", cb=on_advisory
        )
        await subscribed(placement.nc)
        subject = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.JOBS.placement-jobs"

        async def advise_until_heard() -> str:
            # Again every second until heard, though one should do now: a first publish was
            # delivered to nobody in about 1 run of 8 while this waited on one flush, which
            # nats-py lets return before the server has the subscription
            # (tests/helpers.py, subscribed).
            while True:
                await admin.nc.publish(subject, b"{}")
                await admin.nc.flush()
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(heard.get(), 1.0)

        try:
            assert await asyncio.wait_for(advise_until_heard(), 30) == subject
        except TimeoutError:
            said = {
                who: [w.errors.get_nowait() for _ in range(w.errors.qsize())]
                for who, w in (("placement", placement), ("admin", admin))
            }
            raise AssertionError(f"no advisory heard; errors: {said}") from None
        assert placement.errors.empty()
        assert admin.errors.empty()

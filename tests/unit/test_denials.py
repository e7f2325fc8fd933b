"""``gpulayer_cli.denials``: a permission violation the server reports ends the operation
waiting on it at once, naming who lacks what; nothing else does."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from gpulayer_cli.denials import Denials, PermissionDenied, describe, parse_violation


def test_parse_violation_reads_the_servers_words_as_nats_py_passes_them() -> None:
    # nats-py lower-cases the server's -ERR text before the error callback sees it.
    assert parse_violation(
        'nats: permissions violation for publish to "gpulayer.node.vm.doctor"'
    ) == (
        "publish",
        "gpulayer.node.vm.doctor",
    )
    assert parse_violation(
        'nats: Permissions Violation for Subscription to "gpulayer.job.bob.>" using queue "q"'
    ) == ("subscribe", "gpulayer.job.bob.>")
    assert parse_violation(
        'nats: permissions violation for publish with reply of "_inbox.user-alice.x"'
    ) == ("publish", "_inbox.user-alice.x")
    assert parse_violation("nats: stale connection") is None
    assert parse_violation("nats: permissions violation for publish to ") is None


def test_the_message_names_identity_action_subject_and_purpose() -> None:
    text = str(PermissionDenied("publish", "gpulayer.node.vm.doctor", "user dev"))
    assert text == (
        "permission denied: user dev may not publish to gpulayer.node.vm.doctor "
        "(asking a node's probe to detect again)"
    )
    assert str(PermissionDenied("subscribe", "x.y", "node n")).endswith("may not subscribe on x.y")
    assert describe(("user", "alice")) == "user alice"
    assert describe(None).startswith("this connection")


async def _violation(denials: Denials, subject: str) -> None:
    await asyncio.sleep(0)
    await denials.on_error(
        nats.errors.Error(f'nats: permissions violation for publish to "{subject}"')
    )


async def test_a_violation_ends_the_guarded_wait_at_once_with_the_subject_as_spelt() -> None:
    denials = Denials("user bob")
    never = asyncio.get_running_loop().create_future()
    subject = "$JS.API.CONSUMER.CREATE.JOB_EVENTS.ab.gpulayer.job.alice.J1.events"
    violation = asyncio.create_task(_violation(denials, subject.lower()))
    with pytest.raises(PermissionDenied) as err:
        await asyncio.wait_for(denials.guard(never, subject), 5)
    await violation
    assert err.value.subject == subject  # not the lower-cased text nats-py passed on
    assert err.value.who == "user bob"
    assert never.cancelled()  # the operation it ended is not left waiting
    assert denials.seen == [err.value]


async def test_the_innermost_guard_gets_the_violation_and_the_outer_goes_on() -> None:
    denials = Denials()

    async def inner() -> str:
        never = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(
            lambda: asyncio.ensure_future(_violation(denials, "a.b"))
        )
        try:
            await denials.guard(never)
        except PermissionDenied:
            return "degraded"
        return "not reached"

    assert await asyncio.wait_for(denials.guard(inner()), 5) == "degraded"


async def test_a_jetstream_subject_no_guard_named_gets_its_api_tokens_back() -> None:
    denials = Denials("user bob")
    await _violation(denials, "$js.api.stream.info.dlq")
    assert denials.seen[-1].subject == "$JS.API.STREAM.INFO.DLQ"
    await _violation(denials, "gpulayer.node.vm.doctor")
    assert denials.seen[-1].subject == "gpulayer.node.vm.doctor"


async def test_other_errors_and_results_pass_through() -> None:
    denials = Denials()
    await denials.on_error(nats.errors.Error("nats: slow consumer"))
    assert denials.seen == []

    async def value() -> int:
        return 7

    async def fails() -> None:
        raise nats.errors.TimeoutError

    assert await denials.guard(value()) == 7
    with pytest.raises(nats.errors.TimeoutError):
        await denials.guard(fails())


async def test_a_guard_stopped_from_outside_ends_what_it_guards_first() -> None:
    denials = Denials()
    ended = asyncio.Event()

    async def follows() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            # Its own clean-up takes turns of the loop (unsubscribing, say).
            for _ in range(3):
                await asyncio.sleep(0)
            ended.set()

    outer = asyncio.create_task(denials.guard(follows()))
    await asyncio.sleep(0)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert ended.is_set()  # before the caller goes on (to close the connection)

"""Permission violations the NATS server reports to the CLI, turned into one clear failure.

nats-server answers a publish or a subscription the credential does not allow with
``-ERR 'Permissions Violation for Publish to "<subject>"'`` and drops the message: nats-py then
only calls the connection's error callback (``nats: permissions violation for publish to
"<subject>"``, lower-cased) and the request that waited for an answer times out. A
``Denials`` is that error callback: it wakes the operation that is waiting (``guard``) at once
with ``PermissionDenied``, which names the identity, the direction and the subject, instead of
a bare ``nats: timeout`` seconds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import weakref
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

# nats-server: "Permissions Violation for Publish to %q" / "for Subscription to %q" (an optional
# " using queue %q" follows a queue subscription's) / "for Publish with Reply of %q" (a reply
# subject the credential may not receive on).
_VIOLATION = re.compile(
    r'permissions violation for (publish|subscription) (?:to|with reply of) "([^"]*)"', re.I
)

# What a denied subject is for, in the words of docs/security.md's role table.
_WHAT = (
    (re.compile(r"^gpulayer\.node\.[^.]+\.doctor$"), "asking a node's probe to detect again"),
    (
        re.compile(r"^\$JS\.API\.CONSUMER\.CREATE\.JOB_EVENTS\.", re.I),
        "reading a job's events: its owner and admins may",
    ),
    (
        re.compile(r"^\$JS\.API\.CONSUMER\.CREATE\.LOGS\.", re.I),
        "reading a job's logs: its owner and admins may",
    ),
    (re.compile(r"^\$JS\.API\.STREAM\.INFO\.DLQ$", re.I), "reading the dead letters: admins may"),
    (re.compile(r"^\$JS\.API\.STREAM\.INFO\.AUDIT$", re.I), "reading the audit trail: admins may"),
    (re.compile(r"^gpulayer\.api\.[^.]+$"), "asking placement's API without a user's name"),
    (re.compile(r"^gpulayer\.jobs\.submit"), "submitting jobs"),
)


class PermissionDenied(Exception):
    """The server refused this connection's ``action`` (``publish`` or ``subscribe``) on
    ``subject``; ``who`` is the credential's identity (``user alice``)."""

    def __init__(self, action: str, subject: str, who: str = "this credential") -> None:
        super().__init__(action, subject, who)
        self.action, self.subject, self.who = action, subject, who

    def __str__(self) -> str:
        what = next((w for pattern, w in _WHAT if pattern.search(self.subject)), None)
        return (
            f"permission denied: {self.who} may not {self.action} "
            f"{'to' if self.action == 'publish' else 'on'} {self.subject}"
            + (f" ({what})" if what else "")
        )


def parse_violation(text: str) -> tuple[str, str] | None:
    """(``publish`` | ``subscribe``, subject as reported) of a permissions-violation error
    text, None for any other error."""
    m = _VIOLATION.search(text)
    if m is None:
        return None
    return ("publish" if m.group(1).lower() == "publish" else "subscribe"), m.group(2)


def describe(identity: tuple[str, str] | None) -> str:
    """``user alice`` for a credential's (role, name); ``this connection`` without one."""
    if identity is None:
        return "this connection (no credential)"
    role, name = identity
    return f"{role} {name}" if name else role


def _spelt(subject: str) -> str:
    """A lower-cased JetStream API subject as the server has it: its API tokens and stream name
    (gpulayer's are upper-case) up again; the filter after them stays as reported."""
    tokens = subject.split(".")
    if subject.lower().startswith("$js.api.") and len(tokens) >= 5:
        return ".".join([t.upper() for t in tokens[:5]] + tokens[5:])
    return subject


class Denials:
    """The error callback of one CLI connection; the violations it reported, handed to the
    innermost ``guard`` waiting when they arrive."""

    def __init__(self, who: str = "this credential") -> None:
        self.who = who
        self.seen: list[PermissionDenied] = []
        # Innermost last: a violation ends the operation started most recently, which is the
        # one whose message the server just refused (the CLI awaits one thing at a time).
        self._waiting: list[tuple[asyncio.Future[PermissionDenied], tuple[str, ...]]] = []

    async def on_error(self, err: Exception) -> None:
        found = parse_violation(str(err))
        if found is None:
            return  # other errors end the connection: the operation waiting on it fails itself
        action, subject = found
        if self._waiting:
            waiter, known = self._waiting[-1]
            # nats-py lower-cases the server's message: the subject as the caller spelt it.
            subject = next((s for s in known if s.lower() == subject.lower()), _spelt(subject))
            denied = PermissionDenied(action, subject, self.who)
            if not waiter.done():
                waiter.set_result(denied)
        else:
            denied = PermissionDenied(action, _spelt(subject), self.who)
        self.seen.append(denied)

    async def guard(self, aw: Awaitable[T], *subjects: str) -> T:
        """``aw``'s result, or ``PermissionDenied`` as soon as the server refuses something
        while it runs (``aw`` is then cancelled). ``subjects``: what ``aw`` uses, to name a
        refused one as spelt."""
        task: asyncio.Future[T] = asyncio.ensure_future(aw)
        waiter: asyncio.Future[PermissionDenied] = asyncio.get_running_loop().create_future()
        entry = (waiter, subjects)
        self._waiting.append(entry)
        try:
            pending: set[asyncio.Future[Any]] = {task, waiter}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Stopped from outside (Ctrl-C): ``aw`` ends first, so that nothing it does runs
            # on after its caller closed the connection.
            await _cancelled(task)
            raise
        finally:
            self._waiting.remove(entry)
        succeeded = task.done() and not task.cancelled() and task.exception() is None
        if waiter.done() and not succeeded:
            await _cancelled(task)
            raise waiter.result()
        waiter.cancel()
        return task.result()


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, whatever it ends with."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


_WATCHED: weakref.WeakKeyDictionary[Any, Denials] = weakref.WeakKeyDictionary()


def watch(nc: Any, denials: Denials) -> None:
    """Route the violations of ``nc`` (connected with ``error_cb=denials.on_error``) to the
    ``guard`` calls made on it."""
    _WATCHED[nc] = denials


def of(nc: Any) -> Denials | None:
    return _WATCHED.get(nc)


async def guard(nc: Any, aw: Awaitable[T], *subjects: str) -> T:
    """``aw`` under ``nc``'s ``Denials`` (``Denials.guard``); as is on a connection no one
    watches (a service's, a test's)."""
    denials = _WATCHED.get(nc)
    if denials is None:
        return await aw
    return await denials.guard(aw, *subjects)

"""The web service's NATS side, read-only: placement's API asked as the viewer's own name, a
job's stored events, and two feeds that need no request: every job's new events (to refresh
early) and the nodes' device observations (the node charts)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import DeliverPolicy

from gpulayer_cli.client import history, read_subject
from gpulayer_contracts import encode
from gpulayer_contracts.health import NodeObservations
from gpulayer_contracts.subjects import (
    ANONYMOUS,
    JOB_WILDCARD_EVENTS,
    NODE_WILDCARD_OBSERVATIONS,
    api_subject,
    node_observations,
)
from gpulayer_web.cache import FleetCache

log = logging.getLogger(__name__)

_observations = msgspec.json.Decoder(NodeObservations)


def take_observation(cache: FleetCache, subject: str, data: bytes) -> bool:
    """Keep one node's observations; a report that doesn't decode, or names another node than
    the subject it came on, is logged and skipped (one bad report never stops the feed)."""
    try:
        obs = _observations.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        log.warning("observation on %s not read: %s", subject, err)
        return False
    try:
        expected = node_observations(obs.node_id)
    except ValueError:  # a node id no subject could carry
        expected = None
    if subject != expected:
        log.warning("observation on %s names node %r: skipped", subject, obs.node_id[:64])
        return False
    cache.observe(obs)
    return True


class ApiError(RuntimeError):
    """Placement refused the request, or nobody answered it."""


class NatsReader:
    def __init__(self, nc: Client, caller: str = ANONYMOUS, timeout: float = 5.0) -> None:
        self.nc = nc
        self.caller = caller
        self.timeout = timeout
        self._subs: list[Any] = []

    async def ask(self, verb: str, body: dict[str, Any]) -> Any:
        subject = api_subject(verb, self.caller)
        try:
            reply = await self.nc.request(subject, encode(body), timeout=self.timeout)
        except (NoRespondersError, NatsTimeoutError) as err:
            raise ApiError(f"no placement answered on {subject} ({type(err).__name__})") from err
        answer = msgspec.json.decode(reply.data)
        if not isinstance(answer, dict) or not answer.get("ok"):
            error = answer.get("error") if isinstance(answer, dict) else None
            raise ApiError(str(error or "unknown error"))
        return answer.get("data")

    async def events(self, job_id: str, owner: str) -> list[dict[str, Any]]:
        got = await history(self.nc, job_id, timeout=self.timeout, owner=owner)
        return [{"type": type(e).__struct_config__.tag, **msgspec.to_builtins(e)} for e in got]

    async def feed(self, cache: FleetCache) -> None:
        """Wake the cache on every new job event; keep every observation. One consumer and one
        subscription for the whole service, whatever the number of viewers."""

        async def on_event(msg: Any) -> None:
            cache.wake()

        async def on_observation(msg: Any) -> None:
            take_observation(cache, msg.subject, msg.data)

        sub, _ = await read_subject(
            self.nc, "JOB_EVENTS", JOB_WILDCARD_EVENTS, on_event, DeliverPolicy.NEW
        )
        self._subs = [sub, await self.nc.subscribe(NODE_WILDCARD_OBSERVATIONS, cb=on_observation)]

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

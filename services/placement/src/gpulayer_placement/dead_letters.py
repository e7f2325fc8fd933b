"""Dead letters: a message of JOBS or STATUS that can't be handled goes to the DLQ stream on
``gpulayer.dlq.<stream>``, with its body, its headers and headers naming why, then is acked.

Only bad messages come here, so the hot path pays nothing. The JetStream advisory sent when a
message reaches a consumer's delivery limit is counted too: a message on its last delivery is
dead-lettered or held until handled, so an advisory means one was left undelivered in its
stream (placement stopped while handling it).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from gpulayer_contracts.bounds import clip_text
from gpulayer_contracts.subjects import (
    DLQ_CLASS_HEADER,
    DLQ_DELIVERIES_HEADER,
    DLQ_JOB_ID_HEADER,
    DLQ_MSG_ID_HEADER,
    DLQ_REASON_HEADER,
    DLQ_SEQUENCE_HEADER,
    DLQ_SIZE_HEADER,
    DLQ_STREAM_HEADER,
    DLQ_SUBJECT_HEADER,
    DLQ_TRUNCATED_HEADER,
    MAX_DELIVERIES_ADVISORY,
    MSG_ID_HEADER,
    dlq_subject,
)
from gpulayer_runtime.telemetry import DISABLED, Telemetry

# The name every placement part logs under since before the split: log queries filter on it.
log = logging.getLogger("gpulayer_placement.service")

# Deliveries of a JOBS or STATUS message before it is dead-lettered (the consumers' max_deliver).
MAX_DELIVER = 5
# Room kept for the headers of a dead letter: the original's (at most ORIGINAL_HEADERS_BYTES
# are copied) and ours (a reason of at most MAX_REASON_CHARS, a few numbers and names).
DLQ_HEADER_RESERVE = 8 * 1024
ORIGINAL_HEADERS_BYTES = 4 * 1024
MAX_REASON_CHARS = 1000


def delivery(msg: Msg) -> tuple[str, int, int]:
    """(stream, stream sequence, times delivered) of a JetStream message; a message without
    JetStream metadata (a unit test's) is ``("unknown", 0, 1)``."""
    try:
        meta = msg.metadata
    except Exception:
        return "unknown", 0, 1
    return meta.stream, meta.sequence.stream, meta.num_delivered or 1


def last_delivery(msg: Msg) -> bool:
    """Whether JetStream will not deliver ``msg`` again if it is not acked now."""
    return delivery(msg)[2] >= MAX_DELIVER


def header_text(text: str, most: int = MAX_REASON_CHARS) -> str:
    """``text`` fit for a NATS header value: one printable line, clipped."""
    flat = "".join(c if c.isprintable() else " " for c in text)
    return clip_text(flat, most)


class DeadLetters:
    """Sends messages to the DLQ stream and acks them; counts dead letters and advisories."""

    def __init__(
        self, js: JetStreamContext, telemetry: Telemetry = DISABLED, max_payload: int = 1 << 20
    ) -> None:
        self.js = js
        self.tel = telemetry
        self.max_payload = max_payload
        self.sent = 0  # dead letters stored by this replica
        self.max_deliveries = 0  # max-deliveries advisories seen by this replica

    async def send(self, msg: Msg, reason: str, why: str, job_id: str | None = None) -> bool:
        """Store ``msg`` in the DLQ with ``reason`` (``why``: the reason's class, a metric
        label), then ack it. False when the DLQ publish failed: the message is then nak'ed, so
        it comes back rather than being lost."""
        stream, seq, delivered = delivery(msg)
        headers, body = self._entry(msg, stream, seq, delivered, reason, why, job_id)
        log.warning("dead-lettering message %s of %s (%s): %s", seq, stream, msg.subject, reason)
        try:
            await self.js.publish(dlq_subject(stream), body, headers=headers)
        except Exception as err:
            log.error("dead-lettering message %s of %s failed: %r", seq, stream, err)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return False
        self.sent += 1
        self.tel.count("gpulayer.messages.dead_lettered", 1, {"stream": stream, "reason": why})
        with contextlib.suppress(Exception):
            await msg.ack()
        return True

    def _entry(
        self,
        msg: Msg,
        stream: str,
        seq: int,
        delivered: int,
        reason: str,
        why: str,
        job_id: str | None,
    ) -> tuple[dict[str, str], bytes]:
        headers: dict[str, str] = {}
        size = 0
        for name, value in (msg.headers or {}).items():
            size += len(name) + len(value) + 4
            if size > ORIGINAL_HEADERS_BYTES:
                break  # the rest are dropped: a dead letter must fit the server's max_payload
            headers[DLQ_MSG_ID_HEADER if name == MSG_ID_HEADER else name] = value
        headers.update(
            {
                MSG_ID_HEADER: f"{stream}:{seq}" if seq else f"{stream}:{id(msg)}",
                DLQ_REASON_HEADER: header_text(reason),
                DLQ_CLASS_HEADER: header_text(why, 64),
                DLQ_STREAM_HEADER: header_text(stream, 64),
                DLQ_SUBJECT_HEADER: header_text(msg.subject, 256),
                DLQ_SEQUENCE_HEADER: str(seq),
                DLQ_DELIVERIES_HEADER: str(delivered),
                DLQ_SIZE_HEADER: str(len(msg.data)),
            }
        )
        if job_id:
            headers[DLQ_JOB_ID_HEADER] = job_id
        body = bytes(msg.data)
        room = self.max_payload - DLQ_HEADER_RESERVE
        if len(body) > room:
            # The original came in under max_payload with its own headers; ours are more.
            headers[DLQ_TRUNCATED_HEADER] = str(len(body))
            body = body[:room]
        return headers, body

    async def watch_advisories(self, nc: Client) -> Any:
        """Count JetStream's max-deliveries advisories (one replica of a queue group each)."""

        async def on_advisory(msg: Msg) -> None:
            self.max_deliveries += 1
            parts = msg.subject.split(".")
            stream, consumer = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
            log.warning("a message of %s reached the delivery limit of %s", stream, consumer)
            self.tel.count(
                "gpulayer.consumer.max_deliveries", 1, {"stream": stream, "consumer": consumer}
            )

        return await nc.subscribe(
            MAX_DELIVERIES_ADVISORY, queue="placement-advisories", cb=on_advisory
        )

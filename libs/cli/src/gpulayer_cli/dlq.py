"""``gpulayer dlq``: the newest dead letters (messages placement could not handle), read from
the DLQ stream: when, from which stream and subject, why, the job id when one was readable, and
the original size."""

from __future__ import annotations

from typing import Any

import nats.js.errors
from nats.js import JetStreamContext
from rich.table import Table

from gpulayer_contracts.subjects import (
    DLQ_CLASS_HEADER,
    DLQ_DELIVERIES_HEADER,
    DLQ_JOB_ID_HEADER,
    DLQ_REASON_HEADER,
    DLQ_SIZE_HEADER,
    DLQ_STREAM_HEADER,
    DLQ_SUBJECT_HEADER,
)

DLQ_STREAM = "DLQ"


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


async def dead_letters(js: JetStreamContext, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` entries of the DLQ stream, oldest first (none when the stream
    doesn't exist yet)."""
    try:
        state = (await js.stream_info(DLQ_STREAM)).state
    except nats.js.errors.NotFoundError:
        return []
    if not state.messages or limit <= 0:
        return []
    out = []
    for seq in range(max(state.first_seq, state.last_seq - limit + 1), state.last_seq + 1):
        try:
            msg = await js.get_msg(DLQ_STREAM, seq)
        except nats.js.errors.NotFoundError:
            continue  # aged out or deleted meanwhile
        h = msg.headers or {}
        out.append(
            {
                "seq": seq,
                "time": msg.time.isoformat() if msg.time else None,
                "stream": h.get(DLQ_STREAM_HEADER),
                "subject": h.get(DLQ_SUBJECT_HEADER),
                "reason": h.get(DLQ_REASON_HEADER),
                "class": h.get(DLQ_CLASS_HEADER),
                "job_id": h.get(DLQ_JOB_ID_HEADER),
                "size": _int(h.get(DLQ_SIZE_HEADER), len(msg.data or b"")),
                "deliveries": _int(h.get(DLQ_DELIVERIES_HEADER), 0),
            }
        )
    return out


def dlq_table(entries: list[dict[str, Any]]) -> Table:
    table = Table(title=f"dead letters ({len(entries)})")
    for column in ("time", "stream", "subject", "job", "size", "reason"):
        table.add_column(column)
    for e in entries:
        table.add_row(
            str(e["time"] or "")[:19],
            e["stream"] or "",
            e["subject"] or "",
            e["job_id"] or "-",
            str(e["size"]),
            e["reason"] or "",
        )
    return table

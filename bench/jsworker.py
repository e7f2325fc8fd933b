"""The consuming half of the raw JetStream limit, as its own process like placement is.

``python -m bench.jsworker URL STREAM SUBJECT COUNT TIMEOUT``: makes a durable pull consumer,
prints ``ready``, then fetches batches of 256 and acks each message, as placement's ingest does,
with no other work. Prints one JSON line: when the first message arrived and when the last ack
was flushed (wall clock, comparable across processes), and how many were acked.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import FetchTimeoutError

from gpulayer_runtime.nats import connect


async def consume(
    url: str, stream: str, subject: str, count: int, timeout: float
) -> dict[str, float]:
    nc = await connect(url, "bench-jsworker")
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            subject,
            durable="bench-raw",
            stream=stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=20_000
            ),
        )
        print("ready", flush=True)
        deadline = time.monotonic() + timeout
        acked = 0
        first = 0.0
        while acked < count and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(256, timeout=1.0)
            except (FetchTimeoutError, TimeoutError):
                continue
            if not first:
                first = time.time()
            await asyncio.gather(*(m.ack() for m in msgs))
            acked += len(msgs)
        await nc.flush()
        return {"first": first, "last": time.time(), "acked": acked}
    finally:
        await nc.close()


def main(argv: list[str]) -> int:
    url, stream, subject, count, timeout = argv
    result = asyncio.run(consume(url, stream, subject, int(count), float(timeout)))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

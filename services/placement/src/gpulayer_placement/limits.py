"""Rate limits placement applies per identity: submits per owner, API requests per caller.

The identity is the subject's token (``gpulayer.jobs.submit.<owner>``,
``gpulayer.api.<verb>.<caller>``), which only that identity's credential may publish on: a
forged ``owner`` in a payload spends nobody's tokens but the sender's. Admins and the anonymous
caller (auth off, or an admin on the bare subject) are not limited: they run the fleet.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gpulayer_contracts.subjects import ANONYMOUS
from gpulayer_runtime.ratelimit import Buckets

# An owner or caller token in a message is bounded by the subject (64 characters with auth on);
# without auth a subject token may be long: the message names its start.
_NAME_CHARS = 64


class RateLimit:
    """``check(identity)``: None when admitted, else the reason (naming the limit)."""

    def __init__(
        self,
        what: str,
        rate: float,
        burst: int,
        *,
        exempt: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what  # "submits", "API requests"
        self.buckets = Buckets(rate, burst, clock=clock)
        self.exempt = exempt | {ANONYMOUS}

    def check(self, identity: str, at: float | None = None) -> str | None:
        """``at``: when the request was sent, on the limit's clock (default: now)."""
        if identity in self.exempt:
            return None
        wait = self.buckets.take(identity, at=at)
        if not wait:
            return None
        b = self.buckets
        return (
            f"rate limit: {identity[:_NAME_CHARS]} over {b.rate:g} {self.what}/s "
            f"(burst {b.burst:g}); retry in {max(wait, 0.1):.1f} s"
        )


def submit_limit(rate: float, burst: int, admins: frozenset[str]) -> RateLimit:
    """Submits per owner (``GPULAYER_SUBMIT_RATE`` / ``GPULAYER_SUBMIT_BURST``). An array is
    one submit: its size is bounded by MAX_ARRAY_BYTES and what it may hold by quotas.

    On the wall clock: each submit is counted at the time JetStream stored it (its ``at``), so
    the limit judges the rate the owner sent at, not the rate placement reads at. Read from a
    backlog, a flood sent at once was admitted at placement's own pace, under any limit above
    it (c1m, issue 49); and an owner's submits sent within the limit while placement was down
    are not refused for arriving together when it is back."""
    return RateLimit("submits", rate, burst, exempt=admins, clock=time.time)


def api_limit(rate: float, burst: int, admins: frozenset[str]) -> RateLimit:
    """API requests per caller (``GPULAYER_API_RATE`` / ``GPULAYER_API_BURST``)."""
    return RateLimit("API requests", rate, burst, exempt=admins)

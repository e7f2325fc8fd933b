"""Token buckets, one per key (an owner, a caller, a requester), in bounded memory.

Pure: the clock is injected (``time.monotonic`` by default), so tests step it by hand. A bucket
holds up to ``burst`` tokens and gains ``rate`` a second; a request takes one or is refused with
the seconds until one is there. A bucket idle long enough to be full again is the same as no
bucket, so it is dropped; past ``max_keys`` the least recently used is dropped even so (its key
then starts from a full bucket: thousands of distinct keys can't grow the map without bound).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

# Far above any one service's callers in a fleet; the map stays a few MB at most.
DEFAULT_MAX_KEYS = 10_000


class Buckets:
    """Token buckets per key: ``take(key)`` is 0.0 when allowed, else the seconds to wait."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate {rate!r}: expected a positive number")
        if not (math.isfinite(burst) and burst >= 1):
            raise ValueError(f"burst {burst!r}: expected a number of at least 1")
        if max_keys < 1:
            raise ValueError(f"max_keys {max_keys!r}: expected at least 1")
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._clock = clock
        self._refill_s = burst / rate  # an idle bucket is full again after this long
        # key -> (tokens, when counted); least recently used first.
        self._levels: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._levels)

    def take(self, key: str, n: float = 1.0, at: float | None = None) -> float:
        """Take ``n`` tokens from ``key``'s bucket: 0.0 when they were there, else the seconds
        until they will be (nothing is taken then). ``at``: when the request was made, on the
        clock's scale (default: now); one dated before the bucket's last is counted then."""
        now = self._clock() if at is None else at
        self._drop_idle(now)
        held, last = self._levels.pop(key, (self.burst, now))
        now = max(now, last)
        tokens = min(self.burst, held + (now - last) * self.rate)
        if tokens >= n:
            tokens -= n
            wait = 0.0
        else:
            wait = (n - tokens) / self.rate
        self._levels[key] = (tokens, now)  # most recently used last
        if len(self._levels) > self.max_keys:
            self._levels.popitem(last=False)
        return wait

    def _drop_idle(self, now: float) -> None:
        # The least recently used come first: stop at the first one not yet full again.
        while self._levels:
            key, (_, at) = next(iter(self._levels.items()))
            if now - at < self._refill_s:
                return
            del self._levels[key]

"""Token buckets: a burst, then a steady rate, per key (a device, a client address).

In memory and per server process: with several processes behind one address, a caller gets
each process's allowance (the operator divides the settings accordingly). Memory is bounded:
buckets that have refilled are forgotten first, since forgetting them changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable


class TokenBuckets:
    def __init__(self, rate_per_second: float, burst: int, max_keys: int = 100_000) -> None:
        if rate_per_second <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("a token bucket needs rate_per_second > 0, burst >= 1 and max_keys >= 1")
        self.rate, self.burst, self.max_keys = rate_per_second, float(burst), max_keys
        self._buckets: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, at)

    def wait(self, key: Hashable, now: float) -> float:
        """The seconds until `key` has a token (0.0: it has one now); takes none."""
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def take(self, key: Hashable, now: float) -> float:
        """Take one token for `key`: 0.0 when granted, else the seconds until one is available."""
        tokens, at = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate
        if key not in self._buckets and len(self._buckets) >= self.max_keys:
            self._forget(now)
        self._buckets[key] = (tokens - 1.0, now)
        return 0.0

    def _forget(self, now: float) -> None:
        full = [
            k for k, (tokens, at) in self._buckets.items() if tokens + (now - at) * self.rate >= self.burst
        ]
        for key in full:
            del self._buckets[key]
        # Still full of busy callers: drop the oldest half (they get a fresh burst, no more).
        if len(self._buckets) >= self.max_keys:
            for key in list(self._buckets)[: len(self._buckets) // 2]:
                del self._buckets[key]


class WithOverallLimit(TokenBuckets):
    """Per key, and over all keys together: a caller who can name a fresh key for every attempt
    (another address, a proxy's header) still meets the overall bucket. A token is taken from
    both or from neither."""

    OVERALL = ("every key",)

    def __init__(self, per_key: TokenBuckets, overall: TokenBuckets) -> None:
        super().__init__(per_key.rate, int(per_key.burst), per_key.max_keys)
        self._overall = overall

    def wait(self, key: Hashable, now: float) -> float:
        return max(super().wait(key, now), self._overall.wait(self.OVERALL, now))

    def take(self, key: Hashable, now: float) -> float:
        waiting = self.wait(key, now)
        if waiting > 0:
            return waiting
        super().take(key, now)
        self._overall.take(self.OVERALL, now)
        return 0.0

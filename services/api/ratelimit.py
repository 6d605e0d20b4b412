"""Rate limits on mutating routes: one token bucket per caller.

A caller is its token's name (``anonymous`` without a valid one) with its client address. Each
bucket holds at most ``burst`` tokens and refills at ``rate_per_s``; every mutating request that
presents a token (valid or not) takes one before its role is checked; one without a token is a
401 first. An empty bucket is a 429 with ``Retry-After``,
counted in ``pulse_api_rate_limited_total{route}``. Reads are never limited. Buckets live in
memory, per replica, capped at ``max_keys``.

:func:`take` is the pure decision; :class:`RateLimiter` keeps the buckets, with an injected
clock. Why name and address, and why not in Redis: docs/design/ratelimit.md.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.metrics_text import escape

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Bucket:
    tokens: float  # tokens left at ``at``
    at: float  # clock seconds of the last update


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    retry_after_s: float = 0.0  # when refused: seconds until a token is back

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` in whole seconds (RFC 9110 allows no fraction), never below 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


def take(bucket: Bucket | None, *, now: float, rate_per_s: float, burst: int) -> tuple[Bucket, RateDecision]:
    """Take one token from ``bucket`` (None: a new caller, full) at ``now``. ``rate_per_s`` and
    ``burst`` must be positive. A clock that steps back refills nothing."""
    if bucket is None:
        tokens = float(burst)
    else:
        tokens = min(float(burst), bucket.tokens + max(0.0, now - bucket.at) * rate_per_s)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, now), RateDecision(True)
    return Bucket(tokens, now), RateDecision(False, (1.0 - tokens) / rate_per_s)


class RateLimiter:
    """The buckets of one orchestrator process. Owned by the event loop (no locks, no I/O)."""

    def __init__(
        self,
        *,
        rate_per_s: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        routes: Iterable[str] = (),
        max_keys: int = 100_000,
    ) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self.buckets: dict[tuple[str, str], Bucket] = {}
        self.limited: Counter[str] = Counter({r: 0 for r in routes})  # every route present from the start
        self._pruned_at = clock()

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0 and self.burst > 0

    def check(self, caller: str, address: str, *, route: str) -> RateDecision:
        """One mutating request of ``caller`` from ``address`` to ``route``."""
        if not self.enabled:
            return RateDecision(True)
        now = self.clock()
        self._prune(now)
        key = (caller, address)
        bucket, decision = take(self.buckets.pop(key, None), now=now, rate_per_s=self.rate_per_s, burst=self.burst)
        self.buckets[key] = bucket  # re-inserted: dict order is least recently used first
        if len(self.buckets) > self.max_keys:
            del self.buckets[next(iter(self.buckets))]
        if not decision.allowed:
            self.limited[route] += 1
        return decision

    def message(self, caller: str, address: str, decision: RateDecision) -> str:
        return (
            f"rate limit: caller {caller!r} from {address} may make {self.burst} mutating calls at once "
            f"and {self.rate_per_s:g} per second after that (PULSE_RATE_LIMIT_PER_S, PULSE_RATE_LIMIT_BURST); "
            f"retry in {decision.retry_after_s:.2f}s"
        )

    def _prune(self, now: float) -> None:
        """Drop buckets that have refilled (the same as absent), at most once per refill time."""
        refill_s = self.burst / self.rate_per_s
        if now - self._pruned_at < refill_s:
            return
        self._pruned_at = now
        full = [k for k, b in self.buckets.items() if b.tokens + (now - b.at) * self.rate_per_s >= self.burst]
        for k in full:
            del self.buckets[k]

    def metric_lines(self) -> list[str]:
        lines = [
            "# HELP pulse_api_rate_limited_total Mutating API calls refused with 429 by the per-caller rate limit.",
            "# TYPE pulse_api_rate_limited_total counter",
        ]
        lines += [f'pulse_api_rate_limited_total{{route="{escape(r)}"}} {n}' for r, n in sorted(self.limited.items())]
        return lines

"""Retry policy as values: a capped exponential backoff with jitter and the errors worth retrying.

Loops never sleep ad hoc: they ask a :class:`Backoff` how long to wait after the n-th consecutive
failure, and reset it on success. Transient errors (a Redis or database connection refused, a
timeout) are retried; permanent ones (bad input, a schema violation) are dropped and logged.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

import redis.exceptions


class PulseError(Exception):
    """Root of ClusterPulse's own errors. ``transient`` says whether a retry may succeed."""

    transient = False


class TransientError(PulseError):
    transient = True


class PermanentError(PulseError):
    transient = False


TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    TransientError,
    ConnectionError,
    TimeoutError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.TryAgainError,
    # a Redis Cluster between a master's failure and its replica's promotion, or mid-resharding
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterUnreachableError,
    redis.exceptions.AskError,  # and MovedError: a key mid-move, a slot moved (seen by a raw connection)
)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` may succeed. SQLAlchemy is looked up only if already imported,
    so the agent never pays for importing it."""
    if isinstance(exc, PulseError):
        return exc.transient
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is not None:
        if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
            return True
        if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
            return True
    return isinstance(exc, TRANSIENT_ERRORS)


@dataclass
class Backoff:
    """Capped exponential backoff with full jitter; ``failures`` is the consecutive failure count."""

    base_s: float = 0.2
    cap_s: float = 5.0
    jitter: bool = True
    failures: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)

    def next_delay(self) -> float:
        """Record one more failure and return how long to wait before the next try."""
        self.failures += 1
        delay = min(self.cap_s, self.base_s * (2 ** (self.failures - 1)))
        return self._rng.uniform(delay / 2, delay) if self.jitter else delay

    def reset(self) -> None:
        self.failures = 0

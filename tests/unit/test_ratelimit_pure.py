"""The rate limiter's pure core and its bucket table, on an injected clock (no sleeping)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.api.ratelimit import Bucket, RateDecision, RateLimiter, take


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_new_caller_has_the_whole_burst_then_waits_for_the_refill() -> None:
    bucket = None
    for _ in range(5):
        bucket, d = take(bucket, now=0.0, rate_per_s=2.0, burst=5)
        assert d.allowed
    bucket, d = take(bucket, now=0.0, rate_per_s=2.0, burst=5)
    assert not d.allowed and d.retry_after_s == pytest.approx(0.5)
    bucket, d = take(bucket, now=0.25, rate_per_s=2.0, burst=5)  # half a token back: not yet
    assert not d.allowed and d.retry_after_s == pytest.approx(0.25)
    bucket, d = take(bucket, now=0.5, rate_per_s=2.0, burst=5)
    assert d.allowed and bucket.tokens == pytest.approx(0.0)


def test_refill_is_capped_at_the_burst_and_a_clock_stepping_back_refills_nothing() -> None:
    bucket, _ = take(Bucket(tokens=0.0, at=0.0), now=3600.0, rate_per_s=10.0, burst=3)
    assert bucket.tokens == pytest.approx(2.0)  # 3 (cap), one taken
    bucket, d = take(Bucket(tokens=0.0, at=100.0), now=50.0, rate_per_s=10.0, burst=3)
    assert not d.allowed and bucket.tokens == 0.0


def test_retry_after_header_is_whole_seconds_and_at_least_one() -> None:
    assert RateDecision(False, 0.01).retry_after_header == "1"
    assert RateDecision(False, 1.2).retry_after_header == "2"
    assert RateDecision(False, 30.0).retry_after_header == "30"


@settings(max_examples=300, deadline=None)
@given(
    rate=st.floats(min_value=0.01, max_value=1000),
    burst=st.integers(min_value=1, max_value=500),
    gaps=st.lists(st.floats(min_value=0, max_value=5), min_size=1, max_size=200),
)
def test_never_more_than_burst_plus_rate_times_elapsed(rate: float, burst: int, gaps: list[float]) -> None:
    """The token-bucket guarantee, for any arrival pattern: in [0, t], at most burst + rate * t
    calls are let through; and a refused call is told to wait a positive time."""
    bucket, now, allowed = None, 0.0, 0
    for gap in gaps:
        now += gap
        bucket, d = take(bucket, now=now, rate_per_s=rate, burst=burst)
        allowed += d.allowed
        assert allowed <= burst + rate * now + 1e-6
        assert d.allowed or d.retry_after_s > 0


def test_limiter_keys_on_caller_and_address_and_counts_refusals_by_route() -> None:
    clock = Clock()
    lim = RateLimiter(rate_per_s=1.0, burst=2, clock=clock, routes=["/v1/jobs", "/v1/nodes/{name}/cordon"])
    assert [lim.check("ops", "10.0.0.1", route="/v1/jobs").allowed for _ in range(3)] == [True, True, False]
    assert lim.check("ops", "10.0.0.2", route="/v1/jobs").allowed  # same token, another host
    assert lim.check("ci", "10.0.0.1", route="/v1/jobs").allowed  # another token, same host
    refused = lim.check("ops", "10.0.0.1", route="/v1/nodes/{name}/cordon")
    assert not refused.allowed and refused.retry_after_s == pytest.approx(1.0)
    assert dict(lim.limited) == {"/v1/jobs": 1, "/v1/nodes/{name}/cordon": 1}
    clock.t += 1.0
    assert lim.check("ops", "10.0.0.1", route="/v1/jobs").allowed
    text = "\n".join(lim.metric_lines())
    assert "# TYPE pulse_api_rate_limited_total counter" in text
    assert 'pulse_api_rate_limited_total{route="/v1/jobs"} 1' in text
    assert 'pulse_api_rate_limited_total{route="/v1/nodes/{name}/cordon"} 1' in text
    msg = lim.message("ops", "10.0.0.1", refused)
    assert "PULSE_RATE_LIMIT_PER_S" in msg and "'ops'" in msg and "retry in 1.00s" in msg


def test_every_route_is_exported_at_zero_before_any_refusal() -> None:
    lim = RateLimiter(rate_per_s=1.0, burst=1, clock=Clock(), routes=["/v1/jobs"])
    assert 'pulse_api_rate_limited_total{route="/v1/jobs"} 0' in lim.metric_lines()


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 10), (5.0, 0)])
def test_zero_disables(rate: float, burst: int) -> None:
    lim = RateLimiter(rate_per_s=rate, burst=burst, clock=Clock())
    assert not lim.enabled
    assert all(lim.check("x", "a", route="/r").allowed for _ in range(10_000))
    assert not lim.buckets and not lim.limited


def test_refilled_buckets_are_dropped_and_the_table_is_capped() -> None:
    clock = Clock()
    lim = RateLimiter(rate_per_s=10.0, burst=5, clock=clock, max_keys=100)
    for i in range(100):
        lim.check("anonymous", f"10.0.{i // 256}.{i % 256}", route="/r")
    assert len(lim.buckets) == 100
    clock.t += 0.5  # everyone's bucket is full again (5 tokens at 10/s)
    lim.check("ops", "10.1.0.1", route="/r")
    assert list(lim.buckets) == [("ops", "10.1.0.1")]
    for i in range(150):  # a flood of distinct callers within one refill time
        lim.check("anonymous", f"10.2.{i // 256}.{i % 256}", route="/r")
    assert len(lim.buckets) == 100  # the oldest went first
    assert ("anonymous", "10.2.0.149") in lim.buckets and ("ops", "10.1.0.1") not in lim.buckets

"""trainer.report against a real Redis: registration, reports on the wire, Redis down, safety."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from clusterpulse import wire
from clusterpulse.retry import Backoff
from tests.stack import registrations, reports
from tests.support import is_cluster, redis_client, wait_for
from trainer.mfu import mfu
from trainer.report import LossSpikeDetector, TrainerReporter, cosine_warmup

pytestmark = pytest.mark.two_redis


def _one_rank(redis_url: str, **kw: Any) -> TrainerReporter:
    """Rank 0 of job ``j``, a world of one, on node ``n``."""
    return TrainerReporter(
        job="j", rank=0, node="n", world_size=1, redis_url=redis_url, redis_cluster=is_cluster(redis_url), **kw
    )


def test_registration_and_reports_reach_redis(redis_url: str) -> None:
    reporter = TrainerReporter(
        job="j1",
        rank=1,
        node="n1",
        world_size=2,
        local_rank=0,
        redis_url=redis_url,
        redis_cluster=is_cluster(redis_url),
        flops_per_token=1e6,
        peak_flops_per_device=1e11,
        tokens_per_step=256,
    )
    wait_for(lambda: registrations(redis_url), timeout=5, what="registration")
    (reg,) = registrations(redis_url)
    assert (reg.job, reg.rank, reg.node, reg.local_rank, reg.world_size) == ("j1", 1, "n1", 0, 2)
    for step in range(1, 6):
        reporter.report(step=step, loss=2.0 / step, grad_norm=0.5, loss_scale=None, step_time_s=0.5)
    assert reporter.close(timeout=5)
    reps = reports(redis_url)
    assert [r.step for r in reps] == [1, 2, 3, 4, 5]
    first = reps[0]
    assert (first.job, first.rank, first.node, first.loss, first.grad_norm) == ("j1", 1, "n1", 2.0, 0.5)
    assert first.tokens_per_s == pytest.approx(512.0)  # 256 tokens / 0.5 s
    # 512 tok/s * 1e6 FLOP/token / 1e11 FLOP/s = 5.12e-3
    assert first.mfu_ratio == pytest.approx(5.12e-3)
    assert first.mfu_ratio == pytest.approx(
        mfu(tokens_per_s=512, flops_per_token=1e6, ranks=1, peak_flops_per_device=1e11)
    )
    assert first.event is None
    assert reporter.published == 5 and reporter.dropped == 0


def test_env_fallbacks(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PULSE_JOB_ID", "envjob")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("PULSE_NODE", "envnode")
    monkeypatch.setenv("PULSE_REDIS_URL", redis_url)
    monkeypatch.setenv("PULSE_REDIS_CLUSTER", str(is_cluster(redis_url)).lower())
    monkeypatch.setenv("PULSE_PEAK_FLOPS", "2e11")
    with TrainerReporter(flops_per_token=1e6, tokens_per_step=100) as reporter:
        assert (reporter.job, reporter.rank, reporter.local_rank, reporter.world_size) == ("envjob", 3, 1, 4)
        assert reporter.peak_flops_per_device == 2e11
        reporter.report(step=1, loss=1.0, step_time_s=1.0)
    (reg,) = registrations(redis_url)
    assert (reg.job, reg.rank, reg.node, reg.local_rank, reg.world_size) == ("envjob", 3, "envnode", 1, 4)
    (rep,) = reports(redis_url)
    assert rep.mfu_ratio == pytest.approx(100 * 1e6 / 2e11)


def test_bad_identity_is_refused(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PULSE_JOB_ID", raising=False)
    with pytest.raises(ValueError, match="PULSE_JOB_ID"):
        TrainerReporter(redis_url=redis_url, redis_cluster=is_cluster(redis_url))
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        TrainerReporter(
            job="j", rank=2, world_size=2, node="n", redis_url=redis_url, redis_cluster=is_cluster(redis_url)
        )


def test_redis_down_never_blocks_or_raises() -> None:
    reporter = TrainerReporter(
        job="j-down",
        rank=0,
        node="n1",
        world_size=1,
        redis_url="redis://127.0.0.1:1/0",
        flops_per_token=1e6,
        peak_flops_per_device=1e11,
        tokens_per_step=64,
        queue_size=50,
        timeout_s=0.2,
        backoff=Backoff(base_s=0.01, cap_s=0.05),
    )
    worst = 0.0
    for step in range(1, 101):
        t0 = time.perf_counter()
        reporter.report(step=step, loss=1.0, grad_norm=1.0, step_time_s=0.01)
        worst = max(worst, time.perf_counter() - t0)
    assert worst < 0.05, f"report() took {worst * 1000:.1f} ms with Redis down"
    assert reporter.dropped >= 50  # 100 queued into a bound of 50: the oldest went
    t0 = time.perf_counter()
    assert reporter.close(timeout=1.0) is False
    assert time.perf_counter() - t0 < 2.0
    assert reporter.failures >= 1 and reporter.published == 0


def test_spike_event_is_reported(redis_url: str) -> None:
    with _one_rank(redis_url, every=100) as reporter:
        assert all(reporter.report(step=s, loss=1.0) is None for s in range(1, 11))  # not due
        rep = reporter.report(step=11, loss=50.0)  # an event is published whatever the cadence
        assert rep is not None and rep.event is not None and rep.event.startswith("loss_spike ")
        rep = reporter.report(step=12, loss=float("nan"))
        assert rep is not None and rep.event is not None and rep.event.startswith("nonfinite_loss ")
    reps = reports(redis_url)
    assert [r.step for r in reps] == [11, 12]
    assert reps[1].loss is None  # NaN travels as JSON null
    assert reporter.events == 2


def test_flush_sends_before_the_interval(redis_url: str) -> None:
    """With an interval far beyond the test's deadline, only flush() can have sent these."""
    reporter = _one_rank(redis_url, flush_interval_s=600, batch_size=2)
    for step in range(1, 8):
        reporter.report(step=step, loss=1.0, step_time_s=0.1)
    assert reporter.flush(timeout=5)
    assert [r.step for r in reports(redis_url)] == list(range(1, 8))  # in order, across 4 round trips
    assert len(registrations(redis_url)) == 1
    assert (reporter.published, reporter.pending) == (7, 0)
    reporter.report(step=8, loss=1.0)
    assert reporter.close(timeout=5)
    assert [r.step for r in reports(redis_url)][-1] == 8


def test_safety_event_does_not_wait_for_the_interval(redis_url: str) -> None:
    with _one_rank(redis_url, flush_interval_s=600) as reporter:
        wait_for(lambda: registrations(redis_url), timeout=5, what="registration")
        reporter.report(step=1, loss=1.0)
        reporter.report(step=2, loss=float("inf"))
        reps = wait_for(lambda: reports(redis_url), timeout=5, what="the event's report")
        assert isinstance(reps, list) and reps[-1].event is not None and reps[-1].event.startswith("nonfinite_loss")


def test_permanent_errors_are_counted_and_the_next_reports_go_through(redis_url: str) -> None:
    client = redis_client(redis_url)
    client.set(wire.TRAINER_STREAM, b"not a stream")  # every XADD there answers WRONGTYPE
    reporter = _one_rank(redis_url, flush_interval_s=600)
    for step in range(1, 4):
        reporter.report(step=step, loss=1.0)
    assert reporter.flush(timeout=5)  # nothing pending: a rejected report is not retried
    assert (reporter.rejected, reporter.published, reporter.failures) == (3, 0, 0)
    assert len(registrations(redis_url)) == 1  # registration rode the same round trip and succeeded
    client.delete(wire.TRAINER_STREAM)
    client.close()
    reporter.report(step=4, loss=1.0)
    assert reporter.close(timeout=5)
    assert [r.step for r in reports(redis_url)] == [4]
    assert (reporter.rejected, reporter.published) == (3, 1)


def test_loss_spike_detector_exact() -> None:
    det = LossSpikeDetector(window=3, factor=10.0)
    assert det.update(1, 2.0) is None
    assert det.update(2, 1.0) is None
    assert det.update(3, 30.0) is None  # two losses: too few to judge a window of 3
    assert det.update(4, 110.0) is None  # 110 == 10 x the mean 11 of steps 1-3: not over
    reason = det.update(5, 500.0)  # the window holds steps 2-4: mean 47
    assert reason is not None and reason.split()[0] == "loss_spike"
    assert "loss=500 at step 5 > 10 x mean 47 of the last 3 losses" in reason
    assert det.update(6, float("inf")) == "nonfinite_loss loss=inf at step 6"
    assert det.update(7, 1.0, grad_norm=float("nan")) == "nonfinite_grad_norm grad_norm=nan at step 7"
    assert LossSpikeDetector().update(1, None) is None


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.0),
        (5, 0.5e-3),  # warmup: 1e-3 * 5 / 10
        (10, 1e-3),  # peak
        (55, 1e-4 + 0.9e-3 * 0.5),  # halfway through the decay: cos(pi / 2) = 0
        (100, 1e-4),
        (150, 1e-4),
    ],
)
def test_cosine_warmup_exact(step: int, expected: float) -> None:
    got = cosine_warmup(step, warmup=10, total=100, base_lr=1e-3, min_lr=1e-4)
    assert math.isclose(got, expected, rel_tol=1e-12, abs_tol=1e-15)


def test_cosine_warmup_quarter() -> None:
    # p = 0.25: 0 + 1 * (1 + cos(pi / 4)) / 2 = (1 + 0.7071067811865476) / 2
    assert cosine_warmup(25, warmup=0, total=100, base_lr=1.0) == pytest.approx(0.8535533905932737, rel=1e-12)
    with pytest.raises(ValueError, match="total=5"):
        cosine_warmup(1, warmup=10, total=5, base_lr=1.0)

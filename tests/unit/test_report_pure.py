"""trainer.report's pure parts: the loss-spike window against a straightforward reference, and the
Redis protocol the reporter writes by hand against redis-py's own packing of the same commands."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from redis.connection import Connection

from clusterpulse import wire
from trainer.report import LossSpikeDetector, pack_xadds, xadd_prefix


def _reference_mean(seen: list[tuple[int, float]], step: int, window: int) -> float | None:
    """The window's mean by a scan, once it holds enough losses to judge."""
    inside = [loss for s, loss in seen if s >= step - window]
    return sum(inside) / len(inside) if len(inside) >= min(window, LossSpikeDetector.MIN_HISTORY) else None


@given(
    window=st.integers(min_value=1, max_value=12),
    factor=st.sampled_from([1.5, 2.0, 10.0]),
    steps=st.lists(
        st.tuples(st.integers(min_value=0, max_value=4), st.floats(min_value=-1.0, max_value=100.0)),
        max_size=60,
    ),
)
def test_spike_window_matches_a_scan(window: int, factor: float, steps: list[tuple[int, float]]) -> None:
    det = LossSpikeDetector(window=window, factor=factor)
    seen: list[tuple[int, float]] = []
    step = 0
    for gap, loss in steps:  # steps that never decrease, with gaps (0: another micro-step)
        step += gap
        mean = _reference_mean(seen, step, window)
        expected = mean is not None and mean > 0 and loss > factor * mean
        reason = det.update(step, loss)
        assert (reason is not None) == expected, (step, loss, mean)
        if reason is not None:
            assert reason.startswith(f"loss_spike loss={loss:.6g} at step {step} > {factor:g} x mean {mean:.6g}")
        seen.append((step, loss))


def test_a_step_going_back_restarts_the_window() -> None:
    det = LossSpikeDetector(window=100, factor=10.0)
    assert all(det.update(step, 1.0) is None for step in range(1, 11))
    assert det.update(11, 20.0) is not None  # a spike against the mean 1.0
    # Resumed from the checkpoint of step 5: the losses of the abandoned steps 1-11 do not count.
    assert all(det.update(step, 15.0) is None for step in range(5, 15))
    reason = det.update(15, 151.0)
    assert reason is not None and "x mean 15 of the last 10 losses" in reason


def test_noise_near_a_floor_is_no_spike() -> None:
    """A small batch's loss near its floor: often ten times the window's lowest, never its mean."""
    det = LossSpikeDetector(window=100, factor=10.0)
    losses = [0.001, 0.02, 0.004, 0.0005, 0.03, 0.002, 0.011, 0.0008, 0.025, 0.006] * 30
    assert [x for step, x in enumerate(losses, 1) if det.update(step, x) is not None] == []


def test_packed_xadds_are_what_redis_py_sends() -> None:
    payloads = [b"{}", b'{"step":1,"loss":0.5}', "café".encode(), b"x" * 70_000]
    prefix = xadd_prefix(wire.TRAINER_STREAM, wire.TRAINER_FIELD, 100_000)
    ours = b"".join(pack_xadds(prefix, payloads))
    conn = Connection()  # type: ignore[no-untyped-call]  # packs only; never connects
    pack = conn.pack_command
    theirs = b"".join(
        bytes(part)
        for p in payloads
        for part in pack("XADD", wire.TRAINER_STREAM, "MAXLEN", "~", 100_000, "*", wire.TRAINER_FIELD, p)  # type: ignore[no-untyped-call]
    )
    assert ours == theirs
    assert pack_xadds(prefix, []) == []

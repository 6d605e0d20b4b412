"""trainer.report's pure parts: the loss-spike window against a brute-force reference, and the
Redis protocol the reporter writes by hand against redis-py's own packing of the same commands."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from redis.connection import Connection

from clusterpulse import wire
from trainer.report import LossSpikeDetector, pack_xadds, xadd_prefix


def _reference_min(seen: list[tuple[int, float]], step: int, window: int) -> float | None:
    """The window's minimum by a scan: what the detector computed before it kept a running one."""
    inside = [loss for s, loss in seen if s > step - window]
    return min(inside) if inside else None


@given(
    window=st.integers(min_value=1, max_value=12),
    factor=st.sampled_from([1.5, 2.0, 10.0]),
    steps=st.lists(
        st.tuples(st.integers(min_value=1, max_value=4), st.floats(min_value=-1.0, max_value=100.0)),
        max_size=60,
    ),
)
def test_spike_window_matches_a_scan(window: int, factor: float, steps: list[tuple[int, float]]) -> None:
    det = LossSpikeDetector(window=window, factor=factor)
    seen: list[tuple[int, float]] = []
    step = 0
    for gap, loss in steps:  # increasing steps, with gaps
        step += gap
        low = _reference_min(seen, step, window)
        expected = low is not None and low > 0 and loss > factor * low
        reason = det.update(step, loss)
        assert (reason is not None) == expected, (step, loss, low)
        if reason is not None:
            assert reason.startswith(f"loss_spike loss={loss:.6g} at step {step} > {factor:g} x min {low:.6g}")
        seen.append((step, loss))


def test_a_step_going_back_restarts_the_window() -> None:
    det = LossSpikeDetector(window=100, factor=10.0)
    assert det.update(10, 1.0) is None
    assert det.update(11, 20.0) is not None  # a spike against 1.0
    # Resumed from the checkpoint of step 5: the losses of the abandoned steps 10-11 do not count.
    assert det.update(5, 15.0) is None
    reason = det.update(6, 151.0)
    assert reason is not None and "x min 15 of" in reason


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

"""The step's breakdown on a rank (trainer/phases.py), driven by a hand-moved clock."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterpulse import wire
from trainer.phases import BACKWARD, FORWARD, OPTIMIZER, PhaseClock, WallClock


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def tick(self, s: float) -> None:
        self.t += s


class Reduction:
    """The reduction's running totals, moved by hand."""

    def __init__(self) -> None:
        self.reduce_s = self.wait_s = 0.0
        self.arrivals = 0

    def __call__(self) -> tuple[float, float, int]:
        return self.reduce_s, self.wait_s, self.arrivals


def test_each_instant_goes_to_one_phase_and_the_parts_sum_to_the_wall() -> None:
    clock, red = Clock(), Reduction()
    pc = PhaseClock(red, clock)
    for _ in range(2):  # gradient accumulation 2: two micro-steps a window
        clock.tick(0.2)  # the script's DataLoader
        pc.enter(FORWARD)
        clock.tick(0.1)
        pc.leave()
        clock.tick(0.01)  # the script's loss on the output
        pc.enter(BACKWARD)
        clock.tick(0.3)
        red.reduce_s += 0.05  # the reduction inside backward: 0.02 of it waiting for a peer
        red.wait_s += 0.02
        red.arrivals += 1
        clock.tick(0.05)
        pc.leave()
        clock.tick(0.001)  # the script between backward and step
        pc.enter(OPTIMIZER)
        clock.tick(0.04)
        pc.leave()
    pc.enter(OPTIMIZER)  # the boundary's step
    clock.tick(0.02)
    wall, phases = pc.boundary()
    pc.leave()  # the wrapper's leave after the boundary: nothing left to time
    assert phases is not None
    assert wall == pytest.approx(2 * (0.2 + 0.1 + 0.01 + 0.35 + 0.001 + 0.04) + 0.02)
    assert phases.data == pytest.approx(0.4)
    assert phases.forward == pytest.approx(0.22)
    assert phases.backward == pytest.approx(0.6)
    assert phases.communication == pytest.approx(0.1)
    assert phases.wait == pytest.approx(0.04)
    assert phases.optimizer == pytest.approx(2 * 0.041 + 0.02)
    total = phases.data + phases.forward + phases.backward + phases.communication + phases.optimizer
    assert total == pytest.approx(wall)


def test_a_window_starts_where_the_last_ended() -> None:
    clock = Clock()
    pc = PhaseClock(clock=clock)
    pc.enter(OPTIMIZER)
    clock.tick(1.0)
    pc.boundary()
    clock.tick(0.5)  # after the boundary, outside the engine: the next batch
    pc.enter(FORWARD)
    clock.tick(0.1)
    pc.leave()
    wall, phases = pc.boundary()
    assert phases is not None
    assert wall == pytest.approx(0.6) and phases.data == pytest.approx(0.5) and phases.forward == pytest.approx(0.1)
    assert phases.wait is None  # no arrival measured: not known


def test_start_drops_what_came_before() -> None:
    clock = Clock()
    pc = PhaseClock(clock=clock)
    clock.tick(5.0)  # setup, a recovery
    pc.start()
    clock.tick(0.1)
    wall, phases = pc.boundary()
    assert wall == pytest.approx(0.1) and phases is not None and phases.data == pytest.approx(0.1)


def test_the_breakdown_off_reports_the_wall_only() -> None:
    clock = Clock()
    pc = WallClock(clock=clock)
    pc.enter(FORWARD)
    clock.tick(0.3)
    pc.leave()
    wall, phases = pc.boundary()
    assert wall == pytest.approx(0.3) and phases is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([FORWARD, BACKWARD, OPTIMIZER]), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
        max_size=20,
    )
)
def test_any_sequence_of_calls_sums_to_the_wall(calls: list[tuple[int, float, float, float]]) -> None:
    clock, red = Clock(), Reduction()
    pc = PhaseClock(red, clock)
    for phase, outside, inside, reduced in calls:
        clock.tick(outside)
        pc.enter(phase)
        clock.tick(inside)
        red.reduce_s += min(inside, reduced)
        pc.leave()
    wall, phases = pc.boundary()
    assert phases is not None
    parts = phases.data + phases.forward + phases.backward + phases.communication + phases.optimizer
    assert parts == pytest.approx(wall, abs=1e-9)


def test_phases_travel_with_the_report_and_old_readers_ignore_them() -> None:
    phases = wire.StepPhases(data=0.1, forward=0.2, backward=0.3, communication=0.05, optimizer=0.01, wait=0.02)
    rep = wire.TrainerReport(
        v=wire.PROTOCOL_VERSION, job="j", rank=0, node="n0", step=3, step_time_s=0.66, phases=phases
    )
    assert wire.decode_trainer_report(wire.encode(rep)).phases == phases

    class OldReport(msgspec.Struct, kw_only=True):  # what an orchestrator before the breakdown decodes
        v: int
        job: str
        rank: int
        node: str
        step: int
        step_time_s: float | None = None

    old = msgspec.json.decode(wire.encode(rep), type=OldReport)
    assert (old.step, old.step_time_s) == (3, 0.66)
    without = wire.encode(wire.TrainerReport(v=wire.PROTOCOL_VERSION, job="j", rank=0, node="n0", step=3))
    assert wire.decode_trainer_report(without).phases is None  # an older library's report
    with pytest.raises(wire.WireError, match="phases"):
        wire.decode_trainer_report(wire.encode(rep).replace(b'"data":0.1', b'"data":-0.1'))

"""The soak's pure parts: the fault schedule, the verdict from the transitions, and how a stop
flag ends a run."""

from __future__ import annotations

import asyncio
import itertools
import threading

from agent.simulated import FAULT_KINDS, JOB_FAULTS, PERMANENT_FAULTS
from tools.soak import SeenTransition, SoakFault, Timing, judge, schedule, until_stopped

TIMING = Timing(interval_s=2.0, degraded_after_s=12.0, throttle_sustain_s=6.0, recover_after=3, slack_s=8.0)
NODES = [f"n{i:02d}" for i in range(40)]


def test_schedule_is_deterministic_and_every_fault_fits_in_the_run() -> None:
    a = schedule(NODES, seed=7, fault_every_s=5.0, duration_s=600.0, timing=TIMING)
    assert a == schedule(NODES, seed=7, fault_every_s=5.0, duration_s=600.0, timing=TIMING)
    assert a != schedule(NODES, seed=8, fault_every_s=5.0, duration_s=600.0, timing=TIMING)
    assert len(a) > 80 and {f.kind for f in a} == set(FAULT_KINDS) - JOB_FAULTS  # a job's: not the soak's
    for f in a:
        assert f.end_s - f.start_s >= TIMING.detect_within(f.kind)  # long enough to be detected
        assert f.end_s + (TIMING.recover_within if f.clears else 0) <= 600.0
        assert f.clears == (f.kind not in PERMANENT_FAULTS)


def test_schedule_never_overlaps_faults_on_one_node_nor_reuses_a_permanently_broken_one() -> None:
    faults = schedule(NODES[:6], seed=1, fault_every_s=2.0, duration_s=900.0, timing=TIMING)
    by_node: dict[str, list[SoakFault]] = {}
    for f in faults:
        by_node.setdefault(f.node, []).append(f)
    for mine in by_node.values():
        mine.sort(key=lambda f: f.start_s)
        for prev, nxt in itertools.pairwise(mine):
            assert prev.clears, "nothing after a permanent fault"
            assert nxt.start_s >= prev.end_s + TIMING.recover_within


def _ok(f: SoakFault, detect: float = 1.0, recover: float = 4.0) -> list[SeenTransition]:
    out = [SeenTransition(f.node, "SUSPECT", f.start_s + 0.5), SeenTransition(f.node, "DEGRADED", f.start_s + detect)]
    return [*out, SeenTransition(f.node, "HEALTHY", f.end_s + recover)] if f.clears else out


def test_every_fault_seen_and_cleared_is_a_clean_verdict() -> None:
    faults = [
        SoakFault("a", "xid", 10.0, 40.0),
        SoakFault("b", "silent", 12.0, 50.0),
        SoakFault("c", "ecc", 20.0, 60.0, clears=False),
    ]
    ts = _ok(faults[0]) + _ok(faults[1], detect=13.5) + _ok(faults[2])
    v = judge(faults, [*ts, SeenTransition("d", "SUSPECT", 30.0)], timing=TIMING)  # SUSPECT alone is no false DEGRADED
    assert v.lost == [] and v.false_degraded == []
    assert v.detection_s == {"xid": [1.0], "silent": [13.5], "ecc": [1.0]} and v.recovery_s == [4.0, 4.0]


def test_missing_late_or_unexplained_transitions_are_reported() -> None:
    xid, thermal = SoakFault("a", "xid", 10.0, 40.0), SoakFault("b", "thermal", 10.0, 40.0)
    late = SeenTransition("a", "DEGRADED", 10.0 + TIMING.detect_within("xid") + 0.5)  # too late: lost (not false)
    never_back = _ok(thermal)[:-1]  # DEGRADED, but no HEALTHY after it cleared: lost
    stray = SeenTransition("z", "DEGRADED", 25.0)  # a node without a fault: false
    after = SeenTransition("b", "LOST", 40.0 + TIMING.recover_within + 1)  # after its fault's window: false
    v = judge([xid, thermal], [late, *never_back, stray, after], timing=TIMING)
    assert [(x["node"], x["missing"].split()[0]) for x in v.lost] == [
        ("a", "DEGRADED"),
        ("a", "HEALTHY"),
        ("b", "HEALTHY"),
    ]
    assert [(x["node"], x["to_state"]) for x in v.false_degraded] == [("z", "DEGRADED"), ("b", "LOST")]


def test_a_raised_flag_cancels_the_run_and_lets_its_finally_stop_what_it_started() -> None:
    """What SIGTERM does to ``pulse bench soak``: its handler only sets the flag; the run is
    cancelled where it waits, its ``finally`` blocks run, and no result comes back."""
    stopping = threading.Event()
    cleaned: list[str] = []

    async def run() -> int:
        stopping.set()  # as the SIGTERM handler would, mid-run
        try:
            await asyncio.Event().wait()  # a phase that would wait for ever
        finally:
            cleaned.append("stopped")
        return 1

    assert asyncio.run(until_stopped(run(), stopping, check_s=0.01)) is None
    assert cleaned == ["stopped"]
    assert asyncio.run(until_stopped(asyncio.sleep(0, result=5), threading.Event())) == 5

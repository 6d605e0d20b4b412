"""The pure health function through every transition and every guard."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clusterpulse import wire
from clusterpulse.states import NodeState
from services.health.decide import (
    NodeHealth,
    Policy,
    apply,
    assess,
    evaluate,
    observe,
    partition_suspected,
    target,
)

P = Policy(suspect_after=2.0, degraded_after=10.0, lost_after=30.0, recover_after=3, throttle_sustain=5.0)


def gpu(i: int = 0, **kw: object) -> wire.GpuSample:
    base: dict[str, object] = dict(
        index=i,
        power_watts=749.0,
        power_limit_watts=750.0,
        temperature_celsius=60.0,
        pcie_link_width=16,
        pcie_link_width_max=16,
        ecc_volatile_uncorrected=0,
    )
    base.update(kw)
    return wire.GpuSample(**base)  # type: ignore[arg-type]


def psu(name: str, out: float | None = 66.0, inp: float | None = None, ok: bool | None = True) -> wire.PsuSample:
    return wire.PsuSample(name=name, ok=ok, output_current_amperes=out, input_current_amperes=inp)


def hb(gpus: list[wire.GpuSample] | None = None, psus: list[wire.PsuSample] | None = None) -> wire.Heartbeat:
    return wire.Heartbeat(
        v=wire.PROTOCOL_VERSION,
        node="n1",
        boot_id="b",
        seq=1,
        sent_at=0.0,
        interval_s=1.0,
        gpu_source="simulated",
        gpus=gpus if gpus is not None else [gpu(i) for i in range(8)],
        psus=psus if psus is not None else [psu("PS1"), psu("PS2")],
    )


def step(node: NodeHealth, now: float, *, grace: float = -1e9, partitioned: bool = False) -> NodeHealth:
    t = evaluate(node, now=now, grace_start=grace, partitioned=partitioned, policy=P)
    return apply(node, t) if t else node


def feed(node: NodeHealth, beat: wire.Heartbeat, t0: float, n: int, dt: float = 1.0) -> tuple[NodeHealth, float]:
    """n heartbeats dt apart starting at t0, evaluating after each."""
    t = t0
    for _ in range(n):
        node = observe(node, beat, received_at=t, policy=P)
        node = step(node, t)
        t += dt
    return node, t


def fresh() -> NodeHealth:
    n = observe(NodeHealth(name="n1", since=0.0), hb(), received_at=0.0, policy=P)
    return step(n, 0.0)


# --- assess: each hard fault and warning --------------------------------------------------------


@pytest.mark.parametrize(
    ("beat", "needle"),
    [
        (hb(gpus=[gpu(0, lost=True, error="GPU is lost")]), "GPU 0 lost"),
        (hb(gpus=[gpu(0, ecc_volatile_uncorrected=2)]), "uncorrectable ECC errors: 2"),
        (hb(gpus=[gpu(0, xids_recent=(79,))]), "fatal XID 79"),
        (hb(gpus=[gpu(0, pcie_link_width=8)]), "PCIe link x8 of x16"),
        (hb(psus=[psu("PS1", ok=False), psu("PS2")]), "PSU PS1 failed"),
        (
            hb(psus=[psu("PS1", out=66.0), psu("PS2", out=54.0)]),
            "PSU current imbalance: PS2 output 54.0 A vs PS1 66.0 A",
        ),
        (
            hb(psus=[psu("PS1", out=None, inp=14.0), psu("PS2", out=None, inp=12.0)]),
            "PSU current imbalance: PS2 input 12.0 A",
        ),
    ],
)
def test_each_hard_fault_degrades(beat: wire.Heartbeat, needle: str) -> None:
    s = assess(beat, throttle_for=0.0, policy=P)
    assert any(needle in f for f in s.faults), s
    n = observe(NodeHealth(name="n1"), beat, received_at=0.0, policy=P)
    t = evaluate(n, now=0.0, grace_start=0.0, partitioned=False, policy=P)
    assert t is not None and t.new is NodeState.DEGRADED and needle in t.reason


@pytest.mark.parametrize(
    ("beat", "needle"),
    [
        (hb(gpus=[gpu(0, temperature_celsius=90.0)]), "GPU 0 at 90 C"),
        (hb(gpus=[gpu(0, xids_recent=(13,))]), "GPU 0 XID 13"),
        (hb(gpus=[gpu(0, throttle=("thermal",))]), "throttling: GPU 0 thermal"),
        (hb(gpus=[gpu(i, power_watts=700.0 if i >= 4 else 749.0) for i in range(8)]), "power below peers"),
        (hb(gpus=[gpu(0, error="Unknown Error")]), "GPU 0 read error"),
    ],
)
def test_each_warning_makes_suspect(beat: wire.Heartbeat, needle: str) -> None:
    s = assess(beat, throttle_for=0.0, policy=P)
    assert not s.faults and any(needle in w for w in s.warnings), s
    n = observe(NodeHealth(name="n1"), beat, received_at=0.0, policy=P)
    new, reason = target(n, now=0.0, grace_start=0.0, partitioned=False, policy=P)
    assert new is NodeState.SUSPECT and needle in reason


def test_clean_telemetry_and_near_misses_are_healthy() -> None:
    near = hb(
        gpus=[gpu(i, power_watts=749.0 * 0.96, temperature_celsius=86.0, throttle=("sw_power_cap",)) for i in range(8)],
        psus=[psu("PS1", out=66.0), psu("PS2", out=58.1)],  # 7.9 A apart: inside the 8 A bound
    )
    assert assess(near, throttle_for=100.0, policy=P) == assess(hb(), throttle_for=0.0, policy=P)
    assert assess(hb(), throttle_for=0.0, policy=P).level is NodeState.HEALTHY


def test_idle_gpus_are_not_below_busy_peers() -> None:
    half_busy = hb(
        gpus=[gpu(i, power_watts=749.0, utilization_ratio=0.99) for i in range(4)]
        + [gpu(i, power_watts=70.0, utilization_ratio=0.0) for i in range(4, 8)]
    )
    assert not assess(half_busy, throttle_for=0.0, policy=P).warnings
    sagging = hb(
        gpus=[gpu(i, power_watts=749.0, utilization_ratio=0.99) for i in range(4)]
        + [gpu(i, power_watts=700.0, utilization_ratio=0.99) for i in range(4, 8)]
    )
    assert "GPU 4 700 W" in assess(sagging, throttle_for=0.0, policy=P).warnings[0]


def test_input_side_only_used_when_no_output_readings() -> None:
    both = hb(psus=[psu("PS1", out=66.0, inp=14.0), psu("PS2", out=65.0, inp=1.0)])
    assert not assess(both, throttle_for=0.0, policy=P).faults  # output side decides


def test_failed_psu_excluded_from_imbalance() -> None:
    s = assess(hb(psus=[psu("PS1", out=0.0, ok=False), psu("PS2", out=66.0)]), throttle_for=0.0, policy=P)
    assert len(s.faults) == 1 and "failed" in s.faults[0]


def test_lost_gpu_is_not_counted_below_peers() -> None:
    beat = hb(gpus=[gpu(i) for i in range(7)] + [gpu(7, lost=True, power_watts=None)])
    s = assess(beat, throttle_for=0.0, policy=P)
    assert not s.warnings


# --- throttling must be sustained ---------------------------------------------------------------


def test_sustained_throttling_degrades_only_after_sustain_window() -> None:
    node = fresh()
    hot = hb(gpus=[gpu(0, throttle=("power_brake",))])
    node, t = feed(node, hot, 1.0, 5)  # t = 1..5: 4 s of throttling
    assert node.state is NodeState.SUSPECT
    node, t = feed(node, hot, t, 2)  # reaches 5 s
    assert node.state is NodeState.DEGRADED and "throttling for" in node.reason


def test_throttle_break_resets_the_window() -> None:
    node = fresh()
    hot = hb(gpus=[gpu(0, throttle=("thermal",))])
    node, t = feed(node, hot, 1.0, 4)
    node, t = feed(node, hb(), t, 1)
    node, t = feed(node, hot, t, 4)
    assert node.state is NodeState.SUSPECT and node.throttle_since == pytest.approx(t - 4)


# --- silence, grace, LOST -----------------------------------------------------------------------


def test_silence_suspect_then_degraded_then_lost() -> None:
    node = fresh()
    assert step(node, 1.9).state is NodeState.HEALTHY
    node = step(node, 2.0)
    assert node.state is NodeState.SUSPECT and "heartbeat 2.0s old" in node.reason
    assert step(node, 9.9).state is NodeState.SUSPECT
    node = step(node, 10.0)
    assert node.state is NodeState.DEGRADED and "no heartbeat for 10.0s" in node.reason
    node = step(node, 30.0)
    assert node.state is NodeState.LOST and "no trainer ranks" in node.reason


def test_lost_needs_trainer_silence_too() -> None:
    node = replace(fresh(), last_progress=25.0)
    node = step(node, 40.0)
    assert node.state is NodeState.DEGRADED  # ranks stepped 15 s ago: the node still computes
    node = step(node, 55.0)
    assert node.state is NodeState.LOST and "no progress for 30s" in node.reason


def test_startup_grace_gives_a_full_degraded_after() -> None:
    node = fresh()  # last seen at 0
    restarted_at = 100.0
    assert step(node, 101.0, grace=restarted_at).state is NodeState.HEALTHY
    assert step(node, 102.0, grace=restarted_at).state is NodeState.SUSPECT
    assert step(node, 109.9, grace=restarted_at).state is NodeState.SUSPECT
    assert step(node, 110.0, grace=restarted_at).state is NodeState.DEGRADED


def test_never_seen_node_is_timed_from_grace_start() -> None:
    node = NodeHealth(name="ghost", since=0.0)
    assert step(node, 9.0, grace=0.0).state is NodeState.SUSPECT
    assert step(node, 10.0, grace=0.0).state is NodeState.DEGRADED


# --- hysteresis ---------------------------------------------------------------------------------


def test_recovery_needs_recover_after_good_heartbeats() -> None:
    node = fresh()
    node, t = feed(node, hb(gpus=[gpu(0, pcie_link_width=8)]), 1.0, 2)
    assert node.state is NodeState.DEGRADED
    node, t = feed(node, hb(), t, 2)
    assert node.state is NodeState.DEGRADED
    node, t = feed(node, hb(), t, 1)
    assert node.state is NodeState.HEALTHY and "recovered after 3 good heartbeats" in node.reason


def test_flapping_fault_never_recovers() -> None:
    node = fresh()
    bad = hb(gpus=[gpu(0, pcie_link_width=8)])
    t = 1.0
    for _ in range(10):
        node, t = feed(node, bad, t, 1)
        node, t = feed(node, hb(), t, 2)
        assert node.state is NodeState.DEGRADED


def test_recovery_to_intermediate_state_needs_its_own_streak() -> None:
    node = fresh()
    node, t = feed(node, hb(gpus=[gpu(0, pcie_link_width=8)]), 1.0, 1)
    warm = hb(gpus=[gpu(0, temperature_celsius=90.0)])
    node, t = feed(node, warm, t, 3)
    assert node.state is NodeState.SUSPECT
    node, t = feed(node, hb(), t, 3)
    assert node.state is NodeState.HEALTHY


def test_lost_node_back_with_fault_becomes_degraded_after_streak() -> None:
    node = step(fresh(), 30.0)
    assert node.state is NodeState.LOST
    bad = hb(gpus=[gpu(0, ecc_volatile_uncorrected=1)])
    node, t = feed(node, bad, 31.0, 2)
    assert node.state is NodeState.LOST
    node, t = feed(node, bad, t, 1)
    assert node.state is NodeState.DEGRADED


def test_gap_longer_than_suspect_after_breaks_streak() -> None:
    node = fresh()
    node, t = feed(node, hb(gpus=[gpu(0, pcie_link_width=8)]), 1.0, 1)
    node, t = feed(node, hb(), t, 2, dt=5.0)  # heartbeats 5 s apart: not consecutive
    assert node.streak[0] == 1
    assert node.state is not NodeState.HEALTHY


def test_redelivered_older_heartbeat_changes_nothing() -> None:
    node, _ = feed(fresh(), hb(), 1.0, 3)
    again = observe(node, hb(gpus=[gpu(0, pcie_link_width=8)]), received_at=0.5, policy=P)
    assert again == node


# --- partition brake ----------------------------------------------------------------------------


def _nodes(silent: int, total: int, now: float) -> list[NodeHealth]:
    return [NodeHealth(name=f"n{i}", last_seen=(0.0 if i < silent else now)) for i in range(total)]


def test_partition_suspected_over_fraction() -> None:
    assert partition_suspected(_nodes(5, 8, 20.0), now=20.0, grace_start=0.0, policy=P)[0]
    assert not partition_suspected(_nodes(4, 8, 20.0), now=20.0, grace_start=0.0, policy=P)[0]  # exactly half
    assert not partition_suspected(_nodes(2, 2, 20.0), now=20.0, grace_start=0.0, policy=P)[0]  # too few nodes


def test_lost_nodes_do_not_count_towards_partition() -> None:
    nodes = [replace(n, state=NodeState.LOST) if i < 3 else n for i, n in enumerate(_nodes(5, 8, 20.0))]
    suspected, silent, total = partition_suspected(nodes, now=20.0, grace_start=0.0, policy=P)
    assert (suspected, silent, total) == (False, 2, 5)


def test_partition_brake_degrades_nobody_for_silence_but_faults_still_count() -> None:
    node = fresh()
    braked = step(node, 50.0, partitioned=True)
    assert braked.state is NodeState.SUSPECT and "partition suspected" in braked.reason
    faulty = observe(node, hb(gpus=[gpu(0, pcie_link_width=8)]), received_at=1.0, policy=P)
    assert step(faulty, 1.0, partitioned=True).state is NodeState.DEGRADED


# --- properties ---------------------------------------------------------------------------------

beats = st.sampled_from([hb(), hb(gpus=[gpu(0, pcie_link_width=8)]), hb(gpus=[gpu(0, temperature_celsius=95.0)]), None])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(beats, st.floats(min_value=0.1, max_value=40.0)), min_size=1, max_size=40))
def test_property_transitions_are_consistent(script: list[tuple[wire.Heartbeat | None, float]]) -> None:
    """Whatever happens: worsening is immediate, improving needs the streak, every transition has
    a reason, and evaluating twice at the same instant changes nothing (level-triggered)."""
    node = NodeHealth(name="n1", since=0.0)
    t = 0.0
    for beat, dt in script:
        t += dt
        if beat is not None:
            node = observe(node, beat, received_at=t, policy=P)
        want, _ = target(node, now=t, grace_start=0.0, partitioned=False, policy=P)
        tr = evaluate(node, now=t, grace_start=0.0, partitioned=False, policy=P)
        if tr is not None:
            assert tr.reason and tr.old is node.state and tr.new is want
            node = apply(node, tr)
        assert evaluate(node, now=t, grace_start=0.0, partitioned=False, policy=P) is None or tr is None
        from services.health.decide import SEVERITY

        assert SEVERITY[node.state] >= SEVERITY[want]  # never better than the evidence


def test_a_lost_gpus_throttle_reason_is_no_throttling_and_a_live_ones_is() -> None:
    lost_only = hb(gpus=[gpu(0, lost=True, throttle=("thermal",)), gpu(1, throttle=("sw_power_cap",))])
    n = observe(NodeHealth(name="n1"), lost_only, received_at=0.0, policy=P)
    assert n.throttle_since is None and not any("throttling" in x for x in (*n.signals.faults, *n.signals.warnings))
    live = hb(gpus=[gpu(0, lost=True, throttle=("thermal",)), gpu(1, throttle=("sw_power_cap", "power_brake"))])
    n = observe(n, live, received_at=1.0, policy=P)
    assert n.throttle_since == 1.0 and "throttling: GPU 1 power_brake" in n.signals.warnings
    n = observe(n, live, received_at=7.0, policy=P)  # sustained past throttle_sustain: a fault
    assert any(f.startswith("throttling for 6s: GPU 1 power_brake") for f in n.signals.faults)

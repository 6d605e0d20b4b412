"""The pure Slurm node-sync decision (services/slurm/nodes/decide.py), on hand-built cases."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from services.slurm.nodes.decide import (
    TAG,
    Action,
    Breaker,
    Decision,
    Drain,
    Ours,
    SlurmNode,
    SyncPolicy,
    decide,
    slurm_reason,
)

P = SyncPolicy(max_drain_fraction=0.25, drain_window_s=600)
NOW = 10_000.0
PSU = "hard fault: PSU current imbalance: PS2 output 54.1 A vs PS1 66.2 A (bound 8 A)"


def ours(name: str, state: str = "HEALTHY", reason: str = "", schedulable: bool = True) -> Ours:
    return Ours(name=name, state=state, reason=reason or f"{state.lower()} reason", schedulable=schedulable)


def slurm(name: str, state: str = "idle", *flags: str, reason: str = "", user: str = "") -> SlurmNode:
    return SlurmNode(name=name, state=state, flags=frozenset(flags), reason=reason, reason_user=user)


def cluster(n: int, bad: Mapping[str, str] = {}) -> tuple[dict[str, Ours], dict[str, SlurmNode]]:
    names = [f"sn{i}" for i in range(1, n + 1)]
    o = {x: ours(x, bad.get(x, "HEALTHY")) for x in names}
    return o, {x: slurm(x) for x in names}


def kinds(d: Decision) -> list[tuple[str, str]]:
    return [(a.kind, a.node) for a in d.actions]


def test_all_healthy_does_nothing() -> None:
    o, t = cluster(4)
    assert decide(o, t, {}, P, now=NOW) == Decision()


def test_degraded_node_is_drained_with_our_tag_and_reason() -> None:
    o, t = cluster(4)
    o["sn2"] = ours("sn2", "DEGRADED", PSU)
    d = decide(o, t, {}, P, now=NOW)
    assert kinds(d) == [("drain", "sn2")]
    assert d.actions[0].slurm_reason == f"{TAG} DEGRADED: {PSU}"
    assert d.actions[0].slurm_reason.startswith("clusterpulse: DEGRADED: hard fault: PSU current imbalance: PS2")
    assert "sn2" in d.actions[0].why and not d.breaker.open


def test_lost_and_cordoned_nodes_are_drained() -> None:
    o, t = cluster(8)
    o["sn1"] = ours("sn1", "LOST", "silent 300s, no trainer ranks")
    o["sn5"] = ours("sn5", schedulable=False)
    d = decide(o, t, {}, P, now=NOW)
    assert kinds(d) == [("drain", "sn1"), ("drain", "sn5")]
    assert d.actions[1].slurm_reason == "clusterpulse: cordoned in ClusterPulse"


def test_suspect_is_not_drained() -> None:
    o, t = cluster(4)
    o["sn1"] = ours("sn1", "SUSPECT")
    assert decide(o, t, {}, P, now=NOW).actions == ()


def test_a_node_slurm_keeps_out_already_is_not_drained_again() -> None:
    o, t = cluster(4)
    o["sn1"] = ours("sn1", "DEGRADED")
    o["sn2"] = ours("sn2", "DEGRADED")
    t["sn1"] = slurm("sn1", "idle", "drain", reason="maint", user="root")
    t["sn2"] = slurm("sn2", "down", reason="Not responding")
    assert decide(o, t, {}, P, now=NOW).actions == ()


def test_nodes_one_side_does_not_know_are_left_alone() -> None:
    o, t = cluster(2)
    o["gpu-99"] = ours("gpu-99", "DEGRADED")
    t["sn9"] = slurm("sn9", "idle", "drain", reason=f"{TAG} old")
    assert decide(o, t, {"sn9": Drain(f"{TAG} old", 1.0)}, P, now=NOW).actions == ()


def test_our_drain_of_a_node_slurm_no_longer_lists_is_disowned() -> None:
    o, t = cluster(2)
    o["sn7"] = ours("sn7")
    assert kinds(decide(o, t, {"sn7": Drain(f"{TAG} x", 1.0)}, P, now=NOW)) == [("disown", "sn7")]


def test_our_drain_is_resumed_once_healthy() -> None:
    o, t = cluster(4)
    r = f"{TAG} DEGRADED: {PSU}"
    t["sn2"] = slurm("sn2", "idle", "drain", reason=r, user="root")
    d = decide(o, t, {"sn2": Drain(r, NOW - 60)}, P, now=NOW)
    assert kinds(d) == [("resume", "sn2")]


def test_our_drain_stays_while_still_bad_or_only_suspect_or_cordoned() -> None:
    r = f"{TAG} x"
    for state, schedulable in (("DEGRADED", True), ("LOST", True), ("SUSPECT", True), ("HEALTHY", False)):
        o, t = cluster(4)
        o["sn2"] = ours("sn2", state, schedulable=schedulable)
        t["sn2"] = slurm("sn2", "idle", "drain", reason=r)
        assert decide(o, t, {"sn2": Drain(r, NOW)}, P, now=NOW).actions == (), (state, schedulable)


def test_an_admins_drain_is_never_resumed_even_with_our_tag() -> None:
    o, t = cluster(4)
    t["sn1"] = slurm("sn1", "idle", "drain", reason="maint", user="root")
    t["sn2"] = slurm("sn2", "allocated", "drain", reason=f"{TAG} looks like ours", user="alice")
    t["sn3"] = slurm("sn3", "down", reason="cable swap")
    assert decide(o, t, {}, P, now=NOW).actions == ()


def test_a_drain_whose_reason_someone_changed_is_disowned_not_resumed() -> None:
    o, t = cluster(4)
    t["sn2"] = slurm("sn2", "idle", "drain", reason="maint: keep out", user="alice")
    d = decide(o, t, {"sn2": Drain(f"{TAG} DEGRADED: x", NOW - 5)}, P, now=NOW)
    assert kinds(d) == [("disown", "sn2")]
    assert "alice" in d.actions[0].why and "maint: keep out" in d.actions[0].why


def test_a_drain_someone_resumed_is_forgotten_and_made_again_while_still_bad() -> None:
    o, t = cluster(4)
    r = f"{TAG} DEGRADED: x"
    assert kinds(decide(o, t, {"sn2": Drain(r, NOW - 5)}, P, now=NOW)) == [("disown", "sn2")]
    o["sn2"] = ours("sn2", "DEGRADED", "x")
    d = decide(o, t, {"sn2": Drain(r, NOW - 5)}, P, now=NOW)
    assert kinds(d) == [("disown", "sn2"), ("drain", "sn2")]


def test_our_drain_of_a_node_slurm_downed_is_not_resumed() -> None:
    o, t = cluster(4)
    r = f"{TAG} x"
    t["sn2"] = slurm("sn2", "down", "drain", reason=r)
    d = decide(o, t, {"sn2": Drain(r, NOW)}, P, now=NOW)
    assert d.actions == () and any("sn2" in h and "never resumed" in h for h in d.held)


def test_partition_brake_drains_and_resumes_nothing() -> None:
    o, t = cluster(8, {f"sn{i}": "DEGRADED" for i in range(1, 6)})
    r = f"{TAG} x"
    t["sn8"] = slurm("sn8", "idle", "drain", reason=r)
    d = decide(o, t, {"sn8": Drain(r, NOW)}, P, now=NOW, partitioned=True)
    assert d.actions == () and not d.breaker.open
    assert len(d.held) == 6


def test_four_bad_at_once_with_a_quarter_breaker_drains_one_and_trips() -> None:
    o, t = cluster(4, dict.fromkeys(["sn1", "sn2", "sn3", "sn4"], "DEGRADED"))
    d = decide(o, t, {}, P, now=NOW)
    assert kinds(d) == [("drain", "sn1"), ("trip", "sn2")]
    assert d.breaker.open and d.breaker.since == NOW
    assert "at most 1 allowed" in d.breaker.reason and "0.25 of 4 nodes" in d.breaker.reason
    assert {h.split(":")[0] for h in d.held} == {"sn2", "sn3", "sn4"}


def test_an_open_breaker_holds_every_drain_but_lets_resumes_through() -> None:
    o, t = cluster(4, {"sn3": "DEGRADED"})
    r = f"{TAG} x"
    t["sn1"] = slurm("sn1", "idle", "drain", reason=r)
    br = Breaker(open=True, since=NOW - 1000, reason="tripped")
    d = decide(o, t, {"sn1": Drain(r, NOW - 1000)}, P, now=NOW, breaker=br)
    assert kinds(d) == [("resume", "sn1")]
    assert d.breaker == br and any(h.startswith("sn3: drain held, the drain breaker is open") for h in d.held)


def test_the_window_counts_drains_made_earlier_and_forgets_old_ones() -> None:
    o, t = cluster(8, {"sn5": "DEGRADED"})  # 0.25 of 8: two drains per window
    assert kinds(decide(o, t, {}, P, now=NOW, recent=[NOW - 10])) == [("drain", "sn5")]
    assert kinds(decide(o, t, {}, P, now=NOW, recent=[NOW - 10, NOW - 20])) == [("trip", "sn5")]
    assert kinds(decide(o, t, {}, P, now=NOW, recent=[NOW - 700, NOW - 800])) == [("drain", "sn5")]


def test_after_an_operator_reset_earlier_drains_no_longer_count() -> None:
    o, t = cluster(4, {"sn4": "DEGRADED"})
    closed = Breaker(open=False, reset_at=NOW - 5)
    assert kinds(decide(o, t, {}, P, now=NOW, recent=[NOW - 10], breaker=closed)) == [("drain", "sn4")]
    assert kinds(decide(o, t, {}, P, now=NOW, recent=[NOW - 1], breaker=closed)) == [("trip", "sn4")]


def test_allowance_is_at_least_one() -> None:
    assert SyncPolicy(max_drain_fraction=0.1).allowance(3) == 1
    assert SyncPolicy(max_drain_fraction=0.1).allowance(100) == 10
    assert SyncPolicy(max_drain_fraction=0.25).allowance(8) == 2
    assert SyncPolicy(max_drain_fraction=0.3).allowance(10) == 3  # no float rounding down to 2


def test_reason_is_one_line_and_bounded() -> None:
    r = slurm_reason(ours("sn1", "DEGRADED", "line one\nline two   " + "x" * 500))
    assert r.startswith("clusterpulse: DEGRADED: line one line two x") and "\n" not in r
    assert len(r) <= 200 and r.endswith("...")


def test_slurm_node_availability() -> None:
    assert slurm("a").available and slurm("a", "allocated").available and slurm("a", "mixed").available
    assert not slurm("a", "idle", "drain").available and slurm("a", "idle", "drain").drained
    assert not slurm("a", "down").available and slurm("a", "down").down
    assert not slurm("a", "idle", "not_responding").available
    assert slurm("a", "idle", "drain").state_text == "idle+drain"


# --- properties over random clusters ---------------------------------------------------------------

STATES = st.sampled_from(["HEALTHY", "SUSPECT", "DEGRADED", "LOST"])
SLURM = st.sampled_from(["idle", "idle+drain:ours", "idle+drain:admin", "allocated+drain:changed", "down", "mixed"])


@st.composite
def worlds(
    draw: st.DrawFn,
) -> tuple[dict[str, Ours], dict[str, SlurmNode], dict[str, Drain], bool, Breaker, list[float]]:
    n = draw(st.integers(1, 12))
    o: dict[str, Ours] = {}
    t: dict[str, SlurmNode] = {}
    mem: dict[str, Drain] = {}
    for i in range(n):
        name = f"sn{i:02d}"
        o[name] = ours(name, draw(STATES), schedulable=draw(st.booleans()))
        kind = draw(SLURM)
        state, _, who = kind.partition(":")
        base, *flags = state.split("+")
        mine = f"{TAG} mine {i}"
        reason = {"ours": mine, "admin": "maint", "changed": "someone else"}.get(who, "")
        t[name] = slurm(name, base, *flags, reason=reason)
        if who in ("ours", "changed") or (who == "" and draw(st.booleans())):
            mem[name] = Drain(mine, NOW - 5)
    recent = draw(st.lists(st.floats(NOW - 2000, NOW), max_size=5))
    br = Breaker(open=draw(st.booleans()), since=NOW - 100)
    return o, t, mem, draw(st.booleans()), br, recent


@settings(max_examples=400, deadline=None)
@given(worlds())
def test_invariants(
    world: tuple[dict[str, Ours], dict[str, SlurmNode], dict[str, Drain], bool, Breaker, list[float]],
) -> None:
    o, t, mem, partitioned, br, recent = world
    d = decide(o, t, mem, P, now=NOW, recent=recent, breaker=br, partitioned=partitioned)
    again = decide(o, t, mem, P, now=NOW, recent=recent, breaker=br, partitioned=partitioned)
    assert d == again  # deterministic
    drains = [a for a in d.actions if a.kind == "drain"]
    resumes = [a for a in d.actions if a.kind == "resume"]
    if partitioned:
        assert not drains and not resumes and not any(a.kind == "trip" for a in d.actions)
    counted = [a for a in drains if a.counted]
    if br.open:
        assert not counted
    for a in drains:  # only drains for an operator's cordon are not counted
        assert a.counted == (o[a.node].state in ("DEGRADED", "LOST"))
    for a in resumes:  # only our own, unchanged drain of a HEALTHY, schedulable node that is not down
        assert a.node in mem and t[a.node].reason == mem[a.node].reason and t[a.node].drained
        assert o[a.node].state == "HEALTHY" and o[a.node].schedulable and not t[a.node].down
    for a in drains:
        assert a.slurm_reason.startswith(TAG) and not t[a.node].drained and not t[a.node].down
    used = sum(1 for x in recent if x > NOW - P.drain_window_s)
    assert used + len(counted) <= max(P.allowance(len(o)), used)
    assert sum(a.kind == "trip" for a in d.actions) <= 1


def test_action_is_hashable_value() -> None:
    assert Action("drain", "sn1", "why", "r") == Action("drain", "sn1", "why", "r")


def test_a_node_backing_off_is_neither_tried_nor_counted() -> None:
    o, t = cluster(4, {"sn1": "DEGRADED", "sn2": "DEGRADED"})
    d = decide(o, t, {}, P, now=NOW, backing_off={"sn1"})
    assert kinds(d) == [("drain", "sn2")] and not d.breaker.open
    assert any(h.startswith("sn1: drain held, backing off") for h in d.held)


def test_cordon_drains_are_neither_held_by_the_breaker_nor_counted() -> None:
    o, t = cluster(4, {"sn1": "DEGRADED", "sn2": "DEGRADED"})
    o["sn3"] = ours("sn3", schedulable=False)
    o["sn4"] = ours("sn4", schedulable=False)
    d = decide(o, t, {}, P, now=NOW)
    assert kinds(d) == [("drain", "sn1"), ("trip", "sn2"), ("drain", "sn3"), ("drain", "sn4")]
    assert [a.counted for a in d.actions if a.kind == "drain"] == [True, False, False]
    d = decide(o, t, {}, P, now=NOW, breaker=Breaker(open=True, since=1.0))
    assert kinds(d) == [("drain", "sn3"), ("drain", "sn4")]
    assert kinds(decide(o, t, {}, P, now=NOW, partitioned=True)) == []


def test_one_bad_gpu_does_not_drain_its_node_and_the_second_does() -> None:
    """Issue 35: a node DEGRADED only by its GPUs' own faults is drained from
    ``drain_min_bad_gpus`` of them on; below, it is not, and the sync says why."""
    o, t = cluster(4)
    xid = "GPU 2 fatal XID 79"
    o["sn1"] = Ours(name="sn1", state="DEGRADED", reason=xid, own="HEALTHY", bad_gpus=1)
    d = decide(o, t, {}, P, now=NOW)
    assert d.actions == () and len(d.held) == 1
    assert "sn1: not drained for 1 bad GPU(s)" in d.held[0] and "PULSE_SLURM_DRAIN_MIN_BAD_GPUS=2" in d.held[0]
    o["sn1"] = Ours(name="sn1", state="DEGRADED", reason=xid, own="HEALTHY", bad_gpus=2)
    assert kinds(decide(o, t, {}, P, now=NOW)) == [("drain", "sn1")]
    # a fault of the node itself beside one bad GPU: drained as ever
    o["sn1"] = Ours(name="sn1", state="DEGRADED", reason=PSU, own="DEGRADED", bad_gpus=1)
    assert kinds(decide(o, t, {}, P, now=NOW)) == [("drain", "sn1")]


def test_our_drain_is_resumed_when_only_one_bad_gpu_is_left() -> None:
    """Drained for its PSU; the PSU is back and one GPU is still bad: under the threshold the
    node goes by its own state, HEALTHY, and our drain is resumed."""
    o, t = cluster(4)
    reason = slurm_reason(ours("sn3", "DEGRADED", PSU))
    t["sn3"] = slurm("sn3", "idle", "drain", reason=reason)
    memory = {"sn3": Drain(reason=reason, at=NOW - 100)}
    o["sn3"] = Ours(name="sn3", state="DEGRADED", reason=PSU, own="HEALTHY", bad_gpus=1)
    assert kinds(decide(o, t, memory, P, now=NOW)) == [("resume", "sn3")]

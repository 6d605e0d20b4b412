"""The fabric check's rounds and verdict (services/fabric/decide.py), inputs built by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from clusterpulse import wire
from services.fabric import decide as fabric
from services.fabric.decide import FabricPolicy, Pair

POLICY = FabricPolicy(slow_fraction=0.7)
NODES = [f"n{i}" for i in range(8)]


def measured(pairs: list[Pair], figures: dict[frozenset[str], float]) -> list[Pair]:
    """Each pending pair done with its figure (every pair of the round named in ``figures``)."""
    return [replace(p, state="done", busbw_gbps=figures[frozenset(p.nodes)]) if not p.finished else p for p in pairs]


def slow_node_figures(slow: str, fast: float = 20.0, slow_gbps: float = 2.0) -> dict[frozenset[str], float]:
    every = {frozenset((a, b)) for a in NODES for b in NODES if a != b}
    return {pair: slow_gbps if slow in pair else fast for pair in every}


def run(
    nodes: list[str], figures: dict[frozenset[str], float], policy: FabricPolicy = POLICY
) -> tuple[list[Pair], fabric.Verdict]:
    pairs = measured(fabric.first_round(nodes), figures)
    pairs = pairs + fabric.second_round(nodes, pairs, policy)
    pairs = measured(pairs, figures)
    return pairs, fabric.verdict(nodes, pairs, policy)


@pytest.mark.parametrize("slow", NODES)
def test_one_slow_node_of_eight_is_named_in_two_rounds(slow: str) -> None:
    pairs, v = run(NODES, slow_node_figures(slow))
    assert set(v.slow) == {slow}
    assert max(p.round for p in pairs) == 2
    assert "2 GB/s" in v.slow[slow] and "0.1x the median 20 GB/s" in v.slow[slow]
    partner = next(p.nodes for p in pairs if p.round == 1 and slow in p.nodes)
    second = [p for p in pairs if p.round == 2]
    assert {n for p in second for n in p.nodes} >= set(partner)  # both of the slow pair were tried again
    assert all(len(set(p.nodes) & set(partner)) == 1 for p in second)  # each with a node of a fast pair


def test_a_clean_fabric_takes_one_round_and_names_nobody() -> None:
    pairs, v = run(NODES, slow_node_figures("none"))
    assert v.slow == {} and {p.round for p in pairs} == {1} and len(pairs) == 4
    assert v.median_gbps == 20.0 and "no slow node" in v.reason


def test_the_slowest_pair_meets_the_fastest_pair_first() -> None:
    figures = slow_node_figures("n5")
    figures[frozenset(("n0", "n1"))] = 25.0  # the fastest pair
    pairs = measured(fabric.first_round(NODES), figures)
    second = fabric.second_round(NODES, pairs, POLICY)
    assert [p.nodes for p in second] == [("n4", "n0"), ("n5", "n1")]


def test_an_odd_node_out_is_measured_in_round_two() -> None:
    nodes = NODES[:5]
    pairs = measured(fabric.first_round(nodes), slow_node_figures("none"))
    assert [p.nodes for p in pairs] == [("n0", "n1"), ("n2", "n3")]
    second = fabric.second_round(nodes, pairs, POLICY)
    assert [p.nodes for p in second] == [("n4", "n0")]
    _, v = run(nodes, slow_node_figures("n4"))
    assert set(v.slow) == {"n4"}


def test_two_nodes_cannot_be_told_apart_by_a_fraction_but_a_floor_names_both() -> None:
    figures = {frozenset(("n0", "n1")): 2.0}
    _, v = run(["n0", "n1"], figures)
    assert v.slow == {}  # one pair is its own median
    _, v = run(["n0", "n1"], figures, FabricPolicy(slow_fraction=0.7, min_busbw_gbps=10.0))
    assert set(v.slow) == {"n0", "n1"} and "floor 10 GB/s" in v.slow["n0"]


def test_a_failed_probe_is_slow_and_its_detail_is_the_reason() -> None:
    pairs = fabric.first_round(["n0", "n1", "n2", "n3"])
    pairs = [
        replace(pairs[0], state="failed", detail="n1: probe exited (exit 1): NCCL error"),
        replace(pairs[1], state="done", busbw_gbps=20.0),
    ]
    second = fabric.second_round(["n0", "n1", "n2", "n3"], pairs, POLICY)
    assert [p.nodes for p in second] == [("n0", "n2"), ("n1", "n3")]
    second = [replace(second[0], state="done", busbw_gbps=19.0), replace(second[1], state="failed", detail="no result")]
    v = fabric.verdict(["n0", "n1", "n2", "n3"], pairs + second, POLICY)
    assert list(v.slow) == ["n1"] and "every fabric probe failed" in v.slow["n1"]


def test_pairs_that_share_a_node_run_one_after_the_other() -> None:
    pairs = [Pair(2, ("a", "x")), Pair(2, ("b", "x")), Pair(2, ("c", "y"))]
    assert fabric.runnable(pairs) == [0, 2]
    pairs[0] = replace(pairs[0], state="running")
    assert fabric.runnable(pairs) == [2]  # x probes with a: b waits
    pairs[2] = replace(pairs[2], state="done", busbw_gbps=1.0)
    pairs[0] = replace(pairs[0], state="done", busbw_gbps=1.0)
    assert fabric.runnable(pairs) == [1]


def test_round_two_waits_for_round_one() -> None:
    pairs = [Pair(1, ("a", "b"), state="running"), Pair(2, ("c", "d"))]
    assert fabric.runnable(pairs) == []


def test_a_probe_past_its_timeout_fails_when_both_agents_took_it() -> None:
    pairs = [
        Pair(1, ("a", "b"), state="running", started_at=100.0, answered=(0, 1)),
        Pair(1, ("c", "d"), state="running", started_at=150.0),
    ]
    out = fabric.timed_out(pairs, now=161.0, timeout_s=60.0)
    assert [p.state for p in out] == ["failed", "running"] and "60s" in out[0].detail


def test_a_probe_an_agent_never_took_is_unmeasured_and_names_nobody() -> None:
    """Nodes with no launcher behind them (an agent that stopped reading its commands): the pairs
    they are in are unmeasured, which names nobody slow, clears nobody, holds nobody; the node that
    did answer is measured again in round 2 against a fast pair."""
    nodes = ["n0", "n1", "n2", "n3", "n4", "n5"]
    first = fabric.first_round(nodes)
    first = [
        replace(first[0], state="running", started_at=0.0, answered=(0,)),  # n1's agent: no word
        replace(first[1], state="running", started_at=0.0),  # neither n2's nor n3's
        replace(first[2], state="done", busbw_gbps=20.0, answered=(0, 1)),
    ]
    first = fabric.timed_out(first, now=200.0, timeout_s=120.0)
    assert [p.state for p in first] == ["unmeasured", "unmeasured", "done"]
    assert "agent of n1 within 120s" in first[0].detail and "n2 and n3" in first[1].detail
    second = fabric.second_round(nodes, first, POLICY)
    assert [p.nodes for p in second] == [("n0", "n4")]  # n0 answered: tried again; n1-n3 are not
    pairs = [*first, replace(second[0], state="done", busbw_gbps=19.0)]
    v = fabric.verdict(nodes, pairs, POLICY)
    assert v.slow == {} and set(v.unmeasured) == {"n1", "n2", "n3"}
    assert v.reason.endswith("no slow node; not measured: n1, n2, n3"), v.reason
    assert fabric.measured(pairs) == {"n0", "n4", "n5"}  # a standing verdict neither holds nor clears n1-n3
    # every pair unmeasured: no fast pair to try the answering node against; nobody named
    alone = fabric.timed_out([replace(first[0], state="running")], now=200.0, timeout_s=120.0)
    assert fabric.second_round(["n0", "n1"], alone, POLICY) == []
    assert fabric.verdict(["n0", "n1"], alone, POLICY).slow == {}
    assert set(fabric.unmeasured(["n0", "n1"], alone)) == {"n0", "n1"}


def test_a_probe_status_reads_as_running_done_or_failed() -> None:
    line = wire.FABRIC_RESULT_PREFIX + json.dumps({"busbw_gbps": 12.5})
    assert fabric.probe_result({"state": "started"}) == ("running", None, "")
    assert fabric.probe_result({"state": "exited", "exit_code": 0, "log_tail": f"noise\n{line}\n"}) == (
        "done",
        12.5,
        "",
    )
    state, _, why = fabric.probe_result({"state": "exited", "exit_code": 1, "log_tail": "Traceback\nRuntimeError: x"})
    assert state == "failed" and "exit 1" in why and "RuntimeError: x" in why
    assert fabric.probe_result({"state": "exited", "exit_code": 0, "log_tail": "nothing"})[0] == "failed"
    assert (
        "unreadable"
        in fabric.probe_result({"state": "exited", "exit_code": 0, "log_tail": wire.FABRIC_RESULT_PREFIX + "{"})[2]
    )
    assert fabric.probe_result({"state": "preflight_failed", "detail": "no GPU"})[0] == "failed"
    # the other node's rank prints no figure: its clean exit waits for rank 0's word
    assert fabric.probe_result({"state": "exited", "exit_code": 0, "log_tail": ""}, first=False)[0] == "running"
    assert fabric.probe_result({"state": "exited", "exit_code": 1, "log_tail": "x"}, first=False)[0] == "failed"


def test_a_pair_round_trips_through_json() -> None:
    p = Pair(
        2, ("a", "b"), state="done", busbw_gbps=3.5, probe="fabric-x-1", started_at=1.0, addr="10.0.0.1", port=29501,
        answered=(0, 1),
    )  # fmt: skip
    assert Pair.from_json(json.loads(json.dumps(p.to_json()))) == p


def test_a_node_named_twice_or_alone_is_refused() -> None:
    with pytest.raises(ValueError, match="named twice: a"):
        fabric.first_round(["a", "b", "a"])
    with pytest.raises(ValueError, match="at least 2 nodes"):
        fabric.first_round(["a"])


def test_the_nodes_of_a_check() -> None:
    states = {"a": "HEALTHY", "b": "SUSPECT", "c": "DEGRADED", "d": "LOST", "e": "HEALTHY"}
    assert fabric.check_nodes(None, states, {"e": "job1"}) == ["a", "b"]
    assert fabric.check_nodes(["c", "a"], states, {}) == ["c", "a"]
    with pytest.raises(fabric.BadNodes, match="zz"):
        fabric.check_nodes(["a", "zz"], states, {})
    with pytest.raises(fabric.CheckRefused, match=r"LOST node.*d"):
        fabric.check_nodes(["a", "d"], states, {})
    with pytest.raises(fabric.CheckRefused, match=r"e \(job job1\)"):
        fabric.check_nodes(["a", "e"], states, {"e": "job1"})
    with pytest.raises(fabric.BadNodes, match="named twice: a"):
        fabric.check_nodes(["a", "b", "a"], states, {})
    with pytest.raises(fabric.CheckRefused, match="a check needs 2"):
        fabric.check_nodes(None, {"a": "HEALTHY"}, {})
    # a node whose heartbeats say it launches nothing (pulse simulate's): left out, or refused by name
    assert fabric.check_nodes(None, states, {}, {"b"}) == ["a", "e"]
    with pytest.raises(fabric.CheckRefused, match=r"node\(s\) b launch nothing .*pulse simulate"):
        fabric.check_nodes(["a", "b"], states, {}, {"b"})


def test_a_verdict_stands_until_a_later_check_measures_the_node_fast_or_it_runs_out() -> None:
    checks = [
        ("c1", 100.0, {"a", "b", "c"}, {"a": "slow", "b": "slow"}),
        ("c2", 200.0, {"b"}, {}),
    ]
    held = fabric.standing(checks, hold_s=1000.0, now=300.0)
    assert held == {"a": ("fabric check c1: slow", 1100.0)}
    assert fabric.standing(checks, hold_s=1000.0, now=1200.0) == {}


def test_slow_nodes_of_a_job_are_swapped_for_spares_that_passed() -> None:
    assert fabric.replace_slow(["a", "b", "c"], ["d", "e"], {"b"}) == ["a", "c", "d"]
    assert fabric.replace_slow(["a", "b"], ["d", "e"], {"a", "d"}) == ["b", "e"]
    assert fabric.replace_slow(["a", "b"], ["d"], {"a", "b"}) is None
    assert fabric.replace_slow(["a", "b"], [], set()) == ["a", "b"]


def test_the_cli_shows_every_pair_and_each_slow_nodes_reason() -> None:
    from tools.format import format_fabric_check

    pairs, v = run(NODES, slow_node_figures("n3"))
    check = {
        "id": "c1", "state": "DONE", "reason": v.reason, "slow": sorted(v.slow), "slow_reasons": v.slow,
        "pairs": [{k: p.to_json()[k] for k in ("round", "nodes", "state", "busbw_gbps", "detail")} for p in pairs],
    }  # fmt: skip
    lines = format_fabric_check(check).splitlines()
    assert lines[0] == "fabric check c1 DONE: 8 nodes, 6 of 6 pairs measured, median 20 GB/s; slow: n3"
    assert lines[1].split() == ["ROUND", "PAIR", "STATE", "BUSBW", "GB/s", "DETAIL"]
    assert lines[3].split() == ["1", "n2", "-", "n3", "done", "2"]
    assert lines[-1].startswith("slow: n3: all-reduce bus bandwidth at most 2 GB/s in 2 pairs")

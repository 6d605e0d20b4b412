"""The step's verdict (services/jobs/bottleneck.py), windows built by hand."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.jobs import bottleneck
from services.jobs.bottleneck import BottleneckPolicy, RankWindow, Verdict, verdict

POLICY = BottleneckPolicy()


def rank(
    r: int,
    *,
    node: str | None = None,
    data: float = 0.002,
    forward: float = 0.03,
    backward: float = 0.06,
    communication: float = 0.01,
    optimizer: float = 0.01,
    wait: float = 0.0,
    steps: int = 10,
) -> RankWindow:
    return RankWindow(
        rank=r, node=node if node is not None else f"n{r}", steps=steps, data=data, forward=forward,
        backward=backward, communication=communication, optimizer=optimizer, wait=wait,
    )  # fmt: skip


def job(per_rank: dict[str, dict[str, Any]] | None = None, n: int = 4) -> list[RankWindow]:
    """``n`` healthy ranks, one per node; ``{"2": {...}}`` changes rank 2's phases."""
    return [replace(rank(r), **(per_rank or {}).get(str(r), {})) for r in range(n)]


def test_a_healthy_job_is_compute_bound_and_names_nobody() -> None:
    v = verdict(job())
    assert v is not None and v.kind == "compute" and v.rank is None and v.node is None
    assert "data 2%" in v.reason, v.reason


def test_an_empty_window_has_no_verdict() -> None:
    assert verdict([]) is None
    assert verdict([rank(0, steps=0)]) is None


def test_a_rank_whose_loader_sleeps_is_named_although_its_peers_wait_in_the_reduction() -> None:
    # rank 2 waits 0.2 s for data; the other three wait for it at the reduction (wait measured)
    ranks = job({"2": {"data": 0.2}, **{str(r): {"communication": 0.21, "wait": 0.2} for r in (0, 1, 3)}})
    v = verdict(ranks)
    assert v == Verdict(kind="data", rank=2, node="n2", reason=v.reason if v else ""), v
    assert "rank 2 on n2 waits 0.2s a step for its data" in v.reason


def test_the_waits_alone_make_no_communication_verdict_when_not_measured() -> None:
    # the same, on a route that does not measure waits: the sleeping rank still stands out first
    ranks = job({"2": {"data": 0.2}, **{str(r): {"communication": 0.21} for r in (0, 1, 3)}})
    v = verdict(ranks)
    assert v is not None and (v.kind, v.rank) == ("data", 2)


def test_a_node_slow_in_the_reduction_is_named() -> None:
    # node n1's ranks hold their reduction 0.3 s; the others wait for them to arrive next step
    ranks = [
        rank(0, node="a", communication=0.31, wait=0.3),
        rank(1, node="b", communication=0.31),
        rank(2, node="b", communication=0.31),
        rank(3, node="c", communication=0.31, wait=0.3),
    ]
    v = verdict(ranks)
    assert v is not None and (v.kind, v.node, v.rank) == ("communication", "b", None), v
    assert v.reason.startswith("node b: its 2 ranks spend 0.31s a step"), v.reason


def test_a_carrier_waiting_under_a_plan_with_proxies_is_never_named() -> None:
    # a degraded rank's carrier waits for its gradient by design, and waits go unmeasured then:
    # the same windows with every step measured name node b, unmeasured they name no node
    ranks = [
        rank(0, node="a", communication=0.31, wait=0.3),
        replace(rank(1, node="b", communication=0.31), unmeasured=10),
        replace(rank(2, node="b", communication=0.31), unmeasured=10),
        rank(3, node="c", communication=0.31, wait=0.3),
    ]
    v = verdict(ranks)
    assert v is not None and v.node is None and v.rank is None, v


def test_one_node_needs_no_peers_to_be_compared_with() -> None:
    ranks = [rank(r, node="only", communication=0.5) for r in range(4)]
    v = verdict(ranks)
    assert v is not None and v.kind == "communication" and v.node is None  # the job as a whole


def test_a_rank_slow_to_compute_is_named() -> None:
    v = verdict(job({"3": {"backward": 0.3}, **{str(r): {"communication": 0.25, "wait": 0.24} for r in range(3)}}))
    assert v is not None and (v.kind, v.rank, v.node) == ("compute", 3, "n3"), v


def test_every_loader_slow_is_data_bound_naming_nobody() -> None:
    v = verdict([rank(r, data=0.1) for r in range(4)])
    assert v is not None and (v.kind, v.rank, v.node) == ("data", None, None), v


def test_a_slow_network_everywhere_is_communication_bound_naming_nobody() -> None:
    v = verdict([rank(r, communication=0.1) for r in range(4)])
    assert v is not None and (v.kind, v.rank, v.node) == ("communication", None, None), v


def test_a_small_excess_is_noise() -> None:
    # 5 x its peers' loader time, but 1 ms of a 112 ms step: below min_excess
    v = verdict(job({"1": {"data": 0.01}}))
    assert v is not None and v.kind == "compute" and v.rank is None


def test_one_rank_is_judged_as_the_whole_job() -> None:
    v = verdict([rank(0, data=0.5)])
    assert v is not None and (v.kind, v.rank, v.node) == ("data", None, None)
    v = verdict([rank(0)])
    assert v is not None and v.kind == "compute" and v.rank is None


def test_the_largest_excess_wins() -> None:
    v = verdict(job({"1": {"data": 0.2}, "2": {"data": 0.4}}))
    assert v is not None and (v.kind, v.rank) == ("data", 2)


def test_equal_excesses_prefer_data_then_the_lowest_rank() -> None:
    v = verdict(job({"1": {"backward": 0.26}, "2": {"data": 0.202}}))
    assert v is not None and (v.kind, v.rank) == ("data", 2), v
    v = verdict(job({"3": {"data": 0.2}, "1": {"data": 0.2}}))
    assert v is not None and (v.kind, v.rank) == ("data", 1), v


def test_the_whole_job_tie_is_data() -> None:
    v = verdict([rank(r, data=0.1, communication=0.1, forward=0.0, backward=0.0, optimizer=0.0) for r in range(2)])
    assert v is not None and v.kind == "data"


def test_policy_values_are_checked() -> None:
    with pytest.raises(ValueError, match="factor"):
        BottleneckPolicy(factor=1.0)
    with pytest.raises(ValueError, match="min_excess"):
        BottleneckPolicy(min_excess=1.0)
    with pytest.raises(ValueError, match="share"):
        BottleneckPolicy(share=0.0)


def test_a_node_counts_consecutive_windows_and_starts_again_otherwise() -> None:
    comm = Verdict(kind="communication", reason="", node="b")
    streak = bottleneck.consecutive({}, comm)
    assert streak == {"b": 1}
    streak = bottleneck.consecutive(streak, comm)
    assert streak == {"b": 2}
    assert bottleneck.consecutive(streak, Verdict(kind="communication", reason="", node="c")) == {"c": 1}
    assert bottleneck.consecutive(streak, Verdict(kind="compute", reason="")) == {}
    assert bottleneck.consecutive(streak, None) == {}


def test_the_parts_sum_to_the_step() -> None:
    r = rank(0, data=0.1, forward=0.2, backward=0.3, communication=0.15, optimizer=0.05, wait=0.05)
    assert r.step == pytest.approx(0.8)
    assert sum(r.phases().values()) == pytest.approx(r.step)
    assert r.transfer == pytest.approx(0.1) and r.compute == pytest.approx(0.55)
    assert rank(0, communication=0.1, wait=0.2).transfer == 0.0  # a wait measured past the call: never negative


phase = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(phase, phase, phase, phase, phase, st.integers(0, 3)), min_size=1, max_size=12),
)
def test_any_window_gets_one_verdict_naming_ranks_and_nodes_it_holds(rows: list[tuple[float, ...]]) -> None:
    ranks = [
        RankWindow(rank=i, node=f"n{int(row[5])}", steps=5, data=row[0], forward=row[1], backward=row[2],
                   communication=row[3], optimizer=row[4], wait=row[3] / 2)
        for i, row in enumerate(rows)
    ]  # fmt: skip
    v = verdict(ranks)
    assert v is not None and v.kind in bottleneck.KINDS and v.reason
    if v.rank is not None:
        assert v.rank in {r.rank for r in ranks} and v.node == ranks[v.rank].node and v.kind != "communication"
    if v.kind == "communication" and v.node is not None:
        assert v.node in {r.node for r in ranks}
    assert verdict(list(reversed(ranks))) == v  # the order of the ranks never matters


@pytest.mark.parametrize("seed", range(20))
def test_five_percent_noise_names_nobody(seed: int) -> None:
    rng = random.Random(seed)

    def noisy(x: float) -> float:
        return x * rng.uniform(0.95, 1.05)

    ranks = [
        rank(r, data=noisy(0.002), forward=noisy(0.03), backward=noisy(0.06), communication=noisy(0.01),
             optimizer=noisy(0.01))
        for r in range(16)
    ]  # fmt: skip
    v = verdict(ranks)
    assert v is not None and v.kind == "compute" and v.rank is None and v.node is None, v


@pytest.mark.parametrize("seed", range(10))
def test_a_sleeping_loader_is_found_under_noise(seed: int) -> None:
    rng = random.Random(seed)
    slow = rng.randrange(8)
    ranks = [
        rank(r, data=(0.1 if r == slow else 0.002) * rng.uniform(0.9, 1.1),
             communication=0.01 if r == slow else 0.11 * rng.uniform(0.9, 1.1), wait=0 if r == slow else 0.1)
        for r in range(8)
    ]  # fmt: skip
    v = verdict(ranks)
    assert v is not None and (v.kind, v.rank) == ("data", slow), v

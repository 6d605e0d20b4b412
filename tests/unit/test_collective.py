"""The pure parts of gradient rerouting: plan parsing, bucketing, divisor bookkeeping, budgets."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._C._distributed_c10d import GradBucket  # what torch.distributed.GradBucket is

from clusterpulse.wire import Plan
from trainer.collective import ReroutedAllReduce, ddp_comm_hook
from trainer.route import PlanError, Route, StepBudget, exact_count_limit, parse_plan, plan_buckets, reduce_dtype


def _plan(
    participants: list[int],
    proxies: dict[str, int] | None = None,
    excluded: list[int] | None = None,
    generation: int = 1,
) -> Plan:
    return Plan(
        job="j", generation=generation, participants=participants, proxies=proxies or {}, excluded=excluded or []
    )


# --- plans ------------------------------------------------------------------------------------


def test_parse_plan_roles() -> None:
    route = parse_plan(_plan([3, 0, 1], {"2": 3}, [4]), world_size=5)
    assert route == Route(job="j", generation=1, world_size=5, participants=(0, 1, 3), proxies=((2, 3),), excluded=(4,))
    assert [route.role(r) for r in range(5)] == ["participant", "participant", "degraded", "participant", "excluded"]
    assert route.carrier_of(2) == 3
    assert route.carrier_of(0) is None
    assert route.carried_by(3) == (2,)
    assert route.carried_by(0) == ()
    assert route.root == 0
    assert not route.trivial


def test_root_is_the_lowest_participant_when_rank_0_is_degraded() -> None:
    route = parse_plan(_plan([1, 2, 3], {"0": 1}), world_size=4)
    assert route.root == 1
    assert route.role(0) == "degraded"


def test_carrier_with_several_degraded_ranks_lists_them_in_order() -> None:
    route = parse_plan(_plan([0, 1], {"3": 0, "2": 0}), world_size=4)
    assert route.proxies == ((2, 0), (3, 0))
    assert route.carried_by(0) == (2, 3)


def test_full_plan_is_trivial() -> None:
    assert parse_plan(_plan([0, 1, 2, 3]), world_size=4).trivial


@pytest.mark.parametrize(
    ("plan", "needle"),
    [
        (_plan([0, 1, 2, 4]), "plan.participants: rank 4 is outside the world 0..3"),
        (_plan([0, 0, 1, 2, 3]), "plan.participants=[0, 0, 1, 2, 3]: a rank is listed twice"),
        (_plan([], excluded=[0, 1, 2, 3]), "plan.participants is empty"),
        (_plan([0, 1, 2], excluded=[-1]), "plan.excluded: rank -1 is outside"),
        (_plan([0, 1, 2], {"three": 0}), "plan.proxies: key 'three' is not a rank number"),
        (_plan([0, 1, 2], {"9": 0}), "plan.proxies: degraded rank 9 is outside"),
        (_plan([0, 1], {"3": 2}, [2]), "plan.proxies['3']=2: the carrier must be a participant"),
        (_plan([0, 1, 2, 3], {"2": 3}), "plan.participants and plan.proxies both hold ranks [2]"),
        (_plan([0, 1, 3], {"2": 3}, [2]), "plan.excluded and plan.proxies both hold ranks [2]"),
        (_plan([0, 1, 2, 3], excluded=[3]), "plan.participants and plan.excluded both hold ranks [3]"),
        (_plan([0, 1]), "plan: ranks [2, 3] have no role"),
    ],
)
def test_parse_plan_rejects_with_the_field(plan: Plan, needle: str) -> None:
    with pytest.raises(PlanError) as info:
        parse_plan(plan, world_size=4)
    assert needle in str(info.value)


def test_parse_plan_rejects_an_empty_world() -> None:
    with pytest.raises(PlanError, match="world_size=0"):
        parse_plan(_plan([0]), world_size=0)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_parse_plan_accepts_every_partition(data: st.DataObject) -> None:
    """Any assignment of roles with at least one participant and participant carriers is valid."""
    world = data.draw(st.integers(1, 12))
    roles = data.draw(st.lists(st.sampled_from(["p", "d", "x"]), min_size=world, max_size=world))
    roles[data.draw(st.integers(0, world - 1))] = "p"
    participants = [r for r in range(world) if roles[r] == "p"]
    proxies = {str(r): data.draw(st.sampled_from(participants)) for r in range(world) if roles[r] == "d"}
    excluded = [r for r in range(world) if roles[r] == "x"]
    route = parse_plan(_plan(participants, proxies, excluded), world_size=world)
    assert [route.role(r)[0] for r in range(world)] == [{"p": "p", "d": "d", "x": "e"}[x] for x in roles]
    assert sorted(d for c in participants for d in route.carried_by(c)) == sorted(int(k) for k in proxies)


# --- bucketing --------------------------------------------------------------------------------

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def test_buckets_fill_up_to_the_cap() -> None:
    # 4-byte elements, cap 40 bytes = 10 elements
    assert plan_buckets([(4, F32), (6, F32), (1, F32), (10, F32)], 40) == [[0, 1], [2], [3]]


def test_oversized_tensor_gets_its_own_bucket() -> None:
    assert plan_buckets([(1, F32), (100, F32), (1, F32)], 40) == [[0], [1], [2]]


def test_buckets_hold_one_dtype_and_keep_order() -> None:
    specs = [(2, F32), (2, F64), (2, F32), (2, BF16), (2, F64)]
    assert plan_buckets(specs, 1 << 20) == [[0, 2], [1, 4], [3]]


def test_bucket_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets([(1, F32)], 0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.sampled_from([F32, F64, BF16])), max_size=30),
    st.integers(1, 200),
)
def test_buckets_partition_the_tensors(specs: list[tuple[int, torch.dtype]], cap: int) -> None:
    buckets = plan_buckets(specs, cap)
    assert sorted(i for b in buckets for i in b) == list(range(len(specs)))
    for b in buckets:
        assert b == sorted(b)
        assert len({specs[i][1] for i in b}) == 1
        size = sum(specs[i][0] * specs[i][1].itemsize for i in b)
        assert size <= cap or len(b) == 1
    assert [b[0] for b in buckets] == sorted(b[0] for b in buckets)


# --- divisor bookkeeping ----------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "limit"), [(F32, 2**24), (F64, 2**53), (torch.float16, 2048), (BF16, 256)])
def test_exact_count_limit(dtype: torch.dtype, limit: int) -> None:
    assert exact_count_limit(dtype) == limit
    # summing contributor counts one by one, as a ring all-reduce would, stays exact up to the limit
    one = torch.ones((), dtype=dtype)
    below = torch.tensor(limit - 1, dtype=dtype)
    assert int(below + one) == limit
    assert int(torch.tensor(limit, dtype=dtype) + one) != limit + 1


def test_count_rides_in_the_bucket_dtype_unless_it_cannot_count_the_world() -> None:
    assert reduce_dtype(F32, 4096) == F32
    assert reduce_dtype(BF16, 256) == BF16
    assert reduce_dtype(BF16, 257) == F32
    assert reduce_dtype(torch.float16, 4096) == F32


def test_budget_is_shared_by_all_buckets_of_a_peer() -> None:
    budget = StepBudget(2.0)
    assert budget.remaining(7, now=100.0) == 2.0  # the first question starts the clock
    assert budget.remaining(7, now=101.5) == 0.5
    assert budget.remaining(9, now=101.5) == 2.0  # another peer has its own budget
    assert budget.remaining(7, now=103.0) == 0.0
    assert budget.remaining(9, now=104.0) == 0.0


# --- the object without a process group -------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"world_size": 0, "rank": 0}, "world_size=0"),
        ({"world_size": 4, "rank": 4}, "rank=4"),
        ({"world_size": 4, "rank": 0, "proxy_timeout_s": 0}, "proxy_timeout_s=0"),
        ({"world_size": 4, "rank": 0, "proxy_timeout_s": 10, "peer_timeout_s": 5}, "peer_timeout_s=5"),
        ({"world_size": 4, "rank": 0, "bucket_bytes": 0}, "bucket_bytes=0"),
    ],
)
def test_constructor_rejects_with_the_field(kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ReroutedAllReduce(**kwargs)


def test_before_any_plan_it_is_a_world_participant() -> None:
    reroute = ReroutedAllReduce(world_size=4, rank=2)
    assert reroute.role == "participant"
    assert reroute.generation is None
    assert reroute.participants_group is None
    reroute.switch(None)  # already in force: no collective, no process group needed
    reroute.allreduce_([])


def test_switch_rejects_an_invalid_plan_before_any_collective() -> None:
    reroute = ReroutedAllReduce(world_size=4, rank=0)
    with pytest.raises(PlanError, match="have no role"):
        reroute.switch(_plan([0, 1]))
    assert reroute.route is None


def test_hook_annotations_pass_ddps_check() -> None:
    """DDP compares the annotations to the objects themselves; this module uses PEP 563 strings."""
    sig = inspect.signature(ddp_comm_hook)
    assert sig.parameters["bucket"].annotation is GradBucket
    assert sig.return_annotation == torch.futures.Future[torch.Tensor]

"""PlanKeeper's exclusion triggers for a participant that died (services/plans/keeper.py), without I/O."""

from __future__ import annotations

from clusterpulse import wire
from services.plans.decide import PlannerPolicy, RankInfo
from services.plans.keeper import PlanKeeper


def keeper(nodes: list[str]) -> PlanKeeper:
    k = PlanKeeper(policy=PlannerPolicy(max_proxied_per_rank=1))
    for rank, node in enumerate(nodes):
        k.register(wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=rank, node=node, world_size=len(nodes)))
    return k


def test_a_node_whose_ranks_exited_has_them_excluded_once() -> None:
    k = keeper(["n0", "n1", "n2", "n3"])
    assert k.node_exited("j", "n2") == [2]
    assert k.node_exited("j", "n2") == []  # not news the second time
    assert k.excluded_nodes("j") == {"n2"}
    assert k.node_exited("j", "elsewhere") == [] and k.node_exited("other-job", "n1") == []


def test_rank_0_is_excluded_like_any_other_the_store_is_the_agents() -> None:
    k = keeper(["n0", "n1", "n2"])
    assert k.node_exited("j", "n0") == [0]  # agent/job_store.py hosts the store, not rank 0
    assert k.excluded_nodes("j") == {"n0"}
    k.register(wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=0, node="n0", world_size=3))
    assert k.excluded_nodes("j") == set()  # relaunched, it registered again


def test_a_node_counts_while_any_of_its_ranks_is_live() -> None:
    k = keeper(["n0", "n0", "n1", "n1"])
    k.rank_unreachable("j", 2)
    assert k.excluded_nodes("j") == set()
    k.rank_unreachable("j", 3)
    assert k.excluded_nodes("j") == {"n1"}


def test_a_rank_that_registers_again_counts_again() -> None:
    k = keeper(["n0", "n1"])
    k.node_exited("j", "n1")
    k.register(wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=1, node="n1", world_size=2))
    assert k.excluded_nodes("j") == set()


def test_a_registration_says_the_gpu_of_its_rank_and_a_restore_keeps_it() -> None:
    k = PlanKeeper(policy=PlannerPolicy(max_proxied_per_rank=1))
    reg = wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=1, node="n0", local_rank=1, world_size=2, gpu=2)
    assert k.register(reg)
    assert k.ranks["j"][1] == RankInfo(rank=1, node="n0", gpu=2)
    assert not k.register(reg)  # the same again: nothing changed
    assert k.register(wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=1, node="n0", world_size=2, gpu=3))
    assert k.ranks["j"][1].gpu == 3  # a restarted rank on another GPU: the map changed
    k.register(wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=0, node="n0", world_size=2))
    assert k.ranks["j"][0] == RankInfo(rank=0, node="n0", gpu=None)  # its launcher did not say

    after = PlanKeeper(policy=PlannerPolicy(max_proxied_per_rank=1))  # an orchestrator restarted
    after.restore(ranks={"j": {r: (i.node, i.gpu) for r, i in k.ranks["j"].items()}}, plans={})
    assert after.ranks == {"j": {0: RankInfo(rank=0, node="n0"), 1: RankInfo(rank=1, node="n0", gpu=3)}}

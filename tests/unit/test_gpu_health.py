"""One bad GPU costs one rank (issue 35): health per GPU beside health per node, and plans per
rank. The pure functions of services/health/decide.py and services/plans/decide.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.daemon import NodeAgent
from agent.launcher import rank_env
from agent.nvml import NvmlSource
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.states import NodeState
from clusterpulse.wire import Plan
from services.cluster import Cluster, NodeView
from services.health.decide import (
    GpuTransition,
    NodeHealth,
    apply,
    apply_gpu,
    evaluate,
    evaluate_gpus,
    observe,
    own_state,
    rank_state,
    read,
)
from services.jobs.placement import Placement, PlacementRefusal, PlacementRequest, node_gpus, place
from services.operator import _capacity
from services.plans.decide import PlannerPolicy, PlanRefusal, RankInfo, plan
from services.plans.keeper import rank_states
from tests.fake_nvml import FakeGpu, FakeNvml
from tests.unit.test_health import P, gpu, hb, psu
from trainer.rank_gpu import rank_gpu

H, S, D, L = NodeState.HEALTHY, NodeState.SUSPECT, NodeState.DEGRADED, NodeState.LOST


def beat(node: NodeHealth, heartbeat: wire.Heartbeat, t: float) -> tuple[NodeHealth, list[GpuTransition]]:
    """One heartbeat at ``t``, then one evaluation, as services/cluster.py runs them."""
    node = observe(node, heartbeat, received_at=t, policy=P)
    tr = evaluate(node, now=t, grace_start=-1e9, partitioned=False, policy=P)
    if tr is not None:
        node = apply(node, tr)
    moved = evaluate_gpus(node, now=t, policy=P)
    for g in moved:
        node = apply_gpu(node, g)
    if node.gpus:
        node = replace(node, own=own_state(node, now=t, grace_start=-1e9, partitioned=False, policy=P))
    return node, moved


def xid(i: int, code: int = 79) -> wire.GpuSample:
    return gpu(i, xids_recent=(code,))


def board(*bad: wire.GpuSample, psus: list[wire.PsuSample] | None = None) -> wire.Heartbeat:
    """Eight GPUs, the ones given in place of the healthy ones at their index."""
    mine = {g.index: g for g in bad}
    return hb([mine.get(i, gpu(i)) for i in range(8)], psus)


def test_a_fault_of_one_gpu_degrades_that_gpu_and_the_node_shows_it() -> None:
    node, moved = beat(NodeHealth(name="n1"), board(), 0.0)
    assert moved == [] and node.gpus == ()
    node, moved = beat(node, board(xid(3)), 1.0)
    assert [(t.gpu, t.old, t.new) for t in moved] == [(3, H, D)]
    assert "GPU 3 fatal XID 79" in moved[0].reason
    assert node.state is D and "GPU 3 fatal XID 79" in node.reason  # the node shows the worst, naming the GPU
    assert [(g.index, g.state) for g in node.gpus] == [(3, D)]
    assert node.own is H  # nothing wrong with the node itself
    assert [rank_state(node, i) for i in range(8)] == [H, H, H, D, H, H, H, H]


def test_a_gpu_gone_from_the_bus_is_lost_and_its_peers_train_on() -> None:
    node, _ = beat(NodeHealth(name="n1"), board(xid(2)), 0.0)
    node, moved = beat(node, board(gpu(2, lost=True, error="GPU is lost")), 1.0)
    assert [(t.gpu, t.old, t.new) for t in moved] == [(2, D, L)]
    assert node.state is D  # a GPU lost is not the node lost: its agent and seven GPUs answer
    assert rank_state(node, 2) is L and rank_state(node, 0) is H and rank_state(node, None) is D


def test_a_gpu_recovers_after_recover_after_clean_heartbeats_like_the_node() -> None:
    node, _ = beat(NodeHealth(name="n1"), board(xid(5)), 0.0)
    t = 1.0
    for _ in range(P.recover_after - 1):
        node, moved = beat(node, board(), t)
        assert moved == [] and node.gpus[0].state is D
        t += 1
    node, moved = beat(node, board(), t)
    assert [(g.gpu, g.new) for g in moved] == [(5, H)] and "recover_after=3" in moved[0].reason
    assert node.gpus == () and node.own is None and node.state is H


def test_a_fault_of_the_node_itself_covers_every_gpu() -> None:
    sagging = [psu("PS1", 66.0), psu("PS2", 40.0)]
    node, _ = beat(NodeHealth(name="n1"), board(xid(1), psus=sagging), 0.0)
    assert node.state is D and node.own is D  # the PSU imbalance is the node's
    assert [rank_state(node, i) for i in range(3)] == [D, D, D]
    node, _ = beat(node, board(xid(1)), 1.0)  # the PSU back, GPU 1 still faulted
    assert node.own is H and [rank_state(node, i) for i in range(3)] == [H, D, H]


def test_a_silent_node_covers_its_gpus() -> None:
    node, _ = beat(NodeHealth(name="n1"), board(xid(4)), 0.0)
    silent_at = 0.0 + P.degraded_after + 1
    tr = evaluate(node, now=silent_at, grace_start=-1e9, partitioned=False, policy=P)
    assert tr is None  # already DEGRADED
    own = own_state(node, now=silent_at, grace_start=-1e9, partitioned=False, policy=P)
    assert own is D  # silence is the node's: every rank goes by it


def test_two_faults_on_one_gpu_are_one_transition_and_a_later_gpu_is_its_own() -> None:
    node, moved = beat(NodeHealth(name="n1"), board(gpu(6, xids_recent=(48,), ecc_volatile_uncorrected=2)), 0.0)
    assert len(moved) == 1 and "ECC" in moved[0].reason and "XID 48" in moved[0].reason
    node, moved = beat(node, board(gpu(6, ecc_volatile_uncorrected=2), gpu(0, pcie_link_width=8)), 1.0)
    assert [(t.gpu, t.new) for t in moved] == [(0, D)] and "x8 of x16" in moved[0].reason
    assert [g.index for g in node.gpus] == [0, 6]


# --- plans per rank ---------------------------------------------------------------------------------

TWO_NODES = [RankInfo(rank=r, node="A" if r < 4 else "B", gpu=r % 4) for r in range(8)]


def plan_for(
    ranks: Sequence[RankInfo], node_health: Mapping[str, NodeHealth], *, cap: int = 1, previous: Plan | None = None
) -> Plan | PlanRefusal:
    """What the plan keeper asks (services/plans/keeper.py): each rank's own state where its
    node's differs from it."""
    own = rank_states(ranks, node_health)
    return plan(
        job="j",
        ranks=ranks,
        labels={},
        health={n: h.state for n, h in node_health.items()},
        previous=previous,
        policy=PlannerPolicy(max_proxied_per_rank=cap),
        rank_health=own,
    )


def test_one_bad_gpu_of_eight_ranks_proxies_exactly_its_rank_on_its_own_node() -> None:
    a, _ = beat(NodeHealth(name="A"), board(xid(2)), 0.0)
    b, _ = beat(NodeHealth(name="B"), board(), 0.0)
    p = plan_for(TWO_NODES, {"A": a, "B": b})
    assert isinstance(p, Plan), p
    assert p.proxies == {"2": 3}  # its carrier: the next rank on the same node, over NVLink
    assert p.participants == [0, 1, 3, 4, 5, 6, 7] and p.excluded == []
    assert "rank 2 (node A, GPU 2) DEGRADED -> proxied by rank 3 (same node)" in p.reason
    a, _ = beat(a, board(gpu(2, lost=True)), 1.0)
    p2 = plan_for(TWO_NODES, {"A": a, "B": b}, previous=p)
    assert isinstance(p2, Plan) and p2.excluded == [2] and p2.proxies == {} and len(p2.participants) == 7
    assert "rank 2 (node A, GPU 2) LOST -> excluded" in p2.reason


def test_a_node_at_fault_itself_still_has_every_rank_carried_elsewhere() -> None:
    a, _ = beat(NodeHealth(name="A"), board(xid(2), psus=[psu("PS1", 66.0), psu("PS2", 40.0)]), 0.0)
    b, _ = beat(NodeHealth(name="B"), board(), 0.0)
    p = plan_for(TWO_NODES, {"A": a, "B": b})
    assert isinstance(p, Plan) and sorted(p.proxies) == ["0", "1", "2", "3"]
    assert all(c >= 4 for c in p.proxies.values())  # never on the node that is at fault


def test_ranks_without_a_known_gpu_go_by_their_node() -> None:
    a, _ = beat(NodeHealth(name="A"), board(xid(2)), 0.0)
    b, _ = beat(NodeHealth(name="B"), board(), 0.0)
    ranks = [RankInfo(rank=r.rank, node=r.node) for r in TWO_NODES]  # a launcher that said nothing
    p = plan_for(ranks, {"A": a, "B": b})
    assert isinstance(p, Plan) and sorted(p.proxies) == ["0", "1", "2", "3"]


@st.composite
def gpu_jobs(draw: st.DrawFn) -> tuple[list[RankInfo], dict[str, NodeHealth], int]:
    """2-4 nodes of 4 GPUs, one rank per GPU; some GPUs with a fault of their own, some nodes
    with a PSU fault."""
    nodes = [f"n{i}" for i in range(draw(st.integers(2, 4)))]
    health: dict[str, NodeHealth] = {}
    for n in nodes:
        bad = draw(st.lists(st.integers(0, 3), max_size=2, unique=True))
        lost = draw(st.sets(st.sampled_from(bad))) if bad else set()
        samples = [gpu(i, lost=True) if i in lost else xid(i) for i in bad]
        mine = {g.index: g for g in samples}
        psus = [psu("PS1", 66.0), psu("PS2", 40.0)] if draw(st.booleans()) and draw(st.booleans()) else None
        heartbeat = hb([mine.get(i, gpu(i)) for i in range(4)], psus)
        health[n], _ = beat(NodeHealth(name=n), heartbeat, 0.0)
    ranks = [RankInfo(rank=k * 4 + g, node=n, gpu=g) for k, n in enumerate(nodes) for g in range(4)]
    return ranks, health, draw(st.sampled_from((1, 2)))


@settings(max_examples=150, deadline=None)
@given(job=gpu_jobs())
def test_property_per_rank_plans(job: tuple[list[RankInfo], dict[str, NodeHealth], int]) -> None:
    """Every rank takes the role of its own state; a carrier is a participant, never on a bad GPU
    and never on a node at fault itself; a rank whose node has a participant with room is carried
    there."""
    ranks, health, cap = job
    result = plan_for(ranks, health, cap=cap)
    state = {r.rank: rank_state(health[r.node], r.gpu) for r in ranks}
    part = sorted(r for r, s in state.items() if s in (H, S))
    deg = sorted(r for r, s in state.items() if s is D)
    if isinstance(result, PlanRefusal):
        assert not part or len(deg) > len(part) * cap
        return
    assert result.participants == part
    assert sorted(int(k) for k in result.proxies) == deg
    assert result.excluded == sorted(r for r, s in state.items() if s is L)
    node_of = {r.rank: r.node for r in ranks}
    load: dict[int, int] = {}
    for c in result.proxies.values():
        assert state[c] in (H, S)
        load[c] = load.get(c, 0) + 1
    for k, c in sorted(result.proxies.items(), key=lambda kv: int(kv[0])):
        d = int(k)
        same = [p for p in part if node_of[p] == node_of[d] and load.get(p, 0) < cap]
        if same:  # a neighbour on its own node still had room at the end: it was nearer than any
            assert node_of[c] == node_of[d], (d, c, result.proxies)


# --- placement and launch ---------------------------------------------------------------------------


def _node_with_bad_gpu(gpus: int = 4, bad: int = 2) -> tuple[Cluster, NodeView]:
    """A cluster of one simulated node whose GPU ``bad`` reports XID 79, folded and evaluated as
    the orchestrator does (services/cluster.py)."""
    sim = SimulatedNode("g0", gpus=gpus)
    sim.aim("xid79", [bad])
    sim.faults.add("xid79")
    agent = NodeAgent(node="g0", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    c = Cluster(policy=P, grace_start=0.0)
    c.ingest(wire.encode(agent.heartbeat(sim.sample())), received_at=1.0)
    c.evaluate(now=1.0)
    return c, c.nodes["g0"]


def test_a_node_with_one_bad_gpu_of_four_takes_a_job_of_three_and_refuses_four_naming_it() -> None:
    c, view = _node_with_bad_gpu()
    assert view.health.state is D and view.health.own is H and c.gpus_changed
    cap = _capacity("g0", view, used=0, agents=True)
    assert (cap.state, cap.gpus, cap.bad_gpus) == ("HEALTHY", 3, ("GPU 2 DEGRADED",))
    assert place([cap], PlacementRequest(nodes=1, gpus_per_node=3)) == Placement(("g0",), "cluster")
    refused = place([cap], PlacementRequest(nodes=1, gpus_per_node=4))
    assert isinstance(refused, PlacementRefusal) and "3 GPUs free (GPU 2 DEGRADED), 4 needed" in refused.reason
    # the job's three ranks there drive GPUs 0, 1 and 3
    gpus = node_gpus(view.usable_gpus(), 3, any_bad=bool(view.health.gpus))
    assert gpus == [0, 1, 3]
    cmd = wire.JobCommand(v=wire.PROTOCOL_VERSION, kind="launch", job="j", gpus_per_node=3, gpus=gpus)
    envs = [rank_env(cmd, i, visible="0,1,2,3") for i in range(3)]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1,3"}
    assert [rank_gpu(e, int(e["LOCAL_RANK"])) for e in envs] == [0, 1, 3]  # what each rank registers


def test_a_node_at_fault_itself_takes_no_job_and_a_clean_node_launches_as_ever() -> None:
    assert node_gpus([0, 1, 2, 3], 4, any_bad=False) == []  # GPU i for local rank i: the launcher's default
    _, view = _node_with_bad_gpu()
    view.health = replace(view.health, own=D)  # a power supply of its own beside the bad GPU
    assert _capacity("g0", view, used=0, agents=True).state == "DEGRADED"


def test_one_gpu_throttling_for_heat_is_that_gpus_fault_and_a_power_brake_the_nodes() -> None:
    hot = board(gpu(1, throttle=("thermal",)))
    node, t = NodeHealth(name="n1"), 0.0
    while t <= P.throttle_sustain:
        node, _ = beat(node, hot, t)
        t += 1.0
    assert [(g.index, g.state) for g in node.gpus] == [(1, D)] and "GPU 1 thermal throttling for" in node.gpus[0].reason
    assert node.state is D and node.own is H  # the node shows it; its other GPUs' ranks train on
    braked = board(*(gpu(i, throttle=("power_brake",)) for i in range(8)))
    node, t = NodeHealth(name="n2"), 0.0
    while t <= P.throttle_sustain:
        node, _ = beat(node, braked, t)
        t += 1.0
    assert node.state is D and node.gpus == () and "throttling for" in node.reason  # the BMC's: the node's


def test_the_drivers_recovery_action_through_nvml_is_the_gpus_or_the_nodes() -> None:
    """NVML's recovery action (R550 drivers: NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), read by the
    agent's NVML source from a fake NVML at the hardware boundary: a GPU reset asked for is that
    GPU's fault; a node reboot is the node's; a driver that predates it is asked once."""
    fake = FakeNvml([FakeGpu(), FakeGpu(recovery_action=1), FakeGpu(recovery_action=None), FakeGpu()])
    src = NvmlSource(nvml=fake)
    src.open()
    try:
        samples = src.sample()
        assert [g.recovery_action for g in samples] == [0, 1, None, 0]
        reading = read(hb(samples), policy=P)
        assert reading.gpu_faults == ((1, "GPU 1: the driver asks for a GPU reset (NVML recovery action 1)"),)
        src.sample()
        assert fake.calls["nvmlDeviceGetFieldValues"] == 2 * 3 + 1  # GPU 2's driver: asked once
        fake.set(3, recovery_action=2)
        reading = read(hb(src.sample()), policy=P)
        assert "GPU 3: the driver asks for a node reboot (NVML recovery action 2)" in reading.faults
        assert [i for i, _ in reading.gpu_faults] == [1]  # the reboot is the node's: all its ranks go by it
    finally:
        src.close()

"""GPU resets (issue 35): which GPUs are due for one, when an operator's is refused, and what an
agent does with the command (services/health/gpu_reset.py, agent/gpu_reset.py, the simulator)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from agent.gpu_reset import ResetFailed, command_reset, handle_reset
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.states import NodeState
from services.health.decide import GpuHealth, Policy, read
from services.health.gpu_reset import due, refusal, running_on
from services.plans.decide import RankInfo
from tests.unit.test_health import hb


def test_a_gpu_bad_for_the_setting_is_due_once() -> None:
    g = GpuHealth(2, NodeState.DEGRADED, since=100.0, reason="GPU 2 fatal XID 79")
    assert due([g], now=150.0, after_s=60.0) == []
    [marked] = due([g], now=160.0, after_s=60.0)
    assert marked.reset_due and marked.index == 2
    assert due([marked], now=1000.0, after_s=60.0) == []  # reported once


def test_a_reset_is_refused_while_a_rank_drives_the_gpu_or_may() -> None:
    ranks = {
        "j1": [RankInfo(0, "n1", 0), RankInfo(1, "n1", 1), RankInfo(2, "n2", 0)],
        "j2": [RankInfo(0, "n1", None)],
        "j3": [RankInfo(0, "n2", 0)],  # placed on n1 too, nothing registered there yet
    }
    on, unknown = running_on("n1", 1, ranks, {})
    assert on == ["job j1 rank 1"] and unknown == ["j2", "j3"]
    assert running_on("n1", 1, ranks, {"j1": {1}})[0] == []  # excluded: it left
    why = refusal("n1", 1, present=[0, 1, 2, 3], on=on, unknown=[])
    assert why == "GPU 1 of n1 runs job j1 rank 1: a reset would take it from under the rank"
    why = refusal("n1", 1, present=[0, 1, 2, 3], on=[], unknown=["j2"])
    assert why is not None and "job j2 runs on n1" in why
    assert refusal("n1", 7, present=[0, 1], on=[], unknown=[]) == "node n1 has no GPU 7 (its GPUs: 0, 1)"
    assert refusal("n1", 1, present=[0, 1], on=[], unknown=[]) is None


def test_a_simulated_reset_clears_what_a_reset_clears_and_only_on_its_gpu() -> None:
    sim = SimulatedNode("n1", gpus=4)
    sim.aim("gpu_lost", [2])
    sim.aim("pcie_x8", [1])
    sim.faults |= {"gpu_lost", "pcie_x8"}
    before = read(hb(sim.sample()), policy=Policy())
    assert {i for i, _ in before.gpu_faults} == {1, 2} and before.gpus_lost == (2,)
    assert "cleared: gpu_lost" in sim.reset(2)
    assert "cleared: nothing" in sim.reset(1)  # a narrow link is no reset's to fix
    after = read(hb(sim.sample()), policy=Policy())
    assert {i for i, _ in after.gpu_faults} == {1} and after.gpus_lost == ()
    with pytest.raises(ValueError, match="no GPU 9"):
        sim.reset(9)


def _cmd(request: str, gpus: list[int]) -> wire.JobCommand:
    return wire.JobCommand(
        v=wire.PROTOCOL_VERSION, kind="reset", job=f"gpu-reset-{request}", request=request, gpus=gpus
    )


def test_an_agent_resets_once_per_request_and_says_why_it_could_not(tmp_path: Path) -> None:
    calls: list[int] = []

    def reset(index: int) -> str:
        calls.append(index)
        return "ok"

    run = asyncio.run
    assert run(handle_reset(_cmd("r1", [3]), node="n1", state_dir=tmp_path, reset=reset))
    assert not run(handle_reset(_cmd("r1", [3]), node="n1", state_dir=tmp_path, reset=reset))  # read again
    assert calls == [3]
    assert not run(handle_reset(_cmd("r2", [3]), node="n1", state_dir=tmp_path, reset=None))

    def broken(index: int) -> str:
        raise ResetFailed("nvidia-smi: GPU in use")

    assert not run(handle_reset(_cmd("r3", [0]), node="n1", state_dir=tmp_path, reset=broken))


def test_the_reset_command_runs_with_the_index_and_a_failure_names_the_command() -> None:
    ok = command_reset(f"{sys.executable} -c 'import sys; print(\"reset\", sys.argv[1])' {{index}}")
    assert ok(5) == "reset 5"
    failing = command_reset(f"{sys.executable} -c 'import sys; sys.exit(3)' {{index}}")
    with pytest.raises(ResetFailed, match="exited 3"):
        failing(1)
    with pytest.raises(ResetFailed, match="no-such-nvidia-smi"):
        command_reset("no-such-nvidia-smi -r -i {index}")(0)

"""Gradient rerouting on real gloo process groups: 4 CPU ranks as separate processes.

Each world runs this file as a script (``python test_collective_gloo.py SCENARIO RANK OUT``); a rank
writes what it saw to ``OUT/rankN.json`` and the tests assert on those files. Faults are real: the
degraded rank SIGSTOPs or SIGKILLs itself in the middle of a step, between two buckets.

One world ("plans") runs the fault-free scenarios one after another, so the tests (a)-(e) share
the cost of starting 4 interpreters; the hang and kill scenarios get a world each.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests import gloo
from tests.gloo import plan
from trainer.collective import ReroutedAllReduce, ddp_comm_hook

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
ALL = list(range(WORLD))
PROXY_TIMEOUT_S = 2.0
SLACK_S = 3.0  # process scheduling on a small CI box; the step itself is milliseconds
# 4 buckets: [t0, t1] (2264 B), [t2] (6400 B, over the cap), [t3] (168 B), [t4] (float64)
SHAPES = [(33, 17), (5,), (40, 40), (7, 3, 2)]
BUCKET_BYTES = 4096
N_BUCKETS = 4


DEGRADED_2 = plan(1, [0, 1, 3], {"2": 3})
EXCLUDED_1 = plan(2, [0, 2, 3], excluded=[1])
SWITCH_FROM = plan(3, [0, 1, 3], {"2": 3})
SWITCH_TO = plan(4, [0, 2, 3], {"1": 0})
SWITCH_SEEN_AT = {0: 3, 1: 1, 2: 5, 3: 2}  # the step at which each rank first reads SWITCH_TO; rank 0's wins
DDP_PLAN = plan(5, [0, 1, 3], {"2": 3})
DDP_STEPS = 5
LAST_NUMEL = 16 << 20  # 64 MB of float32: more than the sockets buffer, so the send outlasts the step
AFTER_FAULT = plan(2, [0, 1, 3], excluded=[2])


# --- what every rank can compute for every rank ---------------------------------------------------


def make_grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tensors = [torch.randn(s, generator=g) for s in SHAPES]
    return [*tensors, torch.randn(13, generator=g, dtype=torch.float64)]


def mean_of(ranks: list[int], step: int) -> list[torch.Tensor]:
    per_rank = [make_grads(r, step) for r in ranks]
    return [torch.stack(ts).sum(0) / len(ranks) for ts in zip(*per_rank, strict=True)]


def max_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def stock_mean(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [t.clone() for t in tensors]
    for t in out:
        dist.all_reduce(t)
    return [t / WORLD for t in out]


# --- the ranks ------------------------------------------------------------------------------------


class FaultyReroute(ReroutedAllReduce):
    """A degraded rank that stops or dies instead of sending bucket ``at_bucket`` of step ``at_step``."""

    def __init__(self, *, fault: str, at_step: int, at_bucket: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault, self.at_step, self.at_bucket = fault, at_step, at_bucket
        self.step = 0
        self.sent: list[dist.Work] = []

    def _send_to_carrier(self, flat: torch.Tensor, carrier: int, group: dist.ProcessGroup) -> dist.Work:
        if self.step == self.at_step and len(self.sent) == self.at_bucket:
            for work in self.sent:  # what was sent before the fault is on the wire
                work.wait()
            os.kill(os.getpid(), signal.SIGSTOP if self.fault == "stop" else signal.SIGKILL)
        work = super()._send_to_carrier(flat, carrier, group)
        self.sent.append(work)
        return work


def scenario_plans(rank: int) -> dict[str, Any]:
    r = ReroutedAllReduce(world_size=WORLD, rank=rank, proxy_timeout_s=10.0, bucket_bytes=BUCKET_BYTES)
    out: dict[str, Any] = {}

    g = make_grads(rank, 0)
    stock = stock_mean(g)
    r.allreduce_(g)
    out["fast"] = {"err": max_err(g, stock), "contributors": r.last_contributors}

    # (e) membership, (a) exactness with a degraded rank
    r.switch(DEGRADED_2)
    group = r.participants_group
    out["member"] = {
        "role": r.role,
        "group_rank": -1 if group is None else dist.get_rank(group),
        "group_ranks": None if group is None else dist.get_process_group_ranks(group),
    }
    errs = []
    for step in (1, 2, 3):
        g = make_grads(rank, step)
        stock = stock_mean(g)  # every rank is alive, so the stock world all-reduce still works
        r.allreduce_(g)
        errs.append(max(max_err(g, stock), max_err(g, mean_of(ALL, step))))
    out["degraded"] = {"errs": errs, "contributors": r.last_contributors, "missing": sorted(r.missing)}

    # (c) an excluded rank
    r.switch(EXCLUDED_1)
    g = make_grads(rank, 10)
    r.allreduce_(g)
    out["excluded"] = {
        "err_mean3": max_err(g, mean_of([0, 2, 3], 10)),
        "err_own": max_err(g, make_grads(rank, 10)),
        "contributors": r.last_contributors,
    }

    # (d) a plan switch that ranks read at different steps, applied at one step boundary
    r.switch(SWITCH_FROM)
    changed_at = None
    gens, agreed, errs = [], [], []
    for step in range(6):
        proposal = SWITCH_TO if step >= SWITCH_SEEN_AT[rank] else SWITCH_FROM
        before = r.generation
        r.switch(r.agree_plan(proposal))
        if r.generation != before and changed_at is None:
            changed_at = step
        gens.append(r.generation)
        agreed.append(r.agree_generation(100 + rank))
        g = make_grads(rank, 20 + step)
        r.allreduce_(g)
        errs.append(max_err(g, mean_of(ALL, 20 + step)))
    out["switch"] = {"changed_at": changed_at, "generations": gens, "agreed": agreed, "errs": errs}

    # (b) DDP with the hook and a degraded rank against stock DDP
    r.switch(None)
    stock_params, _ = train_ddp(rank, None)
    r.switch(DDP_PLAN)
    hooked_params, initial = train_ddp(rank, r)
    out["ddp"] = {
        "err": max_err(stock_params, hooked_params),
        "moved": max_err(stock_params, initial),
        "contributors": r.last_contributors,
        "missing": sorted(r.missing),
    }

    # (f) the job's last step, a big bucket still on its way from the carrier when the step returns:
    # flushed before the rank leaves (destroy_process_group closes the pair under the receive)
    big = [torch.full((LAST_NUMEL,), float(rank))]
    r.allreduce_(big)
    r.flush()
    # a sample: the bucket arrives whole or not at all, and the carrier must not linger here
    out["last"] = {"err": float((big[0][::4099] - sum(ALL) / WORLD).abs().max()), "missing": sorted(r.missing)}
    return out


def train_ddp(rank: int, reroute: ReroutedAllReduce | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    initial = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)  # about 2 KB: several buckets
    if reroute is not None:
        ddp.register_comm_hook(state=reroute, hook=ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        torch.autograd.backward(nn.functional.mse_loss(ddp(x), y))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], initial


def scenario_fault(rank: int, fault: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "world_size": WORLD,
        "rank": rank,
        "proxy_timeout_s": PROXY_TIMEOUT_S,
        "bucket_bytes": BUCKET_BYTES,
    }
    at_bucket = 0 if fault == "stop" else 1
    r = (
        FaultyReroute(fault=fault, at_step=1, at_bucket=at_bucket, **kwargs)
        if rank == 2
        else ReroutedAllReduce(**kwargs)
    )
    r.switch(DEGRADED_2)
    g = make_grads(rank, 0)
    r.allreduce_(g)
    out: dict[str, Any] = {"before": {"err": max_err(g, mean_of(ALL, 0)), "contributors": r.last_contributors}}
    if isinstance(r, FaultyReroute):
        r.step, r.sent = 1, []
    g = make_grads(rank, 1)
    t0 = time.monotonic()
    r.allreduce_(g)  # rank 2 never comes back from here
    elapsed = time.monotonic() - t0
    # Each bucket is averaged over the ranks that contributed to it: 4, or 3 once rank 2 is gone.
    buckets = _bucket_errors(g, r.last_contributors, step=1)
    out["fault"] = {
        "elapsed_s": elapsed,
        "contributors": r.last_contributors,
        "bucket_errs": buckets,
        "missing": {str(k): v for k, v in r.missing.items()},
    }
    r.switch(AFTER_FAULT)  # the orchestrator's next plan; rank 2 does not take part
    g = make_grads(rank, 2)
    t0 = time.monotonic()
    r.allreduce_(g)
    out["after"] = {
        "elapsed_s": time.monotonic() - t0,
        "err": max_err(g, mean_of([0, 1, 3], 2)),
        "contributors": r.last_contributors,
    }
    return out


def _bucket_errors(got: list[torch.Tensor], contributors: list[int], *, step: int) -> list[float]:
    """Per bucket (see SHAPES), the error against the mean over the ranks its divisor says contributed."""
    buckets = [[0, 1], [2], [3], [4]]
    means = {4: mean_of(ALL, step), 3: mean_of([0, 1, 3], step)}
    errs = []
    for indexes, count in zip(buckets, contributors, strict=True):
        expected = means.get(count)
        errs.append(
            float("inf") if expected is None else max_err([got[i] for i in indexes], [expected[i] for i in indexes])
        )
    return errs


def worker(scenario: str, rank: int, out_dir: Path) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    result = scenario_plans(rank) if scenario == "plans" else scenario_fault(rank, scenario)
    gloo.write_result(out_dir, rank, result)
    # Leave at once, as trainer.run's ranks do (os._exit: no teardown, whose destructors would
    # finish the sends still queued).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- the tests ------------------------------------------------------------------------------------


def run_world(scenario: str, out_dir: Path, *, ranks: list[int], timeout: float) -> dict[int, dict[str, Any]]:
    return gloo.run_world(__file__, scenario, out_dir, world=WORLD, ranks=ranks, timeout=timeout)


@pytest.fixture(scope="module")
def plans_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, dict[str, Any]]]:
    yield run_world("plans", tmp_path_factory.mktemp("plans"), ranks=ALL, timeout=50)


def test_no_plan_is_a_stock_world_allreduce(plans_world: dict[int, dict[str, Any]]) -> None:
    for rank, out in plans_world.items():
        assert out["fast"]["err"] < 1e-6, rank
        assert out["fast"]["contributors"] == [WORLD] * N_BUCKETS


def test_degraded_rank_gives_the_stock_average(plans_world: dict[int, dict[str, Any]]) -> None:
    """(a) plan participants [0, 1, 3], proxies {2: 3}: every rank, rank 2 included, gets mean over 4."""
    for rank, out in plans_world.items():
        assert max(out["degraded"]["errs"]) < 1e-6, (rank, out["degraded"])
        assert out["degraded"]["contributors"] == [WORLD] * N_BUCKETS
        assert out["degraded"]["missing"] == []


def test_degraded_rank_is_not_in_the_participants_group(plans_world: dict[int, dict[str, Any]]) -> None:
    """(e)"""
    assert plans_world[2]["member"] == {"role": "degraded", "group_rank": -1, "group_ranks": None}
    for rank in (0, 1, 3):
        member = plans_world[rank]["member"]
        assert member["role"] == "participant"
        assert member["group_ranks"] == [0, 1, 3]
        assert member["group_rank"] == [0, 1, 3].index(rank)


def test_excluded_rank_contributes_nothing(plans_world: dict[int, dict[str, Any]]) -> None:
    """(c) plan excluded [1]: ranks 0, 2, 3 get the mean over themselves; rank 1 keeps its own."""
    for rank in (0, 2, 3):
        assert plans_world[rank]["excluded"]["err_mean3"] < 1e-6, rank
        assert plans_world[rank]["excluded"]["contributors"] == [3] * N_BUCKETS
    assert plans_world[1]["excluded"]["err_own"] == 0.0


def test_plan_switch_happens_at_the_same_step_everywhere(plans_world: dict[int, dict[str, Any]]) -> None:
    """(d) ranks read generation 4 at steps 1..5; rank 0 (the root) at step 3, so all switch at 3."""
    switches = {rank: out["switch"] for rank, out in plans_world.items()}
    assert {s["changed_at"] for s in switches.values()} == {SWITCH_SEEN_AT[0]}
    for s in switches.values():
        assert s["generations"] == [3, 3, 3, 4, 4, 4]
        assert s["agreed"] == [100] * 6  # the root's proposal, on the degraded ranks too
        assert max(s["errs"]) < 1e-6


def test_ddp_hook_with_a_degraded_rank_matches_stock_ddp(plans_world: dict[int, dict[str, Any]]) -> None:
    """(b) K=5 SGD steps: parameters equal the fault-free stock DDP run on every rank."""
    for rank, out in plans_world.items():
        assert out["ddp"]["moved"] > 1e-3, "the model did not train: the comparison would be vacuous"
        assert out["ddp"]["err"] < 1e-5, (rank, out["ddp"])
        assert len(out["ddp"]["contributors"]) > 1, "expected several DDP buckets"
        assert set(out["ddp"]["contributors"]) == {WORLD}


def test_a_carrier_delivers_the_last_steps_bucket_before_it_leaves(plans_world: dict[int, dict[str, Any]]) -> None:
    """(f) The degraded rank gets the last step's average though its carrier leaves right after."""
    for rank, out in plans_world.items():
        assert out["last"] == {"err": 0.0, "missing": []}, rank


def _assert_survived(results: dict[int, dict[str, Any]], *, lost_after_bucket: int) -> None:
    for rank, out in results.items():
        assert out["before"]["err"] < 1e-6
        fault = out["fault"]
        assert fault["elapsed_s"] < PROXY_TIMEOUT_S + SLACK_S, (rank, fault)
        contributors = fault["contributors"]
        assert len(contributors) == N_BUCKETS
        assert all(c == 3 for c in contributors[lost_after_bucket:]), (rank, contributors)
        assert max(fault["bucket_errs"]) < 1e-6, (rank, fault)
        assert out["after"]["err"] < 1e-6
        assert out["after"]["contributors"] == [3] * N_BUCKETS
        assert out["after"]["elapsed_s"] < SLACK_S
    assert list(results[3]["fault"]["missing"]) == ["2"]  # the carrier noticed ...
    assert results[0]["fault"]["missing"] == results[1]["fault"]["missing"] == {}  # ... nobody else had to


def test_hung_degraded_rank_costs_at_most_the_proxy_timeout(tmp_path: Path) -> None:
    """(f) rank 2 SIGSTOPs itself at the start of a step: the others finish it over 3 ranks."""
    results = run_world("stop", tmp_path, ranks=[0, 1, 3], timeout=40)
    _assert_survived(results, lost_after_bucket=0)
    assert results[3]["fault"]["elapsed_s"] >= PROXY_TIMEOUT_S * 0.9  # it did wait for rank 2


def test_killed_degraded_rank_mid_step(tmp_path: Path) -> None:
    """(g) rank 2 sends its first bucket, then is SIGKILLed: buckets after it are averaged over 3."""
    results = run_world("kill", tmp_path, ranks=[0, 1, 3], timeout=40)
    _assert_survived(results, lost_after_bucket=1)
    for out in results.values():
        assert out["fault"]["contributors"][0] in (3, 4)  # 4 when bucket 0 was read before the reset


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))

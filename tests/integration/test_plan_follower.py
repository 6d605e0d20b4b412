"""Trainers following the orchestrator's plans (trainer/follow.py) on real Redis and real gloo.

In-process tests use a one-rank gloo world to check the reading side: plans from the Redis key,
the channel waking the reader, malformed or foreign plans counted and never raised, Redis down.
The 4-rank world (this file run as a script per rank) checks the switching side: the test
process plays the orchestrator, publishing generations while the ranks train, and every rank
must put each generation in force at the same step, with exact gradients throughout.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import torch.distributed as dist

from clusterpulse import wire
from tests import gloo
from tests.support import REDIS_URL, free_port, is_cluster, redis_client, wait_for
from trainer.collective import ReroutedAllReduce
from trainer.follow import PlanFollower

pytestmark = [pytest.mark.timeout(90), pytest.mark.two_redis]

JOB = "follow"
WORLD = 4
STEP_KEY = "test:follow:step"  # rank 0 writes the step it finished, so the test can publish mid-run
STEP_S = 0.05  # "compute" per step
SHAPES = [(33, 17), (40, 40), (5,)]
GEN1 = wire.Plan(job=JOB, generation=1, participants=[0, 1, 3], proxies={"2": 3}, excluded=[], reason="n2 DEGRADED")
GEN2 = wire.Plan(job=JOB, generation=2, participants=[0, 1, 2, 3], proxies={}, excluded=[], reason="n2 HEALTHY")
STEPS_AFTER_GEN2 = 5
MAX_STEPS = 600


def publish(client: redis.Redis, plan: wire.Plan | bytes, job: str = JOB) -> None:
    client.set(wire.job_plan_key(job), plan if isinstance(plan, bytes) else wire.encode(plan))
    client.publish(wire.PLAN_CHANNEL, job)


# --- one rank, in process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_world() -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def follower(one_rank_world: None, redis_url: str) -> Iterator[PlanFollower]:
    reroute = ReroutedAllReduce(world_size=1, rank=0, proxy_timeout_s=2.0)
    f = PlanFollower(
        job=JOB, reroute=reroute, redis_url=redis_url, redis_cluster=is_cluster(redis_url), poll_s=30.0
    )  # only the channel wakes it
    yield f
    f.close()


def only(job: str = JOB, generation: int = 1) -> wire.Plan:
    return wire.Plan(job=job, generation=generation, participants=[0], proxies={}, excluded=[], reason="test")


def test_a_published_plan_comes_into_force_at_the_next_boundary(follower: PlanFollower, redis_url: str) -> None:
    client = redis_client(redis_url)
    assert follower.boundary() is None and follower.reroute.generation is None
    time.sleep(0.2)  # let the reader subscribe; the notification below must wake it, not the 30 s poll
    publish(client, only(generation=3))
    wait_for(lambda: follower.latest is not None, timeout=15, what="the channel to wake the reader")
    assert follower.reroute.generation is None  # read, but not in force before a boundary
    assert follower.boundary() == only(generation=3)
    assert follower.reroute.generation == 3 and follower.switches == 1
    assert follower.boundary() is None  # nothing new
    client.close()


def test_malformed_foreign_and_older_plans_are_counted_not_raised(follower: PlanFollower, redis_url: str) -> None:
    client = redis_client(redis_url)
    publish(client, only(generation=5))
    wait_for(lambda: follower.latest is not None, timeout=15, what="generation 5")
    publish(client, b'{"job": "follow", "generation": "six"}')
    wait_for(lambda: follower.rejected == 1, timeout=15, what="the malformed plan counted")
    for _ in range(3):  # read again at each notification: the same value is not counted again
        client.publish(wire.PLAN_CHANNEL, JOB)
    time.sleep(0.3)
    assert follower.rejected == 1
    client.set(wire.job_plan_key(JOB), wire.encode(only(job="other", generation=9)))  # a copy under the wrong key
    client.publish(wire.PLAN_CHANNEL, JOB)
    wait_for(lambda: follower.rejected == 2, timeout=15, what="the foreign plan counted")
    publish(client, only(generation=4))  # older than what was read: ignored, not rejected
    time.sleep(0.3)
    latest = follower.latest
    assert latest is not None and latest.generation == 5 and follower.rejected == 2
    assert follower.boundary() == only(generation=5)
    client.close()


def test_an_unusable_plan_is_refused_once_and_the_old_one_stays(
    follower: PlanFollower, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis_client(redis_url)
    publish(client, only(generation=1))
    wait_for(lambda: follower.latest is not None, timeout=15, what="generation 1")
    assert follower.boundary() is not None
    bigger = wire.Plan(job=JOB, generation=2, participants=[0, 1], proxies={}, excluded=[], reason="world of 2")
    publish(client, bigger)
    wait_for(lambda: (p := follower.latest) is not None and p.generation == 2, timeout=15, what="generation 2")
    with caplog.at_level(logging.ERROR, logger="pulse.trainer.follow"):
        assert follower.boundary() is None
        assert follower.boundary() is None
    assert follower.reroute.generation == 1
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # refused once, not per step
    assert "event=plan_unusable" in caplog.records[0].message and "generation=2" in caplog.records[0].message
    client.close()


def test_redis_down_keeps_the_plan_in_force_and_never_blocks(one_rank_world: None) -> None:
    reroute = ReroutedAllReduce(world_size=1, rank=0, proxy_timeout_s=2.0)
    f = PlanFollower(job=JOB, reroute=reroute, redis_url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)
    try:
        started = time.monotonic()
        for _ in range(20):
            assert f.boundary() is None
        assert time.monotonic() - started < 1.0
        assert f.latest is None and reroute.generation is None and f.thread.is_alive()
    finally:
        f.close()


def test_bad_arguments_name_the_value(one_rank_world: None) -> None:
    reroute = ReroutedAllReduce(world_size=1, rank=0)
    with pytest.raises(ValueError, match="poll_s=0"):
        PlanFollower(job=JOB, reroute=reroute, redis_url=REDIS_URL, poll_s=0)
    with pytest.raises(ValueError, match="every=0"):
        PlanFollower(job=JOB, reroute=reroute, redis_url=REDIS_URL, every=0)


# --- four ranks -------------------------------------------------------------------------------------


def grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def mean_all(step: int) -> list[torch.Tensor]:
    per_rank = [grads(r, step) for r in range(WORLD)]
    return [torch.stack(ts).mean(0) for ts in zip(*per_rank, strict=True)]


def scenario_follow(rank: int, redis_url: str) -> dict[str, Any]:
    reroute = ReroutedAllReduce(world_size=WORLD, rank=rank, proxy_timeout_s=5.0, bucket_bytes=4096)
    follower = PlanFollower(
        job=JOB, reroute=reroute, redis_url=redis_url, redis_cluster=is_cluster(redis_url), poll_s=0.05
    )
    client = redis_client(redis_url)
    generations: list[int | None] = []
    roles: list[str] = []
    errs: list[float] = []
    member_of_participants: dict[int, bool] = {}
    step = 0
    while step < MAX_STEPS:
        step += 1
        time.sleep(STEP_S)
        g = grads(rank, step)
        reroute.allreduce_(g)
        errs.append(max(float((a - b).abs().max()) for a, b in zip(g, mean_all(step), strict=True)))
        changed = follower.boundary()
        if changed is not None:
            member_of_participants[changed.generation] = reroute.participants_group is not None
        generations.append(reroute.generation)
        roles.append(reroute.role)
        if rank == 0:
            client.set(STEP_KEY, step)
        if generations.count(2) >= STEPS_AFTER_GEN2:  # agreed, so every rank stops at the same step
            break
    follower.close()
    client.close()
    return {
        "generations": generations,
        "roles": roles,
        "max_err": max(errs),
        "member": {str(k): v for k, v in member_of_participants.items()},
        "rejected": follower.rejected,
    }


def test_every_rank_switches_at_the_same_step_with_exact_gradients(redis_url: str, tmp_path: Path) -> None:
    client = redis_client(redis_url)

    def step_reached(n: int) -> bool:
        raw = client.get(STEP_KEY)
        return raw is not None and int(raw) >= n

    with ThreadPoolExecutor(1) as pool:  # the world runs while this thread plays the orchestrator
        world = pool.submit(
            gloo.run_world, __file__, "follow", tmp_path, world=WORLD, ranks=list(range(WORLD)), timeout=70,
            env={"PULSE_TEST_FOLLOW_REDIS": redis_url},
        )  # fmt: skip
        wait_for(lambda: step_reached(5) or world.done(), timeout=60, what="the ranks to train 5 steps")
        publish(client, GEN1)
        wait_for(lambda: step_reached(25) or world.done(), timeout=30, what="25 steps")
        publish(client, GEN2)
        results = world.result(80)
    client.close()

    gens = {rank: out["generations"] for rank, out in results.items()}
    assert len({tuple(g) for g in gens.values()}) == 1, gens  # the same generation at every step, every rank
    seq = gens[0]
    first1, first2 = seq.index(1), seq.index(2)
    assert 5 <= first1 < first2, seq  # generation 1 came mid-run, generation 2 after it
    assert set(seq[:first1]) == {None} and set(seq[first1:first2]) == {1} and set(seq[first2:]) == {2}
    assert results[2]["roles"][first1] == "degraded" and results[2]["roles"][first2] == "participant"
    # under generation 1 rank 2 is out of the participants' group; generation 2 is trivial (no group at all)
    assert [results[r]["member"]["1"] for r in range(WORLD)] == [True, True, False, True]
    for rank, out in results.items():
        assert out["max_err"] < 1e-6, (rank, out["max_err"])  # every step averaged over all 4
        assert out["rejected"] == 0


if __name__ == "__main__":
    import os

    scenario, rank_arg, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", rank=rank_arg, world_size=WORLD, timeout=timedelta(seconds=30))
    gloo.write_result(out, rank_arg, scenario_follow(rank_arg, os.environ["PULSE_TEST_FOLLOW_REDIS"]))
    dist.destroy_process_group()

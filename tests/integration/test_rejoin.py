"""A rank that died comes back into the running world (trainer/follow.py ``join``) on real gloo and Redis.

Three ranks (this file run as a script per rank) train a toy model with the bounded collective
(``collective_timeout_s``), agreeing and making groups through the job's TCPStore as
``trainer.example`` does. The store is hosted by the test process, as the agent of the job's
first node hosts it (``agent/job_store.py``): every rank is its client
(``TORCHELASTIC_USE_AGENT_STORE``), so rank 0 can die too. The test process plays the
orchestrator: a rank dies mid-run (``os._exit``), the survivors' collective fails, the test
publishes a plan that excludes it (what the orchestrator does when the node's agent reports the
exit), the survivors recover and train on; then the test starts a *new* process for that rank (a
world of one for itself, a TCPStore client to the job's store, as a relaunched rank does), waits
for it to register and publishes a plan that counts on it again. At the next step boundary the
live ranks invite it, make the new groups with it and share the state of a rank that stayed (for
rank 0, which is the root again once back, not its own); from then on every rank steps with the
average over all three, and all end with identical weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, TCPStore

from clusterpulse import wire
from tests.support import REPO, free_port, wait_for
from trainer.collective import ReroutedAllReduce
from trainer.follow import PlanFollower, RecoveryError, forget_invitation
from trainer.rejoin import join

pytestmark = pytest.mark.timeout(150)

JOB = "rejoin"
WORLD = int(os.environ.get("PULSE_TEST_REJOIN_WORLD", "3"))  # the test passes its case's to the ranks
DIES_AT = 8  # the dying rank's first life ends after this many steps
STEP_S = 0.05
SHAPE = (64,)
STEPS_AFTER_JOIN = 6
MAX_STEPS = 2000
STEP_KEY = "test:rejoin:step"  # rank 0's last step, for the test's timing
REGISTERED_KEY = "test:rejoin:registered"  # the restarted rank says it is ready (its "registration")
REPORTED_KEY = "test:rejoin:reported"  # the ranks the survivors reported unreachable
BEAT_S = 0.2
COLLECTIVE_TIMEOUT_S = float(os.environ.get("PULSE_TEST_REJOIN_TIMEOUT_S", "2.0"))
SURVEY_S = {"exit": 3.0, "stop": 60.0}


def plan(
    generation: int, participants: list[int], excluded: list[int] | None = None, proxies: dict[str, int] | None = None
) -> wire.Plan:
    return wire.Plan(
        job=JOB,
        generation=generation,
        participants=participants,
        proxies=proxies or {},
        excluded=excluded or [],
        reason="test",
    )


def publish(client: redis.Redis, p: wire.Plan) -> None:
    client.set(wire.job_plan_key(JOB), wire.encode(p))
    client.publish(wire.PLAN_CHANNEL, JOB)


def grad(rank: int, step: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(1000 * step + rank))


def mean_over(ranks: list[int], step: int) -> torch.Tensor:
    return torch.stack([grad(r, step) for r in ranks]).mean(0)


# --- one rank (this file as a script) ----------------------------------------------------------------


def run_rank(rank: int, redis_url: str, *, rejoin: bool, dying: int, how: str) -> dict[str, Any]:
    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    if rejoin:
        forget_invitation(store, job=JOB, rank=rank)
    reroute = ReroutedAllReduce(
        world_size=WORLD, rank=rank, proxy_timeout_s=2.0, collective_timeout_s=COLLECTIVE_TIMEOUT_S, store=store
    )
    follower = PlanFollower(job=JOB, reroute=reroute, redis_url=redis_url, poll_s=0.05, beat_s=BEAT_S)
    client = redis.Redis.from_url(redis_url)
    weights = torch.zeros(SHAPE)
    header = torch.zeros(2, dtype=torch.float64)
    step = 0
    errors: list[float] = []
    joined_at: int | None = None
    gens: list[int | None] = []
    failed_after: float | None = None  # how long the collective that failed took

    def share_state(completed: int, src: int) -> int:
        """``src``'s last completed step and weights, on every live rank (``trainer.engine_state.take_state``)."""
        header[0] = float(completed)
        reroute.share_(header, src=src)
        reroute.share_(weights, src=src)
        return int(header[0].item())

    if rejoin:
        client.set(REGISTERED_KEY, "1")
        join(follower, timeout_s=60)
        step = share_state(0, follower.source)
        joined_at = step
        gens.append(reroute.generation)
    after_join = 1 if rejoin else 0
    while step < MAX_STEPS:
        step += 1
        time.sleep(STEP_S)
        if rank == dying and not rejoin and step == DIES_AT:  # mid-run, before this step's collective
            if how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # hung: the survivors' collective times out
            os._exit(17)
        g = grad(rank, step)
        began = time.monotonic()
        try:
            reroute.allreduce_([g])
            route = reroute.route
            live = list(range(WORLD)) if route is None else [r for r in range(WORLD) if r not in route.excluded]
            errors.append(float((g - mean_over(live, step)).abs().max()))
            weights -= 0.1 * g
            follower.boundary()
            if follower.joined:
                assert share_state(step, follower.source) == step
                joined_at = step
        except RecoveryError:
            raise
        except RuntimeError as exc:  # a peer died: skip the step, agree on a plan without it
            failed_after = time.monotonic() - began if failed_after is None else failed_after

            def report(missing: list[int]) -> None:
                client.set(REPORTED_KEY, json.dumps(missing))

            # a survey far longer than the test waits: a hung rank is reported from its still beat
            follower.recover(exc, report=report, survey_s=SURVEY_S[how], timeout_s=60)
            step = share_state(step - 1, follower.source)
            continue
        gens.append(reroute.generation)
        if rank == reroute.root:
            client.set(STEP_KEY, step)
        if joined_at is not None:
            after_join += 1
            if after_join > STEPS_AFTER_JOIN:
                break
    follower.close()
    client.close()
    return {
        "step": step,
        "joined_at": joined_at,
        "weights": weights.tolist(),
        "max_err": max(errors) if errors else None,
        "generations": gens,
        "failed_after_s": failed_after,
    }


# --- the test: it plays the orchestrator ---------------------------------------------------------------


def start(rank: int, out: Path, env: dict[str, str], *, rejoin: bool) -> subprocess.Popen[bytes]:
    with (out / f"rank{rank}{'-rejoin' if rejoin else ''}.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-W", "error", __file__, str(rank), str(out), "rejoin" if rejoin else "first"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(out.glob("*.log")))


@pytest.mark.parametrize(
    "case",  # the dying rank, how it dies, the world's size, the collective timeout, survivors carried back
    [(0, "exit", 3, 2.0, False), (1, "stop", 3, 2.0, False), (3, "exit", 4, 20.0, False), (0, "exit", 2, 2.0, True)],
    ids=["rank0-exits", "rank1-hangs", "rank3-exits-of-4", "rank0-back-alone-carrying"],
)  # fmt: skip
def test_a_dead_rank_restarted_rejoins_the_running_world_with_the_live_state(
    redis_url: str, tmp_path: Path, case: tuple[int, str, int, float, bool]
) -> None:
    """A rank exits (or hangs: SIGSTOP, then it is SIGKILLed once reported) mid-run and is
    restarted. A hung rank is reported unreachable from its still liveness beat, within about the
    collective timeout, although the survivors' survey is a minute. No survivor of a dead rank
    waits out the collective timeout: in a world of 4, one survivor waits on another, not on the
    dead rank, and fails only once that one destroys the broken groups (trainer/collective.py).
    Carried back: the plan that counts on the restarted rank again has it as the only participant,
    every survivor degraded and carried by it (their nodes degraded meanwhile): the state comes from
    a survivor all the same, not from the restarted rank's fresh one."""
    dying, how, world, timeout_s, carried = case
    client = redis.Redis.from_url(redis_url)
    client.delete(STEP_KEY, REGISTERED_KEY, REPORTED_KEY, wire.job_plan_key(JOB))
    everyone = list(range(world))
    port = free_port()
    # the job's store, hosted outside every rank (as agent/job_store.py does on the first node)
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "PYTHONPATH": str(REPO),
        "PULSE_TEST_REJOIN_REDIS": redis_url,
        "PULSE_TEST_REJOIN_DYING": str(dying),
        "PULSE_TEST_REJOIN_HOW": how,
        "PULSE_TEST_REJOIN_WORLD": str(world),
        "PULSE_TEST_REJOIN_TIMEOUT_S": str(timeout_s),
    }
    others = [r for r in everyone if r != dying]
    procs = {r: start(r, tmp_path, env, rejoin=False) for r in everyone}
    new: subprocess.Popen[bytes] | None = None
    try:
        publish(client, plan(1, everyone))  # a trivial plan with bounded groups from the start
        if how == "stop":
            hung = psutil.Process(procs[dying].pid)
            wait_for(lambda: hung.status() == psutil.STATUS_STOPPED, timeout=60, what=f"rank {dying} to hang")
            stopped_at = time.monotonic()
            wait_for(lambda: client.get(REPORTED_KEY) is not None, timeout=30, what="the survivors' report")
            reported_s = time.monotonic() - stopped_at
            assert json.loads(client.get(REPORTED_KEY) or b"[]") == [dying]
            # the collective timeout, the beat standing still for 4 beats, a poll: far below the survey
            assert reported_s < timeout_s + 4 * BEAT_S + 3.0, reported_s
            procs[dying].kill()
        wait_for(lambda: procs[dying].poll() is not None, timeout=60, what=f"rank {dying} to die\n" + logs(tmp_path))
        assert procs[dying].returncode == (17 if how == "exit" else -signal.SIGKILL), logs(tmp_path)
        publish(client, plan(2, others, excluded=[dying]))  # the agent reported the rank's exit
        step_then = int(client.get(STEP_KEY) or 0)
        wait_for(
            lambda: int(client.get(STEP_KEY) or 0) >= step_then + 5,
            timeout=40,
            what=f"the survivors to train on without rank {dying}\n" + logs(tmp_path),
        )
        new = start(dying, tmp_path, env, rejoin=True)
        wait_for(lambda: client.get(REGISTERED_KEY) is not None, timeout=60, what=f"the new rank {dying} to register")
        # it registered again: the orchestrator counts on it
        publish(client, plan(3, [dying], proxies={str(r): dying for r in others}) if carried else plan(3, everyone))
        for p in [procs[r] for r in others] + [new]:
            assert p.wait(60) == 0, logs(tmp_path)
    finally:
        for p in [*procs.values(), *([new] if new else [])]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        client.close()
        del store

    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in everyone}
    joined = {r: results[r]["joined_at"] for r in everyone}
    assert len(set(joined.values())) == 1 and joined[0] > DIES_AT, joined  # the same boundary everywhere
    assert {r: results[r]["step"] for r in everyone} == {r: joined[0] + STEPS_AFTER_JOIN for r in everyone}
    # the state of a rank that stayed, then equal steps: identical weights, and not the zeros a
    # restarted rank starts with (a rejoined rank 0 is the root again but must not be the source)
    assert all(results[r]["weights"] == results[0]["weights"] for r in everyone)
    assert any(w != 0.0 for w in results[0]["weights"])
    for r in everyone:
        assert results[r]["max_err"] < 1e-6, results[r]  # every step averaged over the ranks alive in it
        assert results[r]["generations"][-1] == 3
    assert 2 in results[others[0]]["generations"]  # the survivors trained under the plan without it
    if how == "exit":  # nobody waited for the collective timeout: they saw a connection close
        failed_after = {r: results[r]["failed_after_s"] for r in others}
        assert all(t is not None and t < timeout_s / 2 for t in failed_after.values()), failed_after


if __name__ == "__main__":
    rank_arg, out_dir, mode = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    url = os.environ["PULSE_TEST_REJOIN_REDIS"]
    if mode == "rejoin":
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo", rank=rank_arg, world_size=WORLD, timeout=timedelta(seconds=30))
    result = run_rank(
        rank_arg,
        url,
        rejoin=mode == "rejoin",
        dying=int(os.environ["PULSE_TEST_REJOIN_DYING"]),
        how=os.environ["PULSE_TEST_REJOIN_HOW"],
    )
    (out_dir / f"rank{rank_arg}.json").write_text(json.dumps(result))
    os._exit(0)  # gloo threads of groups with a dead peer must not run interpreter finalization

"""What the trainer library costs a user's script, beside the stock script in the same invocation.

Two figures, on ``tests/fixtures/scripts/user_train.py`` (a script that never imports ClusterPulse;
its MLP widened with ``--width`` until a step takes at least ``--min-step-ms``):

- ``overhead_ratio``: nobody degraded. Worlds of ``--ranks`` gloo ranks train ``--steps`` steps,
  alternately (ABBA, ``--rounds`` pairs) as the stock script (``python train.py``, as ``torchrun``
  starts it) and under the library (``python -m trainer.run train.py`` with ``PULSE_REDIS_URL``
  and ``PULSE_JOB_ID`` set: reporting, a plan of generation 1 in force, survival on, the
  per-step checkpoint agreement). Each run's figure is the median time between rank 0's
  optimizer-step ends after ``--warmup`` steps (the script records them); the ratio is the median
  over pairs of library / stock. Target: at most 1.02 for a step of 50 ms or more.
- ``dead_rank_cost_s``: a real stack (orchestrator, ``--ranks`` ``pulse agent`` processes, Redis)
  runs the script as a job; one rank is SIGKILLed mid-run; the figure is the longest gap between
  a survivor's step ends around the kill minus that survivor's median step: what the dead rank
  cost it. Target: at most the collective timeout plus one step at ZeRO 0; at most 1 s plus one
  step at ZeRO 1-2 (``--stage``), where ``zero0_dead_rank_cost_s`` is ZeRO 0's figure from the
  same invocation.

Skipped unless ``PULSE_BENCH=1``. ``python -m tests.bench.test_library_cost`` prints one JSON object;
``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from clusterpulse import wire
from tests.stack import Stack, reports
from tests.support import REDIS_URL, REPO, free_port, pulse_env, wait_all, wait_for
from trainer.run import reroutable

SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "user_train.py"
CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 64,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1_000_000_000,
}


def config(stage: int) -> dict[str, Any]:
    """The job's DeepSpeed config at ZeRO ``stage``. At stages 1-2 both runs get the reduction the
    library needs (:func:`trainer.run.reroutable`: ``reduce_scatter`` off), so the ratio is the library's own
    cost (reporting, agreement, the optimizer-state copy every ``PULSE_ZERO_MIRROR_STEPS``), not
    that of DeepSpeed's other reduction."""
    return reroutable(CONFIG | {"zero_optimization": {"stage": stage}})


def _world(
    tmp: Path,
    *,
    name: str,
    ranks: int,
    steps: int,
    width: int,
    library: bool,
    stage: int = 0,
    extra: dict[str, str] | None = None,
) -> list[float]:
    """One world's run; rank 0's step-end times."""
    out = tmp / name
    out.mkdir()
    port = free_port()
    procs = []
    cfg = out / "ds.json"
    cfg.write_text(json.dumps(config(stage)))
    for rank in range(ranks):
        env = pulse_env(
            RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )  # fmt: skip
        if library:
            env |= {"PULSE_REDIS_URL": REDIS_URL, "PULSE_JOB_ID": name, "PULSE_NODE": f"bench-{rank}", **(extra or {})}
        argv = [str(SCRIPT), "--deepspeed_config", str(cfg), "--max-steps", str(steps), "--width", str(width)]
        argv += ["--backward", "engine"]
        argv += ["--out", str(out)]
        runner = ["-m", "trainer.run"] if library else []
        with (out / f"rank{rank}.log").open("wb") as log:
            procs.append(subprocess.Popen([sys.executable, *runner, *argv], env=env, stdout=log, stderr=log))
    wait_all(procs, timeout=600)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: exit codes {[p.returncode for p in procs]}; logs in {out}")
    times: list[float] = json.loads((out / "rank0.json").read_text())["times"]
    return times


def _median_step(times: list[float], warmup: int) -> float:
    gaps = [b - a for a, b in itertools.pairwise(times[warmup:])]
    return statistics.median(gaps)


World = Callable[..., list[float]]
"""One world's run of a script (``name``, ``ranks``, ``steps``, ``width``, ``library``): rank 0's step-end times."""


def overhead(
    tmp: Path, *, ranks: int, steps: int, warmup: int, rounds: int, min_step_ms: float, stage: int = 0
) -> dict[str, Any]:
    def world(**kw: Any) -> list[float]:
        return _world(tmp, stage=stage, **kw)

    return {"stage": stage, **abba(world, ranks=ranks, steps=steps, warmup=warmup, rounds=rounds,
                                    min_step_ms=min_step_ms, width=256, max_width=8192)}  # fmt: skip


def abba(
    world: World, *, ranks: int, steps: int, warmup: int, rounds: int, min_step_ms: float, width: int, max_width: int
) -> dict[str, Any]:
    """The script's width doubled until a stock step lasts ``min_step_ms``, then ``rounds`` pairs
    stock / library in ABBA order, each run's median step after ``warmup``; the library runs
    with a plan of generation 1 in force, as the orchestrator's first."""
    while True:
        cal = world(name=f"cal-{width}", ranks=ranks, steps=8, width=width, library=False)
        if _median_step(cal, 2) * 1000 >= min_step_ms or width >= max_width:
            break
        width *= 2
    r = redis.Redis.from_url(REDIS_URL)
    pairs = []
    for i in range(rounds):
        figures = {}
        for library in (False, True) if i % 2 == 0 else (True, False):
            name = f"cost-{i}-{'lib' if library else 'stock'}-{os.getpid()}"
            if library:  # the orchestrator's first plan: everyone participates
                plan = wire.Plan(job=name, generation=1, participants=list(range(ranks)), proxies={}, excluded=[])
                r.set(wire.job_plan_key(name), wire.encode(plan))
            times = world(name=name, ranks=ranks, steps=steps, width=width, library=library)
            r.delete(wire.job_plan_key(name))
            figures[library] = _median_step(times, warmup)
        pairs.append((figures[False], figures[True]))
    ratios = [lib / stock for stock, lib in pairs]
    return {
        "ranks": ranks,
        "width": width,
        "stock_step_ms": [round(s * 1000, 2) for s, _ in pairs],
        "library_step_ms": [round(lib * 1000, 2) for _, lib in pairs],
        "overhead_ratio": round(statistics.median(ratios), 4),
        "ratios": [round(x, 4) for x in ratios],
    }


def dead_rank(tmp: Path, *, ranks: int, width: int, collective_timeout_s: float, stage: int = 0) -> dict[str, Any]:
    (tmp / "stack").mkdir()
    s = Stack(tmp / "stack", PULSE_JOB_START_TIMEOUT_S="300", PULSE_JOB_MAX_REJOINS="0")
    out = tmp / "dead"
    out.mkdir()
    nodes = [f"cost-{i}" for i in range(ranks)]
    try:
        s.orchestrator()
        for n in nodes:
            s.agent(n)
        s.wait_healthy(nodes)
        body = {
            "name": "dead-rank",
            "nodes": ranks,
            "gpus_per_node": 1,
            "entrypoint": [str(SCRIPT), "--backward", "engine", "--max-steps", "60", "--width", str(width),
                           "--out", str(out)],
            "deepspeed_config": config(stage),
            "env": {"PULSE_COLLECTIVE_TIMEOUT_S": str(collective_timeout_s), "PULSE_PLAN_POLL_S": "0.2",
                    "OMP_NUM_THREADS": "1"},
        }  # fmt: skip
        created = s.post("/v1/jobs", body)
        if "id" not in created.json():
            raise RuntimeError(f"the job was not created: {created.status_code} {created.text}")
        job = created.json()["id"]
        victim = ranks - 1
        wait_for(
            lambda: any(r.job == job and r.rank == 0 and r.step >= 20 for r in reports(REDIS_URL)),
            timeout=300,
            what="step 20",
            every=0.2,
        )
        pid = _pid_of(job, victim)
        killed = time.time()
        psutil.Process(pid).kill()
        s.wait_state(job, "SUCCEEDED", timeout=300)
    finally:
        s.close()
    costs = {}
    for rank in range(ranks - 1):
        times = json.loads((out / f"rank{rank}.json").read_text())["times"]
        step = _median_step(times, 3)
        around = [b - a for a, b in itertools.pairwise(times) if b >= killed and a <= killed + 60]
        costs[rank] = round(max(around) - step, 3)
    return {"dead_rank_cost_s": costs, "collective_timeout_s": collective_timeout_s}


def _pid_of(job: str, rank: int) -> int:
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = p.info.get("cmdline") or []
            env = p.environ() if "trainer.run" in cmd and cmd[0] != "/bin/sh" else {}
            if env.get("PULSE_JOB_ID") == job and env.get("RANK") == str(rank):
                return int(p.info["pid"])
    raise RuntimeError(f"no process of rank {rank} of job {job}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.test_library_cost", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4, help="ABBA pairs (0: no overhead_ratio, --width as given)")
    p.add_argument("--width", type=int, default=1024, help="the MLP's width with --rounds 0")
    p.add_argument("--min-step-ms", type=float, default=50.0)
    p.add_argument("--collective-timeout", type=float, default=5.0)
    p.add_argument("--stage", type=int, default=0, choices=(0, 1, 2), help="ZeRO stage")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pulse-libcost-") as d:
        tmp = Path(d)
        result: dict[str, Any] = {"stage": a.stage, "width": a.width}
        if a.rounds:
            result = overhead(
                tmp, ranks=a.ranks, steps=a.steps, warmup=a.warmup, rounds=a.rounds, min_step_ms=a.min_step_ms,
                stage=a.stage,
            )  # fmt: skip
        result |= dead_rank(
            tmp, ranks=3, width=result["width"], collective_timeout_s=a.collective_timeout, stage=a.stage
        )
        if a.stage:  # ZeRO 0's beside it, on the same machine in the same minutes
            (tmp / "zero0").mkdir()
            redis.Redis.from_url(REDIS_URL).flushdb()  # the test database: the first stack's nodes go
            zero0 = dead_rank(tmp / "zero0", ranks=3, width=result["width"], collective_timeout_s=a.collective_timeout)
            result["zero0_dead_rank_cost_s"] = zero0["dead_rank_cost_s"]
    print(json.dumps(result))
    return 0


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="a benchmark: PULSE_BENCH=1")
@pytest.mark.timeout(1800)
def test_library_cost(tmp_path: Path) -> None:
    result = overhead(tmp_path, ranks=2, steps=40, warmup=5, rounds=4, min_step_ms=50.0)
    result |= dead_rank(tmp_path, ranks=3, width=result["width"], collective_timeout_s=5.0)
    print(json.dumps(result))
    assert result["overhead_ratio"] <= 1.02, result
    slowest = max(result["library_step_ms"]) / 1000
    assert all(c <= 5.0 + slowest for c in result["dead_rank_cost_s"].values()), result


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="a benchmark: PULSE_BENCH=1")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("stage", [1, 2])
def test_dead_rank_cost_partitioned(tmp_path: Path, stage: int) -> None:
    """At ZeRO 1-2 the survivors re-home the partitions: still at most 1 s plus one step, not the
    collective timeout (the collective timeout is 5 s here, so a wait for it would show)."""
    result = overhead(tmp_path, ranks=2, steps=40, warmup=5, rounds=2, min_step_ms=50.0, stage=stage)
    result |= dead_rank(tmp_path, ranks=3, width=result["width"], collective_timeout_s=5.0, stage=stage)
    print(json.dumps(result))
    slowest = max(result["library_step_ms"]) / 1000
    assert all(c <= 1.0 + slowest for c in result["dead_rank_cost_s"].values()), result


if __name__ == "__main__":
    raise SystemExit(main())

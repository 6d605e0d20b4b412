"""``pulse bench recovery``: what one failed participant costs the survivors, by kind of failure.

For each ZeRO stage (``--stages``, 0 and 2 by default) and each failure, a stack of its own (a
private Redis, the orchestrator, one simulated agent per node: ``tools/goodput/stack.py``) runs
``tools/recovery/mlp_train.py`` (an MLP 16-2048-2048-1, never importing ClusterPulse) as a job of
``--ranks`` ranks with the trainer's defaults (the collective timeout 60 s, unless
``--collective-timeout``); once it has trained ``--warmup-s``, the last rank fails:

- ``dead``: its process is SIGKILLed;
- ``hung``: its process is SIGSTOPped (alive, its sockets open, no exit code);
- ``lost``: its node's agent and then its process are SIGSTOPped (a frozen machine).

The cost, for each survivor: the longest gap between its optimizer-step ends from the failure to
``--observe-s`` after it, minus its median step before the failure (what the failure cost it);
the figure is the largest over the survivors. The relaunched rank is taken back within that
window, which costs the survivors a gap of its own: the gaps from the survivors' invitation on
(``event=rejoin_invited``) are its cost, ``rejoin_cost_s``, not the failure's (torchft's side
relaunches nobody). With ``--repeat N`` each case runs N times, on both sides, and its figures are
the medians (``tools/recovery/gaps.py``, :func:`over_runs`). The JSON has ``dead_rank_cost_s``,
``hung_rank_cost_s`` and ``lost_node_cost_s`` (by stage), the median step, and with ``--torchft``
(where torchft is installed) the same workload under torchft's Manager beside it
(``tools/recovery/torchft_bench.py``): ``torchft_*``. Why and how it is read:
docs/design/hang.md; figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tools.goodput.model import STACK_ENV, CampaignError, wait_until
from tools.goodput.stack import Stack, rank_pids
from tools.recovery.gaps import over_runs, read_times, survivors

SCRIPT = Path(__file__).with_name("mlp_train.py")
KINDS = ("dead", "hung", "lost")
FIGURE = {"dead": "dead_rank_cost_s", "hung": "hung_rank_cost_s", "lost": "lost_node_cost_s"}


def deepspeed_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000_000,
    }


def run_one(workdir: Path, *, kind: str, stage: int, args: argparse.Namespace) -> dict[str, Any]:
    """One stack, one job, one failure of the last rank; the survivors' costs."""
    workdir.mkdir(parents=True)
    out = workdir / "out"
    out.mkdir()
    stack = Stack(workdir, args.ranks)
    stack.env.update(STACK_ENV, PULSE_DEGRADED_AFTER_S="120", PULSE_LOST_AFTER_S="300")
    victim = args.ranks - 1
    stopped: list[int] = []
    try:
        stack.start_redis()
        stack.start_orchestrator()
        for node in stack.nodes:
            stack.start_agent(node)
        wait_until(
            lambda: len(stack.get("/v1/nodes", params={"state": "HEALTHY"})["data"]) == len(stack.nodes),
            timeout=60, what="every node HEALTHY",
        )  # fmt: skip
        env = {"OMP_NUM_THREADS": "1", "PULSE_HANG_WATCH": "true" if args.hang_watch else "false"}
        if args.collective_timeout is not None:
            env["PULSE_COLLECTIVE_TIMEOUT_S"] = str(args.collective_timeout)
        seconds = args.warmup_s + args.observe_s + 30
        body = {
            "name": f"recovery-{kind}-z{stage}",
            "nodes": args.ranks,
            "gpus_per_node": 1,
            "entrypoint": [str(SCRIPT), "--seconds", str(seconds), "--width", str(args.width), "--out", str(out)],
            "deepspeed_config": deepspeed_config(stage),
            "env": env,
        }
        created = stack.post("/v1/jobs", body)
        if created.status_code >= 300:
            raise CampaignError(f"the job was not created: {created.status_code} {created.text}")
        job = created.json()["id"]
        wait_until(
            lambda: len(read_times(out / "rank0.times")) >= 10, timeout=240, what="the job's first steps", every=0.2
        )
        time.sleep(args.warmup_s)
        pid = rank_pids(job)[victim]
        fault = time.time()
        if kind == "dead":
            os.kill(pid, signal.SIGKILL)
        else:
            if kind == "lost":
                agent = stack.agents[stack.nodes[victim]].pid
                os.kill(agent, signal.SIGSTOP)
                stopped.append(agent)
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        time.sleep(args.observe_s)
        plan = stack.get(f"/v1/jobs/{job}/plan")
        with contextlib.suppress(Exception):
            stack.post(f"/v1/jobs/{job}/stop")
    finally:
        for p in stopped:  # so that close() can stop them
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
        stack.close()
    rejoin = rejoin_invited(workdir, job, after=fault)
    try:
        lost = survivors(
            out, args.ranks, fault=fault, observe_s=args.observe_s, what=f"{kind} at ZeRO {stage}", rejoin=rejoin
        )
    except ValueError as exc:
        raise CampaignError(str(exc)) from None
    return {**lost, "excluded": plan.get("excluded", [])}


def rejoin_invited(workdir: Path, job: str, *, after: float) -> float | None:
    """When the survivors first invited the relaunched rank back after ``after``, read from their
    log lines (``event=rejoin_invited``; the time is the logging's local ``asctime``)."""
    seen = []
    for path in workdir.glob(f"agents/*/{job}.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "event=rejoin_invited" in line:
                with contextlib.suppress(ValueError):
                    seen.append(datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return min((t for t in seen if t > after), default=None)


def run_bench(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise SystemExit(f"--repeat: at least one run of each case, got {args.repeat}")
    result: dict[str, Any] = {
        "ranks": args.ranks,
        "collective_timeout_s": args.collective_timeout if args.collective_timeout is not None else 60.0,
        "hang_watch": args.hang_watch,
    }
    with tempfile.TemporaryDirectory(prefix="pulse-recovery-") as d:
        for stage in args.stages:
            for kind in args.kinds:
                runs = [
                    run_one(Path(d) / f"{kind}-z{stage}-{k}", kind=kind, stage=stage, args=args)
                    for k in range(args.repeat)
                ]
                one = over_runs(runs)
                result.setdefault(FIGURE[kind], {})[f"zero{stage}"] = one["cost_s"]
                if "rejoin_cost_s" in one:
                    result.setdefault("rejoin_cost_s", {})[f"{kind}-zero{stage}"] = one["rejoin_cost_s"]
                result.setdefault("detail", {})[f"{kind}-zero{stage}"] = one
                print(f"{kind} ZeRO {stage}: {json.dumps(one)}", file=sys.stderr, flush=True)
        if args.torchft:
            try:
                from tools.recovery.torchft_bench import run_torchft
            except ImportError as exc:
                raise SystemExit(f"--torchft: {exc}; install it with: .venv/bin/pip install -e '.[bench]'") from exc

            result |= run_torchft(Path(d) / "torchft", args)
            result["ratios_to_torchft_defaults"] = {
                name: {stage: round(ours / result[f"torchft_{name}"]["defaults"], 3) for stage, ours in by.items()}
                for name, by in result.items()
                if name in FIGURE.values() and f"torchft_{name}" in result
            }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0

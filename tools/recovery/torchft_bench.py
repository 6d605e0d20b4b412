"""The recovery benchmark's side-by-side: the same workload under torchft (``torchft_train.py``).

A lighthouse in this process and ``--ranks`` replica groups of one process each; once they have
trained ``--warmup-s``, the last one is SIGKILLed (``dead``) or SIGSTOPped (``hung``; a frozen
machine looks the same to torchft, whose participants have no agent: ``lost`` is that run too).
The cost is read as ``tools/recovery/bench.py`` reads ours (``tools/recovery/gaps.py``), over at
least 75 s after the failure with torchft's defaults, whose timeouts are 60 s. Run twice: with torchft's defaults
(the lighthouse's heartbeat timeout, the Manager's and gloo's timeouts) and with every timeout at
``--torchft-timeout`` seconds (the issue's "both timeouts at 5 s").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.goodput.model import CampaignError, wait_until
from tools.harness import child_env
from tools.recovery.gaps import over_runs, read_times, survivors

SCRIPT = Path(__file__).with_name("torchft_train.py")


def run_one(workdir: Path, *, kind: str, timeout_s: float | None, args: argparse.Namespace) -> dict[str, Any]:
    from torchft.coordination import LighthouseServer

    workdir.mkdir(parents=True)
    observe_s = args.observe_s if timeout_s is not None else max(args.observe_s, 75.0)  # past its 60 s timeouts
    tuned = {} if timeout_s is None else {"heartbeat_timeout_ms": int(timeout_s * 1000)}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, **tuned)
    env = child_env()
    env.update(TORCHFT_LIGHTHOUSE=lighthouse.address(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    seconds = args.warmup_s + observe_s + 20
    argv = ["--width", str(args.width), "--seconds", str(seconds), "--out", str(workdir)]
    argv += [] if timeout_s is None else ["--timeout-s", str(timeout_s)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for group in range(args.ranks):
            with (workdir / f"rank{group}.log").open("ab") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tools.recovery.torchft_train", *argv],
                        env={**env, "REPLICA_GROUP_ID": str(group)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        wait_until(
            lambda: all(len(read_times(workdir / f"rank{g}.times")) >= 10 for g in range(args.ranks)),
            timeout=240, what="torchft's first steps on every participant", every=0.2,
        )  # fmt: skip
        time.sleep(args.warmup_s)
        victim = procs[-1]
        fault = time.time()
        os.kill(victim.pid, signal.SIGKILL if kind == "dead" else signal.SIGSTOP)
        time.sleep(observe_s)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        lighthouse.shutdown()
    try:
        return survivors(workdir, args.ranks, fault=fault, observe_s=observe_s, what=f"torchft {kind}")
    except ValueError as exc:
        raise CampaignError(str(exc)) from None


def run_torchft(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``torchft_dead_rank_cost_s``, ``torchft_hung_rank_cost_s``, ``torchft_lost_node_cost_s``, each
    ``{"defaults": ..., "timeouts_<T>s": ...}``; the detail under ``torchft_detail``."""
    out: dict[str, Any] = {}
    for timeout_s in (None, args.torchft_timeout):
        label = "defaults" if timeout_s is None else f"timeouts_{timeout_s:g}s"
        for kind in [k for k in ("dead", "hung") if k in args.kinds or (k == "hung" and "lost" in args.kinds)]:
            runs = [
                run_one(workdir / f"{kind}-{label}-{k}", kind=kind, timeout_s=timeout_s, args=args)
                for k in range(args.repeat)
            ]
            one = over_runs(runs)
            print(f"torchft {kind} {label}: {one}", file=sys.stderr, flush=True)
            names = ["torchft_dead_rank_cost_s"] if kind == "dead" else ["torchft_hung_rank_cost_s"]
            names += [] if kind == "dead" else ["torchft_lost_node_cost_s"]  # no agent: a frozen machine is a hang
            for name in names:
                out.setdefault(name, {})[label] = one["cost_s"]
            out.setdefault("torchft_detail", {})[f"{kind}-{label}"] = one
    return out

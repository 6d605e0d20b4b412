"""``pulse bench gpu-plans``: what one bad GPU costs a job's step under per-GPU plans, beside
the per-node plans of before (issue 35).

One world of ``--world-size`` gloo ranks on this machine (``pulse check reroute``'s ranks,
tools/check_reroute/: a real DDP step with the rerouting hook), ``--gpus-per-node`` ranks a node,
one bad GPU: under a per-GPU plan its rank alone is carried; under a per-node plan (a node
DEGRADED as a whole, what a GPU fault did before) every rank of its node is. The two run in
turn, ``--rounds`` times each, so a shared machine's noise falls on both; each run's figure is
the median over its rounds of the slowest live rank's DDP step, and it is set against the stock
DDP step the same run measured (``rerouted_ddp_ratio``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from tools.check_reroute import CheckConfig, run_check


def _config(args: argparse.Namespace, degrade: tuple[int, ...]) -> CheckConfig:
    return CheckConfig(
        world_size=args.world_size, degrade=degrade, repeats=args.repeats, hidden=args.hidden,
        layers=args.layers, steps=2,
    )  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both plans, ``args.rounds`` runs each in turn; the medians and their ratio."""
    node = args.bad // args.gpus_per_node
    whole = tuple(range(node * args.gpus_per_node, (node + 1) * args.gpus_per_node))
    runs: dict[str, list[dict[str, Any]]] = {"per_gpu": [], "per_node": []}
    for _ in range(args.rounds):
        runs["per_gpu"].append(run_check(_config(args, (args.bad,))))
        runs["per_node"].append(run_check(_config(args, whole)))
    out: dict[str, Any] = {
        "world_size": args.world_size,
        "gpus_per_node": args.gpus_per_node,
        "bad_gpu_rank": args.bad,
        "model": f"{args.layers} x {args.hidden} MLP",
        "rounds": args.rounds,
        "repeats": args.repeats,
    }
    for name, results in runs.items():
        out[name] = {
            "carried_ranks": len(results[0]["plan"]["proxies"]),
            "stock_ddp_step_s": statistics.median(r["stock_ddp_step_s"] for r in results),
            "rerouted_ddp_step_s": statistics.median(r["rerouted_ddp_step_s"] for r in results),
            "rerouted_ddp_ratio": statistics.median(r["rerouted_ddp_ratio"] for r in results),
            "exact": all(r["ok"] for r in results),
        }
    gpu, whole_node = out["per_gpu"]["rerouted_ddp_ratio"], out["per_node"]["rerouted_ddp_ratio"]
    out["per_node_over_per_gpu"] = round(whole_node / gpu, 3) if gpu else None
    return out


def main(args: argparse.Namespace) -> int:
    out = measure(args)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0 if out["per_gpu"]["exact"] and out["per_node"]["exact"] else 1

"""The ``pulse`` command: its argument parser and entry point. The subcommands live in
:mod:`tools.daemons` (processes), :mod:`tools.oncall` (the API client) and the tools they name
(demo, check, bench, goodput); each imports what it runs only when it runs, so ``pulse agent``
stays small."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from clusterpulse.proc import LOG_FORMAT
from tools.daemons import cmd_agent, cmd_agent_credentials, cmd_db, cmd_ingest, cmd_orchestrator, cmd_simulate
from tools.oncall import cmd_check_fabric, cmd_events, cmd_jobs, cmd_nodes, cmd_plan, cmd_slurm, cmd_tokens


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=LOG_FORMAT,
        stream=sys.stderr,
    )
    for noisy in ("httpx", "alembic", "uvicorn.error"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# --- demo / bench -------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from tools.demo import run_demo

    rc: int = run_demo(args)
    return rc


def cmd_check(args: argparse.Namespace) -> int:
    from tools.check_reroute import CheckConfig, CheckFailed, parse_ranks, run_check

    cfg = CheckConfig(
        world_size=args.world_size,
        degrade=parse_ranks("--degrade", args.degrade),
        exclude=parse_ranks("--exclude", args.exclude),
        hang=args.hang,
        steps=args.steps,
        repeats=args.repeats,
        hidden=args.hidden,
        layers=args.layers,
        batch=args.batch,
        bucket_mb=args.bucket_mb,
        lr=args.lr,
        proxy_timeout_s=args.proxy_timeout,
        stock_timeout_s=args.stock_timeout,
        timeout_s=args.timeout,
        tolerance=args.tolerance,
        threads=args.threads,
    )
    try:
        result = run_check(cfg)
    except CheckFailed as exc:
        print(f"pulse check reroute: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {json.dumps(value)}")
    return 0 if result["ok"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from tools.bench import run_bench

    rc: int = run_bench(args)
    return rc


def cmd_bench_nics(args: argparse.Namespace) -> int:
    from tools.bench_nics import run_bench_nics

    return run_bench_nics(args)


def cmd_bench_gpu_plans(args: argparse.Namespace) -> int:
    from tools.bench_gpu_plans import main

    return main(args)


def cmd_bench_reads(args: argparse.Namespace) -> int:
    from tools.bench_reads import run_bench_reads

    args.slice_nodes = args.slice_nodes or [2048]
    args.metrics_slice_nodes = args.metrics_slice_nodes or [256]
    return run_bench_reads(args)


def cmd_goodput(args: argparse.Namespace) -> int:
    from tools.goodput import run_goodput

    return run_goodput(args)


def _demo_parser(sub: Any) -> None:
    m = sub.add_parser("demo", help="orchestrator + 16 simulated nodes on this machine, a training job, a fault")
    m.add_argument("--nodes", type=int, default=16)
    m.add_argument("--port", type=int, default=0, help="orchestrator port (0: a free one)")
    m.add_argument(
        "--fault-after", type=float, default=20.0, help="seconds to the PSU fault (training: after the first step)"
    )
    m.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0: until Ctrl-C)")
    m.add_argument("--no-train", action="store_true", help="no trainer.example job on 4 of the nodes")
    m.set_defaults(fn=cmd_demo)


def _events_parser(sub: Any) -> None:
    e = sub.add_parser("events", help="health transitions and operator actions")
    e.add_argument("--node")
    e.add_argument("--job", help="only this job's events (its states, checkpoints)")
    e.add_argument("--since", type=float, help="only the last S seconds")
    e.add_argument("--limit", type=int, default=100)
    e.add_argument("--json", action="store_true")
    e.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="then follow the event stream (GET /v1/stream), one line (--json: one object) per event, until Ctrl-C",
    )
    e.set_defaults(fn=cmd_events)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pulse", description="ClusterPulse: the control plane of a GPU training cluster.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    _daemon_commands(sub)
    _api_commands(sub)
    _tool_commands(sub)
    return p


Subparsers = Any  # argparse's _SubParsersAction, private in typeshed


def _daemon_commands(sub: Subparsers) -> None:
    """The processes: agent, simulate, orchestrator, db."""
    a = sub.add_parser("agent", help="run one node's agent")
    a.add_argument("--node", required=True)
    a.add_argument("--source", choices=("auto", "nvml", "simulated"), default="auto")
    a.add_argument("--gpus", type=int, default=8, help="GPUs to simulate (--source simulated)")
    a.add_argument("--interval", type=float, help="heartbeat interval, seconds (PULSE_HEARTBEAT_INTERVAL_S)")
    a.add_argument("--label", action="append", default=[], help="topology label KEY=VALUE (repeatable)")
    a.add_argument(
        "--addr",
        help="the address other nodes reach this one at, the rendezvous of jobs it leads "
        "(PULSE_AGENT_ADDR; default: found by the agent, see agent/address.py)",
    )
    a.add_argument(
        "--fault",
        action="append",
        default=[],
        help="KIND[:GPU]@SECONDS[+DURATION] (simulated only, repeatable; :GPU picks the GPU of thermal, "
        "pcie_x8, xid, xid79, ecc, gpu_lost)",
    )
    a.add_argument("--no-jobs", action="store_true", help="do not run the job launcher")
    a.set_defaults(fn=cmd_agent)

    s = sub.add_parser("simulate", help="run N simulated agents in one process")
    s.add_argument("--nodes", type=int, required=True)
    s.add_argument("--gpus-per-node", type=int, default=8)
    s.add_argument("--interval", type=float)
    s.add_argument(
        "--fault",
        action="append",
        default=[],
        help="NODE=KIND[:GPU]@SECONDS[+DURATION] (repeatable; :GPU picks the GPU of thermal, pcie_x8, xid, "
        "xid79, ecc, gpu_lost)",
    )
    s.add_argument("--prefix", default="sim")
    s.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0: until Ctrl-C)")
    s.set_defaults(fn=cmd_simulate)

    o = sub.add_parser("orchestrator", help="run the orchestrator (REST API, /metrics, health loops)")
    o.add_argument("--host", default="127.0.0.1")
    o.add_argument("--port", type=int, default=8000)
    o.set_defaults(fn=cmd_orchestrator)

    i = sub.add_parser("ingest", help="one ingest process: reads heartbeat streams, hands the leader observations")
    i.set_defaults(fn=cmd_ingest)

    d = sub.add_parser("db", help="database schema")
    d.add_argument("action", choices=("upgrade",))
    d.set_defaults(fn=cmd_db)


def _api_commands(sub: Subparsers) -> None:
    """On call, over the REST API: nodes, slurm, events, jobs, plan, tokens, agent credentials."""
    n = sub.add_parser("nodes", help="list, show, cordon, uncordon nodes; reset a GPU")
    n.add_argument("action", choices=("list", "show", "cordon", "uncordon", "reset-gpu"))
    n.add_argument("name", nargs="?")
    n.add_argument("gpu", nargs="?", type=int, help="reset-gpu: the GPU's index")
    n.add_argument("--state")
    n.add_argument("--reason", default="")
    n.add_argument("--json", action="store_true")
    n.add_argument("--watch", type=float, nargs="?", const=2.0, default=0.0, help="refresh every S seconds")
    n.set_defaults(fn=cmd_nodes)

    sl = sub.add_parser("slurm", help="Slurm node sync: status, reset the drain breaker (operator)")
    sl.add_argument("action", choices=("status", "reset-breaker"))
    sl.add_argument("--json", action="store_true")
    sl.set_defaults(fn=cmd_slurm)

    _events_parser(sub)

    j = sub.add_parser("jobs", help="start, list, show, stop, checkpoint training jobs")
    j.add_argument("action", choices=("start", "list", "show", "stop", "checkpoint"))
    j.add_argument("rest", nargs="*", help="JOB (show/stop/checkpoint); for start, the entrypoint goes after --")
    j.add_argument("--reason", default="", help="checkpoint: why (recorded in the job's events)")
    j.add_argument("--name")
    j.add_argument("--nodes", type=int, default=1)
    j.add_argument("--gpus-per-node", type=int, default=1)
    j.add_argument("--deepspeed-config", help="a DeepSpeed JSON config file")
    j.add_argument("--env", action="append", default=[], help="KEY=VALUE for the ranks (repeatable)")
    j.add_argument("--selector", action="append", default=[], help="node label KEY=VALUE (repeatable)")
    j.add_argument("--idempotency-key")
    j.add_argument(
        "--backend",
        choices=("agents", "slurm"),
        help="who runs the ranks (default: the orchestrator's PULSE_JOB_BACKEND)",
    )
    j.add_argument(
        "--preflight-fabric", action="store_true", help="start: a fabric check of its nodes first (slow ones swapped)"
    )
    j.add_argument("--state")
    j.add_argument("--follow", action="store_true", help="stream state and progress until the job ends")
    j.add_argument("--json", action="store_true")
    j.set_defaults(fn=cmd_jobs)

    pl = sub.add_parser("plan", help="a job's gradient-aggregation plan in force")
    pl.add_argument("job")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)

    t = sub.add_parser("tokens", help="API tokens: create, list, revoke (admin)")
    t.add_argument("action", choices=("create", "list", "revoke"))
    t.add_argument("name", nargs="?", help="the token (revoke)")
    t.add_argument("--name", dest="name", help="the new token's name (create): the actor of its events")
    t.add_argument("--role", choices=("viewer", "operator", "admin"), help="reads / cordon and jobs / tokens")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_tokens)

    ac = sub.add_parser(
        "agent-credentials",
        help="a node's (or the orchestrator's) Redis ACL user: print or apply the rules and its URL",
    )
    ac.add_argument("node", nargs="?", help="the node whose agent and ranks will use the user")
    ac.add_argument("--orchestrator", action="store_true", help="the orchestrator's user instead of a node's")
    ac.add_argument("--apply", action="store_true", help="ACL SETUSER at PULSE_REDIS_URL (an admin connection)")
    ac.add_argument(
        "--password-file", help="read the password from this file; generate one into it (0600) when it is missing"
    )
    ac.set_defaults(fn=cmd_agent_credentials)


def _tool_commands(sub: Subparsers) -> None:
    """On this machine: the demo, the checks, the benchmarks (:func:`_bench_commands`)."""
    _demo_parser(sub)

    c = sub.add_parser("check", help="self-checks on this machine")
    csub = c.add_subparsers(dest="check", required=True)
    cr = csub.add_parser(
        "reroute",
        help="gloo ranks on this CPU: rerouted DDP against stock DDP (exactness, cost, a hung rank)",
        description="Starts W gloo ranks on this machine, trains a small MLP with and without the plan "
        "(degraded ranks carried by participants, excluded ranks left out) and prints one JSON object. "
        "max_abs_param_diff is against stock DDP over the ranks not excluded. Exit 1 when the check fails.",
    )
    cr.add_argument("--world-size", type=int, default=4, metavar="W", help="ranks to start (default 4)")
    cr.add_argument("--degrade", required=True, metavar="RANK[,RANK]", help="degraded ranks, carried by participants")
    cr.add_argument("--exclude", metavar="RANK[,RANK]", help="excluded ranks (their gradients are left out)")
    cr.add_argument("--hang", type=int, metavar="RANK", help="a degraded RANK that SIGSTOPs itself mid-run")
    cr.add_argument("--steps", type=int, default=10, help="training steps compared for exactness (default 10)")
    cr.add_argument("--repeats", type=int, default=10, help="timed rounds, medians reported (default 10)")
    cr.add_argument("--hidden", type=int, default=2048, help="MLP width (default 2048: 16 MiB per layer)")
    cr.add_argument("--layers", type=int, default=8, help="MLP layers (default 8: 128 MiB of gradients)")
    cr.add_argument("--batch", type=int, default=8, help="samples per rank and step (default 8)")
    cr.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size, MiB (DDP's default 25)")
    cr.add_argument("--lr", type=float, default=1.0, help="SGD learning rate (default 1.0)")
    cr.add_argument("--proxy-timeout", type=float, default=5.0, help="carrier's wait for a degraded rank, s (5)")
    cr.add_argument("--stock-timeout", type=float, default=20.0, help="timeout of the stock all-reduce hang, s (20)")
    cr.add_argument("--timeout", type=float, default=900.0, help="the whole check, s (default 900)")
    cr.add_argument(
        "--tolerance", type=float, default=1e-3, help="max_abs_param_diff allowed, relative to param_moved (1e-3)"
    )
    cr.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: CPUs / world size)")
    cr.add_argument("--json", action="store_true", help="one JSON object (default: key: value lines)")
    cr.set_defaults(fn=cmd_check)
    cf = csub.add_parser(
        "fabric",
        help="the fabric check through the orchestrator: nodes in pairs, all-reduce bus bandwidth, slow nodes named",
        description="Starts a fabric check (POST /v1/fabric/checks, operator) and follows it: the nodes in pairs "
        "run an all-reduce through their agents, a second round pairs the slow pairs' nodes with the fast ones', "
        "and a node whose every pair was slow is named and made SUSPECT. Exit 0: none slow; 1: some; 2: not done "
        "within --timeout; 3: none slow, but some node not measured (its agent never took the probe).",
    )
    cf.add_argument(
        "--nodes", metavar="A,B,...", help="the nodes (default: every HEALTHY or SUSPECT node without a job)"
    )
    cf.add_argument("--timeout", type=float, default=600.0, help="how long to follow it, s (default 600)")
    cf.add_argument("--poll", type=float, default=0.5, help="seconds between reads of the check (default 0.5)")
    cf.add_argument(
        "--json", action="store_true", help="the check as JSON: pairs, slow, slow_reasons, unmeasured, median_gbps"
    )
    cf.set_defaults(fn=cmd_check_fabric)
    _bench_commands(sub)


def _bench_ingest_args(bi: argparse.ArgumentParser) -> None:
    """`pulse bench ingest`'s options."""
    bi.add_argument("--nodes", type=int, default=2048)
    bi.add_argument("--gpus-per-node", type=int, default=8)
    bi.add_argument("--duration", type=float, default=10.0)
    bi.add_argument("--silences", type=int, default=64, help="nodes silenced to measure detection")
    bi.add_argument(
        "--interval", type=float, default=0.0, help="heartbeat interval of the detection run, s (0: nodes / 2048, >= 1)"
    )
    bi.add_argument(
        "--processes",
        default="",
        help="the scale-out form: e.g. 0,1,2,4 drains one pre-filled backlog with the leader alone (0) "
        "and with that many ingest processes, side by side (tools/bench_scale.py)",
    )
    bi.add_argument(
        "--ingest-processes",
        type=int,
        default=0,
        help="PULSE_INGEST_PROCESSES of the orchestrator the ingest and detection runs measure (default 0)",
    )
    bi.add_argument(
        "--backlog", type=int, default=0, help="heartbeats pre-filled (scale-out form; 0: 65,536, at least 2 per node)"
    )
    bi.add_argument(
        "--shards", type=int, default=4, help="heartbeat stream shards (scale-out and --redis-cluster forms)"
    )
    bi.add_argument(
        "--redis-cluster",
        action="store_true",
        help="the backlog ingest on one Redis and on a private Redis Cluster (3 masters, 3 replicas) side by "
        "side: the ratio, and each server's CPU per 1,000 heartbeats (tools/bench_cluster.py)",
    )
    bi.add_argument(
        "--no-nics",
        action="store_true",
        help="the ingest and scrape heartbeats without network ports (a cluster without InfiniBand; "
        "by default each node has 8)",
    )
    bi.add_argument("--json", action="store_true")


def _bench_commands(sub: Subparsers) -> None:
    """`pulse bench ...`: ingest, agent, nics, soak, goodput, recovery."""
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bi = bsub.add_parser("ingest", help="heartbeat ingest, detection latency and /metrics render")
    _bench_ingest_args(bi)
    bi.set_defaults(fn=cmd_bench)
    ba = bsub.add_parser("agent", help="agent CPU and memory at a 1 s interval")
    ba.add_argument("--gpus", type=int, default=8)
    ba.add_argument("--duration", type=float, default=30.0)
    ba.add_argument("--interval", type=float, default=1.0)
    ba.add_argument("--json", action="store_true")
    ba.set_defaults(fn=cmd_bench)
    bn = bsub.add_parser(
        "nics",
        help="per-heartbeat cost of reading and folding 8 HCAs' ports, beside a heartbeat without them",
        description="Reads a fake DGX H100 sysfs tree (tools/fake_sysfs.py) --reads times "
        "and prints one JSON object (tools/bench_nics.py).",
    )
    bn.add_argument("--reads", type=int, default=2000, help="heartbeats timed (default 2000)")
    bn.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    bn.set_defaults(fn=cmd_bench_nics)
    _reads_command(bsub)
    bs = bsub.add_parser(
        "soak",
        help="long run with random faults: orchestrator memory growth, false DEGRADED, lost events",
        description="Starts the orchestrator, N simulated nodes and a private redis-server, injects a fault "
        "of a random kind on a random node every --fault-every seconds for --duration seconds and prints one "
        "JSON object (tools/soak.py). Exit 1 when an event is lost, a node is DEGRADED without a fault, "
        "or resident memory grows more than --max-rss-growth.",
    )
    bs.add_argument("--nodes", type=int, default=2048)
    bs.add_argument("--gpus-per-node", type=int, default=8)
    bs.add_argument("--duration", type=float, default=600.0, help="seconds of faults after the warm-up (600)")
    bs.add_argument("--fault-every", type=float, default=5.0, help="seconds between fault starts (5)")
    bs.add_argument("--seed", type=int, default=1, help="the fault schedule's seed (1)")
    bs.add_argument("--interval", type=float, default=2.0, help="heartbeat interval, s (2)")
    bs.add_argument("--degraded-after", type=float, default=0.0, help="silence before DEGRADED, s (6 x interval)")
    bs.add_argument(
        "--slack",
        type=float,
        default=0.0,
        help="ingest/evaluation lag tolerated on top of each rule, s (4 x interval, >= 5)",
    )
    bs.add_argument("--warmup", type=float, default=60.0, help="seconds after every node is HEALTHY (60)")
    bs.add_argument("--settle-timeout", type=float, default=300.0, help="for every node to be HEALTHY, s (300)")
    bs.add_argument("--max-rss-growth", type=float, default=1.05, help="orchestrator RSS end / warm allowed (1.05)")
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(fn=cmd_bench)
    _goodput_command(bsub)
    _recovery_command(bsub)
    bg = bsub.add_parser(
        "gpu-plans",
        help="a DDP step with one bad GPU: its rank carried alone (per GPU) against its node's (per node)",
        description="gloo ranks on this CPU, the two plans in turn; prints one JSON object (tools/bench_gpu_plans.py).",
    )
    bg.add_argument("--world-size", type=int, default=8)
    bg.add_argument("--gpus-per-node", type=int, default=4)
    bg.add_argument("--bad", type=int, default=2, help="the rank on the bad GPU (2)")
    bg.add_argument("--rounds", type=int, default=2, help="runs of each plan, in turn (2)")
    bg.add_argument("--repeats", type=int, default=8, help="timed DDP steps a run (8)")
    bg.add_argument("--hidden", type=int, default=1024)
    bg.add_argument("--layers", type=int, default=4)
    bg.add_argument("--json", action="store_true")
    bg.set_defaults(fn=cmd_bench_gpu_plans)


def _reads_command(bsub: Subparsers) -> None:
    """`pulse bench reads`: GET /v1/nodes beside a bare FastAPI app; summary pages at scale."""
    br = bsub.add_parser(
        "reads",
        help="GET /v1/nodes beside a bare FastAPI app serialising the same body; summary pages at scale",
        description="Requests a second of a real orchestrator's GET /v1/nodes (full and fields=summary) beside "
        "a bare FastAPI app answering the same body through orjson, in turn under the same load, and the time "
        "of each summary page at --scale-nodes; prints one JSON object (tools/bench_reads.py).",
    )
    br.add_argument("--nodes", type=int, default=64, help="simulated nodes heartbeating every second (0: skip)")
    br.add_argument("--clients", type=int, default=32, help="keep-alive connections asking at once (32)")
    br.add_argument("--seconds", type=float, default=5.0, help="seconds counted per side and round (5)")
    br.add_argument("--rounds", type=int, default=5, help="rounds of the bare app and the orchestrator (5)")
    br.add_argument("--scale-nodes", type=int, default=16384, help="nodes of the summary pages' run (0: skip)")
    br.add_argument("--page", type=int, default=1000, help="nodes a summary page (1000)")
    br.add_argument("--walks", type=int, default=1, help="warm walks of every page (1)")
    br.add_argument(
        "--slice-nodes", type=int, action="append", help="PULSE_EVALUATE_SLICE_NODES of a run (repeatable; 2048)"
    )
    br.add_argument("--scrape", action="store_true", help="scrape /metrics back to back while the pages are walked")
    br.add_argument(
        "--metrics-slice-nodes", type=int, action="append", help="PULSE_METRICS_SLICE_NODES of a run (repeatable; 256)"
    )
    br.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    br.set_defaults(fn=cmd_bench_reads)


def _recovery_command(bsub: Subparsers) -> None:
    """`pulse bench recovery`: what a dead, hung or lost participant costs (tools/recovery/bench.py)."""
    br = bsub.add_parser(
        "recovery",
        help="time a dead rank, a hung rank and a lost machine cost the survivors, ZeRO 0 and 2",
        description="Runs an MLP job on a private stack per case, fails its last rank (SIGKILL; SIGSTOP; "
        "SIGSTOP of its agent and itself) and prints the longest gap in the survivors' steps minus their "
        "median step (tools/recovery/bench.py).",
    )
    br.add_argument("--ranks", type=int, default=3)
    br.add_argument("--stages", type=int, nargs="+", default=[0, 2], choices=(0, 1, 2), help="ZeRO stages (0 2)")
    br.add_argument("--kinds", nargs="+", default=["dead", "hung", "lost"], choices=("dead", "hung", "lost"))
    br.add_argument("--width", type=int, default=2048, help="the MLP's hidden width (2048)")
    br.add_argument("--warmup-s", type=float, default=8.0, help="training before the failure, s (8)")
    br.add_argument("--observe-s", type=float, default=15.0, help="how long after the failure gaps count, s (15)")
    br.add_argument("--collective-timeout", type=float, default=None, help="PULSE_COLLECTIVE_TIMEOUT_S (default 60)")
    br.add_argument("--no-hang-watch", dest="hang_watch", action="store_false", help="PULSE_HANG_WATCH=false")
    br.add_argument("--repeat", type=int, default=1, help="runs of each case; the figure is their median (1)")
    br.add_argument("--torchft", action="store_true", help="the same workload under torchft, side by side")
    br.add_argument(
        "--torchft-timeout", type=float, default=5.0, help="torchft's second run: every timeout at this, s (5)"
    )
    br.add_argument("--json", action="store_true", help="one line of JSON")
    br.set_defaults(fn=cmd_recovery)


def cmd_recovery(args: argparse.Namespace) -> int:
    from tools.recovery.bench import run_bench

    rc: int = run_bench(args)
    return rc


def _goodput_command(bsub: Subparsers) -> None:
    """`pulse bench goodput`: the fault campaign (tools/goodput/)."""
    bg = bsub.add_parser("goodput", help="a fault campaign against a real stack and a DeepSpeed job: goodput")
    bg.add_argument("--ranks", type=int, default=4, help="simulated nodes, one rank each (default 4)")
    bg.add_argument("--duration", type=float, default=600.0, help="seconds of training per run (default 600)")
    bg.add_argument("--fault-every", type=float, default=15.0, help="seconds between faults (default 15)")
    bg.add_argument("--seed", type=int, default=0, help="seed of the fault draw (default 0)")
    bg.add_argument(
        "--kinds", type=lambda v: [k for k in v.split(",") if k], default=None, help="comma-separated fault kinds"
    )
    bg.add_argument("--cycle", action="store_true", help="take --kinds in turn instead of drawing them")
    bg.add_argument(
        "--collective-timeout",
        type=float,
        default=5.0,
        help="the job's PULSE_COLLECTIVE_TIMEOUT_S: how long survivors wait for a hung or dead peer (default 5)",
    )
    bg.add_argument(
        "--rank-victims",
        type=lambda v: [int(r) for r in v.split(",") if r],
        default=None,
        help="comma-separated ranks rank faults may hit (default: any)",
    )
    bg.add_argument(
        "--fault-free-duration", type=float, default=0.0, help="seconds of the fault-free run (default --duration)"
    )
    bg.add_argument("--out", default=None, help="folder for goodput.json and goodput.png (default: the run's temp dir)")
    bg.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for a job's first step")
    bg.add_argument("--finish-timeout", type=float, default=300.0, help="seconds the faulted job may take to finish")
    bg.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    bg.add_argument(
        "--deepspeed-config",
        default=None,
        help="with --entrypoint: the job's DeepSpeed config (JSON file; default the script's own)",
    )
    bg.add_argument(
        "--entrypoint",
        nargs=argparse.REMAINDER,
        default=None,
        help="SCRIPT|-m MODULE [ARGS...] (last): the script to train instead of trainer.example, run unchanged; "
        "the campaign stops it after the expected steps with PULSE_MAX_STEPS",
    )
    bg.set_defaults(fn=cmd_goodput)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    entry: list[str] = []
    if "--" in argv and "jobs" in argv[: argv.index("--")]:  # pulse jobs start ... -- ENTRYPOINT
        cut = argv.index("--")
        argv, entry = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    args.entry = entry
    _setup_logging(args.verbose)
    try:
        rc: int = args.fn(args)
    except ValueError as exc:  # bad flags or settings: say what, no traceback
        print(f"pulse: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
    os._exit(0)

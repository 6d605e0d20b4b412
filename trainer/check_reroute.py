"""``pulse check reroute``: a self-check of gradient rerouting on real gloo ranks, like nccl-tests.

The check starts ``world_size`` ranks on this machine's CPUs (each a ``python -m
trainer.check_reroute worker`` process, joined through a ``TCPStore`` that the coordinating
process hosts on a port chosen by the kernel) and runs, on every rank, in this order:

1. **Exactness.** ``steps`` SGD steps of a small MLP with stock DDP, then the same steps from the
   same initial parameters with DDP and :func:`trainer.collective.ddp_comm_hook` under the plan.
   Each rank trains on its own batches. ``max_abs_param_diff`` is the largest parameter difference
   between the two runs on any rank that is not excluded (degraded ranks included: they step with
   the reduced gradient their carrier sends back). The reference is a *fault-free stock DDP run
   over the ranks that are not excluded*: an excluded rank's gradient is left out of the rerouted
   all-reduce by design, so the reference leaves its data out too (with no ``--exclude`` it is the
   plain stock DDP run over the whole world). An excluded rank keeps its own gradient and is not
   compared. The check passes when ``max_abs_param_diff <= tolerance x param_moved`` (the largest
   change of any parameter in the reference run: summation order differs, so the runs agree to
   float32 rounding, not bit for bit), and every bucket was averaged over every live rank.
2. **Cost.** ``repeats`` rounds, each starting on a world barrier, of: a stock ``all_reduce`` of
   every gradient bucket against :meth:`ReroutedAllReduce.allreduce_` of the same buckets under
   the plan (``healthy_allreduce_s``, ``rerouted_allreduce_s``, ``ratio``); and whole DDP steps
   (forward, backward, SGD) with stock DDP, with the hook and no plan (``hook_overhead_ratio``),
   and with the hook under the plan (``rerouted_ddp_ratio``). The order within a round rotates so
   that a shared machine's noise hits every variant alike. A round's figure is the slowest live
   rank's (a synchronous job moves at the pace of its slowest rank); the reported figure is the
   median over rounds.
3. **Hang** (``hang``): one more hooked DDP step in which the hung rank, a degraded one, SIGSTOPs
   itself before it sends its first bucket. ``hung_step_s`` is the slowest other rank's time for
   that step; the carrier gives up after ``proxy_timeout_s``, so the bound is ``proxy_timeout_s +
   healthy_step_s`` (a stock DDP step). The others then agree on and switch to the plan the
   orchestrator would publish next (the hung rank excluded), take one step
   (``after_hang_step_s``), and finally run the same hang under a stock all-reduce: a world
   all-reduce of the gradient buckets on a gloo group whose timeout is ``stock_timeout_s``
   (``stock_hung_step_s``). Without that timeout a stock all-reduce waits for gloo's default of
   30 minutes (NCCL's: 10), i.e. the job hangs.

The gradient is bucketed like DDP's (``bucket_mb``, default 25, DDP's ``bucket_cap_mb``). The
default model (8 layers of 2048 x 2048, 128 MiB of float32 gradients: 8 all-reduce buckets of one
layer each; DDP forms its own, ``ddp_buckets``) is chosen for several buckets: the carrier's
receive of bucket ``i+1`` overlaps the participants' all-reduce of bucket ``i``, so a one-bucket
model shows the worst case (nothing to overlap) and is not what a real model (hundreds of 25 MB
buckets) sees; 8 buckets keep one run of the check around a minute on a small machine. Every
duration and size is a flag, so that a test runs the whole check in seconds.

The ``targets`` object reports the issue's cost targets (met or not: timings on a shared machine
are noisy, so they do not fail the check); ``failures`` lists what did, and ``ok`` is false then
(``pulse check reroute`` exits 1).

Layout: :class:`CheckConfig`, :func:`parse_ranks`, :func:`make_plan` and :func:`summarize` are pure;
:func:`run_check` starts the ranks and collects their result files; :func:`worker` is one rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped
from torch.nn.parallel import DistributedDataParallel

from clusterpulse.wire import Plan
from trainer.collective import ReroutedAllReduce, ddp_comm_hook, plan_buckets

log = logging.getLogger(__name__)

JOB = "check-reroute"
REFERENCE = (
    "stock DDP without faults over the ranks that are not excluded (their data only); excluded ranks are not compared"
)
_POLL_S = 0.05
_DONE_KEY = "check_reroute/done"  # set by the coordinator once it has every result file


class CheckError(ValueError):
    """A flag with a value the check cannot run with; the message names the flag and the value."""


class CheckFailed(RuntimeError):
    """The ranks did not deliver their results (a rank died, or the check ran past its timeout)."""


# --- Pure parts --------------------------------------------------------------------------------


def parse_ranks(flag: str, text: str | None) -> tuple[int, ...]:
    """``"2,3"`` -> ``(2, 3)``; ``None`` or ``""`` -> ``()`` only when the flag is optional."""
    if text is None:
        return ()
    ranks: list[int] = []
    for part in text.split(","):
        try:
            rank = int(part.strip())
        except ValueError:
            raise CheckError(f"{flag} {text!r}: expected RANK[,RANK] (non-negative integers)") from None
        if rank < 0:
            raise CheckError(f"{flag} {text!r}: rank {rank} is negative")
        if rank in ranks:
            raise CheckError(f"{flag} {text!r}: rank {rank} is listed twice")
        ranks.append(rank)
    return tuple(ranks)


@dataclass(frozen=True)
class CheckConfig:
    """What to check; :meth:`validate` says which flag is wrong. Durations are seconds."""

    world_size: int = 4
    degrade: tuple[int, ...] = ()
    exclude: tuple[int, ...] = ()
    hang: int | None = None
    steps: int = 10
    repeats: int = 10
    hidden: int = 2048
    layers: int = 8
    batch: int = 8
    bucket_mb: float = 25.0
    lr: float = 1.0  # the MSE gradient of a wide MLP is small: this moves the parameters visibly
    proxy_timeout_s: float = 5.0
    stock_timeout_s: float = 20.0
    timeout_s: float = 900.0
    tolerance: float = 1e-3  # of max_abs_param_diff relative to param_moved
    threads: int = 0  # torch threads per rank; 0: this machine's CPUs shared among the ranks
    seed: int = 0

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def live(self) -> tuple[int, ...]:
        """Ranks whose parameters must match the reference: everybody but the excluded."""
        return tuple(r for r in range(self.world_size) if r not in self.exclude)

    def validate(self) -> None:
        w = self.world_size
        if w < 2:
            raise CheckError(f"--world-size {w}: expected at least 2 ranks")
        for flag, ranks in (("--degrade", self.degrade), ("--exclude", self.exclude)):
            for r in ranks:
                if not 0 <= r < w:
                    raise CheckError(f"{flag} {r}: rank outside the world 0..{w - 1} (--world-size {w})")
        if not self.degrade:
            raise CheckError("--degrade: expected at least one rank")
        both = sorted(set(self.degrade) & set(self.exclude))
        if both:
            raise CheckError(f"--degrade/--exclude: rank {both[0]} is both degraded and excluded")
        if len(self.degrade) + len(self.exclude) >= w:
            raise CheckError(
                f"--degrade {_fmt(self.degrade)} --exclude {_fmt(self.exclude)}: every rank of the world of {w} is "
                "degraded or excluded; at least one rank must stay in the all-reduce to carry the others"
            )
        if self.hang is not None and self.hang not in self.degrade:
            raise CheckError(f"--hang {self.hang}: expected one of the degraded ranks {_fmt(self.degrade)}")
        positive_ints = {
            "--steps": self.steps,
            "--repeats": self.repeats,
            "--hidden": self.hidden,
            "--layers": self.layers,
            "--batch": self.batch,
        }
        for flag, n in positive_ints.items():
            if n < 1:
                raise CheckError(f"{flag} {n}: expected at least 1")
        positive = {
            "--bucket-mb": self.bucket_mb,
            "--lr": self.lr,
            "--proxy-timeout": self.proxy_timeout_s,
            "--stock-timeout": self.stock_timeout_s,
            "--timeout": self.timeout_s,
        }
        for flag, x in positive.items():
            if not x > 0:
                raise CheckError(f"{flag} {x}: expected a positive number")
        if self.tolerance < 0:
            raise CheckError(f"--tolerance {self.tolerance}: expected at least 0")
        if self.threads < 0:
            raise CheckError(f"--threads {self.threads}: expected 0 (automatic) or more")


def _fmt(ranks: Iterable[int]) -> str:
    return ",".join(map(str, ranks)) or "''"


def make_plan(world_size: int, degrade: Sequence[int], exclude: Sequence[int], *, generation: int = 1) -> Plan:
    """The plan of the check: each degraded rank carried by the least-loaded participant, nearest
    in ring order (after it) among equals, as the orchestrator's planner does without topology."""
    participants = [r for r in range(world_size) if r not in degrade and r not in exclude]
    load = dict.fromkeys(participants, 0)
    proxies: dict[str, int] = {}
    for d in sorted(degrade):
        carrier = min(participants, key=lambda p: (load[p], (p - d) % world_size))
        load[carrier] += 1
        proxies[str(d)] = carrier
    return Plan(
        job=JOB,
        generation=generation,
        participants=participants,
        proxies=proxies,
        excluded=sorted(exclude),
        reason=f"check: degraded {sorted(degrade)}, excluded {sorted(exclude)}",
    )


def after_hang_plan(plan: Plan, hung: int) -> Plan:
    """What the orchestrator publishes once the carrier reports ``hung`` missing: it is excluded."""
    return Plan(
        job=plan.job,
        generation=plan.generation + 1,
        participants=list(plan.participants),
        proxies={d: c for d, c in plan.proxies.items() if int(d) != hung},
        excluded=sorted([*plan.excluded, hung]),
        reason=f"check: rank {hung} hung",
    )


def _median_of_slowest(results: dict[int, dict[str, Any]], ranks: Iterable[int], key: str) -> float | None:
    """Median over rounds of the slowest of ``ranks`` in each round."""
    series = [results[r][key] for r in ranks if r in results]
    if not series or not series[0]:
        return None
    slowest: list[float] = [max(s[i] for s in series) for i in range(len(series[0]))]
    return statistics.median(slowest)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def _round(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(x, digits)


def _stock_error(errors: list[str | None]) -> str | None:
    """The rank's own timeout if one saw it (the others see their pairs closed by that rank)."""
    seen = [e for e in errors if e]
    return next((e for e in seen if "imed out" in e), seen[0] if seen else None)


def summarize(
    cfg: CheckConfig, plan: Plan, results: dict[int, dict[str, Any]], hang: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """The check's one JSON object, from every rank's result file (and the hang files)."""
    out = _figures(cfg, plan, results)
    failures = _failures(cfg, results, out)
    targets: dict[str, Any] = {
        "ratio_le_1.25": out["ratio"] is not None and out["ratio"] <= 1.25,
        "hook_overhead_ratio_le_1.02": out["hook_overhead_ratio"] is not None and out["hook_overhead_ratio"] <= 1.02,
    }
    if cfg.hang is not None:
        _hang_figures(cfg, hang, out, targets, failures)
    out["targets"] = targets
    out["failures"] = failures
    out["ok"] = not failures
    return out


def _figures(cfg: CheckConfig, plan: Plan, results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What was run, the exactness figures and the timings (per round the slowest live rank)."""
    live = cfg.live
    carriers = sorted(set(plan.proxies.values()))
    roles = {
        "participant": [r for r in plan.participants if r not in carriers],
        "carrier": carriers,
        "degraded": sorted(int(d) for d in plan.proxies),
    }
    diffs = [results[r]["param_diff"] for r in live]
    moved = min(results[r]["param_moved"] for r in live)
    healthy = _median_of_slowest(results, range(cfg.world_size), "stock_allreduce_s")
    rerouted = _median_of_slowest(results, live, "rerouted_allreduce_s")
    stock_ddp = _median_of_slowest(results, range(cfg.world_size), "stock_ddp_s")
    hook_ddp = _median_of_slowest(results, range(cfg.world_size), "hook_ddp_s")
    rerouted_ddp = _median_of_slowest(results, live, "rerouted_ddp_s")
    any_rank = results[live[0]]
    return {
        "world_size": cfg.world_size,
        "degraded": sorted(cfg.degrade),
        "excluded": sorted(cfg.exclude),
        "plan": {"participants": plan.participants, "proxies": plan.proxies, "excluded": plan.excluded},
        "steps": cfg.steps,
        "repeats": cfg.repeats,
        "model": {
            "hidden": cfg.hidden,
            "layers": cfg.layers,
            "batch": cfg.batch,
            "params": any_rank["params"],
            "grad_bytes": any_rank["grad_bytes"],
        },
        "bucket_mb": cfg.bucket_mb,
        "allreduce_buckets": any_rank["allreduce_buckets"],
        "ddp_buckets": any_rank["ddp_buckets"],
        "threads_per_rank": any_rank["threads"],
        "max_abs_param_diff": max(diffs),
        "param_diff_reference": REFERENCE,
        "param_moved": moved,
        "relative_param_diff": None if not moved else max(diffs) / moved,
        "tolerance": cfg.tolerance,
        "contributors": sorted({c for r in live for c in results[r]["contributors"]}),
        "healthy_allreduce_s": _round(healthy),
        "rerouted_allreduce_s": _round(rerouted),
        "ratio": _ratio(rerouted, healthy),
        "rerouted_allreduce_by_role_s": {
            role: _round(_median_of_slowest(results, ranks, "rerouted_allreduce_s")) for role, ranks in roles.items()
        },
        "stock_ddp_step_s": _round(stock_ddp),
        "hook_ddp_step_s": _round(hook_ddp),
        "hook_overhead_ratio": _ratio(hook_ddp, stock_ddp),
        "rerouted_ddp_step_s": _round(rerouted_ddp),
        "rerouted_ddp_ratio": _ratio(rerouted_ddp, stock_ddp),
        "timing": "per round the slowest live rank, median over rounds; rounds start on a world barrier",
    }


def _failures(cfg: CheckConfig, results: dict[int, dict[str, Any]], out: dict[str, Any]) -> list[str]:
    """What makes the check fail without a hang: parameters that did not move or moved apart,
    a carrier giving up without a fault, a bucket divided by another count than the live ranks."""
    live = cfg.live
    moved, diff = out["param_moved"], out["max_abs_param_diff"]
    failures: list[str] = []
    if not moved:
        failures.append("the parameters did not move: the comparison would be vacuous (raise --lr or --steps)")
    elif not diff <= cfg.tolerance * moved:
        failures.append(
            f"max_abs_param_diff {diff:.3g} exceeds --tolerance {cfg.tolerance:g} x param_moved {moved:.3g}"
        )
    lost = {r: results[r]["missing"] for r in live if results[r]["missing"]}
    if lost:
        failures.append(f"carriers gave up on degraded ranks without a fault: {lost}")
    if out["contributors"] != [len(live)]:
        failures.append(f"bucket divisors {out['contributors']}, expected [{len(live)}] (every live rank)")
    return failures


def _hang_figures(
    cfg: CheckConfig, hang: dict[int, dict[str, Any]], out: dict[str, Any], targets: dict[str, Any], failures: list[str]
) -> None:
    """The hung rank's part: its carrier's step against the bound, what the carrier reported, and
    the stock all-reduce's hang beside it; added to ``out``, ``targets`` and ``failures``."""
    assert cfg.hang is not None
    others = [r for r in range(cfg.world_size) if r != cfg.hang]
    missing = sorted(m for r in others for m in hang.get(r, {}).get("missing", []))
    hung_step = max(hang[r]["hung_step_s"] for r in others)
    stock_ddp = out["stock_ddp_step_s"]
    bound = cfg.proxy_timeout_s + (stock_ddp or 0.0)
    stock_hung = max(hang[r]["stock_hung_step_s"] for r in others)
    out.update(
        {
            "hung_rank": cfg.hang,
            "hung_step_s": _round(hung_step),
            "proxy_timeout_s": cfg.proxy_timeout_s,
            "healthy_step_s": stock_ddp,
            "hung_step_bound_s": _round(bound),
            "carrier_reported_missing": missing,
            "after_hang_step_s": _round(max(hang[r]["after_hang_step_s"] for r in others)),
            "stock_hung_step_s": _round(stock_hung),
            "stock_timeout_s": cfg.stock_timeout_s,
            "stock_hang_error": _stock_error([hang[r]["stock_error"] for r in others]),
        }
    )
    targets["hung_step_le_proxy_timeout_plus_healthy_step"] = hung_step <= bound
    if missing != [cfg.hang]:
        failures.append(f"the carrier reported {missing} missing, expected [{cfg.hang}]")
    if not hung_step < stock_hung:
        failures.append(f"hung_step_s {hung_step:.3f} is not below stock_hung_step_s {stock_hung:.3f}")
    after = sorted({c for r in others for c in hang[r]["after_contributors"]})
    if after != [len(cfg.live) - 1]:
        failures.append(f"bucket divisors after the hang {after}, expected [{len(cfg.live) - 1}]")


# --- The coordinator ---------------------------------------------------------------------------


def run_check(cfg: CheckConfig) -> dict[str, Any]:
    """Run the check (see the module docstring) and return its summary; raises :class:`CheckError`
    for a bad config and :class:`CheckFailed` when the ranks did not all deliver."""
    cfg.validate()
    plan = make_plan(cfg.world_size, cfg.degrade, cfg.exclude)
    # The store lives here, not in rank 0: a SIGSTOPped rank 0 would take the store with it.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    config = json.dumps(dataclasses.asdict(cfg))
    procs: dict[int, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="pulse-check-reroute-") as tmp:
        out_dir = Path(tmp)
        logs = {r: out_dir / f"rank{r}.log" for r in range(cfg.world_size)}
        try:
            for r in range(cfg.world_size):
                with logs[r].open("wb") as fh:
                    procs[r] = subprocess.Popen(
                        [sys.executable, "-m", "trainer.check_reroute", "worker", config, str(r), str(store.port), tmp],
                        env=env,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            log.info("check reroute started world_size=%d plan=%s hang=%s", cfg.world_size, plan.proxies, cfg.hang)
            wanted = {r: [out_dir / f"rank{r}.json"] for r in range(cfg.world_size)}
            if cfg.hang is not None:
                for r in range(cfg.world_size):
                    wanted[r] += [] if r == cfg.hang else [out_dir / f"rank{r}.hang.json"]
            _wait_for_files(wanted, procs, logs, deadline=time.monotonic() + cfg.timeout_s)
            results = {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(cfg.world_size)}
            hang = {
                r: json.loads((out_dir / f"rank{r}.hang.json").read_text())
                for r in range(cfg.world_size)
                if (out_dir / f"rank{r}.hang.json").exists()
            }
            store.set(_DONE_KEY, "1")
            _wait_for_exit(procs, hang=cfg.hang, deadline=time.monotonic() + 10)
        finally:
            _stop_all(procs)
    return summarize(cfg, plan, results, hang)


def _wait_for_files(
    wanted: dict[int, list[Path]],
    procs: dict[int, subprocess.Popen[bytes]],
    logs: dict[int, Path],
    *,
    deadline: float,
) -> None:
    """Poll until every rank's files exist; fail as soon as a rank exits without them."""
    while True:
        if all(p.exists() for paths in wanted.values() for p in paths):
            return
        for rank, proc in procs.items():
            rc = proc.poll()  # None for a running or a stopped (the hung) rank
            if rc is not None and not all(p.exists() for p in wanted[rank]):
                raise CheckFailed(f"rank {rank} exited with {rc} before delivering its results\n" + _tails(logs))
        if time.monotonic() > deadline:
            late = [p.name for paths in wanted.values() for p in paths if not p.exists()]
            raise CheckFailed(f"no {', '.join(late)} within --timeout; rank logs follow\n" + _tails(logs))
        time.sleep(_POLL_S)


def _wait_for_exit(procs: dict[int, subprocess.Popen[bytes]], *, hang: int | None, deadline: float) -> None:
    """Give the ranks (all but the hung one) a moment to leave by themselves."""
    while time.monotonic() < deadline and any(p.poll() is None for r, p in procs.items() if r != hang):
        time.sleep(_POLL_S)


def _stop_all(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    """Kill what is left (the hung rank above all: SIGKILL ends a stopped process too), by pid."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    for proc in procs.values():
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            log.warning("check reroute rank pid=%d did not exit after SIGKILL", proc.pid)


def _tails(logs: dict[int, Path]) -> str:
    return "\n".join(f"--- rank {r}\n{p.read_text(errors='replace')[-2000:]}" for r, p in logs.items() if p.exists())


# --- One rank ----------------------------------------------------------------------------------


class _HangingReroute(ReroutedAllReduce):
    """The hung rank's collective: once armed, it SIGSTOPs itself instead of sending a bucket."""

    armed = False

    def _send_to_carrier(self, flat: torch.Tensor, carrier: int, group: dist.ProcessGroup) -> dist.Work:
        if self.armed:
            os.kill(os.getpid(), signal.SIGSTOP)
        return super()._send_to_carrier(flat, carrier, group)


def build_model(cfg: CheckConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)
    layers: list[nn.Module] = []
    for i in range(cfg.layers):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(cfg.hidden, cfg.hidden))
    return nn.Sequential(*layers)


def batch(cfg: CheckConfig, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    return torch.randn(cfg.batch, cfg.hidden, generator=g), torch.randn(cfg.batch, cfg.hidden, generator=g)


class _Trainer:
    """A model under DDP (stock, or with the rerouting hook) and its optimizer."""

    def __init__(
        self, cfg: CheckConfig, *, reroute: ReroutedAllReduce | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        self.cfg = cfg
        self.model = build_model(cfg)
        self.ddp = DistributedDataParallel(
            self.model, process_group=group, bucket_cap_mb=cfg.bucket_mb, broadcast_buffers=False
        )
        if reroute is not None:
            self.ddp.register_comm_hook(state=reroute, hook=ddp_comm_hook)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=cfg.lr)

    def step(self, rank: int, step: int) -> float:
        """One training step; returns its duration in seconds."""
        x, y = batch(self.cfg, rank, step)
        t0 = time.perf_counter()
        self.opt.zero_grad()
        torch.autograd.backward(nn.functional.mse_loss(self.ddp(x), y))
        self.opt.step()
        return time.perf_counter() - t0

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _stock_allreduce_(
    tensors: Sequence[torch.Tensor], buckets: list[list[int]], group: dist.ProcessGroup | None
) -> None:
    """The healthy baseline: one stock world ``all_reduce`` per bucket (async, like DDP), averaged."""
    flats = [torch.cat([tensors[j].reshape(-1) for j in idx]) for idx in buckets]
    works = [dist.all_reduce(f, group=group, async_op=True) for f in flats]
    size = dist.get_world_size(group)
    for work, flat, idx in zip(works, flats, buckets, strict=True):
        assert work is not None
        work.wait()
        flat.div_(size)
        for t, piece in zip(
            [tensors[j] for j in idx], torch.split(flat, [tensors[j].numel() for j in idx]), strict=True
        ):
            t.copy_(piece.view_as(t))


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(cfg: CheckConfig, rank: int, store_port: int, out_dir: Path) -> None:
    """One rank of the check; writes ``rankN.json`` (and ``rankN.hang.json``) into ``out_dir``."""
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // cfg.world_size)
    torch.set_num_threads(threads)
    store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=cfg.world_size, timeout=timedelta(seconds=cfg.timeout_s)
    )
    plan = make_plan(cfg.world_size, cfg.degrade, cfg.exclude)
    # Groups first, in the same order on every rank (torch names groups by a per-process counter).
    survivors = dist.new_group(ranks=list(cfg.live)) if cfg.exclude else None
    stock_group = (
        dist.new_group(ranks=list(range(cfg.world_size)), timeout=timedelta(seconds=cfg.stock_timeout_s))
        if cfg.hang is not None
        else None
    )
    others = dist.new_group(ranks=[r for r in range(cfg.world_size) if r != cfg.hang]) if cfg.hang is not None else None
    kwargs: dict[str, Any] = {
        "world_size": cfg.world_size,
        "rank": rank,
        "proxy_timeout_s": cfg.proxy_timeout_s,
        "bucket_bytes": cfg.bucket_bytes,
        "peer_timeout_s": max(cfg.timeout_s, cfg.proxy_timeout_s),
    }
    reroute = _HangingReroute(**kwargs) if rank == cfg.hang else ReroutedAllReduce(**kwargs)
    plain_hook = ReroutedAllReduce(**kwargs)  # no plan: what the hook costs when nobody is degraded
    reroute.switch(reroute.agree_plan(plan))
    out: dict[str, Any] = {"rank": rank, "role": reroute.role, "threads": threads}

    out.update(_exactness(cfg, rank, reroute, survivors))
    rerouted, buckets = _costs(cfg, rank, reroute, plain_hook, out)
    _write(out_dir / f"rank{rank}.json", out)
    if cfg.hang is not None:
        assert stock_group is not None and others is not None
        hang = _hang(
            cfg, rank, plan, reroute, rerouted=rerouted, buckets=buckets, stock_group=stock_group, others=others
        )
        _write(out_dir / f"rank{rank}.hang.json", hang)
    # Stay until every rank has delivered: a rank that leaves closes its connections, and a peer
    # still inside a collective with it would fail early ("Connection closed by peer").
    store.wait([_DONE_KEY], timedelta(seconds=cfg.timeout_s))
    # Leave without tearing down gloo: a hung peer would keep destroy_process_group waiting, and
    # gloo threads outliving interpreter teardown abort the exit (see trainer/example.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exactness(
    cfg: CheckConfig, rank: int, reroute: ReroutedAllReduce, survivors: dist.ProcessGroup | None
) -> dict[str, Any]:
    """1. Stock DDP over the ranks not excluded, then the hook under the plan, the same steps."""
    reference = initial = None
    if rank in cfg.live:
        stock = _Trainer(cfg, group=survivors)
        initial = stock.params()
        for step in range(cfg.steps):
            stock.step(rank, step)
        reference = stock.params()
        del stock
    hooked = _Trainer(cfg, reroute=reroute)
    for step in range(cfg.steps):
        hooked.step(rank, step)
    params = hooked.params()
    return {
        "param_diff": None if reference is None else _max_diff(params, reference),
        "param_moved": None if reference is None or initial is None else _max_diff(initial, reference),
        "params": sum(p.numel() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "contributors": reroute.last_contributors,
    }


def _costs(
    cfg: CheckConfig, rank: int, reroute: ReroutedAllReduce, plain_hook: ReroutedAllReduce, out: dict[str, Any]
) -> tuple[_Trainer, list[list[int]]]:
    """2. Cost, in rounds that start on a barrier; the order of the variants rotates per round.
    The timings go into ``out``; returns the rerouted trainer and the all-reduce's buckets."""
    grads = [torch.randn_like(p) for p in build_model(cfg).parameters()]
    buckets = plan_buckets([(g.numel(), g.dtype) for g in grads], cfg.bucket_bytes)
    stock = _Trainer(cfg)
    plain = _Trainer(cfg, reroute=plain_hook)
    rerouted = _Trainer(cfg, reroute=reroute)
    variants: dict[str, Callable[[int], float]] = {
        "stock_allreduce_s": lambda _: _timed(lambda: _stock_allreduce_(grads, buckets, None)),
        "rerouted_allreduce_s": lambda _: _timed(lambda: reroute.allreduce_(grads)),
        "stock_ddp_s": lambda step: stock.step(rank, step),
        "hook_ddp_s": lambda step: plain.step(rank, step),
        "rerouted_ddp_s": lambda step: rerouted.step(rank, step),
    }
    names = list(variants)
    for step in range(2):  # warm-up; DDP also rebuilds its buckets (on the world group) here
        for name in names:
            dist.barrier()
            variants[name](cfg.steps + step)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(cfg.repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            times[name].append(variants[name](cfg.steps + 2 + i))
    out.update(times)
    out["allreduce_buckets"] = len(buckets)
    out["ddp_buckets"] = len(plain_hook.last_contributors)
    out["missing"] = {str(k): v for k, v in reroute.missing.items()}
    if reroute.role != "excluded":  # the divisors of the last rerouted step (excluded: nothing)
        out["contributors"] = sorted({*out["contributors"], *reroute.last_contributors})
    return rerouted, buckets


def _hang(
    cfg: CheckConfig,
    rank: int,
    plan: Plan,
    reroute: ReroutedAllReduce,
    *,
    rerouted: _Trainer,
    buckets: list[list[int]],
    stock_group: dist.ProcessGroup,
    others: dist.ProcessGroup,
) -> dict[str, Any]:
    """3. A degraded rank hangs mid-run: rerouted, then the same hang under a stock all-reduce."""
    assert cfg.hang is not None
    dist.barrier()
    step = cfg.steps + 2 + cfg.repeats
    if isinstance(reroute, _HangingReroute):
        reroute.armed = True  # stops in this step's backward, before its first bucket
    hang: dict[str, Any] = {"hung_step_s": rerouted.step(rank, step)}
    hang["missing"] = sorted(reroute.missing)
    reroute.switch(reroute.agree_plan(after_hang_plan(plan, cfg.hang)))
    dist.barrier(group=others)
    hang["after_hang_step_s"] = rerouted.step(rank, step + 1)
    hang["after_contributors"] = [] if reroute.role == "excluded" else reroute.last_contributors
    model = build_model(cfg)  # no DDP: a stock all-reduce of the gradient below
    x, y = batch(cfg, rank, step + 2)
    dist.barrier(group=others)  # the same start everywhere: a rank's timeout closes its peers' pairs
    t0 = time.perf_counter()
    torch.autograd.backward(nn.functional.mse_loss(model(x), y))
    try:
        _stock_allreduce_([p.grad for p in model.parameters() if p.grad is not None], buckets, stock_group)
        hang["stock_error"] = None
    except RuntimeError as exc:  # gloo's timeout: the outcome expected here
        hang["stock_error"] = str(exc).splitlines()[0][:200]
    hang["stock_hung_step_s"] = time.perf_counter() - t0
    return hang


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def _worker_main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.check_reroute")
    p.add_argument("role", choices=("worker",))
    p.add_argument("config", help="CheckConfig as JSON")
    p.add_argument("rank", type=int)
    p.add_argument("store_port", type=int)
    p.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    raw = json.loads(args.config)
    raw["degrade"], raw["exclude"] = tuple(raw["degrade"]), tuple(raw["exclude"])
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s level=%(levelname)s rank={args.rank} logger=%(name)s %(message)s",
        stream=sys.stderr,
    )
    worker(CheckConfig(**raw), args.rank, args.store_port, args.out_dir)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])

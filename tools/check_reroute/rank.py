"""One rank of ``pulse check reroute`` (``python -m tools.check_reroute.rank worker ...``): exactness
against stock DDP, the cost rounds and the hang, each written to a result file for the
coordinator (docs/design/check-reroute.md)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped
from torch.nn.parallel import DistributedDataParallel

from clusterpulse.wire import Plan
from tools.check_reroute.check import DONE_KEY, CheckConfig, after_hang_plan, make_plan
from trainer.collective import ReroutedAllReduce, ddp_comm_hook
from trainer.route import plan_buckets

log = logging.getLogger(__name__)


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
    store.wait([DONE_KEY], timedelta(seconds=cfg.timeout_s))
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
    p = argparse.ArgumentParser(prog="python -m tools.check_reroute.rank")
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

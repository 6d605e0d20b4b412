"""A small GPT trained with DeepSpeed on a learnable synthetic sequence, reporting to ClusterPulse.

``python -m trainer.example [--steps N] ...`` runs on CPUs (gloo) and on GPUs (nccl, bf16 where
supported) unchanged. It is launched by the ``deepspeed`` launcher (which passes
``--local_rank``), by ``torchrun``, or by anything that sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; with none of them set it runs as a single
rank on a free local port.

Data: sequences where the next token is ``(3 * token + 1) % vocab`` from a random start, so
the loss falls within a few steps; each rank draws its own batches (seeded by ``--seed`` and the
rank), the model starts identical on every rank.

Reporting (``--report``, the default, when ``PULSE_REDIS_URL`` is set): every rank publishes a
:class:`clusterpulse.wire.TrainerReport` per optimizer step through
:class:`trainer.report.TrainerReporter` to ``PULSE_REDIS_URL``; a Redis that does not answer at
start is logged and retried in the background, never waited for. MFU needs a peak: the GPU's
from the table in :mod:`trainer.mfu`, or ``PULSE_PEAK_FLOPS`` (required on a CPU).

Rerouting (``--reroute``, the default, with reporting on): the engine's gradient reduction goes
through :class:`trainer.collective.ReroutedAllReduce` (:func:`trainer.deepspeed_reroute.attach`)
and a :class:`trainer.follow.PlanFollower` puts the orchestrator's plans in force at step
boundaries. A rank its carrier gave up on is reported (``unreachable_ranks``), so the next plan
excludes it; a rank the plan in force excludes stops training and leaves with exit code 0 (its
node was LOST; the others go on without it). ``--proxy-timeout`` (``PULSE_PROXY_TIMEOUT_S``,
default 30 s) bounds what a hung degraded rank costs its carrier per step.

Surviving a dead or hung participant (``--collective-timeout``, ``PULSE_COLLECTIVE_TIMEOUT_S``;
off by default): the plan's groups are made with that timeout, a step whose collective fails
(a peer died or hangs) is skipped on every survivor (gradients zeroed, no update), the
survivors agree on a plan that excludes the failed rank (:meth:`trainer.follow.PlanFollower.recover`:
through the job's TCPStore: the agent of the first node hosts it, so any rank may fail, rank 0
included; started otherwise, rank 0 hosts it and must survive), switch to it,
take the new root's parameters, optimizer state and step count, and go on. No restart. A rank
that finds itself excluded (a hung one that wakes up) leaves with exit code 0. Each rank beats
in the job's store every ``--collective-timeout / 10`` seconds (0.05 to 1), so a hung rank, whose
beat stands still, is reported without waiting out the survivors' survey.
``--recovery-timeout`` (``PULSE_RECOVERY_TIMEOUT_S``, default 120 s) bounds the wait for that
plan; past it the rank fails.

Rejoining (``--rejoin``, ``PULSE_REJOIN=1``, which the orchestrator sets when it launches an
excluded node's share anew, ``services/jobs.py``): the rank cannot enter the live ranks' world
(its size was fixed at ``init_process_group``), so it makes a world of one for itself, connects
to the job's store (``MASTER_ADDR:MASTER_PORT``, as every rank does with a collective timeout),
registers, and waits (:meth:`trainer.follow.PlanFollower.join`) until the live ranks put in
force a plan that counts on it; at that boundary every live rank takes the parameters, optimizer
state, step count and learning rate of a rank that stayed (``PlanFollower.source``), and the
restarted rank trains on from that rank's step. A rank whose job finished while it waited leaves with 0.

Emergency checkpoint: ``SIGUSR2`` to any rank asks for ``engine.save_checkpoint`` into
``--checkpoint-dir`` (tag ``emergency-stepN``) at the next step boundary, then training goes
on. All ranks must save together, so with a checkpoint dir each step ends with a one-element
max all-reduce of the "requested" flag.

The lowest participant (rank 0 unless a plan took it out) prints one JSON line at the end:
``{"steps", "first_loss", "final_loss", "world_size", "plan_generation", "contributors"}`` (losses
averaged over the ranks still contributing).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import HashStore, TCPStore  # torch.distributed re-exports them untyped

from trainer import deepspeed_reroute
from trainer.collective import ReroutedAllReduce
from trainer.follow import JobFinished, PlanFollower, RecoveryError, forget_invitation
from trainer.mfu import model_flops_per_token, peak_flops
from trainer.report import StepTimer, TrainerReporter, cosine_warmup, env_peak_flops

log = logging.getLogger("pulse.trainer.example")


# --- the model ----------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP, each residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        mlp: torch.Tensor = self.mlp(self.ln2(x))
        return x + mlp


class TinyGPT(nn.Module):
    def __init__(self, *, vocab: int, seq_len: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(gen: torch.Generator, *, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of sequences following ``t -> (3 t + 1) % vocab``."""
    seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for i in range(1, seq_len + 1):
        seq[:, i] = (seq[:, i - 1] * 3 + 1) % vocab
    return seq[:, :-1], seq[:, 1:]


# --- setup ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.example", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--warmup", type=int, default=0, help="linear warmup steps before the cosine decay")
    p.add_argument("--job", default=os.environ.get("PULSE_JOB_ID") or "local", help="job id in the reports")
    p.add_argument(
        "--report",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="publish a TrainerReport per step to PULSE_REDIS_URL (default on)",
    )
    p.add_argument(
        "--reroute",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="follow the orchestrator's gradient-aggregation plans (default on; needs reporting)",
    )
    p.add_argument(
        "--proxy-timeout",
        type=float,
        default=_env_float("PULSE_PROXY_TIMEOUT_S", 30.0),
        help="seconds a carrier waits for a degraded rank per step (PULSE_PROXY_TIMEOUT_S, default 30)",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=_env_float("PULSE_COLLECTIVE_TIMEOUT_S", 0.0),
        help="seconds a plan's collective may wait for a participant before the survivors go on without it "
        "(PULSE_COLLECTIVE_TIMEOUT_S; default 0: off, a dead participant fails the job)",
    )
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=_env_float("PULSE_RECOVERY_TIMEOUT_S", 120.0),
        help="seconds survivors wait for a plan without a failed rank (PULSE_RECOVERY_TIMEOUT_S, default 120)",
    )
    p.add_argument(
        "--rejoin",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("PULSE_REJOIN", "") == "1",
        help="this rank was restarted while the job runs on: join the live ranks at a step boundary and take "
        "their state instead of starting a world (PULSE_REJOIN=1, set by the orchestrator's relaunch; "
        "needs --collective-timeout)",
    )
    p.add_argument("--plan-poll", type=float, default=1.0, help="seconds between plan reads besides notifications")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="where SIGUSR2 saves an emergency checkpoint")
    p.add_argument("--deepspeed_config", "--deepspeed-config", type=Path, default=None, help="DeepSpeed JSON config")
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="seconds of sleep added to each step (simulates a bigger model; lets tests signal mid-run)",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    for name in ("steps", "seq_len", "layers", "hidden", "heads", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.collective_timeout < 0:
        p.error(f"--collective-timeout={args.collective_timeout}: expected seconds >= 0 (0: off)")
    if args.rejoin and not (args.collective_timeout > 0 and args.reroute and args.report):
        p.error("--rejoin: needs --collective-timeout > 0 with --reroute and --report (the live ranks' plans)")
    for name in ("proxy_timeout", "plan_poll", "recovery_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected seconds > 0")
    if args.hidden % args.heads:
        p.error(f"--hidden={args.hidden}: expected a multiple of --heads={args.heads}")
    return args


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r}: expected seconds as a number") from None


def default_config(*, bf16: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def load_config(path: Path | None, *, bf16: bool) -> dict[str, Any]:
    """The job's DeepSpeed config: ``PULSE_DEEPSPEED_CONFIG`` (JSON, set by the agents), else the
    ``--deepspeed_config`` file, else :func:`default_config`."""
    raw = os.environ.get("PULSE_DEEPSPEED_CONFIG")
    if raw:
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"PULSE_DEEPSPEED_CONFIG: not valid JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise SystemExit(f"PULSE_DEEPSPEED_CONFIG: expected a JSON object, got {type(cfg).__name__}")
        if cfg:
            return cfg
    if path is not None:
        loaded = json.loads(path.read_text())
        if not isinstance(loaded, dict):
            raise SystemExit(f"--deepspeed_config={path}: expected a JSON object")
        return loaded
    return default_config(bf16=bf16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _single_rank_env() -> None:
    """Without a launcher: one rank on this host (DeepSpeed would otherwise look for MPI)."""
    if "RANK" in os.environ:
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def _redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        return bool(client.ping())
    except (redis.exceptions.RedisError, OSError):
        return False
    finally:
        client.close()


def _checkpoint_boundary(
    args: argparse.Namespace, engine: Any, reroute: ReroutedAllReduce | None, *, rank: int, step: int, requested: bool
) -> bool:
    """Save an emergency checkpoint when any rank asked for one (a flag all-reduced every step);
    True when one was saved."""
    import deepspeed.comm as dist

    assert args.checkpoint_dir is not None
    flag = torch.tensor([1.0 if requested else 0.0], device=engine.device)
    if reroute is not None:
        reroute.allreduce_([flag])  # a mean > 0 when any rank asked; never waits on a lost rank
    else:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        tag = f"emergency-step{step}"
        engine.save_checkpoint(str(args.checkpoint_dir), tag=tag, client_state={"step": step})
        if rank == (0 if reroute is None else reroute.root):
            log.info(json.dumps({"event": "checkpoint", "step": step, "dir": str(args.checkpoint_dir / tag)}))
        return True
    return False


def _take_state(engine: Any, reroute: ReroutedAllReduce, completed: int, *, src: int) -> int:
    """After a recovery or a rank's return: every live rank takes ``src``'s parameters, optimizer
    state, step count and learning rate (a survivor may have completed the failed step's update
    when another did not; a restarted rank has nothing). Returns ``src``'s last completed step."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed may wrap the torch optimizer
    tensors = [p.data for p in engine.module.parameters()]
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            tensors.extend(state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor))
    sched = engine.lr_scheduler
    header = torch.tensor(
        [
            float(completed),
            float(engine.global_steps),
            float(getattr(sched, "last_epoch", -1)),
            float(len(tensors)),
            *[float(g.get("step", 0) or 0) for g in opt.param_groups],
            *[float(g["lr"]) for g in opt.param_groups],
        ],
        dtype=torch.float64,
    )
    reroute.share_(header, src=src)
    if int(header[3].item()) != len(tensors):
        raise RuntimeError(
            f"rank {reroute.rank}: {len(tensors)} state tensors here, {int(header[3].item())} on rank {src} "
            "(an optimizer that has not stepped yet has no state)"
        )
    if tensors:
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        reroute.share_(flat, src=src)
        for t, piece in zip(tensors, torch.split(flat, [t.numel() for t in tensors]), strict=True):
            t.copy_(piece.view_as(t))
    engine.global_steps = int(header[1].item())
    if sched is not None and hasattr(sched, "last_epoch"):
        sched.last_epoch = int(header[2].item())
    n = len(opt.param_groups)
    for g, v, lr in zip(opt.param_groups, header[4 : 4 + n].tolist(), header[4 + n :].tolist(), strict=True):
        if "step" in g:
            g["step"] = int(v)
        g["lr"] = lr
    return int(header[0].item())


def _materialize_optimizer_state(engine: Any) -> None:
    """A restarted rank: give its optimizer the state tensors the live ranks' optimizers have (torch
    optimizers make them at the first step), by one step on zero gradients, so that
    :func:`_take_state` can overwrite them with the live ranks'. Parameters change at most by
    weight decay; the sync overwrites them too."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    params = [p for group in opt.param_groups for p in group["params"]]
    if all(opt.state.get(p) for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None


def _grad_norm(model: nn.Module) -> float | None:
    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in model.parameters() if p.grad is not None]
    if not norms:
        return None
    return float(torch.linalg.vector_norm(torch.stack(norms)))


# --- the run ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    _single_rank_env()
    if args.local_rank is not None and "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if cuda else "gloo"
    if args.rejoin:
        # The live ranks' world cannot take a new process; this rank works through the plans'
        # groups (trainer.collective), so its own world group is a world of one.
        torch.distributed.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend=backend)
    if not args.rejoin:
        rank, world = dist.get_rank(), dist.get_world_size()
    job_store = None
    if args.collective_timeout > 0 and args.reroute and args.report and os.environ.get("PULSE_REDIS_URL"):
        # Every rank, first or restarted, agrees and makes groups through the rendezvous store.
        job_store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=args.recovery_timeout),
            wait_for_workers=False,
        )
        if args.rejoin:
            forget_invitation(job_store, job=args.job, rank=rank)  # before registering: see trainer.follow

    config = load_config(args.deepspeed_config, bf16=cuda and torch.cuda.is_bf16_supported())
    if args.rejoin and "train_batch_size" in config:
        # DeepSpeed checks train_batch_size = micro * accumulation * its world, which is one here
        config = {**config, "train_batch_size": int(config["train_batch_size"]) // world}
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = TinyGPT(vocab=args.vocab, seq_len=args.seq_len, hidden=args.hidden, layers=args.layers, heads=args.heads)
    n_params = sum(p.numel() for p in model.parameters())

    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        # cosine_warmup with base_lr=1 is the factor on the optimizer's configured lr
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: cosine_warmup(s, warmup=args.warmup, total=args.steps, base_lr=1.0, min_lr=0.1)
        )

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        lr_scheduler=None if "scheduler" in config else schedule,  # a configured scheduler wins
    )
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    tokens_per_step = micro * gas * args.seq_len

    reporter = None
    url = os.environ.get("PULSE_REDIS_URL", "")
    if args.report and not url:
        log.info("event=reporting_off rank=%d reason=PULSE_REDIS_URL_unset", rank)
    if args.report and url:
        if not _redis_answers(url):
            log.warning("event=redis_unavailable url=%s rank=%d note=reports_retried_in_background", url, rank)
        dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else None
        device_name = torch.cuda.get_device_name(local_rank) if cuda else "cpu"
        peak = env_peak_flops()
        if peak is None and dtype is not None:
            peak = peak_flops(device_name, dtype=dtype)
        if peak is None:
            log.info("event=mfu_unavailable device=%r note=set_PULSE_PEAK_FLOPS rank=%d", device_name, rank)
        reporter = TrainerReporter(
            job=args.job,
            rank=rank,
            local_rank=local_rank,
            world_size=world,
            redis_url=url,
            flops_per_token=model_flops_per_token(
                params=n_params, layers=args.layers, hidden=args.hidden, seq_len=args.seq_len
            ),
            peak_flops_per_device=peak,
            tokens_per_step=tokens_per_step,
        )

    reroute: ReroutedAllReduce | None = None
    follower: PlanFollower | None = None
    bounded = args.collective_timeout > 0
    if args.reroute and reporter is not None:
        reroute = ReroutedAllReduce(
            world_size=world,
            rank=rank,
            proxy_timeout_s=args.proxy_timeout,
            # a degraded rank learns that its carrier's group broke only when the answer does not come
            peer_timeout_s=args.proxy_timeout + 2 * args.collective_timeout + 1.0 if bounded else 300.0,
            collective_timeout_s=args.collective_timeout if bounded else None,
            store=job_store,
        )
        deepspeed_reroute.attach(engine, reroute, rejoining=args.rejoin)
        follower = PlanFollower(
            job=args.job,
            reroute=reroute,
            redis_url=url,
            poll_s=args.plan_poll,
            # the liveness beat that lets survivors report a hung rank early (trainer/follow.py)
            beat_s=min(1.0, max(0.05, args.collective_timeout / 10)) if bounded else None,
        )
    elif args.rejoin:
        raise SystemExit("--rejoin: PULSE_REDIS_URL is unset, so this rank cannot follow the live ranks' plans")

    checkpoint_requested = False

    def on_sigusr2(signum: int, frame: FrameType | None) -> None:
        nonlocal checkpoint_requested
        checkpoint_requested = True

    signal.signal(signal.SIGUSR2, on_sigusr2)

    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    first_loss = final_loss = float("nan")
    timer = StepTimer()
    step = completed = 0
    failures_here = 0  # recoveries without a completed step in between
    if args.rejoin:
        assert follower is not None and reroute is not None
        try:
            follower.join(timeout_s=args.recovery_timeout)
        except JobFinished as exc:
            log.warning("event=rejoin_abandoned job=%s rank=%d reason=%r", args.job, rank, str(exc))
            follower.close()
            if reporter is not None:
                reporter.close(timeout=5.0)
            return 0
        _materialize_optimizer_state(engine)
        step = completed = _take_state(engine, reroute, 0, src=follower.source)
        log.warning("event=rejoined job=%s rank=%d step=%d", args.job, rank, step)
        if args.checkpoint_dir is not None:  # the rest of the boundary the live ranks are at
            _checkpoint_boundary(args, engine, reroute, rank=rank, step=step, requested=False)
    try:
        while step < args.steps:
            step += 1
            try:
                losses = []
                grad_norm = None
                for _ in range(gas):
                    x, y = synthetic_batch(gen, batch=micro, seq_len=args.seq_len, vocab=args.vocab)
                    loss = engine(x.to(engine.device), y.to(engine.device))
                    engine.backward(loss)
                    if engine.is_gradient_accumulation_boundary():
                        grad_norm = _grad_norm(engine.module)  # reduced grads, before step() clears them
                    engine.step()
                    losses.append(loss.item())
                completed = step
                if args.step_delay > 0:
                    time.sleep(args.step_delay)
                step_loss = sum(losses) / len(losses)
                first_loss = step_loss if step == 1 else first_loss
                final_loss = step_loss
                engine_norm = engine.get_global_grad_norm()
                if engine_norm is not None:
                    grad_norm = float(engine_norm)

                unreachable: list[int] = []
                if follower is not None:
                    follower.boundary()
                    if follower.joined and reroute is not None:  # restarted ranks came back: share state
                        completed = _take_state(engine, reroute, completed, src=follower.source)
                    unreachable = sorted(follower.newly_missing())
                    if reroute is not None and reroute.role == "excluded":
                        log.warning("event=excluded job=%s rank=%d step=%d note=leaving_training", args.job, rank, step)
                        break

                if args.checkpoint_dir is not None:
                    if _checkpoint_boundary(
                        args, engine, reroute, rank=rank, step=step, requested=checkpoint_requested
                    ):
                        checkpoint_requested = False
                elif checkpoint_requested:
                    log.warning("event=checkpoint_ignored rank=%d reason=no_checkpoint_dir", rank)
                    checkpoint_requested = False
            except RuntimeError as exc:  # gloo reports a dead or timed-out peer as a RuntimeError
                if follower is None or reroute is None or not bounded or failures_here >= 3:
                    raise
                failures_here += 1
                engine.zero_grad()  # this step's gradients are partial: no update from them
                last_loss = final_loss

                def report_missing(missing: list[int], at: int = completed, loss: float = last_loss) -> None:
                    assert reporter is not None and reroute is not None
                    reporter.report(step=at, loss=loss, plan_generation=reroute.generation, unreachable_ranks=missing)

                error: RuntimeError = exc
                for _ in range(5):  # another rank may die while the survivors recover
                    # Every participant notices within about one collective timeout; a degraded
                    # rank only when its carrier's answer does not come (peer_timeout_s).
                    survey_s = 2 * args.collective_timeout
                    if reroute.route is not None and reroute.route.proxies:
                        survey_s = reroute.peer_timeout_s + args.collective_timeout
                    try:
                        follower.recover(
                            error, report=report_missing, survey_s=survey_s, timeout_s=args.recovery_timeout
                        )
                        if reroute.role != "excluded":
                            completed = _take_state(engine, reroute, completed, src=follower.source)
                        break
                    except RecoveryError:
                        raise
                    except RuntimeError as again:
                        error = again
                else:
                    raise error
                if reroute.role == "excluded":
                    log.warning("event=excluded job=%s rank=%d step=%d note=leaving_training", args.job, rank, step)
                    break
                step = completed
                timer.lap()
                continue
            failures_here = 0

            step_time = timer.lap()
            if reporter is not None:
                scale = getattr(engine.optimizer, "cur_scale", None) if engine.fp16_enabled() else None
                reporter.report(
                    step=step,
                    loss=step_loss,
                    grad_norm=grad_norm,
                    loss_scale=float(scale) if scale is not None else None,
                    step_time_s=step_time,
                    plan_generation=None if reroute is None else reroute.generation,
                    unreachable_ranks=unreachable or None,
                )
        if follower is not None and reroute is not None and reroute.role != "excluded":
            follower.finish()  # a restarted rank still waiting to rejoin leaves with success
    finally:
        if follower is not None:
            follower.close()
        if reporter is not None:
            reporter.close(timeout=5.0)

    if reroute is not None and reroute.role == "excluded":
        return 0  # the others finish without this rank; it must not join their last collective
    mean = torch.tensor([first_loss, final_loss], device=engine.device)
    if reroute is not None:
        reroute.allreduce_([mean])  # averaged over the ranks still contributing
        contributors = reroute.last_contributors[0] if reroute.last_contributors else world
    else:
        dist.all_reduce(mean)
        mean /= world
        contributors = world
    route = None if reroute is None else reroute.route
    if rank == (0 if route is None else route.root):
        summary = {
            "steps": args.steps,
            "first_loss": mean[0].item(),
            "final_loss": mean[1].item(),
            "world_size": world,
            "plan_generation": None if reroute is None else reroute.generation,
            "contributors": contributors,
        }
        print(json.dumps(summary), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without interpreter finalization. gloo worker threads outlive destroy_process_group()
    # (DeepSpeed keeps references to its groups), and one that releases the last collective's
    # tensors while the interpreter is being torn down aborts the process (SIGABRT, "terminate
    # called without an active exception", exit 134): 3 of 30 rank exits on this machine.
    # Reports, checkpoint files and the summary line are all flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)

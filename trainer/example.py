"""A small GPT trained with DeepSpeed on a learnable synthetic sequence: a plain DeepSpeed script.

Run it as any DeepSpeed script (``deepspeed``, ``torchrun``, alone; CPUs with gloo or GPUs with
nccl and bf16). Launched through ``POST /v1/jobs`` (under ``python -m trainer.run``) it reports,
follows plans, survives a dead or hung rank and rejoins with no protocol code here. It uses the
public API as a user would: :func:`trainer.resilience.attach` declares what MFU needs, the loop
counts steps from ``engine.global_steps`` (a relaunched rank continues from the live ranks'
step), and the lead rank prints ``{"steps", "first_loss", "final_loss", "world_size",
"plan_generation", "contributors"}`` averaged over the ranks still contributing. Data: the next
token is ``(3 * token + 1) % vocab``; each rank draws its own batches from identical weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trainer import resilience
from trainer.mfu import model_flops_per_token
from trainer.report import cosine_warmup


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP, each residual."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
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
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq_len, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(self.ln_f(nn.Sequential(*self.blocks)(x)))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(gen: torch.Generator, *, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of sequences following ``t -> (3 t + 1) % vocab``."""
    seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for i in range(1, seq_len + 1):
        seq[:, i] = (seq[:, i - 1] * 3 + 1) % vocab
    return seq[:, :-1], seq[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.example", description=__doc__.splitlines()[0])
    for name, default in (("steps", 20), ("seq-len", 64), ("layers", 2), ("hidden", 64), ("heads", 4), ("vocab", 256)):
        p.add_argument(f"--{name}", type=int, default=default, help=f"(default {default})")
    p.add_argument("--warmup", type=int, default=0, help="linear warmup steps before the cosine decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deepspeed_config", "--deepspeed-config", type=Path, default=None, help="DeepSpeed JSON config")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep per step (a bigger model)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    for name in [n for n in ("steps", "seq_len", "layers", "hidden", "heads", "vocab") if getattr(args, n) < 1]:
        p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.hidden % args.heads:
        p.error(f"--hidden={args.hidden}: expected a multiple of --heads={args.heads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # no launcher: one rank on this host (DeepSpeed would look for MPI)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import deepspeed

    if cuda := torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    config = json.loads(args.deepspeed_config.read_text()) if args.deepspeed_config else None
    config = config or {
        "train_micro_batch_size_per_gpu": 4,
        # on CPU torch's AdamW: DeepSpeed's own CPU Adam is an op it compiles first (half a minute)
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": not cuda}},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 1_000_000_000,
        **({"bf16": {"enabled": True}} if cuda and torch.cuda.is_bf16_supported() else {}),
    }
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = TinyGPT(vocab=args.vocab, seq_len=args.seq_len, hidden=args.hidden, layers=args.layers, heads=args.heads)

    def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:  # a factor on the config's lr
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cosine_warmup(s, warmup=args.warmup, total=args.steps, base_lr=1.0, min_lr=0.1)
        )

    engine, _, _, _ = deepspeed.initialize(  # a scheduler in the config wins over ours
        model=model, config=config, lr_scheduler=None if "scheduler" in config else schedule
    )
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    n_params = sum(p.numel() for p in model.parameters())
    fpt = model_flops_per_token(params=n_params, layers=args.layers, hidden=args.hidden, seq_len=args.seq_len)
    pulse = resilience.attach(engine, tokens_per_step=micro * gas * args.seq_len, flops_per_token=fpt)
    gen, first_loss, final_loss = torch.Generator().manual_seed(args.seed * 1000 + pulse.rank), math.nan, math.nan
    while engine.global_steps < args.steps:  # from the live ranks' step when this rank rejoined
        losses = []
        for _ in range(gas):
            x, y = synthetic_batch(gen, batch=micro, seq_len=args.seq_len, vocab=args.vocab)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        time.sleep(args.step_delay)
        final_loss = sum(losses) / len(losses)
        first_loss = final_loss if math.isnan(first_loss) else first_loss
    mean = torch.tensor([first_loss, final_loss], device=engine.device)
    contributors = pulse.average_(mean)  # over the ranks still contributing; never waits on a lost one
    if pulse.leader:
        generation = None if pulse.reroute is None else pulse.reroute.generation
        summary = {"steps": args.steps, "first_loss": mean[0].item(), "final_loss": mean[1].item()}
        summary |= {"world_size": pulse.world_size, "plan_generation": generation, "contributors": contributors}
        print(json.dumps(summary), flush=True)
    deepspeed.comm.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

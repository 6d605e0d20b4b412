"""What ``TrainerReporter`` adds to a training step, as a ratio to the same step without it.

The target is a reporting cost of at most 1 % of step time. Three CPU steps, each a forward,
backward and optimizer step:

- ``toy_mlp``: a 64x64 MLP on a batch of 8 (well under 1 ms): the worst case, kept so that it
  stays visible; no real training step is this short.
- ``transformer_75ms`` and ``transformer_500ms``: a 4-layer transformer (d_model 256, sequence 128,
  AdamW), its batch calibrated at start to the named step time: the size of a real step (a GPU
  step of a large model lasts hundreds of milliseconds).

For each, blocks of about ``block_s`` seconds of bare steps and of the same steps each followed by
``report()`` alternate (ABBA order), ``rounds`` pairs; the ``ratio`` is the median over pairs of
the reported block's time over its bare partner's. One reporter per size lives through its blocks, its
thread publishing to the test Redis on its interval; each reported block ends with
:meth:`TrainerReporter.flush`, timed, so that every report of a block is sent and paid for inside
it (the wait for that last round trip is counted too: the figure errs high).

Also per size, less exposed to a shared machine's noise than a wall-clock ratio: ``report_call_us``
(median time inside ``report()``; ``report_call_mean_us`` its mean), ``thread_cpu_us_per_report``
(the publishing thread's CPU time over the run, idle wake-ups included, per report) and
``cpu_cost_pct``, the two together as a share of the bare step.

Skipped unless ``PULSE_BENCH=1``. ``python -m tests.bench.test_report_cost`` prints one JSON object;
``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support import REDIS_URL

TARGET_RATIO = 1.01
SIZES = ("toy_mlp", "transformer_75ms", "transformer_500ms")


def _toy_step() -> tuple[Callable[[], float], dict[str, Any]]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 64), torch.randn(8, 1)

    def step() -> float:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        torch.autograd.backward(loss)
        opt.step()
        return float(loss.item())

    return step, {"tokens_per_step": 8, "flops_per_token": 6.0 * sum(p.numel() for p in model.parameters())}


def _transformer_step(target_s: float) -> tuple[Callable[[], float], dict[str, Any]]:
    """A small causal-LM-like step whose batch is scaled until one step takes about ``target_s``."""
    import torch

    torch.manual_seed(0)
    vocab, d_model, seq = 1000, 256, 128

    class Lm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d_model)
            layer = torch.nn.TransformerEncoderLayer(
                d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
            )
            self.body = torch.nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
            self.head = torch.nn.Linear(d_model, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.body(self.embed(tokens)))
            return out

    model = Lm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    batch = {"n": 2}
    data: dict[str, torch.Tensor] = {}

    def make_batch() -> None:
        data["x"] = torch.randint(0, vocab, (batch["n"], seq), generator=gen)
        data["y"] = torch.randint(0, vocab, (batch["n"], seq), generator=gen)

    def step() -> float:
        opt.zero_grad()
        logits = model(data["x"])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), data["y"].reshape(-1))
        torch.autograd.backward(loss)
        opt.step()
        return float(loss.item())

    def timed(n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    make_batch()
    timed(2)  # warm up at the smallest batch
    for _ in range(3):  # scale the batch to the target, then check
        t = timed(3)
        batch["n"] = max(1, round(batch["n"] * target_s / t))
        make_batch()
        timed(1)
    params = sum(p.numel() for p in model.parameters())
    return step, {"tokens_per_step": batch["n"] * seq, "flops_per_token": 6.0 * params, "batch": batch["n"]}


def _measure_size(
    step: Callable[[], float], reporter: Any, *, block_s: float, rounds: int, first_step: int
) -> tuple[dict[str, Any], int]:
    from trainer.report import StepTimer

    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < 0.5:  # warm up, and size the blocks
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    steps = max(3, math.ceil(block_s / statistics.median(times)))
    n = first_step

    def bare_block() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return time.perf_counter() - t0

    def reported_block() -> float:
        nonlocal n
        timer = StepTimer()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
            n += 1
            r0 = time.perf_counter()
            reporter.report(step=n, loss=loss, grad_norm=1.0, loss_scale=65536.0, step_time_s=timer.lap())
            calls.append(time.perf_counter() - r0)
        reporter.flush(timeout=10)
        return time.perf_counter() - t0

    bare: list[float] = []
    reported: list[float] = []
    ratios: list[float] = []
    calls: list[float] = []
    cpu0 = reporter.thread_cpu_s
    for r in range(rounds):
        if r % 2 == 0:
            b = bare_block()
            w = reported_block()
        else:
            w = reported_block()
            b = bare_block()
        bare.append(b / steps)
        reported.append(w / steps)
        ratios.append(w / b)
    thread_per_report = (reporter.thread_cpu_s - cpu0) / len(calls)
    call_mean = statistics.fmean(calls)
    bare_step = statistics.median(bare)
    ratio = statistics.median(ratios)
    return {
        "steps_per_block": steps,
        "bare_step_ms": round(bare_step * 1e3, 3),
        "step_with_report_ms": round(statistics.median(reported) * 1e3, 3),
        "report_call_us": round(statistics.median(calls) * 1e6, 2),
        "report_call_mean_us": round(call_mean * 1e6, 2),
        "thread_cpu_us_per_report": round(thread_per_report * 1e6, 2),
        # CPU the reporting adds per step (the call and the thread's share), load-independent
        "cpu_cost_pct": round((call_mean + thread_per_report) / bare_step * 100, 3),
        "ratio": round(ratio, 4),
        "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "overhead_pct": round((ratio - 1) * 100, 2),
        "target_met": ratio <= TARGET_RATIO,
    }, n


def measure(
    *,
    sizes: tuple[str, ...] = SIZES,
    rounds: int = 9,
    block_s: float = 2.0,
    flush_interval_s: float = 0.5,
    torch_threads: int = 1,
    redis_url: str = REDIS_URL,
) -> dict[str, Any]:
    import torch

    from trainer.report import TrainerReporter

    if torch_threads > 0:
        torch.set_num_threads(torch_threads)

    out: dict[str, Any] = {
        "target_ratio": TARGET_RATIO,
        "rounds": rounds,
        "block_s": block_s,
        "flush_interval_s": flush_interval_s,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "sizes": {},
    }
    n = 0
    total = {"published": 0, "dropped": 0, "rejected": 0, "reported": 0}
    for name in sizes:
        if name == "toy_mlp":
            step, shape = _toy_step()
        elif name.startswith("transformer_") and name.endswith("ms"):
            step, shape = _transformer_step(float(name.removeprefix("transformer_").removesuffix("ms")) / 1e3)
        else:
            raise ValueError(f"size={name!r}: expected toy_mlp or transformer_<N>ms")
        reporter = TrainerReporter(
            job="bench",
            rank=0,
            node="bench",
            world_size=1,
            redis_url=redis_url,
            flops_per_token=shape["flops_per_token"],
            peak_flops_per_device=1e12,
            tokens_per_step=shape["tokens_per_step"],
            flush_interval_s=flush_interval_s,
            queue_size=100_000,
        )
        try:
            if not reporter.flush(timeout=10):  # registered before anything is timed
                raise RuntimeError(f"redis_url={redis_url}: the reporter could not register")
            start = n
            result, n = _measure_size(step, reporter, block_s=block_s, rounds=rounds, first_step=n)
            total["reported"] += n - start
        finally:
            reporter.close(timeout=10)
        if "batch" in shape:
            result["batch"] = shape["batch"]
        out["sizes"][name] = result
        for key in ("published", "dropped", "rejected"):
            total[key] += getattr(reporter, key)
    out.update(total)
    return out


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="benchmark: set PULSE_BENCH=1")
def test_report_cost(redis_url: str) -> None:
    out = measure(rounds=3, block_s=0.5, redis_url=redis_url)
    print(json.dumps(out))
    # Behaviour only: timings on a shared machine are for reading, not for failing a build.
    assert out["published"] == out["reported"] and out["dropped"] == 0 and out["rejected"] == 0
    assert all(s["report_call_us"] < 1000 for s in out["sizes"].values())


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.test_report_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated: toy_mlp, transformer_<N>ms")
    parser.add_argument("--rounds", type=int, default=9, help="bare/reported block pairs per size")
    parser.add_argument("--block-s", type=float, default=2.0, help="seconds of steps per block")
    parser.add_argument("--flush-interval-s", type=float, default=0.5, help="the reporter's flush interval")
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch intra-op threads (0: torch's default, one per core)"
    )
    args = parser.parse_args()
    out = measure(
        sizes=tuple(s for s in args.sizes.split(",") if s),
        rounds=args.rounds,
        block_s=args.block_s,
        flush_interval_s=args.flush_interval_s,
        torch_threads=args.torch_threads,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()

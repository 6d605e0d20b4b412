"""What the step's breakdown (trainer/phases.py: the phases timed, one arrival all-reduce a step)
costs a user's script, beside the same script under the library without it, in one invocation.

``tests/fixtures/scripts/user_train.py`` (it never imports ClusterPulse), its MLP widened until a
step takes at least ``--min-step-ms``; worlds of ``--ranks`` gloo ranks run ``--steps`` steps
under ``python -m trainer.run`` (reporting, a plan of generation 1 in force, survival on),
alternately (ABBA, ``--rounds`` pairs) with ``PULSE_STEP_PHASES=0`` and with the breakdown on.
Each run's figure is the median time between rank 0's step ends after ``--warmup`` steps; the
ratio is the median over pairs of on / off. Target: at most 1.01 for a step of 50 ms or more.

Skipped unless ``PULSE_BENCH=1``. ``python -m tests.bench.test_step_phases_cost`` prints one JSON
object; ``--help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import redis

from clusterpulse import wire
from tests.bench.test_library_cost import _world, abba
from tests.support import REDIS_URL


def cost(tmp: Path, *, ranks: int, steps: int, warmup: int, rounds: int, min_step_ms: float) -> dict[str, Any]:
    """:func:`tests.bench.test_library_cost.abba` with "stock" the library without the breakdown
    (``PULSE_STEP_PHASES=0``) and "library" the library with it."""

    r = redis.Redis.from_url(REDIS_URL)

    def world(*, library: bool, name: str, **kw: Any) -> list[float]:
        if not library and not name.startswith("cal-"):  # the same plan in force as abba gives the other run
            plan = wire.Plan(job=name, generation=1, participants=list(range(ranks)), proxies={}, excluded=[])
            r.set(wire.job_plan_key(name), wire.encode(plan))
        return _world(tmp, library=True, name=name, extra={"PULSE_STEP_PHASES": "1" if library else "0"}, **kw)

    out = abba(world, ranks=ranks, steps=steps, warmup=warmup, rounds=rounds, min_step_ms=min_step_ms, width=256,
               max_width=8192)  # fmt: skip
    return {
        "ranks": out["ranks"],
        "width": out["width"],
        "without_step_ms": out["stock_step_ms"],
        "with_step_ms": out["library_step_ms"],
        "breakdown_ratio": out["overhead_ratio"],
        "ratios": out["ratios"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.test_step_phases_cost", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4, help="ABBA pairs")
    p.add_argument("--min-step-ms", type=float, default=50.0)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pulse-phasecost-") as d:
        result = cost(
            Path(d), ranks=a.ranks, steps=a.steps, warmup=a.warmup, rounds=a.rounds, min_step_ms=a.min_step_ms
        )
    print(json.dumps(result))
    return 0


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="a benchmark: PULSE_BENCH=1")
@pytest.mark.timeout(1800)
def test_step_phases_cost(tmp_path: Path) -> None:
    result = cost(tmp_path, ranks=2, steps=40, warmup=5, rounds=4, min_step_ms=50.0)
    print(json.dumps(result))
    assert result["breakdown_ratio"] <= 1.01, result


if __name__ == "__main__":
    raise SystemExit(main())

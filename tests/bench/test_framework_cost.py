"""What the trainer library costs a Hugging Face Trainer script, beside the stock script in the same invocation.

``tests/fixtures/scripts/hf_trainer_train.py`` (it never imports ClusterPulse; its model widened
with ``--width`` until a step takes at least ``--min-step-ms``) trains ``--steps`` steps on
``--ranks`` gloo ranks, alternately (ABBA, ``--rounds`` pairs) as the stock script (``python
train.py``, as ``torchrun`` starts it) and under the library (``python -m trainer.run train.py``
with ``PULSE_REDIS_URL`` and ``PULSE_JOB_ID`` set: registration, reporting, a plan of generation
1 in force, survival on, the world group's collectives over the live ranks). Each run's figure is
the median time between rank 0's optimizer-step ends after ``--warmup`` steps; ``overhead_ratio``
is the median over pairs of library / stock. Target: at most 1.02 for a step of 50 ms or more.

Skipped unless ``PULSE_BENCH=1``. ``python -m tests.bench.test_framework_cost`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.bench.test_library_cost import abba
from tests.support import REDIS_URL, REPO, free_port, pulse_env, wait_all

SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "hf_trainer_train.py"


def _world(tmp: Path, *, name: str, ranks: int, steps: int, width: int, library: bool) -> list[float]:
    """One world's run; rank 0's step-end times."""
    out = tmp / name
    out.mkdir()
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = pulse_env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        )  # fmt: skip
        if library:
            env |= {"PULSE_REDIS_URL": REDIS_URL, "PULSE_JOB_ID": name, "PULSE_NODE": f"bench-{rank}"}
        argv = [str(SCRIPT), "--out", str(out), "--max-steps", str(steps), "--width", str(width)]
        argv += ["--logging-steps", "5", "--save-steps", "1000000"]
        runner = ["-m", "trainer.run"] if library else []
        with (out / f"rank{rank}.log").open("wb") as log:
            procs.append(subprocess.Popen([sys.executable, *runner, *argv], env=env, stdout=log, stderr=log))
    wait_all(procs, timeout=900)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{name}: exit codes {[p.returncode for p in procs]}; logs in {out}")
    times: list[float] = json.loads((out / "rank0.json").read_text())["times"]
    return times


def overhead(tmp: Path, *, ranks: int, steps: int, warmup: int, rounds: int, min_step_ms: float) -> dict[str, Any]:
    def world(**kw: Any) -> list[float]:
        return _world(tmp, **kw)

    return {"script": SCRIPT.name, **abba(world, ranks=ranks, steps=steps, warmup=warmup, rounds=rounds,
                                          min_step_ms=min_step_ms, width=64, max_width=2048)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.test_framework_cost", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4, help="ABBA pairs")
    p.add_argument("--min-step-ms", type=float, default=50.0)
    a = p.parse_args(argv)
    # DeepSpeed's CPU ops where bootstrap built them (tests/conftest.py does the same): a stock
    # rank would otherwise build its own under ~/.cache, waiting on any lock a killed build left
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    with tempfile.TemporaryDirectory(prefix="pulse-hfcost-") as d:
        result = overhead(
            Path(d), ranks=a.ranks, steps=a.steps, warmup=a.warmup, rounds=a.rounds, min_step_ms=a.min_step_ms
        )
    print(json.dumps(result))
    return 0


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="a benchmark: PULSE_BENCH=1")
@pytest.mark.timeout(3600)
def test_framework_cost(tmp_path: Path) -> None:
    result = overhead(tmp_path, ranks=2, steps=40, warmup=5, rounds=4, min_step_ms=50.0)
    print(json.dumps(result))
    assert result["overhead_ratio"] <= 1.02, result


if __name__ == "__main__":
    raise SystemExit(main())

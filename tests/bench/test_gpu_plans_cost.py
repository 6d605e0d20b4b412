"""What one bad GPU costs a step, per-GPU plans beside per-node plans (issue 35):
``pulse bench gpu-plans`` (tools/bench_gpu_plans.py) at its defaults, 8 gloo ranks as 2 nodes of
4, the rank on GPU 2 carried alone against its node's four. Both stay exact; the ratio is
printed and recorded in docs/benchmarks.md, never asserted (a shared machine). Skipped unless
``PULSE_BENCH=1``."""

from __future__ import annotations

import argparse
import json
import os

import pytest

pytestmark = pytest.mark.timeout(900)


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="a benchmark: PULSE_BENCH=1")
def test_gpu_plans_cost() -> None:
    from tools.bench_gpu_plans import measure

    args = argparse.Namespace(world_size=8, gpus_per_node=4, bad=2, rounds=2, repeats=8, hidden=1024, layers=4)
    out = measure(args)
    print(json.dumps(out))
    assert out["per_gpu"]["exact"] and out["per_node"]["exact"], out
    assert (out["per_gpu"]["carried_ranks"], out["per_node"]["carried_ranks"]) == (1, 4), out

"""What a failure cost a rank, read from the step-end times it wrote (``mlp_train.py``,
``torchft_train.py``): pure, shared by both sides of ``pulse bench recovery``."""

from __future__ import annotations

import contextlib
import itertools
import statistics
from pathlib import Path


def read_times(path: Path) -> list[float]:
    """The step-end times a rank wrote (``mlp_train.py``), a partial last line left out."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(float(line))
    return out


def cost(times: list[float], *, fault: float, observe_s: float) -> tuple[float, float] | None:
    """(the time ``fault`` cost a rank whose step ends are ``times``, its median step before it):
    the longest gap between step ends that spans or follows the fault within ``observe_s``, minus
    the median step before it. None when the rank did not step on both sides of the fault."""
    before = [b - a for a, b in itertools.pairwise(times) if b < fault]
    around = [b - a for a, b in itertools.pairwise(times) if b >= fault and a <= fault + observe_s]
    if len(before) < 3 or not around:
        return None
    step = statistics.median(before[len(before) // 2 :])  # after the first steps' warm-up
    return max(around) - step, step

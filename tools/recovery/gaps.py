"""What a failure cost a rank, read from the step-end times it wrote (``mlp_train.py``,
``torchft_train.py``): pure, shared by both sides of ``pulse bench recovery``."""

from __future__ import annotations

import contextlib
import itertools
import statistics
from pathlib import Path
from typing import Any


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


def survivors(folder: Path, ranks: int, *, fault: float, observe_s: float, what: str) -> dict[str, Any]:
    """The cost of ``fault`` to each of ranks 0 .. ``ranks`` - 2 (the last one failed), from the
    ``rank<N>.times`` in ``folder``: ``cost_s`` (the largest), ``by_rank`` and ``step_s`` (the
    slowest median step). Raises :class:`ValueError` naming ``what`` when a survivor did not step
    both before the fault and within ``observe_s`` after it."""
    by_rank: dict[int, float] = {}
    steps: list[float] = []
    for rank in range(ranks - 1):
        got = cost(read_times(folder / f"rank{rank}.times"), fault=fault, observe_s=observe_s)
        if got is not None:
            by_rank[rank] = round(got[0], 3)
            steps.append(got[1])
    if len(by_rank) < ranks - 1:
        raise ValueError(
            f"{what}: only ranks {sorted(by_rank)} stepped both before the failure and within {observe_s:g} s "
            "after it (a survivor waiting out a collective timeout needs a longer --observe-s)"
        )
    return {"cost_s": max(by_rank.values()), "by_rank": by_rank, "step_s": round(max(steps), 4)}

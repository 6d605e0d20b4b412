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


def cost(
    times: list[float], *, fault: float, observe_s: float, rejoin: float | None = None
) -> tuple[float, float] | None:
    """(the time ``fault`` cost a rank whose step ends are ``times``, its median step before it):
    the longest gap between step ends that spans or follows the fault within ``observe_s``, minus
    the median step before it. ``rejoin``: when the failed rank, relaunched, was taken back; only
    the gaps that end before it count (the admission's gap is :func:`rejoin_cost`'s). None when
    the rank did not step on both sides of the fault."""
    before = [b - a for a, b in itertools.pairwise(times) if b < fault]
    around = [
        b - a
        for a, b in itertools.pairwise(times)
        if b >= fault and a <= fault + observe_s and (rejoin is None or b < rejoin)
    ]
    if len(before) < 3 or not around:
        return None
    step = statistics.median(before[len(before) // 2 :])  # after the first steps' warm-up
    return max(around) - step, step


def rejoin_cost(times: list[float], *, rejoin: float, observe_s: float, step: float) -> float | None:
    """What taking the relaunched rank back cost a rank: the longest gap ending from ``rejoin`` to
    ``observe_s`` after it, less ``step``; None when the rank did not step after it."""
    after = [b - a for a, b in itertools.pairwise(times) if rejoin <= b <= rejoin + observe_s]
    return max(after) - step if after else None


def survivors(
    folder: Path, ranks: int, *, fault: float, observe_s: float, what: str, rejoin: float | None = None
) -> dict[str, Any]:
    """The cost of ``fault`` to each of ranks 0 .. ``ranks`` - 2 (the last one failed), from the
    ``rank<N>.times`` in ``folder``: ``cost_s`` (the largest), ``by_rank`` and ``step_s`` (the
    slowest median step); with ``rejoin`` (:func:`cost`), ``rejoin_cost_s``, the largest cost of
    the admission. Raises :class:`ValueError` naming ``what`` when a survivor did not step
    both before the fault and within ``observe_s`` after it."""
    by_rank: dict[int, float] = {}
    steps: list[float] = []
    rejoins: list[float] = []
    for rank in range(ranks - 1):
        times = read_times(folder / f"rank{rank}.times")
        got = cost(times, fault=fault, observe_s=observe_s, rejoin=rejoin)
        if got is not None:
            by_rank[rank] = round(got[0], 3)
            steps.append(got[1])
            back = None if rejoin is None else rejoin_cost(times, rejoin=rejoin, observe_s=observe_s, step=got[1])
            rejoins += [] if back is None else [back]
    if len(by_rank) < ranks - 1:
        raise ValueError(
            f"{what}: only ranks {sorted(by_rank)} stepped both before the failure and within {observe_s:g} s "
            "after it (a survivor waiting out a collective timeout needs a longer --observe-s)"
        )
    out = {"cost_s": max(by_rank.values()), "by_rank": by_rank, "step_s": round(max(steps), 4)}
    return out | ({"rejoin_cost_s": round(max(rejoins), 3)} if rejoins else {})


def over_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated runs of one case (``--repeat``): ``cost_s`` and ``rejoin_cost_s`` their medians,
    ``costs`` each run's; one run is returned as it is. On a shared machine one run can land on a
    busy second; the median of a few does not."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {"cost_s": round(statistics.median(r["cost_s"] for r in runs), 3)}
    out["costs"] = [r["cost_s"] for r in runs]
    rejoins = [r["rejoin_cost_s"] for r in runs if "rejoin_cost_s" in r]
    if rejoins:
        out |= {"rejoin_cost_s": round(statistics.median(rejoins), 3), "rejoin_costs": rejoins}
    return out | {"runs": runs}

"""The goodput campaign's picture (``goodput.png``): step rate of both runs, each node's state,
the plan generation the ranks train under, and a line per fault."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.goodput.accounting import step_rate_bins
from tools.goodput.model import RANK_KINDS, InjectedFault, Run
from tools.goodput.monitor import Monitor


def plot(
    mon: Monitor,
    *,
    nodes: list[str],
    duration_s: float,
    faults: list[InjectedFault],
    lost_ranks: set[int],
    ff: Run,
    runs: list[Run],
    result: dict[str, Any],
    path: Path,
) -> None:
    """Draw the campaign's picture into ``path``: ``nodes`` in rank order, ``duration_s`` the
    faulted window, ``lost_ranks`` the ranks still out at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    t0 = runs[0].first_step_at or runs[0].submitted
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(13, 8), sharex=True, gridspec_kw={"height_ratios": [2, 1.4, 1]})
    bin_s = max(1.0, duration_s / 120)
    x, y = step_rate_bins(mon.timeline(ff), ff.first_step_at or ff.submitted, bin_s)
    ax1.plot(x, y, color="0.6", lw=1, label="fault-free run")
    for i, run in enumerate(runs):
        x, y = step_rate_bins(mon.timeline(run), t0, bin_s)
        ax1.plot(x, y, lw=1.2, label="faulted run" if i == 0 else f"restart {i}")
    ax1.set_ylabel("steps / s")
    ax1.legend(loc="lower left", fontsize=8)
    ax1.set_title(
        f"goodput {result['goodput_ratio']:.3f}  restarts {result['restarts']}  "
        f"({result['ranks']} ranks, fault every {result['fault_every_s']:g} s, seed {result['seed']})"
    )
    colors = {"HEALTHY": "tab:green", "SUSPECT": "gold", "DEGRADED": "tab:orange", "LOST": "tab:red"}
    end = (t0 + duration_s + 5) - t0
    for i, node in enumerate(nodes):
        changes = [(t - t0, st) for t, n, st in mon.node_states if n == node]
        for j, (t, st) in enumerate(changes):
            t_end = changes[j + 1][0] if j + 1 < len(changes) else end
            lo, hi = max(t, 0.0), max(t_end, 0.0)
            if hi > lo:
                ax2.barh(i, hi - lo, left=lo, color=colors.get(st, "0.5"), height=0.6)
    plans = [(t - t0, p) for t, p in mon.plans if p.get("job") == runs[-1].job]
    for rank in sorted(lost_ranks | {f.rank for f in faults if f.kind in RANK_KINDS and f.rank}):
        out_since: float | None = None  # each span: from a plan excluding the rank to one counting on it again
        for t, p in [*plans, (end, {"excluded": []})]:
            if rank in (p.get("excluded") or []):
                out_since = t if out_since is None else out_since
            elif out_since is not None:
                ax2.plot([out_since, t], [rank, rank], color="k", lw=2, ls=":")
                out_since = None
    ax2.set_yticks(range(len(nodes)), [f"{n} (rank {i})" for i, n in enumerate(nodes)])
    ax2.set_ylabel("node state")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax2.legend([*handles, Line2D([], [], color="k", ls=":")], [*colors, "rank excluded"], fontsize=7,
               loc="upper right", ncol=5)  # fmt: skip
    for run in runs:
        pts, newest = [], 0
        for t, r in run.reports:
            newest = max(newest, r.plan_generation or 0)
            pts.append((t - t0, newest))
        if pts:
            ax3.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="tab:blue")
    ax3.set_ylabel("plan generation")
    ax3.set_xlabel("seconds since the faulted run's first step")
    for f in faults:
        for ax in (ax1, ax2, ax3):
            ax.axvline(f.at - t0, color="tab:red", alpha=0.35, lw=0.8)
        label = f.kind if f.node is None else f"{f.kind} {f.node}"
        ax1.text(f.at - t0, ax1.get_ylim()[1], label, rotation=90, fontsize=6, va="top", ha="right", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

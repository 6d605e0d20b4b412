"""``pulse check reroute``: a self-check of gradient rerouting on real gloo ranks, like nccl-tests.

It runs, on ``world_size`` ranks of this machine, the exactness of the rerouted DDP step against
stock DDP, the cost of rerouting, and (``hang``) a degraded rank that stops mid-step; what each
figure means is in docs/design/check-reroute.md. :func:`run_check` returns the summary, whose
``ok`` is false (and ``pulse check reroute`` exits 1) when ``failures`` lists anything.
"""

from tools.check_reroute.check import (
    CheckConfig,
    CheckError,
    CheckFailed,
    after_hang_plan,
    make_plan,
    parse_ranks,
    summarize,
)
from tools.check_reroute.coordinator import run_check

__all__ = [
    "CheckConfig",
    "CheckError",
    "CheckFailed",
    "after_hang_plan",
    "make_plan",
    "parse_ranks",
    "run_check",
    "summarize",
]

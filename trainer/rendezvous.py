"""The rank's reporter from its rendezvous to its exit, whatever the script builds on top.

The runner (:mod:`trainer.run`) wraps ``torch.distributed.init_process_group``: once the rank's
process group exists, this process's :class:`~trainer.report.TrainerReporter` is made, and its
first send registers the rank. So a job is RUNNING once its ranks rendezvoused, whether or not
the library attaches to a DeepSpeed engine (a plain DDP script, a framework it cannot reach);
when it does attach, it reports its steps through the same reporter (:func:`reporter`). A
rejoining rank is not registered here: its registration is what takes it back
(``services/plans/keeper.py``), so it registers once it has joined. At the end :func:`leave` reports the
rank's exit code, so the orchestrator knows how a rank ended even when its node's agent died.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from trainer.imports import after_import
from trainer.report import TrainerReporter
from trainer.settings import TrainerSettings

log = logging.getLogger("pulse.trainer.rendezvous")

_reporter: TrainerReporter | None = None


def reporter() -> TrainerReporter | None:
    """This process's reporter, made at its rendezvous (None before, or for a rejoining rank)."""
    return _reporter


def install(settings: TrainerSettings) -> None:
    """Register this rank once its process group exists (module docstring)."""
    after_import("torch.distributed", lambda dist: _wrap(dist, settings))


def _wrap(dist: ModuleType, settings: TrainerSettings) -> None:
    original: Callable[..., Any] = dist.init_process_group
    if getattr(original, "_pulse", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if not settings.rejoin:
            started(settings, rank=int(dist.get_rank()), world_size=int(dist.get_world_size()))
        return out

    init_process_group._pulse = True  # type: ignore[attr-defined]
    dist.init_process_group = init_process_group  # type: ignore[attr-defined]
    dist.distributed_c10d.init_process_group = init_process_group


def started(settings: TrainerSettings, *, rank: int, world_size: int) -> TrainerReporter | None:
    """Make this process's reporter (once), which registers the rank; None when it cannot be made
    (the reason is logged: a script is never stopped for its reporting)."""
    global _reporter
    if _reporter is None:
        try:
            _reporter = TrainerReporter(
                job=settings.job_id, rank=rank, world_size=world_size, node=settings.node or None,
                redis_url=settings.redis_url, redis_cluster=settings.redis_cluster,
            )  # fmt: skip
        except ValueError as exc:
            log.warning("event=reporting_off job=%s rank=%d reason=%r", settings.job_id, rank, str(exc))
    return _reporter


def leave(code: int) -> None:
    """Report this rank's exit code and close the reporter (at most a few seconds)."""
    global _reporter
    r, _reporter = _reporter, None
    if r is not None:
        r.report_exit(code)
        r.close(timeout=5.0)

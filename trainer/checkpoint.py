"""The emergency checkpoint: asked of any rank, written by every live rank at the same step.

A checkpoint is asked for with SIGUSR2 (the agent sends it to each rank when
``POST /v1/jobs/{id}/checkpoint`` comes, ``agent/ranks.py``); the handler only sets a flag. At
each optimizer-step boundary the live ranks agree on whether any of them was asked (the flag
rides with the step's gradient reduction where it can, else a one-element all-reduce, rerouted
under a plan so it never waits on a lost rank) and, if so, all save under
the same tag, ``emergency-step<N>``, into ``PULSE_CHECKPOINT_DIR``. Under a plan DeepSpeed's
world barriers become rerouted all-reduces, the lowest live participant writes the model states,
and DeepSpeed's tag check (world all-reduces) is left out: the tag is the agreed step's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from trainer.collective import ReroutedAllReduce

log = logging.getLogger("pulse.trainer")


class EmergencyCheckpoint:
    """The flag SIGUSR2 sets (:meth:`ask`), the agreement and the save at a boundary
    (:meth:`boundary`), and the directories written so far (:attr:`written`)."""

    def __init__(self, engine: Any, *, directory: Path, job: str, rank: int) -> None:
        self.engine = engine
        self.directory = directory
        self.job, self.rank = job, rank
        self.requested = False
        self.written: list[str] = []

    def ask(self, signum: int = 0, frame: FrameType | None = None) -> None:
        """The SIGUSR2 handler: a checkpoint at the next boundary."""
        self.requested = True

    def boundary(self, reroute: ReroutedAllReduce | None, *, asked: bool | None = None) -> str | None:
        """Every live rank saves together when any rank was asked to; returns the directory
        written (the model states by the lowest live rank, :mod:`trainer.job_checkpoint`). ``asked``: whether any live rank was asked, agreed already (the flag rode with this
        step's gradients, ``trainer.deepspeed_reroute.Rider``); None: agree now, by a collective."""
        engine = self.engine
        if asked is None:
            flag = torch.tensor([1.0 if self.requested else 0.0], device=engine.device)
            if reroute is not None:
                reroute.allreduce_([flag])  # a mean > 0 when any rank asked; never waits on a lost rank
            else:
                import deepspeed.comm as dist

                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            asked = flag.item() > 0
        if not asked:
            return None
        self.requested = False
        step = int(engine.global_steps)
        tag = f"emergency-step{step}"
        directory = self.directory.resolve()
        with self._live_world(reroute):
            engine.save_checkpoint(str(directory), tag=tag, client_state={"step": step})
        written = str(directory / tag)
        self.written.append(written)
        log.warning("event=checkpoint_written job=%s rank=%d step=%d dir=%s", self.job, self.rank, step, written)
        return written

    @contextlib.contextmanager
    def _live_world(self, reroute: ReroutedAllReduce | None) -> Iterator[None]:
        """``engine.save_checkpoint`` among the live ranks: DeepSpeed's barriers there run on the
        world group (which waits for a lost rank as long as the world's timeout); under a plan the
        barrier is a rerouted all-reduce of one element and the tag check (world all-reduces) is
        left out."""
        engine = self.engine
        if reroute is None or reroute.route is None:
            yield
            return
        import deepspeed.comm as dist

        self.directory.resolve().mkdir(parents=True, exist_ok=True)  # rank 0 may be gone
        barrier = dist.barrier

        def live_barrier(*args: Any, **kwargs: Any) -> None:
            reroute.allreduce_([torch.zeros(1, device=engine.device)])

        dist.barrier = live_barrier
        # DeepSpeed checks that every rank saves under the same tag with two all-reduces on the
        # world group; the tag here is the agreed step's, the same on every live rank by construction.
        engine._checkpoint_tag_validation = lambda tag: None
        try:
            yield
        finally:
            dist.barrier = barrier
            del engine._checkpoint_tag_validation

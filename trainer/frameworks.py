"""What a relaunched rank needs under a framework that sizes its world when it starts.

A relaunched rank runs in a world of one (:func:`trainer.run.world_of_one`) until the live ranks
take it back. The frameworks read their world from that process group, so for such a rank
(:func:`install`):

- Accelerate's ``PartialState`` (the Hugging Face Trainer's too) is told the job's world size and
  the rank's place in it: the sampler gives the rank its own shard, "main process" checks stay on
  rank 0, and the Trainer's ``"auto"`` batch sizes are the job's;
- the Hugging Face Trainer's step counter takes the live ranks' step at the rank's first
  optimizer step (a callback first in line), so its log lines, periodic checkpoints and
  ``max_steps`` line up with theirs, and so do the collectives they run.

A bare Accelerate loop or Lightning counts its own steps where the library cannot reach them: a
relaunched rank replays the loop up to the live ranks' step (:mod:`trainer.replay`), and the
checkpoints the loop takes meanwhile (``Accelerator.save_state``, Lightning's ``save_checkpoint``)
are not written: they would overwrite the live ranks' of the same step with a replay's files.

On every rank (:func:`install_writers`): while a plan leaves rank 0 out, its stand-in
(:func:`trainer.world.stands_in_for_rank_zero`) also does the Trainer's main-process writing and
logging, so a checkpoint taken then holds ``trainer_state.json`` and the model's weights and can be
resumed; a Trainer checkpoint during which a rank died is taken again, whole.
"""

from __future__ import annotations

import functools
import weakref
from types import ModuleType
from typing import Any

from trainer import world
from trainer.imports import after_import


def install(*, rank: int, world_size: int) -> None:
    after_import("accelerate.state", lambda state: _job_world(state, rank=rank, world_size=world_size))
    after_import("transformers.trainer", _align_steps)
    after_import("accelerate.accelerator", lambda module: _not_while_replaying(module.Accelerator, "save_state"))
    for trainer in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        after_import(trainer, lambda module: _not_while_replaying(module.Trainer, "save_checkpoint"))


def _not_while_replaying(cls: type, name: str) -> None:
    """``cls.name`` does nothing while this rank replays its loop (module docstring)."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        from trainer import resilience

        r = resilience.current()
        if r is not None and r.replay is not None:
            return None
        return original(self, *args, **kwargs)

    setattr(cls, name, method)


def install_writers() -> None:
    after_import("transformers.training_args", _stand_in_args)
    after_import("transformers.trainer", _stand_in_trainer)
    after_import("transformers.distributed.mixin", _stand_in_model)


def _stand_in_model(module: ModuleType) -> None:
    """``save_pretrained`` also asks that this be torch.distributed's rank 0."""
    cls = getattr(module, "DistributedMixin", None)
    if cls is None or not hasattr(cls, "should_save_on_this_rank"):
        return
    original = cls.should_save_on_this_rank

    def should_save_on_this_rank(self: Any, is_main_process: bool) -> bool:
        return bool(original(self, is_main_process)) or (is_main_process and world.stands_in_for_rank_zero())

    cls.should_save_on_this_rank = should_save_on_this_rank


def _stand_in_args(module: ModuleType) -> None:
    cls = module.TrainingArguments
    or_stand_in(cls, "should_save", per_node="save_on_each_node")
    or_stand_in(cls, "should_log", per_node="log_on_each_node")


def _stand_in_trainer(module: ModuleType) -> None:
    cls = module.Trainer
    original = cls.is_world_process_zero
    checkpoint = cls._save_checkpoint

    def is_world_process_zero(self: Any) -> bool:
        return bool(original(self)) or world.stands_in_for_rank_zero()

    def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        """Taken again, whole, when a rank died during it (:func:`trainer.job_checkpoint.whole`)."""
        from trainer import job_checkpoint, resilience

        r = resilience.current()
        if r is None or r.reroute is None:
            return checkpoint(self, *args, **kwargs)
        return job_checkpoint.whole(lambda: checkpoint(self, *args, **kwargs), r.reroute)

    cls.is_world_process_zero = is_world_process_zero
    cls._save_checkpoint = _save_checkpoint


def or_stand_in(cls: type, name: str, *, per_node: str) -> None:
    """Property ``name`` of ``cls`` also true on rank 0's stand-in, unless ``per_node`` is set (a
    writer on every node: the stand-in's node has its own)."""
    getter = getattr(cls, name).fget

    def get(obj: Any) -> bool:
        return bool(getter(obj)) or (not getattr(obj, per_node) and world.stands_in_for_rank_zero())

    setattr(cls, name, property(get, doc=getter.__doc__))


def _job_world(state: ModuleType, *, rank: int, world_size: int) -> None:
    cls = state.PartialState
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.num_processes == 1 and world_size > 1:  # the world of one, not the job's
            self.num_processes, self.process_index = world_size, rank

    cls.__init__ = __init__


def _align_steps(module: ModuleType) -> None:
    from transformers import TrainerCallback

    class JoinedSteps(TrainerCallback):
        """The live ranks' step, once, at this rank's first optimizer step."""

        def __init__(self, trainer: Any) -> None:
            self.trainer = weakref.ref(trainer)
            self.done = False

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            from trainer import resilience

            r = resilience.current()
            if self.done or r is None:
                return
            self.done = True
            state.global_step = int(r.engine.global_steps)
            trainer = self.trainer()
            if trainer is not None:
                trainer._globalstep_last_logged = state.global_step - 1  # its loss sum holds one step

    cls = module.Trainer
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.callback_handler.callbacks.insert(0, JoinedSteps(self))

    cls.__init__ = __init__

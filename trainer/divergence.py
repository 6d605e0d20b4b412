"""Training health a rank watches with no script change: a loss that spikes or a gradient norm
that is not finite asks for an emergency checkpoint, and the weight-update ratio every few steps.

:class:`Divergence` holds one rank's recent losses (the rule is
:class:`trainer.report.LossSpikeDetector`'s) and its cool-down, :class:`UpdateRatio` the weights of
the step it measures.
:mod:`trainer.resilience` calls them: each loss as the backward that reduces it starts, so a
checkpoint asked for rides with that step's gradient reduction (or is agreed at its boundary,
:mod:`trainer.checkpoint`) and every live rank saves at the boundary of the step that spiked,
before the next optimizer step; a gradient norm at a boundary, so its checkpoint is the next
boundary's. ``PULSE_DIVERGENCE_FACTOR=0`` turns the watch off; ``PULSE_UPDATE_RATIO_EVERY=0`` the
ratio. docs/design/step.md, "Training health".
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from clusterpulse import wire
from trainer.report import LossSpikeDetector
from trainer.settings import TrainerSettings


class Divergence:
    """One rank's watch: :class:`trainer.report.LossSpikeDetector` (the rule the reports' own
    ``loss_spike`` events use) over each micro-step's loss, and over each step's gradient norm,
    with a cool-down of ``cooldown_steps`` after a trigger so one divergence asks once."""

    def __init__(self, *, factor: float, window: int, cooldown_steps: int) -> None:
        self.detector = LossSpikeDetector(window=window, factor=factor) if factor > 0 else None
        self.cooldown_steps = cooldown_steps
        self._quiet_until = -1  # no trigger before this step
        self.why: str | None = None  # the last trigger's reason, until taken

    def loss(self, value: torch.Tensor, step: int) -> bool:
        """A micro-step's loss as its backward starts (``step``: the optimizer step it is part
        of): True when it asks for a checkpoint."""
        if self.detector is None or value.numel() != 1:
            return False
        return self._trigger(self.detector.update(step, float(value.detach())), step)

    def grad_norm(self, value: float | None, step: int) -> bool:
        """A step's gradient norm at its boundary: True when it asks for a checkpoint."""
        if self.detector is None or value is None or math.isfinite(value):
            return False
        return self._trigger(self.detector.update(step, None, value), step)

    def take(self) -> str | None:
        """The reason of the last trigger, once."""
        why, self.why = self.why, None
        return why

    def _trigger(self, why: str | None, step: int) -> bool:
        if why is None or step < self._quiet_until:
            return False
        self._quiet_until = step + self.cooldown_steps
        self.why = why
        return True


class UpdateRatio:
    """Every ``every`` steps, the norm of the optimizer's update over the norm of the weights,
    over the first tensors of the model up to ``max_elements`` weights (a copy of them is held
    through the step: a sample, never a second copy of a large model)."""

    def __init__(self, every: int, *, max_elements: int = 1 << 24) -> None:
        self.every = every
        self.max_elements = max_elements
        self._before: list[torch.Tensor] | None = None

    def _sample(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        total = 0
        for p in params:
            if out and total + p.numel() > self.max_elements:
                break
            out.append(p)
            total += p.numel()
        return out

    def before(self, params: Iterable[torch.Tensor], step: int) -> None:
        """Ahead of optimizer step ``step + 1``: keep a copy of the sample when it is measured."""
        self._before = None
        if self.every > 0 and (step + 1) % self.every == 0:
            self._before = [p.detach().float().clone() for p in self._sample(params)]

    def after(self, params: Iterable[torch.Tensor]) -> float | None:
        """After the step: ||w_after - w_before|| / ||w_before|| over the sample, or None when
        this step was not measured."""
        before, self._before = self._before, None
        if before is None:
            return None
        after = [p.detach().float() for p in self._sample(params)]
        if [a.shape for a in after] != [b.shape for b in before]:
            return None
        update = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(a - b) for a, b in zip(after, before, strict=True)])
        )
        weights = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b) for b in before]))
        return float(update / weights) if float(weights) > 0 else None


class Health:
    """A rank's training health (module docstring): the divergence watch and the update ratio,
    from the rank's settings; :mod:`trainer.resilience` calls it, :mod:`trainer.step_report` reads it."""

    def __init__(self, *, factor: float, window: int, cooldown_steps: int, ratio_every: int) -> None:
        self.watch = Divergence(factor=factor, window=window, cooldown_steps=cooldown_steps)
        self.ratio = UpdateRatio(ratio_every)
        self.measured: float | None = None  # this boundary's update ratio, until reported

    @classmethod
    def from_settings(cls, s: TrainerSettings) -> Health:
        return cls(
            factor=s.divergence_factor, window=s.divergence_window, cooldown_steps=s.divergence_cooldown_steps,
            ratio_every=s.update_ratio_every,
        )  # fmt: skip

    def loss(self, value: torch.Tensor, step: int) -> bool:
        """A micro-step's loss as its backward starts: True when it asks for a checkpoint."""
        return self.watch.loss(value, step)

    def before_step(self, params: Iterable[torch.Tensor], step: int) -> None:
        self.ratio.before(params, step)

    def after_step(self, params: Iterable[torch.Tensor], *, step: int, grad_norm: float | None) -> bool:
        """The boundary of ``step``: its update ratio measured (when due); True when its gradient
        norm asks for a checkpoint (at the next boundary)."""
        self.measured = self.ratio.after(params)
        return self.watch.grad_norm(grad_norm, step)

    def note(self, written: str | None) -> str | None:
        """The report's note for a checkpoint ``written`` at this boundary: the directory, and on
        the next line why the library asked for it when it did."""
        if written is None:
            return None
        why = self.watch.take()
        note = f"{wire.CHECKPOINT_WRITTEN} {written}"
        return note if why is None else f"{note}\ndivergence_checkpoint {why}; every live rank saved at this boundary"

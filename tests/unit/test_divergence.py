"""Training health on a rank (trainer/divergence.py): a loss spike or a non-finite gradient norm
asks for a checkpoint once per cool-down, noise never does; the update ratio is what it says."""

from __future__ import annotations

import math
import random

import pytest
import torch

from clusterpulse import wire
from trainer.divergence import Divergence, Health, UpdateRatio
from trainer.settings import TrainerSettings


def _loss(v: float) -> torch.Tensor:
    return torch.tensor(v)


def test_a_tenfold_spike_asks_once_and_again_only_after_the_cool_down() -> None:
    d = Divergence(factor=10, window=100, cooldown_steps=50)
    assert not any(d.loss(_loss(2.0), step) for step in range(1, 21))
    assert d.loss(_loss(25.0), 21)
    assert d.take() is not None and d.take() is None  # the reason, once
    assert not d.loss(_loss(30.0), 22)  # still diverging, within the cool-down: asked already
    assert not d.loss(_loss(30.0), 70)
    assert d.loss(_loss(1000.0), 71)  # the cool-down is over


def test_ten_thousand_steps_of_five_percent_noise_ask_nothing() -> None:
    rng = random.Random(3)
    d = Divergence(factor=10, window=100, cooldown_steps=100)
    for step in range(1, 10_001):
        mean = 4.0 * math.exp(-step / 3000) + 0.5  # a loss that falls, as it does
        for _ in range(2):  # two micro-steps an optimizer step
            assert not d.loss(_loss(mean * rng.uniform(0.95, 1.05)), step), step
        assert not d.grad_norm(rng.uniform(0.5, 2.0), step)


def test_a_non_finite_loss_or_gradient_norm_asks() -> None:
    d = Divergence(factor=10, window=100, cooldown_steps=0)
    assert d.loss(_loss(float("nan")), 1)
    assert (d.take() or "").startswith("nonfinite_loss")
    assert not d.grad_norm(3.0, 2) and not d.grad_norm(None, 2)
    assert d.grad_norm(float("inf"), 3)
    assert (d.take() or "").startswith("nonfinite_grad_norm")


def test_factor_zero_watches_nothing_and_a_factor_up_to_one_is_refused() -> None:
    d = Divergence(factor=0, window=100, cooldown_steps=0)
    assert not d.loss(_loss(1.0), 1) and not d.loss(_loss(1e9), 30) and not d.grad_norm(float("nan"), 31)
    with pytest.raises(ValueError, match=r"PULSE_DIVERGENCE_FACTOR=0\.5"):
        TrainerSettings(divergence_factor=0.5)


def test_the_update_ratio_is_the_updates_norm_over_the_weights() -> None:
    w = [torch.full((3,), 2.0), torch.full((4,), 1.0)]  # ||w|| = sqrt(12 + 4) = 4
    ratio = UpdateRatio(5)
    ratio.before(w, 3)  # ahead of step 4: not measured
    assert ratio.after(w) is None
    ratio.before(w, 4)  # ahead of step 5
    w[0] -= 0.1  # the optimizer's update: ||d|| = sqrt(3 x 0.01)
    assert ratio.after(w) == pytest.approx(math.sqrt(0.03) / 4)
    assert UpdateRatio(0).after(w) is None


def test_the_update_ratio_samples_a_large_model() -> None:
    w = [torch.ones(10), torch.ones(10), torch.ones(10)]
    ratio = UpdateRatio(1, max_elements=20)
    ratio.before(w, 0)
    w[2] += 100.0  # beyond the sample: not seen
    w[0] += 1.0
    assert ratio.after(w) == pytest.approx(math.sqrt(10) / math.sqrt(20))


def test_a_checkpoint_note_says_why_the_library_asked() -> None:
    h = Health(factor=10, window=100, cooldown_steps=0, ratio_every=0)
    assert h.note(None) is None
    assert h.note("/ck/emergency-step3") == f"{wire.CHECKPOINT_WRITTEN} /ck/emergency-step3"
    for step in range(1, 12):
        h.loss(_loss(1.0), step)
    assert h.loss(_loss(50.0), 12)
    first, why = (h.note("/ck/emergency-step12") or "").split("\n")
    assert first == f"{wire.CHECKPOINT_WRITTEN} /ck/emergency-step12"
    assert why.startswith("divergence_checkpoint loss_spike loss=50 at step 12 > 10 x mean 1 of the last 11 losses"), (
        why
    )

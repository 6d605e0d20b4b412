"""trainer.mfu: FLOPs per token worked out by hand, the peak table, the ratio."""

from __future__ import annotations

import pytest

from trainer.mfu import mfu, model_flops_per_token, peak_flops


def test_gpt2_small_flops_per_token() -> None:
    # 6 N        = 6 * 124e6                 =   744,000,000
    # 12 L H S   = 12 * 12 * 768 * 1024
    #            = 144 * 768 * 1024 = 110,592 * 1024 = 113,246,208
    # total      =                               857,246,208
    assert model_flops_per_token(params=124_000_000, layers=12, hidden=768, seq_len=1024) == 857_246_208


def test_llama_7b_flops_per_token() -> None:
    # 6 N        = 6 * 6.74e9                = 40,440,000,000
    # 12 L H S   = 12 * 32 * 4096 * 4096 = 384 * 16,777,216 = 6,442,450,944
    # total      =                           46,882,450,944
    assert model_flops_per_token(params=6_740_000_000, layers=32, hidden=4096, seq_len=4096) == 46_882_450_944


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="layers=-1"):
        model_flops_per_token(params=1, layers=-1, hidden=1, seq_len=1)


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-PCIE-40GB", "bf16", 312e12),
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("nvidia h100 pcie", "bf16", 756e12),  # case-insensitive
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA B200", "bf16", 2250e12),
        ("NVIDIA L40S", "bf16", 362e12),  # not the L40 entry
        ("NVIDIA L40", "bf16", 181e12),
        ("NVIDIA A10", "bf16", 125e12),  # not an A100
        ("Tesla V100-SXM2-32GB", "fp16", 125e12),
        ("Tesla V100-PCIE-16GB", "fp16", 112e12),
    ],
)
def test_peak_table(name: str, dtype: str, expected: float) -> None:
    assert peak_flops(name, dtype=dtype) == expected


def test_unknown_device_or_precision_is_none() -> None:
    assert peak_flops("cpu") is None
    assert peak_flops("Tesla V100-SXM2-32GB", dtype="bf16") is None  # Volta has no bf16


def test_override_wins_and_is_checked() -> None:
    assert peak_flops("cpu", override=1e11) == 1e11
    assert peak_flops("NVIDIA H100 80GB HBM3", override=5e14) == 5e14
    with pytest.raises(ValueError, match="override=0"):
        peak_flops("cpu", override=0)
    with pytest.raises(ValueError, match="dtype='fp8'"):
        peak_flops("NVIDIA H100", dtype="fp8")


def test_known_mfu() -> None:
    # 1000 tok/s * 1e9 FLOP/token = 1e12 FLOP/s achieved, over 4 devices * 1e12 peak = 0.25
    assert mfu(tokens_per_s=1000, flops_per_token=1e9, ranks=4, peak_flops_per_device=1e12) == pytest.approx(0.25)
    # 7B on 8 H100 SXM at 3,000 tok/s per GPU: 24,000 * 46,882,450,944 / (8 * 989e12) = 0.14221...
    fpt = model_flops_per_token(params=6_740_000_000, layers=32, hidden=4096, seq_len=4096)
    got = mfu(tokens_per_s=24_000, flops_per_token=fpt, ranks=8, peak_flops_per_device=989e12)
    assert got == pytest.approx(24_000 * 46_882_450_944 / (8 * 989e12))
    assert 0.142 < got < 0.1423


def test_mfu_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="ranks=0"):
        mfu(tokens_per_s=1, flops_per_token=1, ranks=0, peak_flops_per_device=1)
    with pytest.raises(ValueError, match="peak_flops_per_device"):
        mfu(tokens_per_s=1, flops_per_token=1, ranks=1, peak_flops_per_device=0)

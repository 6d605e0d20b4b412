"""Model FLOPs utilisation: training FLOPs per token, peak FLOP/s per device, and their ratio.

MFU is the FLOP/s the model *needs* (the FLOPs of forward + backward per token, times tokens/s)
over the FLOP/s the hardware could deliver at its dense peak. Recomputation (activation
checkpointing) is not counted: it costs time without adding model FLOPs, so it lowers MFU,
which is the point of the figure.

Pure functions, no torch: the trainer passes the device name it got from NVML or
``torch.cuda.get_device_name()``. On a CPU there is no table entry; the caller passes a
configured peak (``PULSE_PEAK_FLOPS``, FLOP/s per device as a float) as ``override``.
"""

from __future__ import annotations

import re
from typing import Final

DTYPES: Final = ("bf16", "fp16")
"""The precisions the peak table knows: dense tensor-core throughput, no structured sparsity."""

# (tokens of the NVML name, {dtype: dense peak FLOP/s}), most specific first. Matching is on whole
# tokens of the upper-cased name split at non-alphanumerics, not on raw substrings, so that
# "A10" does not match "NVIDIA A100-SXM4-80GB" and "L40" does not match "NVIDIA L40S".
# Figures: NVIDIA datasheets, dense (half the "with sparsity" figures).
_PEAKS: Final[tuple[tuple[frozenset[str], dict[str, float]], ...]] = (
    (frozenset({"GB200"}), {"bf16": 2500e12, "fp16": 2500e12}),
    (frozenset({"B200"}), {"bf16": 2250e12, "fp16": 2250e12}),
    (frozenset({"H200", "NVL"}), {"bf16": 835e12, "fp16": 835e12}),
    (frozenset({"H200"}), {"bf16": 989e12, "fp16": 989e12}),
    (frozenset({"GH200"}), {"bf16": 989e12, "fp16": 989e12}),
    (frozenset({"H100", "NVL"}), {"bf16": 835e12, "fp16": 835e12}),
    (frozenset({"H100", "PCIE"}), {"bf16": 756e12, "fp16": 756e12}),
    (frozenset({"H100"}), {"bf16": 989e12, "fp16": 989e12}),  # SXM5 ("H100 80GB HBM3")
    (frozenset({"A100"}), {"bf16": 312e12, "fp16": 312e12}),  # SXM4 and PCIe, 40 and 80 GB
    (frozenset({"A30"}), {"bf16": 165e12, "fp16": 165e12}),
    (frozenset({"A10"}), {"bf16": 125e12, "fp16": 125e12}),
    (frozenset({"L40S"}), {"bf16": 362e12, "fp16": 362e12}),
    (frozenset({"L40"}), {"bf16": 181e12, "fp16": 181e12}),
    (frozenset({"L4"}), {"bf16": 121e12, "fp16": 121e12}),
    (frozenset({"V100", "PCIE"}), {"fp16": 112e12}),  # Volta has no bf16
    (frozenset({"V100"}), {"fp16": 125e12}),  # SXM2
)

_TOKEN_SPLIT = re.compile(r"[^A-Z0-9]+")


def model_flops_per_token(*, params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token of a decoder-only transformer: ``6 N + 12 L H S``.

    ``6 N``: forward (2 per parameter: multiply and add) plus backward (twice the forward) over the
    ``N`` parameters (conventionally the non-embedding count; the caller decides). ``12 L H S``:
    the attention scores and their weighted sum (``Q K^T`` and ``A V``, ``2 S H`` FLOPs per token
    each in the forward, times 3 with the backward), summed over ``L`` layers for context ``S``.
    This is the PaLM (Chowdhery et al. 2022, appendix B) accounting.
    """
    for name, value in (("params", params), ("layers", layers), ("hidden", hidden), ("seq_len", seq_len)):
        if value < 0:
            raise ValueError(f"{name}={value}: expected a count >= 0")
    return 6.0 * params + 12.0 * layers * hidden * seq_len


def peak_flops(device_name: str, *, dtype: str = "bf16", override: float | None = None) -> float | None:
    """Dense peak FLOP/s of one device at ``dtype``, or ``None`` when it is not known.

    ``override`` (a configured figure, for example ``PULSE_PEAK_FLOPS`` on a CPU or a GPU missing
    from the table) wins over the table. ``device_name`` is matched case-insensitively on whole
    tokens, most specific entry first ("NVIDIA H100 PCIe" before "H100"). A known GPU without
    that precision (a V100 at bf16) gives ``None``.
    """
    if override is not None:
        if not override > 0:
            raise ValueError(f"override={override}: expected a peak FLOP/s > 0")
        return float(override)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    tokens = set(_TOKEN_SPLIT.split(device_name.upper()))
    for needed, peaks in _PEAKS:
        if needed <= tokens:
            return peaks.get(dtype)
    return None


def mfu(*, tokens_per_s: float, flops_per_token: float, ranks: int, peak_flops_per_device: float) -> float:
    """Achieved model FLOP/s over the peak of ``ranks`` devices: ``tps * fpt / (ranks * peak)``.

    ``tokens_per_s`` is the throughput of those ``ranks`` together (one rank's own tokens/s with
    ``ranks=1`` gives that rank's MFU).
    """
    if ranks < 1:
        raise ValueError(f"ranks={ranks}: expected >= 1")
    if not peak_flops_per_device > 0:
        raise ValueError(f"peak_flops_per_device={peak_flops_per_device}: expected > 0")
    if tokens_per_s < 0 or flops_per_token < 0:
        raise ValueError(f"tokens_per_s={tokens_per_s}, flops_per_token={flops_per_token}: expected >= 0")
    return tokens_per_s * flops_per_token / (ranks * peak_flops_per_device)

"""The exposition text's pieces every /metrics renderer shares: the content type, label values
escaped, sample values formatted, and the text written out in pieces."""

from __future__ import annotations

import math
from collections.abc import Iterator

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def fmt(v: float | int) -> str:
    """A sample value as the text format writes it (NaN, +Inf, integers without a point)."""
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def escape(value: str) -> str:
    """A label value, escaped as the text format requires."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def encoded(lines: list[str], *, per_chunk: int = 4096) -> Iterator[bytes]:
    """The exposition text of ``lines`` in pieces of ``per_chunk`` lines (about 0.5 MB), each
    ending with a newline: /metrics streams them, so that no one write holds the event loop (the
    whole text is about 150 MB at 16,384 nodes; written at once, copying it into the socket's
    buffer and out again held the loop for over a second)."""
    for start in range(0, len(lines), per_chunk):
        yield ("\n".join(lines[start : start + per_chunk]) + "\n").encode()

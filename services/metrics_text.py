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


def encoded(lines: list[str], *, chunk_chars: int = 1 << 20) -> Iterator[bytes]:
    """The exposition text of ``lines`` in pieces of about ``chunk_chars`` characters (1 MiB;
    an element of ``lines`` is a node's lines of one family), each ending with a newline:
    /metrics streams them, so that no one write holds the event loop (the whole text is 330 MB
    at 16,384 nodes with 8 network ports each; written at once, copying it into the socket's
    buffer and out again held the loop for over a second)."""
    piece: list[str] = []
    size = 0
    for line in lines:
        piece.append(line)
        size += len(line)
        if size >= chunk_chars:
            yield ("\n".join(piece) + "\n").encode()
            piece, size = [], 0
    if piece:
        yield ("\n".join(piece) + "\n").encode()

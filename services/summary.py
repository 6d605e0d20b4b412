"""What the database keeps of a node's telemetry: who the node is, not what it measures.

The full heartbeat of every node lives in memory (the snapshot that REST and /metrics read) and in
Redis (``pulse:{node:N}:latest``, which a new leader and the followers read back). The database
keeps, per node, its :func:`identity`: the heartbeat with every measurement left out (its GPUs by
index, UUID, model, memory size and whether lost; its PSUs and fans by name; labels, address, agent
boot), which changes when a node reboots, loses or swaps a GPU, or is relabelled; and when it was
last seen. A node's identity is written when it changes, never on every heartbeat, and read back
as a valid :class:`~clusterpulse.wire.Heartbeat` whose measurements are absent ("could not read",
never zero) where Redis no longer holds the node's latest.
"""

from __future__ import annotations

from typing import Any

import msgspec

from clusterpulse import wire


def identity(hb: wire.Heartbeat) -> wire.Heartbeat:
    """``hb`` without its measurements, its ``seq`` or its ``sent_at``: equal for two heartbeats
    of the same node unless something a database should know about changed."""
    return msgspec.structs.replace(
        hb,
        seq=0,
        sent_at=0.0,
        gpus=[
            wire.GpuSample(
                index=g.index, uuid=g.uuid, name=g.name, lost=g.lost, memory_total_bytes=g.memory_total_bytes
            )
            for g in hb.gpus
        ],
        psus=[wire.PsuSample(name=p.name) for p in hb.psus],
        fans=[wire.FanSample(name=f.name) for f in hb.fans],
    )


def as_row(ident: wire.Heartbeat) -> dict[str, Any]:
    """The identity as the ``telemetry`` column holds it: absent fields left out, not nulls."""
    row: dict[str, Any] = msgspec.to_builtins(ident)
    for part in ("gpus", "psus", "fans"):
        row[part] = [{k: v for k, v in item.items() if v not in (None, [], {}, "")} for item in row[part]]
    return row


def stored(telemetry: dict[str, object]) -> wire.Heartbeat | None:
    """The identity read back from the database's ``telemetry`` column; None if it holds none
    (a node registered but not yet summarised) or one this version cannot read."""
    if not telemetry:
        return None
    try:
        return msgspec.convert(telemetry, wire.Heartbeat)
    except msgspec.ValidationError:
        return None

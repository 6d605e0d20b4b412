"""What the database keeps of a node's telemetry: who the node is, not what it measures.

The full heartbeat of every node lives in memory (the snapshot that REST and /metrics read) and in
Redis (``pulse:{node:N}:latest``, which a new leader and the followers read back). The database
keeps, per node, its identity: the heartbeat with every measurement left out (its GPUs by index,
UUID, model, memory size and whether lost; its PSUs and fans by name; labels, address, agent boot),
which changes when a node reboots, loses or swaps a GPU, or is relabelled; and when it was last
seen. An identity is written when it changes (:func:`key` differs from the stored one), never on
every heartbeat, and read back (:func:`stored`) as a valid :class:`~clusterpulse.wire.Heartbeat`
whose measurements are absent ("could not read", never zero) where Redis no longer holds the
node's latest.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import msgspec

from clusterpulse import wire

_GPU_ID = attrgetter("index", "uuid", "name", "lost", "memory_total_bytes")

Key = tuple[Any, ...]


def key(hb: wire.Heartbeat) -> Key:
    """Equal for two heartbeats of one node unless something the database keeps changed."""
    return (
        hb.boot_id,
        hb.addr,
        hb.interval_s,
        hb.gpu_source,
        hb.ipmi,
        tuple(sorted(hb.labels.items())),
        tuple(map(_GPU_ID, hb.gpus)),
        tuple(p.name for p in hb.psus),
        tuple(f.name for f in hb.fans),
    )


def row(hb: wire.Heartbeat) -> dict[str, Any]:
    """The identity as the ``telemetry`` column holds it (absent fields left out, not nulls)."""
    gpus = []
    for index, uuid, name, lost, memory in map(_GPU_ID, hb.gpus):
        gpu: dict[str, Any] = {"index": index, "uuid": uuid, "name": name, "lost": lost}
        if memory is not None:
            gpu["memory_total_bytes"] = memory
        gpus.append(gpu)
    return {
        "v": hb.v,
        "node": hb.node,
        "boot_id": hb.boot_id,
        "seq": 0,
        "sent_at": 0.0,
        "interval_s": hb.interval_s,
        "gpu_source": hb.gpu_source,
        "ipmi": hb.ipmi,
        "labels": dict(hb.labels),
        "addr": hb.addr,
        "gpus": gpus,
        "psus": [{"name": p.name} for p in hb.psus],
        "fans": [{"name": f.name} for f in hb.fans],
    }


def stored(telemetry: dict[str, object]) -> wire.Heartbeat | None:
    """The identity read back from the ``telemetry`` column; None if it holds none (a node
    registered but not yet summarised) or one this version cannot read."""
    if not telemetry:
        return None
    try:
        return msgspec.convert(telemetry, wire.Heartbeat)
    except msgspec.ValidationError:
        return None

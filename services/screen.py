"""Screening a batch of heartbeat stream entries: decoded and validated (clusterpulse/wire.py),
then checked against each claimed node's own latest key (services/sender.py), with one pipelined
read per batch of the keys whose earlier contents do not vouch for their entries already.

Both readers of the heartbeat streams use it: the leader's ingest (services/ingest.py) when it
reads them itself, and the ingest processes (services/ingest_worker.py) when they do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from clusterpulse import wire
from clusterpulse.settings import Settings
from services.sender import SenderCheck
from services.shared import read_latest, until_ok

log = logging.getLogger("pulse.orchestrator")

Entries = list[tuple[bytes, dict[bytes, bytes]]]


@dataclass(frozen=True, slots=True)
class Screened:
    """One entry: its heartbeat, or the reason it is refused (a ``pulse_heartbeats_rejected_total``
    reason: ``missing_field``, a :class:`clusterpulse.wire.WireError` reason, or ``sender``)."""

    entry_id: bytes
    heartbeat: wire.Heartbeat | None
    rejected: str = ""
    payload: bytes = b""  # the heartbeat as its agent wrote it


async def screen(
    entries: Entries, *, stream: str, redis_client: aioredis.Redis, senders: SenderCheck, settings: Settings
) -> list[Screened]:
    decoded: list[tuple[bytes, bytes | None, wire.Heartbeat | wire.WireError | None]] = []
    for entry_id, fields in entries:
        payload = fields.get(wire.HEARTBEAT_FIELD) if fields else None
        item: wire.Heartbeat | wire.WireError | None = None
        if payload is not None:
            try:
                item = wire.decode_heartbeat(payload)
            except wire.WireError as exc:
                item = exc
        decoded.append((entry_id, payload, item))
    check = settings.heartbeat_sender_check
    nodes = sorted(
        {hb.node for _, p, hb in decoded if isinstance(hb, wire.Heartbeat) and p and not senders.vouched(hb, p)}
        if check
        else ()
    )
    own: dict[str, bytes | None] = {}
    if nodes:

        async def read_own() -> None:
            own.update(await read_latest(redis_client, nodes))

        await until_ok(settings, "sender check", read_own)
    out: list[Screened] = []
    for entry_id, payload, item in decoded:
        if payload is None or item is None:
            out.append(Screened(entry_id, None, "missing_field"))
        elif isinstance(item, wire.WireError):
            out.append(Screened(entry_id, None, item.reason))
            log.debug("event=heartbeat_rejected reason=%s detail=%s", item.reason, item)
        elif check and (reason := senders.verdict(item, payload, own.get(item.node))) is not None:
            out.append(Screened(entry_id, None, reason))
            log.warning(
                "event=heartbeat_rejected reason=%s node=%s boot_id=%s seq=%d entry=%s stream=%s detail=%r",
                reason, item.node, item.boot_id, item.seq, entry_id.decode(), stream,
                "its node's own latest key does not hold this heartbeat or a newer one of the same boot",
            )  # fmt: skip
        else:
            out.append(Screened(entry_id, item, payload=payload))
    return out

"""Screening a batch of heartbeat stream entries: decoded and validated (clusterpulse/wire.py),
then checked against each claimed node's own latest key (services/ingest/decide.py), with one pipelined
read per batch of the keys whose earlier contents do not vouch for their entries already.

Both readers of the heartbeat streams use it: the leader's ingest (services/ingest/loop.py) when it
reads them itself, and the ingest processes (services/ingest/worker.py) when they do; and both
read their streams with :func:`read_group` and take over idle entries with :func:`autoclaim`.

On a Redis Cluster one ``XREADGROUP`` may name streams of one slot only: :func:`read_group` reads
each slot's streams with one command, all slots at once, and a slot whose master does not answer
(failing over) does not hold up the others (docs/design/redis-cluster.md, "Reading by shard").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import redis.exceptions

from clusterpulse import wire
from clusterpulse.redis_client import AsyncRedis, by_slot, is_cluster
from clusterpulse.retry import is_transient
from clusterpulse.settings import Settings
from services.ingest.decide import SenderCheck
from services.shared import read_latest, until_ok

log = logging.getLogger("pulse.orchestrator")

Entries = list[tuple[bytes, dict[bytes, bytes]]]


async def read_group(
    client: AsyncRedis,
    consumer: str,
    streams: dict[str, str],
    *,
    count: int,
    block_ms: int | None,
    failed: set[str] | None = None,
) -> list[tuple[str, Entries]]:
    """XREADGROUP of the orchestrator's group, normalised to [(stream, [(id, fields)])] for RESP2
    and RESP3 replies.

    On a Cluster, one read per slot, concurrently: first without blocking, and only when none of
    them brought anything, again blocking up to ``block_ms`` (so a quiet slot never delays a busy
    one's entries; on a quiet Cluster an entry may wait up to ``block_ms`` for the other slots'
    reads). With ``failed`` given, a slot whose read fails transiently (its master down, a
    failover under way) adds its streams to ``failed`` and the others' entries are returned; the
    error is raised only when every slot failed. The entries such a read may have been given
    before its reply was lost stay pending with this consumer: the caller reads them again."""
    if not is_cluster(client):
        return await _read_one(client, consumer, streams, count=count, block_ms=block_ms)
    groups = [{k: streams[k] for k in keys} for keys in by_slot(streams)]
    out = await _read_slots(client, consumer, groups, count=count, block_ms=None, failed=failed)
    if block_ms is not None and not any(entries for _, entries in out):
        out = await _read_slots(client, consumer, groups, count=count, block_ms=block_ms, failed=failed)
    return out


async def _read_slots(
    client: AsyncRedis,
    consumer: str,
    groups: list[dict[str, str]],
    *,
    count: int,
    block_ms: int | None,
    failed: set[str] | None,
) -> list[tuple[str, Entries]]:
    replies = await asyncio.gather(
        *(_read_one(client, consumer, g, count=count, block_ms=block_ms) for g in groups), return_exceptions=True
    )
    out: list[tuple[str, Entries]] = []
    errors: list[BaseException] = []
    for group, reply in zip(groups, replies, strict=True):
        if isinstance(reply, BaseException):
            if failed is None or not (is_transient(reply) or _moved_away(reply)):
                raise reply
            errors.append(reply)
            failed.update(group)
        else:
            out.extend(reply)
    if errors and len(errors) == len(groups):
        raise errors[0]
    return out


def _moved_away(exc: BaseException) -> bool:
    """A blocked read whose stream was migrated to another master (resharding) while it waited:
    read again, at the new master."""
    return isinstance(exc, redis.exceptions.ResponseError) and str(exc).startswith("UNBLOCKED")


async def _read_one(
    client: AsyncRedis, consumer: str, streams: dict[str, str], *, count: int, block_ms: int | None
) -> list[tuple[str, Entries]]:
    resp: Any = await client.xreadgroup(
        wire.ORCHESTRATOR_GROUP, consumer, cast(Any, streams), count=count, block=block_ms
    )
    items = resp.items() if isinstance(resp, dict) else (resp or [])
    out: list[tuple[str, Entries]] = []
    for stream, entries in items:
        name = stream.decode() if isinstance(stream, bytes) else str(stream)
        out.append((name, entries[0] if entries and isinstance(entries[0], list) else entries))
    return out


async def autoclaim(
    client: AsyncRedis, stream: str, consumer: str, *, min_idle_ms: int, count: int
) -> AsyncIterator[Entries]:
    """Every entry of ``stream`` pending with any consumer for at least ``min_idle_ms`` becomes
    ``consumer``'s (``XAUTOCLAIM``), a batch at a time, until the whole pending list was scanned;
    entries trimmed from the stream meanwhile are left out."""
    start: Any = "0-0"
    while True:
        resp = await client.xautoclaim(
            stream, wire.ORCHESTRATOR_GROUP, consumer, min_idle_ms, start_id=start, count=count
        )
        start = resp[0]  # the cursor: 0-0 once the whole pending list was scanned
        yield [e for e in resp[1] if e and e[1] is not None]
        if start in (b"0-0", "0-0"):
            return


@dataclass(frozen=True, slots=True)
class Screened:
    """One entry: its heartbeat, or the reason it is refused (a ``pulse_heartbeats_rejected_total``
    reason: ``missing_field``, a :class:`clusterpulse.wire.WireError` reason, or ``sender``)."""

    entry_id: bytes
    heartbeat: wire.Heartbeat | None
    rejected: str = ""
    payload: bytes = b""  # the heartbeat as its agent wrote it


async def screen(
    entries: Entries, *, stream: str, redis_client: AsyncRedis, senders: SenderCheck, settings: Settings
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

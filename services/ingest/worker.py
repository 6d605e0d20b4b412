"""An ingest process: reads heartbeat stream shards, hands the leader observations.

``PULSE_INGEST_PROCESSES=N`` (N > 0) makes each orchestrator replica start N of these
(services/ingest/pool.py); ``pulse ingest`` runs one by itself, on any host that reaches Redis.
They are consumers of the heartbeat streams' consumer group, as the leader is when it reads them
itself, so Redis shares the shards' entries among them: adding a process adds throughput, and a
process needs no assignment and holds nothing another could not rebuild.

Each batch read is screened (services/ingest/screen.py: decoded, validated, sender-checked), read for
what it says about the hardware (services/health/decide.py ``read``) and handed over with the
:data:`services.ingest.observations.HANDOFF` script: acknowledged and appended to the observation stream
in one step. Entries another process read and has not handed over within
``PULSE_INGEST_CLAIM_S`` (a killed or hung process) are claimed (``XAUTOCLAIM``) and handed over
here; one handed over twice reaches the leader once (the script appends a batch only while all
of it is still pending). A malformed heartbeat becomes a rejected observation, counted by the leader; it
never stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator

import redis.exceptions

from clusterpulse import wire
from clusterpulse.proc import LOG_FORMAT
from clusterpulse.redis_client import AsyncRedis, connect
from clusterpulse.retry import is_transient
from clusterpulse.settings import Settings
from services.clock import entry_time
from services.health import decide as health
from services.ingest import observations
from services.ingest.decide import SenderCheck
from services.ingest.screen import Entries, autoclaim, read_group, screen
from services.runner import Retry, Runner, Tick

log = logging.getLogger("pulse.ingest")


_FORGET = """
-- KEYS[1]: a heartbeat stream; ARGV[1]: the group; ARGV[2]: a consumer. Deleted only while it holds
-- nothing: DELCONSUMER drops a consumer's pending entries with it.
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return -1
"""


class IngestWorker(Tick):
    """One process's reading and handing over, a tick of its own runner."""

    name = "ingest_worker"
    leader_only = False

    def __init__(self, settings: Settings, *, redis_client: AsyncRedis, consumer: str | None = None) -> None:
        self.settings = settings
        self.redis = redis_client
        self.consumer = consumer or f"ingest-{socket.gethostname()}-{os.getpid()}"
        self.streams = wire.heartbeat_stream_keys(settings.heartbeat_stream_shards)
        # each shard's observations: one stream on one Redis, the shard's own on a Cluster
        self.observations = {
            s: observations.stream_for(i, cluster=settings.redis_cluster) for i, s in enumerate(self.streams)
        }
        self.policy = health.Policy.from_settings(settings)
        self.senders = SenderCheck()
        self.maxlen = settings.heartbeat_stream_maxlen * (
            1 if settings.redis_cluster else settings.heartbeat_stream_shards
        )
        self.handoff = redis_client.register_script(observations.HANDOFF)
        self.forget = redis_client.register_script(_FORGET)
        self.handed = 0  # entries handed over by this process
        self.claimed = 0  # entries claimed from other consumers
        self.interval_s = settings.ingest_block_s
        self._fresh = True  # set up the group and claim before the next read (:meth:`tick`)
        self._claimed_at = 0.0  # monotonic

    async def tick(self, now: float) -> float:
        """One read handed over; read again at once. The first turn, and the turn after one that
        did not finish (a Redis restart deletes the group), create the group and claim first.
        On a Redis Cluster a shard whose master does not answer (failing over) is skipped this
        turn, the others are read: what it gave this process before is claimed back later."""
        claim_every = max(0.05, self.settings.ingest_claim_s / 2)
        if self._fresh:
            for stream in self.streams:
                async with self._shard(stream):
                    with contextlib.suppress(redis.exceptions.ResponseError):  # BUSYGROUP: it exists
                        await self.redis.xgroup_create(stream, wire.ORCHESTRATOR_GROUP, id="0", mkstream=True)
            self._claimed_at = -claim_every
        self._fresh = True
        if time.monotonic() - self._claimed_at >= claim_every:
            await self.claim()
            self._claimed_at = time.monotonic()
        block_ms = max(1, int(self.settings.ingest_block_s * 1000))
        streams = dict.fromkeys(self.streams, ">")
        read = await read_group(
            self.redis, self.consumer, streams, count=self.settings.ingest_batch, block_ms=block_ms,
            failed=set() if self.settings.redis_cluster else None,
        )  # fmt: skip
        for stream, entries in read:
            await self.hand_over(stream, entries)
        self._fresh = False
        return 0.0

    @contextlib.asynccontextmanager
    async def _shard(self, stream: str) -> AsyncIterator[None]:
        """On a Redis Cluster: a transient error of one shard (its master failing over) is logged
        and that shard left for a later turn; on one Redis, and any other error, it is raised."""
        try:
            yield
        except Exception as exc:
            if not (self.settings.redis_cluster and is_transient(exc)):
                raise
            log.warning("event=shard_unavailable stream=%s consumer=%s error=%r", stream, self.consumer, str(exc))

    async def claim(self) -> None:
        """Take over what other consumers read and left pending longer than a claim lease."""
        min_idle_ms = int(self.settings.ingest_claim_s * 1000)
        for stream in self.streams:
            async with self._shard(stream):
                batches = autoclaim(
                    self.redis, stream, self.consumer, min_idle_ms=min_idle_ms, count=self.settings.ingest_batch
                )
                async for entries in batches:
                    if entries:
                        self.claimed += len(entries)
                        log.info(
                            "event=ingest_claimed stream=%s entries=%d consumer=%s", stream, len(entries), self.consumer
                        )
                        await self.hand_over(stream, entries)
                await self._forget_gone(stream, min_idle_ms)

    async def _forget_gone(self, stream: str, min_idle_ms: int) -> None:
        """Consumers of ingest processes gone long ago, with nothing pending, leave the group's
        list (a restarted process is a new consumer). One still alive comes back at its next read."""
        for c in await self.redis.xinfo_consumers(stream, wire.ORCHESTRATOR_GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
            if (
                name.startswith("ingest-")
                and name != self.consumer
                and not c["pending"]
                and c["idle"] > 10 * min_idle_ms
            ):
                await self.forget(keys=[stream], args=[wire.ORCHESTRATOR_GROUP, name])

    async def hand_over(self, stream: str, entries: Entries) -> int:
        """Screen, read and hand over one batch of one stream; returns how many reached the leader."""
        if not entries:
            return 0
        screened = await screen(
            entries, stream=stream, redis_client=self.redis, senders=self.senders, settings=self.settings
        )
        items: dict[bytes, observations.Observed] = {}
        for s in screened:
            at, hb = entry_time(s.entry_id), s.heartbeat
            if hb is None:
                items[s.entry_id] = observations.Observed(at, s.rejected)
            else:
                r = health.read(hb, policy=self.policy)
                items[s.entry_id] = observations.Observed(
                    at, "", hb.node, hb.sent_at, len(hb.gpus), hb.labels, s.payload, r.faults, r.warnings, r.throttled,
                    r.tcp, r.rates, r.gpu_faults, r.gpus_lost,
                )  # fmt: skip
        n = 0
        while items:  # once, unless another process handed over part of the batch meanwhile
            blob = observations.encode_batch(list(items.values()))
            keys = [self.observations[stream], stream]
            res = await self.handoff(
                keys=keys, args=[wire.ORCHESTRATOR_GROUP, self.consumer, self.maxlen, blob, *items]
            )
            if isinstance(res, int):
                n = res
                break
            still = set(res)
            items = {k: v for k, v in items.items() if k in still}
        self.handed += n
        return n


async def run(settings: Settings) -> None:
    """One ingest process until SIGTERM or SIGINT."""
    client = connect(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=settings.redis_timeout_s)
    worker = IngestWorker(settings, redis_client=client)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("event=ingest_started consumer=%s streams=%d", worker.consumer, len(worker.streams))
    # the worker decides nothing on time: the runner's clock is this host's
    runner = Runner([worker], now=time.time, leading=lambda: False, retry=Retry.from_settings(settings))
    runner.start()
    await stop.wait()
    await runner.stop()
    await client.aclose()
    log.info("event=ingest_stopped consumer=%s handed=%d claimed=%d", worker.consumer, worker.handed, worker.claimed)


def main() -> None:
    """``python -m services.ingest.worker``: the settings as JSON on standard input (what
    services/ingest/pool.py writes), so that a parent built from keyword arguments passes them whole."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    settings = Settings.model_validate_json(sys.stdin.read())
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()

"""Observations: what the ingest processes hand the leader instead of raw heartbeats.

With ``PULSE_INGEST_PROCESSES`` above 0, the ingest processes (services/ingest/worker.py) read
the heartbeat stream shards, screen each entry (services/ingest/screen.py) and read what it says about
the hardware (:func:`services.health.decide.read`), and hand the result over in one step: a Lua script
(:data:`HANDOFF`) acknowledges a batch's heartbeat entries (``XACK``) and appends their
observations, as one msgpack array, to an observation stream, only if every one of them is still
pending. An entry that another ingest process claimed and handed over first is not pending any
more: the script then changes nothing and names the entries still pending, and the process hands
over those alone. So every heartbeat reaches the leader once, and a process killed before the
script ran leaves its entries pending for the others to claim. The leader
reads the observation stream with the consumer group and acknowledges an observation entry once
what it carried is stored, exactly as it did the heartbeat entries (services/ingest/loop.py).

What the leader saves and what stays with it: docs/design/ingest.md.
"""

from __future__ import annotations

import msgspec

from clusterpulse import wire
from services.health import decide as health

OBSERVATION_STREAM = "pulse:{ingest}:observations"
"""The one observation stream on one Redis. On a Redis Cluster the script's keys must share a slot,
so each heartbeat stream shard has its own, on its slot (``wire.observation_stream_key``)."""


def stream_keys(shards: int, *, cluster: bool) -> list[str]:
    """Every observation stream the leader reads."""
    return wire.observation_stream_keys(shards) if cluster else [OBSERVATION_STREAM]


def stream_for(shard: int, *, cluster: bool) -> str:
    """The observation stream the observations of heartbeat stream shard ``shard`` go to."""
    return wire.observation_stream_key(shard) if cluster else OBSERVATION_STREAM


OBSERVATION_FIELD = b"o"


class Observed(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One heartbeat entry, screened: ``rejected`` is empty and the rest describes the heartbeat,
    or it is the reason the entry was refused. The heartbeat itself travels as its agent wrote it
    (``payload``, already validated): the leader decodes it only when something reads it."""

    at: float  # when Redis took the entry in (its id), the one clock health measures silence on
    rejected: str
    node: str = ""
    sent_at: float = 0.0
    gpus: int = 0
    labels: dict[str, str] = {}
    payload: bytes = b""
    faults: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    throttled: tuple[str, ...] = ()
    tcp: tuple[str, ...] = ()
    rates: tuple[tuple[str, str, float], ...] = ()
    gpu_faults: tuple[tuple[int, str], ...] = ()  # last: an ingest process of the version before sends none
    gpus_lost: tuple[int, ...] = ()

    @property
    def reading(self) -> health.Reading:
        return health.Reading(
            self.faults, self.warnings, self.throttled, self.tcp, self.rates, self.gpu_faults, self.gpus_lost
        )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Observed])


def encode_batch(items: list[Observed]) -> bytes:
    """A batch's observations, as :data:`HANDOFF` appends them."""
    return _encoder.encode(items)


def decode_batch(blob: bytes) -> list[Observed]:
    """An observation entry's array. Raises ``msgspec.DecodeError`` (or ``ValidationError``) on
    bytes no ingest process wrote."""
    return _decoder.decode(blob)


HANDOFF = """
-- KEYS[1]: the observation stream; KEYS[2]: the heartbeat stream the entries are from.
-- ARGV[1]: the consumer group; ARGV[2]: this consumer; ARGV[3]: the observation stream's MAXLEN
-- (approximate); ARGV[4]: the observations, one msgpack array; then the heartbeat entry ids.
local ids, claim = {}, {'XCLAIM', KEYS[2], ARGV[1], ARGV[2], '0'}
for i = 5, #ARGV do
  ids[#ids + 1] = ARGV[i]
  claim[#claim + 1] = ARGV[i]
end
claim[#claim + 1] = 'JUSTID'
local live = redis.call(unpack(claim))  -- the ids still pending, whoever holds them
if #live ~= #ids then
  return live
end
redis.call('XACK', KEYS[2], ARGV[1], unpack(ids))
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'o', ARGV[4])
return #ids
"""
"""Hand a batch over, atomically (a script runs whole or not at all): when every entry of the batch
is still pending (nobody else handed any of it over), acknowledge them all and append the
observations, and return how many; otherwise change nothing and return the ids still pending,
for the caller to hand over those alone."""

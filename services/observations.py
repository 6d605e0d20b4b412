"""Observations: what the ingest processes hand the leader instead of raw heartbeats.

With ``PULSE_INGEST_PROCESSES`` above 0, the ingest processes (services/ingest_worker.py) read
the heartbeat stream shards, screen each entry (services/screen.py) and read what it says about
the hardware (:func:`services.health.read`), and hand the result over in one step: a Lua script
acknowledges each heartbeat entry (``XACK``) and appends the observations of the entries it really
acknowledged, as one msgpack array, to ``OBSERVATION_STREAM``. An entry that another ingest
process claimed and handed over first is not pending any more, so its second observation is
dropped there: every heartbeat reaches the leader once, and a process killed before the script
ran leaves its entries pending for the others to claim. The leader reads the observation stream
with the consumer group and acknowledges an observation entry once what it carried is stored,
exactly as it did the heartbeat entries (services/ingest.py).

What the leader saves per heartbeat: the Redis reply of one entry per batch instead of one per
heartbeat, a msgpack decode instead of JSON (no number parsing), and the sender check and health
reading, done by the ingest processes. What stays with it: the node's throttle clock and streaks
(:func:`services.health.observe_reading`), evaluation, and everything after.
"""

from __future__ import annotations

import msgspec

from clusterpulse import wire
from services import health

OBSERVATION_STREAM = "pulse:{ingest}:observations"
OBSERVATION_FIELD = b"o"


class Observed(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One heartbeat entry, screened: ``rejected`` is empty and ``heartbeat`` set, or the reason."""

    at: float  # when Redis took the entry in (its id), the one clock health measures silence on
    rejected: str
    heartbeat: wire.Heartbeat | None
    faults: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    throttled: tuple[str, ...] = ()

    @property
    def reading(self) -> health.Reading:
        return health.Reading(self.faults, self.warnings, self.throttled)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Observed])


def encode(item: Observed) -> bytes:
    """One observation, as an element of the array :data:`HANDOFF` builds."""
    return _encoder.encode(item)


def decode_batch(blob: bytes) -> list[Observed]:
    """An observation entry's array. Raises ``msgspec.DecodeError`` (or ``ValidationError``) on
    bytes no ingest process wrote."""
    return _decoder.decode(blob)


HANDOFF = """
-- KEYS[1]: the observation stream; KEYS[2]: the heartbeat stream the entries are from.
-- ARGV[1]: the consumer group; ARGV[2]: the observation stream's MAXLEN (approximate);
-- then pairs of (heartbeat entry id, its encoded observation).
local parts, n = {}, 0
for i = 3, #ARGV, 2 do
  if redis.call('XACK', KEYS[2], ARGV[1], ARGV[i]) == 1 then
    n = n + 1
    parts[n] = ARGV[i + 1]
  end
end
if n > 0 then
  local head = struct.pack('>BI4', 221, n)  -- a msgpack array32 of n elements
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'o', head .. table.concat(parts))
end
return n
"""
"""Acknowledge heartbeat entries and append the observations of those this call acknowledged,
atomically (a script runs whole or not at all): returns how many were handed over."""

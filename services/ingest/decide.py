"""Who sent a heartbeat: what the per-node Redis users of ``clusterpulse/acl.py`` let the
orchestrator's ingest conclude about the writer of a stream entry.

Redis does not record who wrote a stream entry, but only ``pulse-node-NAME`` may write
``pulse:{node:NAME}:latest``, and the publisher sets that key before its ``XADD``. So
:class:`SenderCheck` refuses (reason ``sender``, counted in ``pulse_heartbeats_rejected_total``)
an entry claiming node N that N's own key does not vouch for: the key is missing, names another
node, is of another ``boot_id``, is older than the entry, or has the same ``seq`` with other
bytes. It is evidence, not a signature; what it does not close (a backlog window, the shared
job-status and trainer streams, an admin user): docs/design/sender.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from clusterpulse import wire


@dataclass(frozen=True, slots=True)
class _Vouch:
    boot_id: str
    seq: int
    digest: bytes  # of the payload the key held at that seq


class SenderCheck:
    """Whether a stream entry's node vouches for it (docs/design/sender.md), with a memory.

    What a node's own key once held stays proof: the key only moves forward, so once it held
    ``(boot_id, seq)`` every entry of that boot with a lower ``seq`` (and the entry of that ``seq``
    with the same bytes) was written by the node. The orchestrator therefore reads the own keys of
    only the entries :meth:`vouched` cannot pass: in steady state about one per entry (each is its
    node's newest), behind a backlog one per node per batch. Evidence is remembered per node, so
    the memory is bounded by the cluster's size."""

    def __init__(self) -> None:
        self._vouched: dict[str, _Vouch] = {}

    def vouched(self, hb: wire.Heartbeat, payload: bytes) -> bool:
        """Passed on what the node's key held before, with no read."""
        v = self._vouched.get(hb.node)
        if v is None or v.boot_id != hb.boot_id or hb.seq > v.seq:
            return False
        return hb.seq < v.seq or hashlib.blake2b(payload, digest_size=16).digest() == v.digest

    def verdict(self, hb: wire.Heartbeat, payload: bytes, own: bytes | None) -> str | None:
        """None when node ``hb.node`` vouches for the entry ``payload`` (decoded: ``hb``), on what
        its own latest key held before or holds now (``own``: its bytes, None when missing); else
        the reason ``sender``. Remembers what ``own`` proves."""
        if self.vouched(hb, payload):
            return None
        if own is None:
            return "sender"
        if own == payload:
            latest = hb
        else:
            try:
                latest = wire.decode_heartbeat(own)
            except wire.WireError:
                return "sender"
            if latest.node != hb.node:
                return "sender"  # the key of N holds another node's heartbeat: its writer lies
        v = self._vouched.get(hb.node)
        if v is None or latest.boot_id != v.boot_id or latest.seq >= v.seq:
            digest = hashlib.blake2b(own, digest_size=16).digest()
            self._vouched[hb.node] = _Vouch(latest.boot_id, latest.seq, digest)
        if own == payload:
            return None  # the key holds this very entry (the usual case: one hash, not two)
        return None if self.vouched(hb, payload) else "sender"

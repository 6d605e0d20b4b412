"""Who sent a heartbeat: what the per-node Redis users of ``clusterpulse/acl.py`` let the
orchestrator's ingest conclude about the writer of a stream entry.

Redis does not record the writer of a stream entry, and an ACL cannot
restrict which entries a user ``XADD``\\ s to a stream it may write, so the sender of an entry of a
*shared* heartbeat stream cannot be read off the entry. It can be known where the key itself
belongs to one node: only ``pulse-node-NAME`` (and admins) can write ``pulse:{node:NAME}:latest``.
The publisher ``SET``\\ s that key before its ``XADD`` on the same connection, so when the
orchestrator reads an entry claiming node N, N's own key holds that heartbeat or a newer one of
the same agent process. :class:`SenderCheck` refuses (reason ``sender``, counted in
``pulse_heartbeats_rejected_total``) an entry that N's own key does not vouch for: the key is
missing, names another node, is of another ``boot_id``, is older than the entry (``seq``), or is of
the same ``seq`` with other bytes. A heartbeat sent with A's credentials and claiming B is refused
unless the forger knows B's current ``boot_id`` and ``seq`` (both shown by the REST API) and the
orchestrator lags more than one interval behind the stream (see below).

**Limits, honestly.**

- The check is evidence, not a signature. With the orchestrator behind by more than an interval
  (a backlog after its restart), an entry with B's ``boot_id`` and a ``seq`` between the last one
  the orchestrator folded and B's latest passes; the genuine entry with the same ``seq`` follows
  and is folded after it, so a forger gets at most that backlog window.
- A genuine heartbeat from before an agent restart that the orchestrator reads only after the
  restart is refused too (another ``boot_id``), unless :class:`SenderCheck` already remembers a
  newer ``seq`` of that boot: harmless (a newer heartbeat of the node follows), but it shows in
  the ``sender`` count.
- A node may write to its shard of the heartbeat stream, and so can trim it (``XADD ... MAXLEN
  0``) or push its ids into the future (``XADD`` with an explicit id), which delays or drops the
  other nodes' entries of that shard; more shards narrow the damage to the nodes sharing one.
  Likewise for the shared job-status and trainer streams, whose entries (``JobStatus.node``,
  ``TrainerReport.node``) carry no per-node evidence at all: a node's credentials can claim
  another node's job status or rank there. Closing these needs per-node streams (one consumer
  group read over thousands of keys) or signed entries; neither is done here.
- An admin user (``default``) can write anything; the check only binds the per-node users.
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
    """Whether a stream entry's node vouches for it (see the module docstring), with a memory.

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

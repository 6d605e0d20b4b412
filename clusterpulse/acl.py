"""Redis credentials: one ACL user per node, one for the orchestrator, and what they let the
orchestrator conclude about who sent a heartbeat.

**Users.** ``pulse-node-NAME`` is what a node's agent and the training ranks it launches use
(they run on that node and inherit its ``PULSE_REDIS_URL``); ``pulse-orchestrator`` is what the
orchestrator (and its REST API) uses. Each gets only the commands its code sends, each command
only on the keys and channels it sends it to, using Redis 7 ACL selectors so that a command
allowed on one key is not allowed on another (``SET`` on the node's latest key must not become
``SET`` over a shared stream). A node user may:

- ``SET`` its own latest-heartbeat key (``pulse:{node:NAME}:latest``; agent/publisher.py);
- ``XADD`` to its own heartbeat stream shard only (``wire.node_heartbeat_stream_key``, so the
  rules depend on ``heartbeat_stream_shards``: change it and re-apply every node's rules), to the
  job-status stream (agent/launcher.py) and to the trainer report and registration streams
  (trainer/report.py);
- ``XREAD`` its own command stream (``pulse:{node:NAME}:commands``), ``GET`` job plans and
  ``SUBSCRIBE`` to the plan channel (trainer/follow.py);
- ``PING`` and ``SELECT`` (what redis-py sends on connecting; its ``CLIENT SETINFO`` is refused
  and ignored).

Nothing else: not another node's keys, not ``KEYS``/``SCAN``/``FLUSHALL``/``CONFIG``/``ACL``, not
reading any stream. Rules start with ``reset``, so applying them again is safe and replaces
whatever the user had (level-triggered); passwords go in as SHA-256 (``#...``), never in clear.

**Who sent a heartbeat.** Redis does not record the writer of a stream entry, and an ACL cannot
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
import secrets
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

from clusterpulse import wire

NODE_USER_PREFIX = "pulse-node-"
ORCHESTRATOR_USER = "pulse-orchestrator"

# SELECT for a URL with /DB, PING for health checks. redis-py also sends CLIENT SETINFO (Redis
# 7.2+) and ignores its refusal: not granted.
_CONNECTION = ["+ping", "+select"]


def node_username(node: str) -> str:
    """The ACL user of ``node``; a name outside ``wire.NODE_NAME_PATTERN`` is refused."""
    if not wire.valid_node_name(node):
        raise ValueError(f"node={node!r}: expected a name matching {wire.NODE_NAME_PATTERN}")
    return NODE_USER_PREFIX + node


def new_password() -> str:
    """A generated password: 256 bits, URL-safe (it goes into ``PULSE_REDIS_URL`` unquoted)."""
    return secrets.token_urlsafe(32)


def _password_rule(password: str) -> str:
    if not password:
        raise ValueError("password: expected a non-empty password")
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def _key(pattern: str, mode: str = "") -> str:
    return f"%{mode}~{pattern}" if mode else f"~{pattern}"


def node_acl(node: str, *, shards: int, password: str, user: str | None = None) -> list[str]:
    """The arguments of ``ACL SETUSER`` (user name first) for ``node``'s agent and ranks.

    Pure: every key comes from the key functions of :mod:`clusterpulse.wire`, escaped as a glob
    (node names cannot hold glob characters, and are refused unless valid; escaping is the
    second guard). ``shards`` is ``heartbeat_stream_shards``: the node may write its shard only.
    ``user`` replaces the user name (tests; several clusters sharing one Redis).
    """
    user = user if user is not None else node_username(node)
    node_username(node)  # refuses an invalid name whatever the user is called
    esc = wire.glob_escape
    writes = [
        wire.node_heartbeat_stream_key(node, shards),
        wire.JOB_STATUS_STREAM,
        wire.TRAINER_STREAM,
        wire.REGISTRATION_STREAM,
    ]
    return [
        user,
        "reset",
        "on",
        _password_rule(password),
        *_CONNECTION,
        "+subscribe",
        "+unsubscribe",
        "&" + esc(wire.PLAN_CHANNEL),
        f"(+set {_key(esc(wire.node_latest_key(node)), 'W')})",
        "(+xadd " + " ".join(_key(esc(k), "W") for k in writes) + ")",
        f"(+xread {_key(esc(wire.node_commands_key(node)), 'R')})",
        f"(+get {_key(wire.key_glob(wire.job_plan_key), 'R')})",
    ]


def orchestrator_acl(*, password: str, user: str = ORCHESTRATOR_USER) -> list[str]:
    """The arguments of ``ACL SETUSER`` for the orchestrator (services/orchestrator.py, api.py):
    the consumer group over every stream it reads, plans (key and channel), job commands to any
    node, reading any node's latest key (the sender check), ``TIME`` (the one clock), claiming a
    previous leader's pending entries and the fencing scripts (``EVAL`` over the leader's epoch
    key and the plans or commands it writes). Every heartbeat shard, whatever their number."""
    esc = wire.glob_escape
    streams = [
        wire.key_glob(wire.heartbeat_stream_key),
        esc(wire.TRAINER_STREAM),
        esc(wire.JOB_STATUS_STREAM),
        esc(wire.REGISTRATION_STREAM),
    ]
    return [
        user,
        "reset",
        "on",
        _password_rule(password),
        *_CONNECTION,
        "+time",
        "+publish",
        "&" + esc(wire.PLAN_CHANNEL),
        "(+xreadgroup +xack +xautoclaim +xgroup|create " + " ".join(_key(s) for s in streams) + ")",
        f"(+set +get {_key(wire.key_glob(wire.job_plan_key))})",
        f"(+xadd {_key(wire.key_glob(wire.node_commands_key), 'W')})",
        # the fencing scripts (services/leader.py): the epoch key, then the plans or commands
        f"(+get +set {_key(esc(wire.LEADER_KEY))})",
        f"(+eval {_key(esc(wire.LEADER_KEY))} {_key(wire.key_glob(wire.job_plan_key))} "
        f"{_key(wire.key_glob(wire.node_commands_key))})",
        f"(+get {_key(wire.key_glob(wire.node_latest_key), 'R')})",
    ]


def credentials_url(base_url: str, *, username: str, password: str) -> str:
    """``base_url`` (scheme, host, port, database, query such as ``ssl_ca_certs``) with
    ``username:password`` in place of its credentials."""
    parts = urlsplit(base_url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(username, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redis_cli_line(args: list[str]) -> str:
    """``ACL SETUSER args...`` as one line redis-cli reads back unchanged (double quotes where an
    argument holds a space, a quote or a backslash)."""

    def q(a: str) -> str:
        if a and not any(c in a for c in " \"\\'") and a.isprintable():
            return a
        return '"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return " ".join(["ACL", "SETUSER", *(q(a) for a in args)])


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

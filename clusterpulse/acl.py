"""Redis credentials: one ACL user per node and one for the orchestrator.

``pulse-node-NAME`` is what a node's agent and the ranks it launches use; ``pulse-orchestrator``
is the orchestrator's. Each may send only the commands its code sends, each only to the keys and
channels it sends it to (Redis 7 ACL selectors): a node user writes its own latest key and
heartbeat stream shard (so the rules depend on ``heartbeat_stream_shards``), the job-status and
trainer streams, and reads its own and jobs' command streams and the plans. Rules start with
``reset``, so applying them again replaces whatever the user had; passwords go in as SHA-256.
The whole list: docs/design/acl.md.
"""

from __future__ import annotations

import hashlib
import secrets
from urllib.parse import quote, urlsplit, urlunsplit

from clusterpulse import wire

NODE_USER_PREFIX = "pulse-node-"
ORCHESTRATOR_USER = "pulse-orchestrator"

# SELECT for a URL with /DB, PING for health checks. redis-py also sends CLIENT SETINFO (Redis
# 7.2+) and ignores its refusal: not granted.
_CONNECTION = ["+ping", "+select"]
# A Redis Cluster client also reads the slot map (CLUSTER SLOTS) and the command table (COMMAND:
# which arguments are keys), and follows a key mid-move with ASKING.
_CLUSTER_CONNECTION = ["+cluster|slots", "+command", "+asking"]


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


def node_acl(node: str, *, shards: int, password: str, user: str | None = None, cluster: bool = False) -> list[str]:
    """The arguments of ``ACL SETUSER`` (user name first) for ``node``'s agent and ranks.

    Pure: every key comes from the key functions of :mod:`clusterpulse.wire`, escaped as a glob
    (node names cannot hold glob characters, and are refused unless valid; escaping is the
    second guard). ``shards`` is ``heartbeat_stream_shards``: the node may write its shard only.
    ``user`` replaces the user name (tests; several clusters sharing one Redis). ``cluster``: a
    Redis Cluster's client's commands too (the rules are then set on every node of it).
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
        *(_CLUSTER_CONNECTION if cluster else ()),
        "+subscribe",
        "+unsubscribe",
        "&" + esc(wire.PLAN_CHANNEL),
        f"(+set {_key(esc(wire.node_latest_key(node)), 'W')})",
        "(+xadd " + " ".join(_key(esc(k), "W") for k in writes) + ")",
        f"(+xread {_key(esc(wire.node_commands_key(node)), 'R')})",
        f"(+xread +xrevrange {_key(wire.key_glob(wire.job_commands_key), 'R')})",
        f"(+get {_key(wire.key_glob(wire.job_plan_key), 'R')})",
    ]


def orchestrator_acl(*, password: str, user: str = ORCHESTRATOR_USER, cluster: bool = False) -> list[str]:
    """The arguments of ``ACL SETUSER`` for the orchestrator (services/orchestrator.py, api.py):
    the consumer group over every stream it reads, plans (key and channel), job commands to any
    node or Slurm job (and trimming their streams), reading any node's latest key (the sender check), ``TIME`` (the one clock), claiming a
    previous leader's pending entries and the fencing scripts (``EVAL`` over the leader's epoch
    key and the plans or commands it writes). Every heartbeat shard, whatever their number.
    ``cluster``: a Redis Cluster's client's commands too, and each slot's fence key
    (``wire.slot_fence_key``: read, raised and compared with by the fencing scripts)."""
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
        *(_CLUSTER_CONNECTION if cluster else ()),
        "+time",
        "+publish",
        "&" + esc(wire.PLAN_CHANNEL),
        "(+xreadgroup +xack +xautoclaim +xgroup|create " + " ".join(_key(s) for s in streams) + ")",
        f"(+set +get {_key(wire.key_glob(wire.job_plan_key))})",
        f"(+xadd {_key(wire.key_glob(wire.node_commands_key), 'W')} {_key(wire.key_glob(wire.job_commands_key), 'W')})",
        # the commands script trims each stream it writes, keeping every current command
        f"(+xtrim +xlen +xrange {_key(wire.key_glob(wire.node_commands_key))} {_key(wire.key_glob(wire.job_commands_key))})",
        # the fencing scripts (services/leader.py): the epoch key, then the plans or commands
        f"(+get +set {_key(esc(wire.LEADER_KEY))})",
        f"(+eval {_key(esc(wire.LEADER_KEY))} {_key(wire.key_glob(wire.job_plan_key))} "
        f"{_key(wire.key_glob(wire.node_commands_key))} {_key(wire.key_glob(wire.job_commands_key))}"
        + (f" {_key(wire.key_glob(wire.fence_key))}" if cluster else "")
        + ")",
        f"(+get {_key(wire.key_glob(wire.node_latest_key), 'R')})",
        *([f"(+get {_key(wire.key_glob(wire.fence_key), 'R')})"] if cluster else []),
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

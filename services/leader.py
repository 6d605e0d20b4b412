"""High availability: one leader among the orchestrator replicas, under a lease with a fencing token.

Exactly one replica, the **leader**, runs the ingest, evaluate, persist and jobs loops; the
others are **followers**: they serve reads from a snapshot of the database and answer
mutations with 503 naming the leader (token management works on any replica).

- **The lease** is one database row, judged on the database's clock: a conditional UPDATE takes
  or renews it (the pure :func:`decide` says which), every ``leader_renew_s``.
- **The fencing token** is the lease's ``epoch``, one more at every change of holder. Every
  database write transaction checks it before it commits (``db.fence_epoch``); Redis writes go
  through Lua scripts (:data:`FENCED_PLANS`, :data:`FENCED_COMMANDS`) that refuse a lower epoch
  than ``wire.LEADER_KEY``. A refused write ends leadership at once.
- The leader steps down ``leader_margin_s`` before any follower may see the lease expire, on its
  own monotonic clock; while the database is down it goes on leading as long as Redis's epoch
  key vouches for it.
- **Failover** takes at most one lease plus one renew tick; the new leader reloads its state,
  gives every node one full ``degraded_after``, raises the Redis epoch and republishes the plans.

Why each step is safe, and the known limits: docs/design/leader.md.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from clusterpulse import proc, wire
from clusterpulse.redis_client import CLUSTER_SLOTS, AsyncRedis, is_cluster, slot, slot_fence_key
from clusterpulse.retry import PermanentError, is_transient
from clusterpulse.settings import Settings
from services import db
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator.leader")


class NotLeader(PermanentError):
    """This replica does not lead (or no longer does): the write was not made."""


class StaleEpoch(NotLeader):
    """A write carried an epoch lower than the lease's: another replica took over."""


# --- The pure part ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Renew:
    epoch: int


@dataclass(frozen=True)
class Acquire:
    seen_epoch: int
    reclaim: str  # a holder this replica may take the lease from before it runs out ("" : none)
    reason: str


@dataclass(frozen=True)
class Follow:
    holder: str
    epoch: int
    reason: str


def default_replica_id(hostname: str, pid: int) -> str:
    return f"{hostname}-{pid}"


def local_pid(holder: str, hostname: str) -> int | None:
    """The pid of ``holder`` when it names a default-id process of this host, else None."""
    head, sep, pid = holder.rpartition("-")
    return int(pid) if sep and head == hostname and pid.isdigit() else None


def decide(lease: db.LeaseState, *, me: str, leading_epoch: int | None, holder_dead: bool) -> Renew | Acquire | Follow:
    """What a replica does with the lease it just read.

    ``leading_epoch``: the epoch this replica took and has not given up, or None. Its own deadline
    may have passed (a renewal that waited on a busy database): while the row still names it at
    that epoch nobody else can have acted, so it renews the same epoch and goes on where it
    paused, instead of taking the lease back under a new one and reloading everything.
    ``holder_dead``: the holder is a process of this host that no longer runs."""
    if leading_epoch is not None:
        if lease.epoch == leading_epoch and lease.holder == me:
            return Renew(leading_epoch)
        return Follow(lease.holder, lease.epoch, f"lease taken by {lease.holder} at epoch {lease.epoch}")
    if not lease.holder:
        return Acquire(lease.epoch, "", "no replica has led yet")
    if lease.holder == me:
        return Acquire(lease.epoch, "", f"this replica id held epoch {lease.epoch} before: taken back")
    if lease.expires_at <= lease.db_now:
        ago = lease.db_now - lease.expires_at
        return Acquire(lease.epoch, "", f"the lease of {lease.holder} (epoch {lease.epoch}) ran out {ago:.1f}s ago")
    if holder_dead:
        return Acquire(lease.epoch, lease.holder, f"{lease.holder} (epoch {lease.epoch}) no longer runs on this host")
    left = lease.expires_at - lease.db_now
    return Follow(lease.holder, lease.epoch, f"{lease.holder} leads at epoch {lease.epoch} ({left:.1f}s left)")


def lead_deadline(started: float, *, lease_s: float, margin_s: float) -> float:
    """Until when (monotonic) a renewal attempted at ``started`` lets this replica act as leader."""
    return started + lease_s - margin_s


# --- Redis fencing ------------------------------------------------------------------------------

_FENCE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local mine = tonumber(ARGV[1])
if cur > mine then return cur end
if cur < mine then redis.call('SET', KEYS[1], mine) end
"""

RAISE_EPOCH = _FENCE + "return 0\n"
"""KEYS: leader key. ARGV: epoch. Raises the key to ``epoch``; returns the higher epoch that
refused it, or 0."""

FENCED_PLANS = (
    _FENCE
    + """
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], ARGV[2 * i - 1])
  redis.call('PUBLISH', ARGV[2], ARGV[2 * i])
end
return 0
"""
)
"""KEYS: leader key, plan keys. ARGV: epoch, channel, then (payload, job) per plan key."""

FENCED_COMMANDS = (
    _FENCE
    + """
local maxlen, keep_ms, age_ms = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
for i = 2, #KEYS do
  local id = redis.call('XADD', KEYS[i], '*', ARGV[5], ARGV[i + 4], 'EPOCH_FIELD', ARGV[1])
  local ms = tonumber(string.match(id, '^%d+'))
  redis.call('XTRIM', KEYS[i], 'MINID', string.format('%.0f', math.max(0, ms - age_ms)))
  local excess = redis.call('XLEN', KEYS[i]) - maxlen
  if excess > 0 then
    local oldest = redis.call('XRANGE', KEYS[i], '-', '+', 'COUNT', excess + 1)
    local cut = oldest[#oldest][1]
    local floor = math.max(0, ms - keep_ms)
    if tonumber(string.match(cut, '^%d+')) > floor then cut = string.format('%.0f', floor) end
    redis.call('XTRIM', KEYS[i], 'MINID', cut)
  end
end
return 0
"""
).replace("EPOCH_FIELD", wire.COMMAND_EPOCH_FIELD.decode())
"""KEYS: leader key, command stream per command. ARGV: epoch, maxlen, keep_ms, max_age_ms, field,
then one payload per stream. Each entry carries the epoch it was written under
(``wire.COMMAND_EPOCH_FIELD``). Each stream is then trimmed, in Redis server time (the new entry's
id): entries older than ``max_age_ms`` go, then the oldest beyond ``maxlen`` entries, but never
one younger than ``keep_ms`` (a command still current, ``PULSE_JOB_COMMAND_TTL_S``), so a burst of
current commands may hold the stream above ``maxlen`` until they expire."""


def plans_args(epoch: int, plans: Iterable[tuple[str, bytes]]) -> tuple[list[str], list[str | bytes | int]]:
    """KEYS and ARGV of :data:`FENCED_PLANS` for (job, encoded plan) pairs."""
    keys: list[str] = [wire.LEADER_KEY]
    args: list[str | bytes | int] = [epoch, wire.PLAN_CHANNEL]
    for job, payload in plans:
        keys.append(wire.job_plan_key(job))
        args += [payload, job]
    return keys, args


def commands_args(
    epoch: int, commands: Iterable[tuple[str, bytes]], *, maxlen: int, keep_s: float, max_age_s: float
) -> tuple[list[str], list[str | bytes | int]]:
    """KEYS and ARGV of :data:`FENCED_COMMANDS` for (command stream key, encoded command) pairs:
    a node's (``wire.node_commands_key``) or a Slurm job's (``wire.job_commands_key``)."""
    keys: list[str] = [wire.LEADER_KEY]
    args: list[str | bytes | int] = [
        epoch,
        maxlen,
        math.ceil(keep_s * 1000),
        math.ceil(max_age_s * 1000),
        wire.COMMAND_FIELD,
    ]
    for key, payload in commands:
        keys.append(key)
        args.append(payload)
    return keys, args


def by_fence_slot(
    keys: list[str], args: list[str | bytes | int], *, fixed: int, per_key: int
) -> list[tuple[list[str], list[str | bytes | int]]]:
    """A fenced script's KEYS and ARGV (:func:`plans_args`, :func:`commands_args`) split for a
    Redis Cluster: one call per slot of the written keys, each comparing with that slot's fence key
    (``wire.slot_fence_key``) instead of ``wire.LEADER_KEY``. ``fixed``: the ARGV before the
    per-key ones; ``per_key``: ARGV per written key."""
    head, rest = args[:fixed], args[fixed:]
    calls: dict[int, tuple[list[str], list[str | bytes | int]]] = {}
    for i, key in enumerate(keys[1:]):
        s = slot(key)
        call = calls.setdefault(s, ([slot_fence_key(s)], list(head)))
        call[0].append(key)
        call[1].extend(rest[i * per_key : (i + 1) * per_key])
    return list(calls.values())


SCRIPT_ARGS = {FENCED_PLANS: (2, 2), FENCED_COMMANDS: (5, 1)}
"""Per fenced script: (ARGV before the per-key ones, ARGV per written key)."""

CANARY_EVERY = 64
"""On a Redis Cluster, each renewal reads the fence keys of every 64th slot (256 of them); one
below the leader's epoch (a master restarted empty, a failover that lost writes) has the leader
raise every slot's fence again."""


# --- The lease, with its I/O --------------------------------------------------------------------


class LeaderLease:
    """This replica's side of the lease: :meth:`tick` once per ``renew_s``; :meth:`leading` tells
    the loops whether they may act; writes are checked with :meth:`check` (database) and
    :meth:`fenced_eval` (Redis)."""

    def __init__(
        self,
        settings: Settings,
        *,
        sessions: sessionmaker[Session],
        redis_client: AsyncRedis,
        monotonic: Callable[[], float] = time.monotonic,
        pid_alive: Callable[[int], bool] = proc.alive,
    ) -> None:
        self.hostname = socket.gethostname()
        self.me = settings.replica_id or default_replica_id(self.hostname, os.getpid())
        self.lease_s = settings.leader_lease_s
        self.renew_s = settings.leader_renew
        self.margin_s = settings.leader_margin
        self.sessions = sessions
        self.redis = redis_client
        self.monotonic = monotonic
        self.pid_alive = pid_alive
        self.epoch: int | None = None  # the epoch this replica leads under
        self.deadline = 0.0  # monotonic: act as leader only before this
        self.holder = ""  # who leads, as last read
        self.holder_epoch = 0
        self.reason = ""  # why this replica leads or follows, as last decided
        self.refused: Counter[str] = Counter()  # fenced writes refused, by what

    def leading(self) -> bool:
        return self.epoch is not None and self.monotonic() < self.deadline

    def fence(self) -> int:
        """The epoch to write under; :class:`NotLeader` (naming the leader) when not leading."""
        if self.epoch is None or not self.leading():
            raise NotLeader(self.not_leader_detail())
        return self.epoch

    def not_leader_detail(self) -> str:
        if self.holder and self.holder != self.me:
            return (
                f"replica {self.me} follows; the leader is {self.holder} (epoch {self.holder_epoch}): send this there"
            )
        return f"replica {self.me} does not lead right now (no leader yet or its lease ran out): try again shortly"

    async def tick(self) -> None:
        """Read the lease, decide, renew or acquire. The caller compares :meth:`leading` before
        and after; errors propagate (the leader's own deadline still ends its leadership)."""
        started = self.monotonic()
        try:
            outcome = await in_thread(self._tick_db, self.epoch)
        except Exception as exc:
            if is_transient(exc) and await self._redis_vouches(exc):
                return
            raise
        if isinstance(outcome, int):
            if self.epoch != outcome:
                log.info("event=leader_elected replica=%s epoch=%d reason=%r", self.me, outcome, self.reason)
            self.epoch, self.holder, self.holder_epoch = outcome, self.me, outcome
            self.deadline = lead_deadline(started, lease_s=self.lease_s, margin_s=self.margin_s)
            return
        if self.epoch is not None:
            log.warning("event=leader_lost replica=%s epoch=%d reason=%r", self.me, self.epoch, outcome)
            self.epoch = None

    async def _redis_vouches(self, exc: BaseException) -> bool:
        """The database did not answer a leader's renewal. While Redis's epoch key still holds
        this leader's epoch no other replica has taken over (a new leader raises the key before
        it acts), so the check counts as a renewal: health never waits on the database. Once a successor raises the key, this replica sees it at its next tick (or
        its next fenced write) and steps down; its writes are refused meanwhile."""
        if self.epoch is None or not self.leading():
            return False
        checked = self.monotonic()
        try:
            raw = await self.redis.get(wire.LEADER_KEY)
        except Exception:
            return False
        if raw is not None and int(raw) > self.epoch:
            self.step_down(f"database unreachable and Redis fences at epoch {int(raw)}: a successor took over")
        if raw is None or int(raw) != self.epoch:
            return False
        vouched = lead_deadline(checked, lease_s=self.lease_s, margin_s=self.margin_s)
        if vouched > self.deadline:
            self.deadline = vouched
            log.warning(
                "event=leader_held_by_redis replica=%s epoch=%d detail=%r error=%r",
                self.me, self.epoch, "database unreachable; Redis still fences at this epoch", str(exc),
            )  # fmt: skip
        return True

    def _tick_db(self, leading_epoch: int | None) -> int | str:
        """One round in one transaction: the epoch this replica now leads under, or why not."""
        with self.sessions.begin() as s:
            lease = db.read_lease(s)
            pid = local_pid(lease.holder, self.hostname)
            dead = pid is not None and lease.holder != self.me and not self.pid_alive(pid)
            d = decide(lease, me=self.me, leading_epoch=leading_epoch, holder_dead=dead)
            if isinstance(d, Renew):
                if db.renew_lease(s, holder=self.me, epoch=d.epoch, lease_s=self.lease_s):
                    return d.epoch
                return "renewal refused: the lease changed hands"
            if isinstance(d, Acquire):
                got = db.acquire_lease(
                    s, holder=self.me, seen_epoch=d.seen_epoch, reclaim=d.reclaim, lease_s=self.lease_s
                )
                if got is not None:
                    self.reason = d.reason
                    return got
                return "another replica took the lease first"
            if (d.holder, d.epoch) != (self.holder, self.holder_epoch):
                log.info("event=leader_follows replica=%s leader=%s epoch=%d", self.me, d.holder, d.epoch)
            self.holder, self.holder_epoch, self.reason = d.holder, d.epoch, d.reason
            return d.reason

    def step_down(self, reason: str) -> None:
        if self.epoch is not None:
            log.warning("event=leader_lost replica=%s epoch=%d reason=%r", self.me, self.epoch, reason)
        self.epoch = None

    def check(self, session: Session, *, epoch: int, what: str) -> None:
        """Inside a write transaction, just before it commits: refuse it (:class:`StaleEpoch`,
        the transaction rolls back) when the lease has moved past ``epoch``."""
        current = db.fence_epoch(session)
        if current != epoch:
            raise self._refused(what, epoch, current)

    async def raise_epoch(self, epoch: int, *, every_slot: bool = True) -> None:
        """Fence Redis to ``epoch`` (a new leader, before it writes there; every renewal).

        On a Redis Cluster the fence is also every slot's fence key, since a fenced script compares
        with its own slot's: all 16,384 of them at a take-over (``every_slot``); at a renewal
        (``every_slot=False``) only when a sample of them (:data:`CANARY_EVERY`) shows one below
        ``epoch``."""
        higher = int(await self.redis.eval(RAISE_EPOCH, 1, wire.LEADER_KEY, epoch))
        if higher:
            raise self._refused("redis epoch", epoch, higher)
        if not is_cluster(self.redis):
            return
        if not every_slot:
            canaries = [slot_fence_key(s) for s in range(0, CLUSTER_SLOTS, CANARY_EVERY)]
            pipe = self.redis.pipeline(transaction=False)
            for key in canaries:
                pipe.get(key)
            seen = [int(v or 0) for v in await pipe.execute()]
            if max(seen) > epoch:
                raise self._refused("redis epoch", epoch, max(seen))
            if min(seen) == epoch:
                return
            log.warning(
                "event=slot_fences_raised replica=%s epoch=%d reason=%r", self.me, epoch, "a fence key was below"
            )
        pipe = self.redis.pipeline(transaction=False)
        for s in range(CLUSTER_SLOTS):
            pipe.eval(RAISE_EPOCH, 1, slot_fence_key(s), epoch)
        higher = max(int(v) for v in await pipe.execute())
        if higher:
            raise self._refused("redis epoch", epoch, higher)

    async def fenced_eval(self, script: str, keys: list[str], args: list[str | bytes | int], *, what: str) -> None:
        """Run a fenced Redis script; :class:`StaleEpoch` when Redis knows a higher epoch. On a
        Redis Cluster, one call per slot of the written keys (:func:`by_fence_slot`), each fenced
        by its slot's fence key: all of them are refused once a successor raised the fences."""
        epoch = int(args[0])
        if is_cluster(self.redis):
            fixed, per_key = SCRIPT_ARGS[script]
            calls = by_fence_slot(keys, args, fixed=fixed, per_key=per_key)
            pipe = self.redis.pipeline(transaction=False)
            for k, a in calls:
                pipe.eval(script, len(k), *k, *a)
            higher = max((int(v) for v in await pipe.execute()), default=0)
        else:
            higher = int(await self.redis.eval(script, len(keys), *keys, *args))
        if higher:
            raise self._refused(what, epoch, higher)

    def _refused(self, what: str, mine: int, current: int) -> StaleEpoch:
        self.refused[what] += 1
        log.error(
            "event=write_refused_stale_epoch replica=%s what=%r epoch=%d current_epoch=%d",
            self.me, what, mine, current,
        )  # fmt: skip
        if self.epoch == mine:
            self.step_down(f"a {what} write under epoch {mine} was refused: the lease is at epoch {current}")
        return StaleEpoch(
            f"replica {self.me}: {what} write under epoch {mine} refused, the lease is at epoch {current}"
        )

    async def release(self) -> None:
        """A clean stop: end the lease now so that a follower takes over at its next tick."""
        epoch, self.epoch = self.epoch, None
        if epoch is None:
            return

        def write() -> bool:
            with self.sessions.begin() as s:
                return db.release_lease(s, holder=self.me, epoch=epoch)

        if await in_thread(write):
            log.info("event=leader_released replica=%s epoch=%d", self.me, epoch)


def leader_lines(lease: LeaderLease, *, leading: bool) -> list[str]:
    """The replica's own series for /metrics."""
    lines = [
        "# HELP pulse_leader 1 when this replica leads (evaluates health, plans, launches), else 0.",
        "# TYPE pulse_leader gauge",
        f"pulse_leader {1 if leading else 0}",
        "# HELP pulse_leader_epoch The lease's fencing epoch as this replica last saw it.",
        "# TYPE pulse_leader_epoch gauge",
        f"pulse_leader_epoch {lease.epoch if leading and lease.epoch is not None else lease.holder_epoch}",
        "# HELP pulse_leader_fenced_writes_total Writes of this replica refused: their epoch was stale.",
        "# TYPE pulse_leader_fenced_writes_total counter",
    ]
    lines += [f'pulse_leader_fenced_writes_total{{what="{w}"}} {n}' for w, n in sorted(lease.refused.items())]
    return lines

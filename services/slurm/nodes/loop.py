"""Talking to Slurm (``sinfo``, ``scontrol``) and the node-sync loop around the pure decision.

- :class:`SlurmClient` runs ``sinfo`` and ``scontrol update`` as subprocesses (asyncio, each under
  ``PULSE_SLURM_COMMAND_TIMEOUT_S``, ``SLURM_CONF`` from ``PULSE_SLURM_CONF`` when set); a command
  that fails, times out or cannot start raises :class:`SlurmError` (transient) naming the command
  and what it said. :func:`parse_sinfo` reads ``sinfo --Node -O`` output (the recorded outputs
  of a real Slurm 22.05 are in ``tests/fixtures/slurm/``).
- :class:`SlurmSync` is the leader's sync loop body: read Slurm, call
  :func:`services.slurm.nodes.decide.decide`, run the actions, record each as an event (actor ``slurm``,
  with the command's outcome), persist the drains it owns (table ``slurm_drains``, so a restart or
  a new leader forgets nothing) and keep the snapshot ``GET /v1/nodes`` and placement read
  (``NodeView.scheduler``). A Slurm that does not answer is retried with backoff
  (:class:`clusterpulse.retry.Backoff`) and counted (``pulse_slurm_sync_errors_total{op}``); it
  runs as its own loop (services/runner.py), so it never delays health evaluation.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from clusterpulse.retry import Backoff, TransientError
from clusterpulse.settings import Settings
from clusterpulse.states import EventKind
from services import db
from services.cluster import Cluster, NodeView
from services.models import SlurmDrainRow
from services.runner import Tick
from services.slurm.nodes.decide import Action, Breaker, Decision, Drain, Ours, SlurmNode, SyncPolicy, decide

log = logging.getLogger("pulse.orchestrator.slurm")

ACTOR = "slurm"
SEP = "\x1f"  # the unit separator: no Slurm name, state or reason holds it
SINFO_FIELDS = ("NodeList", "StateComplete", "Reason", "User", "Timestamp")
SINFO_ARGS = ("--Node", "--noheader", "--Format=" + ",".join(f"{f}:0{SEP}" for f in SINFO_FIELDS))
OPS = ("sinfo", "drain", "resume")
EVENT_KINDS = tuple(k for k in EventKind if k.startswith("slurm_"))
# sinfo appends these to a state: * not responding, ~ powered off, # powering up, ! pending power
# down, % powering down, $ maintenance reservation, @ reboot pending, ^ rebooting, - planned
_SUFFIX_FLAGS = {"*": "not_responding", "~": "powered_down", "#": "powering_up", "!": "power_down",
                 "%": "powering_down", "$": "maint", "@": "reboot_requested", "^": "reboot_issued", "-": "planned"}  # fmt: skip


class SlurmError(TransientError):
    """A Slurm command failed, timed out or could not start. ``op``: sinfo, drain or resume."""

    def __init__(self, op: str, message: str) -> None:
        super().__init__(message)
        self.op = op


def parse_state(text: str) -> tuple[str, frozenset[str]]:
    """``idle+drain`` -> (``idle``, {``drain``}); ``down*`` -> (``down``, {``not_responding``})."""
    text = text.strip().lower()
    flags: set[str] = set()
    while text and text[-1] in _SUFFIX_FLAGS:
        flags.add(_SUFFIX_FLAGS[text[-1]])
        text = text[:-1]
    base, *rest = text.split("+") if text else ["unknown"]
    return base or "unknown", frozenset(flags | {f for f in rest if f})


def parse_sinfo(text: str) -> dict[str, SlurmNode]:
    """Parse ``sinfo`` run with :data:`SINFO_ARGS` (one line per node and partition: a node in two
    partitions comes twice, alike). Raises ValueError naming a line it cannot read."""
    out: dict[str, SlurmNode] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(SEP)
        if len(parts) < len(SINFO_FIELDS):
            raise ValueError(f"sinfo line {line!r}: expected {len(SINFO_FIELDS)} fields separated by \\x1f")
        name, state, reason, user, stamp = (p.strip() for p in parts[: len(SINFO_FIELDS)])
        base, flags = parse_state(state)
        out[name] = SlurmNode(
            name=name,
            state=base,
            flags=flags,
            reason="" if reason in ("none", "(null)") else reason,
            reason_user="" if user == "Unknown" else user.split("(", 1)[0],
            reason_time="" if stamp in ("Unknown", "None") else stamp,
        )
    return out


class SlurmClient:
    """``sinfo`` and ``scontrol`` as subprocesses, each under a timeout."""

    def __init__(self, *, sinfo: str, scontrol: str, conf: str, timeout_s: float) -> None:
        self.sinfo_cmd = shlex.split(sinfo)
        self.scontrol_cmd = shlex.split(scontrol)
        self.conf_env = {"SLURM_CONF": conf} if conf else {}
        self.env = {**os.environ, **self.conf_env}
        self.timeout_s = timeout_s

    @classmethod
    def from_settings(cls, s: Settings) -> SlurmClient:
        return cls(
            sinfo=s.slurm_sinfo, scontrol=s.slurm_scontrol, conf=s.slurm_conf, timeout_s=s.slurm_command_timeout_s
        )

    async def run(
        self, op: str, argv: list[str], *, stdin: bytes | None = None, env: dict[str, str] | None = None
    ) -> str:
        """Run ``argv`` (with ``stdin`` on its standard input, in ``env`` instead of this
        process's environment); its stdout, or :class:`SlurmError` with the exit status and stderr."""
        cmd = shlex.join(argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=self.env if env is None else env,
                stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
        except OSError as exc:
            raise SlurmError(op, f"{cmd}: cannot start: {exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SlurmError(op, f"{cmd}: no answer within {self.timeout_s:g}s (killed)") from None
        if proc.returncode != 0:
            detail = (err or out).decode(errors="replace").strip().replace("\n", "; ")[:500]
            raise SlurmError(op, f"{cmd}: exit {proc.returncode}: {detail}")
        return out.decode(errors="replace")

    async def nodes(self) -> dict[str, SlurmNode]:
        text = await self.run("sinfo", [*self.sinfo_cmd, *SINFO_ARGS])
        try:
            return parse_sinfo(text)
        except ValueError as exc:
            raise SlurmError("sinfo", str(exc)) from exc

    def drain_argv(self, node: str, reason: str) -> list[str]:
        return [*self.scontrol_cmd, "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]

    def resume_argv(self, node: str) -> list[str]:
        return [*self.scontrol_cmd, "update", f"NodeName={node}", "State=RESUME"]


@dataclass(frozen=True)
class SlurmEvent:
    kind: str
    node: str | None
    reason: str
    at: float


Writer = Callable[[Callable[[Session], Any]], Awaitable[Any]]


class SlurmSync(Tick):
    """The leader's Slurm node sync: state between ticks and one tick (module docstring), on the
    nodes of ``cluster()`` (none yet: no tick); ``write`` stores under the leader's epoch."""

    name = "slurm"

    def __init__(
        self, settings: Settings, client: SlurmClient, *, cluster: Callable[[], Cluster | None], write: Writer
    ) -> None:
        self.settings = settings
        self.client = client
        self.cluster = cluster
        self.write = write
        self.interval_s = settings.slurm_sync_period_s
        self.policy = SyncPolicy(
            max_drain_fraction=settings.slurm_max_drain_fraction,
            drain_window_s=settings.slurm_drain_window_s,
            drain_min_bad_gpus=settings.slurm_drain_min_bad_gpus,
        )
        self.memory: dict[str, Drain] = {}
        self.recent: list[float] = []
        self.breaker = Breaker()
        self.errors: Counter[str] = Counter({op: 0 for op in OPS})
        self.theirs: dict[str, SlurmNode] = {}
        self.last_sync_at: float | None = None
        self.last_error = ""
        self._backoff = Backoff(settings.slurm_sync_period_s, settings.slurm_backoff_max_s)
        self._events: list[SlurmEvent] = []  # recorded, not yet stored
        self._dirty: set[str] = set()  # nodes whose slurm_drains row is not stored yet
        self._held: tuple[str, ...] = ()
        # per node: a drain or resume that failed is not tried again before this time (one clock),
        # backing off like the loop does, so a command Slurm refuses is not an event every period
        self._node_backoff: dict[str, Backoff] = {}
        self._not_before: dict[str, float] = {}

    # --- state across restarts ------------------------------------------------------------------
    def load(self, session: Session, *, now: float) -> None:
        """What a new leader (or a restarted one) knows: the drains it owns, the breaker (the
        newest open/reset event), the drains inside the window (events)."""
        self.memory = {r.node: Drain(r.reason, r.at) for r in session.scalars(select(SlurmDrainRow))}
        newest = db.list_events(session, kinds=[EventKind.SLURM_BREAKER_OPEN, EventKind.SLURM_BREAKER_RESET], limit=1)
        resets = db.list_events(session, kinds=[EventKind.SLURM_BREAKER_RESET], limit=1)
        reset_at = resets[-1].at if resets else None
        if newest and newest[-1].kind == EventKind.SLURM_BREAKER_OPEN:
            self.breaker = Breaker(True, newest[-1].at, newest[-1].reason, reset_at)
        else:
            self.breaker = Breaker(reset_at=reset_at)
        since = now - self.settings.slurm_drain_window_s
        self.recent = [e.at for e in db.list_events(session, kinds=[EventKind.SLURM_DRAIN], since=since, limit=100_000)]
        self._events, self._dirty = [], set()

    def _store(self, session: Session, events: list[SlurmEvent], dirty: Iterable[str]) -> None:
        for node in sorted(dirty):
            mine = self.memory.get(node)
            session.execute(delete(SlurmDrainRow).where(SlurmDrainRow.node == node))
            if mine is not None:
                session.add(SlurmDrainRow(node=node, reason=mine.reason, at=mine.at))
        for ev in events:
            db.record_event(session, kind=ev.kind, node=ev.node, reason=ev.reason, at=ev.at, actor=ACTOR)

    async def flush(self) -> None:
        """Store recorded events and owned drains; kept for the next tick when the database fails."""
        if not self._events and not self._dirty:
            return
        events, dirty = list(self._events), set(self._dirty)
        await self.write(lambda s: self._store(s, events, dirty))
        del self._events[: len(events)]
        self._dirty -= dirty

    # --- one tick -------------------------------------------------------------------------------
    async def tick(self, now: float) -> float | None:
        """Read Slurm, decide, act, record. Returns the seconds to wait before the next tick:
        Slurm not answering backs off (``PULSE_SLURM_BACKOFF_MAX_S``)."""
        cluster = self.cluster()
        if cluster is None:
            return None
        try:
            theirs = await self.client.nodes()
        except SlurmError as exc:
            self._failed(exc)
            await self.flush()
            return self._backoff.next_delay()
        self._backoff.reset()
        self.recent = [t for t in self.recent if t > now - self.policy.drain_window_s]
        self.theirs, self.last_sync_at, self.last_error = theirs, now, ""
        for name, view in cluster.nodes.items():
            if view.scheduler != (now_theirs := theirs.get(name)):
                view.scheduler = now_theirs
                view.changed()
        ours = {name: _ours(name, v) for name, v in cluster.nodes.items()}
        decision = decide(
            ours, theirs, self.memory, self.policy,
            now=now, recent=self.recent, breaker=self.breaker, partitioned=cluster.partitioned,
            backing_off={n for n, t in self._not_before.items() if now < t},
        )  # fmt: skip
        await self._apply(decision, now=now)
        await self.flush()
        return self.settings.slurm_sync_period_s

    def _failed(self, exc: SlurmError) -> None:
        self.errors[exc.op] += 1
        self.last_error = str(exc)
        log.warning("event=slurm_command_failed op=%s error=%r", exc.op, str(exc))

    def _node_failed(self, node: str, now: float) -> None:
        backoff = self._node_backoff.setdefault(
            node, Backoff(self.settings.slurm_sync_period_s, self.settings.slurm_backoff_max_s)
        )
        self._not_before[node] = now + backoff.next_delay()

    def _node_ok(self, node: str) -> None:
        self._node_backoff.pop(node, None)
        self._not_before.pop(node, None)

    async def _command(self, op: str, a: Action, argv: list[str], failed: EventKind, *, now: float) -> bool:
        """Run a drain or resume; on failure count it, back the node off and record ``failed``;
        on success the node's owned drain (or its absence) is to be stored again."""
        try:
            await self.client.run(op, argv)
        except SlurmError as exc:
            self._failed(exc)
            self._node_failed(a.node, now)
            self._events.append(SlurmEvent(failed, a.node, f"{a.why}: {exc}", now))
            return False
        self._node_ok(a.node)
        self._dirty.add(a.node)
        return True

    async def _apply(self, decision: Decision, *, now: float) -> None:
        record = self._events.append
        drain_failed = False
        for a in decision.actions:
            if drain_failed and a.kind in ("drain", "trip"):
                continue  # the count this decision made no longer holds: the next tick decides again
            if a.kind == "drain":
                argv = self.client.drain_argv(a.node, a.slurm_reason)
                if not await self._command("drain", a, argv, EventKind.SLURM_DRAIN_FAILED, now=now):
                    drain_failed = True
                    continue
                self.memory[a.node] = Drain(a.slurm_reason, now)
                if a.counted:
                    self.recent.append(now)
                kind = EventKind.SLURM_DRAIN if a.counted else EventKind.SLURM_DRAIN_CORDON  # only the first counts
                record(SlurmEvent(kind, a.node, f"{a.why}: {shlex.join(argv)}: ok", now))
                log.warning("event=slurm_drain node=%s reason=%r", a.node, a.slurm_reason)
            elif a.kind == "resume":
                argv = self.client.resume_argv(a.node)
                if not await self._command("resume", a, argv, EventKind.SLURM_RESUME_FAILED, now=now):
                    continue
                self.memory.pop(a.node, None)
                record(SlurmEvent(EventKind.SLURM_RESUME, a.node, f"{a.why}: {shlex.join(argv)}: ok", now))
                log.info("event=slurm_resume node=%s", a.node)
            elif a.kind == "disown":
                self.memory.pop(a.node, None)
                self._dirty.add(a.node)
                record(SlurmEvent(EventKind.SLURM_DRAIN_DISOWNED, a.node, a.why, now))
                log.info("event=slurm_drain_disowned node=%s why=%r", a.node, a.why)
            elif a.kind == "trip":
                record(SlurmEvent(EventKind.SLURM_BREAKER_OPEN, a.node, a.why, now))
                log.error("event=slurm_breaker_open node=%s why=%r", a.node, a.why)
        if not drain_failed:
            self.breaker = decision.breaker
        if decision.held != self._held:
            self._held = decision.held
            if decision.held:
                log.warning("event=slurm_held held=%r", list(decision.held))

    def reset_breaker(self, *, now: float, actor: str) -> SlurmEvent | None:
        """An operator closes the breaker; drains before ``now`` no longer count. None when it was
        not open (nothing recorded)."""
        if not self.breaker.open:
            return None
        was = self.breaker
        self.breaker = Breaker(reset_at=now)
        return SlurmEvent(
            EventKind.SLURM_BREAKER_RESET,
            None,
            f"drain breaker reset by {actor} (open since {was.since}: {was.reason})",
            now,
        )

    # --- what /metrics and the API show ---------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "breaker_open": self.breaker.open,
            "breaker_since": self.breaker.since,
            "breaker_reason": self.breaker.reason,
            "breaker_reset_at": self.breaker.reset_at,
            "drained_by_clusterpulse": {n: d.reason for n, d in sorted(self.memory.items())},
            "sync_errors": dict(sorted(self.errors.items())),
            "last_sync_at": self.last_sync_at,
            "last_error": self.last_error,
        }


def metric_lines(sync: SlurmSync | None) -> list[str]:
    """``pulse_slurm_*``: families always (typed), samples while Slurm sync is on."""
    out = [
        "# HELP pulse_slurm_drained_nodes Slurm nodes drained by ClusterPulse (drains it made and still owns).",
        "# TYPE pulse_slurm_drained_nodes gauge",
    ]
    if sync is not None:
        out.append(f"pulse_slurm_drained_nodes {len(sync.memory)}")
    out += [
        "# HELP pulse_slurm_sync_errors_total Slurm commands that failed or timed out, by operation.",
        "# TYPE pulse_slurm_sync_errors_total counter",
    ]
    if sync is not None:
        out += [f'pulse_slurm_sync_errors_total{{op="{op}"}} {n}' for op, n in sorted(sync.errors.items())]
    out += [
        "# HELP pulse_slurm_drain_breaker_open 1 while the Slurm drain breaker is open (no drains until reset).",
        "# TYPE pulse_slurm_drain_breaker_open gauge",
    ]
    if sync is not None:
        out.append(f"pulse_slurm_drain_breaker_open {1 if sync.breaker.open else 0}")
    return out


def _ours(name: str, v: NodeView) -> Ours:
    """A node as the sync compares it with Slurm's view: its state, and its own beside its GPUs'."""
    h = v.health
    own = None if h.own is None else h.own.value
    return Ours(
        name=name, state=h.state.value, reason=h.reason, schedulable=v.schedulable, own=own, bad_gpus=len(h.gpus)
    )

"""Node sync with Slurm as a pure decision: which Slurm nodes ClusterPulse drains or resumes now.

``decide(ours, theirs, memory, policy, now=...) -> Decision`` compares our view of each node with
Slurm's and with the drains ClusterPulse made and still owns (``memory``), and returns the
actions that converge them, each with a reason; level-triggered, no clock, no command.

- **Drain** a node DEGRADED or LOST to us, or cordoned, unless Slurm shows it drained or down;
  the reason starts with :data:`TAG`. A node worse only through faults of its own GPUs goes by
  its own state until ``drain_min_bad_gpus`` of them are bad: one bad GPU costs one rank, and
  Slurm keeps handing out the others (:func:`for_slurm`).
- **Resume** only a drain of ours that nobody changed, once the node is HEALTHY and not
  cordoned; a drain someone changed is disowned, never touched again.
- **Partition brake**: nothing changes while the orchestrator may be cut off from the nodes.
- **Drain breaker**: past ``allowance(total)`` drains for health in ``drain_window_s`` it opens
  (a ``trip``) and holds further drains for health until an operator resets it.

The rules in full: docs/design/slurm-sync.md.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

TAG = "clusterpulse:"
BAD_STATES = frozenset({"DEGRADED", "LOST"})
MAX_REASON = 200  # Slurm keeps long reasons, but sinfo and people read them: keep them short
# Slurm node states and flags (lower case, as ``sinfo -O StateComplete`` prints them) under which
# Slurm itself will not start new work on the node.
UNAVAILABLE = frozenset(
    {"down", "drain", "drained", "draining", "fail", "failing", "maint", "not_responding", "power_down",
     "powered_down", "powering_down", "reboot_requested", "reboot_issued", "inval", "future"}
)  # fmt: skip


@dataclass(frozen=True)
class Ours:
    """A node as ClusterPulse sees it."""

    name: str
    state: str  # HEALTHY | SUSPECT | DEGRADED | LOST
    reason: str  # the reason of its last transition
    schedulable: bool = True  # False: cordoned by an operator
    own: str | None = None  # its state leaving its GPUs' own faults aside (None: the same as state)
    bad_gpus: int = 0  # GPUs DEGRADED or LOST by faults of their own


@dataclass(frozen=True)
class SlurmNode:
    """A node as Slurm sees it (``services/slurm/nodes/loop.py`` reads it with ``sinfo``)."""

    name: str
    state: str  # the base state, lower case: idle, allocated, mixed, down, unknown, ...
    flags: frozenset[str] = frozenset()  # drain, not_responding, maint, ...
    reason: str = ""  # "" when Slurm has none
    reason_user: str = ""  # who set the reason
    reason_time: str = ""  # when, as Slurm prints it (controller's local time)

    @property
    def drained(self) -> bool:
        """Drained or draining: the DRAIN flag is set (by whoever)."""
        return "drain" in self.flags or self.state in ("drain", "drained", "draining")

    @property
    def down(self) -> bool:
        return self.state in ("down", "fail") or "fail" in self.flags

    @property
    def available(self) -> bool:
        """Slurm would start new work on it."""
        return self.state not in UNAVAILABLE and not (self.flags & UNAVAILABLE)

    @property
    def state_text(self) -> str:
        return "+".join([self.state, *sorted(self.flags)])


@dataclass(frozen=True)
class Drain:
    """A drain ClusterPulse made and still owns: the exact reason it set, and when."""

    reason: str
    at: float


@dataclass(frozen=True)
class Breaker:
    """The drain circuit breaker. ``open`` until an operator resets it (``reset_at``)."""

    open: bool = False
    since: float | None = None
    reason: str = ""
    reset_at: float | None = None  # the last operator reset: drains before it no longer count


@dataclass(frozen=True)
class SyncPolicy:
    max_drain_fraction: float = 0.1
    drain_window_s: float = 3600.0
    drain_min_bad_gpus: int = 2  # PULSE_SLURM_DRAIN_MIN_BAD_GPUS

    def allowance(self, total: int) -> int:
        """How many drains the window allows among ``total`` nodes (at least one)."""
        return max(1, math.floor(self.max_drain_fraction * total + 1e-9))


@dataclass(frozen=True)
class Action:
    """``drain`` (set ``slurm_reason``), ``resume``, ``disown`` (forget a drain someone else
    changed) or ``trip`` (open the breaker; ``node`` is the drain it held)."""

    kind: Literal["drain", "resume", "disown", "trip"]
    node: str
    why: str
    slurm_reason: str = ""
    counted: bool = True  # a drain for health (counts against the breaker); False: for a cordon


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...] = ()
    breaker: Breaker = field(default_factory=Breaker)
    held: tuple[str, ...] = ()  # "node: why" of each drain wanted and not made (brake, breaker)


def slurm_reason(ours: Ours) -> str:
    """The reason a drain of ``ours`` gets in Slurm: :data:`TAG`, then ours, on one line."""
    if ours.state in BAD_STATES:
        text = f"{ours.state}: {ours.reason}" if ours.reason else ours.state
    else:
        text = "cordoned in ClusterPulse"
    text = " ".join(f"{TAG} {text}".split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def for_slurm(ours: Ours, policy: SyncPolicy) -> tuple[Ours, str]:
    """The node as Slurm should see it, and why it is not drained where its GPUs alone make it
    worse: under ``drain_min_bad_gpus`` bad GPUs of its own, it goes by its own state."""
    if ours.own is None or ours.state not in BAD_STATES or ours.own in BAD_STATES:
        return ours, ""
    if ours.bad_gpus >= policy.drain_min_bad_gpus:
        return ours, ""
    why = (
        f"{ours.name}: not drained for {ours.bad_gpus} bad GPU(s) of its own, under "
        f"PULSE_SLURM_DRAIN_MIN_BAD_GPUS={policy.drain_min_bad_gpus} ({ours.reason})"
    )
    return replace(ours, state=ours.own), why


def wants_drain(ours: Ours) -> bool:
    return ours.state in BAD_STATES or not ours.schedulable


def drains_counted(recent: Sequence[float], *, policy: SyncPolicy, breaker: Breaker, now: float) -> int:
    """How many of our drains (made at ``recent``) count against the breaker now: those within
    the window, and after the last reset of the breaker."""
    since = now - policy.drain_window_s
    if breaker.reset_at is not None:
        since = max(since, breaker.reset_at)
    return sum(1 for t in recent if t > since)


def decide(
    ours: Mapping[str, Ours],
    theirs: Mapping[str, SlurmNode],
    memory: Mapping[str, Drain],
    policy: SyncPolicy,
    *,
    now: float,
    recent: Sequence[float] = (),
    breaker: Breaker = Breaker(),
    partitioned: bool = False,
    backing_off: Collection[str] = (),
) -> Decision:
    """The actions that bring Slurm in line with our view (the contract: docs/design/slurm-sync.md).
    ``recent``: when ClusterPulse's drains were made (for the window; may hold older ones).
    ``backing_off``: nodes whose last drain or resume failed lately; nothing is tried on them
    now, and they do not count against the breaker."""
    names = sorted(ours.keys() & theirs.keys())
    allowance = policy.allowance(len(names))
    used = drains_counted(recent, policy=policy, breaker=breaker, now=now)
    actions: list[Action] = []
    held: list[str] = []
    for name in names:
        (o, spared), t, mine = for_slurm(ours[name], policy), theirs[name], memory.get(name)
        if spared and mine is None and not t.drained:
            held.append(spared)
        want = wants_drain(o)
        if mine is not None:
            if not t.drained:
                actions.append(Action("disown", name, f"Slurm no longer shows our drain of {name} (state "
                                      f"{t.state_text}): someone resumed it; forgotten"))  # fmt: skip
                mine = None
            elif t.reason != mine.reason:
                who = f" by {t.reason_user}" if t.reason_user else ""
                actions.append(Action("disown", name, f"the Slurm reason of {name} was changed{who} to "
                                      f"{t.reason!r} (ours: {mine.reason!r}): no longer ours, left as it is"))  # fmt: skip
                continue
            elif want:
                continue  # ours and still wanted
            elif o.state != "HEALTHY":
                continue  # better, not yet well: stays drained until HEALTHY
            elif t.down:
                held.append(f"{name}: Slurm shows it {t.state_text}; a down node is never resumed")
                continue
            elif partitioned:
                held.append(f"{name}: resume held, the orchestrator suspects a partition")
                continue
            elif name in backing_off:
                held.append(f"{name}: resume held, backing off after a failed command")
                continue
            else:
                actions.append(Action("resume", name, f"{name} is HEALTHY and schedulable again ({o.reason}); "
                                      f"resuming the drain ClusterPulse made ({mine.reason!r})"))  # fmt: skip
                continue
        if not want or t.drained or t.down:
            continue  # nothing to do, or Slurm (someone else) keeps it out already
        reason = slurm_reason(o)
        if partitioned:
            held.append(f"{name}: drain held, the orchestrator suspects a partition")
        elif name in backing_off:
            held.append(f"{name}: drain held, backing off after a failed command")
        elif o.state not in BAD_STATES:  # cordoned by an operator: not the breaker's business
            actions.append(Action("drain", name, f"{name} is cordoned: draining it in Slurm", reason, counted=False))
        elif breaker.open:
            held.append(f"{name}: drain held, the drain breaker is open since {breaker.since}: {breaker.reason}")
        elif used + 1 > allowance:
            why = (
                f"{name} would be drain {used + 1} within {policy.drain_window_s:g}s, at most {allowance} allowed "
                f"({policy.max_drain_fraction:g} of {len(names)} nodes): drain breaker open, no drain until an "
                f"operator resets it"
            )
            breaker = Breaker(open=True, since=now, reason=why, reset_at=breaker.reset_at)
            actions.append(Action("trip", name, why))
            held.append(f"{name}: drain held, the drain breaker just opened")
        else:
            used += 1
            actions.append(Action("drain", name, f"{name} is {o.state}: draining it in Slurm", slurm_reason=reason))
    for name in sorted(memory.keys() - theirs.keys()):  # e.g. taken out of every partition
        actions.append(Action("disown", name, f"{name} is no longer in Slurm's node list: our drain is forgotten"))
    return Decision(actions=tuple(actions), breaker=breaker, held=tuple(held))

"""The fabric check (preflight) as pure functions: which node pairs probe, in which round, and
which nodes the figures name slow. The loop (``services/fabric/loop.py``) launches the probes,
stores what they measured and calls these; nothing here reads a clock or touches I/O.

A check runs at most two rounds of pair probes (``trainer/fabric_probe.py``: an all-reduce
between one rank on each node of the pair, its bus bandwidth in GB/s):

1. **Round 1** pairs the nodes in order, (0, 1), (2, 3), ...; an odd node out waits for round 2.
   Pairs of a round that share no node run at the same time.
2. A pair is **slow** when its bus bandwidth is below ``slow_fraction`` of the median of round 1's
   measured pairs, or below ``min_busbw_gbps`` (0: no floor), or when its probe failed. **Round
   2** pairs every node of a slow pair (and the odd one out) with a node of a fast pair: the
   slowest pair's nodes with the fastest pair's, and so on. Two probes that share a node run one
   after the other.
3. A node is **named slow** when every pair it was in is slow: the partner of a slow node shows
   fast in round 2 and is cleared. A pair of two nodes, or a check whose every pair is slow,
   has no fast node to tell its nodes apart by: both are named.
4. A pair whose probe a node's agent never took (no word from it within the probe timeout: an
   agent that stopped reading its commands) is **unmeasured**: neither slow nor fast, it names
   nobody and clears nobody; the node that did answer is paired again in round 2. A node no pair
   measured is listed as such (:func:`unmeasured`), never held SUSPECT for it: the fabric check
   judges the fabric, and a node without a working launcher is not a slow link. Nodes whose
   heartbeats say they launch nothing are not probed at all (:func:`check_nodes`).

The figure a node is named with is the best bus bandwidth it reached: what the slowest part of
its path (its NIC, cable, switch port) let through.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from clusterpulse import wire

PairState = Literal["pending", "running", "done", "failed", "unmeasured"]


@dataclass(frozen=True)
class FabricPolicy:
    slow_fraction: float = 0.7  # PULSE_FABRIC_SLOW_FRACTION
    min_busbw_gbps: float = 0.0  # PULSE_FABRIC_MIN_BUSBW_GBPS; 0: no floor


@dataclass(frozen=True)
class Pair:
    """One probe: two nodes, one round, and what it measured (``busbw_gbps``) or why not (``detail``)."""

    round: int
    nodes: tuple[str, str]
    state: PairState = "pending"
    busbw_gbps: float | None = None
    detail: str = ""
    probe: str = ""  # the probe's job id, once launched
    started_at: float | None = None
    addr: str = ""  # where its two ranks meet, once launched
    port: int = 0
    answered: tuple[int, ...] = ()  # the node ranks (0, 1) whose agents reported the probe

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "unmeasured")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "nodes": list(self.nodes), "answered": list(self.answered)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Pair:
        a, b = d["nodes"]
        return cls(
            round=int(d["round"]), nodes=(str(a), str(b)), state=d["state"], busbw_gbps=d.get("busbw_gbps"),
            detail=str(d.get("detail", "")), probe=str(d.get("probe", "")), started_at=d.get("started_at"),
            addr=str(d.get("addr", "")), port=int(d.get("port", 0)),
            answered=tuple(int(r) for r in d.get("answered") or ()),
        )  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    slow: dict[str, str]  # node -> why, with its figure
    median_gbps: float | None  # round 1's median, what "slow" is measured against
    reason: str  # one line for the check
    unmeasured: dict[str, str] = field(default_factory=dict)  # node -> why no pair measured it


def first_round(nodes: Sequence[str]) -> list[Pair]:
    """Round 1: the nodes in pairs, in order; an odd one out is left for round 2."""
    if len(set(nodes)) != len(nodes):
        raise ValueError(f"a node is named twice: {', '.join(sorted({n for n in nodes if nodes.count(n) > 1}))}")
    if len(nodes) < 2:
        raise ValueError(f"a fabric check needs at least 2 nodes, got {len(nodes)}")
    return [Pair(1, (nodes[i], nodes[i + 1])) for i in range(0, len(nodes) - 1, 2)]


def median_gbps(pairs: Iterable[Pair]) -> float | None:
    """The median bus bandwidth of round 1's measured pairs (None before any)."""
    figures = [p.busbw_gbps for p in pairs if p.round == 1 and p.state == "done" and p.busbw_gbps is not None]
    return statistics.median(figures) if figures else None


def is_slow(pair: Pair, median: float | None, policy: FabricPolicy) -> bool:
    """A finished pair below the fraction of the median or under the floor; a failed probe is slow."""
    if pair.state == "failed" or pair.busbw_gbps is None:
        return pair.state == "failed"
    if policy.min_busbw_gbps > 0 and pair.busbw_gbps < policy.min_busbw_gbps:
        return True
    return median is not None and pair.busbw_gbps < policy.slow_fraction * median


def second_round(nodes: Sequence[str], pairs: Sequence[Pair], policy: FabricPolicy) -> list[Pair]:
    """Round 2 (round 1 finished): each node of a slow pair, slowest pair first, the node that
    answered in an unmeasured pair, and the odd node out, paired with a node of a fast pair,
    fastest first. Nothing when no pair is slow and no node is left over, or when no pair is fast
    (nothing to compare against: :func:`verdict` names both)."""
    first = [p for p in pairs if p.round == 1]
    median = median_gbps(first)
    slow = sorted((p for p in first if is_slow(p, median, policy)), key=lambda p: p.busbw_gbps or 0.0)
    fast = sorted(
        (p for p in first if p.state == "done" and not is_slow(p, median, policy)), key=lambda p: -(p.busbw_gbps or 0.0)
    )
    seen = {n for p in first for n in p.nodes}
    answered = [p.nodes[r] for p in first if p.state == "unmeasured" for r in p.answered]
    suspects = [n for p in slow for n in p.nodes] + answered + [n for n in nodes if n not in seen]
    partners = [n for p in fast for n in p.nodes]
    if not partners:
        return []
    return [Pair(2, (node, partners[i % len(partners)])) for i, node in enumerate(suspects)]


def runnable(pairs: Sequence[Pair]) -> list[int]:
    """The indices of pending pairs of the current round that can start now: none of their nodes
    is in a running pair, nor in an earlier pending pair picked here (a node probes one pair at a time)."""
    rounds = [p.round for p in pairs if not p.finished]
    if not rounds:
        return []
    current = min(rounds)
    busy = {n for p in pairs if p.state == "running" for n in p.nodes}
    out = []
    for i, p in enumerate(pairs):
        if p.round == current and p.state == "pending" and not busy & set(p.nodes):
            out.append(i)
            busy.update(p.nodes)
    return out


def timed_out(pairs: Sequence[Pair], *, now: float, timeout_s: float) -> list[Pair]:
    """Running pairs past ``timeout_s`` (the caller stops their probes): failed when both agents
    took the probe and no result came, unmeasured when a node's agent never said a word of it."""
    return [
        _timed_out(p, timeout_s)
        if p.state == "running" and p.started_at is not None and now - p.started_at > timeout_s
        else p
        for p in pairs
    ]


def _timed_out(p: Pair, timeout_s: float) -> Pair:
    silent = [n for r, n in enumerate(p.nodes) if r not in p.answered]
    if silent:
        why = f"no word of the probe from the agent of {' and '.join(silent)} within {timeout_s:g}s (PULSE_FABRIC_PROBE_TIMEOUT_S): not measured"
        return replace(p, state="unmeasured", detail=why)
    return replace(p, state="failed", detail=f"no result within {timeout_s:g}s (PULSE_FABRIC_PROBE_TIMEOUT_S)")


def probe_result(status: dict[str, Any], *, first: bool = True) -> tuple[PairState, float | None, str]:
    """What the agent's status of one node of a probe says: ("failed", None, why) when its rank
    did not exit 0; for the ``first`` node (rank 0) that did, ("done", GB/s, "") from the result
    line it printed; ("running", None, "") while it runs, and for the other node's clean exit."""
    state = str(status.get("state", ""))
    if state in ("started", "hung", ""):
        return "running", None, ""
    tail = str(status.get("log_tail") or "")
    if state != "exited" or status.get("exit_code") != 0:
        last = tail.strip().splitlines()[-1:] or [str(status.get("detail", ""))]
        return "failed", None, f"probe {state} (exit {status.get('exit_code')}): {last[0][:300]}"
    if not first:
        return "running", None, ""
    for line in reversed(tail.splitlines()):
        if line.startswith(wire.FABRIC_RESULT_PREFIX):
            try:
                figures = json.loads(line[len(wire.FABRIC_RESULT_PREFIX) :])
                return "done", float(figures["busbw_gbps"]), ""
            except (ValueError, KeyError, TypeError) as exc:
                return "failed", None, f"probe result unreadable: {exc}"
    return "failed", None, "the probe exited 0 without its result line"


def round_finished(pairs: Sequence[Pair], round_: int) -> bool:
    return all(p.finished for p in pairs if p.round == round_)


def verdict(nodes: Sequence[str], pairs: Sequence[Pair], policy: FabricPolicy) -> Verdict:
    """The nodes every one of whose pairs was slow, each with its best figure."""
    median = median_gbps(pairs)
    mine = _by_node(p for p in pairs if p.state in ("done", "failed"))
    slow: dict[str, str] = {}
    for node in nodes:
        probes = mine.get(node, [])
        if not probes or not all(is_slow(p, median, policy) for p in probes):
            continue
        best = max(probes, key=lambda p: p.busbw_gbps or 0.0)
        peer = best.nodes[1] if best.nodes[0] == node else best.nodes[0]
        if best.busbw_gbps is None:
            slow[node] = f"every fabric probe failed; with {peer}: {best.detail}"
            continue
        against = (
            f", {best.busbw_gbps / median:.2g}x the median {median:.3g} GB/s "
            f"(PULSE_FABRIC_SLOW_FRACTION={policy.slow_fraction:g})"
            if median
            else ""
        )
        floor = f", floor {policy.min_busbw_gbps:g} GB/s" if policy.min_busbw_gbps > 0 else ""
        slow[node] = (
            f"all-reduce bus bandwidth at most {best.busbw_gbps:.3g} GB/s in {len(probes)} "
            f"pair{'s' if len(probes) > 1 else ''} (best with {peer}){against}{floor}"
        )
    count = sum(1 for p in pairs if p.state == "done")
    median_text = f"median {median:.3g} GB/s" if median is not None else "no pair measured"
    named = f"slow: {', '.join(sorted(slow))}" if slow else "no slow node"
    missing = unmeasured(nodes, pairs)
    left = f"; not measured: {', '.join(sorted(missing))}" if missing else ""
    reason = f"{len(nodes)} nodes, {count} of {len(pairs)} pairs measured, {median_text}; {named}{left}"
    return Verdict(slow=slow, median_gbps=median, reason=reason, unmeasured=missing)


def unmeasured(nodes: Sequence[str], pairs: Sequence[Pair]) -> dict[str, str]:
    """node -> why, for each node of a finished check that no pair measured or failed: every pair
    it was in was unmeasured (its own agent or its partner's never took the probe)."""
    mine = _by_node(pairs)
    return {
        node: mine[node][-1].detail
        for node in nodes
        if node in mine and all(p.state == "unmeasured" for p in mine[node])
    }


def _by_node(pairs: Iterable[Pair]) -> dict[str, list[Pair]]:
    """node -> the pairs it was in, in order: one pass, however many nodes are asked about."""
    out: dict[str, list[Pair]] = {}
    for p in pairs:
        for n in p.nodes:
            out.setdefault(n, []).append(p)
    return out


def replace_slow(assigned: Sequence[str], spares: Sequence[str], slow: Iterable[str]) -> list[str] | None:
    """A preflighted job's nodes with the slow ones swapped for spares that passed, in order;
    None when too few spares passed."""
    bad = set(slow)
    keep = [n for n in assigned if n not in bad]
    extra = [n for n in spares if n not in bad and n not in keep]
    need = len(assigned) - len(keep)
    return keep + extra[:need] if len(extra) >= need else None


def measured(pairs: Iterable[Pair]) -> set[str]:
    """The nodes some pair measured or failed (a verdict speaks for them, slow or not)."""
    return {n for p in pairs if p.state in ("done", "failed") for n in p.nodes}


def suspect_reason(check: str, why: str) -> str:
    """The warning a node named slow carries while it is SUSPECT (services/cluster.py)."""
    return f"fabric check {check}: {why}"


def standing(
    checks: Iterable[tuple[str, float, set[str], Mapping[str, str]]], *, hold_s: float, now: float
) -> dict[str, tuple[str, float]]:
    """node -> (warning, until) of the checks (id, finished at, measured nodes, slow), oldest first:
    each node as the newest check that measured it left it, while ``hold_s`` has not passed."""
    held: dict[str, tuple[str, float]] = {}
    for check, at, nodes, slow in checks:
        for node in nodes:
            if node in slow and at + hold_s > now:
                held[node] = (suspect_reason(check, slow[node]), at + hold_s)
            else:
                held.pop(node, None)
    return held


class CheckRefused(ValueError):
    """A check that cannot start as asked; the message names the nodes and why."""


class BadNodes(CheckRefused):
    """Nodes named wrong: one the orchestrator has never heard from, or one named twice."""


def check_nodes(
    requested: Sequence[str] | None,
    states: Mapping[str, str],
    busy: Mapping[str, str],
    launch_nothing: Collection[str] = (),
) -> list[str]:
    """The nodes a check probes: ``requested`` as given, or every HEALTHY or SUSPECT node that no
    active job holds (``busy``: node -> job) and that launches, in name order. A probe beside a
    job's ranks would measure the job's traffic and slow the job, so a busy node is refused, as is
    a LOST one (no agent to launch on), one whose heartbeats say it launches nothing
    (``launch_nothing``: ``pulse simulate``'s nodes, ``pulse agent --no-jobs``) and an unknown one.
    ``states``: node -> state, of every known node."""
    if requested is None:
        nodes = sorted(
            n for n, st in states.items() if st in ("HEALTHY", "SUSPECT") and n not in busy and n not in launch_nothing
        )
        if len(nodes) < 2:
            raise CheckRefused(
                f"{len(nodes)} HEALTHY or SUSPECT nodes without an active job whose agent launches probes: a check needs 2"
            )
        return nodes
    unknown = [n for n in requested if n not in states]
    if unknown:
        raise BadNodes(f"unknown node(s): {', '.join(unknown)}")
    lost = [n for n in requested if states[n] == "LOST"]
    if lost:
        raise CheckRefused(f"LOST node(s) {', '.join(lost)}: no agent to run a probe")
    idle = [n for n in requested if n in launch_nothing]
    if idle:
        raise CheckRefused(
            f"node(s) {', '.join(idle)} launch nothing (their heartbeats say launches=false: simulated by "
            "`pulse simulate`, or `pulse agent --no-jobs`): no probe can run there"
        )
    taken = [f"{n} (job {busy[n]})" for n in requested if n in busy]
    if taken:
        raise CheckRefused(f"node(s) running a job: {', '.join(taken)}; a probe would compete with its traffic")
    try:
        first_round(requested)  # two at least, none twice
    except ValueError as exc:
        raise BadNodes(str(exc)) from None
    return list(requested)

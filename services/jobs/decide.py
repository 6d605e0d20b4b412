"""A job's life as a pure function of what its nodes' agents reported.

``PENDING`` (placed) -> ``STARTING`` (launch sent) -> ``RUNNING`` (every rank *joined*: it
registered or reported a step, i.e. it is past its rendezvous) -> ``SUCCEEDED`` (every counted
node exited 0) or ``FAILED`` (a preflight failed, ranks exited non-zero or were lost, or the job
was not RUNNING ``start_timeout`` after the launch); ``STOPPING`` -> ``STOPPED``. A node all of
whose ranks reported their exit counts as exited, whatever its agent last said.

Once RUNNING, nodes whose ranks the plan excluded no longer count; a job with every node
excluded FAILS. An excluded node that is HEALTHY again with its ranks gone is launched anew with
``PULSE_REJOIN=1`` (:func:`relaunch`), at most ``max_rejoins`` times, and not for ZeRO stage 3
(:func:`rejoinable`).

:func:`decide` takes the state, the latest status per node, the ranks that joined and the time,
and returns the new state and the commands to send; the loop persists and sends. Running it twice
changes nothing. Why RUNNING means rendezvoused, and the rejoin rule: docs/design/jobs.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from clusterpulse import wire
from clusterpulse.states import ACTIVE_JOB_STATES, TERMINAL_JOB_STATES, JobState

JOB_STATES = (*ACTIVE_JOB_STATES, *TERMINAL_JOB_STATES)


@dataclass(frozen=True)
class JobDecision:
    state: str
    reason: str
    send: str | None = None  # "launch" or "stop": to every assigned node
    relaunch: tuple[str, ...] = ()  # nodes whose share is launched anew to rejoin the running job


def _last_line(status: Mapping[str, object]) -> str:
    tail = str(status.get("log_tail") or "").strip().splitlines()
    return f"; last log line: {tail[-1][:200]}" if tail else ""


def _names(items: Sequence[object], most: int = 8) -> str:
    shown = ", ".join(str(i) for i in items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def rejoinable(deepspeed_config: Mapping[str, Any] | None) -> bool:
    """Whether a relaunched rank of a job with this DeepSpeed config can be taken back: not at ZeRO
    stage 3, whose ranks follow no plan. A job without a config in its spec (the script's own) is
    tried; the rank refuses at start if it cannot."""
    zero = (deepspeed_config or {}).get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    return stage is None or str(stage) in ("0", "1", "2")


def decide(
    *,
    state: str,
    nodes: Sequence[str],
    status: Mapping[str, Mapping[str, object]],
    since: float,
    now: float,
    start_timeout: float,
    joined: Collection[int],
    gpus_per_node: int,
    rendezvous: str,
    excluded: Collection[str] = (),
    healthy: Collection[str] = (),
    rejoins: Mapping[str, int] | None = None,
    max_rejoins: int = 0,
    rejoin: bool = True,
    exits: Mapping[int, int] | None = None,
    held: str = "",
) -> JobDecision:
    """What to do with a job in ``state`` since ``since``, given ``status[node]`` (the latest
    JobStatus of each node as a dict) and ``joined``, the ranks that registered or reported a step
    (ranks outside the job's world are ignored). ``rendezvous`` (``addr:port``) is only named in
    reasons. A command in ``send`` with an unchanged state is a resend: the caller sends it at
    most every few seconds, so a command lost in a crash is sent again. ``held``: why a PENDING
    job may not launch yet (its fabric preflight runs, services/fabric/loop.py)."""
    if state in TERMINAL_JOB_STATES:
        return JobDecision(state, "")
    status = _with_rank_exits(nodes, status, exits or {}, per_node=max(1, gpus_per_node))
    states = {n: str(status[n]["state"]) for n in nodes if n in status}
    if state == JobState.PENDING and held:
        return JobDecision(JobState.PENDING, held)
    if state == JobState.PENDING:
        return JobDecision(JobState.STARTING, f"launch sent to {', '.join(nodes)}", send="launch")
    if state == JobState.STOPPING:
        running = [n for n in nodes if states.get(n) == "started"]
        if not running:
            return JobDecision(JobState.STOPPED, "every node's ranks are gone")
        return JobDecision(JobState.STOPPING, "", send="stop")  # re-sent (rate-limited by the caller) until gone
    relaunch: tuple[str, ...] = ()
    if state == JobState.RUNNING and excluded:
        relaunch = tuple(
            n
            for n in nodes
            if n in excluded
            and n in healthy
            and states.get(n) in ("exited", "lost")
            and status[n].get("exit_code") != wire.REJOIN_REFUSED_EXIT  # the last relaunch was refused
            and (rejoins or {}).get(n, 0) < max_rejoins
            and rejoin
        )
        nodes = [n for n in nodes if n not in excluded]
        if not nodes:
            return JobDecision(JobState.FAILED, "every node's ranks were excluded: no live rank is left", send="stop")
    for n in nodes:
        st = status.get(n, {})
        if states.get(n) == "preflight_failed":
            return JobDecision(JobState.FAILED, f"preflight failed on {n}: {st.get('detail', '')}", send="stop")
        if states.get(n) == "lost":
            return JobDecision(JobState.FAILED, f"the ranks on {n} were lost: {st.get('detail', '')}", send="stop")
        if states.get(n) == "exited" and st.get("exit_code") != 0:
            return JobDecision(
                JobState.FAILED, f"ranks on {n} exited with {st.get('exit_code')}{_last_line(st)}", send="stop"
            )
    if nodes and all(states.get(n) == "exited" for n in nodes):
        # the stop ends what outlives the ranks: the job's store (agent/job_store.py), an excluded rank still hung
        return JobDecision(JobState.SUCCEEDED, f"every node's ranks exited 0 ({len(nodes)} nodes)", send="stop")
    if state == JobState.STARTING:
        return _starting(
            state=state, nodes=nodes, states=states, since=since, now=now, start_timeout=start_timeout,
            joined=joined, per_node=max(1, gpus_per_node), rendezvous=rendezvous,
        )  # fmt: skip
    return JobDecision(state, "", relaunch=relaunch)


def node_ranks(nodes: Sequence[str], node: str, *, per_node: int) -> range:
    """The global ranks ``node`` runs: its place among the job's ``nodes`` times ``per_node``."""
    i = list(nodes).index(node)
    return range(i * per_node, (i + 1) * per_node)


def _with_rank_exits(
    nodes: Sequence[str], status: Mapping[str, Mapping[str, object]], exits: Mapping[int, int], *, per_node: int
) -> Mapping[str, Mapping[str, object]]:
    """``status`` with each node whose ranks all reported their exit (``exits``: rank -> code) as
    exited with the first non-zero code (else 0), whatever its agent said last: a node whose
    agent died would otherwise stay started until it is LOST."""
    out = dict(status)
    for n in nodes:
        codes = [exits.get(r) for r in node_ranks(nodes, n, per_node=per_node)]
        if out.get(n, {}).get("state") == "exited" or any(c is None for c in codes):
            continue
        code = next((c for c in codes if c), 0)
        out[n] = {"state": "exited", "exit_code": code, "detail": "its ranks reported their exit"}
    return out


def _starting(
    *,
    state: str,
    nodes: Sequence[str],
    states: Mapping[str, str],
    since: float,
    now: float,
    start_timeout: float,
    joined: Collection[int],
    per_node: int,
    rendezvous: str,
) -> JobDecision:
    """A STARTING job: RUNNING once every rank of its world joined, FAILED at the start timeout
    naming who is missing, else the launch resent until every node answered."""
    world = len(nodes) * per_node
    seen = {r for r in joined if 0 <= r < world}
    answered = all(states.get(n) in ("started", "exited") for n in nodes)
    if answered and len(seen) == world:
        return JobDecision(
            JobState.RUNNING, f"every rank rendezvoused at {rendezvous}: {world} ranks on {_names(nodes)}"
        )
    if now - since > start_timeout:
        missing = [n for n in nodes if n not in states]
        if missing:
            return JobDecision(
                JobState.FAILED, f"no start from {_names(missing)} within {start_timeout:g}s", send="stop"
            )
        waiting = [n for i, n in enumerate(nodes) if any(i * per_node + j not in seen for j in range(per_node))]
        return JobDecision(
            JobState.FAILED,
            f"ranks did not rendezvous within {start_timeout:g} s at {rendezvous}: {len(seen)} of {world} "
            f"ranks registered or reported a step; waiting on {_names(waiting)}",
            send="stop",
        )
    if answered:
        return JobDecision(state, "")  # launched everywhere: the ranks are rendezvousing
    return JobDecision(state, "", send="launch")  # re-sent (rate-limited) until every node answers


def master_addr(first_node: str, label: str | None, published: str) -> str:
    """The rendezvous address of a job whose first node is ``first_node``: the node's address
    label when it has one (an operator's word wins), else the address its agent published
    (``agent/address.py``), else, from an agent that publishes none, the node's name."""
    return label or published or first_node


def master_port(job_id: str, *, taken: Collection[int] = (), base: int = 29500, span: int = 500) -> int | None:
    """The job's rendezvous port (its store's, on its first node) in ``base ... base + span - 1``:
    the one the job's id hashes to, or the next one up (wrapping) that no active job at the same
    rendezvous address holds (``taken``); ``None`` when every one is held. Two jobs at one address
    on one port would share one store: the second store cannot bind, and the second job's ranks
    join the first job's store and die with it (``agent/launcher.py`` refuses such a store). The
    port is stored with the job, so it is stable across orchestrator restarts."""
    start = zlib.crc32(job_id.encode()) % span
    candidates = (base + (start + i) % span for i in range(span))
    return next((port for port in candidates if port not in taken), None)

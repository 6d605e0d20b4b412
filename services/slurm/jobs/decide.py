"""The Slurm job backend's decisions, pure: what to submit, and what a job's state is given Slurm's.

A job created with ``"backend": "slurm"`` is placed as any job, then handed to Slurm by the
leader's Slurm job loop (``services/slurm/jobs/loop.py``), which calls the functions here:

- :func:`sbatch_argv` and :func:`batch_script`: ``sbatch`` of the placed nodes (the job named
  ``pulse-<id>``, so a leader that crashed before storing Slurm's id finds it again), a batch
  script that starts the job's store on the first node and runs every rank with ``srun`` through
  its supervisor (``agent/slurm_rank.py``) and ``python -u -m trainer.run``, with the environment
  the agents give a rank;
- :func:`decide`: the job's state follows Slurm's (``scontrol show job``, else ``sacct``:
  :func:`parse_sacct`), with the ranks' own exits deciding where Slurm knows only the step's
  highest code (:func:`fold_rank_status`); a stop is ``term``, then ``kill`` of each rank step
  after ``grace_s`` (:func:`rank_steps`);
- :func:`relaunch`: the nodes whose excluded ranks may start anew to rejoin.

The table of Slurm's states against ours, and why a stop is signalled that way:
docs/design/slurm-jobs.md.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from clusterpulse.states import TERMINAL_JOB_STATES, JobState

JOB_NAME_PREFIX = "pulse-"
SLURM_PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "REVOKED"})
SLURM_RUNNING = frozenset({"CONFIGURING", "RUNNING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT"})
SLURM_ENDING = frozenset({"COMPLETING"})
# every other state is an end: COMPLETED, CANCELLED, FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...


def is_slurm(spec: Mapping[str, object]) -> bool:
    """A job created with ``"backend": "slurm"`` (a job stored before backends were named: agents)."""
    return spec.get("backend") == "slurm"


@dataclass(frozen=True)
class SlurmJob:
    """One job as ``scontrol show job --oneliner`` prints it."""

    id: str
    name: str
    state: str  # JobState, e.g. RUNNING
    reason: str = ""  # "" for None
    exit_code: str = ""  # "0:0": the batch script's exit status and the signal that ended it
    nodes: str = ""  # NodeList, e.g. sn-[000-001]

    @property
    def over(self) -> bool:
        return self.state not in SLURM_PENDING | SLURM_RUNNING | SLURM_ENDING


@dataclass(frozen=True)
class SlurmJobDecision:
    state: str
    reason: str  # "" when the state does not change and there is nothing new to say
    action: str | None = None  # "submit", "term", "kill" or "cancel" (scancel: Slurm's own TERM, KillWait, KILL)
    slurm_job_id: str | None = None  # Slurm's id to store (the job was found by its name)


_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=")


def parse_job_line(line: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` -> dict; a value may hold spaces (a ``Command`` path)."""
    marks = list(_FIELD.finditer(line))
    out: dict[str, str] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def parse_jobs(text: str) -> dict[str, SlurmJob]:
    """``scontrol show job --oneliner`` (all jobs the controller still holds) -> id -> job. "No
    jobs in the system" is none. Raises ValueError naming a line without a JobId."""
    out: dict[str, SlurmJob] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("No jobs"):
            continue
        f = parse_job_line(line)
        if not f.get("JobId"):
            raise ValueError(f"scontrol show job line without JobId: {line[:200]!r}")
        reason = f.get("Reason", "")
        out[f["JobId"]] = SlurmJob(
            id=f["JobId"],
            name=f.get("JobName", ""),
            state=f.get("JobState", "UNKNOWN"),
            reason="" if reason in ("None", "(null)") else reason,
            exit_code=f.get("ExitCode", ""),
            nodes="" if f.get("NodeList") in (None, "(null)") else f["NodeList"],
        )
    return out


SACCT_FORMAT = "JobID,JobName,State,ExitCode,NodeList,Reason"


def sacct_argv(sacct: Sequence[str], slurm_job_id: str) -> list[str]:
    """``sacct`` of one job, the fields :func:`parse_sacct` reads, one ``|``-separated line a record."""
    return [*sacct, "--jobs", slurm_job_id, "--noheader", "--parsable2", "--allocations", f"--format={SACCT_FORMAT}"]


def parse_sacct(text: str, slurm_job_id: str) -> SlurmJob | None:
    """The job's own record (not its steps') from :func:`sacct_argv`'s output, None when sacct
    holds no record of it. ``CANCELLED by 0`` is CANCELLED. Raises ValueError for a line that is
    not the format asked for."""
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != len(SACCT_FORMAT.split(",")):
            raise ValueError(f"sacct line with {len(fields)} fields, expected {SACCT_FORMAT}: {line[:200]!r}")
        jid, name, state, exit_code, nodes, reason = fields
        if jid == slurm_job_id:
            reason = "" if reason in ("None", "(null)") else reason
            return SlurmJob(jid, name, state.split(" ")[0] or "UNKNOWN", reason, exit_code, nodes)
    return None


def rank_steps(text: str) -> list[str]:
    """The job's steps that run ranks, from ``scontrol show step --oneliner <job>``: every step
    but the batch shell's and the extern one (``12.0``, ``12.1`` ...)."""
    steps = [parse_job_line(line).get("StepId", "") for line in text.splitlines() if line.startswith("StepId=")]
    return [s for s in steps if s and not s.endswith((".batch", ".extern"))]


def find(jobs: Mapping[str, SlurmJob], *, job_id: str, slurm_job_id: str | None) -> SlurmJob | None:
    """Our job in Slurm's list: by Slurm's id when stored, else by its name (the newest)."""
    if slurm_job_id:
        return jobs.get(slurm_job_id)
    named = [j for j in jobs.values() if j.name == JOB_NAME_PREFIX + job_id]
    return max(named, key=lambda j: int(j.id) if j.id.isdigit() else 0) if named else None


def excluded(slurm_nodes: Iterable[str], usable: Collection[str]) -> list[str]:
    """Every Slurm node that is not HEALTHY and schedulable here (``usable``), sorted."""
    return sorted(n for n in set(slurm_nodes) if n not in usable)


@dataclass(frozen=True)
class Submission:
    """What ``sbatch`` needs for one job."""

    job_id: str
    name: str
    nodes: Sequence[str]  # placed, in order
    gpus_per_node: int
    entrypoint: Sequence[str]
    master_port: int
    # node -> the address its peers reach it at, where ClusterPulse knows one (an address label, or
    # the one its agent published); elsewhere the ranks use the address Slurm launched them from
    # (SLURM_LAUNCH_NODE_IPADDR: the batch script's node, the allocation's first)
    addrs: Mapping[str, str]
    exclude: Sequence[str] = ()
    gres: str = "gpu"  # "" when the cluster has no GPU GRES
    partition: str = ""
    workdir: str = ""
    output: str = ""  # a folder for the batch output, "" for Slurm's default
    python: str = "python3"
    store_linger_s: float = 30.0
    store_ready_timeout_s: float = 60.0
    env: Mapping[str, str] = field(default_factory=dict)


def sbatch_argv(sbatch: Sequence[str], sub: Submission) -> list[str]:
    """The ``sbatch`` command line; the script (:func:`batch_script`) goes on its stdin, the
    environment (``--export=ALL``) is the one the caller runs it with."""
    per = max(1, sub.gpus_per_node)
    argv = [*sbatch, "--parsable", f"--job-name={JOB_NAME_PREFIX}{sub.job_id}", f"--nodes={len(sub.nodes)}"]
    argv += [f"--ntasks-per-node={per}", f"--nodelist={','.join(sub.nodes)}"]
    if sub.gres and sub.gpus_per_node > 0:
        argv.append(f"--gres={sub.gres}:{sub.gpus_per_node}")
    if sub.exclude:
        argv.append(f"--exclude={','.join(sub.exclude)}")
    if sub.partition:
        argv.append(f"--partition={sub.partition}")
    if sub.workdir:
        argv.append(f"--chdir={sub.workdir}")
    if sub.output:
        argv.append(f"--output={sub.output.rstrip('/')}/{JOB_NAME_PREFIX}{sub.job_id}-%j.out")
    argv += ["--export=ALL", f"--comment=clusterpulse job {sub.job_id} ({sub.name})"]
    return argv


def batch_script(sub: Submission) -> str:
    """The batch script (docs/design/slurm-jobs.md). Its exit status is srun's: the highest of the ranks'.
    Each srun task is a rank's supervisor (``agent/slurm_rank.py``), which sets the rank's
    environment from srun's, reports its exit and delivers checkpoint requests to it alone; beside
    the step, ``agent/slurm_rejoin.py`` starts the new steps of ranks relaunched to rejoin, and the
    script waits for them after the first step ends."""
    q = shlex.quote
    per = max(1, sub.gpus_per_node)
    cases = "".join(f"  {q(n)}) export MASTER_ADDR={q(a)} ;;\n" for n, a in sub.addrs.items() if a)
    store = [
        q(sub.python),
        "-m",
        "agent.job_store",
        '--port="$MASTER_PORT"',
        f"--job={q(sub.job_id)}",
        '--ready-file="$ready"',
    ]
    rank = [q(sub.python), "-m", "agent.slurm_rank", "--", q(sub.python), "-u", "-m", "trainer.run"]
    rank += [q(a) for a in sub.entrypoint]
    rejoin = [q(sub.python), "-m", "agent.slurm_rejoin", f"--per={per}", "--", *rank]
    return (
        "#!/bin/bash\n"
        f"# ClusterPulse job {sub.job_id} ({sub.name}), submitted by the orchestrator: services/slurm/jobs/decide.py\n"
        'case "$SLURMD_NODENAME" in\n'
        f"{cases}esac\n"
        f"export MASTER_PORT={sub.master_port} PULSE_JOB_ID={q(sub.job_id)}\n"
        f"export LOCAL_WORLD_SIZE={per} LOCAL_SIZE={per} WORLD_SIZE={per * len(sub.nodes)} CROSS_SIZE={len(sub.nodes)}\n"
        "store=\n"
        f"if {q(sub.python)} -c 'import importlib.util as u, sys; sys.exit(u.find_spec(\"torch\") is None)'; then\n"
        '  ready="${TMPDIR:-/tmp}/clusterpulse-store-$SLURM_JOB_ID.ready"; rm -f "$ready"\n'
        f"  {' '.join(store)} --linger={sub.store_linger_s:g} &\n"
        "  store=$!\n"
        # the ranks start once it listens: one that cannot (the port is held) would send them into
        # whatever holds the port (agent/job_store.py)
        f"  deadline=$((SECONDS + {math.ceil(sub.store_ready_timeout_s)}))\n"
        '  until [ -s "$ready" ]; do\n'
        '    if ! kill -0 "$store" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then\n'
        '      echo "clusterpulse: the job\'s store did not listen at port $MASTER_PORT" >&2\n'
        '      kill "$store" 2>/dev/null; exit 127\n'
        "    fi\n"
        "    sleep 0.05\n"
        "  done\n"
        '  rm -f "$ready"\n'
        "  export TORCHELASTIC_USE_AGENT_STORE=True PULSE_JOB_STORE=1\n"
        "fi\n"
        f"{' '.join(rejoin)} &\n"
        "rejoin=$!\n"
        f"srun --export=ALL --kill-on-bad-exit=0 --nodes={len(sub.nodes)} --ntasks-per-node={per} {' '.join(rank)}\n"
        "rc=$?\n"
        'kill -TERM "$rejoin" 2>/dev/null; wait "$rejoin"\n'
        'if [ -n "$store" ]; then kill "$store" 2>/dev/null; wait "$store" 2>/dev/null; fi\n'
        "exit $rc\n"
    )


def fold_rank_status(previous: Mapping[str, Any] | None, status: Mapping[str, Any]) -> dict[str, Any]:
    """One rank's ``JobStatus`` (``agent/slurm_rank.py``: ``started``, ``exited``) folded into its
    node's: ``ranks`` maps each rank (a string: it is stored as JSON) to its exit code, None while
    it runs; the node is ``exited`` once every rank it reported has, with the first non-zero code
    (else 0), and ``started`` while one runs."""
    ranks = dict((previous or {}).get("ranks") or {})
    ranks[str(status["rank"])] = status.get("exit_code") if status["state"] == "exited" else None
    done = all(c is not None for c in ranks.values())
    first = next((c for c in ranks.values() if c), 0) if done else None
    return {**status, "state": "exited" if done else "started", "exit_code": first, "ranks": ranks}


def relaunch(
    *,
    node_status: Mapping[str, Mapping[str, Any]],
    excluded: Collection[int],
    healthy: Collection[str],
    rejoins: Mapping[str, int],
    max_rejoins: int,
    per_node: int,
) -> list[tuple[str, int]]:
    """The nodes of a RUNNING Slurm job whose ranks to start again to rejoin, each with its place
    in the job (``node_rank``, Slurm's order), by the agents' rule (``services/jobs/decide.py``): every
    rank on it excluded (``excluded``) and exited, as its supervisor said (with any code), the node
    HEALTHY (``healthy``), and fewer than ``max_rejoins`` relaunches of it so far (``rejoins``)."""
    out = []
    for node, st in sorted(node_status.items()):
        ranks = {int(r): c for r, c in (st.get("ranks") or {}).items()}
        gone = len(ranks) >= per_node and all(c is not None for c in ranks.values())
        if gone and set(ranks) <= set(excluded) and node in healthy and rejoins.get(node, 0) < max_rejoins:
            out.append((node, int(st.get("node_rank") or 0)))
    return out


def rank_exits(node_status: Mapping[str, Mapping[str, Any]]) -> dict[int, int | None]:
    """rank -> its last exit code (None: it runs), from the nodes' folded statuses."""
    return {int(r): c for st in node_status.values() for r, c in (st.get("ranks") or {}).items()}


def decide(
    *,
    state: str,
    job_id: str,
    slurm: SlurmJob | None,
    slurm_job_id: str | None,
    since: float,
    created: float,
    now: float,
    joined: Collection[int],
    world: int,
    grace_s: float,
    start_timeout: float,
    submit_error: str = "",
    unusable: Sequence[str] = (),
    exits: Mapping[int, int | None] | None = None,
    excluded_ranks: Collection[int] = (),
    ended_for: float = 0.0,
    exit_wait_s: float = 0.0,
) -> SlurmJobDecision:
    """What a Slurm job's state should be and what to do (docs/design/slurm-jobs.md). ``slurm``: the job
    as Slurm lists it (found by :func:`find`), None when Slurm does not list it; ``slurm_job_id``:
    Slurm's id as stored; ``since``: when the job entered ``state``; ``submit_error``: the last
    ``sbatch`` failure, "" when none; ``unusable``: the job's placed nodes that are no longer
    HEALTHY and schedulable (a job not yet submitted then FAILS rather than being sent there);
    ``exits``: rank -> its exit code as its supervisor reported it (None: running;
    :func:`rank_exits`); ``excluded_ranks``: the ranks the job's plan excluded or its survivors
    reported unreachable; ``ended_for``: how long Slurm has shown the job over (or not listed it),
    the ranks' exits awaited up to ``exit_wait_s`` of it."""
    ranks = _Ranks(exits or {}, frozenset(excluded_ranks), world, ended_for < exit_wait_s)
    if state in TERMINAL_JOB_STATES:
        return SlurmJobDecision(state, "")
    found = slurm.id if slurm is not None and slurm.id != slurm_job_id else None
    sid = slurm.id if slurm is not None else slurm_job_id
    if state == JobState.STOPPING:
        return _stopping(slurm, sid, found, since=since, now=now, grace_s=grace_s)
    if slurm is None:
        if slurm_job_id:
            return _vanished(state, slurm_job_id, ranks)
        if unusable:
            return SlurmJobDecision(
                JobState.FAILED,
                f"not submitted: {', '.join(unusable)} no longer HEALTHY and schedulable since placement",
            )
        if submit_error and now - created > start_timeout:
            return SlurmJobDecision(
                JobState.FAILED, f"not submitted to Slurm within {start_timeout:g}s; sbatch said: {submit_error}"
            )
        return SlurmJobDecision(state, "", action="submit")
    if slurm.state in SLURM_PENDING:
        why = f"Slurm job {slurm.id} {slurm.state}" + (f": {slurm.reason}" if slurm.reason else "")
        return SlurmJobDecision(state, why, slurm_job_id=found)
    if slurm.state in SLURM_ENDING:
        return SlurmJobDecision(state, "", slurm_job_id=found)
    if slurm.state in SLURM_RUNNING:
        if state == JobState.STARTING and now - since > start_timeout:
            seen = len({r for r in joined if 0 <= r < world})
            return SlurmJobDecision(
                JobState.FAILED,
                f"ranks did not rendezvous within {start_timeout:g} s of Slurm job {slurm.id} running on "
                f"{slurm.nodes}: {seen} of {world} ranks registered or reported a step; cancelled",
                action="cancel",
                slurm_job_id=found,
            )
        return _running(state, slurm, found, joined=joined, world=world)
    return _ended(state, slurm, found, ranks)


def _stopping(
    slurm: SlurmJob | None, sid: str | None, found: str | None, *, since: float, now: float, grace_s: float
) -> SlurmJobDecision:
    if slurm is None:
        gone = f"Slurm job {sid} is gone" if sid else "stopped before it was submitted to Slurm"
        return SlurmJobDecision(JobState.STOPPED, gone)
    if slurm.over:
        return SlurmJobDecision(
            JobState.STOPPED, f"Slurm job {slurm.id} ended {slurm.state} (exit {slurm.exit_code})", slurm_job_id=found
        )
    if slurm.state in SLURM_ENDING:
        return SlurmJobDecision(JobState.STOPPING, "", slurm_job_id=found)  # Slurm is ending it already
    if now - since >= grace_s:
        return SlurmJobDecision(JobState.STOPPING, "", action="kill", slurm_job_id=found)
    return SlurmJobDecision(JobState.STOPPING, "", action="term", slurm_job_id=found)


def _running(
    state: str, slurm: SlurmJob, found: str | None, *, joined: Collection[int], world: int
) -> SlurmJobDecision:
    seen = {r for r in joined if 0 <= r < world}
    if state == JobState.RUNNING or len(seen) >= world:
        return SlurmJobDecision(
            JobState.RUNNING,
            f"every rank rendezvoused: {world} ranks in Slurm job {slurm.id} on {slurm.nodes}",
            slurm_job_id=found,
        )
    return SlurmJobDecision(
        JobState.STARTING,
        f"Slurm job {slurm.id} {slurm.state} on {slurm.nodes}: {len(seen)} of {world} ranks joined",
        slurm_job_id=found,
    )


@dataclass(frozen=True)
class _Ranks:
    """What the ranks' supervisors said of their exits, and whether to wait for more."""

    exits: Mapping[int, int | None]
    excluded: frozenset[int]
    world: int
    waiting: bool  # Slurm's end is recent: a rank's exit may still be on its way

    @property
    def live(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.excluded]

    def said(self, ranks: Iterable[int]) -> str:
        return ", ".join(f"rank {r} {'running' if self.exits.get(r) is None else self.exits[r]}" for r in ranks)

    def verdict(self, state: str, said: str, found: str | None) -> SlurmJobDecision | None:
        """SUCCEEDED when the job was RUNNING and every rank it still counts (not excluded) exited
        0; unchanged while one of them has not reported and ``waiting``; else None (FAILED)."""
        live = self.live
        missing = [r for r in live if self.exits.get(r) is None]
        failed = [r for r in live if self.exits.get(r) not in (None, 0)]
        if state != JobState.RUNNING or not live or failed:
            return None
        if missing:
            return SlurmJobDecision(state, "", slurm_job_id=found) if self.waiting else None
        out = sorted(r for r in self.excluded if r < self.world)
        why = (
            f"ranks excluded by the plan: {self.said(out)}; the {len(live)} others" if out else f"all {len(live)} ranks"
        )
        return SlurmJobDecision(JobState.SUCCEEDED, f"{said}: {why} exited 0", slurm_job_id=found)


def _vanished(state: str, slurm_job_id: str, ranks: _Ranks) -> SlurmJobDecision:
    """Slurm no longer lists the job (past ``MinJobAge``, its end unseen): the ranks' exits decide."""
    said = f"Slurm job {slurm_job_id} is no longer listed by Slurm (its end was not seen)"
    if (d := ranks.verdict(state, said, None)) is not None:
        return d
    failed = [r for r in range(ranks.world) if ranks.exits.get(r)]
    return SlurmJobDecision(JobState.FAILED, said + (f"; {ranks.said(failed)}" if failed else ""))


def _ended(state: str, slurm: SlurmJob, found: str | None, ranks: _Ranks) -> SlurmJobDecision:
    said = f"Slurm job {slurm.id} {slurm.state} (exit {slurm.exit_code}" + (
        f", reason {slurm.reason})" if slurm.reason else ")"
    )
    if slurm.state == "COMPLETED":
        return SlurmJobDecision(JobState.SUCCEEDED, said, slurm_job_id=found)
    if slurm.state == "CANCELLED":
        return SlurmJobDecision(JobState.STOPPED, f"{said}: cancelled in Slurm", slurm_job_id=found)
    if (d := ranks.verdict(state, said, found)) is not None:
        return d  # an excluded rank's exit does not fail the job, nor a rejoined rank's first run
    failed = [r for r in range(ranks.world) if ranks.exits.get(r)]
    return SlurmJobDecision(JobState.FAILED, said + (f"; {ranks.said(failed)}" if failed else ""), slurm_job_id=found)

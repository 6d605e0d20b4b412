"""Emergency checkpoints on demand: who may ask, and what the job's events say.

``POST /v1/jobs/{id}/checkpoint`` (``pulse jobs checkpoint JOB``) asks every rank of a RUNNING job
to save at the next step boundary, the request SIGUSR2 makes of a rank: the orchestrator sends a
``checkpoint`` :class:`clusterpulse.wire.JobCommand` to each assigned node's agent, which signals
its ranks (agent/launcher.py), and records a ``checkpoint_requested`` job event (who asked, why,
which nodes; ``NOT DELIVERED`` and why when Redis failed the send: the caller gets a 503). Each rank that saved then reports ``event="checkpoint_written DIR"`` at that
step (:data:`clusterpulse.wire.CHECKPOINT_WRITTEN`); the orchestrator records one
``checkpoint_written`` job event per (job, step), at the first report, naming the step, the
directory and the rank. The later ranks' reports of the same step add nothing.

Pure: :func:`refusal` and :class:`WrittenLedger` take their inputs as arguments; the
orchestrator does the I/O (services/operator.py asks, services/ingest/loop.py observes, services/persist/outbox.py
stores).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from clusterpulse import wire
from clusterpulse.states import EventKind, JobState

REQUESTED = EventKind.CHECKPOINT_REQUESTED
WRITTEN = wire.CHECKPOINT_WRITTEN


class CheckpointRefused(Exception):
    """The job cannot take a checkpoint now; the message says its state and what is needed."""


class CheckpointUndelivered(Exception):
    """The request's commands did not reach Redis: nothing was sent, and its
    ``checkpoint_requested`` event says it was not delivered; the message names the request and
    says to ask again (a new request)."""


def refusal(job_id: str, state: str) -> str | None:
    """Why a job in ``state`` cannot be asked for a checkpoint, or None when it can: only running
    ranks save, and before RUNNING they may not yet catch SIGUSR2 (its default action kills)."""
    if state == JobState.RUNNING:
        return None
    return f"job {job_id!r} is {state}, not RUNNING: only a running job's ranks can save a checkpoint"


def requested_reason(*, actor: str, reason: str, nodes: Sequence[str], undelivered: str | None = None) -> str:
    """The ``checkpoint_requested`` event's reason: delivered, or (``undelivered``: why not) not."""
    why = f": {reason}" if reason else ""
    if undelivered is not None:
        return f"NOT DELIVERED ({undelivered}): asked by {actor}{why}; nothing was sent to {', '.join(nodes)}"
    return f"asked by {actor}{why}; SIGUSR2 to every rank on {', '.join(nodes)} (saved at the next step boundary)"


def written_path(event: str) -> str | None:
    """The directory a ``checkpoint_written DIR`` event names ("" when it names none), or None when
    the event is of another kind (of an event of several lines, the first's)."""
    kind, _, rest = event.strip().split("\n", 1)[0].partition(" ")  # the first line: the note comes first
    return rest.strip() if kind == WRITTEN else None


def written_key(step: int) -> str:
    """How a ``checkpoint_written`` event's reason starts: what makes it one per (job, step) in
    the database too (``services.db.record_event_once``)."""
    return f"step {step}:"


@dataclass(frozen=True)
class Written:
    """A checkpoint first reported written: the one ``checkpoint_written`` event of its step."""

    job: str
    step: int
    path: str
    rank: int
    node: str
    at: float

    @property
    def reason(self) -> str:
        where = self.path or "(the rank named no directory)"
        return (
            f"{written_key(self.step)} {where} written by rank {self.rank} on {self.node} "
            "(first report; every rank that saved reports this step)"
        )


class WrittenLedger:
    """The (job, step) checkpoints already recorded, the last ``keep`` steps of each job."""

    def __init__(self, *, keep: int = 256) -> None:
        self.keep = keep
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def observe(self, report: wire.TrainerReport, *, at: float) -> Written | None:
        """The event to record for this report: a :class:`Written` for the first report of a
        (job, step) checkpoint, None for any other report (another kind, or a later rank)."""
        if report.event is None or (path := written_path(report.event)) is None:
            return None
        steps = self._seen.setdefault(report.job, OrderedDict())
        if report.step in steps:
            return None
        steps[report.step] = None
        while len(steps) > self.keep:
            steps.popitem(last=False)
        return Written(report.job, report.step, path, report.rank, report.node, at)

    def forget(self, job: str) -> None:
        self._seen.pop(job, None)

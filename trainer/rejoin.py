"""A relaunched rank's side of being taken back by the live ranks.

The live ranks' side is :class:`trainer.follow.PlanFollower`: at the switch that counts on the
rank again, their root writes it an :class:`~trainer.follow.Invitation` (the plan, the salt that
names its groups, whose state to take, their step); where they hand over their state, their source
marks the admission (:meth:`PlanFollower.admit`). Here, on the relaunched rank: :func:`join` waits
for the invitation and makes the plan's groups with them (:func:`invitation` and :func:`accept`,
one poll each, for a rank that replays its loop meanwhile: :mod:`trainer.replay`); :func:`admitted`
waits for the admission; :func:`taken_back` is the whole of it on a rank's
:class:`~trainer.resilience.Resilience`, ending with their state.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import msgspec
from torch.distributed import DistError

from clusterpulse import wire
from trainer.follow import Invitation, JobFinished, PlanFollower, RecoveryError, admit_key, join_key, live_step_key

if TYPE_CHECKING:
    from trainer.resilience import Resilience

log = logging.getLogger("pulse.trainer.rejoin")


def taken_back(r: Resilience, *, joined: bool = False) -> None:
    """Wait for the live ranks' invitation and make their groups (done already when ``joined``:
    :mod:`trainer.replay`), then take their state when they admit the rank; it is alone in the
    world's collectives until its first boundary. Leaves with 0 when the job finished meanwhile."""
    follower = r.follower
    assert follower is not None and r.reroute is not None
    try:
        if not joined:
            join(follower, timeout_s=r.settings.recovery_timeout_s)
        admitted(follower, timeout_s=r.settings.recovery_timeout_s)
    except JobFinished as exc:
        abandon(r, exc)
    r._take_state(fresh=r.reroute.joined)
    r._entering = {r.rank}
    log.warning("event=rejoined job=%s rank=%d step=%d", r.settings.job_id, r.rank, r.engine.global_steps)
    r._settle()


def abandon(r: Resilience, exc: JobFinished) -> None:
    """Nothing left to rejoin: the rank leaves with 0."""
    log.warning("event=rejoin_abandoned job=%s rank=%d reason=%r", r.settings.job_id, r.rank, str(exc))
    r._leave("job_finished")


def join(follower: PlanFollower, *, timeout_s: float, poll_s: float = 0.05) -> wire.Plan:
    """Wait until the live ranks put in force a plan that counts on this rank again (the
    orchestrator publishes one once it has registered again), then make the plan's groups with
    them. The caller then takes :attr:`PlanFollower.source`'s state
    (``trainer.engine_state.take_state``), as every live rank does after a switch that brought ranks
    back. Raises :class:`RecoveryError` when no invitation came within ``timeout_s``,
    :class:`JobFinished` when the live ranks finished the job meanwhile (:meth:`PlanFollower.finish`)."""
    started = time.monotonic()
    while True:
        key = join_key(follower.job, follower.reroute.rank)
        _await(follower, key, started=started, timeout_s=timeout_s, poll_s=poll_s, what="take it back")
        found = invitation(follower)
        if found is not None and accept(follower, found, started=started):
            return found.plan


def invitation(follower: PlanFollower) -> Invitation | None:
    """The live ranks' invitation to this rank, taken from the store; None when there is none yet.
    Raises :class:`JobFinished` as :func:`join` does."""
    store, key = follower.reroute.store, join_key(follower.job, follower.reroute.rank)
    if not _invited(follower, key):
        return None
    found = msgspec.json.decode(store.get(key), type=Invitation)
    store.delete_key(key)
    return found


def accept(follower: PlanFollower, found: Invitation, *, started: float) -> bool:
    """Make the invitation's groups with the live ranks; False when they gave up on this attempt
    (they invite again)."""
    reroute = follower.reroute
    try:
        reroute.switch(found.plan, salt=found.salt)
    except RuntimeError as exc:
        log.warning(
            "event=rejoin_attempt_failed job=%s rank=%d generation=%d error=%r",
            follower.job, reroute.rank, found.plan.generation, str(exc)[:300],
        )  # fmt: skip
        reroute.reset()
        return False
    reroute.joined = found.back  # as its peers have it: PlanGroups.source
    follower.source = found.source
    follower.switches += 1
    log.warning(
        "event=rejoined job=%s rank=%d generation=%d role=%s after_s=%.2f",
        follower.job, reroute.rank, found.plan.generation, reroute.role, time.monotonic() - started,
    )  # fmt: skip
    return True


def admitted(follower: PlanFollower, *, timeout_s: float) -> None:
    """After :func:`join`: wait (a short poll) for the live ranks to :meth:`PlanFollower.admit` it."""
    key = admit_key(follower.job, follower.reroute.salt)
    _await(follower, key, started=time.monotonic(), timeout_s=timeout_s, poll_s=0.005, what="admit it")


def live_step(follower: PlanFollower) -> int | None:
    """The live ranks' step as their source published it at their last boundary (while ranks are
    left out: :meth:`PlanFollower.boundary`), or None."""
    store, key = follower.reroute.store, live_step_key(follower.job)
    return int(store.get(key)) if store.check([key]) else None


def _await(follower: PlanFollower, key: str, *, started: float, timeout_s: float, poll_s: float, what: str) -> None:
    while not _invited(follower, key):
        if time.monotonic() - started > timeout_s:
            raise RecoveryError(f"rank {follower.reroute.rank}: the live ranks did not {what} in {timeout_s:g}s")
        time.sleep(poll_s)


def _invited(follower: PlanFollower, key: str) -> bool:
    store, job = follower.reroute.store, follower.job
    try:
        if store.check([wire.job_done_store_key(job)]):
            raise JobFinished(f"job {job} finished before rank {follower.reroute.rank} could rejoin it")
        return store.check([key])
    except DistError as exc:
        # The store outlives every rank but the job (agent/job_store.py), or it lives in rank 0:
        # gone means the job is over, one way or the other (the job's state says which).
        raise JobFinished(f"job {job}: its store is gone ({exc}); nothing left to rejoin") from exc

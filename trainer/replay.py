"""A rank relaunched under a loop that counts its own steps replays it up to the live ranks' step.

Accelerate's own loop and Lightning count their steps where the library cannot reach them (a
variable of the script, the loop's progress). A rank relaunched there starts its loop from the top
while the live ranks are at step N; taken back at once, its log lines, checkpoints and the
collectives they run would fall on other steps than theirs. So it replays (:class:`Replay`): the
loop runs from the top with each forward under ``torch.no_grad``, no backward, no update and no
collective with the live ranks; each optimizer step counts on the engine as one skipped
(:func:`trainer.engine_state.skip_step`), its world-group collectives run alone, and its
checkpoints are not written (they would overwrite the live ranks' of the same step). Its data
loader, its learning-rate scheduler's calls and the loop's counters advance as they did on the
rank that died.

At each step it asks what to do next (:func:`move`): replay while it is behind the step the live
ranks' source publishes while ranks are left out (:func:`trainer.rejoin.live_step`); at that step it
registers, which makes the orchestrator count on it again, and waits there (the live step moves on,
and it replays up to it) until the live ranks invite it. It then makes their groups, replays to the
step the invitation names and, at its next forward, takes their state as a rank relaunched under
the Hugging Face Trainer does (:func:`trainer.rejoin.taken_back`).

What it costs: a forward per step of the live ranks' run so far, plus the data loading, on the
relaunched rank alone; the live ranks wait for it only to make the groups and hand over the state,
as for any rank taken back. A relaunched rank 0 prints its replay's log lines again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from trainer import rejoin
from trainer.engine_state import skip_step
from trainer.follow import JobFinished, RecoveryError

if TYPE_CHECKING:
    from trainer.resilience import Resilience

log = logging.getLogger("pulse.trainer.replay")

Move = Literal["replay", "wait", "take_state"]


def move(step: int, *, live: int | None, invited_at: int | None) -> Move:
    """What a replaying rank at ``step`` does before its next step: ``take_state`` at the step its
    invitation names (``invited_at``), ``replay`` while behind it or behind the live ranks'
    published step (``live``), else ``wait`` (registered) for the live ranks to step or invite it."""
    if invited_at is not None:
        return "take_state" if step >= invited_at else "replay"
    if live is not None and step < live:
        return "replay"
    return "wait"


class Replay:
    """The replay of one relaunched rank (module docstring): its :class:`Resilience`'s ``replay``
    until it is taken back, None from then on."""

    def __init__(self, r: Resilience, *, register: Callable[[], None], poll_s: float = 0.05) -> None:
        self.r = r
        self.register = register
        self.poll_s = poll_s
        self.invited_at: int | None = None
        self.registered_at: float | None = None
        self.replayed = 0
        self._in_window = False
        engine = r.engine
        save = engine.save_checkpoint
        engine.save_checkpoint = functools.wraps(save)(lambda *a, **k: None if r.replay is self else save(*a, **k))

    def replays(self) -> bool:
        """At each forward while replaying: whether this one is replayed (under ``torch.no_grad``,
        by the caller). At a window's first forward, what :func:`move` says: at ``take_state`` the
        rank is taken back now (the replay is over) and this forward is a real one."""
        if not self._in_window and self._next() == "take_state":
            self.r.replay = None
            log.warning("event=replayed job=%s rank=%d steps=%d", self.r.settings.job_id, self.r.rank, self.replayed)
            rejoin.taken_back(self.r, joined=True)
            return False
        self._in_window = True
        return True

    def step(self, *, boundary: bool) -> None:
        """The engine's step while replaying: no update; a boundary counts as a skipped step."""
        engine = self.r.engine
        engine.micro_steps += 1  # DeepSpeed's accumulation window, as a real step moves it
        if boundary:
            skip_step(engine)
            self.replayed += 1
            self._in_window = False

    def _next(self) -> Move:
        follower, engine = self.r.follower, self.r.engine
        assert follower is not None
        started = time.monotonic()
        while True:
            if self.invited_at is None:
                try:
                    invitation = rejoin.invitation(follower)
                except JobFinished as exc:
                    rejoin.abandon(self.r, exc)
                if invitation is not None and rejoin.accept(follower, invitation, started=started):
                    self.invited_at = invitation.step
            step = int(engine.global_steps)
            if self.invited_at is not None and step > self.invited_at:
                raise RecoveryError(
                    f"rank {self.r.rank} replayed to step {step}, past the live ranks' {self.invited_at}"
                )
            what = move(step, live=rejoin.live_step(follower), invited_at=self.invited_at)
            if what != "wait":
                return what
            if self.registered_at is None:
                self.registered_at = time.monotonic()
                log.warning("event=replay_caught_up job=%s rank=%d step=%d", self.r.settings.job_id, self.r.rank, step)
                self.register()
            timeout_s = self.r.settings.recovery_timeout_s
            if time.monotonic() - self.registered_at > timeout_s:
                raise RecoveryError(f"rank {self.r.rank}: the live ranks did not take it back in {timeout_s:g}s")
            time.sleep(self.poll_s)

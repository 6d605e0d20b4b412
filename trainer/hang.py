"""A hung peer costs seconds, not the collective timeout: each rank watches two neighbours' beats.

Every live rank's own thread writes its liveness beat into the job's store (:class:`Beat`); a
process that is stopped (SIGSTOP, a frozen machine) stops beating, one that is merely slow beats
on. On each beat, :class:`HangWatch` also reads the beats of the rank's two neighbours in the
ring of the plan's participants (:func:`watched`: every participant is watched by two others, and
each rank reads two keys, whatever the size of the job). A neighbour whose beat has stood still
``PULSE_HANG_SILENCE_S`` is hung; so is a participant a newer plan excludes while this rank
cannot reach a step boundary (the orchestrator excludes a rank whose agent saw its process
stopped, ``agent/hung.py``, sooner than the silence). Either way the watch cuts the connections
of the plan's groups (:meth:`trainer.groups.PlanGroups.cut`), so the collective the training
thread is blocked in fails now, as after a dead peer, and the survivors' recovery reports the
silent rank (with the watch's evidence, so at once) and switches to the plan that excludes it. A
rank whose beat moves is never cut off, however slow its steps. Why, and what it costs:
docs/design/hang.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta

from torch._C._distributed_c10d import Store, TCPStore  # torch.distributed re-exports them untyped

from clusterpulse.wire import Plan
from trainer.groups import PlanGroups

log = logging.getLogger("pulse.trainer")

# The beats of some ranks: rank -> the wall time it last beat, None if it never did (Beat.read)
Read = Callable[[Collection[int]], dict[int, float | None]]


def watched(participants: Sequence[int], rank: int) -> list[int]:
    """The participants ``rank`` watches: the one before it and the one after it in the ring of
    ``participants`` (ascending); one with two participants, none when ``rank`` is alone or not
    one of them."""
    ring = sorted(participants)
    if rank not in ring or len(ring) < 2:
        return []
    i = ring.index(rank)
    return sorted({ring[i - 1], ring[(i + 1) % len(ring)]})


def silent_ranks(
    missing: list[int],
    beats: dict[int, tuple[float | None, float]],
    read: Read,
    *,
    beat_s: float,
    now: float,
    wall: float,
    silent_beats: float = 4.0,
) -> list[int]:
    """The ``missing`` ranks whose liveness beat stands still, updating ``beats`` (rank -> (the
    beat last read, the monotonic ``now`` it was first read at)) with ``read(ranks)`` (each rank's
    wall time it last beat, None if it never did).

    Silent: the beat has not moved here for ``silent_beats * beat_s`` (4 by default,
    ``PULSE_SILENT_BEATS``); or for ``1.5 * beat_s`` when it is also ``silent_beats * beat_s`` old
    by ``wall`` (this rank's clock). The second only shortens the wait for
    a beat that has long stood still; a live peer's beat moves every ``beat_s``, so a clock that
    runs behind never makes it silent."""
    observe_beats(missing, beats, read, now)
    out = []
    for r in missing:
        last, since = beats[r]
        still = now - since
        old = last is not None and wall - last >= silent_beats * beat_s
        if still >= silent_beats * beat_s or (old and still >= 1.5 * beat_s):
            out.append(r)
    return out


def observe_beats(
    ranks: Collection[int],
    beats: dict[int, tuple[float | None, float]],
    read: Read,
    now: float,
) -> None:
    """Read ``ranks``' beats (in one call); ``beats`` keeps (the value, the ``now`` it was first read at)."""
    for r, last in read(ranks).items():
        if r not in beats or beats[r][0] != last:
            beats[r] = (last, now)


class HangWatch:
    """One rank's watch (module docstring); :meth:`check` runs on the beat thread after each beat,
    :meth:`plan_check` on the plan thread when a plan arrives. :attr:`beats` is the evidence
    (rank -> (its beat last read, when that was first seen)) a recovery starts from.

    Two reasons to cut the groups in force, once per set of groups: a watched neighbour's beat
    stood still ``silence_s`` (by this rank's own clock: a peer's clock is never compared with
    it); or a plan newer than the one in force (``latest``) excludes one of its participants
    while the training thread is stalled (``stalled(now)``: no step boundary for longer than
    a step takes, so it cannot switch to that plan at a boundary: it waits in a collective on
    the excluded rank, which the orchestrator excluded from its agent's word that the rank's
    process is stopped)."""

    def __init__(
        self,
        *,
        job: str,
        groups: PlanGroups,
        read: Read,
        silence_s: float,
        latest: Callable[[], Plan | None] = lambda: None,
        stalled: Callable[[float], bool] = lambda now: False,
        keep_ports: Collection[int] = (),
    ) -> None:
        self.job = job
        self.groups = groups
        self.read = read
        self.silence_s = silence_s
        self.latest = latest
        self.stalled = stalled
        self.keep_ports = frozenset(keep_ports)
        self.beats: dict[int, tuple[float | None, float]] = {}
        self.cuts = 0  # times this rank cut its groups
        self._lock = threading.Lock()  # two threads check; a recovery copies the beats
        self._cut_salt: str | None = None  # the groups last cut: once per set of groups
        self._salt: str | None = None  # the groups the evidence was gathered under

    def evidence(self) -> dict[int, tuple[float | None, float]]:
        """A copy of :attr:`beats`, for a recovery's survey to start from."""
        with self._lock:
            return dict(self.beats)

    def check(self, *, now: float | None = None) -> list[int]:
        """Read the neighbours' beats; cut the plan's groups when one stood still ``silence_s``, or
        for :meth:`plan_check`'s reason. Returns the silent neighbours."""
        route = self.groups.route
        if route is None:
            return []
        now = time.monotonic() if now is None else now
        peers = watched(route.participants, self.groups.rank)
        with self._lock:
            if self.groups.salt != self._salt:  # new groups: a rank may be back as a new process
                self.beats.clear()  # whose first beat is not written yet: its old one must not count
                self._salt = self.groups.salt
            observe_beats(peers, self.beats, self.read, now)
            # still for silence_s by this rank's clock; one that never beat is still starting
            silent = [r for r in peers if self.beats[r][0] is not None and now - self.beats[r][1] >= self.silence_s]
            if silent:
                self._cut(f"silent={silent} still_s={now - self.beats[silent[0]][1]:.2f}")
            else:
                self._plan_cut(now)
        return silent

    def plan_check(self, now: float | None = None) -> None:
        """A plan arrived: cut the plan's groups when it excludes a participant of the plan in force
        and the training thread is stalled (class docstring)."""
        with self._lock:
            self._plan_cut(time.monotonic() if now is None else now)

    def _plan_cut(self, now: float) -> None:
        route, latest = self.groups.route, self.latest()
        if route is None or latest is None or latest.generation <= route.generation:
            return
        gone = sorted(set(latest.excluded) & set(route.participants))
        if gone and self.stalled(now):
            self._cut(f"excluded={gone} by_generation={latest.generation}")

    def _cut(self, why: str) -> None:
        groups = self.groups
        route, salt = groups.route, groups.salt
        if route is None or salt == self._cut_salt:
            return
        self._cut_salt = salt
        cut = groups.cut(keep_ports=self.keep_ports)
        self.cuts += 1
        log.warning(
            "event=peer_hung job=%s rank=%d generation=%d %s connections_cut=%d",
            self.job, groups.rank, route.generation, why, cut,
        )  # fmt: skip


class Beat:
    """The rank's liveness beat: its wall-clock time written into ``pulse/<job>/beat/<rank>`` in the
    job's store every ``beat_s``, then, with ``watch``, :meth:`HangWatch.check`. A thread of its
    own, so it goes on while the training thread waits in a collective and stops only when the
    whole process does; and a store connection of its own where the store is a TCPStore, because
    the client serialises its requests and the training thread's blocking ones (a group's
    rendezvous waits for its peers' keys) would hold the beat for as long. :meth:`read` is what
    a recovery's survey reads (docs/design/follow.md)."""

    def __init__(
        self,
        *,
        job: str,
        groups: PlanGroups,
        store: Store,
        beat_s: float,
        silence_s: float,
        watch: bool = True,
        latest: Callable[[], Plan | None] = lambda: None,
        stalled: Callable[[float], bool] = lambda now: False,
        keep_ports: Collection[int] = (),
    ) -> None:
        self.job = job
        self.rank = groups.rank
        self.beat_s = beat_s
        self.store = own_connection(store, timeout_s=max(2.0, 4 * beat_s))
        self.watch: HangWatch | None = None
        if watch:
            keep = {*keep_ports, *([store.port] if isinstance(store, TCPStore) else [])}
            self.watch = HangWatch(
                job=job, groups=groups, read=self.read, silence_s=silence_s, latest=latest,
                stalled=stalled, keep_ports=keep,
            )  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"pulse-beat-{self.rank}", daemon=True)
        self._thread.start()

    def read(self, ranks: Collection[int]) -> dict[int, float | None]:
        """The wall time each of ``ranks`` last beat (None: it never did). Two requests to the store
        when every one has beaten (the usual case: a beat a rank, each reading its two
        neighbours), two a rank otherwise (``get`` would wait for a key that is not there)."""
        order = list(ranks)
        keys = [beat_key(self.job, r) for r in order]
        if keys and self.store.check(keys):
            return {r: float(v) for r, v in zip(order, self.store.multi_get(keys), strict=True)}
        return {
            r: float(self.store.get(k)) if self.store.check([k]) else None for r, k in zip(order, keys, strict=True)
        }

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        key = beat_key(self.job, self.rank)
        while True:  # the first beat at once: a rank back as a new process shows it is alive
            try:
                self.store.set(key, f"{time.time():.3f}")
                if self.watch is not None:
                    self.watch.check()
            except Exception as exc:  # the store's host gone or slow: recovery falls back on its survey
                log.debug("event=beat_failed job=%s rank=%d error=%r", self.job, self.rank, str(exc))
            if self._stop.wait(self.beat_s):
                return


def own_connection(store: Store, *, timeout_s: float) -> Store:
    """A client of its own to ``store`` when it is a TCPStore (``store`` itself otherwise, or when
    that connection cannot be made)."""
    if not isinstance(store, TCPStore):
        return store
    try:
        return TCPStore(
            store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except Exception as exc:  # the beat then shares the training thread's client, as before
        log.warning("event=beat_connection_shared host=%s port=%d error=%r", store.host, store.port, str(exc))
        return store


def beat_key(job: str, rank: int) -> str:
    return f"pulse/{job}/beat/{rank}"

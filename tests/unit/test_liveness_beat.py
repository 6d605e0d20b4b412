"""Which ranks a rank calls silent from their liveness beat (trainer/hang.py: silent_ranks)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped
from torch.distributed import DistStoreError, HashStore

from trainer.hang import Beat, beat_key, silent_ranks

BEAT_S = 0.2


def _poll(
    beats_at: dict[int, float | None], beats: dict[int, tuple[float | None, float]], *, now: float, wall: float
) -> list[int]:
    return silent_ranks(
        list(beats_at), beats, lambda ranks: {r: beats_at.get(r) for r in ranks}, beat_s=BEAT_S, now=now, wall=wall
    )


def test_a_beat_that_stood_still_long_before_is_silent_after_one_and_a_half_beats() -> None:
    # rank 3 last beat 2 s ago (the collective timed out on it); rank 1 never beat at all
    beats: dict[int, tuple[float | None, float]] = {}
    seen = {3: 998.0, 1: None}
    assert _poll(seen, beats, now=10.0, wall=1000.0) == []
    assert _poll(seen, beats, now=10.2, wall=1000.2) == []  # one beat: not yet
    assert _poll(seen, beats, now=10.3, wall=1000.3) == [3]  # 1.5 beats, and 2.3 s old by our clock
    assert _poll(seen, beats, now=10.8, wall=1000.8) == [3, 1]  # never beat: the full 4 beats


def test_a_fresh_beat_that_stops_takes_four_beats() -> None:
    beats: dict[int, tuple[float | None, float]] = {}
    seen: dict[int, float | None] = {2: 999.95}  # it beat 50 ms ago, then died
    assert _poll(seen, beats, now=10.0, wall=1000.0) == []
    assert _poll(seen, beats, now=10.5, wall=1000.5) == []  # 1.5 beats still, but only 0.55 s old
    assert _poll(seen, beats, now=10.8, wall=1000.8) == [2]


def test_a_live_peer_whose_clock_runs_behind_is_never_silent() -> None:
    """Its beats say 5 s ago (its clock is 5 s behind ours), but they move every beat."""
    beats: dict[int, tuple[float | None, float]] = {}
    now, wall = 10.0, 1000.0
    for i in range(40):  # 8 s of polls every 0.2 s, the peer beating every 0.2 s
        assert _poll({1: wall - 5.0 + 0.001 * i}, beats, now=now, wall=wall) == []
        now, wall = now + BEAT_S, wall + BEAT_S


def test_the_beat_goes_on_while_the_training_thread_waits_in_the_store() -> None:
    """The training thread's client blocks in a key wait (a group's rendezvous does): the beat has a
    connection of its own and keeps beating (a shared client held it for the whole wait)."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    shared = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=3), wait_for_workers=False)
    groups = cast(Any, SimpleNamespace(rank=1, route=None, salt=""))  # what Beat reads of PlanGroups
    beat = Beat(job="j", groups=groups, store=shared, beat_s=0.05, silence_s=0.2)
    waiting = threading.Thread(target=_wait_for_a_key_never_set, args=(shared,))
    try:
        waiting.start()
        time.sleep(0.3)  # the shared client is now blocked in its get
        seen = set()
        for _ in range(10):
            seen.add(master.get(beat_key("j", 1)))
            time.sleep(0.1)
        assert waiting.is_alive()  # still blocked while we looked
        assert len(seen) >= 5, seen
    finally:
        beat.close()
        waiting.join(5)


def _wait_for_a_key_never_set(store: TCPStore) -> None:
    with contextlib.suppress(DistStoreError):  # its 3 s timeout
        store.get("never-set")


class _Counted:
    """A store whose requests are counted, by kind."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        self.calls[name] += 1
        return getattr(self.store, name)


def test_reading_beats_takes_two_requests_when_every_rank_has_beaten() -> None:
    """Each rank reads its two neighbours every beat: a check and a multi_get, not a check and a
    get for each; a rank that never beat reads as None (a get would wait for its key)."""
    store = HashStore()
    groups = cast(Any, SimpleNamespace(rank=0, route=None, salt=""))
    beat = Beat(job="j", groups=groups, store=store, beat_s=60.0, silence_s=0.2, watch=False)
    beat.close()
    store.set(beat_key("j", 1), "100.5")
    store.set(beat_key("j", 3), "101.25")
    counted = _Counted(store)
    beat.store = cast(Any, counted)
    assert beat.read([1, 3]) == {1: 100.5, 3: 101.25}
    assert counted.calls == {"check": 1, "multi_get": 1}
    assert beat.read([1, 2]) == {1: 100.5, 2: None}

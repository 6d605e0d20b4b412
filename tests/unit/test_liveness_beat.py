"""Which missing ranks a survivor calls silent from their liveness beat (trainer/follow.py)."""

from __future__ import annotations

from trainer.follow import silent_ranks

BEAT_S = 0.2


def _poll(
    beats_at: dict[int, float | None], beats: dict[int, tuple[float | None, float]], *, now: float, wall: float
) -> list[int]:
    return silent_ranks(list(beats_at), beats, beats_at.get, beat_s=BEAT_S, now=now, wall=wall)


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

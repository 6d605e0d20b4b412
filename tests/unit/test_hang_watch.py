"""A rank watches its two neighbours' beats and cuts its groups once when one stands still (trainer/hang.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from clusterpulse.wire import Plan
from trainer.hang import HangWatch, watched
from trainer.route import Route, parse_plan

BEAT_S = 0.25
SILENCE_S = 1.0  # four beats


@pytest.mark.parametrize(
    ("participants", "rank", "expected"),
    [
        ([0, 1, 2, 3], 0, [1, 3]),
        ([0, 1, 2, 3], 2, [1, 3]),
        ([0, 1, 2, 3], 3, [0, 2]),
        ([0, 5], 5, [0]),
        ([0, 1, 3], 2, []),  # not a participant (degraded or excluded): its carrier's timeout covers it
        ([4], 4, []),
    ],
)
def test_each_participant_watches_the_one_before_and_the_one_after_it_in_the_ring(
    participants: list[int], rank: int, expected: list[int]
) -> None:
    assert watched(participants, rank) == expected


def test_every_participant_is_watched_by_two_others() -> None:
    ring = list(range(9))
    watchers = {r: [w for w in ring if r in watched(ring, w)] for r in ring}
    assert all(len(w) == 2 for w in watchers.values()), watchers


@dataclass
class Groups:
    """What HangWatch uses of trainer.groups.PlanGroups: the plan in force, its salt, cut()."""

    rank: int
    route: Route | None
    salt: str = "job/s1"
    cuts: list[frozenset[int]] = field(default_factory=list)

    def cut(self, *, keep_ports: frozenset[int] = frozenset()) -> int:
        self.cuts.append(frozenset(keep_ports))
        return 3


def _route(participants: list[int], excluded: list[int] | None = None) -> Route:
    plan = Plan(job="j", generation=1, participants=participants, proxies={}, excluded=excluded or [])
    return parse_plan(plan, len(participants) + len(excluded or []))


def _watch(groups: Groups, beats: dict[int, float | None], **kw: Any) -> HangWatch:
    return HangWatch(
        job="j",
        groups=cast(Any, groups),  # the part of PlanGroups the watch uses
        read=lambda ranks: {r: beats.get(r) for r in ranks},
        silence_s=SILENCE_S,
        keep_ports=(6379,),
        **kw,
    )


def test_a_neighbour_whose_beat_stands_still_four_beats_is_cut_off_once() -> None:
    groups = Groups(rank=1, route=_route([0, 1, 2, 3]))
    beats: dict[int, float | None] = {0: 100.0, 2: 100.0}
    watch = _watch(groups, beats)
    now, wall = 10.0, 100.0
    assert watch.check(now=now) == []  # both seen; rank 2's beat stops here
    for _ in range(3):  # rank 0 beats on
        now, wall = now + BEAT_S, wall + BEAT_S
        beats[0] = wall
        assert watch.check(now=now) == []
    now, wall = now + BEAT_S, wall + BEAT_S
    beats[0] = wall
    assert watch.check(now=now) == [2]  # still for the whole silence, four beats
    assert groups.cuts == [frozenset({6379})]
    assert watch.check(now=now + BEAT_S) == [2]
    assert len(groups.cuts) == 1  # the same groups are cut once
    groups.salt = "job/s2"  # a recovery made new groups, and rank 2 is still a participant
    assert watch.check(now=now + 2 * BEAT_S) == []  # the evidence starts anew with the groups
    beats[0] = wall + SILENCE_S  # rank 0 beats on
    assert watch.check(now=now + 2 * BEAT_S + SILENCE_S) == [2]
    assert len(groups.cuts) == 2
    assert watch.cuts == 2


def test_a_slow_neighbour_that_beats_on_is_never_cut_off() -> None:
    groups = Groups(rank=0, route=_route([0, 1, 2]))
    beats: dict[int, float | None] = {1: 0.0, 2: 0.0}
    watch = _watch(groups, beats)
    now = 0.0
    for i in range(200):  # 50 s of beats that keep moving (a straggler's step is slow, its beat is not)
        now += BEAT_S
        beats[1] = beats[2] = now + 0.001 * i
        assert watch.check(now=now) == []
    assert groups.cuts == []


def test_a_neighbour_stopped_half_a_second_is_not_cut_off() -> None:
    groups = Groups(rank=0, route=_route([0, 1]))
    beats: dict[int, float | None] = {1: 0.0}
    watch = _watch(groups, beats)
    now = 0.0
    for i in range(40):
        now += BEAT_S
        if not 4 <= i < 6:  # two beats (0.5 s) missing
            beats[1] = now
        assert watch.check(now=now) == []
    assert groups.cuts == []


def test_no_cut_for_a_rank_that_never_beat_or_without_a_plan() -> None:
    groups = Groups(rank=0, route=_route([0, 1]))
    watch = _watch(groups, {1: None})  # still starting: its beat thread has not written yet
    assert [watch.check(now=float(t)) for t in range(10)] == [[]] * 10
    assert groups.cuts == []
    idle = Groups(rank=0, route=None)  # between a reset and the next switch: nothing to cut
    assert _watch(idle, {1: 0.0}).check(now=100.0) == []


def test_the_evidence_is_a_copy_a_recovery_starts_from() -> None:
    groups = Groups(rank=1, route=_route([0, 1, 2]))
    beats: dict[int, float | None] = {0: 5.0, 2: 5.0}
    watch = _watch(groups, beats)
    watch.check(now=1.0)
    seen = watch.evidence()
    assert seen == {0: (5.0, 1.0), 2: (5.0, 1.0)}
    seen[0] = (9.0, 9.0)
    assert watch.beats[0] == (5.0, 1.0)


def test_a_beat_long_old_by_our_clock_still_has_to_stand_still_the_whole_silence() -> None:
    """A peer whose clock runs 10 s behind looks long silent by wall time; only its standing still
    counts, so a half-second stop is not taken for a hang."""
    groups = Groups(rank=0, route=_route([0, 1]))
    beats: dict[int, float | None] = {1: -10.0}
    watch = _watch(groups, beats)
    assert watch.check(now=0.0) == []
    assert watch.check(now=0.5) == []  # stopped half a second
    beats[1] = -9.25
    assert watch.check(now=0.75) == []
    assert groups.cuts == []


def _stalled_after(s: float) -> Any:
    return lambda now: now >= s


def test_a_newer_plan_excluding_a_participant_cuts_only_a_stalled_rank() -> None:
    """The orchestrator excluded rank 2 (its agent saw it stopped): a rank that reaches its next
    boundary switches there; one stalled in a collective on rank 2 cuts its groups."""
    groups = Groups(rank=0, route=_route([0, 1, 2]))
    newer = Plan(job="j", generation=2, participants=[0, 1], proxies={}, excluded=[2])
    watch = _watch(groups, {1: 0.0, 2: 0.0}, latest=lambda: newer, stalled=_stalled_after(5.0))
    watch.plan_check(now=1.0)
    assert groups.cuts == []  # not stalled yet: the boundary will put the plan in force
    watch.plan_check(now=5.0)
    assert len(groups.cuts) == 1
    watch.plan_check(now=6.0)
    assert len(groups.cuts) == 1  # once per set of groups


def test_a_newer_plan_that_excludes_no_participant_cuts_nothing() -> None:
    groups = Groups(rank=0, route=_route([0, 1], excluded=[2]))
    same = Plan(job="j", generation=2, participants=[0, 1], proxies={}, excluded=[2])
    older = Plan(job="j", generation=1, participants=[0], proxies={}, excluded=[1, 2])
    for latest in (same, older):
        watch = _watch(groups, {1: 0.0}, latest=lambda p=latest: p, stalled=_stalled_after(0.0))
        watch.plan_check(now=10.0)
    assert groups.cuts == []


def test_a_rank_back_as_a_new_process_gets_the_whole_silence_anew() -> None:
    """Rank 1 died (its last beat stands), was excluded, and is back under new groups: its new
    process has not beaten yet. The old beat's standing still must not count."""
    groups = Groups(rank=0, route=_route([0, 1]))
    beats: dict[int, float | None] = {1: 5.0}
    watch = _watch(groups, beats)
    assert watch.check(now=10.0) == []
    groups.route, groups.salt = _route([0], excluded=[1]), "job/s2"  # excluded: not watched
    assert watch.check(now=11.0) == []
    groups.route, groups.salt = _route([0, 1]), "job/s3"  # back, 20 s after its old beat
    assert watch.check(now=30.0) == []
    assert watch.check(now=30.0 + SILENCE_S / 2) == []
    beats[1] = 31.0  # its first beat
    assert watch.check(now=30.0 + SILENCE_S + 0.1) == []
    assert groups.cuts == []

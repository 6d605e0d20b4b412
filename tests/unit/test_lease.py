"""The pure part of leader election (services/leader.py): the decision on a lease as read, the
deadline a leader trusts its lease until, holder ids, the fencing scripts' arguments, settings;
and a model of many replicas pausing at random that never has two leaders at once."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from clusterpulse import wire
from clusterpulse.settings import load_settings
from services.db import LeaseState
from services.leader import (
    Acquire,
    Follow,
    Renew,
    commands_args,
    decide,
    default_replica_id,
    lead_deadline,
    local_pid,
    plans_args,
)


def lease(holder: str = "a", epoch: int = 3, expires_at: float = 110.0, db_now: float = 100.0) -> LeaseState:
    return LeaseState(holder=holder, epoch=epoch, expires_at=expires_at, db_now=db_now)


def test_the_leader_renews_while_the_row_is_still_its_own() -> None:
    assert decide(lease(), me="a", leading_epoch=3, holder_dead=False) == Renew(3)
    # even past expiry on the database's clock: the conditional UPDATE says whether it still may
    assert decide(lease(expires_at=90.0), me="a", leading_epoch=3, holder_dead=False) == Renew(3)


@pytest.mark.parametrize("row", [lease(holder="b", epoch=4), lease(holder="a", epoch=4), lease(holder="b", epoch=3)])
def test_a_leader_whose_row_changed_follows(row: LeaseState) -> None:
    d = decide(row, me="a", leading_epoch=3, holder_dead=False)
    assert isinstance(d, Follow) and d.holder == row.holder and d.epoch == row.epoch
    assert f"epoch {row.epoch}" in d.reason


def test_a_leader_whose_renewal_came_late_keeps_its_epoch_while_the_row_is_unchanged() -> None:
    """Its own deadline passed (the renewal waited on a busy SQLite) and even the row's expiry:
    nobody took the lease meanwhile, so it renews the same epoch instead of re-taking it under a
    new one (which would make it drop and reload its whole state)."""
    assert decide(lease(expires_at=80.0), me="a", leading_epoch=3, holder_dead=False) == Renew(3)
    # the same replica id without an epoch of its own (a restarted process) takes it back anew
    assert isinstance(decide(lease(expires_at=80.0), me="a", leading_epoch=None, holder_dead=False), Acquire)


def test_a_follower_waits_for_a_live_unexpired_lease() -> None:
    d = decide(lease(holder="b"), me="a", leading_epoch=None, holder_dead=False)
    assert d == Follow("b", 3, "b leads at epoch 3 (10.0s left)")


@pytest.mark.parametrize(
    ("row", "dead", "reclaim", "words"),
    [
        (lease(holder="", epoch=0), False, "", "no replica has led yet"),
        (lease(holder="a"), False, "", "this replica id held epoch 3 before"),
        (lease(holder="b", expires_at=100.0), False, "", "ran out 0.0s ago"),  # expiry is inclusive
        (lease(holder="b", expires_at=95.5), False, "", "the lease of b (epoch 3) ran out 4.5s ago"),
        (lease(holder="host-7"), True, "host-7", "host-7 (epoch 3) no longer runs on this host"),
    ],
)
def test_a_follower_acquires(row: LeaseState, dead: bool, reclaim: str, words: str) -> None:
    d = decide(row, me="a", leading_epoch=None, holder_dead=dead)
    assert isinstance(d, Acquire)
    assert (d.seen_epoch, d.reclaim) == (row.epoch, reclaim)
    assert words in d.reason


def test_holder_ids_and_local_pids() -> None:
    assert default_replica_id("node-1", 42) == "node-1-42"
    assert local_pid("node-1-42", "node-1") == 42
    assert local_pid("node-1-42", "node-2") is None  # another host's process: never judged from here
    assert local_pid("orch-a", "orch") is None  # an explicit PULSE_REPLICA_ID
    assert local_pid("node-1", "node-1") is None
    assert local_pid("", "node-1") is None


def test_a_leader_stops_trusting_its_lease_a_margin_before_it_runs_out() -> None:
    assert lead_deadline(50.0, lease_s=15.0, margin_s=1.5) == 63.5
    assert lead_deadline(50.0, lease_s=15.0, margin_s=0.0) == 65.0


def test_fencing_script_arguments() -> None:
    keys, args = plans_args(7, [("j1", b"p1"), ("j2", b"p2")])
    assert keys == [wire.LEADER_KEY, wire.job_plan_key("j1"), wire.job_plan_key("j2")]
    assert args == [7, wire.PLAN_CHANNEL, b"p1", "j1", b"p2", "j2"]
    keys, args = commands_args(
        7,
        [(wire.node_commands_key("n1"), b"c1"), (wire.node_commands_key("n2"), b"c2")],
        maxlen=100,
        keep_s=120,
        max_age_s=86_400,
    )
    assert keys == [wire.LEADER_KEY, wire.node_commands_key("n1"), wire.node_commands_key("n2")]
    assert args == [7, 100, 120_000, 86_400_000, wire.COMMAND_FIELD, b"c1", b"c2"]


def test_settings_defaults_and_refusals() -> None:
    s = load_settings()
    assert (s.leader_lease_s, s.leader_renew, s.leader_margin) == (15.0, 5.0, 1.5)
    assert s.replica_id == ""
    small = load_settings(leader_lease_s=2, leader_renew_s=0.5, leader_margin_s=0.2, replica_id="orch-a")
    assert (small.leader_renew, small.leader_margin, small.replica_id) == (0.5, 0.2, "orch-a")
    with pytest.raises(ValidationError, match="leader_renew_s"):
        load_settings(leader_lease_s=2, leader_renew_s=1.9)


def test_no_two_replicas_ever_believe_they_lead_at_once() -> None:
    """A model of the protocol: replicas tick at random, pause for random spans (SIGSTOP, GC),
    each tick reads and conditionally updates the row atomically on the database's clock, and
    a replica believes it leads only until its own deadline. Over many schedules, at no instant
    do two replicas act as leader, and a live replica always ends up leading."""
    lease_s, renew_s, margin_s = 3.0, 1.0, 0.3
    for seed in range(300):
        rng = random.Random(seed)
        names = ["a", "b", "c"]
        row = LeaseState(holder="", epoch=0, expires_at=0.0, db_now=0.0)
        epoch: dict[str, int | None] = dict.fromkeys(names)
        deadline = dict.fromkeys(names, 0.0)
        beliefs: list[tuple[float, float, str]] = []  # (from, until, replica)
        next_tick = {n: rng.uniform(0, renew_s) for n in names}
        t = 0.0
        while t < 60.0:
            n = min(next_tick, key=lambda k: next_tick[k])
            t = next_tick[n]
            # the epoch it holds, even past its own deadline (a late renewal of an unchanged row)
            d = decide(
                LeaseState(row.holder, row.epoch, row.expires_at, t), me=n, leading_epoch=epoch[n], holder_dead=False
            )
            if isinstance(d, Renew):
                row = LeaseState(n, d.epoch, t + lease_s, t)
                deadline[n] = lead_deadline(t, lease_s=lease_s, margin_s=margin_s)
            elif isinstance(d, Acquire):
                row = LeaseState(n, row.epoch + 1, t + lease_s, t)
                epoch[n], deadline[n] = row.epoch, lead_deadline(t, lease_s=lease_s, margin_s=margin_s)
            else:
                epoch[n] = None
            if epoch[n] is not None:
                beliefs.append((t, deadline[n], n))
            pause = rng.expovariate(1 / 4.0) if rng.random() < 0.15 else 0.0
            next_tick[n] = t + renew_s + pause
        beliefs.sort()
        until = dict.fromkeys(names, 0.0)  # the latest deadline each replica believed so far
        for start, end, n in beliefs:
            others = {m: u for m, u in until.items() if m != n and u > start}
            assert not others, f"seed {seed}: {n} leads from {start:.2f} while {others} still believe they lead"
            until[n] = max(until[n], end)
        assert any(end > 55.0 for _, end, _ in beliefs), f"seed {seed}: nobody leads at the end"

"""When a job's store leaves without its keeper, and which stores a restarted agent ends
(agent/store_keeper.py): the pure decisions, time an argument."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.store_keeper import Watch, unowned, watch


def test_a_kept_store_stays_and_forgets_any_earlier_absence() -> None:
    assert watch(None, kept=True, now=100.0, grace_s=5.0) == Watch(None)
    assert watch(90.0, kept=True, now=100.0, grace_s=5.0) == Watch(None)  # a restarted agent adopted it


def test_a_store_leaves_once_its_keeper_has_been_gone_for_the_grace() -> None:
    first = watch(None, kept=False, now=100.0, grace_s=5.0)
    assert first == Watch(100.0, leave=False)
    assert watch(first.orphaned_since, kept=False, now=104.9, grace_s=5.0) == Watch(100.0, leave=False)
    assert watch(first.orphaned_since, kept=False, now=105.0, grace_s=5.0) == Watch(100.0, leave=True)


def test_a_keeper_back_within_the_grace_starts_the_count_again() -> None:
    w = watch(None, kept=False, now=0.0, grace_s=5.0)
    w = watch(w.orphaned_since, kept=True, now=4.0, grace_s=5.0)  # the agent restarted and adopted it
    w = watch(w.orphaned_since, kept=False, now=8.0, grace_s=5.0)  # ... and died again
    assert w == Watch(8.0, leave=False)
    assert watch(w.orphaned_since, kept=False, now=13.0, grace_s=5.0).leave


@given(
    looks=st.lists(st.tuples(st.floats(0, 10), st.booleans()), max_size=50),
    grace=st.floats(0.1, 20),
)
def test_a_store_never_leaves_before_its_keeper_was_gone_for_the_whole_grace(
    looks: list[tuple[float, bool]], grace: float
) -> None:
    now, since, last_kept = 0.0, None, 0.0
    for step, kept in looks:
        now += step
        w = watch(since, kept=kept, now=now, grace_s=grace)
        last_kept = now if kept else last_kept
        if w.leave:
            assert not kept and now - last_kept >= grace
            break
        since = w.orphaned_since


def test_a_restarted_agent_ends_the_stores_of_jobs_it_no_longer_runs() -> None:
    got = unowned(["running", "relaunched", "over"], running={"running"}, adopted={"relaunched"})
    assert list(got) == ["over"] and "no rank of the job runs on this node" in got["over"]
    assert unowned([], running={"a"}, adopted=set()) == {}
